//! The labelled cases: every pathology at several severities, onsets, durations and duty cycles
//! (flapping), at and around its threshold, node-wide slowdowns, mixed with healthy work; and
//! healthy node-hours with look-alikes that must raise nothing (intended MPS packing under thread
//! limits, 95 % preallocation, idle inference servers, checkpoint pauses, bursts, job churn,
//! counter resets, a GPU at its power cap, congestion and background NIC errors); step times
//! (`mpsr_step()`) of training ranks and inference replicas, with slow replicas and host-side
//! stalls as positives and idle servers, checkpoints and load-dependent steps as look-alikes.

use crate::model::{job, stepping, Fault, Load, Node, Overlay, Rng, GPUS};

/// What a finding must be about to count for a label.
#[derive(Debug, Clone, PartialEq)]
pub enum About {
    Gpu(u32),
    Client(u32, u32),
    Job(u32),
    Nic(String),
    /// Anything on the node (a node-wide condition).
    Node,
}

/// A condition that should be found by `rule` while it lasts.
#[derive(Debug, Clone)]
pub struct Label {
    pub rule: &'static str,
    pub about: About,
    pub start: f64,
    pub end: f64,
    /// Other rules that may fire about the same thing without being false alarms (a throttled
    /// GPU is also clocked below its peers).
    pub also: &'static [&'static str],
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub node: Node,
    pub duration_s: f64,
    pub labels: Vec<Label>,
    /// How long the condition lasts and its duty cycle (for the recall goals); 0 for healthy.
    pub lasting_s: f64,
    pub duty: f64,
    pub healthy: bool,
}

/// How big a run is.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Seeds per (fault, severity, duration, duty).
    pub seeds: u32,
    pub healthy_hours: f64,
}

pub const PORT: &str = "mlx5_0/1";

/// Job 10 (TP over 8 GPUs, 60 GiB a rank, steady).
fn training(seed: u64) -> Node {
    Node {
        seed,
        ranks: stepping(
            job(
                10,
                1000,
                &[0, 1, 2, 3, 4, 5, 6, 7],
                Load::Steady(0.92),
                60.0,
                None,
                None,
                (0.0, f64::MAX),
            ),
            0.4,
        ),
        overlays: Vec::new(),
        nics: vec![PORT.into()],
        nic_background_per_h: 4.0,
    }
}

/// Job 10 over GPUs 0-3 (30 GiB a rank), job 20 bursty over 4-5, three jobs packed on GPU 6
/// under `--mps-threads=30` and `--mps-mem=20G`, an inference server on GPU 7 holding 95 %.
fn mixed(seed: u64) -> Node {
    let mut ranks = job(
        10,
        1000,
        &[0, 1, 2, 3],
        Load::Steady(0.9),
        30.0,
        None,
        None,
        (0.0, f64::MAX),
    );
    ranks.extend(job(
        20,
        1001,
        &[4, 5],
        Load::Bursty { lo: 0.15, hi: 0.85 },
        24.0,
        None,
        None,
        (0.0, f64::MAX),
    ));
    for j in 30..33 {
        ranks.extend(job(
            j,
            1002 + j - 30,
            &[6],
            Load::Steady(0.95),
            12.0,
            Some(30),
            Some(20.0),
            (0.0, f64::MAX),
        ));
    }
    ranks.extend(job(
        40,
        1010,
        &[7],
        Load::Bursty { lo: 0.1, hi: 0.8 },
        0.95 * 79.6 - 0.6,
        None,
        None,
        (0.0, f64::MAX),
    ));
    Node {
        seed,
        ranks,
        overlays: Vec::new(),
        nics: vec![PORT.into()],
        nic_background_per_h: 4.0,
    }
}

struct Spec {
    fault: Fault,
    rule: &'static str,
    also: &'static [&'static str],
    sevs: &'static [f64],
    durations: &'static [f64],
    duties: &'static [f64],
    /// Which base node and on what (gpu, pid, job) it is injected; what the label is about.
    place: fn(&mut Rng) -> (Node, Overlay, About),
}

fn gpu_fault(fault: Fault, node: fn(u64) -> Node) -> impl Fn(&mut Rng) -> (Node, Overlay, About) {
    move |r: &mut Rng| {
        let g = (r.next_u64() % GPUS as u64) as u32;
        (
            node(r.next_u64()),
            overlay(fault, g, None, None),
            About::Gpu(g),
        )
    }
}

fn overlay(fault: Fault, gpu: u32, pid: Option<u32>, job: Option<u32>) -> Overlay {
    Overlay {
        fault,
        gpu,
        pid,
        job,
        start: 0.0,
        end: 0.0,
        duty: 1.0,
        period_s: 20.0,
        sev: 0.0,
    }
}

