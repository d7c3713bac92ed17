//! GPU backends: real GPUs (NVML + nvidia-cuda-mps-control) or simulated ones. The rest of the agent
//! only sees this trait.

pub mod nvml;
pub mod sim;

use crate::event::Signal;
use crate::kmsg::PciAddr;
use mpsr_proto::ServerState;
use std::sync::mpsc::Sender;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub pci: PciAddr,
    pub pipe_dir: String,
    pub log_dir: String,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("NVML: {0}")]
    Nvml(String),
    #[error("MPS control daemon for gpu{gpu}: {message}")]
    Mps { gpu: u32, message: String },
    #[error("no GPU {0}")]
    NoSuchGpu(u32),
    #[error("{0} is only available with the sim backend")]
    Unsupported(&'static str),
    #[error("simulated GPUs: {0}")]
    Sim(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

pub trait GpuBackend: Send + Sync {
    fn name(&self) -> &'static str;
    fn simulated(&self) -> bool;
    fn gpus(&self) -> &[GpuInfo];
    /// Start MPS daemons and event sources; signals go to `tx`.
    fn start(&self, tx: Sender<Signal>) -> Result<(), BackendError>;
    fn server_state(&self, gpu: u32) -> ServerState;
    fn clients(&self, gpu: u32) -> Vec<u32>;
    fn terminate_client(&self, gpu: u32, pid: u32) -> Result<(), BackendError>;
    /// Whether a GPU that had a hardware fault answers again (used to clear `unhealthy`).
    fn probe_healthy(&self, gpu: u32) -> bool;
    fn shutdown(&self);
    /// Inject a simulated fault; returns the pids of the clients it killed.
    fn sim_inject(
        &self,
        _gpu: u32,
        _xid: u32,
        _culprit: Option<u32>,
    ) -> Result<Vec<u32>, BackendError> {
        Err(BackendError::Unsupported("fault injection"))
    }
    fn sim_recover(&self, _gpu: u32) -> Result<(), BackendError> {
        Err(BackendError::Unsupported("GPU recovery"))
    }

    fn gpu_by_pci(&self, pci: PciAddr) -> Option<u32> {
        self.gpus().iter().find(|g| g.pci == pci).map(|g| g.index)
    }
}
