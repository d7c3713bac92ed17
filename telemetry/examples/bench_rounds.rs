//! CPU cost of the agent's per-round telemetry work that does not touch a GPU: the pathology rules
//! over one round (8 GPUs, 4 clients each) and one /metrics render. NVML's own cost is measured on
//! the H200 (tests/gpu/telemetry_proof.py). Prints numbers; run with
//! `cargo run --release -p mpsr-telemetry --example bench_rounds`.

use mpsr_telemetry::metrics::{render, Exporter};
use mpsr_telemetry::replay::{Rank, Scenario};
use mpsr_telemetry::{Detector, Owner, Snapshot, RULES};
use std::sync::{Arc, Mutex};
use std::time::Instant;

fn main() {
    let gpus = 8;
    let ranks = (0..gpus * 4)
        .map(|i| Rank {
            gpu: i / 4,
            pid: 1000 + i,
            owner: Some(Owner {
                job: 10 + i % 3,
                step: 0,
                task: 1000 + i,
                uid: 1000,
            }),
            util: 0.8,
            mem_bytes: 8 << 30,
        })
        .collect();
    let s = Scenario {
        seed: 1,
        gpus,
        ranks,
        nics: vec!["mlx5_0/1".into(), "mlx5_1/1".into()],
        injections: vec![],
        per_client_util: true,
    };
    let rounds = 5_000u64;
    let ticks: Vec<_> = (0..rounds).map(|r| s.tick(r, r as f64 * 5.0)).collect();
    let mut d = Detector::new(RULES.to_vec());
    let t0 = Instant::now();
    for t in &ticks {
        d.observe(t);
    }
    let detect_us = t0.elapsed().as_secs_f64() * 1e6 / rounds as f64;
    let ex = Exporter(Arc::new(Mutex::new(Snapshot {
        node: "n".into(),
        simulated: true,
        tick: ticks.last().unwrap().clone(),
        findings: d.active(),
        rounds,
        cpu_seconds: 0.0,
        pid_labels: false,
    })));
    let n = 500;
    let t1 = Instant::now();
    let mut bytes = 0;
    for _ in 0..n {
        bytes = render(&ex).len();
    }
    let render_us = t1.elapsed().as_secs_f64() * 1e6 / n as f64;
    println!("rules over one round, 8 GPUs x 4 clients: {detect_us:.1} us");
    println!("one /metrics render ({bytes} bytes): {render_us:.1} us");
    println!(
        "at a 5 s round and a 15 s scrape: {:.4} % of one core",
        (detect_us / 5.0 + render_us / 15.0) / 1e6 * 100.0
    );
}
