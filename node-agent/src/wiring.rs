//! Wiring: reads the state back, makes the channels, the workers and their handles, starts the GPU
//! backend, the fault domains and every worker thread (the only module that knows them all;
//! nothing imports it but the binary).

use crate::act::escalation::Escalation;
use crate::act::keeper_watch::KeeperWatch;
use crate::act::keepers::Keepers;
use crate::act::recovery::Recovery;
use crate::act::slurm::scontrol::Scontrol;
use crate::act::slurm::worker::SlurmWorker;
use crate::agent::{Agent, Trusted};
use crate::config::Config;
use crate::domain::lifecycle::Domains;
use crate::domain::probe::Prober;
use crate::fault::classify::Classifier;
use crate::fault::worker::FaultWorker;
use crate::gpu::GpuBackend;
use crate::store::Store;
use crate::sys::atomic_file;
use crate::sys::worker;
use crate::telemetry::Telemetry;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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

/// A worker thread; one that panics ends the agent (systemd restarts it): none may die silently.
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), StartError> {
    let n = name.to_string();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || worker::guarded(&n, f, worker::exit_on_panic))
        .map(|_| ())
        .map_err(|source| StartError::Thread {
            name: name.into(),
            source,
        })
}

/// Reads the state back, starts the backend, every fault domain and every worker. Returns once
/// the agent is ready to serve requests.
pub fn start(
    cfg: Config,
    node: String,
    backend: Arc<dyn GpuBackend>,
    classifier: Classifier,
    trusted: Trusted,
) -> Result<Arc<Agent>, StartError> {
    for dir in [&cfg.state_dir, &cfg.run_dir] {
        std::fs::create_dir_all(dir).map_err(|source| StartError::Dir {
            path: dir.clone(),
            source,
        })?;
    }
    let cfg = Arc::new(cfg);
    let window = Duration::from_millis(cfg.faults.correlation_window_ms);
    let state = crate::store::recover::recover(&cfg.state_dir, window)?;
    let store = Arc::new(Store::new(state, &cfg.state_dir));
    // Written once now so a recovered-and-reconciled state is durable before we serve.
    store.persist_now();
    let (signals, signals_rx) = std::sync::mpsc::channel();
    let (probes, probes_rx) = std::sync::mpsc::channel();
    hand_kmsg_cursor(&cfg, &store);
    backend.start(signals.clone())?;
    let domains = Arc::new(Domains::new(
        cfg.clone(),
        store.clone(),
        backend.clone(),
        signals.clone(),
    ));
    domains.start_all()?;
    let slurm = Arc::new(Scontrol::new(cfg.slurm.clone()));
    let keepers = Arc::new(Keepers::new(
        &cfg,
        backend
            .gpus()
            .iter()
            .map(|g| (g.index, g.uuid.clone()))
            .collect(),
        backend.simulated(),
    ));
    let escalation = Arc::new(Escalation::new(
        &cfg,
        node.clone(),
        store.clone(),
        backend.clone(),
        domains.clone(),
    ));
    let recovery = Arc::new(Recovery::new(
        &cfg.mps,
        store.clone(),
        backend.clone(),
        keepers.clone(),
        escalation,
    ));
    let faults = FaultWorker::new(
        cfg.clone(),
        node.clone(),
        store.clone(),
        backend.clone(),
        classifier,
        probes,
    );
    let s = store.clone();
    spawn("persist", move || s.run_persister())?;
    spawn("faults", move || faults.run(signals_rx))?;
    let prober = Prober::new(store.clone(), backend.clone(), signals.clone());
    spawn("probe", move || prober.run(probes_rx))?;
    let slurm_worker = SlurmWorker::new(store.clone(), slurm.clone());
    spawn("slurm", move || slurm_worker.run())?;
    let r = recovery.clone();
    spawn("health", move || r.run())?;
    let d = domains.clone();
    spawn("domains", move || d.run())?;
    let watch = KeeperWatch::new(store.clone(), backend.clone(), keepers.clone(), slurm);
    spawn("keepers", move || watch.run())?;
    let exporter = mpsr_telemetry::metrics::Exporter::default();
    if cfg.telemetry.enabled {
        let t = Telemetry::new(
            cfg.clone(),
            node.clone(),
            store.clone(),
            backend.clone(),
            exporter.clone(),
        );
        let (source, detector) = t.prepare();
        spawn("telemetry", move || t.run(source, detector))?;
    }
    let agent = Arc::new(Agent {
        cfg,
        node,
        backend,
        trusted,
        store,
        domains,
        recovery,
        keepers,
        signals,
        exporter,
    });
    serve_http(&agent)?;
    Ok(agent)
}

/// The kernel-log reader resumes after the record kept with the last decision made from it (what
/// it read later and was not decided is read again).
fn hand_kmsg_cursor(cfg: &Config, store: &Store) {
    let Some(k) = store.lock().durable.cursors.kmsg.clone() else {
        return;
    };
    let file = cfg.state_dir.join(crate::intake::readers::KMSG_CURSOR_FILE);
    if let Err(e) = atomic_file::write_atomic(&file, &k) {
        tracing::warn!(error = %e, "kernel-log cursor not handed to its reader");
    }
}

fn serve_http(agent: &Arc<Agent>) -> Result<(), StartError> {
    let cfg = &agent.cfg.telemetry;
    if cfg.listen.is_empty() {
        return Ok(());
    }
    // Validated at load (networks, token file); an error here means the token file changed
    // since: serve nobody rather than everybody.
    let access = cfg.http_access().unwrap_or_else(|e| {
        tracing::error!(key = e.key, error = %e.message, "telemetry HTTP serves nobody");
        crate::sys::http_access::Access::default()
    });
    match tiny_http::Server::http(cfg.listen.as_str()) {
        Ok(server) => {
            let a = agent.clone();
            spawn("http", move || crate::api::http::serve(a, server, access))
        }
        // Metrics are not worth failing the fault handling for: say so and go on.
        Err(e) => {
            tracing::error!(listen = %cfg.listen, error = %e, "telemetry HTTP not started");
            Ok(())
        }
    }
}

/// Writes what changed and stops the domains' daemons (when configured to).
pub fn shutdown(agent: &Agent) {
    agent.store.persist_now();
    let domains = agent
        .store
        .lock()
        .all_domains(agent.backend.gpus().iter().map(|g| g.index));
    agent.backend.shutdown(&domains);
}
