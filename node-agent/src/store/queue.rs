//! The Slurm actions a decision queues: requeue a job, drain the node. Each is idempotent by its
//! key, queued in the durable state (so an agent restart loses none) and coalesced in a storm (one
//! requeue per run of a job, one drain in flight).

use crate::store::state::{push_outcome, Durable};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SlurmOp {
    Requeue {
        job_id: u32,
        /// Slurm's restart count of the job when it was hit; a higher count means this requeue
        /// already happened (before an agent crash or a timed-out attempt).
        #[serde(default)]
        restarts_before: Option<u32>,
    },
    Drain {
        node: String,
        reason: String,
    },
    /// Appends a line to the job's AdminComment (what `scontrol show job` and `sacct` show):
    /// the fault, the job's part in it and what was done.
    Annotate {
        job_id: u32,
        line: String,
        /// Slurm's restart count of the run the fault hit: one line per run of a job, however
        /// many faults a storm brings.
        #[serde(default)]
        restarts: Option<u32>,
    },
}

impl SlurmOp {
    /// The key that makes this action for fault `fault` idempotent (derived, never built apart).
    pub fn key(&self, fault: u64) -> ActionKey {
        match self {
            SlurmOp::Requeue { job_id, .. } => ActionKey::Requeue {
                fault,
                job: *job_id,
            },
            SlurmOp::Drain { .. } => ActionKey::Drain { fault },
            SlurmOp::Annotate { job_id, .. } => ActionKey::Annotate {
                fault,
                job: *job_id,
            },
        }
    }

    /// The job the action is about (none for a drain).
    pub fn job(&self) -> Option<u32> {
        match self {
            SlurmOp::Requeue { job_id, .. } | SlurmOp::Annotate { job_id, .. } => Some(*job_id),
            SlurmOp::Drain { .. } => None,
        }
    }

    /// The run of a job a requeue ends (job id and Slurm's restart count), when known: a done
    /// requeue keeps it among the done keys so later faults of the same run add no second one.
    pub fn run_key(&self) -> Option<ActionKey> {
        match self {
            SlurmOp::Requeue {
                job_id,
                restarts_before: Some(r),
            } => Some(ActionKey::RunRequeued {
                job: *job_id,
                restarts: *r,
            }),
            SlurmOp::Annotate {
                job_id,
                restarts: Some(r),
                ..
            } => Some(ActionKey::RunAnnotated {
                job: *job_id,
                restarts: *r,
            }),
            _ => None,
        }
    }
}

/// What makes a Slurm action idempotent: the same key is queued and done once. On disk the text
/// of earlier versions (`f3:requeue:7`, `f3:drain`, `run:7:0:requeued`), so state files carry over.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum ActionKey {
    /// The requeue of a job for one fault.
    Requeue { fault: u64, job: u32 },
    /// The drain of the node for one fault.
    Drain { fault: u64 },
    /// A requeue of one run of a job (Slurm's restart count) is done: that run gets no second.
    RunRequeued { job: u32, restarts: u32 },
    /// The job's AdminComment line for one fault.
    Annotate { fault: u64, job: u32 },
    /// One run of a job has its AdminComment line: a storm's later faults add none.
    RunAnnotated { job: u32, restarts: u32 },
    /// A key this version does not know (kept as it was read, matched by equality only).
    Other(String),
}

impl std::fmt::Display for ActionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActionKey::Requeue { fault, job } => write!(f, "f{fault}:requeue:{job}"),
            ActionKey::Drain { fault } => write!(f, "f{fault}:drain"),
            ActionKey::RunRequeued { job, restarts } => write!(f, "run:{job}:{restarts}:requeued"),
            ActionKey::Annotate { fault, job } => write!(f, "f{fault}:annotate:{job}"),
            ActionKey::RunAnnotated { job, restarts } => {
                write!(f, "run:{job}:{restarts}:annotated")
            }
            ActionKey::Other(s) => f.write_str(s),
        }
    }
}

impl From<ActionKey> for String {
    fn from(k: ActionKey) -> String {
        k.to_string()
    }
}

