//! mpsr-simgpu: SIMULATED GPUs and their MPS servers (CI and the demo only). Started by the agent
//! with `backend = "sim"`; like real MPS control daemons it outlives agent restarts.

use mpsr_agent::simgpu::SimGpus;
use std::path::PathBuf;
use std::sync::Arc;

fn main() -> std::process::ExitCode {
    let mut run_dir: Option<PathBuf> = None;
    let (mut gpus, mut recovery_ms, mut isolation) = (2u32, 200u64, false);
    let mut args = std::env::args().skip(1);
    let usage = "usage: mpsr-simgpu --run-dir DIR [--gpus N] [--recovery-ms MS] [--isolation]";
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Option<u64> {
            let v = args.next().and_then(|v| v.parse().ok());
            if v.is_none() {
                eprintln!("mpsr-simgpu: {name} needs a number\n{usage}");
            }
            v
        };
        match a.as_str() {
            "--run-dir" => run_dir = args.next().map(PathBuf::from),
            "--gpus" => match num("--gpus") {
                Some(n) if (1..=64).contains(&n) => gpus = n as u32,
                _ => return 2.into(),
            },
            "--recovery-ms" => match num("--recovery-ms") {
                Some(n) => recovery_ms = n,
                None => return 2.into(),
            },
            "--isolation" => isolation = true,
            other => {
                eprintln!("mpsr-simgpu: unknown argument {other}\n{usage}");
                return 2.into();
            }
        }
    }
    let Some(run_dir) = run_dir else {
        eprintln!("mpsr-simgpu: --run-dir is required\n{usage}");
        return 2.into();
    };
    eprintln!(
        "mpsr-simgpu: {gpus} SIMULATED GPUs under {} (pid {})",
        run_dir.display(),
        std::process::id()
    );
    match Arc::new(SimGpus::new(gpus, &run_dir, isolation, recovery_ms)).serve() {
        Ok(()) => 0.into(),
        Err(e) => {
            eprintln!("mpsr-simgpu: {e}");
            1.into()
        }
    }
}
