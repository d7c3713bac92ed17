//! Every injected pathology is detected within its window and attributed to the right GPU, job
//! and client; clean noisy series (many seeds) and benign oddities (counter resets, unsupported
//! counters, gaps) raise nothing. SIMULATED series (mpsr_telemetry::replay).

use mpsr_telemetry::replay::{Injection, Pathology, Rank, Scenario};
use mpsr_telemetry::rules::{Rule, RuleId, RULES};
use mpsr_telemetry::{Detector, Finding, FindingState, Owner, Subject};
use std::collections::BTreeSet;

const STEP: f64 = 5.0;

fn owner(job: u32, task: u32, uid: u32) -> Option<Owner> {
    Some(Owner {
        job,
        step: 0,
        task,
        uid,
    })
}

fn rank(gpu: u32, pid: u32, job: u32, uid: u32, util: f64, gib: u64) -> Rank {
    Rank {
        gpu,
        pid,
        owner: owner(job, pid, uid),
        util,
        mem_bytes: gib << 30,
    }
}

/// 4 GPUs: job 10 on GPUs 0,1 (pids 100, 101); job 11 on GPUs 2,3 (200, 201); job 12 shares
/// GPU 3's MPS server (pid 300); one NIC port. Clients have no utilization of their own, as NVML
/// reports MPS clients (measured); `with_client_util` is the no-MPS case.
fn base(seed: u64) -> Scenario {
    Scenario {
        seed,
        gpus: 4,
        ranks: vec![
            rank(0, 100, 10, 1000, 0.85, 8),
            rank(1, 101, 10, 1000, 0.85, 8),
            rank(2, 200, 11, 1001, 0.85, 8),
            rank(3, 201, 11, 1001, 0.85, 8),
            rank(3, 300, 12, 1002, 0.10, 2),
        ],
        nics: vec!["mlx5_0/1".into()],
        injections: vec![],
        per_client_util: false,
    }
}

fn with_client_util(seed: u64) -> Scenario {
    Scenario {
        per_client_util: true,
        ..base(seed)
    }
}

fn run(s: &Scenario, until: f64) -> Vec<Finding> {
    let mut d = Detector::new(RULES.to_vec());
    let mut out = Vec::new();
    let mut round = 0;
    let mut t = 0.0;
    while t <= until {
        out.extend(d.observe(&s.tick(round, t)));
        round += 1;
        t += STEP;
    }
    out
}

fn rule(id: RuleId) -> &'static Rule {
    RULES.iter().find(|r| r.id == id).unwrap()
}

#[test]
fn clean_noisy_series_raise_nothing_over_many_seeds() {
    for seed in 0..60 {
        let f = run(&base(seed), 2.0 * 3600.0);
        assert!(f.is_empty(), "seed {seed}: {f:#?}");
    }
}

#[test]
fn benign_oddities_raise_nothing() {
    for seed in 0..20 {
        for what in [
            Pathology::CounterReset,
            Pathology::NotSupported,
            Pathology::Gap,
        ] {
            let mut s = base(seed);
            for gpu in 0..4 {
                s.injections.push(Injection {
                    what,
                    gpu,
                    pid: None,
                    start_s: 600.0,
                    end_s: 900.0,
                });
                s.injections.push(Injection {
                    what,
                    gpu,
                    pid: None,
                    start_s: 1500.0,
                    end_s: 1510.0,
                });
            }
            let f = run(&s, 3600.0);
            assert!(f.is_empty(), "seed {seed} {what:?}: {f:#?}");
        }
    }
}

#[test]
fn clients_with_per_process_utilization_raise_nothing_either() {
    for seed in 0..20 {
        let f = run(&with_client_util(seed), 3600.0);
        assert!(f.is_empty(), "seed {seed}: {f:#?}");
    }
}

struct Case {
    what: Pathology,
    gpu: u32,
    pid: Option<u32>,
    /// (rule, subject, job it is attributed to)
    expect: Vec<(RuleId, Subject, Option<u32>)>,
}

fn gpu(g: u32) -> Subject {
    Subject::Gpu { gpu: g }
}
fn client(g: u32, pid: u32) -> Subject {
    Subject::Client { gpu: g, pid }
}

fn server(g: u32) -> Subject {
    Subject::Server { gpu: g, slot: 0 }
}