const STATE_DURATIONS: &[f64] = &[15.0, 30.0, 60.0, 120.0, 300.0];
const FLAP: &[f64] = &[1.0, 0.7, 0.5];
const STEADY: &[f64] = &[1.0];

fn specs() -> Vec<Spec> {
    vec![
        Spec {
            fault: Fault::Throttle,
            rule: "hw_slowdown",
            also: &["clock_skew", "node_slowdown"],
            sevs: &[0.2, 0.4],
            durations: STATE_DURATIONS,
            duties: FLAP,
            place: |r| gpu_fault(Fault::Throttle, training)(r),
        },
        Spec {
            fault: Fault::Thermal,
            rule: "thermal",
            also: &[],
            sevs: &[0.5, 2.0, 3.0],
            durations: STATE_DURATIONS,
            duties: FLAP,
            place: |r| gpu_fault(Fault::Thermal, training)(r),
        },
        Spec {
            fault: Fault::EccStorm,
            rule: "ecc_storm",
            also: &[],
            sevs: &[12.0, 30.0, 100.0],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::EccStorm, training)(r),
        },
        Spec {
            fault: Fault::EccDbe,
            rule: "ecc_uncorrected",
            also: &[],
            sevs: &[1.0],
            durations: &[60.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::EccDbe, training)(r),
        },
        Spec {
            fault: Fault::RemapPending,
            rule: "row_remap_pending",
            also: &[],
            sevs: &[1.0],
            durations: &[30.0, 120.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::RemapPending, training)(r),
        },
        Spec {
            fault: Fault::Replays,
            rule: "pcie_replays",
            also: &[],
            sevs: &[1.5, 3.0, 10.0],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::Replays, training)(r),
        },
        Spec {
            fault: Fault::LinkWidth,
            rule: "pcie_width",
            also: &[],
            sevs: &[1.0],
            durations: &[30.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::LinkWidth, training)(r),
        },
        Spec {
            fault: Fault::LinkGen,
            rule: "pcie_gen",
            also: &[],
            sevs: &[1.0],
            durations: STATE_DURATIONS,
            duties: FLAP,
            place: |r| gpu_fault(Fault::LinkGen, training)(r),
        },
        Spec {
            fault: Fault::Nvlink,
            rule: "nvlink_errors",
            also: &[],
            sevs: &[2.0, 10.0, 60.0],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::Nvlink, training)(r),
        },
        Spec {
            fault: Fault::Lost,
            rule: "gpu_unreadable",
            also: &[],
            sevs: &[1.0],
            durations: &[15.0, 30.0, 60.0, 300.0],
            duties: STEADY,
            place: |r| gpu_fault(Fault::Lost, training)(r),
        },
        Spec {
            fault: Fault::ClockSkew,
            rule: "clock_skew",
            also: &["straggler"],
            sevs: &[0.85, 0.75, 0.6],
            durations: STATE_DURATIONS,
            duties: FLAP,
            place: |r| gpu_fault(Fault::ClockSkew, training)(r),
        },
        Spec {
            fault: Fault::NodeSlow,
            rule: "node_slowdown",
            also: &["clock_skew"],
            sevs: &[0.85, 0.7],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| {
                let mut o = overlay(Fault::NodeSlow, 0, None, None);
                o.gpu = 0;
                (training(r.next_u64()), o, About::Node)
            },
        },
        Spec {
            fault: Fault::Straggler,
            rule: "straggler",
            also: &["clock_skew"],
            sevs: &[0.7, 0.6, 0.5, 0.3],
            durations: &[30.0, 60.0, 120.0, 300.0],
            duties: FLAP,
            place: |r| {
                let g = 1 + (r.next_u64() % 7) as u32;
                let pid = 1000 + g;
                (
                    training(r.next_u64()),
                    overlay(Fault::Straggler, g, Some(pid), None),
                    About::Client(g, pid),
                )
            },
        },
        Spec {
            fault: Fault::TpSlowRank,
            rule: "straggler",
            also: &["clock_skew"],
            sevs: &[0.5, 0.3],
            durations: &[30.0, 60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| {
                let g = (r.next_u64() % 8) as u32;
                let pid = 1000 + g;
                let mut o = overlay(Fault::TpSlowRank, g, Some(pid), Some(10));
                o.job = Some(10);
                (training(r.next_u64()), o, About::Client(g, pid))
            },
        },
        Spec {
            fault: Fault::MemSkew,
            rule: "memory_imbalance",
            also: &["near_oom"],
            sevs: &[1.8, 2.5],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| {
                let g = (r.next_u64() % 4) as u32;
                (
                    mixed(r.next_u64()),
                    overlay(Fault::MemSkew, g, Some(1000 + g), None),
                    About::Job(10),
                )
            },
        },
        Spec {
            fault: Fault::NearOom,
            rule: "near_oom",
            also: &[],
            sevs: &[0.97, 0.99],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| {
                (
                    mixed(r.next_u64()),
                    overlay(Fault::NearOom, 6, Some(3000), None),
                    About::Job(30),
                )
            },
        },
        Spec {
            fault: Fault::Hog,
            rule: "mps_contention",
            also: &["mps_hog"],
            sevs: &[1.0],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| {
                let mut n = mixed(r.next_u64());
                // An uncapped job joins the packed server and takes it.
                n.ranks.extend(job(
                    33,
                    1009,
                    &[6],
                    Load::Steady(0.9),
                    8.0,
                    None,
                    None,
                    (0.0, f64::MAX),
                ));
                // (it joins at the onset: see catalogue)
                (n, overlay(Fault::Hog, 6, Some(3300), None), About::Gpu(6))
            },
        },
        Spec {
            fault: Fault::Hung,
            rule: "idle_allocation",
            also: &[],
            sevs: &[1.0],
            durations: &[2400.0],
            duties: STEADY,
            place: |r| {
                (
                    mixed(r.next_u64()),
                    overlay(Fault::Hung, 0, None, Some(10)),
                    About::Job(10),
                )
            },
        },
        Spec {
            fault: Fault::StepSlow,
            rule: "step_skew",
            // Twice as slow is also a spike against its own past steps.
            also: &["step_spike"],
            sevs: &[1.5, 2.0],
            durations: &[30.0, 60.0, 120.0, 300.0],
            duties: FLAP,
            place: |r| {
                let g = (r.next_u64() % 4) as u32;
                let pid = 5000 + g;
                (
                    inference(r.next_u64()),
                    overlay(Fault::StepSlow, g, Some(pid), None),
                    About::Client(g, pid),
                )
            },
        },
        Spec {
            fault: Fault::StepStall,
            rule: "step_spike",
            also: &["step_skew"],
            sevs: &[1.0],
            durations: &[30.0, 60.0, 120.0, 300.0],
            duties: FLAP,
            place: |r| {
                let g = (r.next_u64() % 8) as u32;
                let pid = 1000 + g;
                (
                    training(r.next_u64()),
                    overlay(Fault::StepStall, g, Some(pid), None),
                    About::Client(g, pid),
                )
            },
        },
        Spec {
            fault: Fault::NicErrors,
            rule: "nic_errors",
            also: &[],
            sevs: &[5.0, 30.0, 120.0],
            durations: &[60.0, 120.0, 300.0],
            duties: STEADY,
            place: |r| {
                (
                    training(r.next_u64()),
                    overlay(Fault::NicErrors, 0, None, None),
                    About::Nic(PORT.into()),
                )
            },
        },
    ]
}

