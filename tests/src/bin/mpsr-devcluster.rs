//! mpsr-devcluster: starts the local Slurm test cluster (SIMULATED GPUs) and keeps it up until
//! stdin closes or Enter is pressed; prints how to use it. For trying things by hand.

use mpsr_e2e::{Cluster, Options};
use std::io::BufRead;

fn main() -> std::process::ExitCode {
    let c = match Cluster::start(Options {
        health_interval_s: 5,
        ..Options::default()
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mpsr-devcluster: {e}");
            return 1.into();
        }
    };
    println!(
        "local Slurm cluster with SIMULATED GPUs is up in {}",
        c.dir.display()
    );
    println!(
        "  export SLURM_CONF={} PATH={}:$PATH",
        c.conf.display(),
        c.bin.display()
    );
    for n in &c.opts.nodes {
        println!(
            "  agent of {n}: mpsrctl --socket {} status",
            c.agent_socket(n).display()
        );
    }
    println!("press Enter (or close stdin) to stop it");
    let _ = std::io::stdin().lock().lines().next();
    0.into()
}
