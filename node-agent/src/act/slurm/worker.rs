//! Executes pending Slurm actions (requeue, drain) outside the state lock, with retries and backoff;
//! each result becomes an outcome line of its fault and job.

use crate::act::slurm::scontrol::{Outcome, Scontrol};
use crate::store::queue::{ActionKey, PendingAction, SlurmOp};
use crate::store::state::DONE_KEYS_KEPT;
use crate::store::Store;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// When a failed action may be tried again.
type Backoff = BTreeMap<ActionKey, Instant>;

/// The Slurm worker: the action queue (in the store) and the Slurm client.
pub struct SlurmWorker {
    store: Arc<Store>,
    slurm: Arc<Scontrol>,
}

impl SlurmWorker {
    pub fn new(store: Arc<Store>, slurm: Arc<Scontrol>) -> SlurmWorker {
        SlurmWorker { store, slurm }
    }

    /// Executes pending Slurm actions outside the state lock; retries with backoff.
    pub fn run(self) {
        let mut not_before = Backoff::new();
        loop {
            let next = self.next_ready(&not_before);
            // Write-ahead: the decision that queued it is on disk before Slurm is touched, so an
            // agent killed in between finds the action after its restart (and verifies it, since
            // it may have run). A disk that refuses writes delays the action by at most a second.
            if next.fresh && next.attempts == 0 {
                let d = self
                    .store
                    .wait_durable_within(self.store.latest_gen(), Duration::from_secs(1));
                if d != crate::store::persister::Durability::Durable {
                    tracing::warn!(key = %next.key, durability = ?d, "acting before the decision is on disk");
                }
            }
            let outcome = self.stale_after_restart(&next).unwrap_or_else(|| {
                self.slurm
                    .execute(&next.op, !next.fresh || next.attempts > 0)
            });
            self.settle(&next, outcome, &mut not_before);
            let g = self.store.mark_dirty();
            self.store.wait_durable(g);
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
            .store
            .lock()
            .history
            .iter()
            .rev()
            .find(|r| r.fault_id == next.fault_id)
            .map(|r| r.at_ms)?;
        self.slurm.stale_requeue(job_id, at)
    }

    /// Waits for the first pending action that may run now (its backoff and its own delay over).
    fn next_ready(&self, not_before: &Backoff) -> PendingAction {
        let mut st = self.store.lock();
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
            st = self.store.wait_queued(st, Duration::from_millis(100));
        }
    }

    /// What an attempt came to: retried later (backoff), or done or failed for good (the action
    /// leaves the queue, its key is done, its job and fault get the outcome line).
    fn settle(&self, next: &PendingAction, outcome: Outcome, not_before: &mut Backoff) {
        let mut st = self.store.lock();
        let (ok, msg) = match settlement(outcome, next.attempts, self.slurm.max_attempts()) {
            Settlement::Retry { attempts, error } => {
                tracing::warn!(key = %next.key, attempt = attempts, error = %error, "Slurm action failed; will retry");
                if let Some(p) = st.durable.pending.iter_mut().find(|p| p.key == next.key) {
                    p.attempts = attempts;
                    p.last_error = Some(error);
                }
                not_before.insert(
                    next.key.clone(),
                    Instant::now() + self.slurm.backoff(attempts),
                );
                return;
            }
            Settlement::Final { ok, detail } => (ok, detail),
        };
        let job = next.op.job();
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
        self.store.record(&mut st, next.fault_id, job, o);
        drop(st);
        self.store.action_settled();
    }
}

/// What one attempt of a Slurm action settles: tried again (with the attempt count it reached),
/// or final — done, or failed for good (refused for good, or out of attempts).
#[derive(Debug, PartialEq, Eq)]
enum Settlement {
    Retry { attempts: u32, error: String },
    Final { ok: bool, detail: String },
}

/// The settlement of an attempt made after `attempts_before` earlier ones, `max_attempts` in all.
fn settlement(outcome: Outcome, attempts_before: u32, max_attempts: u32) -> Settlement {
    let attempts = attempts_before + 1;
    match outcome {
        Outcome::Done(detail) => Settlement::Final { ok: true, detail },
        Outcome::Permanent(detail) => Settlement::Final { ok: false, detail },
        Outcome::Retry(e) if attempts >= max_attempts => Settlement::Final {
            ok: false,
            detail: format!("gave up after {attempts} attempts: {e}"),
        },
        Outcome::Retry(error) => Settlement::Retry { attempts, error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal that may pass is retried until the attempts run out, then fails for good with
    /// the last error; a done or permanent outcome is final at once, whatever the count.
    #[test]
    fn an_attempt_is_retried_until_the_attempts_run_out() {
        let retry = || Outcome::Retry("slurmctld down".into());
        assert_eq!(
            settlement(retry(), 0, 3),
            Settlement::Retry {
                attempts: 1,
                error: "slurmctld down".into()
            }
        );
        assert_eq!(
            settlement(retry(), 1, 3),
            Settlement::Retry {
                attempts: 2,
                error: "slurmctld down".into()
            }
        );
        assert_eq!(
            settlement(retry(), 2, 3),
            Settlement::Final {
                ok: false,
                detail: "gave up after 3 attempts: slurmctld down".into()
            }
        );
        assert_eq!(
            settlement(Outcome::Done("requeued job 7".into()), 9, 3),
            Settlement::Final {
                ok: true,
                detail: "requeued job 7".into()
            }
        );
        assert_eq!(
            settlement(Outcome::Permanent("job 7 no longer exists".into()), 0, 3),
            Settlement::Final {
                ok: false,
                detail: "job 7 no longer exists".into()
            }
        );
    }
}
