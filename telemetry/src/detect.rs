//! Turns rounds of telemetry into findings: each rule's measure per subject, then a small state
//! machine per (rule, subject) with the rule's window and hysteresis. A value that cannot be
//! measured this round (not supported, a gap) changes nothing: it neither confirms nor clears.

use crate::rules::{self, Measure, Rule, RuleId, Severity, IDLE_ALLOCATION_BYTES};
use crate::sample::{ClientSample, GpuReading, GpuSample, Owner, Tick};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// What a finding is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Subject {
    Gpu {
        gpu: u32,
    },
    Client {
        gpu: u32,
        pid: u32,
    },
    Job {
        job: u32,
    },
    /// One MPS server (fault domain slot) on a GPU.
    Server {
        gpu: u32,
        slot: u32,
    },
    Nic {
        port: String,
    },
    /// The node as a whole (all its GPUs at once).
    Node,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingState {
    Raised,
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub rule: RuleId,
    pub severity: Severity,
    pub state: FindingState,
    pub subject: Subject,
    pub gpu: Option<u32>,
    /// The job rank the finding is about or attributed to.
    pub owner: Option<Owner>,
    /// The other jobs concerned (those on the GPU, or sharing it with a hog).
    pub others: Vec<Owner>,
    pub value: f64,
    pub threshold: f64,
    /// Round time (seconds, the source's monotonic clock).
    pub t: f64,
    /// For people only.
    pub detail: String,
}

impl Finding {
    /// Every job the finding concerns.
    pub fn jobs(&self) -> BTreeSet<u32> {
        self.owner
            .iter()
            .chain(&self.others)
            .map(|o| o.job)
            .chain(match self.subject {
                Subject::Job { job } => Some(job),
                _ => None,
            })
            .collect()
    }
}

/// One measured value, who it is about and what to say.
struct Measured {
    subject: Subject,
    value: Option<f64>,
    gpu: Option<u32>,
    owner: Option<Owner>,
    others: Vec<Owner>,
    detail: String,
}

/// How one reading stands against a rule's thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Bad,
    Between,
    Good,
}

/// Per (rule, subject): its finding if raised, and its recent readings. A rule raises on the
/// *fraction* of bad readings in its window (windowed evidence: one good reading does not undo
/// a flapping condition, and a value that sits at its threshold is raised), and clears once
/// nearly all readings of its clear window are good.
#[derive(Debug, Clone, Default)]
struct RuleState {
    active: Option<Finding>,
    readings: VecDeque<(f64, Reading)>,
}

/// Share of good readings a clear window needs.
const CLEAR_GOOD: f64 = 0.9;

impl RuleState {
    /// (readings, bad, good) within [t - span, t], and how far back they reach.
    fn evidence(&self, t: f64, span: f64) -> (usize, usize, usize, f64) {
        let mut n = (0, 0, 0, 0.0f64);
        for (at, r) in self.readings.iter().rev() {
            if t - at > span + 1e-9 {
                break;
            }
            n.0 += 1;
            n.1 += (*r == Reading::Bad) as usize;
            n.2 += (*r == Reading::Good) as usize;
            n.3 = t - at;
        }
        n
    }
}

/// Counter history for per-minute rates.
#[derive(Debug, Default)]
struct Series(VecDeque<(f64, u64)>);

const RATE_HORIZON_S: f64 = 60.0;
/// A rate over a span shorter than half the horizon counts only with this many events in it, over
/// at least this long (three events in ten seconds of a counter that grows a few times a day is
/// not noise).
const RATE_MIN_EVENTS: u64 = 3;
const RATE_MIN_SPAN_S: f64 = 10.0;

impl Series {
    /// Adds a reading; returns the growth per minute over the horizon, `None` until two
    /// readings exist (and right after a reset).
    fn push(&mut self, t: f64, v: u64) -> Option<f64> {
        if let Some(&(_, last)) = self.0.back() {
            if v < last {
                self.0.clear(); // reset (driver reload, counter cleared): start over
            }
        }
        self.0.push_back((t, v));
        while self.0.len() > 2 && t - self.0[1].0 >= RATE_HORIZON_S {
            self.0.pop_front();
        }
        let &(t0, v0) = self.0.front()?;
        // Too short a span turns one count into a high rate: half the horizon, unless enough
        // events came for the rate to mean something (a storm is seen in seconds).
        let whole = (t - t0 >= RATE_HORIZON_S / 2.0).then(|| (v - v0) as f64 * 60.0 / (t - t0));
        // The recent part of the horizon alone, where enough events came in it: a storm that
        // began 15 s ago is not diluted by the quiet 45 s before it.
        let recent = self
            .0
            .iter()
            .filter(|(ti, vi)| t - ti >= RATE_MIN_SPAN_S && v - vi >= RATE_MIN_EVENTS)
            .map(|(ti, vi)| (v - vi) as f64 * 60.0 / (t - ti))
            .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))));
        match (whole, recent) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

pub struct Detector {
    rules: Vec<Rule>,
    states: BTreeMap<(RuleId, Subject), RuleState>,
    series: BTreeMap<(RuleId, Subject), Series>,
    /// Each GPU's memory used over the last `MEM_GROWTH_S` (near_oom: full *and* growing).
    mem_history: BTreeMap<u32, VecDeque<(f64, u64)>>,
    /// Per (gpu, pid): its step times of the last minutes (the spike rule's baseline).
    step_history: BTreeMap<(u32, u32), VecDeque<(f64, f64)>>,
}

