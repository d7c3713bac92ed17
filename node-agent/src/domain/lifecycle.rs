//! The domains' daemons on this node: start (or adopt after an agent restart), log tails (a server.log fatal-error line says *which* server faulted),
//! probing servers after a fault no domain has shown yet, and stopping domains that stayed empty.

use super::{paths, DomainRecord, LogTails, Policy};
use crate::config::Config;
use crate::gpu::{BackendError, DomainSpec, GpuBackend};
use crate::intake::readers::LogCursor;
use crate::signal::Signal;
use crate::store::Store;
use crate::sys::lock;
use mpsr_proto::{DomainId, DomainStatus, FaultOutcome, ServerState};
use std::collections::BTreeSet;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod placement;
pub use placement::{Placement, PlacementError};

/// How often a fenced domain's daemon is started again to see whether it comes back.
pub const RETRY_FENCED: Duration = Duration::from_secs(30);

/// Queries of a daemon that must all fail before it is taken for dead.
const DOWN_CONFIRMATIONS: u32 = 3;

/// Whether a daemon is really down: one failed query is not enough (a slow answer under load, a
/// control daemon busy with another command); it must answer none of `tries` queries `pause`
/// apart. Starting a live daemon "again" would replace what watches it for nothing.
fn confirmed_down(mut state: impl FnMut() -> ServerState, tries: u32, pause: Duration) -> bool {
    for i in 0..tries {
        if i > 0 {
            std::thread::sleep(pause);
        }
        if state() != ServerState::Down {
            return false;
        }
    }
    true
}

/// The domains' daemons and the handles they need.
pub struct Domains {
    cfg: Arc<Config>,
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    /// The admin's fault-domain placement rules.
    policy: Policy,
    /// Where the log tails send what they read.
    signals: Sender<Signal>,
    /// Serializes starting and stopping domains' daemons.
    ops: Mutex<()>,
    /// Each domain's MPS log tails.
    log_tails: LogTails,
}

impl Domains {
    pub fn new(
        cfg: Arc<Config>,
        store: Arc<Store>,
        backend: Arc<dyn GpuBackend>,
        signals: Sender<Signal>,
    ) -> Domains {
        Domains {
            policy: crate::domain::Policy::from_config(&cfg.mps),
            cfg,
            store,
            backend,
            signals,
            ops: Mutex::new(()),
            log_tails: LogTails::default(),
        }
    }

    /// What the domain's daemon is started with (its record's owner and limits).
    pub fn domain_spec(&self, id: DomainId) -> DomainSpec {
        let rec = self.store.lock().durable.domains.get(id).cloned();
        self.spec(id, rec.as_ref())
    }

    fn spec(&self, id: DomainId, rec: Option<&DomainRecord>) -> DomainSpec {
        let (pipe_dir, log_dir) = paths(&self.cfg.run_dir, id);
        let admin_pct = Some(self.cfg.mps.default_thread_pct).filter(|p| *p < 100);
        let admin_mem = crate::config::parse_size(&self.cfg.mps.default_pinned_mem_limit);
        DomainSpec {
            id,
            pipe_dir,
            log_dir,
            owner_uid: rec.and_then(|r| r.owner_uid),
            thread_pct: rec.and_then(|r| r.thread_pct).or(admin_pct),
            mem_limit: rec.and_then(|r| r.mem_limit).or(admin_mem),
        }
    }

    /// Starts (or adopts) each GPU's shared domain and every recorded domain; a recorded domain
    /// that cannot be started is dropped from the table (its tasks are gone with it).
    pub fn start_all(&self) -> Result<(), BackendError> {
        let _serial = lock(&self.ops);
        for g in self.backend.gpus() {
            self.start_domain(&self.spec(DomainId::shared(g.index), None))?;
        }
        let records: Vec<DomainRecord> = self
            .store
            .lock()
            .durable
            .domains
            .records()
            .cloned()
            .collect();
        for r in records {
            match self.start_domain(&self.spec(r.id, Some(&r))) {
                Ok(()) => {
                    tracing::info!(domain = %r.id, tenancy = %r.tenancy, "fault domain adopted")
                }
                Err(e) => {
                    tracing::error!(domain = %r.id, error = %e, "fault domain could not be started again; dropped");
                    self.store.lock().durable.domains.remove(r.id);
                    self.store.mark_dirty();
                }
            }
        }
        Ok(())
    }

    /// Callers hold `domain_ops`: a domain is never started and stopped at once.
    fn start_domain(&self, spec: &DomainSpec) -> Result<(), BackendError> {
        let t0 = Instant::now();
        let started = self.backend.start_domain(spec)?;
        tracing::debug!(domain = %spec.id, ms = t0.elapsed().as_millis() as u64, ?started, "fault domain daemon up");
        self.follow_logs(spec, started);
        Ok(())
    }

