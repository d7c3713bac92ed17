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

#[derive(Debug, Clone, Default)]
struct RuleState {
    active: Option<Finding>,
    bad_since: Option<f64>,
    good_since: Option<f64>,
}

/// Counter history for per-minute rates.
#[derive(Debug, Default)]
struct Series(VecDeque<(f64, u64)>);

const RATE_HORIZON_S: f64 = 60.0;

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
        // Too short a span turns one count into a high rate: wait for half the horizon.
        if t - t0 < RATE_HORIZON_S / 2.0 {
            return None;
        }
        Some((v - v0) as f64 * 60.0 / (t - t0))
    }
}

pub struct Detector {
    rules: Vec<Rule>,
    states: BTreeMap<(RuleId, Subject), RuleState>,
    series: BTreeMap<(RuleId, Subject), Series>,
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
        if rule.breaches(v) {
            st.good_since = None;
            match &mut st.active {
                Some(f) => {
                    f.value = v;
                    f.detail = m.detail.clone();
                }
                None => {
                    let since = *st.bad_since.get_or_insert(t);
                    if t - since >= rule.window_s - 1e-9 {
                        let f = finding(FindingState::Raised);
                        st.active = Some(f.clone());
                        st.bad_since = None;
                        out.push(f);
                    }
                }
            }
        } else if rule.recovered(v) {
            st.bad_since = None;
            if let Some(active) = &st.active {
                let since = *st.good_since.get_or_insert(t);
                if t - since >= rule.clear_s - 1e-9 {
                    let mut f = finding(FindingState::Cleared);
                    f.owner = f.owner.or(active.owner);
                    st.active = None;
                    st.good_since = None;
                    out.push(f);
                }
            }
        } else {
            // Between the thresholds: a streak toward raising or clearing is broken.
            st.bad_since = None;
            st.good_since = None;
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
            Measure::RankUtilVsPeers => self.rank_util_vs_peers(tick),
            Measure::JobMemorySpread => self.job_memory_spread(tick),
            Measure::MemoryUsed => self.memory_used(tick),
            Measure::GpuShare => self.gpu_share(tick),
            Measure::ServerSaturated => self.server_saturated(tick),
            Measure::IdleAllocation => self.idle_allocation(tick),
            Measure::NicErrorRate => self.nic_error_rate(rule, tick),
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

    fn clock_vs_peers(&mut self, tick: &Tick) -> Vec<Measured> {
        let busy: Vec<(u32, f64)> = tick
            .gpus
            .iter()
            .filter_map(GpuReading::sample)
            .filter(|s| s.util.is_some_and(|u| u >= 0.5))
            .filter_map(|s| Some((s.gpu, s.sm_clock_mhz? as f64)))
            .collect();
        busy.iter()
            .map(|&(g, c)| {
                let peers: Vec<f64> = busy.iter().filter(|(o, _)| *o != g).map(|p| p.1).collect();
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

    fn rank_util_vs_peers(&mut self, tick: &Tick) -> Vec<Measured> {
        let ranks: Vec<(&ClientSample, Owner, Option<f64>)> = tick
            .clients
            .iter()
            .filter_map(|c| Some((c, c.owner?, client_util(tick, c))))
            .collect();
        ranks
            .iter()
            .map(|&(c, o, u)| {
                let peers: Vec<f64> = ranks
                    .iter()
                    .filter(|(p, po, _)| po.job == o.job && p.pid != c.pid)
                    .filter_map(|(_, _, u)| *u)
                    .collect();
                let m = median(peers).filter(|m| *m >= 0.2);
                Measured {
                    subject: Subject::Client {
                        gpu: c.gpu,
                        pid: c.pid,
                    },
                    value: u.zip(m).map(|(u, m)| u / m),
                    gpu: Some(c.gpu),
                    owner: Some(o),
                    others: Vec::new(),
                    detail: format!(
                        "utilization {:.0} % vs peers' median {:.0} %",
                        u.unwrap_or(0.0) * 100.0,
                        m.unwrap_or(0.0) * 100.0
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

    fn memory_used(&mut self, tick: &Tick) -> Vec<Measured> {
        tick.gpus
            .iter()
            .filter_map(GpuReading::sample)
            .map(|s| {
                let v = s
                    .mem_used_bytes
                    .zip(s.mem_total_bytes.filter(|t| *t > 0))
                    .map(|(u, t)| u as f64 / t as f64);
                let top = tick
                    .clients
                    .iter()
                    .filter(|c| c.gpu == s.gpu)
                    .max_by_key(|c| c.mem_used_bytes.unwrap_or(0));
                let owner = top.and_then(|c| c.owner);
                Measured {
                    subject: Subject::Gpu { gpu: s.gpu },
                    value: v,
                    gpu: Some(s.gpu),
                    owner,
                    others: owners_on(tick, s.gpu, owner.map(|o| o.job)),
                    detail: format!(
                        "{:.1} of {:.1} GiB used, most by pid {}",
                        rules::gib(s.mem_used_bytes.unwrap_or(0)),
                        rules::gib(s.mem_total_bytes.unwrap_or(0)),
                        top.map(|c| c.pid).unwrap_or(0)
                    ),
                }
            })
            .collect()
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
        for c in &tick.clients {
            if let (Some(slot), Some(o)) = (c.slot, c.owner) {
                servers.entry((c.gpu, slot)).or_default().insert(o);
            }
        }
        let keys: Vec<(u32, u32)> = servers.keys().copied().collect();
        servers
            .iter()
            .map(|(&(gpu, slot), owners)| {
                let jobs: BTreeSet<u32> = owners.iter().map(|o| o.job).collect();
                let alone = keys.iter().all(|k| k.0 != gpu || k.1 == slot);
                let util = tick.gpu(gpu).and_then(|s| s.util);
                let v = match (jobs.len() >= 2, alone) {
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
        tick.clients
            .iter()
            .map(|c| {
                let held = c.mem_used_bytes.unwrap_or(0);
                // Beside a busy client, a client computing nothing may be starved, not
                // idle: no verdict then.
                let crowded = tick.clients.iter().any(|o| {
                    o.gpu == c.gpu && o.pid != c.pid && o.sm_util.is_some_and(|u| u >= 0.5)
                });
                let v = if held < IDLE_ALLOCATION_BYTES {
                    Some(0.0)
                } else if crowded {
                    None
                } else {
                    client_util(tick, c).map(|u| if u <= 0.01 { 1.0 } else { 0.0 })
                };
                Measured {
                    subject: Subject::Client {
                        gpu: c.gpu,
                        pid: c.pid,
                    },
                    value: v,
                    gpu: Some(c.gpu),
                    owner: c.owner,
                    others: Vec::new(),
                    detail: format!(
                        "pid {} holds {:.1} GiB and computes nothing",
                        c.pid,
                        rules::gib(held)
                    ),
                }
            })
            .collect()
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
        assert_eq!(s.push(30.0, 110), Some(20.0));
        assert_eq!(s.push(60.0, 5), None, "went down: reset, no rate");
        assert_eq!(s.push(90.0, 5), Some(0.0));
        assert_eq!(
            s.push(200.0, 10),
            Some(5.0 * 60.0 / 110.0),
            "one reading older than the horizon is kept"
        );
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }
}
