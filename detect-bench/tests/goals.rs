//! The detection goals on a small run of the labelled benchmark (SIMULATED 8-GPU nodes: one case
//! per pathology, severity, duration and duty cycle, and 2 healthy node-hours). The full run,
//! old rules beside new, is scripts/bench-detect.sh; BENCHMARKS.md has its table.

use mpsr_detect_bench::cases::{catalogue, Scale};
use mpsr_detect_bench::sampler::Sampling;
use mpsr_detect_bench::score::{percentile, score};
use mpsr_telemetry::{Detector, RULES};

/// Hardware-state rules: seen within 15 s (1 s rounds of the cheap NVML getters).
const STATE: &[&str] = &[
    "hw_slowdown",
    "thermal",
    "pcie_gen",
    "pcie_width",
    "gpu_unreadable",
    "ecc_uncorrected",
];
/// Stragglers and skews: within 30 s.
const SKEWS: &[&str] = &[
    "straggler",
    "clock_skew",
    "node_slowdown",
    "memory_imbalance",
    "mps_contention",
    "step_skew",
    "step_spike",
];

#[test]
fn the_default_rules_meet_the_detection_goals_on_the_labelled_benchmark() {
    let cases = catalogue(Scale {
        seeds: 1,
        healthy_hours: 2.0,
    });
    let rep = score(&cases, Sampling::FAST, &|| Detector::new(RULES.to_vec()));
    let mut failed = Vec::new();
    for (rule, s) in &rep.rules {
        if s.goal_cases > 0 && (s.goal_found as f64) < 0.95 * s.goal_cases as f64 {
            failed.push(format!(
                "{rule}: recall {}/{} of conditions >= 30 s at >= 50 % duty",
                s.goal_found, s.goal_cases
            ));
        }
        if s.right + s.wrong > 0 && (s.right as f64) < 0.95 * (s.right + s.wrong) as f64 {
            failed.push(format!(
                "{rule}: precision {}/{}",
                s.right,
                s.right + s.wrong
            ));
        }
        if s.healthy_wrong > 0 {
            failed.push(format!(
                "{rule}: {} false alarm(s) in {:.0} healthy node-hours",
                s.healthy_wrong, rep.healthy_hours
            ));
        }
        let p95 = percentile(&s.ttd, 0.95).unwrap_or(0.0);
        let bound = if STATE.contains(&rule.as_str()) {
            15.0
        } else if SKEWS.contains(&rule.as_str()) {
            30.0
        } else {
            f64::MAX
        };
        if p95 > bound {
            failed.push(format!(
                "{rule}: time to detect p95 {p95:.0} s > {bound:.0} s"
            ));
        }
    }
    for rule in STATE.iter().chain(SKEWS) {
        assert!(
            rep.rules.get(*rule).is_some_and(|s| s.cases > 0),
            "the benchmark has cases for {rule}"
        );
    }
    assert!(failed.is_empty(), "{failed:#?}\nmissed: {:#?}", rep.misses);
}

/// The benchmark can fail: the rules of 0.2.0 (streak windows of 60 s, straggler at 0.5x,
/// clock skew among a node's GPUs only) sampled as 0.2.0 did miss most of it. Modelled here by
/// the same detector with 5 s rounds and windows held to one reading in twelve (a streak).
#[test]
fn the_benchmark_fails_rules_that_need_a_minute_of_unbroken_evidence() {
    let cases = catalogue(Scale {
        seeds: 1,
        healthy_hours: 0.0,
    });
    let slow: Vec<_> = RULES
        .iter()
        .map(|r| {
            let mut r = *r;
            r.window_s = r.window_s.max(60.0);
            r.duty = 1.0;
            r
        })
        .collect();
    let rep = score(&cases, Sampling::V0_2, &|| Detector::new(slow.clone()));
    let s = &rep.rules["hw_slowdown"];
    assert!(
        (s.goal_found as f64) < 0.95 * s.goal_cases as f64,
        "flapping throttles are missed with unbroken 60 s windows: {}/{}",
        s.goal_found,
        s.goal_cases
    );
}