    /// Follows the domain's logs: a daemon started in fresh directories writes new files, so
    /// its tails start anew; an adopted one keeps its tails.
    ///
    /// Each tail starts at the position kept with the decisions (an adopted daemon: lines written
    /// while the agent was down are read then), else at the file's end now, which is kept as the
    /// position from then on: a fault written after it is read after a restart, however soon.
    pub fn follow_logs(&self, spec: &DomainSpec, started: crate::gpu::dirs::Started) {
        if started == crate::gpu::dirs::Started::Fresh {
            self.log_tails.stop(spec.id);
        }
        if !self.cfg.faults.mps_logs {
            return;
        }
        let from: std::collections::BTreeMap<std::path::PathBuf, LogCursor> = {
            let mut st = self.store.lock();
            let cursors = &mut st.durable.cursors;
            if started == crate::gpu::dirs::Started::Fresh {
                cursors.forget_dir(&spec.log_dir);
            }
            super::tails::LOGS
                .iter()
                .map(|name| {
                    let path = spec.log_dir.join(name);
                    let kept = cursors.logs.get(&path).copied();
                    let now = crate::intake::readers::log_position(&path);
                    let at = match (kept, now) {
                        (Some(k), Some(n)) if k.ino == n.ino && k.offset <= n.offset => k,
                        // Made (or replaced) since the position was kept: all of it is news.
                        (Some(_), Some(n)) => LogCursor {
                            ino: n.ino,
                            offset: 0,
                        },
                        (None, Some(n)) => n,
                        (_, None) => LogCursor::default(),
                    };
                    cursors.logs.insert(path.clone(), at);
                    (path, at)
                })
                .collect()
        };
        self.store.mark_dirty();
        self.log_tails.ensure(
            spec.id,
            &spec.log_dir,
            |p| from.get(p).copied(),
            &self.signals,
        );
    }

    fn stop_domain(&self, id: DomainId) {
        self.log_tails.stop(id);
        let (_, log_dir) = paths(&self.cfg.run_dir, id);
        self.store.lock().durable.cursors.forget_dir(&log_dir);
        match self.backend.stop_domain(id) {
            Ok(()) => tracing::info!(domain = %id, "empty fault domain stopped"),
            Err(e) => tracing::warn!(domain = %id, error = %e, "stopping fault domain failed"),
        }
    }

    /// Starts again the daemon of every domain that does not answer (it crashed or was killed):
    /// new clients of that domain would find no server. A GPU marked unhealthy is left alone.
    fn restart_dead_daemons(&self, down: &mut BTreeSet<DomainId>) {
        let domains: Vec<(DomainId, Option<DomainRecord>)> = {
            let st = self.store.lock();
            self.backend
                .gpus()
                .iter()
                .filter(|g| !st.durable.unhealthy.contains_key(&g.index))
                .flat_map(|g| st.domains_of_gpu(g.index))
                // A server recovering from a fault may not answer: it is not dead (the escalation
                // ladder restarts it); a fenced one is retried by the ladder's own loop.
                .filter(|d| !st.recovering.contains_key(d) && !st.durable.domains.is_fenced(*d))
                .map(|d| (d, st.durable.domains.get(d).cloned()))
                .collect()
        };
        for (d, rec) in domains {
            let state = || self.backend.server_state(d);
            if !confirmed_down(state, DOWN_CONFIRMATIONS, Duration::from_millis(250)) {
                down.remove(&d);
                continue;
            }
            let _serial = lock(&self.ops);
            match self.start_domain(&self.spec(d, rec.as_ref())) {
                Ok(()) => {
                    down.remove(&d);
                    tracing::warn!(domain = %d, "MPS control daemon was not answering; started again");
                }
                Err(e) => {
                    if down.insert(d) {
                        tracing::error!(domain = %d, error = %e, "MPS control daemon not answering and cannot be started; retrying");
                    }
                }
            }
        }
    }

    /// Stops job and user domains that had neither registered tasks nor clients for the linger time,
    /// and every few seconds starts again a domain daemon that stopped answering.
    pub fn run(&self) {
        const WATCHDOG_EVERY: u32 = 5;
        let linger_ms = self.cfg.mps.domain_linger_s * 1000;
        let mut down = BTreeSet::new();
        let mut tick = 0u32;
        loop {
            std::thread::sleep(Duration::from_secs(1));
            tick = tick.wrapping_add(1);
            if tick.is_multiple_of(WATCHDOG_EVERY) {
                self.restart_dead_daemons(&mut down);
            }
            if tick.is_multiple_of(RETRY_FENCED.as_secs() as u32) {
                self.retry_fenced();
            }
            let (ids, used): (Vec<DomainId>, BTreeSet<DomainId>) = {
                let st = self.store.lock();
                let ids = st.durable.domains.records().map(|r| r.id).collect();
                (ids, in_use(&st.durable))
            };
            // A client not (yet) registered keeps its domain alive too.
            let busy: BTreeSet<DomainId> = ids
                .into_iter()
                .filter(|d| used.contains(d) || !self.backend.clients(*d).is_empty())
                .collect();
            let _serial = lock(&self.ops);
            let expired = {
                let mut st = self.store.lock();
                let now = crate::sys::now_ms();
                let used_now = in_use(&st.durable);
                let e = st.durable.domains.expired(
                    |d| busy.contains(&d) || used_now.contains(&d),
                    now,
                    linger_ms,
                );
                for d in &e {
                    st.durable.domains.remove(*d);
                }
                e
            };
            if expired.is_empty() {
                continue;
            }
            self.store.mark_dirty();
            for d in expired {
                self.stop_domain(d);
            }
        }
    }

