//! Wiring: starts the GPU backend, the fault domains and every worker thread of the agent (the
//! only module that knows them all; nothing imports it).

use crate::agent::{Agent, StartError};
use crate::fault::classify::FaultClass;
use crate::sys::{lock, worker};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

impl Agent {
    /// Starts the backend, every fault domain and every loop. Returns once the agent is ready.
    pub fn start(self: &Arc<Self>) -> Result<(), StartError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.set_signal_sender(tx.clone());
        let (ptx, prx) = std::sync::mpsc::channel();
        *lock(&self.probes) = Some(ptx);
        // The kernel-log reader resumes after the record kept with the last decision made from
        // it (what it read later and was not decided is read again).
        if let Some(k) = self.state().durable.cursors.kmsg.clone() {
            let file = self
                .cfg
                .state_dir
                .join(crate::intake::readers::KMSG_CURSOR_FILE);
            if let Err(e) = crate::store::atomic_file::write_atomic(&file, &k) {
                tracing::warn!(error = %e, "kernel-log cursor not handed to its reader");
            }
        }
        self.backend.start(tx)?;
        self.start_domains()?;
        // A worker that panics ends the agent (systemd restarts it): none may die silently.
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            let n = name.to_string();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || worker::guarded(&n, f, worker::exit_on_panic))
                .map(|_| ())
                .map_err(|source| StartError::Thread {
                    name: name.into(),
                    source,
                })
        };
        let a = self.clone();
        spawn("persist", Box::new(move || a.persist_loop()))?;
        let a = self.clone();
        spawn("faults", Box::new(move || a.fault_loop(rx)))?;
        let a = self.clone();
        spawn("probe", Box::new(move || a.probe_loop(prx)))?;
        let a = self.clone();
        spawn("slurm", Box::new(move || a.slurm_loop()))?;
        let a = self.clone();
        spawn("health", Box::new(move || a.health_loop()))?;
        let a = self.clone();
        spawn("domains", Box::new(move || a.domain_loop()))?;
        let a = self.clone();
        spawn("keepers", Box::new(move || a.keeper_loop()))?;
        if self.cfg.telemetry.enabled {
            // Validated at config load; an error here would be a bug, so it falls back to the table.
            let rules = self
                .cfg
                .telemetry
                .rules()
                .unwrap_or_else(|_| mpsr_telemetry::RULES.to_vec());
            let mut det = mpsr_telemetry::Detector::new(rules);
            det.restore(self.state().telemetry.active.clone());
            let source = self.backend.telemetry_source();
            let a = self.clone();
            spawn("telemetry", Box::new(move || a.telemetry_loop(source, det)))?;
        }
        if !self.cfg.telemetry.listen.is_empty() {
            // Validated at load (networks, token file); an error here means the token file
            // changed since: serve nobody rather than everybody.
            let access = self.cfg.telemetry.http_access().unwrap_or_else(|e| {
                tracing::error!(key = e.key, error = %e.message, "telemetry HTTP serves nobody");
                crate::api::http_access::Access::default()
            });
            match tiny_http::Server::http(self.cfg.telemetry.listen.as_str()) {
                Ok(server) => {
                    let a = self.clone();
                    spawn(
                        "http",
                        Box::new(move || crate::api::http::serve(a, server, access)),
                    )?;
                }
                // Metrics are not worth failing the fault handling for: say so and go on.
                Err(e) => tracing::error!(
                    listen = %self.cfg.telemetry.listen,
                    error = %e,
                    "telemetry HTTP not started"
                ),
            }
        }
        Ok(())
    }

    /// Starts missing keepers (first start, or one that died); cheap pings otherwise.
    fn keeper_loop(self: Arc<Self>) {
        loop {
            let lost: BTreeSet<u32> = self
                .state()
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
        use crate::act::keepers::{kept_verdict, KeptVerdict};
        let kept: Vec<(u32, u64)> = self
            .state()
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
            self.state().durable.kept_for_requeue.remove(&job);
            self.mark_dirty();
            if v == KeptVerdict::Free {
                tracing::info!(job, "requeued job will not run again (Slurm says it ended); its kept GPU state freed");
                self.keepers.job_end(job, Duration::ZERO);
            }
        }
    }
}
