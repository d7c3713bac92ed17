//! Slurm actions through `scontrol`, each bounded in time, retried with backoff, idempotent by key
//! (fault id + job id), and persisted until done so an agent restart loses none.

use crate::config::SlurmConfig;
use crate::mps::run_bounded;
use serde::{Deserialize, Serialize};
use std::process::Command;
use std::time::Duration;

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
}

impl SlurmOp {
    /// The run of a job a requeue ends (job id and Slurm's restart count), when known: a done
    /// requeue keeps it among the done keys so later faults of the same run add no second one.
    pub fn run_key(&self) -> Option<String> {
        match self {
            SlurmOp::Requeue {
                job_id,
                restarts_before: Some(r),
            } => Some(format!("run:{job_id}:{r}:requeued")),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingAction {
    /// `f<fault>:requeue:<job>` or `f<fault>:drain`.
    pub key: String,
    pub fault_id: u64,
    pub op: SlurmOp,
    pub attempts: u32,
    pub last_error: Option<String>,
    /// Created by this agent process and never attempted. An action read back from disk after a
    /// restart may have run just before the crash, so it is verified against Slurm first.
    #[serde(skip)]
    pub fresh: bool,
}

/// Result of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done(String),
    /// Will not succeed by retrying (e.g. not a batch job, job gone).
    Permanent(String),
    Retry(String),
}

pub struct Scontrol {
    cfg: SlurmConfig,
}

impl Scontrol {
    pub fn new(cfg: SlurmConfig) -> Self {
        Scontrol { cfg }
    }

    fn run(&self, args: &[&str]) -> Result<(bool, String), String> {
        let mut c = Command::new(&self.cfg.scontrol);
        c.args(args);
        if let Some(conf) = &self.cfg.slurm_conf {
            c.env("SLURM_CONF", conf);
        }
        run_bounded(
            c,
            None,
            Duration::from_millis(self.cfg.timeout_ms),
            &format!("scontrol {}", args.join(" ")),
        )
        .map_err(|e| e.to_string())
    }

    /// Runs one action. `verify`: it may have run already; check Slurm's state first so it is not
    /// done twice.
    pub fn execute(&self, op: &SlurmOp, verify: bool) -> Outcome {
        match op {
            SlurmOp::Requeue {
                job_id,
                restarts_before,
            } => {
                if let (true, Some(before)) = (verify, restarts_before) {
                    if let Ok(now) = self.job_restarts(*job_id) {
                        if now > *before {
                            return Outcome::Done(format!(
                                "job {job_id} already requeued (Restarts={now})"
                            ));
                        }
                    }
                }
                let id = job_id.to_string();
                match self.run(&["requeue", &id]) {
                    Ok((true, _)) => Outcome::Done(format!("requeued job {job_id}")),
                    Ok((false, out)) => classify_requeue_error(*job_id, &out),
                    Err(e) => Outcome::Retry(e),
                }
            }
            SlurmOp::Drain { node, reason } => {
                // Never take over a node someone else drained: keep their reason.
                match self.node_state(node) {
                    Ok((state, r)) if state.contains("DRAIN") && !r.starts_with("mpsr:") => {
                        return Outcome::Done(format!(
                            "node {node} already drained by someone else (reason \"{r}\"); left as is"
                        ));
                    }
                    Ok(_) => {}
                    Err(e) => return Outcome::Retry(e),
                }
                let reason_arg = format!("Reason={reason}");
                let node_arg = format!("NodeName={node}");
                match self.run(&["update", &node_arg, "State=DRAIN", &reason_arg]) {
                    Ok((true, _)) => Outcome::Done(format!("drained node {node}")),
                    Ok((false, out)) if out.contains("Invalid node name") => {
                        Outcome::Permanent(format!("drain {node}: {out}"))
                    }
                    Ok((false, out)) => Outcome::Retry(out),
                    Err(e) => Outcome::Retry(e),
                }
            }
        }
    }

    /// Slurm's restart count of a job (`scontrol show job -o`).
    pub fn job_restarts(&self, job_id: u32) -> Result<u32, String> {
        match self.run(&["show", "job", &job_id.to_string(), "-o"]) {
            Ok((true, out)) => out
                .split_whitespace()
                .find_map(|t| t.strip_prefix("Restarts="))
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("no Restarts= in: {out}")),
            Ok((false, out)) => Err(out),
            Err(e) => Err(e),
        }
    }

    /// (State, Reason) of a node from `scontrol show node -o`.
    pub fn node_state(&self, node: &str) -> Result<(String, String), String> {
        match self.run(&["show", "node", node, "-o"]) {
            Ok((true, out)) => Ok(parse_node_line(&out)),
            Ok((false, out)) => Err(out),
            Err(e) => Err(e),
        }
    }

    pub fn resume_node(&self, node: &str) -> Result<(), String> {
        let node_arg = format!("NodeName={node}");
        match self.run(&["update", &node_arg, "State=RESUME"]) {
            Ok((true, _)) => Ok(()),
            Ok((false, out)) => Err(out),
            Err(e) => Err(e),
        }
    }

    pub fn backoff(&self, attempts: u32) -> Duration {
        let ms = self
            .cfg
            .retry_backoff_ms
            .saturating_mul(1u64 << attempts.min(10));
        Duration::from_millis(ms.min(60_000))
    }

    pub fn max_attempts(&self) -> u32 {
        self.cfg.max_attempts
    }
}

pub fn classify_requeue_error(job_id: u32, out: &str) -> Outcome {
    if out.contains("Only batch jobs") {
        Outcome::Permanent(format!(
            "job {job_id} is not a batch job; Slurm cannot requeue it"
        ))
    } else if out.contains("pending execution") || out.contains("already pending") {
        Outcome::Done(format!("job {job_id} already pending (requeued before)"))
    } else if out.contains("Invalid job id") {
        Outcome::Permanent(format!("job {job_id} no longer exists"))
    } else if out.contains("disabled")
        || out.contains("not requeueable")
        || out.contains("Requeue") && out.contains("not")
    {
        Outcome::Permanent(format!("job {job_id}: {out}"))
    } else {
        Outcome::Retry(out.to_string())
    }
}

/// `State=IDLE+DRAIN ... Reason=mpsr: xid 79 [root@2026-...]` -> ("IDLE+DRAIN", "mpsr: xid 79 [root@…]").
pub fn parse_node_line(out: &str) -> (String, String) {
    let state = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("State="))
        .unwrap_or("")
        .to_string();
    // Reason is the last field on the line and may contain spaces.
    let reason = out
        .find(" Reason=")
        .map(|i| out[i + 8..].trim().to_string())
        .unwrap_or_default();
    let reason = if reason == "(null)" {
        String::new()
    } else {
        reason
    };
    (state, reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requeue_errors() {
        assert!(matches!(
            classify_requeue_error(
                3,
                "scontrol: error: Only batch jobs are accepted or processed for job 3"
            ),
            Outcome::Permanent(_)
        ));
        assert!(matches!(
            classify_requeue_error(
                3,
                "Requeue of JobId=3 returned an error: Job is pending execution"
            ),
            Outcome::Done(_)
        ));
        assert!(matches!(
            classify_requeue_error(3, "Invalid job id specified"),
            Outcome::Permanent(_)
        ));
        assert!(matches!(
            classify_requeue_error(3, "Unable to contact slurm controller (connect failure)"),
            Outcome::Retry(_)
        ));
    }

    #[test]
    fn node_line() {
        let (s, r) = parse_node_line("NodeName=n1 Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=1 Reason=mpsr: xid 79 (device_lost) on gpu0 of n1 [root@2026-12-02T13:09:48]");
        assert_eq!(s, "IDLE+DRAIN");
        assert!(r.starts_with("mpsr: xid 79"));
        let (s, r) = parse_node_line("NodeName=n1 State=IDLE ThreadsPerCore=1");
        assert_eq!((s.as_str(), r.as_str()), ("IDLE", ""));
    }

    #[test]
    fn scontrol_missing_is_retry_not_panic() {
        let s = Scontrol::new(SlurmConfig {
            scontrol: "/nonexistent/scontrol".into(),
            ..SlurmConfig::default()
        });
        assert!(matches!(
            s.execute(
                &SlurmOp::Requeue {
                    job_id: 1,
                    restarts_before: None
                },
                false
            ),
            Outcome::Retry(_)
        ));
        assert_eq!(s.backoff(0), Duration::from_millis(500));
        assert_eq!(s.backoff(30), Duration::from_millis(60_000));
    }

    #[test]
    fn a_requeue_that_may_have_run_is_verified_and_not_repeated() {
        let dir = std::env::temp_dir().join(format!("mpsr-slurm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shim = dir.join("scontrol");
        // Slurm already shows the job requeued once; a requeue call is recorded.
        std::fs::write(
            &shim,
            format!(
                "#!/bin/sh\ncase \"$1\" in show) echo 'JobId=7 JobState=PENDING Restarts=1';; *) echo \"$@\" >> {}/calls;; esac\n",
                dir.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let s = Scontrol::new(SlurmConfig {
            scontrol: shim,
            ..SlurmConfig::default()
        });
        let op = SlurmOp::Requeue {
            job_id: 7,
            restarts_before: Some(0),
        };
        assert!(matches!(s.execute(&op, true), Outcome::Done(m) if m.contains("already requeued")));
        assert!(!dir.join("calls").exists(), "requeue must not run again");
        // A fresh action is not verified (no extra scontrol call on the fast path).
        assert!(matches!(s.execute(&op, false), Outcome::Done(_)));
        assert!(std::fs::read_to_string(dir.join("calls"))
            .unwrap()
            .contains("requeue 7"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
