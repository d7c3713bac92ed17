//! mpsr-simgpu: SIMULATED GPUs and their MPS servers (CI and the demo only). Started by the agent
//! with `backend = "sim"`; like real MPS control daemons it outlives agent restarts.

use clap::Parser;
use mpsr_simgpu::{DriverPatch, FaultTiming, SimGpus};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    version,
    about = "SIMULATED GPUs and MPS servers for CI and the demo (no real GPU)"
)]
struct Args {
    /// Directory of the control socket (<DIR>/sim/control.sock); the daemon exits when it is removed.
    #[arg(long)]
    run_dir: PathBuf,
    /// Number of simulated GPUs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus: u32,
    /// FAULT -> ACTIVE delay after the last faulted client left (measured ~0.2 s on an H200).
    #[arg(long, default_value_t = 200)]
    recovery_ms: u64,
    /// Which phase of the driver patch to model for an Xid 31 with a known culprit.
    #[arg(long, value_enum, default_value_t = DriverPatch::Off)]
    driver_patch: DriverPatch,
    /// When a fault shows: as measured on an H200 (the driver reports an Xid 43 after ~14 ms, an
    /// Xid 31 after ~100 ms; victims fail after ~150/125 ms), or all at once.
    #[arg(long, value_enum, default_value_t = FaultTiming::Measured)]
    timing: FaultTiming,
}

fn main() -> std::process::ExitCode {
    mpsr_manpage::print_if_asked(<Args as clap::CommandFactory>::command());
    let a = Args::parse();
    eprintln!(
        "mpsr-simgpu: {} SIMULATED GPUs under {} (pid {})",
        a.gpus,
        a.run_dir.display(),
        std::process::id()
    );
    match Arc::new(SimGpus::new(
        a.gpus,
        &a.run_dir,
        a.driver_patch,
        a.timing,
        a.recovery_ms,
    ))
    .serve()
    {
        Ok(()) => 0.into(),
        Err(e) => {
            eprintln!("mpsr-simgpu: {e}");
            1.into()
        }
    }
}
