//! A job's ranks on one node (what each node's agent serves at `/v1/jobs/<id>`) and the
//! comparison `mpsrctl job-skew` makes across nodes, with the straggler rule's thresholds.

use crate::detect::{client_util, median};
use crate::rules::{RuleId, RULES};
use crate::snapshot::Snapshot;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankView {
    pub gpu: u32,
    pub pid: u32,
    pub step: u32,
    /// The registered Slurm task's pid.
    pub task: u32,
    /// The rank's utilization (its own where NVML gives one, else its GPU's when alone there).
    pub util: Option<f64>,
    pub mem_used_bytes: Option<u64>,
    pub gpu_util: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub power_w: Option<f64>,
    pub clock_events: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    pub node: String,
    pub simulated: bool,
    pub job: u32,
    pub ranks: Vec<RankView>,
}

/// The job's ranks in a snapshot.
pub fn job_view(s: &Snapshot, job: u32) -> JobView {
    let ranks = s
        .tick
        .clients
        .iter()
        .filter_map(|c| {
            let o = c.owner.filter(|o| o.job == job)?;
            let g = s.tick.gpu(c.gpu);
            Some(RankView {
                gpu: c.gpu,
                pid: c.pid,
                step: o.step,
                task: o.task,
                util: client_util(&s.tick, c),
                mem_used_bytes: c.mem_used_bytes,
                gpu_util: g.and_then(|g| g.util),
                sm_clock_mhz: g.and_then(|g| g.sm_clock_mhz),
                power_w: g.and_then(|g| g.power_w),
                clock_events: g.and_then(|g| g.clock_events),
            })
        })
        .collect();
    JobView {
        node: s.node.clone(),
        simulated: s.simulated,
        job,
        ranks,
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankVerdict {
    pub node: String,
    pub rank: RankView,
    /// Its utilization over the median of all the job's other ranks, on every node.
    pub relative: Option<f64>,
    pub straggler: bool,
}

/// Compares every rank with the median of the others (all nodes), flagging those at or below the
/// straggler rule's threshold.
pub fn compare(views: &[JobView]) -> Vec<RankVerdict> {
    let raise = RULES
        .iter()
        .find(|r| r.id == RuleId::Straggler)
        .map_or(0.75, |r| r.raise);
    let all: Vec<(&str, &RankView)> = views
        .iter()
        .flat_map(|v| v.ranks.iter().map(move |r| (v.node.as_str(), r)))
        .collect();
    all.iter()
        .enumerate()
        .map(|(i, (node, r))| {
            let peers: Vec<f64> = all
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .filter_map(|(_, (_, p))| p.util)
                .collect();
            let relative = r
                .util
                .zip(median(peers).filter(|m| *m >= 0.2))
                .map(|(u, m)| u / m);
            RankVerdict {
                node: node.to_string(),
                rank: (*r).clone(),
                relative,
                straggler: relative.is_some_and(|x| x <= raise),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(pid: u32, util: f64) -> RankView {
        RankView {
            gpu: 0,
            pid,
            step: 0,
            task: pid,
            util: Some(util),
            mem_used_bytes: None,
            gpu_util: None,
            sm_clock_mhz: None,
            power_w: None,
            clock_events: None,
        }
    }

    #[test]
    fn the_slow_rank_on_another_node_is_named() {
        let v = [
            JobView {
                node: "a".into(),
                simulated: true,
                job: 1,
                ranks: vec![rank(1, 0.9), rank(2, 0.88)],
            },
            JobView {
                node: "b".into(),
                simulated: true,
                job: 1,
                ranks: vec![rank(3, 0.3), rank(4, 0.91)],
            },
        ];
        let c = compare(&v);
        let slow: Vec<(&str, u32)> = c
            .iter()
            .filter(|r| r.straggler)
            .map(|r| (r.node.as_str(), r.rank.pid))
            .collect();
        assert_eq!(slow, vec![("b", 3)]);
    }
}
