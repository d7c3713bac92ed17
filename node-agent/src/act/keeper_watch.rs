//! Keeps a state keeper on each GPU (started on first need, or again after one died; none on a
//! lost GPU) and frees the state kept for requeued jobs that will not run here again.

use crate::act::keepers::{kept_verdict, Keepers, KeptVerdict};
use crate::act::slurm::scontrol::Scontrol;
use crate::gpu::GpuBackend;
use crate::store::Store;
use mpsr_proto::FaultClass;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// The keeper watch and the handles it needs.
pub struct KeeperWatch {
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    keepers: Arc<Keepers>,
    slurm: Arc<Scontrol>,
}

impl KeeperWatch {
    pub fn new(
        store: Arc<Store>,
        backend: Arc<dyn GpuBackend>,
        keepers: Arc<Keepers>,
        slurm: Arc<Scontrol>,
    ) -> KeeperWatch {
        KeeperWatch {
            store,
            backend,
            keepers,
            slurm,
        }
    }

    /// Starts missing keepers (first start, or one that died); cheap pings otherwise.
    pub fn run(&self) {
        loop {
            let lost: BTreeSet<u32> = self
                .store
                .lock()
                .durable
                .unhealthy
                .iter()
                .filter(|(_, (c, _))| *c == FaultClass::DeviceLost)
                .map(|(g, _)| *g)
                .collect();
            for g in self.backend.gpus() {
                if !lost.contains(&g.index) {
                    if let Err(e) = self.keepers.ensure(g.index) {
                        tracing::warn!(gpu = g.index, error = %e, "state keeper not available");
                    }
                }
            }
            self.free_state_of_jobs_that_will_not_run_again();
            std::thread::sleep(Duration::from_secs(5));
        }
    }

    /// State kept for a requeued job waits `keeper.keep_after_requeue_s` for its next run; a job
    /// cancelled (or ended) while pending never comes: its state is freed as soon as Slurm says so.
    fn free_state_of_jobs_that_will_not_run_again(&self) {
        let kept: Vec<(u32, u64)> = self
            .store
            .lock()
            .durable
            .kept_for_requeue
            .iter()
            .map(|(j, u)| (*j, *u))
            .collect();
        for (job, until) in kept {
            let now = crate::sys::now_ms();
            let facts = if now >= until {
                Ok(None)
            } else {
                self.slurm.job_facts(job)
            };
            let v = kept_verdict(until, now, &facts);
            if v == KeptVerdict::Keep {
                continue;
            }
            self.store.lock().durable.kept_for_requeue.remove(&job);
            self.store.mark_dirty();
            if v == KeptVerdict::Free {
                tracing::info!(job, "requeued job will not run again (Slurm says it ended); its kept GPU state freed");
                self.keepers.job_end(job, Duration::ZERO);
            }
        }
    }
}
