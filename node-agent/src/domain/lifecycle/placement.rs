//! Placement of a registering task (and of a hot standby) in the domains of its GPUs, starting
//! the daemons of domains it makes: the table decides, this starts what it decided.

use super::Domains;
use crate::domain::{DomainRecord, PlaceError};
use crate::gpu::BackendError;
use crate::sys::lock;
use mpsr_proto::{DomainId, Isolation, ServerState};

/// Why a task could not be placed.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// The admin's policy refuses it (not allowed, GPU full): the job must not run unprotected.
    #[error(transparent)]
    Refused(#[from] PlaceError),
    #[error("starting fault domain {domain}: {source}")]
    Start {
        domain: DomainId,
        source: BackendError,
    },
}

/// Where one task's clients go on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub domain: DomainId,
    pub isolation: Isolation,
    pub quarantined: bool,
    /// Quarantined, but no domain was free: placed where it asked (see `Placed`).
    pub quarantine_waived: bool,
}

impl Domains {
    /// Places a registering task on each of its GPUs, starting new domains' daemons. Called with
    /// the task's trusted identity (job, uid), before it is registered.
    pub fn place_task(
        &self,
        job: u32,
        uid: u32,
        gpus: &[u32],
        asked: Option<Isolation>,
        limits: (Option<u8>, Option<u64>),
    ) -> Result<Vec<Placement>, PlacementError> {
        let mut out = Vec::new();
        let mut to_start = Vec::new();
        // Held until the new daemons are up: a second task of the job must not get a context
        // for a domain still starting, nor the linger loop stop it meanwhile.
        let _serial = lock(&self.ops);
        {
            let mut st = self.store.lock();
            let now = crate::sys::now_ms();
            for &gpu in gpus {
                let p =
                    st.durable
                        .domains
                        .place(&self.policy, gpu, job, uid, asked, limits, now)?;
                if let Some(rec) = p.start {
                    to_start.push(rec);
                }
                out.push(Placement {
                    domain: p.id,
                    isolation: p.isolation,
                    quarantined: p.quarantined,
                    quarantine_waived: p.quarantine_waived,
                });
            }
        }
        self.start_placed(to_start)?;
        Ok(out)
    }

    /// Starts the daemons of domains placement just made (or took over). Callers hold
    /// `domain_ops`.
    fn start_placed(&self, to_start: Vec<DomainRecord>) -> Result<(), PlacementError> {
        if !to_start.is_empty() {
            self.store.mark_dirty();
        }
        for rec in to_start {
            // A domain taken over from an earlier tenant gets a fresh daemon (owner, limits).
            if self.backend.server_state(rec.id) != ServerState::Down {
                self.stop_domain(rec.id);
            }
            if let Err(source) = self.start_domain(&self.spec(rec.id, Some(&rec))) {
                self.store.lock().durable.domains.remove(rec.id);
                self.store.mark_dirty();
                return Err(PlacementError::Start {
                    domain: rec.id,
                    source,
                });
            }
            tracing::info!(domain = %rec.id, tenancy = %rec.tenancy, owner_uid = ?rec.owner_uid, "fault domain started");
        }
        Ok(())
    }

    /// The domain a hot standby of a task in domain `of` waits in (started if new).
    pub fn place_standby(&self, of: DomainId) -> Result<DomainId, PlacementError> {
        let _serial = lock(&self.ops);
        let (id, start) = self
            .store
            .lock()
            .durable
            .domains
            .standby_domain(&self.policy, of)?;
        self.start_placed(start.into_iter().collect())?;
        Ok(id)
    }
}