    /// Ends the domain's control daemon and starts it again (fresh directories, new log tails).
    pub fn restart_daemon(&self, domain: DomainId) -> Result<(), String> {
        let _serial = lock(&self.ops);
        let spec = self.domain_spec(domain);
        self.backend
            .restart_daemon(&spec)
            .map_err(|e| e.to_string())?;
        self.follow_logs(&spec, crate::gpu::dirs::Started::Fresh);
        Ok(())
    }

    /// Starts each fenced domain's daemon again (every `RETRY_FENCED`, from the domain loop);
    /// one that answers ACTIVE is placed into again.
    fn retry_fenced(&self) {
        let fenced: Vec<DomainId> = self.store.lock().durable.domains.fenced().collect();
        for domain in fenced {
            let back = self.restart_daemon(domain).is_ok()
                && matches!(
                    self.backend.server_state(domain),
                    ServerState::Active | ServerState::Idle
                );
            if !back {
                continue;
            }
            if self.store.lock().durable.domains.unfence(domain) {
                let o = FaultOutcome::DomainUnfenced { domain };
                tracing::warn!(%domain, "{o}");
                self.store.mark_dirty();
            }
        }
    }

    /// Status of a GPU's domains; `own` filters jobs (and hides clients) for untrusted callers.
    pub fn domain_status(&self, gpu: u32, own: Option<&BTreeSet<u32>>) -> Vec<DomainStatus> {
        let fenced: BTreeSet<DomainId> = self.store.lock().durable.domains.fenced().collect();
        let (domains, jobs) = {
            let st = self.store.lock();
            let domains: Vec<(DomainId, String)> = st
                .domains_of_gpu(gpu)
                .into_iter()
                .map(|d| (d, st.durable.domains.tenancy(d).to_string()))
                .collect();
            (
                domains,
                super::jobs_by_domain(st.durable.registry.tasks(), gpu),
            )
        };
        domains
            .into_iter()
            .map(|(d, tenancy)| DomainStatus {
                domain: d,
                tenancy: if own.is_some() && !d.is_shared() {
                    "private".into()
                } else {
                    tenancy
                },
                state: self.backend.server_state(d),
                clients: if own.is_none() {
                    self.backend.clients(d)
                } else {
                    vec![]
                },
                jobs: jobs
                    .get(&d)
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(|j| own.is_none_or(|o| o.contains(j)))
                    .collect(),
                memory_bytes: self.backend.domain_memory(d),
                fenced: fenced.contains(&d),
            })
            .collect()
    }
}

/// The domains that must keep running: those of registered tasks, and those where a hot or warm
/// standby waits (a warm one is no client while it waits: its server must still be there when it
/// is released). A cold standby keeps none: it restarts its task only where a server still runs.
fn in_use(d: &crate::store::state::Durable) -> BTreeSet<DomainId> {
    d.registry
        .tasks()
        .flat_map(|t| t.gpus.iter().filter_map(|g| t.domain_on(*g)))
        .chain(
            d.standbys
                .iter()
                .filter(|s| s.kind != mpsr_proto::standby::Kind::Cold)
                .map(|s| s.domain),
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_failed_query_does_not_make_a_daemon_dead() {
        let answers = std::cell::RefCell::new(vec![ServerState::Down, ServerState::Active]);
        let next = || answers.borrow_mut().remove(0);
        assert!(!confirmed_down(next, 3, Duration::ZERO));
        let mut n = 0;
        let always_down = || {
            n += 1;
            ServerState::Down
        };
        assert!(confirmed_down(always_down, 3, Duration::ZERO));
        assert_eq!(n, 3, "asked three times before giving up on it");
    }

    /// A warm standby is no client while it waits: its domain must not linger out under it. A
    /// cold one keeps nothing running.
    #[test]
    fn hot_and_warm_standbys_keep_their_domain_cold_ones_do_not() {
        use mpsr_proto::standby::Kind;
        let mut d = crate::store::state::Durable::default();
        let domain = |slot| DomainId { gpu: 0, slot };
        for (slot, kind) in [(1, Kind::Hot), (2, Kind::Warm), (3, Kind::Cold)] {
            d.standbys.push(crate::store::state::Standby {
                task: (10 + slot, 0, 100 + slot),
                uid: 1000,
                domain: domain(slot),
                fifo: "/nonexistent".into(),
                armed: None,
                kind,
            });
        }
        let used = in_use(&d);
        assert!(used.contains(&domain(1)) && used.contains(&domain(2)));
        assert!(!used.contains(&domain(3)));
    }
}
