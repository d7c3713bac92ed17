//! mpsr-keeper: started by the node agent, one per GPU (`CUDA_VISIBLE_DEVICES=<uuid>` and an empty
//! `CUDA_MPS_PIPE_DIRECTORY`, so it is never an MPS client). Runs until killed; survives agent
//! restarts and MPS server faults.

use mpsr_keeper::memory::{CudaDevice, Device, HostSimDevice};
use mpsr_keeper::server::{self, Keeper};
use mpsr_keeper::snapshot::Snapshots;
use mpsr_keeper::store::Store;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendKind {
    /// Real GPU memory through the CUDA driver.
    Cuda,
    /// SIMULATED GPU memory in host RAM (tests, the demo).
    HostSim,
}

/// Holds jobs' named GPU allocations outside MPS, one keeper per GPU.
#[derive(Debug, clap::Parser)]
#[command(
    name = "mpsr-keeper",
    version,
    about = "mps-resilient state keeper: holds jobs' named GPU allocations outside MPS",
    long_about = "Started by the node agent, one per GPU (CUDA_VISIBLE_DEVICES=<uuid> and an empty CUDA_MPS_PIPE_DIRECTORY, so it is never an MPS client). Holds the named allocations jobs attach through libmpsr_state, so they survive client crashes and MPS server faults, and snapshots them to host files. Runs until killed or until its run directory is gone; survives agent restarts. Not started by hand on a production node."
)]
struct Args {
    /// The GPU index this keeper serves.
    #[arg(long)]
    gpu: u32,
    /// Its socket (jobs' libmpsr_state connects here).
    #[arg(long)]
    socket: PathBuf,
    /// The node agent's socket (who may attach what is asked there).
    #[arg(long)]
    agent_socket: PathBuf,
    /// Where host snapshots go (a subdirectory per GPU).
    #[arg(long)]
    snapshot_dir: PathBuf,
    #[arg(long, value_enum, default_value_t = BackendKind::Cuda)]
    backend: BackendKind,
    /// Most bytes one job may keep (e.g. 64G).
    #[arg(long = "max-bytes-per-job", value_name = "SIZE", default_value = "64G", value_parser = size)]
    quota: u64,
    /// Snapshot every allocation every N seconds (0: only when asked).
    #[arg(long = "snapshot-interval-s", value_name = "N", default_value_t = 0)]
    interval: u64,
    /// Snapshot directories untouched this long are removed at start.
    #[arg(long = "stale-after-s", value_name = "N", default_value_t = 86_400)]
    stale: u64,
}

/// A `--max-bytes-per-job` value that is not a size.
#[derive(Debug, thiserror::Error)]
#[error("'{0}' is not a size (e.g. 512M, 64G)")]
struct NotASize(String);

fn size(s: &str) -> Result<u64, NotASize> {
    mpsr_proto::parse_size(s).ok_or_else(|| NotASize(s.to_string()))
}

fn main() -> std::process::ExitCode {
    mpsr_manpage::print_if_asked(<Args as clap::CommandFactory>::command());
    let a = <Args as clap::Parser>::parse();
    let dev: Box<dyn Device> = if a.backend == BackendKind::HostSim {
        eprintln!(
            "mpsr-keeper gpu{}: SIMULATED GPU memory (host-sim backend)",
            a.gpu
        );
        Box::new(HostSimDevice)
    } else {
        match CudaDevice::open() {
            Ok(d) => Box::new(d),
            Err(e) => {
                eprintln!("mpsr-keeper gpu{}: {e}", a.gpu);
                return 1.into();
            }
        }
    };
    // Per GPU: two GPUs' keepers may hold the same job's allocation names.
    let snaps = Snapshots::new(&a.snapshot_dir.join(format!("gpu{}", a.gpu)));
    let stale = snaps.clean_stale(Duration::from_secs(a.stale));
    if stale > 0 {
        eprintln!(
            "mpsr-keeper gpu{}: removed {stale} stale snapshot dir(s)",
            a.gpu
        );
    }
    let listener = match server::bind(&a.socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("mpsr-keeper gpu{}: {}: {e}", a.gpu, a.socket.display());
            return 1.into();
        }
    };
    let k = Arc::new(Keeper {
        gpu: a.gpu,
        dev,
        snaps,
        store: Mutex::new(Store::new(a.quota)),
        agent_socket: a.agent_socket,
    });
    let s = k.clone();
    let dir = a.socket.parent().map(PathBuf::from).unwrap_or_default();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(1));
        s.sweep();
        // Its run directory is gone (the node's runtime dir was wiped, or a test ended).
        if !dir.exists() {
            eprintln!(
                "mpsr-keeper gpu{}: {} is gone; exiting",
                s.gpu,
                dir.display()
            );
            std::process::exit(0);
        }
    });
    if a.interval > 0 {
        let s = k.clone();
        let every = Duration::from_secs(a.interval);
        std::thread::spawn(move || loop {
            std::thread::sleep(every);
            s.checkpoint_all();
        });
    }
    eprintln!(
        "mpsr-keeper gpu{}: serving {} (pid {})",
        a.gpu,
        a.socket.display(),
        std::process::id()
    );
    server::serve(k, listener);
    0.into()
}
