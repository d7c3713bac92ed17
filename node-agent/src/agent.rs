//! The agent core: state (registry, pending Slurm actions, resume board, GPU health), the fault loop
//! (signal -> correlated event -> decision -> actions), and the background loops (Slurm executor,
//! MPS server health). Request handling lives in `handlers.rs`.

use crate::backend::GpuBackend;
use crate::config::Config;
use crate::decide::{decide, Action, Decision};
use crate::event::{Correlator, GpuRef, Merge, Signal, Source};
use crate::persist;
use crate::registry::{procfs, Registry};
use crate::slurm::{Outcome, PendingAction, Scontrol, SlurmOp};
use crate::xid::{BlastRadius, Classifier, FaultClass};
use mpsr_proto::{DecisionRecord, ResumeVerdict, ServerState};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const DONE_KEYS_KEPT: usize = 10_000;
const OUTCOME_JOBS_KEPT: usize = 2_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeEntry {
    pub fault_id: u64,
    pub gpu: u32,
    /// Set for culprits and tasks on an unusable GPU: their supervisor is told to fail.
    pub fail: Option<String>,
}

/// Everything that must survive an agent restart.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Durable {
    pub registry: Registry,
    pub next_fault_id: u64,
    pub pending: Vec<PendingAction>,
    pub done_keys: VecDeque<String>,
    /// job -> outcome lines (requeue done, resume handed over, ...).
    pub outcomes: BTreeMap<u32, Vec<String>>,
    /// `job.step.pid` -> resume entry.
    pub resume: BTreeMap<String, ResumeEntry>,
    /// gpu -> why it is unhealthy (hardware fault class).
    pub unhealthy: BTreeMap<u32, (FaultClass, String)>,
    /// Reports of jobs that ended here, with their owner uid, for `mpsrctl report` afterwards.
    #[serde(default)]
    pub finished: BTreeMap<u32, (u32, mpsr_proto::JobReport)>,
    /// The last registry journal entry this state file includes.
    #[serde(default)]
    pub journal_seq: u64,
}

/// A GPU whose server is expected to be in FAULT after a decision.
struct Recovering {
    fault_id: u64,
    since: Instant,
    terminated: BTreeSet<u32>,
}

pub struct State {
    pub d: Durable,
    pub history: VecDeque<DecisionRecord>,
    correlator: Correlator,
    recovering: BTreeMap<u32, Recovering>,
    /// Tasks that just exited abnormally. A fault kills its clients at about the moment its Xid is
    /// reported, so a victim may deregister before the fault's first signal arrives: it still
    /// counts as hit for a short while.
    recent_exits: VecDeque<(Instant, crate::registry::Task)>,
    /// Registry changes not yet in the journal file.
    journal_pending: Vec<crate::journal::Entry>,
    next_seq: u64,
}

impl State {
    /// Records a registry change for the journal (the change itself is already applied).
    pub fn journal(&mut self, op: crate::journal::Op) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.journal_pending.push(crate::journal::Entry { seq, op });
    }

    /// Notes an abnormal task exit (see `recent_exits`).
    pub fn note_exit(&mut self, t: crate::registry::Task, keep: Duration) {
        self.recent_exits.retain(|(at, _)| at.elapsed() < keep);
        self.recent_exits.push_back((Instant::now(), t));
        while self.recent_exits.len() > 10_000 {
            self.recent_exits.pop_front();
        }
    }
}

/// Group commit: mutations bump `dirty`; one writer thread persists and bumps `durable`. Registry
/// changes alone go to the journal (cheap); anything else sets `full` (state file rewrite).
struct Persister {
    gens: Mutex<(u64, u64)>,
    cv: Condvar,
    full: std::sync::atomic::AtomicBool,
    journal: Mutex<crate::journal::Journal>,
    /// The decision history changed (kept in its own file; not needed for correctness).
    history: std::sync::atomic::AtomicBool,
}

/// A full state file after this many journal entries.
const JOURNAL_MAX: usize = 20_000;

