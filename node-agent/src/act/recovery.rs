//! After a fault: watches each hit domain's server back to ACTIVE, clears healed GPUs, and answers
//! resume supervisors (`resume`).
//!
//! A server stays in FAULT until every client it poisoned is gone. A hit resume task that keeps
//! no standby has its CUDA processes ended at once (its supervisor restarts it). After
//! `mps.fault_grace_ms`, the clients that belong to a hit job (already dead in GPU terms: their next CUDA call fails)
//! are ended with SIGKILL: `terminate_client` does not reach a client that is not calling CUDA,
//! and measured on an H200 it then blocks the control daemon (nothing answers, the server stays in
//! FAULT until the client's next CUDA call, 29 s later in that run). Clients of no hit job get
//! `terminate_client` (off this loop) and are named in the event as what blocks recovery, never
//! killed.

use crate::act::escalation::Escalation;
use crate::act::keepers::Keepers;
use crate::config::MpsConfig;
use crate::gpu::GpuBackend;
use crate::store::state::{Recovering, State};
use crate::store::Store;
use crate::sys::procfs;
use mpsr_proto::{DomainId, FaultOutcome, ServerState};
use mpsr_proto::{FaultClass, Mode};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod resume;
pub use resume::Verdict;

/// How often a recovering server is asked for its state in the first `WATCH_CLOSELY` of its
/// recovery, and after.
const WATCH: Duration = Duration::from_millis(10);
const WATCH_CLOSELY: Duration = Duration::from_secs(2);
const WATCH_LATER: Duration = Duration::from_millis(100);

/// Recovery and the handles it needs.
pub struct Recovery {
    /// Hit clients are ended once their server has been in FAULT this long.
    grace: Duration,
    /// How often healed GPUs are looked for.
    health: Duration,
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    keepers: Arc<Keepers>,
    escalation: Arc<Escalation>,
}

impl Recovery {
    pub fn new(
        mps: &MpsConfig,
        store: Arc<Store>,
        backend: Arc<dyn GpuBackend>,
        keepers: Arc<Keepers>,
        escalation: Arc<Escalation>,
    ) -> Recovery {
        Recovery {
            grace: Duration::from_millis(mps.fault_grace_ms),
            health: Duration::from_millis(mps.health_interval_ms),
            store,
            backend,
            keepers,
            escalation,
        }
    }

    /// The health loop, until the process ends.
    pub fn run(self: Arc<Self>) {
        // Recovering servers are watched closely (a hit task's restart waits for ACTIVE, and the
        // time to it is an outcome people read); healed GPUs are looked for every
        // `mps.health_interval_ms`. Only domains that recover are asked, so the cost is bounded
        // by the faults, not by the node.
        let health = self.health;
        let mut last_health = Instant::now();
        let mut asked = BTreeMap::new();
        loop {
            std::thread::sleep(WATCH);
            self.watch_recovering(&mut asked);
            if last_health.elapsed() >= health {
                last_health = Instant::now();
                self.clear_healed();
            }
        }
    }

    /// Asks each recovering domain's server for its state: every `WATCH` in the first
    /// `WATCH_CLOSELY` of its recovery (a normal recovery ends there), then every `WATCH_LATER`
    /// (each question is a command to its control daemon, which a stuck server may make slow).
    fn watch_recovering(self: &Arc<Self>, asked: &mut BTreeMap<DomainId, Instant>) {
        let grace = self.grace;
        let recovering: Vec<(DomainId, u64, Instant)> = self
            .store
            .lock()
            .recovering
            .iter()
            .map(|(d, r)| (*d, r.fault_id, r.since))
            .collect();
        asked.retain(|d, _| recovering.iter().any(|(r, _, _)| r == d));
        let now = Instant::now();
        let domains = recovering.into_iter().filter(|(d, _, since)| {
            let due = now.duration_since(*since) < WATCH_CLOSELY
                || asked
                    .get(d)
                    .is_none_or(|t| now.duration_since(*t) >= WATCH_LATER);
            if due {
                asked.insert(*d, now);
            }
            due
        });
        for (domain, fault_id, since) in domains.collect::<Vec<_>>() {
            match self.backend.server_state(domain) {
                ServerState::Active | ServerState::Idle => {
                    let ms = since.elapsed().as_millis();
                    let mut st = self.store.lock();
                    st.recovering.remove(&domain);
                    let o = FaultOutcome::ServerActive {
                        domain,
                        ms: ms as u64,
                    };
                    tracing::info!(%domain, fault_id, "{o}");
                    self.store.record(&mut st, fault_id, None, o);
                    drop(st);
                    // Supervisors waiting to restart a task of this domain go now.
                    self.store.recovery_changed();
                }
                // A server holding a poisoned client may not answer at all (its control daemon
                // blocks): Down here is that, not a dead daemon.
                ServerState::Fault | ServerState::Down if since.elapsed() > grace => {
                    self.end_hit_clients(domain, fault_id, grace);
                    self.escalation.escalate(domain, fault_id, since);
                }
                ServerState::Fault | ServerState::Down => {
                    self.end_resume_primaries(domain, fault_id)
                }
                ServerState::Lost => {}
            }
        }
    }