/// Every positive case and the healthy node-hours.
pub fn catalogue(scale: Scale) -> Vec<Case> {
    let mut out = Vec::new();
    let mut rng = Rng::new(0x5eed);
    for spec in specs() {
        for &sev in spec.sevs {
            for &dur in spec.durations {
                for &duty in spec.duties {
                    for _ in 0..scale.seeds {
                        let (mut node, mut o, about) = (spec.place)(&mut rng);
                        let onset = rng.range(90.0, 240.0);
                        o.start = onset;
                        o.end = onset + dur;
                        o.duty = duty;
                        o.sev = sev;
                        let gpu = o.gpu;
                        node.overlays.push(o);
                        for r in node.ranks.iter_mut().filter(|r| r.job == 33) {
                            r.from_s = onset;
                        }
                        let about = match about {
                            About::Gpu(_) if spec.fault != Fault::Hog => About::Gpu(gpu),
                            a => a,
                        };
                        out.push(Case {
                            name: format!("{:?} sev {sev} {dur:.0}s duty {duty}", spec.fault),
                            duration_s: onset + dur + 180.0,
                            node,
                            labels: vec![Label {
                                rule: spec.rule,
                                about,
                                start: onset,
                                end: onset + dur,
                                also: spec.also,
                            }],
                            lasting_s: dur,
                            duty,
                            healthy: false,
                        });
                    }
                }
            }
        }
    }
    out.extend(healthy(scale.healthy_hours, &mut rng));
    out
}

