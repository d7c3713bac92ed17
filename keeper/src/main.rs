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

const USAGE: &str =
    "usage: mpsr-keeper --gpu N --socket PATH --agent-socket PATH --snapshot-dir DIR \
[--backend cuda|host-sim] [--max-bytes-per-job SIZE] [--snapshot-interval-s N] [--stale-after-s N]";

struct Args {
    gpu: u32,
    socket: PathBuf,
    agent_socket: PathBuf,
    snapshot_dir: PathBuf,
    backend: String,
    quota: u64,
    interval: u64,
    stale: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        gpu: 0,
        socket: PathBuf::new(),
        agent_socket: PathBuf::new(),
        snapshot_dir: PathBuf::new(),
        backend: "cuda".into(),
        quota: 64 << 30,
        interval: 0,
        stale: 86_400,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it
            .next()
            .ok_or_else(|| format!("{k} needs a value\n{USAGE}"))?;
        let num = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{k}: bad number '{v}'"))
        };
        match k.as_str() {
            "--gpu" => a.gpu = num(&v)? as u32,
            "--socket" => a.socket = v.into(),
            "--agent-socket" => a.agent_socket = v.into(),
            "--snapshot-dir" => a.snapshot_dir = v.into(),
            "--backend" if v == "cuda" || v == "host-sim" => a.backend = v,
            "--max-bytes-per-job" => {
                a.quota =
                    mpsr_proto::parse_size(&v).ok_or_else(|| format!("{k}: bad size '{v}'"))?
            }
            "--snapshot-interval-s" => a.interval = num(&v)?,
            "--stale-after-s" => a.stale = num(&v)?,
            _ => return Err(format!("unknown argument {k} {v}\n{USAGE}")),
        }
    }
    if a.socket.as_os_str().is_empty()
        || a.agent_socket.as_os_str().is_empty()
        || a.snapshot_dir.as_os_str().is_empty()
    {
        return Err(format!(
            "--socket, --agent-socket and --snapshot-dir are required\n{USAGE}"
        ));
    }
    Ok(a)
}

fn main() -> std::process::ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mpsr-keeper: {e}");
            return 2.into();
        }
    };
    let dev: Box<dyn Device> = if a.backend == "host-sim" {
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