/// `client_util`: whether NVML gives each client its own utilization (no MPS).
fn cases(client_util: bool) -> Vec<Case> {
    use Pathology as P;
    use RuleId as R;
    let c = |what, g, pid, expect| Case {
        what,
        gpu: g,
        pid,
        expect,
    };
    vec![
        // A throttled GPU is slower than its peers too, but its clock-event reason already says
        // why: one finding, not a second `clock_skew` of the same cause.
        c(P::Throttle, 0, None, vec![(R::HwSlowdown, gpu(0), None)]),
        c(P::Thermal, 1, None, vec![(R::Thermal, gpu(1), None)]),
        c(P::EccStorm, 2, None, vec![(R::EccStorm, gpu(2), None)]),
        c(
            P::EccUncorrected,
            2,
            None,
            vec![(R::EccUncorrected, gpu(2), None)],
        ),
        c(
            P::RemapPending,
            3,
            None,
            vec![(R::RowRemapPending, gpu(3), None)],
        ),
        c(
            P::ReplayGrowth,
            1,
            None,
            vec![(R::PcieReplays, gpu(1), None)],
        ),
        c(
            P::LinkDowngrade,
            0,
            None,
            vec![(R::PcieWidth, gpu(0), None)],
        ),
        c(
            P::NvlinkErrors,
            3,
            None,
            vec![(R::NvlinkErrors, gpu(3), None)],
        ),
        c(P::ClockSkew, 2, None, vec![(R::ClockSkew, gpu(2), None)]),
        c(
            P::Straggler,
            0,
            Some(100),
            vec![(R::Straggler, client(0, 100), Some(10))],
        ),
        c(
            P::MemorySkew,
            1,
            Some(101),
            vec![(R::MemoryImbalance, Subject::Job { job: 10 }, Some(10))],
        ),
        c(P::NearOom, 1, None, vec![(R::NearOom, gpu(1), Some(10))]),
        // With per-client utilization the hog is named and its starved neighbour straggles; under
        // MPS only the saturated shared server shows.
        if client_util {
            c(
                P::Hog,
                3,
                Some(300),
                vec![
                    (R::MpsHog, client(3, 300), Some(12)),
                    (R::Straggler, client(3, 201), Some(11)),
                    (R::MpsContention, server(3), None),
                ],
            )
        } else {
            c(
                P::Hog,
                3,
                Some(300),
                vec![(R::MpsContention, server(3), None)],
            )
        },
        // Job 10 idle on both its GPUs (an idle inference server holding its memory): one
        // finding for the job, not one per rank. (Its second rank is made idle in the test.)
        c(
            P::IdleAllocation,
            0,
            Some(100),
            vec![(R::IdleAllocation, Subject::Job { job: 10 }, Some(10))],
        ),
        c(
            P::NicErrors,
            0,
            None,
            vec![(
                R::NicErrors,
                Subject::Nic {
                    port: "mlx5_0/1".into(),
                },
                None,
            )],
        ),
        c(P::GpuLost, 2, None, vec![(R::GpuUnreadable, gpu(2), None)]),
    ]
}

#[test]
fn each_pathology_is_detected_in_its_window_attributed_and_cleared() {
    let start = 1200.0;
    let len = 1800.0;
    for (seed, client_util) in [(1, false), (2, false), (3, true), (4, true)] {
        for case in cases(client_util) {
            let mut s = if client_util {
                with_client_util(seed)
            } else {
                base(seed)
            };
            s.injections.push(Injection {
                what: case.what,
                gpu: case.gpu,
                pid: case.pid,
                start_s: start,
                end_s: start + len,
            });
            if case.what == Pathology::IdleAllocation {
                s.injections.push(Injection {
                    what: case.what,
                    gpu: 1,
                    pid: Some(101),
                    start_s: start,
                    end_s: start + len,
                });
            }
            let f = run(&s, start + len + 3600.0);
            let raised: Vec<&Finding> = f
                .iter()
                .filter(|f| f.state == FindingState::Raised)
                .collect();
            let got: BTreeSet<(RuleId, Subject)> =
                raised.iter().map(|f| (f.rule, f.subject.clone())).collect();
            let want: BTreeSet<(RuleId, Subject)> = case
                .expect
                .iter()
                .map(|(r, s, _)| (*r, s.clone()))
                .collect();
            assert_eq!(got, want, "seed {seed} {:?}: {raised:#?}", case.what);
            for (id, subject, job) in &case.expect {
                let r = raised
                    .iter()
                    .find(|f| f.rule == *id && &f.subject == subject)
                    .unwrap();
                assert!(r.t >= start, "{id:?} raised before the injection");
                let bound = start + rule(*id).window_s + 3.0 * STEP;
                assert!(
                    r.t <= bound,
                    "seed {seed} {id:?} raised at {} > {bound}",
                    r.t
                );
                assert_eq!(
                    r.owner.map(|o| o.job),
                    *job,
                    "{id:?} attributed to {:?}",
                    r.owner
                );
                if *id == RuleId::MpsHog {
                    assert!(
                        r.others.iter().any(|o| o.job == 11),
                        "the starved job is named: {:?}",
                        r.others
                    );
                }
            }
            // Everything raised is cleared again after the injection ends (hysteresis, then clear_s).
            let cleared: BTreeSet<(RuleId, Subject)> = f
                .iter()
                .filter(|f| f.state == FindingState::Cleared)
                .map(|f| (f.rule, f.subject.clone()))
                .collect();
            assert_eq!(cleared, want, "seed {seed} {:?} not all cleared", case.what);
            for c in f.iter().filter(|f| f.state == FindingState::Cleared) {
                assert!(
                    c.t >= start + len,
                    "{:?} cleared while the injection lasted",
                    c.rule
                );
            }
        }
    }
}

/// One bad reading is noise, not a condition (windows need several in a row or most of them).
#[test]
fn a_single_bad_reading_raises_nothing() {
    let mut s = base(5);
    s.injections.push(Injection {
        what: Pathology::Throttle,
        gpu: 0,
        pid: None,
        start_s: 600.0,
        end_s: 600.0 + STEP - 1.0,
    });
    s.injections.push(Injection {
        what: Pathology::Straggler,
        gpu: 0,
        pid: Some(100),
        start_s: 900.0,
        end_s: 900.0 + STEP - 1.0,
    });
    assert!(run(&s, 2400.0).is_empty());
}

#[test]
fn findings_of_a_client_that_exits_are_cleared() {
    let mut s = base(9);
    s.injections.push(Injection {
        what: Pathology::Straggler,
        gpu: 0,
        pid: Some(100),
        start_s: 100.0,
        end_s: 5000.0,
    });
    let mut d = Detector::new(RULES.to_vec());
    let mut round = 0;
    let mut t = 0.0;
    while t < 400.0 {
        d.observe(&s.tick(round, t));
        round += 1;
        t += STEP;
    }
    assert_eq!(d.active().len(), 1);
    s.ranks.retain(|r| r.pid != 100);
    let f = d.observe(&s.tick(round, t));
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].state, FindingState::Cleared);
    assert!(d.active().is_empty());
}