/// Healthy node-hours, in 3-hour nodes of four kinds, with their look-alikes.
fn healthy(hours: f64, rng: &mut Rng) -> Vec<Case> {
    const SPAN: f64 = 3.0 * 3600.0;
    let n = (hours * 3600.0 / SPAN).ceil() as u32;
    (0..n)
        .map(|i| {
            let seed = rng.next_u64();
            let mut node = match i % 4 {
                0 => churn(mixed(seed), rng),
                1 => {
                    let mut t = training(seed);
                    let pause = rng.range(30.0, 150.0);
                    for r in &mut t.ranks {
                        r.load = Load::Checkpointing {
                            every_s: 1200.0,
                            pause_s: pause,
                        };
                    }
                    t
                }
                2 => inference(seed),
                _ => packed(seed),
            };
            // Look-alikes on every kind: a counter reset, a GPU at its power cap beside light
            // work, congestion bursts.
            let g = (rng.next_u64() % GPUS as u64) as u32;
            let mut reset = overlay(Fault::CounterReset, g, None, None);
            reset.start = rng.range(600.0, SPAN - 600.0);
            reset.end = reset.start + 1.0;
            node.overlays.push(reset);
            let mut cap = overlay(Fault::PowerCap, (g + 3) % GPUS, None, None);
            cap.start = rng.range(600.0, SPAN / 2.0);
            cap.end = cap.start + 1800.0;
            cap.sev = 0.12;
            node.overlays.push(cap);
            for k in 0..3 {
                let mut c = overlay(Fault::Congestion, 0, None, None);
                c.start = 3600.0 * k as f64 + rng.range(0.0, 3000.0);
                c.end = c.start + 120.0;
                c.sev = 600.0;
                node.overlays.push(c);
            }
            Case {
                name: format!(
                    "healthy node {i} ({})",
                    ["churn", "checkpoints", "inference", "packed"][i as usize % 4]
                ),
                node,
                duration_s: SPAN,
                labels: Vec::new(),
                lasting_s: 0.0,
                duty: 0.0,
                healthy: true,
            }
        })
        .collect()
}

/// The mixed node with its bursty job replaced every 20-60 minutes (job churn).
fn churn(mut n: Node, rng: &mut Rng) -> Node {
    n.ranks.retain(|r| r.job != 20);
    let mut t = 0.0;
    let mut j = 20;
    while t < 3.0 * 3600.0 {
        let d = rng.range(1200.0, 3600.0);
        n.ranks.extend(job(
            j,
            1001,
            &[4, 5],
            Load::Bursty { lo: 0.15, hi: 0.85 },
            24.0,
            None,
            None,
            (t, t + d),
        ));
        t += d + rng.range(5.0, 60.0);
        j += 1;
    }
    n
}

/// Two inference servers: job 50 on GPUs 0-3 holding 95 % of each (vLLM-style preallocation),
/// bursty; job 60 on GPUs 4-7, idle for stretches of up to 20 minutes between bursts.
fn inference(seed: u64) -> Node {
    // Both mark their decode steps (replicas of one model: independent, no collective).
    let mut ranks = stepping(
        job(
            50,
            1000,
            &[0, 1, 2, 3],
            Load::Bursty { lo: 0.05, hi: 0.9 },
            0.95 * 79.6 - 0.6,
            None,
            None,
            (0.0, f64::MAX),
        ),
        0.05,
    );
    ranks.extend(stepping(
        job(
            60,
            1001,
            &[4, 5, 6, 7],
            Load::IdleServer { max_idle_s: 1200.0 },
            40.0,
            None,
            None,
            (0.0, f64::MAX),
        ),
        0.05,
    ));
    Node {
        seed,
        ranks,
        overlays: Vec::new(),
        nics: vec![PORT.into()],
        nic_background_per_h: 4.0,
    }
}

/// Every GPU shared by three or four jobs under thread limits that add up to at most 100 %
/// (intended packing): each GPU is saturated, as intended.
fn packed(seed: u64) -> Node {
    let mut ranks = Vec::new();
    let mut j = 70;
    for g in 0..GPUS {
        let k = 3 + g % 2;
        for _ in 0..k {
            let pct = (100 / k) as u8;
            ranks.extend(job(
                j,
                1000 + j,
                &[g],
                Load::Steady(0.95),
                10.0,
                Some(pct),
                Some(18.0),
                (0.0, f64::MAX),
            ));
            j += 1;
        }
    }
    Node {
        seed,
        ranks,
        overlays: Vec::new(),
        nics: vec![PORT.into()],
        nic_background_per_h: 4.0,
    }
}
