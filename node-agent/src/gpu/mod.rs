//! GPU backends: real GPUs (NVML + nvidia-cuda-mps-control) or simulated ones. The rest of the agent
//! only sees this trait: GPUs, their event sources, and fault domains (one MPS control daemon and
//! server each) addressed by [`DomainId`]. `dirs` makes a domain's pipe and log directories fresh
//! for each daemon start (root's log directory: the root control daemon follows symlinks there).

pub mod dirs;
pub mod mps;
pub mod nvml;
pub mod sim;

use crate::signal::PciAddr;
use crate::signal::Signal;
use dirs::Started;
use mpsr_proto::{DomainId, ServerState};
use std::path::PathBuf;
use std::sync::mpsc::Sender;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub pci: PciAddr,
}

/// One line of `mpsr-agent --self-check`: what was looked at, and what was found there or why
/// it is missing (both text for people).
pub type CheckLine = (String, Result<String, CheckFailed>);

/// Why one self-check failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CheckFailed(pub String);

impl CheckFailed {
    pub fn of(e: impl std::fmt::Display) -> CheckFailed {
        CheckFailed(e.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("NVML: {0}")]
    Nvml(String),
    #[error("MPS control daemon of {domain}: {source}")]
    Mps {
        domain: DomainId,
        source: crate::sys::process::RunError,
    },
    #[error("no GPU {0}")]
    NoSuchGpu(u32),
    #[error("no fault domain {0}")]
    NoSuchDomain(DomainId),
    #[error("{0} is only available with the sim backend")]
    Unsupported(&'static str),
    #[error("simulated GPUs: {0}")]
    Sim(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// What a domain's daemon is started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainSpec {
    pub id: DomainId,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    /// Only this uid's processes may open the pipe directory (job and user domains).
    pub owner_uid: Option<u32>,
    /// Server defaults (`set_default_active_thread_percentage`, pinned memory limit).
    pub thread_pct: Option<u8>,
    pub mem_limit: Option<u64>,
}

pub trait GpuBackend: Send + Sync {
    fn name(&self) -> &'static str;
    fn simulated(&self) -> bool;
    fn gpus(&self) -> &[GpuInfo];
    /// Starts the GPU-wide event sources (NVML Xid events, kernel log); signals go to `tx`.
    fn start(&self, tx: Sender<Signal>) -> Result<(), BackendError>;
    /// Starts a domain's MPS control daemon in fresh directories, or adopts the one already
    /// answering there.
    fn start_domain(&self, spec: &DomainSpec) -> Result<Started, BackendError>;
    /// Escalation for a server stuck in FAULT: ends the domain's MPS server processes (every
    /// client of a faulted server is dead in GPU terms already); its control daemon starts a fresh
    /// server for the next client. Returns the pids ended.
    fn end_server(&self, id: DomainId) -> Result<Vec<u32>, BackendError>;
    /// Escalation for a control daemon that does not answer: ends it and its servers, then starts
    /// it again in fresh directories.
    fn restart_daemon(&self, spec: &DomainSpec) -> Result<(), BackendError>;
    /// Stops a domain's daemon (the agent does so only when it has no clients).
    fn stop_domain(&self, id: DomainId) -> Result<(), BackendError>;
    fn server_state(&self, id: DomainId) -> ServerState;
    fn clients(&self, id: DomainId) -> Vec<u32>;
    fn terminate_client(&self, id: DomainId, pid: u32) -> Result<(), BackendError>;
    /// GPU memory used by the domain's server and clients, where the backend can tell.
    fn domain_memory(&self, id: DomainId) -> Option<u64>;
    /// Whether a GPU that had a hardware fault answers again (used to clear `unhealthy`).
    fn probe_healthy(&self, gpu: u32) -> bool;
    /// Stops every domain's daemon if configured to (`mps.quit_on_shutdown`).
    fn shutdown(&self, domains: &[DomainId]);
    /// Inject a simulated fault into `slot`'s server (else the culprit's, else the shared one);
    /// returns the pids of the clients it killed.
    fn sim_inject(
        &self,
        _gpu: u32,
        _xid: u32,
        _culprit: Option<u32>,
        _slot: Option<u32>,
    ) -> Result<Vec<u32>, BackendError> {
        Err(BackendError::Unsupported("fault injection"))
    }
    fn sim_recover(&self, _gpu: u32) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("GPU recovery"))
    }
    /// The telemetry source for these GPUs (owned by the agent's telemetry thread).
    fn telemetry_source(&self) -> Box<dyn mpsr_telemetry::source::Source>;
    /// Inject a simulated pathology into the simulated telemetry for `secs` from now.
    fn sim_pathology(
        &self,
        _what: mpsr_telemetry::replay::Pathology,
        _gpu: u32,
        _pid: Option<u32>,
        _secs: u32,
    ) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("pathology injection"))
    }

    fn gpu_by_pci(&self, pci: PciAddr) -> Option<u32> {
        self.gpus().iter().find(|g| g.pci == pci).map(|g| g.index)
    }
}
