//! The agent: its parts (config, GPU backend, classifier, state, persister, Slurm executor) and
//! its threads. What each thread does lives in its own module: `faults` (signal -> decision ->
//! actions), `slurm_exec` (requeue/drain), `recovery` (servers back to ACTIVE, resume verdicts),
//! `domain` (fault domains' daemons), `persister` (state on disk). Requests are in `handlers`.

use crate::act::slurm::scontrol::Scontrol;
use crate::config::Config;
use crate::domain::{DomainProbe, Policy};
use crate::fault::classify::{Classifier, FaultClass};
use crate::fault::correlate::{Correlator, Signal};
use crate::gpu::GpuBackend;
use crate::store::persist;
use crate::store::persister::Persister;
use crate::store::state::{Durable, State};
use crate::sys::{lock, procfs};
use mpsr_proto::DecisionRecord;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    pub started: Instant,
    pub keepers: Arc<crate::act::keepers::Keepers>,
    pub telemetry: crate::telemetry::Telemetry,
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
                d,
                history,
                telemetry,
                correlator: Correlator::new(window),
                recovering: BTreeMap::new(),
                recent_exits: VecDeque::new(),
                moved: Vec::new(),
                totals: Default::default(),
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
            started: Instant::now(),
            keepers,
            telemetry: crate::telemetry::Telemetry::default(),
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

    pub fn signal_sender(&self) -> Option<Sender<Signal>> {
        lock(&self.signals).clone()
    }

    /// Starts the backend, every fault domain and every loop. Returns once the agent is ready.
    pub fn start(self: &Arc<Self>) -> Result<(), StartError> {
        let (tx, rx) = std::sync::mpsc::channel();
        *lock(&self.signals) = Some(tx.clone());
        let (ptx, prx) = std::sync::mpsc::channel();
        *lock(&self.probes) = Some(ptx);
        self.backend.start(tx)?;
        self.start_domains()?;
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
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
                .d
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
            std::thread::sleep(Duration::from_secs(5));
        }
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
}

/// Reads the state back and reconciles it with the processes alive now: tasks that exited while
/// the agent was down leave the registry (and their standbys and resume entries go).
fn recover_state(cfg: &Config) -> Result<Recovered, StartError> {
    let mut d: Durable = persist::read(&cfg.state_dir.join("state.json"))?.unwrap_or_default();
    let journal_path = cfg.state_dir.join("registry.journal");
    let (replayed, last_seq) =
        crate::store::journal::Journal::replay(&journal_path, d.journal_seq, &mut d.registry);
    if replayed > 0 {
        tracing::info!(entries = replayed, "registry journal replayed");
    }
    let history: VecDeque<DecisionRecord> =
        persist::read(&cfg.state_dir.join("history.json"))?.unwrap_or_default();
    let telemetry: crate::store::state::TelemetryLog =
        persist::read(&cfg.state_dir.join("telemetry.json"))?.unwrap_or_default();
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
    crate::api::standby::remove_fifos(&stale);
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
    })
}
