//! After a fault: watches each hit domain's server back to ACTIVE (ending clients that linger past
//! the grace time: a server stays in FAULT until every faulting client is gone), clears healed
//! GPUs, and answers resume supervisors (restart once the task's own server is ACTIVE).

use crate::agent::Agent;
use crate::xid::FaultClass;
use mpsr_proto::{DomainId, ResumeVerdict, ServerState};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Agent {
    pub(crate) fn health_loop(self: Arc<Self>) {
        let interval = Duration::from_millis(self.cfg.mps.health_interval_ms.min(100));
        loop {
            std::thread::sleep(interval);
            self.watch_recovering();
            self.clear_healed();
        }
    }

    fn watch_recovering(&self) {
        let grace = Duration::from_millis(self.cfg.mps.fault_grace_ms);
        let domains: Vec<(DomainId, u64, Instant)> = self
            .state()
            .recovering
            .iter()
            .map(|(d, r)| (*d, r.fault_id, r.since))
            .collect();
        for (domain, fault_id, since) in domains {
            match self.backend.server_state(domain) {
                ServerState::Active | ServerState::Idle => {
                    let ms = since.elapsed().as_millis();
                    let mut st = self.state();
                    st.recovering.remove(&domain);
                    let line = format!("{domain} MPS server ACTIVE again {ms} ms after the fault");
                    tracing::info!(%domain, fault_id, "{line}");
                    self.add_outcome(&mut st, fault_id, line);
                }
                ServerState::Fault if since.elapsed() > grace => {
                    let clients = self.backend.clients(domain);
                    let todo: Vec<u32> = {
                        let mut st = self.state();
                        let Some(r) = st.recovering.get_mut(&domain) else {
                            continue;
                        };
                        let t: Vec<u32> = clients
                            .into_iter()
                            .filter(|c| !r.terminated.contains(c))
                            .collect();
                        r.terminated.extend(&t);
                        t
                    };
                    for pid in todo {
                        let res = self.backend.terminate_client(domain, pid);
                        let line = format!(
                            "terminate_client {pid} on {domain} (still attached after {} ms): {}",
                            grace.as_millis(),
                            match res {
                                Ok(()) => "ok".to_string(),
                                Err(e) => e.to_string(),
                            }
                        );
                        tracing::warn!(%domain, pid, "{line}");
                        let mut st = self.state();
                        self.add_outcome(&mut st, fault_id, line);
                    }
                }
                ServerState::Lost | ServerState::Down | ServerState::Fault => {}
            }
        }
    }

    fn clear_healed(&self) {
        let unhealthy: Vec<(u32, FaultClass)> = self
            .state()
            .d
            .unhealthy
            .iter()
            .map(|(g, (c, _))| (*g, *c))
            .collect();
        for (gpu, class) in unhealthy {
            // Lost GPUs heal when they answer again (reset); uncontained errors need an operator.
            if class == FaultClass::DeviceLost
                && self.backend.probe_healthy(gpu)
                && self.backend.server_state(DomainId::shared(gpu)) != ServerState::Lost
            {
                self.state().d.unhealthy.remove(&gpu);
                tracing::info!(gpu, "GPU answers again; marked healthy");
                self.mark_dirty();
                // Its memory did not survive the reset: a fresh keeper restores snapshots.
                self.keepers.restart(gpu);
            }
        }
    }

    pub fn resume_verdict(&self, key: &str) -> (ResumeVerdict, String) {
        let entry = self.state().d.resume.get(key).cloned();
        let Some(e) = entry else {
            return (ResumeVerdict::NotHit, "no fault known for this task".into());
        };
        let done = |v: ResumeVerdict, why: String| {
            self.state().d.resume.remove(key);
            self.mark_dirty();
            (v, why)
        };
        if let Some(why) = e.fail {
            return done(ResumeVerdict::Fail, why);
        }
        let domain = e.domain();
        match self.backend.server_state(domain) {
            ServerState::Active | ServerState::Idle => done(
                ResumeVerdict::Restart,
                format!(
                    "hit by fault {} on {domain}; MPS server ACTIVE again",
                    e.fault_id
                ),
            ),
            ServerState::Lost => done(ResumeVerdict::Fail, format!("gpu{} is lost", e.gpu)),
            s => (
                ResumeVerdict::Wait,
                format!("hit by fault {}; {domain} server is {s:?}", e.fault_id),
            ),
        }
    }
}
