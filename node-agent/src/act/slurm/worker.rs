//! Executes pending Slurm actions (requeue, drain) outside the state lock, with retries and backoff;
//! each result becomes an outcome line of its fault and job.

use crate::act::slurm::queue::{ActionKey, PendingAction, SlurmOp};
use crate::act::slurm::scontrol::Outcome;
use crate::agent::Agent;
use crate::store::state::{push_outcome, DONE_KEYS_KEPT};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// When a failed action may be tried again.
type Backoff = BTreeMap<ActionKey, Instant>;

impl Agent {
    /// Executes pending Slurm actions outside the state lock; retries with backoff.
    pub(crate) fn slurm_loop(self: Arc<Self>) {
        let mut not_before = Backoff::new();
        loop {
            let next = self.next_ready(&not_before);
            // Write-ahead: the decision that queued it is on disk before Slurm is touched, so an
            // agent killed in between finds the action after its restart (and verifies it, since
            // it may have run). A disk that refuses writes delays the action by at most a second.
            if next.fresh && next.attempts == 0 {
                let d = self.wait_durable_within(self.latest_gen(), Duration::from_secs(1));
                if d != crate::store::persister::Durability::Durable {
                    tracing::warn!(key = %next.key, durability = ?d, "acting before the decision is on disk");
                }
            }
            let outcome = self.stale_after_restart(&next).unwrap_or_else(|| {
                self.slurm
                    .execute(&next.op, !next.fresh || next.attempts > 0)
            });
            self.settle(&next, outcome, &mut not_before);
            let g = self.mark_dirty();
            self.wait_durable(g);
        }
    }

    /// A requeue read back after a restart may be stale (its job ran on and ended since): then
    /// what Slurm says of the job settles it without a call.
    fn stale_after_restart(&self, next: &PendingAction) -> Option<Outcome> {
        let SlurmOp::Requeue { job_id, .. } = next.op else {
            return None;
        };
        if next.fresh {
            return None;
        }
        let at = self
            .state()
            .history
            .iter()
            .rev()
            .find(|r| r.fault_id == next.fault_id)
            .map(|r| r.at_ms)?;
        self.slurm.stale_requeue(job_id, at)
    }

    /// Waits for the first pending action that may run now (its backoff and its own delay over).
    fn next_ready(&self, not_before: &Backoff) -> PendingAction {
        let mut st = self.state();
        loop {
            let now = Instant::now();
            let now_ms = crate::sys::now_ms();
            let ready = st
                .durable
                .pending
                .iter()
                .find(|p| {
                    not_before.get(&p.key).is_none_or(|t| *t <= now)
                        && p.not_before_ms.is_none_or(|t| t <= now_ms)
                })
                .cloned();
            if let Some(p) = ready {
                return p;
            }
            st = self
                .slurm_wake
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// What an attempt came to: retried later (backoff), or done or failed for good (the action
    /// leaves the queue, its key is done, its job and fault get the outcome line).
    fn settle(&self, next: &PendingAction, outcome: Outcome, not_before: &mut Backoff) {
        let mut st = self.state();
        let attempts = next.attempts + 1;
        let msg = match &outcome {
            Outcome::Done(m) | Outcome::Permanent(m) => m.clone(),
            Outcome::Retry(e) if attempts >= self.slurm.max_attempts() => {
                format!("gave up after {attempts} attempts: {e}")
            }
            Outcome::Retry(e) => {
                tracing::warn!(key = %next.key, attempt = attempts, error = %e, "Slurm action failed; will retry");
                if let Some(p) = st.durable.pending.iter_mut().find(|p| p.key == next.key) {
                    p.attempts = attempts;
                    p.last_error = Some(e.clone());
                }
                not_before.insert(
                    next.key.clone(),
                    Instant::now() + self.slurm.backoff(attempts),
                );
                return;
            }
        };
        let ok = matches!(outcome, Outcome::Done(_));
        let job = match &next.op {
            SlurmOp::Requeue { job_id, .. } | SlurmOp::Annotate { job_id, .. } => Some(*job_id),
            SlurmOp::Drain { .. } => None,
        };
        if ok {
            if let SlurmOp::Requeue {
                job_id,
                restarts_before,
            } = next.op
            {
                st.durable
                    .note_requeued(job_id, next.fault_id, restarts_before);
            }
            st.durable.done_keys.extend(next.op.run_key());
            tracing::info!(key = %next.key, "{msg}");
        } else {
            tracing::error!(key = %next.key, "Slurm action failed for good: {msg}");
        }
        st.durable.pending.retain(|p| p.key != next.key);
        not_before.remove(&next.key);
        st.durable.done_keys.push_back(next.key.clone());
        while st.durable.done_keys.len() > DONE_KEYS_KEPT {
            st.durable.done_keys.pop_front();
        }
        let o = mpsr_proto::FaultOutcome::Slurm {
            done: ok,
            detail: msg,
        };
        if let Some(j) = job {
            push_outcome(
                &mut st.durable.outcomes,
                j,
                format!("fault {}: {o}", next.fault_id),
            );
        }
        self.add_outcome(&mut st, next.fault_id, o);
    }
}
