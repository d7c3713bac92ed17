//! Runs the detector over each case and scores its findings against the labels: per rule the
//! cases found (recall), the raised findings that were right (precision), the time from onset to
//! the finding (time to detect), and false alarms per node-day on the healthy node-hours.

use crate::cases::{About, Case};
use crate::sampler::{Sampler, Sampling};
use mpsr_telemetry::{Detector, Finding, FindingState, Subject, Tick};
use std::collections::BTreeMap;

/// A raise after the condition ended still counts within this (the last window was filling).
const LATE_S: f64 = 60.0;

#[derive(Debug, Clone, Default)]
pub struct RuleScore {
    /// Positive cases labelled with this rule, and those found.
    pub cases: u32,
    pub found: u32,
    /// The same, for conditions lasting >= 30 s at a duty cycle >= 50 % (the goals).
    pub goal_cases: u32,
    pub goal_found: u32,
    /// Seconds from onset to the finding, per found case.
    pub ttd: Vec<f64>,
    /// Raised findings: right ones and false ones (in positive cases and on healthy nodes).
    pub right: u32,
    pub wrong: u32,
    /// False ones on the healthy node-hours alone.
    pub healthy_wrong: u32,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub rules: BTreeMap<String, RuleScore>,
    pub healthy_hours: f64,
    pub cases: u32,
    pub ticks: u64,
    pub seconds: f64,
    /// The labels not found, as "case: rule" (for `--misses`).
    pub misses: Vec<String>,
    /// Findings that were false alarms, for `--misses`.
    pub wrong: Vec<String>,
    /// Every label: (case, rule, seconds to detect where found), for `--cases`.
    pub labels: Vec<(String, String, Option<f64>)>,
}

impl Report {
    pub fn false_alarms_per_day(&self, s: &RuleScore) -> f64 {
        s.healthy_wrong as f64 / (self.healthy_hours / 24.0).max(1e-9)
    }
    pub fn total_false_alarms_per_day(&self) -> f64 {
        let n: u32 = self.rules.values().map(|s| s.healthy_wrong).sum();
        n as f64 / (self.healthy_hours / 24.0).max(1e-9)
    }
}

fn about_matches(about: &About, f: &Finding) -> bool {
    match about {
        About::Node => true,
        About::Gpu(g) => f.gpu == Some(*g),
        About::Client(g, pid) => {
            matches!(f.subject, Subject::Client { gpu, pid: p } if gpu == *g && p == *pid)
                || f.owner.is_some_and(|o| o.task == *pid)
        }
        About::Job(j) => f.jobs().contains(j),
        About::Nic(p) => matches!(&f.subject, Subject::Nic { port } if port == p),
    }
}

/// The raised findings of one case, with their time.
pub fn run_case(
    case: &Case,
    sampling: Sampling,
    rules: &dyn Fn() -> Detector,
) -> (Vec<Finding>, u64) {
    let mut det = rules();
    let mut sampler = Sampler::new(sampling);
    let mut out = Vec::new();
    let mut t = 0.0;
    let mut n = 0;
    while t <= case.duration_s {
        let truth = case.node.truth(t);
        let json = sampler.round(&truth);
        let tick: Tick = match serde_json::from_value(json) {
            Ok(t) => t,
            Err(e) => panic!("a round the telemetry crate cannot read: {e}"),
        };
        out.extend(
            det.observe(&tick)
                .into_iter()
                .filter(|f| f.state == FindingState::Raised),
        );
        t += sampling.interval_s;
        n += 1;
    }
    (out, n)
}

/// Scores every case.
pub fn score(cases: &[Case], sampling: Sampling, rules: &dyn Fn() -> Detector) -> Report {
    let started = std::time::Instant::now();
    let mut rep = Report::default();
    for case in cases {
        let (raised, n) = run_case(case, sampling, rules);
        rep.ticks += n;
        rep.cases += 1;
        if case.healthy {
            rep.healthy_hours += case.duration_s / 3600.0;
        }
        let during = |l: &crate::cases::Label, f: &Finding| {
            about_matches(&l.about, f) && f.t >= l.start && f.t <= l.end + LATE_S
        };
        for l in &case.labels {
            let s = rep.rules.entry(l.rule.to_string()).or_default();
            s.cases += 1;
            let goal = l.end - l.start >= 30.0 && case.duty >= 0.5;
            s.goal_cases += goal as u32;
            let hit = raised
                .iter()
                .find(|f| f.rule.name() == l.rule && during(l, f));
            rep.labels.push((
                case.name.clone(),
                l.rule.to_string(),
                hit.map(|f| f.t - l.start),
            ));
            if let Some(f) = hit {
                s.found += 1;
                s.goal_found += goal as u32;
                s.ttd.push(f.t - l.start);
            } else {
                rep.misses.push(format!("{}: {}", case.name, l.rule));
            }
        }
        for f in &raised {
            let name = f.rule.name();
            let right = case.labels.iter().any(|l| l.rule == name && during(l, f));
            // A rule that also describes a labelled condition is neither right nor wrong there.
            let tolerated = case
                .labels
                .iter()
                .any(|l| l.also.contains(&name) && during(l, f));
            let s = rep.rules.entry(name.to_string()).or_default();
            if right {
                s.right += 1;
            } else if !tolerated {
                rep.wrong.push(format!(
                    "{}: {} {:?} at {:.0} s",
                    case.name, name, f.subject, f.t
                ));
                s.wrong += 1;
                s.healthy_wrong += case.healthy as u32;
            }
        }
    }
    rep.seconds = started.elapsed().as_secs_f64();
    rep
}

pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    Some(v[i])
}