pub struct Agent {
    pub cfg: Config,
    pub node: String,
    pub backend: Arc<dyn GpuBackend>,
    pub classifier: Classifier,
    pub trusted: BTreeSet<u32>,
    state: Mutex<State>,
    persister: Persister,
    slurm: Scontrol,
    slurm_wake: Condvar,
    signals: Mutex<Option<Sender<Signal>>>,
    pub started: Instant,
    pub keepers: Arc<crate::keeper::Keepers>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Persist(#[from] persist::PersistError),
    #[error("creating {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking request thread must not wedge the agent: keep going with the data as it is.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Agent {
    fn state_file(&self) -> PathBuf {
        self.cfg.state_dir.join("state.json")
    }
    fn history_file(&self) -> PathBuf {
        self.cfg.state_dir.join("history.json")
    }

    pub fn new(
        cfg: Config,
        node: String,
        backend: Arc<dyn GpuBackend>,
        classifier: Classifier,
        trusted: BTreeSet<u32>,
    ) -> Result<Arc<Agent>, StartError> {
        for dir in [&cfg.state_dir, &cfg.run_dir] {
            std::fs::create_dir_all(dir).map_err(|source| StartError::Dir {
                path: dir.clone(),
                source,
            })?;
        }
        let mut d: Durable = persist::read(&cfg.state_dir.join("state.json"))?.unwrap_or_default();
        let journal_path = cfg.state_dir.join("registry.journal");
        let (replayed, last_seq) =
            crate::journal::Journal::replay(&journal_path, d.journal_seq, &mut d.registry);
        if replayed > 0 {
            tracing::info!(entries = replayed, "registry journal replayed");
        }
        let history: VecDeque<DecisionRecord> =
            persist::read(&cfg.state_dir.join("history.json"))?.unwrap_or_default();
        let gone = d.registry.reconcile(procfs::alive);
        for t in &gone {
            tracing::info!(
                job = t.job_id,
                step = t.step_id,
                pid = t.pid,
                "task exited while the agent was down; deregistered"
            );
            d.resume
                .remove(&format!("{}.{}.{}", t.job_id, t.step_id, t.pid));
        }
        if !d.registry.is_empty() || !d.pending.is_empty() {
            tracing::info!(
                tasks = d.registry.len(),
                pending_actions = d.pending.len(),
                "state recovered after restart"
            );
        }
        let window = Duration::from_millis(cfg.faults.correlation_window_ms);
        let slurm = Scontrol::new(cfg.slurm.clone());
        let keepers = Arc::new(crate::keeper::Keepers::new(
            &cfg,
            backend
                .gpus()
                .iter()
                .map(|g| (g.index, g.uuid.clone()))
                .collect(),
            backend.simulated(),
        ));
        let agent = Arc::new(Agent {
            node,
            backend,
            classifier,
            trusted,
            state: Mutex::new(State {
                d,
                history,
                correlator: Correlator::new(window),
                recovering: BTreeMap::new(),
                recent_exits: VecDeque::new(),
                journal_pending: Vec::new(),
                next_seq: last_seq + 1,
            }),
            persister: Persister {
                gens: Mutex::new((1, 0)),
                cv: Condvar::new(),
                // The first write is a full one: it folds the replayed journal into the state file.
                full: std::sync::atomic::AtomicBool::new(true),
                journal: Mutex::new(crate::journal::Journal::new(&journal_path)),
                history: std::sync::atomic::AtomicBool::new(false),
            },
            slurm,
            slurm_wake: Condvar::new(),
            signals: Mutex::new(None),
            started: Instant::now(),
            keepers,
            cfg,
        });
        // Write once now so a recovered-and-reconciled state is durable before we serve.
        agent.persist_now();
        Ok(agent)
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub fn is_trusted(&self, uid: u32) -> bool {
        uid == 0 || self.trusted.contains(&uid)
    }

    /// Marks the durable state changed; returns the generation to wait for.
    pub fn mark_dirty(&self) -> u64 {
        let mut g = lock(&self.persister.gens);
        self.persister
            .full
            .store(true, std::sync::atomic::Ordering::SeqCst);
        g.0 += 1;
        self.persister.cv.notify_all();
        g.0
    }

    /// Marks registry changes recorded with `State::journal` (only a journal append is needed).
    pub fn mark_journaled(&self) -> u64 {
        let mut g = lock(&self.persister.gens);
        g.0 += 1;
        self.persister.cv.notify_all();
        g.0
    }

    /// Blocks until generation `gen` is on disk (bounded: a stuck disk must not hang callers forever).
    pub fn wait_durable(&self, gen: u64) -> bool {
        let mut g = lock(&self.persister.gens);
        let deadline = Instant::now() + Duration::from_secs(5);
        while g.1 < gen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .persister
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    fn persist_now(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let (target, mut full) = {
            let g = lock(&self.persister.gens);
            (g.0, self.persister.full.swap(false, SeqCst))
        };
        let mut journal = lock(&self.persister.journal);
        full |= journal.len > JOURNAL_MAX;
        let result = if full {
            let body = {
                let mut st = self.state();
                // Everything journaled so far is in memory, hence in this file.
                st.d.journal_seq = st.next_seq - 1;
                st.journal_pending.clear();
                serde_json::to_vec(&st.d)
            };
            body.map_err(|e| e.to_string())
                .and_then(|b| {
                    persist::write_atomic_bytes(&self.state_file(), &b).map_err(|e| e.to_string())
                })
                .and_then(|_| journal.reset().map_err(|e| e.to_string()))
        } else {
            let entries = std::mem::take(&mut self.state().journal_pending);
            if entries.is_empty() {
                Ok(())
            } else {
                journal.append(&entries).map_err(|e| e.to_string())
            }
        };
        if self.persister.history.swap(false, SeqCst) {
            let body = serde_json::to_vec(&self.state().history);
            if let Err(e) = body.map_err(|e| e.to_string()).and_then(|b| {
                persist::write_atomic_bytes(&self.history_file(), &b).map_err(|e| e.to_string())
            }) {
                tracing::warn!(error = %e, "writing the decision history failed");
            }
        }
        match result {
            Ok(()) => {
                let mut g = lock(&self.persister.gens);
                g.1 = g.1.max(target);
                self.persister.cv.notify_all();
            }
            Err(e) => {
                // The next attempt writes the whole state, which holds whatever was lost here.
                self.persister.full.store(true, SeqCst);
                tracing::error!(error = %e, "persisting state failed; will retry");
            }
        }
    }

    fn persist_loop(self: Arc<Self>) {
        loop {
            {
                let mut g = lock(&self.persister.gens);
                while g.1 >= g.0 {
                    g = self.persister.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            }
            let before = lock(&self.persister.gens).1;
            self.persist_now();
            if lock(&self.persister.gens).1 == before {
                std::thread::sleep(Duration::from_millis(200)); // write failed; back off
            }
        }
    }

    pub fn signal_sender(&self) -> Option<Sender<Signal>> {
        lock(&self.signals).clone()
    }

    /// Starts the backend and every loop. Returns once the agent is ready to serve.
    pub fn start(self: &Arc<Self>) -> Result<(), StartError> {
        let (tx, rx) = std::sync::mpsc::channel();
        *lock(&self.signals) = Some(tx.clone());
        self.backend.start(tx)?;
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|source| StartError::Dir {
                    path: PathBuf::from(name),
                    source,
                })
        };
        let a = self.clone();
        spawn("persist", Box::new(move || a.persist_loop()))?;
        let a = self.clone();
        spawn("faults", Box::new(move || a.fault_loop(rx)))?;
        let a = self.clone();
        spawn("slurm", Box::new(move || a.slurm_loop()))?;
        let a = self.clone();
        spawn("health", Box::new(move || a.health_loop()))?;
        let a = self.clone();
        spawn(
            "keepers",
            Box::new(move || loop {
                // Start missing keepers (first start, or one that died); cheap pings otherwise.
                let lost: BTreeSet<u32> = a
                    .state()
                    .d
                    .unhealthy
                    .iter()
                    .filter(|(_, (c, _))| *c == FaultClass::DeviceLost)
                    .map(|(g, _)| *g)
                    .collect();
                for g in a.backend.gpus() {
                    if !lost.contains(&g.index) {
                        if let Err(e) = a.keepers.ensure(g.index) {
                            tracing::warn!(gpu = g.index, error = %e, "state keeper not available");
                        }
                    }
                }
                std::thread::sleep(Duration::from_secs(5));
            }),
        )?;
        Ok(())
    }

    fn fault_loop(self: Arc<Self>, rx: Receiver<Signal>) {
        while let Ok(s) = rx.recv() {
            self.on_signal(s);
        }
    }

    /// The data path: one signal in, at most one decision (or re-decision) out.
    pub fn on_signal(&self, s: Signal) {
        let gpu = match s.gpu {
            GpuRef::Index(i) if (i as usize) < self.backend.gpus().len() => i,
            GpuRef::Pci(p) => match self.backend.gpu_by_pci(p) {
                Some(i) => i,
                None => {
                    tracing::warn!(pci = %p, xid = ?s.xid, "Xid for a GPU this agent does not manage; ignored");
                    return;
                }
            },
            GpuRef::Index(i) => {
                tracing::warn!(gpu = i, xid = ?s.xid, "signal for unknown GPU index; ignored");
                return;
            }
        };
        if let Some(x) = s.xid {
            if self.classifier.class_of(x) == FaultClass::Unknown {
                tracing::warn!(gpu, xid = x, source = s.source.name(), detail = %s.detail, "unknown Xid: logged, no action (classify it in faults.xid_classes)");
            }
        }
        let mut st = self.state();
        let State { d, correlator, .. } = &mut *st;
        let merged = correlator.merge(gpu, &s, || {
            d.next_fault_id += 1;
            d.next_fault_id
        });
        let id = match merged {
            Merge::Ignored => return,
            Merge::Joined { id, changed: false } => {
                // Same fault seen by another source: note the source, decide nothing new.
                if let Some(r) = st.history.iter_mut().rev().find(|r| r.fault_id == id) {
                    let n = s.source.name().to_string();
                    if !r.sources.contains(&n) {
                        r.sources.push(n);
                    }
                    if r.reported_pid.is_none() {
                        r.reported_pid = s.reported_pid;
                    }
                }
                return;
            }
            Merge::New(id) | Merge::Joined { id, .. } => id,
        };
        let Some(ev) = st.correlator.get(id).cloned() else {
            return;
        };
        // The registry as it was a moment ago: live tasks plus victims that exited just now.
        // Copied only when there are such victims: the common case decides on the registry itself.
        let keep = self.exit_memory();
        let exited: Vec<&crate::registry::Task> = st
            .recent_exits
            .iter()
            .filter(|(at, t)| at.elapsed() < keep && t.gpus.contains(&ev.gpu))
            .map(|(_, t)| t)
            .collect();
        let view = if exited.is_empty() {
            std::borrow::Cow::Borrowed(&st.d.registry)
        } else {
            let mut v = st.d.registry.clone();
            for t in exited {
                v.insert_exited(t.clone());
            }
            std::borrow::Cow::Owned(v)
        };
        let reg: &crate::registry::Registry = &view;
        let decision = decide(&ev, reg, &self.classifier, &self.node, |pid| {
            procfs::ancestry(pid)
                .into_iter()
                .find_map(|p| reg.task_by_pid(p).map(|t| t.job_id))
        });
        let decide_us = ev.first.elapsed().as_micros() as u64;
        self.apply(&mut st, &ev, &decision, decide_us);
    }

    fn apply(&self, st: &mut State, ev: &crate::event::FaultEvent, dec: &Decision, decide_us: u64) {
        let mut action_lines = Vec::new();
        let mut terminate = Vec::new();
        for a in &dec.actions {
            action_lines.push(a.to_string());
            match a {
                Action::TerminateClient { gpu, pid } => terminate.push((*gpu, *pid)),
                Action::Requeue { job_id } => {
                    // One requeue per job and fault, however often the fault is re-decided.
                    let key = format!("f{}:requeue:{job_id}", ev.id);
                    let restarts_before =
                        st.d.registry
                            .tasks()
                            .chain(st.recent_exits.iter().map(|(_, t)| t))
                            .filter(|t| t.job_id == *job_id)
                            .map(|t| t.restart_count)
                            .max();
                    self.enqueue(
                        st,
                        key,
                        ev.id,
                        SlurmOp::Requeue {
                            job_id: *job_id,
                            restarts_before,
                        },
                    );
                }
                Action::DrainNode { reason } => {
                    let key = format!("f{}:drain", ev.id);
                    st.d.unhealthy.insert(ev.gpu, (dec.class, reason.clone()));
                    self.enqueue(
                        st,
                        key,
                        ev.id,
                        SlurmOp::Drain {
                            node: self.node.clone(),
                            reason: reason.clone(),
                        },
                    );
                }
                Action::Resume {
                    job_id,
                    step_id,
                    pid,
                } => hand_to_resume_board(
                    &mut st.d,
                    ev,
                    (*job_id, *step_id, *pid),
                    None,
                    "resume in place handed over".into(),
                ),
                Action::FailTask {
                    job_id,
                    step_id,
                    pid,
                    why,
                } => hand_to_resume_board(
                    &mut st.d,
                    ev,
                    (*job_id, *step_id, *pid),
                    Some(why.clone()),
                    format!("not resumed: {why}"),
                ),
                Action::None { job_id, why } => {
                    push_outcome(
                        &mut st.d.outcomes,
                        *job_id,
                        format!("fault {}: no action ({why})", ev.id),
                    );
                }
            }
        }
        if self.classifier.policy(dec.class).radius == BlastRadius::Gpu {
            st.recovering.entry(ev.gpu).or_insert(Recovering {
                fault_id: ev.id,
                since: ev.first,
                terminated: BTreeSet::new(),
            });
        }
        let record = DecisionRecord {
            fault_id: ev.id,
            at_ms: ev.first_ms,
            gpu: ev.gpu,
            xids: ev.xids.clone(),
            class: dec.class.to_string(),
            sources: ev.sources.iter().map(|s| s.name().to_string()).collect(),
            reported_pid: ev.reported_pid,
            culprit: ev.culprit,
            hit_jobs: dec.hit.iter().copied().collect(),
            spared_jobs: dec.spared.iter().copied().collect(),
            actions: action_lines,
            decide_us,
            outcome: Vec::new(),
        };
        // One structured line per decision.
        tracing::info!(
            target: "mpsr_decision",
            fault_id = record.fault_id,
            gpu = record.gpu,
            xids = ?record.xids,
            class = %record.class,
            sources = ?record.sources,
            reported_pid = ?record.reported_pid,
            culprit = ?record.culprit,
            hit = ?record.hit_jobs,
            spared = ?record.spared_jobs,
            actions = ?record.actions,
            decide_us = record.decide_us,
            simulated = self.backend.simulated(),
            "decision"
        );
        if let Some(old) = st.history.iter_mut().rev().find(|r| r.fault_id == ev.id) {
            let outcome = std::mem::take(&mut old.outcome);
            *old = record;
            old.outcome = outcome;
        } else {
            st.history.push_back(record);
            while st.history.len() > self.cfg.faults.history {
                st.history.pop_front();
            }
        }
        // Written by the persister, off the fault path.
        self.persister
            .history
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.mark_dirty();
        self.slurm_wake.notify_all();
        for (gpu, pid) in terminate {
            let b = self.backend.clone();
            std::thread::spawn(move || {
                if let Err(e) = b.terminate_client(gpu, pid) {
                    tracing::warn!(gpu, pid, error = %e, "terminate_client failed");
                }
            });
        }
    }

    fn enqueue(&self, st: &mut State, key: String, fault_id: u64, op: SlurmOp) {
        if st.d.done_keys.contains(&key) || st.d.pending.iter().any(|p| p.key == key) {
            return;
        }
        st.d.pending.push(PendingAction {
            key,
            fault_id,
            op,
            attempts: 0,
            last_error: None,
            fresh: true,
        });
    }

    fn add_outcome(&self, st: &mut State, fault_id: u64, line: String) {
        if let Some(r) = st.history.iter_mut().rev().find(|r| r.fault_id == fault_id) {
            r.outcome.push(line);
        }
        self.persister
            .history
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.mark_journaled();
    }

    /// Executes pending Slurm actions outside the state lock; retries with backoff.
    fn slurm_loop(self: Arc<Self>) {
        let mut not_before: BTreeMap<String, Instant> = BTreeMap::new();
        loop {
            let next = {
                let mut st = self.state();
                loop {
                    let now = Instant::now();
                    let ready =
                        st.d.pending
                            .iter()
                            .find(|p| not_before.get(&p.key).is_none_or(|t| *t <= now))
                            .cloned();
                    if let Some(p) = ready {
                        break p;
                    }
                    st = self
                        .slurm_wake
                        .wait_timeout(st, Duration::from_millis(100))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            };
            let outcome = self
                .slurm
                .execute(&next.op, !next.fresh || next.attempts > 0);
            let mut st = self.state();
            let job = match &next.op {
                SlurmOp::Requeue { job_id, .. } => Some(*job_id),
                SlurmOp::Drain { .. } => None,
            };
            let attempts = next.attempts + 1;
            let finished = match &outcome {
                Outcome::Done(m) | Outcome::Permanent(m) => Some(m.clone()),
                Outcome::Retry(e) if attempts >= self.slurm.max_attempts() => {
                    Some(format!("gave up after {attempts} attempts: {e}"))
                }
                Outcome::Retry(e) => {
                    tracing::warn!(key = %next.key, attempt = attempts, error = %e, "Slurm action failed; will retry");
                    if let Some(p) = st.d.pending.iter_mut().find(|p| p.key == next.key) {
                        p.attempts = attempts;
                        p.last_error = Some(e.clone());
                    }
                    not_before.insert(
                        next.key.clone(),
                        Instant::now() + self.slurm.backoff(attempts),
                    );
                    None
                }
            };
            if let Some(msg) = finished {
                let ok = matches!(outcome, Outcome::Done(_));
                if ok {
                    tracing::info!(key = %next.key, "{msg}");
                } else {
                    tracing::error!(key = %next.key, "Slurm action failed for good: {msg}");
                }
                st.d.pending.retain(|p| p.key != next.key);
                not_before.remove(&next.key);
                st.d.done_keys.push_back(next.key.clone());
                while st.d.done_keys.len() > DONE_KEYS_KEPT {
                    st.d.done_keys.pop_front();
                }
                let line = if ok { msg } else { format!("FAILED: {msg}") };
                if let Some(j) = job {
                    push_outcome(
                        &mut st.d.outcomes,
                        j,
                        format!("fault {}: {line}", next.fault_id),
                    );
                }
                self.add_outcome(&mut st, next.fault_id, line);
            }
            drop(st);
            let g = self.mark_dirty();
            self.wait_durable(g);
        }
    }

    /// Watches servers after a fault: ends clients that linger past the grace time (the server stays
    /// in FAULT until every faulting client is gone), records recovery, clears healed GPUs.
    fn health_loop(self: Arc<Self>) {
        let interval = Duration::from_millis(self.cfg.mps.health_interval_ms.min(100));
        let grace = Duration::from_millis(self.cfg.mps.fault_grace_ms);
        loop {
            std::thread::sleep(interval);
            let gpus: Vec<(u32, u64, Instant)> = self
                .state()
                .recovering
                .iter()
                .map(|(g, r)| (*g, r.fault_id, r.since))
                .collect();
            for (gpu, fault_id, since) in gpus {
                let state = self.backend.server_state(gpu);
                match state {
                    ServerState::Active | ServerState::Idle => {
                        let ms = since.elapsed().as_millis();
                        let mut st = self.state();
                        st.recovering.remove(&gpu);
                        let line =
                            format!("gpu{gpu} MPS server ACTIVE again {ms} ms after the fault");
                        tracing::info!(gpu, fault_id, "{line}");
                        self.add_outcome(&mut st, fault_id, line);
                    }
                    ServerState::Fault if since.elapsed() > grace => {
                        let clients = self.backend.clients(gpu);
                        let todo: Vec<u32> = {
                            let mut st = self.state();
                            let Some(r) = st.recovering.get_mut(&gpu) else {
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
                            let res = self.backend.terminate_client(gpu, pid);
                            let line = format!("terminate_client {pid} on gpu{gpu} (still attached after {} ms): {}", grace.as_millis(), if res.is_ok() { "ok".to_string() } else { format!("{res:?}") });
                            tracing::warn!(gpu, pid, "{line}");
                            let mut st = self.state();
                            self.add_outcome(&mut st, fault_id, line);
                        }
                    }
                    ServerState::Lost | ServerState::Down | ServerState::Fault => {}
                }
            }
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
                    && self.backend.server_state(gpu) != ServerState::Lost
                {
                    self.state().d.unhealthy.remove(&gpu);
                    tracing::info!(gpu, "GPU answers again; marked healthy");
                    self.mark_dirty();
                    // Its memory did not survive the reset: a fresh keeper restores snapshots.
                    self.keepers.restart(gpu);
                }
            }
        }
    }

    /// How long an abnormally exited task still counts as a possible victim of a fault.
    pub fn exit_memory(&self) -> Duration {
        Duration::from_millis((2 * self.cfg.faults.correlation_window_ms).max(1000))
    }

    /// Called when a task ends. An abnormal exit on a GPU with an open fault corroborates it.
    pub fn client_exit_signal(&self, gpus: &[u32], exit_status: Option<i32>) {
        let abnormal = exit_status.is_some_and(|s| s != 0);
        if !abnormal {
            return;
        }
        for g in gpus {
            let mut s = Signal::new(Source::ClientExit, GpuRef::Index(*g), None);
            s.detail = format!("task exit status {exit_status:?}");
            self.on_signal(s);
        }
    }

    pub fn resume_verdict(&self, key: &str) -> (ResumeVerdict, String) {
        let entry = self.state().d.resume.get(key).cloned();
        let Some(e) = entry else {
            return (ResumeVerdict::NotHit, "no fault known for this task".into());
        };
        if let Some(why) = e.fail {
            self.state().d.resume.remove(key);
            self.mark_dirty();
            return (ResumeVerdict::Fail, why);
        }
        match self.backend.server_state(e.gpu) {
            ServerState::Active | ServerState::Idle => {
                self.state().d.resume.remove(key);
                self.mark_dirty();
                (
                    ResumeVerdict::Restart,
                    format!(
                        "hit by fault {} on gpu{}; MPS server ACTIVE again",
                        e.fault_id, e.gpu
                    ),
                )
            }
            ServerState::Lost => {
                self.state().d.resume.remove(key);
                self.mark_dirty();
                (ResumeVerdict::Fail, format!("gpu{} is lost", e.gpu))
            }
            s => (
                ResumeVerdict::Wait,
                format!("hit by fault {}; gpu{} server is {s:?}", e.fault_id, e.gpu),
            ),
        }
    }

    pub fn shutdown(&self) {
        self.persist_now();
        self.backend.shutdown();
    }
}

/// Records a hit task's resume verdict (restart, or fail with a reason) and the job's outcome line.
fn hand_to_resume_board(
    d: &mut Durable,
    ev: &crate::event::FaultEvent,
    (job_id, step_id, pid): crate::registry::TaskKey,
    fail: Option<String>,
    line: String,
) {
    d.resume.insert(
        format!("{job_id}.{step_id}.{pid}"),
        ResumeEntry {
            fault_id: ev.id,
            gpu: ev.gpu,
            fail,
        },
    );
    push_outcome(&mut d.outcomes, job_id, format!("fault {}: {line}", ev.id));
}

/// Keeps a finished job's report (bounded like the outcome lines).
pub fn archive_report(d: &mut Durable, owner: u32, report: mpsr_proto::JobReport) {
    d.finished.insert(report.job_id, (owner, report));
    while d.finished.len() > OUTCOME_JOBS_KEPT {
        let Some(first) = d.finished.keys().next().copied() else {
            break;
        };
        d.finished.remove(&first);
    }
}

pub fn push_outcome(outcomes: &mut BTreeMap<u32, Vec<String>>, job: u32, line: String) {
    outcomes.entry(job).or_default().push(line);
    while outcomes.len() > OUTCOME_JOBS_KEPT {
        let Some(first) = outcomes.keys().next().copied() else {
            break;
        };
        outcomes.remove(&first);
    }
}
