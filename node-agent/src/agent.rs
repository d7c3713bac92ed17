//! What the requests are served from: the agent's parts, each a handle a worker holds too (the
//! state store, the domains, recovery, the keepers, the latest telemetry round). `wiring` makes
//! them; nothing here acts on its own.

use crate::act::keepers::Keepers;
use crate::act::recovery::Recovery;
use crate::config::Config;
use crate::domain::lifecycle::Domains;
use crate::gpu::GpuBackend;
use crate::signal::Signal;
use crate::store::Store;
use std::collections::BTreeSet;
use std::sync::mpsc::Sender;
use std::sync::Arc;

pub struct Agent {
    pub cfg: Arc<Config>,
    pub node: String,
    pub backend: Arc<dyn GpuBackend>,
    /// The uids that act for Slurm (root always does).
    pub trusted: Trusted,
    pub store: Arc<Store>,
    pub domains: Arc<Domains>,
    pub recovery: Arc<Recovery>,
    pub keepers: Arc<Keepers>,
    /// Where request threads send task exits (the fault worker reads them).
    pub signals: Sender<Signal>,
    /// The latest telemetry round, published for `/metrics` and `mpsrctl top`.
    pub exporter: mpsr_telemetry::metrics::Exporter,
}

/// The uids trusted to act for Slurm: root and the configured ones.
#[derive(Debug, Clone, Default)]
pub struct Trusted(pub BTreeSet<u32>);

impl Trusted {
    pub fn includes(&self, uid: u32) -> bool {
        uid == 0 || self.0.contains(&uid)
    }
}