    /// SIGKILLs the clients of `domain` that are (or run under) a registered task of a hit job;
    /// reports the others once. The server's client list is not enough: measured on an H200,
    /// while a poisoned idle client holds the server, `terminate_client` blocks and the control
    /// daemon answers nothing. So the hit tasks' own CUDA processes (holding /dev/nvidia*) count too.
    fn end_hit_clients(self: &Arc<Self>, domain: DomainId, fault_id: u64, grace: Duration) {
        // At most once a second: asking for the clients is a command to a daemon that may be slow.
        let Some(Some(roots)) = self.hit_roots(domain) else {
            return;
        };
        let mut clients = self.backend.clients(domain);
        for p in procfs::under(&roots) {
            if !clients.contains(&p) && procfs::uses_gpu(p) {
                clients.push(p);
            }
        }
        let Some((lines, terminate)) = self.kill_hit_clients(domain, grace, clients) else {
            return;
        };
        // Off the health loop: terminate_client blocks until the client is gone (an idle one: up
        // to the command timeout, the control daemon answering nothing meanwhile).
        for pid in terminate {
            let a = self.clone();
            std::thread::spawn(move || {
                let res = a.backend.terminate_client(domain, pid);
                let o = FaultOutcome::ClientTerminated {
                    domain,
                    pid,
                    error: res.err().map(|e| e.to_string()),
                };
                tracing::warn!(%domain, pid, "{o}");
                let mut st = a.store.lock();
                a.store.record(&mut st, fault_id, None, o);
            });
        }
        for o in lines {
            tracing::warn!(%domain, fault_id, "{o}");
            let mut st = self.store.lock();
            self.store.record(&mut st, fault_id, None, o);
        }
    }

    /// Ends at once, once per recovery, the CUDA processes of the hit resume tasks that keep no
    /// standby: they are poisoned (their next CUDA call fails) and their supervisor restarts
    /// them the moment they are gone. Left to notice on their own they exit ~220 ms after an
    /// Xid 43 (measured on an H100), which delays both that restart and the server's recovery.
    /// The supervisor itself (the task's pid, no CUDA) is never ended.
    fn end_resume_primaries(&self, domain: DomainId, fault_id: u64) {
        let roots = {
            let mut st = self.store.lock();
            let Some(r) = st.recovering.get(&domain).filter(|r| !r.primaries_ended) else {
                return;
            };
            let roots = resume_tasks_to_restart(&st, domain, &r.hit_jobs);
            // Looked for again on the next watch while there are none (an in-memory scan).
            if roots.is_empty() {
                return;
            }
            if let Some(r) = st.recovering.get_mut(&domain) {
                r.primaries_ended = true;
            }
            roots
        };
        // Found in /proc, not asked of the faulted server's control daemon (it may not answer
        // while a poisoned client holds it, and this is the health loop).
        let ended: Vec<(u32, Option<u64>)> = procfs::under(&roots)
            .into_iter()
            .filter(|p| !roots.contains(p) && procfs::uses_gpu(*p))
            .map(|p| (p, procfs::start_ticks(p)))
            .collect();
        let mut st = self.store.lock();
        for (pid, ticks) in ended {
            let Some(r) = st.recovering.get_mut(&domain) else {
                return;
            };
            r.fenced_pids.push((pid, ticks));
            let Some(o) = kill_hit_client(r, domain, pid, 0) else {
                continue;
            };
            tracing::info!(%domain, fault_id, "{o} (a resume task's: its supervisor restarts it)");
            self.store.record(&mut st, fault_id, None, o);
        }
    }

