//! The escalation ladder for a domain whose server stays in FAULT.
//!
//! Measured on an H100: after a takeover SIGKILLed a hit client, the shared server still listed
//! it 2 s later, `terminate_client` answered ok, and the server never came back (every later task
//! died of CUDA error 807; a `quit` to its control daemon hung 30 s). A domain must never stay
//! broken, so once it has been in FAULT for `mps.fault_stuck_ms` (the hit clients were ended at
//! `mps.fault_grace_ms` already), one rung is climbed every `mps.escalation_step_ms`:
//! 1. end the domain's MPS server: every client of a faulted server is dead in GPU terms already,
//!    a client of no job included; the control daemon starts a fresh server for the next client;
//! 2. end the control daemon (it may answer nothing) and start it again in fresh directories;
//! 3. fence the domain: no task is placed there (refused with the reason), `mpsrctl status` and
//!    `mpsr_domain_fenced` say so, and a GPU's shared domain drains the node. A fenced domain is
//!    tried again every 30 s (the domain loop's `RETRY_FENCED`) and unfenced once it answers ACTIVE.
//!
//! Each rung is bounded (the backend's command timeout) and recorded on the fault's event as a
//! typed outcome. [`Ladder::due`] is the pure part: which rung is due when.

use crate::config::Config;
use crate::domain::lifecycle::Domains;
use crate::gpu::GpuBackend;
use crate::store::Store;
use mpsr_proto::{DomainId, EscalationRung, FaultOutcome};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// When each rung is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ladder {
    pub stuck_after: Duration,
    pub step: Duration,
}

impl Ladder {
    pub fn from_config(m: &crate::config::MpsConfig) -> Ladder {
        Ladder {
            stuck_after: Duration::from_millis(m.fault_stuck_ms),
            step: Duration::from_millis(m.escalation_step_ms),
        }
    }

    /// The next rung, if it is due `in_fault` after the fault with `climbed` rungs behind.
    pub fn due(&self, in_fault: Duration, climbed: usize) -> Option<EscalationRung> {
        let rung = *EscalationRung::ALL.get(climbed)?;
        let at = self.stuck_after + self.step * climbed as u32;
        (in_fault >= at).then_some(rung)
    }
}

/// The ladder and the handles its rungs need.
pub struct Escalation {
    ladder: Ladder,
    node: String,
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    domains: Arc<Domains>,
}

impl Escalation {
    pub fn new(
        cfg: &Config,
        node: String,
        store: Arc<Store>,
        backend: Arc<dyn GpuBackend>,
        domains: Arc<Domains>,
    ) -> Escalation {
        Escalation {
            ladder: Ladder::from_config(&cfg.mps),
            node,
            store,
            backend,
            domains,
        }
    }

    /// Climbs the rung that is due for `domain` (in FAULT, or not answering, since `since`), off
    /// the health loop: a step may wait for the control daemon's command timeout.
    pub fn escalate(self: &Arc<Self>, domain: DomainId, fault_id: u64, since: Instant) {
        let ladder = self.ladder;
        let rung = {
            let mut st = self.store.lock();
            let Some(r) = st.recovering.get_mut(&domain) else {
                return;
            };
            if r.escalating {
                return;
            }
            let Some(rung) = ladder.due(since.elapsed(), r.climbed) else {
                return;
            };
            r.climbed += 1;
            r.escalating = true;
            rung
        };
        let a = self.clone();
        std::thread::spawn(move || {
            let after_ms = since.elapsed().as_millis() as u64;
            let (ended, error) = a.climb(domain, rung);
            let mut st = a.store.lock();
            *st.escalations.entry((domain.gpu, rung)).or_default() += 1;
            if let Some(r) = st.recovering.get_mut(&domain) {
                r.escalating = false;
            }
            if rung == EscalationRung::Fence {
                if st.recovering.remove(&domain).is_some() {
                    a.fence(&mut st, domain, fault_id, after_ms);
                }
                drop(st);
                a.store.recovery_changed();
                return;
            }
            let o = FaultOutcome::Escalated {
                domain,
                rung,
                after_ms,
                ended,
                error,
            };
            tracing::error!(%domain, fault_id, rung = rung.name(), "{o}");
            a.store.record(&mut st, fault_id, None, o);
        });
    }

    /// One rung: the pids it ended and why it failed.
    fn climb(&self, domain: DomainId, rung: EscalationRung) -> (Vec<u32>, Option<String>) {
        match rung {
            EscalationRung::EndServer => match self.backend.end_server(domain) {
                Ok(pids) => (pids, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            },
            EscalationRung::RestartDaemon => {
                (Vec::new(), self.domains.restart_daemon(domain).err())
            }
            EscalationRung::Fence => (Vec::new(), None),
        }
    }

    /// The last rung: no task is placed in `domain` from now on; a GPU's shared domain drains
    /// the node (Slurm stops sending jobs there).
    fn fence(&self, st: &mut crate::store::state::State, domain: DomainId, fault_id: u64, ms: u64) {
        st.durable.domains.fence(domain);
        let o = FaultOutcome::DomainFenced {
            domain,
            after_ms: ms,
        };
        tracing::error!(%domain, fault_id, "{o}");
        if domain.is_shared() {
            crate::store::queue::enqueue_drain(
                &mut st.durable,
                &self.node,
                fault_id,
                format!(
                    "gpu{} shared MPS server stuck in FAULT (fault {fault_id}), fenced",
                    domain.gpu
                ),
            );
            self.store.action_queued();
        }
        self.store.record(st, fault_id, None, o);
        self.store.mark_dirty();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LADDER: Ladder = Ladder {
        stuck_after: Duration::from_secs(10),
        step: Duration::from_secs(5),
    };

    #[test]
    fn a_stuck_domain_escalates_one_rung_per_step_in_order() {
        let s = Duration::from_secs;
        assert_eq!(LADDER.due(s(9), 0), None, "not stuck yet");
        assert_eq!(LADDER.due(s(10), 0), Some(EscalationRung::EndServer));
        assert_eq!(LADDER.due(s(14), 1), None, "a step apart");
        assert_eq!(LADDER.due(s(15), 1), Some(EscalationRung::RestartDaemon));
        assert_eq!(LADDER.due(s(19), 2), None);
        assert_eq!(LADDER.due(s(20), 2), Some(EscalationRung::Fence));
        assert_eq!(LADDER.due(s(3600), 3), None, "nothing after the fence");
    }

    #[test]
    fn a_domain_found_stuck_late_still_climbs_each_rung_in_turn() {
        // The health loop saw it only after a minute (an agent restart): one rung per call, the
        // first one first, never skipping to the fence.
        let late = Duration::from_secs(60);
        let rungs: Vec<_> = (0..4).map_while(|n| LADDER.due(late, n)).collect();
        assert_eq!(rungs, EscalationRung::ALL.to_vec());
    }
}