impl From<String> for ActionKey {
    fn from(s: String) -> ActionKey {
        let parts: Vec<&str> = s.split(':').collect();
        let fault = |p: &str| p.strip_prefix('f').and_then(|n| n.parse::<u64>().ok());
        let parsed = match parts.as_slice() {
            [f, "requeue", j] => fault(f)
                .zip(j.parse().ok())
                .map(|(fault, job)| ActionKey::Requeue { fault, job }),
            [f, "drain"] => fault(f).map(|fault| ActionKey::Drain { fault }),
            [f, "annotate", j] => fault(f)
                .zip(j.parse().ok())
                .map(|(fault, job)| ActionKey::Annotate { fault, job }),
            ["run", j, r, "requeued"] => j
                .parse()
                .ok()
                .zip(r.parse().ok())
                .map(|(job, restarts)| ActionKey::RunRequeued { job, restarts }),
            ["run", j, r, "annotated"] => j
                .parse()
                .ok()
                .zip(r.parse().ok())
                .map(|(job, restarts)| ActionKey::RunAnnotated { job, restarts }),
            _ => None,
        };
        parsed.unwrap_or(ActionKey::Other(s))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingAction {
    pub key: ActionKey,
    /// Not before this wall-clock time (unix ms): a job's fault line waits until the fault's
    /// class is settled (its Xid may come after the server's line).
    #[serde(default)]
    pub not_before_ms: Option<u64>,
    pub fault_id: u64,
    pub op: SlurmOp,
    pub attempts: u32,
    pub last_error: Option<String>,
    /// Created by this agent process and never attempted. An action read back from disk after a
    /// restart may have run just before the crash, so it is verified against Slurm first.
    #[serde(skip)]
    pub fresh: bool,
}

/// Drains the node for a fault whose domain could not be brought back (escalation's fence).
pub fn enqueue_drain(d: &mut Durable, node: &str, fault_id: u64, why: String) {
    enqueue(
        d,
        fault_id,
        SlurmOp::Drain {
            node: node.to_string(),
            reason: format!("{} {why}", mpsr_proto::fault::SLURM_TEXT_PREFIX),
        },
    );
}

/// Queues a Slurm action unless it (or one that covers it) is queued or done already.
pub fn enqueue(d: &mut Durable, fault_id: u64, op: SlurmOp) {
    let key = op.key(fault_id);
    if d.done_keys.contains(&key) || d.pending.iter().any(|p| p.key == key) {
        return;
    }
    // A fault storm hits the same job and node again and again: one requeue per run of a job and
    // one drain in flight per node, however many faults come (each fault still records the hit).
    let coalesced = match &op {
        SlurmOp::Requeue { job_id, .. } => d
            .pending
            .iter()
            .find_map(|p| {
                matches!(p.op, SlurmOp::Requeue { job_id: j, .. } if j == *job_id)
                    .then_some(p.fault_id)
            })
            .or_else(|| {
                let run = op.run_key()?;
                d.done_keys
                    .contains(&run)
                    .then(|| d.requeued.get(job_id).copied().unwrap_or(fault_id))
            }),
        SlurmOp::Drain { .. } => d
            .pending
            .iter()
            .find_map(|p| matches!(p.op, SlurmOp::Drain { .. }).then_some(p.fault_id)),
        // Queued by `annotate`, one per job and fault.
        SlurmOp::Annotate { .. } => None,
    };
    if let Some(earlier) = coalesced {
        if let SlurmOp::Requeue { job_id, .. } = op {
            push_outcome(
                &mut d.outcomes,
                job_id,
                format!("fault {fault_id}: requeue already under way for fault {earlier}"),
            );
        }
        return;
    }
    d.pending.push(PendingAction {
        key,
        not_before_ms: None,
        fault_id,
        op,
        attempts: 0,
        last_error: None,
        fresh: true,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_keys_read_the_text_of_earlier_state_files() {
        for (text, key) in [
            ("f3:requeue:7", ActionKey::Requeue { fault: 3, job: 7 }),
            ("f12:drain", ActionKey::Drain { fault: 12 }),
            (
                "run:7:2:requeued",
                ActionKey::RunRequeued {
                    job: 7,
                    restarts: 2,
                },
            ),
            ("f4:annotate:9", ActionKey::Annotate { fault: 4, job: 9 }),
            (
                "run:9:1:annotated",
                ActionKey::RunAnnotated {
                    job: 9,
                    restarts: 1,
                },
            ),
            ("x:y", ActionKey::Other("x:y".into())),
        ] {
            assert_eq!(ActionKey::from(text.to_string()), key);
            assert_eq!(key.to_string(), text);
            let json = serde_json::to_string(&key).unwrap();
            assert_eq!(json, format!("\"{text}\""));
            assert_eq!(serde_json::from_str::<ActionKey>(&json).unwrap(), key);
        }
    }
}
