//! What is published after each round: the round and the findings active then.

use crate::detect::Finding;
use crate::sample::Tick;
use serde::{Deserialize, Serialize};

/// The latest round and what is active: what `/metrics`, `mpsrctl top` and `job-skew` show.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub node: String,
    pub simulated: bool,
    pub tick: Tick,
    /// Findings active now.
    pub findings: Vec<Finding>,
    pub rounds: u64,
    /// CPU time the sampling thread has used.
    pub cpu_seconds: f64,
    /// Per-process series carry a `pid` label (off by default: series churn).
    pub pid_labels: bool,
}