/// How far back a GPU's memory growth is looked for.
const MEM_GROWTH_S: f64 = 600.0;

/// A rank below this share of its peers' utilization is paused (a checkpoint), not slow.
const PAUSED: f64 = 0.15;

/// A step-time baseline covers this long, leaves out the last this-many seconds, and needs this
/// many rounds.
const STEP_BASELINE_S: f64 = 300.0;
const STEP_BASELINE_GAP_S: f64 = 30.0;
const STEP_BASELINE_MIN: usize = 20;

/// A rank's step time now: its last steps' median, or how long the step under way has run when
/// that is longer (a stall shows before the step ends).
fn step_now(c: &ClientSample) -> Option<f64> {
    let s = c.steps?;
    Some(s.step_s?.max(s.age_s.unwrap_or(0.0)))
}

/// A rank's slowest step now: the longest step that ended this round, else how long the step
/// under way has run (one long step among many short ones is what a spike is; a median hides it).
fn step_worst(c: &ClientSample) -> Option<f64> {
    let s = c.steps?;
    s.max_s.or(s.age_s).or(s.step_s)
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// A client's utilization: its own where NVML gives one, else its GPU's when it is the GPU's
/// only client.
pub fn client_util(tick: &Tick, c: &ClientSample) -> Option<f64> {
    if let Some(u) = c.sm_util {
        return Some(u);
    }
    let alone = tick.clients.iter().filter(|o| o.gpu == c.gpu).count() == 1;
    if alone {
        tick.gpu(c.gpu)?.util
    } else {
        None
    }
}

/// A GPU's measurement, with the jobs on that GPU as the others a finding names.
fn gpu_measured(tick: &Tick, gpu: u32, value: Option<f64>, detail: String) -> Measured {
    Measured {
        subject: Subject::Gpu { gpu },
        value,
        gpu: Some(gpu),
        owner: None,
        others: owners_on(tick, gpu, None),
        detail,
    }
}

fn owners_on(tick: &Tick, gpu: u32, except: Option<u32>) -> Vec<Owner> {
    let set: BTreeSet<Owner> = tick
        .clients
        .iter()
        .filter(|c| c.gpu == gpu)
        .filter_map(|c| c.owner)
        .filter(|o| Some(o.job) != except)
        .collect();
    set.into_iter().collect()
}

impl Detector {
    pub fn new(rules: Vec<Rule>) -> Detector {
        Detector {
            rules,
            states: BTreeMap::new(),
            series: BTreeMap::new(),
            mem_history: BTreeMap::new(),
            step_history: BTreeMap::new(),
        }
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Resumes findings that were active before a restart: they clear by the rules' hysteresis,
    /// not by the restart (a node drained for one stays drained until the condition is gone).
    pub fn restore(&mut self, active: Vec<Finding>) {
        for f in active {
            if self.rules.iter().any(|r| r.id == f.rule) {
                let st = self.states.entry((f.rule, f.subject.clone())).or_default();
                st.active = Some(f);
            }
        }
    }

    /// The findings raised and not cleared, with their latest values.
    pub fn active(&self) -> Vec<Finding> {
        self.states
            .values()
            .filter_map(|s| s.active.clone())
            .collect()
    }

    /// Feeds one round; returns the findings raised or cleared by it.
    pub fn observe(&mut self, tick: &Tick) -> Vec<Finding> {
        let mut out = Vec::new();
        for i in 0..self.rules.len() {
            let rule = self.rules[i]; // a copy: measuring borrows self mutably (counter series)
            for m in self.measure(&rule, tick) {
                self.step(&rule, tick.t, m, &mut out);
            }
        }
        self.forget_gone(tick, &mut out);
        out
    }

    fn step(&mut self, rule: &Rule, t: f64, m: Measured, out: &mut Vec<Finding>) {
        let Some(v) = m.value else { return };
        let st = self.states.entry((rule.id, m.subject.clone())).or_default();
        let finding = |state| Finding {
            rule: rule.id,
            severity: rule.severity,
            state,
            subject: m.subject.clone(),
            gpu: m.gpu,
            owner: m.owner,
            others: m.others.clone(),
            value: v,
            threshold: rule.raise,
            t,
            detail: m.detail.clone(),
        };
        let reading = if rule.breaches(v) {
            Reading::Bad
        } else if rule.recovered(v) {
            Reading::Good
        } else {
            Reading::Between
        };
        st.readings.push_back((t, reading));
        let keep = rule.window_s.max(rule.clear_s) + 1.0;
        while st.readings.front().is_some_and(|(at, _)| t - at > keep) {
            st.readings.pop_front();
        }
        match &mut st.active {
            Some(f) => {
                if reading == Reading::Bad {
                    f.value = v;
                    f.detail = m.detail.clone();
                }
                let (n, _, good, reach) = st.evidence(t, rule.clear_s);
                let cleared = reading == Reading::Good
                    && (rule.clear_s <= 0.0
                        || (reach >= rule.clear_s * 0.5 && good as f64 >= CLEAR_GOOD * n as f64));
                if cleared {
                    // Cleared about what was raised (its GPU, owner and the others it named): a
                    // job's measurement may come from another of its GPUs by now.
                    let Some(mut f) = st.active.take() else {
                        return;
                    };
                    f.state = FindingState::Cleared;
                    f.value = v;
                    f.t = t;
                    f.detail = m.detail.clone();
                    st.readings.clear();
                    out.push(f);
                }
            }
            None => {
                let (n, bad, _, reach) = st.evidence(t, rule.window_s);
                let raised = reading == Reading::Bad
                    && (rule.window_s <= 0.0
                        || (reach >= rule.window_s * 0.5 && bad as f64 >= rule.duty * n as f64));
                if raised {
                    let f = finding(FindingState::Raised);
                    // The clear window counts only what came after the raise: the good readings
                    // from before the condition began say nothing of its end.
                    st.readings.clear();
                    st.readings.push_back((t, reading));
                    st.active = Some(f.clone());
                    out.push(f);
                }
            }
        }
    }

    /// Findings about clients or jobs that are gone are cleared (and their state dropped).
    fn forget_gone(&mut self, tick: &Tick, out: &mut Vec<Finding>) {
        let pids: BTreeSet<(u32, u32)> = tick.clients.iter().map(|c| (c.gpu, c.pid)).collect();
        let jobs: BTreeSet<u32> = tick
            .clients
            .iter()
            .filter_map(|c| c.owner.map(|o| o.job))
            .collect();
        let servers: BTreeSet<(u32, u32)> = tick
            .clients
            .iter()
            .filter_map(|c| Some((c.gpu, c.slot?)))
            .collect();
        let gone = |s: &Subject| match s {
            Subject::Client { gpu, pid } => !pids.contains(&(*gpu, *pid)),
            Subject::Job { job } => !jobs.contains(job),
            Subject::Server { gpu, slot } => !servers.contains(&(*gpu, *slot)),
            _ => false,
        };
        let t = tick.t;
        self.states.retain(|(_, s), st| {
            if !gone(s) {
                return true;
            }
            if let Some(mut f) = st.active.take() {
                f.state = FindingState::Cleared;
                f.t = t;
                f.detail = "gone".into();
                out.push(f);
            }
            false
        });
        self.series.retain(|(_, s), _| !gone(s));
    }

    fn rate(&mut self, rule: RuleId, subject: &Subject, t: f64, v: Option<u64>) -> Option<f64> {
        let s = self.series.entry((rule, subject.clone())).or_default();
        s.push(t, v?)
    }

    fn measure(&mut self, rule: &Rule, tick: &Tick) -> Vec<Measured> {
        match rule.measure {
            Measure::Gpu(f) => self.gpu_value(rule, tick, f),
            Measure::GpuRate(f) => self.gpu_rate(rule, tick, f),
            Measure::PcieReplayBound => self.pcie_replay_bound(rule, tick),
            Measure::GpuUnreadable => self.gpu_unreadable(tick),
            Measure::ClockVsPeers => self.clock_vs_peers(tick),
            Measure::NodeClockVsMax => self.node_clock_vs_max(tick),
            Measure::RankUtilVsPeers => self.rank_util_vs_peers(tick),
            Measure::JobMemorySpread => self.job_memory_spread(tick),
            Measure::MemoryUsed => self.memory_used(rule, tick),
            Measure::GpuShare => self.gpu_share(tick),
            Measure::ServerSaturated => self.server_saturated(tick),
            Measure::IdleAllocation => self.idle_allocation(tick),
            Measure::NicErrorRate => self.nic_error_rate(rule, tick),
            Measure::StepVsPeers => self.step_vs_peers(tick),
            Measure::StepVsBaseline => self.step_vs_baseline(tick),
        }
    }

    fn gpu_value(
        &mut self,
        rule: &Rule,
        tick: &Tick,
        f: fn(&GpuSample) -> Option<f64>,
    ) -> Vec<Measured> {
        tick.gpus
            .iter()
            .filter_map(GpuReading::sample)
            .map(|s| {
                let v = f(s);
                let detail = match rule.id {
                    RuleId::HwSlowdown => format!(
                        "clock events {}, SM {} MHz",
                        crate::sample::clock_event::names(s.clock_events.unwrap_or(0)).join(","),
                        s.sm_clock_mhz.unwrap_or(0)
                    ),
                    _ => format!("{} = {:.2}", rule.name, v.unwrap_or(f64::NAN)),
                };
                gpu_measured(tick, s.gpu, v, detail)
            })
            .collect()
    }

    fn gpu_rate(
        &mut self,
        rule: &Rule,
        tick: &Tick,
        f: fn(&GpuSample) -> Option<u64>,
    ) -> Vec<Measured> {
        let samples: Vec<_> = tick.gpus.iter().filter_map(GpuReading::sample).collect();
        samples
            .into_iter()
            .map(|s| {
                let subj = Subject::Gpu { gpu: s.gpu };
                let v = self.rate(rule.id, &subj, tick.t, f(s));
                gpu_measured(
                    tick,
                    s.gpu,
                    v,
                    format!("{:.1} per minute", v.unwrap_or(0.0)),
                )
            })
            .collect()
    }

    fn pcie_replay_bound(&mut self, rule: &Rule, tick: &Tick) -> Vec<Measured> {
        let samples: Vec<_> = tick.gpus.iter().filter_map(GpuReading::sample).collect();
        samples
            .into_iter()
            .map(|s| {
                let subj = Subject::Gpu { gpu: s.gpu };
                let rate = self.rate(rule.id, &subj, tick.t, s.pcie_replays);
                let bound = s
                    .pcie_gen_max
                    .zip(s.pcie_width_max)
                    .and_then(|(g, w)| rules::pcie_replay_bound_per_min(g, w));
                let v = rate.zip(bound).map(|(r, b)| r / b);
                gpu_measured(
                    tick,
                    s.gpu,
                    v,
                    format!(
                        "{:.1} replays per minute (bound {:.0})",
                        rate.unwrap_or(0.0),
                        bound.unwrap_or(0.0)
                    ),
                )
            })
            .collect()
    }

    fn gpu_unreadable(&mut self, tick: &Tick) -> Vec<Measured> {
        tick.gpus
            .iter()
            .map(|r| {
                let v = match r {
                    GpuReading::Lost { .. } => Some(1.0),
                    GpuReading::Sample(_) => Some(0.0),
                    GpuReading::Gap { .. } => None,
                };
                gpu_measured(tick, r.gpu(), v, "NVML: GPU lost".into())
            })
            .collect()
    }

    /// Busy GPUs whose clock no power or thermal management explains: (gpu, SM clock, max).
    fn unexplained_clocks(tick: &Tick) -> Vec<(u32, f64, Option<f64>)> {
        use crate::sample::clock_event::GPU_IDLE;
        tick.gpus
            .iter()
            .filter_map(GpuReading::sample)
            .filter(|s| s.util.is_some_and(|u| u >= 0.5))
            .filter(|s| s.clock_events.is_some_and(|b| b & !GPU_IDLE == 0))
            .filter_map(|s| {
                Some((
                    s.gpu,
                    s.sm_clock_mhz? as f64,
                    s.sm_clock_max_mhz.map(f64::from),
                ))
            })
            .collect()
    }

    fn clock_vs_peers(&mut self, tick: &Tick) -> Vec<Measured> {
        let busy = Self::unexplained_clocks(tick);
        busy.iter()
            .map(|&(g, c, _)| {
                let peers: Vec<f64> = busy
                    .iter()
                    .filter(|(o, _, _)| *o != g)
                    .map(|p| p.1)
                    .collect();
                let m = median(peers).filter(|m| *m > 0.0);
                gpu_measured(
                    tick,
                    g,
                    m.map(|m| c / m),
                    format!("SM {c:.0} MHz vs peers' median {:.0}", m.unwrap_or(0.0)),
                )
            })
            .collect()
    }

    fn node_clock_vs_max(&mut self, tick: &Tick) -> Vec<Measured> {
        let ratios: Vec<f64> = Self::unexplained_clocks(tick)
            .into_iter()
            .filter_map(|(_, c, max)| Some(c / max.filter(|m| *m > 0.0)?))
            .collect();
        let n = ratios.len();
        // The fastest of them: a node is slow when even that one is (one slow GPU among fast
        // ones is `clock_skew`'s, and must not pull a node value down).
        let v = (n >= 2).then(|| ratios.iter().copied().fold(0.0, f64::max));
        let others: BTreeSet<Owner> = tick.clients.iter().filter_map(|c| c.owner).collect();
        vec![Measured {
            subject: Subject::Node,
            value: v,
            gpu: None,
            owner: None,
            others: others.into_iter().collect(),
            detail: format!(
                "{n} busy GPUs, the fastest at {:.0} % of its maximum SM clock, no clock-event reason",
                v.unwrap_or(0.0) * 100.0
            ),
        }]
    }

    fn rank_util_vs_peers(&mut self, tick: &Tick) -> Vec<Measured> {
        let ranks: Vec<(&ClientSample, Owner, Option<f64>)> = tick
            .clients
            .iter()
            .filter_map(|c| Some((c, c.owner?, client_util(tick, c))))
            .collect();
        // Tensor activity is per GPU: it is a rank's where the rank is its GPU's only client.
        let tensor = |c: &ClientSample| {
            let alone = tick.clients.iter().filter(|o| o.gpu == c.gpu).count() == 1;
            alone.then(|| tick.gpu(c.gpu)?.tensor_active).flatten()
        };
        ranks
            .iter()
            .map(|&(c, o, u)| {
                let peers: Vec<&(&ClientSample, Owner, Option<f64>)> = ranks
                    .iter()
                    .filter(|(p, po, _)| po.job == o.job && p.pid != c.pid)
                    .collect();
                let m =
                    median(peers.iter().filter_map(|(_, _, u)| *u).collect()).filter(|m| *m >= 0.2);
                // A rank near 0 against busy peers is paused (writing a checkpoint), not slow;
                // unless its GPU is busy with another client: then it is starved, and slow.
                let starved = tick
                    .clients
                    .iter()
                    .any(|o| o.gpu == c.gpu && o.pid != c.pid)
                    && tick
                        .gpu(c.gpu)
                        .and_then(|s| s.util)
                        .is_some_and(|g| g >= 0.9);
                let by_util = u
                    .zip(m)
                    .map(|(u, m)| u / m)
                    .filter(|r| *r >= PAUSED || starved);
                // Every rank busy: a slow rank's peers wait for it in a collective, spinning at
                // full utilization with idle tensor cores while it computes.
                let all_busy = u.is_some_and(|u| u >= 0.9)
                    && !peers.is_empty()
                    && peers.iter().all(|(_, _, pu)| pu.is_some_and(|x| x >= 0.9));
                let by_activity = all_busy
                    .then(|| {
                        let own = tensor(c).filter(|t| *t > 0.05)?;
                        let theirs: Option<Vec<f64>> =
                            peers.iter().map(|(p, _, _)| tensor(p)).collect();
                        Some(median(theirs?)? / own)
                    })
                    .flatten();
                let value = match (by_util, by_activity) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                Measured {
                    subject: Subject::Client {
                        gpu: c.gpu,
                        pid: c.pid,
                    },
                    value,
                    gpu: Some(c.gpu),
                    owner: Some(o),
                    others: Vec::new(),
                    detail: format!(
                        "utilization {:.0} % vs peers' median {:.0} %; pace {:.2}",
                        u.unwrap_or(0.0) * 100.0,
                        m.unwrap_or(0.0) * 100.0,
                        value.unwrap_or(f64::NAN)
                    ),
                }
            })
            .collect()
    }

    fn job_memory_spread(&mut self, tick: &Tick) -> Vec<Measured> {
        let mut jobs: BTreeMap<u32, Vec<(&ClientSample, Owner, u64)>> = BTreeMap::new();
        for c in &tick.clients {
            if let (Some(o), Some(m)) = (c.owner, c.mem_used_bytes) {
                jobs.entry(o.job).or_default().push((c, o, m));
            }
        }
        jobs.into_iter()
            .map(|(job, ranks)| {
                let max = ranks.iter().max_by_key(|r| r.2);
                let min = ranks.iter().min_by_key(|r| r.2);
                let (value, owner, detail) = match (max, min) {
                    (Some(hi), Some(lo)) if ranks.len() >= 2 => {
                        let v = if hi.2 - lo.2 < IDLE_ALLOCATION_BYTES {
                            1.0
                        } else {
                            hi.2 as f64 / (lo.2.max(1)) as f64
                        };
                        (
                            Some(v),
                            Some(hi.1),
                            format!(
                                "rank pid {} holds {:.1} GiB, rank pid {} {:.1} GiB",
                                hi.0.pid,
                                rules::gib(hi.2),
                                lo.0.pid,
                                rules::gib(lo.2)
                            ),
                        )
                    }
                    _ => (None, None, String::new()),
                };
                Measured {
                    subject: Subject::Job { job },
                    value,
                    gpu: owner.and_then(|o| ranks.iter().find(|r| r.1 == o).map(|r| r.0.gpu)),
                    owner,
                    others: Vec::new(),
                    detail,
                }
            })
            .collect()
    }

    fn memory_used(&mut self, rule: &Rule, tick: &Tick) -> Vec<Measured> {
        let mut out: Vec<Measured> = tick
            .clients
            .iter()
            .filter_map(|c| {
                let limit = c.mem_limit_bytes.filter(|l| *l > 0)?;
                let used = c.mem_used_bytes?;
                Some(Measured {
                    subject: Subject::Client {
                        gpu: c.gpu,
                        pid: c.pid,
                    },
                    value: Some(used as f64 / limit as f64),
                    gpu: Some(c.gpu),
                    owner: c.owner,
                    others: Vec::new(),
                    detail: format!(
                        "pid {} holds {:.1} of its {:.1} GiB limit",
                        c.pid,
                        rules::gib(used),
                        rules::gib(limit)
                    ),
                })
            })
            .collect();
        for s in tick.gpus.iter().filter_map(GpuReading::sample) {
            let (Some(used), Some(total)) =
                (s.mem_used_bytes, s.mem_total_bytes.filter(|t| *t > 0))
            else {
                continue;
            };
            let h = self.mem_history.entry(s.gpu).or_default();
            h.push_back((tick.t, used));
            while h.front().is_some_and(|(t, _)| tick.t - t > MEM_GROWTH_S) {
                h.pop_front();
            }
            let low = h.iter().map(|(_, u)| *u).min().unwrap_or(used);
            // Full and still growing; a preallocation that holds its share is intended.
            let growing = used.saturating_sub(low) >= IDLE_ALLOCATION_BYTES;
            let v = used as f64 / total as f64;
            let top = tick
                .clients
                .iter()
                .filter(|c| c.gpu == s.gpu)
                .max_by_key(|c| c.mem_used_bytes.unwrap_or(0));
            let owner = top.and_then(|c| c.owner);
            out.push(Measured {
                subject: Subject::Gpu { gpu: s.gpu },
                // Not growing: held between the thresholds, so a full GPU neither raises (an
                // intended preallocation) nor clears (a raised one stays until memory is freed).
                value: Some(if growing {
                    v
                } else {
                    v.min((rule.raise + rule.clear) / 2.0)
                }),
                gpu: Some(s.gpu),
                owner,
                others: owners_on(tick, s.gpu, owner.map(|o| o.job)),
                detail: format!(
                    "{:.1} of {:.1} GiB used, most by pid {}",
                    rules::gib(used),
                    rules::gib(total),
                    top.map(|c| c.pid).unwrap_or(0)
                ),
            });
        }
        out
    }

    fn gpu_share(&mut self, tick: &Tick) -> Vec<Measured> {
        tick.clients
            .iter()
            .map(|c| {
                let busy = tick
                    .gpu(c.gpu)
                    .and_then(|s| s.util)
                    .is_some_and(|u| u >= 0.95);
                let on: Vec<&ClientSample> =
                    tick.clients.iter().filter(|o| o.gpu == c.gpu).collect();
                let job = c.owner.map(|o| o.job);
                let shared = on
                    .iter()
                    .any(|o| o.owner.is_some() && o.owner.map(|x| x.job) != job);
                let total: f64 = on.iter().filter_map(|o| o.sm_util).sum();
                // No hog on a GPU that is not saturated or not shared: a clean value, so a
                // finding clears once the pressure is gone.
                let v = match (busy && shared && total > 0.0, c.sm_util) {
                    (true, Some(u)) => Some(u / total),
                    (false, Some(_)) => Some(0.0),
                    (_, None) => None,
                };
                Measured {
                    subject: Subject::Client {
                        gpu: c.gpu,
                        pid: c.pid,
                    },
                    value: v,
                    gpu: Some(c.gpu),
                    owner: c.owner,
                    others: owners_on(tick, c.gpu, job),
                    detail: format!(
                        "pid {} takes {:.0} % of the GPU's client utilization",
                        c.pid,
                        v.unwrap_or(0.0) * 100.0
                    ),
                }
            })
            .collect()
    }

    fn server_saturated(&mut self, tick: &Tick) -> Vec<Measured> {
        let mut servers: BTreeMap<(u32, u32), BTreeSet<Owner>> = BTreeMap::new();
        // Per server: whether every client has a thread limit (`--mps-threads`): none can then
        // take more than its share, so a saturated GPU is the packing its users asked for.
        let mut divided: BTreeMap<(u32, u32), bool> = BTreeMap::new();
        for c in &tick.clients {
            if let (Some(slot), Some(o)) = (c.slot, c.owner) {
                servers.entry((c.gpu, slot)).or_default().insert(o);
                let d = divided.entry((c.gpu, slot)).or_insert(true);
                *d &= c.thread_pct.is_some_and(|p| p < 100);
            }
        }
        let keys: Vec<(u32, u32)> = servers.keys().copied().collect();
        servers
            .iter()
            .map(|(&(gpu, slot), owners)| {
                let jobs: BTreeSet<u32> = owners.iter().map(|o| o.job).collect();
                let alone = keys.iter().all(|k| k.0 != gpu || k.1 == slot);
                let util = tick.gpu(gpu).and_then(|s| s.util);
                let intended = divided.get(&(gpu, slot)).is_some_and(|all| *all);
                let v = match (jobs.len() >= 2 && !intended, alone) {
                    (false, _) => Some(0.0),
                    // Other servers time-slice the GPU too: its utilization is not this one's.
                    (true, false) => None,
                    (true, true) => util,
                };
                let names: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
                Measured {
                    subject: Subject::Server { gpu, slot },
                    value: v,
                    gpu: Some(gpu),
                    owner: None,
                    others: owners.iter().copied().collect(),
                    detail: format!(
                        "gpu{gpu} server {slot} {:.0} % busy with jobs {} in it",
                        util.unwrap_or(0.0) * 100.0,
                        names.join(",")
                    ),
                }
            })
            .collect()
    }

    fn idle_allocation(&mut self, tick: &Tick) -> Vec<Measured> {
        let mut jobs: BTreeMap<u32, Vec<&ClientSample>> = BTreeMap::new();
        for c in &tick.clients {
            if let Some(o) = c.owner {
                jobs.entry(o.job).or_default().push(c);
            }
        }
        jobs.into_iter()
            .map(|(job, ranks)| {
                let held: u64 = ranks.iter().map(|c| c.mem_used_bytes.unwrap_or(0)).sum();
                let all_hold = ranks
                    .iter()
                    .all(|c| c.mem_used_bytes.unwrap_or(0) >= IDLE_ALLOCATION_BYTES);
                // A rank's own utilization, else its GPU's: a GPU at 0 is idle for all on it.
                let idle = |c: &ClientSample| {
                    client_util(tick, c)
                        .or_else(|| tick.gpu(c.gpu)?.util.filter(|u| *u <= 0.01))
                        .map(|u| u <= 0.01)
                };
                let v = if !all_hold {
                    Some(0.0)
                } else {
                    let each: Option<Vec<bool>> = ranks.iter().map(|c| idle(c)).collect();
                    each.map(|e| if e.iter().all(|x| *x) { 1.0 } else { 0.0 })
                };
                Measured {
                    subject: Subject::Job { job },
                    value: v,
                    gpu: ranks.first().map(|c| c.gpu),
                    owner: ranks.first().and_then(|c| c.owner),
                    others: Vec::new(),
                    detail: format!(
                        "job {job}'s {} rank(s) hold {:.1} GiB and compute nothing",
                        ranks.len(),
                        rules::gib(held)
                    ),
                }
            })
            .collect()
    }

    fn step_vs_peers(&mut self, tick: &Tick) -> Vec<Measured> {
        let ranks: Vec<(&ClientSample, Owner, f64)> = tick
            .clients
            .iter()
            .filter_map(|c| Some((c, c.owner?, step_now(c)?)))
            .collect();
        ranks
            .iter()
            .map(|&(c, o, s)| {
                let peers: Vec<f64> = ranks
                    .iter()
                    .filter(|(p, po, _)| po.job == o.job && p.pid != c.pid)
                    .map(|r| r.2)
                    .collect();
                let m = median(peers).filter(|m| *m > 0.0);
                Measured {
                    subject: Subject::Client {
                        gpu: c.gpu,
                        pid: c.pid,
                    },
                    value: m.map(|m| s / m),
                    gpu: Some(c.gpu),
                    owner: Some(o),
                    others: Vec::new(),
                    detail: format!(
                        "step {:.1} ms vs its peers' median {:.1} ms",
                        s * 1e3,
                        m.unwrap_or(0.0) * 1e3
                    ),
                }
            })
            .collect()
    }

    fn step_vs_baseline(&mut self, tick: &Tick) -> Vec<Measured> {
        let t = tick.t;
        let mut out = Vec::new();
        for c in &tick.clients {
            let (Some(s), Some(worst)) = (c.steps.and_then(|x| x.step_s), step_worst(c)) else {
                continue;
            };
            let h = self.step_history.entry((c.gpu, c.pid)).or_default();
            // The baseline: its steps of the 5 minutes before, not the last window's (a spike
            // must not raise its own baseline).
            let base: Vec<f64> = h
                .iter()
                .filter(|(at, _)| t - at >= STEP_BASELINE_GAP_S)
                .map(|(_, v)| *v)
                .collect();
            let enough = base.len() >= STEP_BASELINE_MIN;
            let b = median(base).filter(|b| *b > 0.0 && enough);
            h.push_back((t, s));
            while h.front().is_some_and(|(at, _)| t - at > STEP_BASELINE_S) {
                h.pop_front();
            }
            out.push(Measured {
                subject: Subject::Client {
                    gpu: c.gpu,
                    pid: c.pid,
                },
                value: b.map(|b| worst / b),
                gpu: Some(c.gpu),
                owner: c.owner,
                others: Vec::new(),
                detail: format!(
                    "step {:.1} ms vs its median {:.1} ms",
                    worst * 1e3,
                    b.unwrap_or(0.0) * 1e3
                ),
            });
        }
        let live: BTreeSet<(u32, u32)> = tick.clients.iter().map(|c| (c.gpu, c.pid)).collect();
        self.step_history.retain(|k, _| live.contains(k));
        out
    }

    fn nic_error_rate(&mut self, rule: &Rule, tick: &Tick) -> Vec<Measured> {
        let nics = tick.nics.clone();
        nics.iter()
            .map(|n| {
                let subject = Subject::Nic {
                    port: n.port.clone(),
                };
                let v = self.rate(rule.id, &subject, tick.t, n.errors);
                Measured {
                    subject,
                    value: v,
                    gpu: None,
                    owner: None,
                    others: Vec::new(),
                    detail: format!("{}: {:.1} errors per minute", n.port, v.unwrap_or(0.0)),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_restart_after_a_counter_reset() {
        let mut s = Series::default();
        assert_eq!(s.push(0.0, 100), None);
        assert_eq!(s.push(10.0, 101), None, "span too short for a rate");
        // Over the whole 30 s: 20 a minute; over the last 20 s (9 events): 27, the one given.
        assert_eq!(s.push(30.0, 110), Some(27.0));
        assert_eq!(s.push(60.0, 5), None, "went down: reset, no rate");
        assert_eq!(s.push(90.0, 5), Some(0.0));
        assert_eq!(
            s.push(200.0, 10),
            Some(5.0 * 60.0 / 110.0),
            "one reading older than the horizon is kept"
        );
    }

    fn rank(gpu: u32, pid: u32, gib: u64) -> ClientSample {
        ClientSample {
            gpu,
            pid,
            slot: None,
            mem_used_bytes: Some(gib << 30),
            sm_util: None,
            owner: Some(Owner {
                job: 10,
                step: 0,
                task: pid,
                uid: 1000,
            }),
            thread_pct: None,
            mem_limit_bytes: None,
            steps: None,
        }
    }

    /// A finding is cleared about what it was raised about: a job's memory skew raised on the
    /// GPU of its largest rank (1) is cleared naming GPU 1, though by then the largest rank (by a
    /// little) is the one on GPU 0. Before, the clear named GPU 0.
    #[test]
    fn a_finding_is_cleared_naming_the_gpu_it_was_raised_on() {
        let rule = crate::rules::RULES
            .iter()
            .find(|r| r.id == RuleId::MemoryImbalance)
            .unwrap();
        let mut d = Detector::new(vec![*rule]);
        let mut all = Vec::new();
        let mut t = 0.0;
        let mut run = |d: &mut Detector, ranks: [(u32, u64); 2], until: f64, t: &mut f64| {
            while *t < until {
                let tick = Tick {
                    t: *t,
                    gpus: Vec::new(),
                    clients: ranks
                        .iter()
                        .map(|&(g, gib)| rank(g, 100 + g, gib))
                        .collect(),
                    nics: Vec::new(),
                };
                all.extend(d.observe(&tick));
                *t += 1.0;
            }
        };
        run(&mut d, [(0, 10), (1, 40)], 60.0, &mut t);
        run(&mut d, [(0, 21), (1, 20)], 300.0, &mut t);
        let states: Vec<(FindingState, Option<u32>)> =
            all.iter().map(|f| (f.state, f.gpu)).collect();
        assert_eq!(
            states,
            vec![
                (FindingState::Raised, Some(1)),
                (FindingState::Cleared, Some(1))
            ],
            "{all:#?}"
        );
    }

    /// The GPM readings measured on an H100 under MPS (tests/gpu/results/
    /// 2026-12-06_H100_580.159.04_detect_run1): a bf16 GEMM read utilization 1.0, SM activity 0.96,
    /// tensor activity 0.94; a kernel spinning on a flag in GPU memory, as NCCL waits for a peer,
    /// read utilization 1.0, SM activity 0.48, tensor activity 0.0. A job whose rank on GPU 0
    /// computes while its ranks on GPUs 1-3 spin reads busy everywhere: the straggler rule names
    /// the computing rank by its peers' tensor activity, and nothing else.
    #[test]
    fn measured_gpm_of_a_computing_rank_and_spinning_peers_names_the_slow_rank() {
        let rule = crate::rules::RULES
            .iter()
            .find(|r| r.id == RuleId::Straggler)
            .unwrap();
        let mut d = Detector::new(vec![*rule]);
        let reading = |gpu: u32, sm: f64, tensor: f64| {
            GpuReading::Sample(Box::new(GpuSample {
                gpu,
                util: Some(1.0),
                sm_active: Some(sm),
                tensor_active: Some(tensor),
                ..GpuSample::default()
            }))
        };
        let mut found = Vec::new();
        for i in 0..30 {
            let tick = Tick {
                t: i as f64,
                gpus: vec![
                    reading(0, 0.964, 0.936),
                    reading(1, 0.485, 0.0),
                    reading(2, 0.485, 0.0),
                    reading(3, 0.485, 0.0),
                ],
                clients: (0..4).map(|g| rank(g, 100 + g, 10)).collect(),
                nics: Vec::new(),
            };
            found.extend(d.observe(&tick));
        }
        let raised: Vec<(Subject, f64)> = found
            .iter()
            .filter(|f| f.state == FindingState::Raised)
            .map(|f| (f.subject.clone(), f.t))
            .collect();
        assert_eq!(raised.len(), 1, "{found:#?}");
        assert_eq!(raised[0].0, Subject::Client { gpu: 0, pid: 100 });
        assert!(raised[0].1 <= 15.0, "raised within 15 s: {raised:?}");
    }

    fn stepping(pid: u32, job: u32, step_s: f64, age_s: f64) -> ClientSample {
        ClientSample {
            steps: Some(crate::steps::StepSample {
                steps: 100,
                step_s: Some(step_s),
                // A step under way longer than the usual one: none ended this round.
                max_s: (age_s <= step_s).then_some(step_s),
                age_s: Some(age_s),
            }),
            owner: Some(Owner {
                job,
                step: 0,
                task: pid,
                uid: 1000,
            }),
            ..rank(pid - 100, pid, 10)
        }
    }

    fn step_rules() -> Detector {
        Detector::new(
            crate::rules::RULES
                .iter()
                .filter(|r| matches!(r.id, RuleId::StepSkew | RuleId::StepSpike))
                .copied()
                .collect(),
        )
    }

    /// Step times (mpsr_step): a rank 1.5x slower than its job's three others is skewed; a rank
    /// whose step time triples is a spike, and so is one whose step has not ended for 3 s (a
    /// host-side stall); jitter of ±20 % and a job whose ranks all agree raise nothing.
    #[test]
    fn step_times_find_a_skewed_rank_a_spike_and_a_stall_and_nothing_in_jitter() {
        let run = |f: &dyn Fn(f64, u32) -> (f64, f64)| {
            let mut d = step_rules();
            let mut out = Vec::new();
            for i in 0..400 {
                let t = i as f64;
                let clients = (0..4u32)
                    .map(|k| {
                        let (s, age) = f(t, k);
                        stepping(100 + k, 7, s, age)
                    })
                    .collect();
                out.extend(d.observe(&Tick {
                    t,
                    gpus: Vec::new(),
                    clients,
                    nics: Vec::new(),
                }));
            }
            out.into_iter()
                .filter(|f| f.state == FindingState::Raised)
                .map(|f| (f.rule, f.subject, f.t))
                .collect::<Vec<_>>()
        };
        let jitter = |t: f64, k: u32| 0.1 * (1.0 + 0.2 * ((t * 1.7 + k as f64 * 2.3).sin()));
        assert!(run(&|t, k| (jitter(t, k), 0.05)).is_empty());
        let skew = run(&|t, k| {
            let s = jitter(t, k);
            (if k == 2 && t >= 100.0 { s * 1.5 } else { s }, 0.05)
        });
        assert_eq!(skew.len(), 1, "{skew:?}");
        assert_eq!(
            (skew[0].0, skew[0].1.clone()),
            (RuleId::StepSkew, Subject::Client { gpu: 2, pid: 102 })
        );
        assert!(
            skew[0].2 - 100.0 <= 15.0,
            "found after {} s",
            skew[0].2 - 100.0
        );
        let spike = run(&|t, k| {
            let s = jitter(t, k);
            (
                if (350.0..360.0).contains(&t) {
                    s * 3.0
                } else {
                    s
                },
                0.05,
            )
        });
        assert!(
            (0..4).all(|k| spike.iter().any(|f| f.0 == RuleId::StepSpike
                && f.1
                    == Subject::Client {
                        gpu: k,
                        pid: 100 + k
                    }
                && (350.0..355.0).contains(&f.2))),
            "{spike:?}"
        );
        let stall = run(&|t, k| {
            let s = jitter(t, k);
            let age = if k == 1 && t >= 350.0 {
                t - 349.0
            } else {
                0.05
            };
            (s, age)
        });
        assert!(
            stall.iter().any(|f| f.0 == RuleId::StepSpike
                && f.1 == Subject::Client { gpu: 1, pid: 101 }
                && f.2 <= 352.0),
            "{stall:?}"
        );
    }

    /// A rank that says it is idle (`mpsr_step_idle()`: a server waiting for requests) is no
    /// stall, however long it waits.
    #[test]
    fn an_idle_rank_is_no_stall() {
        let mut d = step_rules();
        let mut out = Vec::new();
        for i in 0..600 {
            let idle = i >= 300;
            let mut c = stepping(100, 7, 0.1, 0.05);
            if idle {
                c.steps = Some(crate::steps::StepSample {
                    steps: 100,
                    step_s: Some(0.1),
                    max_s: None,
                    age_s: None,
                });
            }
            out.extend(d.observe(&Tick {
                t: i as f64,
                gpus: Vec::new(),
                clients: vec![c],
                nics: Vec::new(),
            }));
        }
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }
}