    /// The pids of the hit jobs' tasks in `domain` (their descendants are the CUDA processes to
    /// look for), at most once a second (`Some(None)` in between); None once the domain no longer
    /// recovers.
    fn hit_roots(&self, domain: DomainId) -> Option<Option<Vec<u32>>> {
        let mut st = self.store.lock();
        let State {
            durable: d,
            recent_exits,
            recovering,
            ..
        } = &mut *st;
        let r = recovering.get_mut(&domain)?;
        if r.scanned_at
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return Some(None);
        }
        r.scanned_at = Some(Instant::now());
        Some(Some(
            d.registry
                .tasks()
                .chain(recent_exits.iter().map(|(_, t)| t))
                .filter(|t| r.hit_jobs.contains(&t.job_id) && t.in_domain(domain))
                .map(|t| t.pid)
                .collect(),
        ))
    }

    /// SIGKILLs the clients that run under a task of a hit job (once each); the others are
    /// returned to get terminate_client (once each). The outcome lines to add come back too.
    fn kill_hit_clients(
        &self,
        domain: DomainId,
        grace: Duration,
        clients: Vec<u32>,
    ) -> Option<(Vec<FaultOutcome>, Vec<u32>)> {
        let (mut lines, mut terminate) = (Vec::new(), Vec::new());
        let mut st = self.store.lock();
        let r = st.recovering.get(&domain)?;
        let hit = r.hit_jobs.clone();
        let fenced_by_us: Vec<u32> = r
            .fenced_pids
            .iter()
            .filter(|(p, ticks)| procfs::alive(*p, *ticks))
            .map(|(p, _)| *p)
            .collect();
        let (kill, blockers) = split_clients(&st, &hit, &fenced_by_us, clients, procfs::ancestry);
        let r = st.recovering.get_mut(&domain)?;
        lines.extend(
            kill.into_iter()
                .filter_map(|pid| kill_hit_client(r, domain, pid, grace.as_millis() as u64)),
        );
        for pid in blockers {
            if r.blockers_reported.insert(pid) {
                lines.push(FaultOutcome::ServerHeld { domain, pid });
                terminate.push(pid);
            }
        }
        Some((lines, terminate))
    }

    fn clear_healed(&self) {
        let unhealthy: Vec<(u32, FaultClass)> = self
            .store
            .lock()
            .durable
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
                self.store.lock().durable.unhealthy.remove(&gpu);
                tracing::info!(gpu, "GPU answers again; marked healthy");
                self.store.mark_dirty();
                // Its memory did not survive the reset: a fresh keeper restores snapshots.
                self.keepers.restart(gpu);
            }
        }
    }

    /// Waits up to `within` while any of `domains` recovers from a fault: MPS refuses a new
    /// client of a server in FAULT (CUDA error 807). Returns those still recovering at the end.
    pub fn await_recovered(&self, domains: &[DomainId], within: Duration) -> Vec<DomainId> {
        let deadline = Instant::now() + within;
        loop {
            let still: Vec<DomainId> = {
                let st = self.store.lock();
                domains
                    .iter()
                    .copied()
                    .filter(|d| st.recovering.contains_key(d))
                    .collect()
            };
            if still.is_empty() || Instant::now() >= deadline {
                return still;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// SIGKILLs a client of a hit job once per recovery (terminate_client does not reach an idle
/// client) and returns its outcome line; None if it was already ended.
fn kill_hit_client(
    r: &mut Recovering,
    domain: DomainId,
    pid: u32,
    grace_ms: u64,
) -> Option<FaultOutcome> {
    if !r.killed.insert(pid) {
        return None;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is a client (or CUDA process)
    // of this domain's server under a registered task of a hit job, found a moment ago.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    Some(FaultOutcome::HitClientKilled {
        domain,
        pid,
        grace_ms,
        error: (rc != 0).then(|| std::io::Error::last_os_error().to_string()),
    })
}

/// The registered resume-mode tasks of the `hit` jobs in `domain` that keep no standby (one
/// prepared, armed or released is the takeover's to fence) and are no culprit: their pids (their
/// supervisors').
fn resume_tasks_to_restart(st: &State, domain: DomainId, hit: &BTreeSet<u32>) -> Vec<u32> {
    st.durable
        .registry
        .tasks()
        .filter(|t| t.mode == Mode::Resume && hit.contains(&t.job_id) && t.in_domain(domain))
        .filter(|t| {
            let key = (t.job_id, t.step_id, t.pid);
            !st.durable.standbys.iter().any(|s| s.task == key)
                && st
                    .durable
                    .resume
                    .get(key)
                    .is_some_and(|e| e.fail.is_none() && e.takeover.is_none())
        })
        .map(|t| t.pid)
        .collect()
}

/// Which clients of a server held in FAULT are ended (those of a hit job: a registered task of it,
/// or one that just exited, among their ancestors; or a process the agent itself fenced) and which
/// are only reported as holding the server (every other one: never killed).
fn split_clients(
    st: &State,
    hit: &std::collections::BTreeSet<u32>,
    fenced_by_us: &[u32],
    clients: Vec<u32>,
    ancestry: impl Fn(u32) -> Vec<u32>,
) -> (Vec<u32>, Vec<u32>) {
    let (mut kill, mut blockers) = (Vec::new(), Vec::new());
    for pid in clients {
        let ancestry = ancestry(pid);
        let of_hit_job = fenced_by_us.contains(&pid)
            || hit.iter().any(|j| {
                st.durable
                    .registry
                    .task_in_ancestry(*j, &ancestry)
                    .is_some()
                    || st
                        .recent_exits
                        .iter()
                        .any(|(_, t)| t.job_id == *j && ancestry.contains(&t.pid))
            });
        if of_hit_job {
            kill.push(pid);
        } else {
            blockers.push(pid);
        }
    }
    (kill, blockers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::registry::Task;
    use mpsr_proto::Mode;

    fn task(job: u32, pid: u32) -> Task {
        Task {
            trusted: true,
            ..crate::store::registry::tests::task(job, pid, 1000, &[0])
        }
    }

    /// A client under a hit job's task (registered, or exited a moment ago) or fenced by the
    /// agent is ended; a client of another job, or of no job, is only reported.
    #[test]
    fn only_the_clients_of_hit_jobs_are_ended() {
        let dir = tempfile::tempdir().unwrap();
        let mut st =
            crate::store::recover::recover(dir.path(), Duration::from_millis(100)).unwrap();
        st.durable.registry.register(task(5, 100)).unwrap();
        st.durable.registry.register(task(6, 200)).unwrap();
        st.note_exit(task(7, 300), Duration::from_secs(60));
        let hit = [5, 7].into_iter().collect();
        // pid -> its ancestors (itself first), as /proc would say.
        let tree = |pid: u32| match pid {
            101 => vec![101, 100, 1],
            201 => vec![201, 200, 1],
            301 => vec![301, 300, 1],
            p => vec![p, 1],
        };
        let (kill, report) = split_clients(&st, &hit, &[900], vec![101, 201, 301, 900, 950], tree);
        assert_eq!(kill, vec![101, 301, 900]);
        assert_eq!(report, vec![201, 950]);
    }

    /// Only the hit resume tasks that keep no standby and are no culprit have their processes
    /// ended at the start of the recovery; a requeue job's, a standby's task's, another
    /// domain's or an unhit job's wait for the grace as before.
    #[test]
    fn the_hit_resume_tasks_without_a_standby_are_restarted_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut st =
            crate::store::recover::recover(dir.path(), Duration::from_millis(100)).unwrap();
        let shared = DomainId::shared(0);
        let resume = |job, pid| Task {
            mode: Mode::Resume,
            batch: false,
            ..task(job, pid)
        };
        let entry = |fail: Option<&str>, takeover| crate::store::state::ResumeEntry {
            fault_id: 1,
            gpu: 0,
            slot: 0,
            fail: fail.map(str::to_string),
            takeover,
            standby_kind: Default::default(),
            consumed: false,
        };
        for (t, e) in [
            (resume(1, 100), Some(entry(None, None))),
            (task(2, 200), None),
            (resume(3, 300), Some(entry(None, None))),
            (resume(4, 400), Some(entry(Some("culprit"), None))),
            (
                resume(5, 500),
                Some(entry(
                    None,
                    Some(crate::store::state::Takeover::Releasing(501)),
                )),
            ),
            (resume(6, 600), Some(entry(None, None))),
            (
                Task {
                    domains: vec![DomainId { gpu: 0, slot: 2 }],
                    ..resume(7, 700)
                },
                Some(entry(None, None)),
            ),
        ] {
            if let Some(e) = e {
                st.durable.resume.insert((t.job_id, 0, t.pid), e);
            }
            st.durable.registry.register(t).unwrap();
        }
        // Task 3 keeps a standby (prepared, not yet armed).
        st.durable.standbys.push(crate::store::state::Standby {
            task: (3, 0, 300),
            uid: 1000,
            domain: DomainId { gpu: 0, slot: 1 },
            fifo: "/run/x".into(),
            armed: None,
            kind: Default::default(),
        });
        let hit = [1, 2, 3, 4, 5, 7].into_iter().collect();
        assert_eq!(resume_tasks_to_restart(&st, shared, &hit), vec![100]);
    }
}
