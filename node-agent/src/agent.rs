//! The agent's hub: its parts (config, GPU backend, classifier, state, persister, Slurm executor,
//! keepers) and the state read back at start. It imports no worker: the workers (`fault::worker`,
//! `act::*`, `domain::lifecycle`, `telemetry`, `api`) work on it, and `wiring` starts them.

use crate::act::slurm::scontrol::Scontrol;
use crate::config::Config;
use crate::domain::{DomainProbe, Policy};
use crate::fault::classify::Classifier;
use crate::fault::correlate::{Correlator, Signal};
use crate::gpu::GpuBackend;
use crate::store::atomic_file;
use crate::store::persister::{Durability, Persister};
use crate::store::state::{Durable, State};
use crate::sys::{lock, procfs};
use mpsr_proto::DecisionRecord;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

pub struct Agent {
    pub cfg: Config,
    pub node: String,
    pub backend: Arc<dyn GpuBackend>,
    pub classifier: Classifier,
    pub trusted: BTreeSet<u32>,
    /// The admin's fault-domain placement rules.
    pub policy: Policy,
    state: Mutex<State>,
    pub(crate) persister: Persister,
    pub(crate) slurm: Scontrol,
    pub(crate) slurm_wake: Condvar,
    signals: Mutex<Option<Sender<Signal>>>,
    pub(crate) probes: Mutex<Option<Sender<DomainProbe>>>,
    /// Serializes starting and stopping domains' daemons.
    pub(crate) domain_ops: Mutex<()>,
    /// Each domain's MPS log tails.
    pub(crate) log_tails: crate::domain::LogTails,
    pub keepers: Arc<crate::act::keepers::Keepers>,
    /// The latest telemetry round, published for `/metrics` and `mpsrctl top`.
    pub exporter: mpsr_telemetry::metrics::Exporter,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Persist(#[from] atomic_file::PersistError),
    #[error("creating {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting thread {name}: {source}")]
    Thread {
        name: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Backend(#[from] crate::gpu::BackendError),
}

impl Agent {
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
        let Recovered {
            d,
            history,
            telemetry,
            last_seq,
            gone,
        } = recover_state(&cfg)?;
        let journal_path = cfg.state_dir.join("registry.journal");
        let window = Duration::from_millis(cfg.faults.correlation_window_ms);
        let slurm = Scontrol::new(cfg.slurm.clone());
        let keepers = Arc::new(crate::act::keepers::Keepers::new(
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
            policy: cfg.mps.policy(),
            state: Mutex::new(State {
                durable: d,
                history,
                telemetry,
                correlator: Correlator::new(window),
                recovering: BTreeMap::new(),
                recent_exits: VecDeque::new(),
                moved: Vec::new(),
                totals: Default::default(),
                escalations: Default::default(),
                xid_totals: Default::default(),
                down_exits: crate::store::state::DownExits::new(gone),
                journal_pending: Vec::new(),
                next_seq: last_seq + 1,
            }),
            persister: Persister::new(&journal_path),
            slurm,
            slurm_wake: Condvar::new(),
            signals: Mutex::new(None),
            probes: Mutex::new(None),
            domain_ops: Mutex::new(()),
            log_tails: crate::domain::LogTails::default(),
            keepers,
            exporter: Default::default(),
            cfg,
        });
        // Write once now so a recovered-and-reconciled state is durable before we serve.
        agent.persist_now();
        Ok(agent)
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Marks the durable state changed; returns the generation to wait for.
    pub fn mark_dirty(&self) -> u64 {
        self.persister.mark_dirty()
    }

    /// Marks registry changes recorded with `State::journal` (only a journal append is needed).
    pub fn mark_journaled(&self) -> u64 {
        self.persister.mark_journaled()
    }

    /// Marks the telemetry log changed (written without the state file).
    pub fn telemetry_changed(&self) {
        self.persister.telemetry_changed();
    }

    /// The generation of the latest change: waiting for it covers everything changed so far.
    pub fn latest_gen(&self) -> u64 {
        self.persister.latest_gen()
    }

    /// Blocks until generation `gen` is on disk (bounded: a stuck disk must not hang callers forever).
    pub fn wait_durable(&self, gen: u64) -> bool {
        self.wait_durable_within(gen, Duration::from_secs(5)) == Durability::Durable
    }

    /// Waits up to `bound` for generation `gen` to be on disk (see `Persister`).
    pub fn wait_durable_within(&self, gen: u64, bound: Duration) -> Durability {
        self.persister.wait_durable_within(gen, bound)
    }

    /// The persister's writer thread (group commit of the state), until the process ends.
    pub(crate) fn persist_loop(&self) {
        self.persister.run(&self.state, &self.cfg.state_dir);
    }

    /// Where the workers send fault signals (the fault worker reads them).
    pub(crate) fn set_signal_sender(&self, tx: Sender<Signal>) {
        *lock(&self.signals) = Some(tx);
    }

    /// Writes what changed now, on the caller's thread (at start and at shutdown).
    pub(crate) fn persist_now(&self) {
        self.persister.persist(&self.state, &self.cfg.state_dir);
    }

    pub fn is_trusted(&self, uid: u32) -> bool {
        uid == 0 || self.trusted.contains(&uid)
    }

    pub fn signal_sender(&self) -> Option<Sender<Signal>> {
        lock(&self.signals).clone()
    }

    pub fn shutdown(&self) {
        self.persist_now();
        let domains = self.all_domains(&self.state());
        self.backend.shutdown(&domains);
    }
}

/// What the agent finds on disk at start: the state file with the registry journal replayed on
/// top, the decision history and telemetry log.
struct Recovered {
    d: Durable,
    history: VecDeque<DecisionRecord>,
    telemetry: crate::store::state::TelemetryLog,
    last_seq: u64,
    /// Tasks that exited while the agent was down (a fault then may have been why).
    gone: Vec<crate::store::registry::Task>,
}

/// Reads the state back and reconciles it with the processes alive now: tasks that exited while
/// the agent was down leave the registry (and their standbys and resume entries go).
fn recover_state(cfg: &Config) -> Result<Recovered, StartError> {
    let mut d: Durable = atomic_file::read(&cfg.state_dir.join("state.json"))?.unwrap_or_default();
    let journal_path = cfg.state_dir.join("registry.journal");
    let (replayed, last_seq) =
        crate::store::journal::Journal::replay(&journal_path, d.journal_seq, &mut d.registry);
    if replayed > 0 {
        tracing::info!(entries = replayed, "registry journal replayed");
    }
    let history: VecDeque<DecisionRecord> =
        atomic_file::read(&cfg.state_dir.join("history.json"))?.unwrap_or_default();
    let telemetry: crate::store::state::TelemetryLog =
        atomic_file::read(&cfg.state_dir.join("telemetry.json"))?.unwrap_or_default();
    let gone = d.registry.reconcile(procfs::alive);
    d.tasks_left(&gone, crate::sys::now_ms());
    // Standbys of tasks that are gone, or whose standby process is.
    let live: std::collections::BTreeSet<_> = d
        .registry
        .tasks()
        .map(|t| (t.job_id, t.step_id, t.pid))
        .collect();
    let stale = d.drop_standbys(|s| {
        !live.contains(&s.task)
            || s.armed
                .is_some_and(|a| !procfs::alive(a.standby.0, a.standby.1))
    });
    crate::store::state::remove_fifos(&stale);
    for t in &gone {
        tracing::info!(
            job = t.job_id,
            step = t.step_id,
            pid = t.pid,
            "task exited while the agent was down; deregistered"
        );
        d.resume.remove((t.job_id, t.step_id, t.pid));
    }
    if !d.registry.is_empty() || !d.pending.is_empty() {
        tracing::info!(
            tasks = d.registry.len(),
            pending_actions = d.pending.len(),
            domains = d.domains.records().count(),
            "state recovered after restart"
        );
    }
    Ok(Recovered {
        d,
        history,
        telemetry,
        last_seq,
        gone,
    })
}
