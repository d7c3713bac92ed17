//! A hit task's supervisor asks what to do (`ResumeQuery`): restart (in its own domain once its
//! server is ACTIVE, or at once in another running domain of its GPU), wait, fail, or nothing (a
//! standby took over, or no fault hit it; `TakenOver` too when a cold standby was released: its
//! supervisor restarted the task at once).

use super::Recovery;
use crate::store::state::Takeover;
use mpsr_proto::standby::Kind;
use mpsr_proto::{DomainId, FaultOutcome, ResumeVerdict, ServerState};

impl Recovery {
    /// What a hit task's supervisor is to do. With `may_move` (the supervisor can restart the
    /// task elsewhere, and the node allows it), a task whose server still recovers is restarted
    /// at once in the GPU's other running domain (`DomainTable::restart_elsewhere`): its new
    /// context is made while the old server recovers (the verdict's domain says where).
    pub fn resume_verdict(&self, key: crate::store::registry::TaskKey, may_move: bool) -> Verdict {
        let entry = self.store.lock().durable.resume.get(key).cloned();
        let Some(e) = entry.filter(|e| !e.consumed) else {
            return Verdict::new(ResumeVerdict::NotHit, "no fault known for this task".into());
        };
        let done = |v: ResumeVerdict, why: String| {
            if let Some(e) = self.store.lock().durable.resume.get_mut(key) {
                e.consumed = true;
            }
            self.store.mark_dirty();
            Verdict::new(v, why)
        };
        if let Some(why) = e.fail {
            return done(ResumeVerdict::Fail, why);
        }
        // What mpsr-run prints on the task's stderr names the fault as Slurm's views do.
        let fault = self
            .store
            .lock()
            .history
            .iter()
            .rev()
            .find(|r| r.fault_id == e.fault_id)
            .map(|r| {
                let xids: Vec<String> = r.xids.iter().map(|x| x.to_string()).collect();
                format!("fault {} (xid {}, {})", e.fault_id, xids.join("+"), r.class)
            })
            .unwrap_or_else(|| format!("fault {}", e.fault_id));
        match e.takeover {
            Some(Takeover::Releasing(pid)) => {
                return Verdict::new(
                    ResumeVerdict::Wait,
                    format!("hit by {fault}; standby pid {pid} being released"),
                )
            }
            // A cold standby's supervisor has started the next incarnation already.
            Some(Takeover::Released(_)) if e.standby_kind == Kind::Cold => {
                return done(
                    ResumeVerdict::TakenOver,
                    format!("hit by {fault}; restarted at once in another fault domain"),
                )
            }
            Some(Takeover::Released(pid)) => {
                return done(
                    ResumeVerdict::TakenOver,
                    format!("hit by {fault}; standby pid {pid} took over"),
                )
            }
            Some(Takeover::Unavailable) | None => {}
        }
        let domain = e.domain();
        match self.backend.server_state(domain) {
            ServerState::Active | ServerState::Idle => done(
                ResumeVerdict::Restart,
                format!("hit by {fault} on {domain}; MPS server ACTIVE again"),
            ),
            ServerState::Lost => done(ResumeVerdict::Fail, format!("gpu{} is lost", e.gpu)),
            s => {
                if may_move {
                    if let Some(to) = self.move_now(key, e.fault_id, domain) {
                        let mut v = done(
                            ResumeVerdict::Restart,
                            format!(
                                "hit by {fault} on {domain} (its server {s:?}); {to}'s server runs"
                            ),
                        );
                        v.moved_to = Some(to);
                        return v;
                    }
                }
                Verdict::new(
                    ResumeVerdict::Wait,
                    format!("hit by {fault}; {domain} server is {s:?}"),
                )
            }
        }
    }

    /// Moves a task hit in `from` to where it may restart elsewhere if that one's server runs (ACTIVE:
    /// a new client's context is made at once; a server still to start would come no sooner
    /// than `from`'s recovery); where it went.
    fn move_now(
        &self,
        task: crate::store::registry::TaskKey,
        fault_id: u64,
        from: DomainId,
    ) -> Option<DomainId> {
        let to = {
            let st = self.store.lock();
            st.durable
                .domains
                .restart_elsewhere(from)
                .filter(|d| !st.recovering.contains_key(d))?
        };
        // Asked outside the state lock (an MPS control command).
        if self.backend.server_state(to) != ServerState::Active {
            return None;
        }
        let mut st = self.store.lock();
        st.move_task(fault_id, task, to);
        self.store.record(
            &mut st,
            fault_id,
            Some(task.0),
            FaultOutcome::RestartedElsewhere {
                job: task.0,
                step: task.1,
                from,
                domain: to,
            },
        );
        drop(st);
        self.store.mark_dirty();
        tracing::info!(fault_id, job = task.0, pid = task.2, %from, %to, "hit task restarted in another fault domain while its server recovers");
        Some(to)
    }
}

/// What a resume supervisor is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub verdict: ResumeVerdict,
    pub reason: String,
    /// With `Restart`: the domain the task runs in from now on, when not the one it was hit in.
    pub moved_to: Option<DomainId>,
}

impl Verdict {
    fn new(verdict: ResumeVerdict, reason: String) -> Verdict {
        Verdict {
            verdict,
            reason,
            moved_to: None,
        }
    }
}
