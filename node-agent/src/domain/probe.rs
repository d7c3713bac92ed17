//! Probing servers after an application fault that no domain has shown yet: the servers of the
//! fault's candidate domains are asked whether they are in FAULT until one is, or the wait is over;
//! a server in FAULT becomes a signal for its domain.

use crate::gpu::GpuBackend;
use crate::signal::{GpuRef, Signal, Source};
use crate::store::Store;
use mpsr_proto::{DomainId, ServerState};
use std::collections::BTreeSet;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Ask these domains' servers whether they are in FAULT, until `until` (after an application
/// fault that no domain has shown yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainProbe {
    pub fault_id: u64,
    pub gpu: u32,
    pub domains: BTreeSet<DomainId>,
    pub until: Instant,
}

/// The probe worker and the handles it needs.
pub struct Prober {
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    signals: Sender<Signal>,
}

impl Prober {
    pub fn new(store: Arc<Store>, backend: Arc<dyn GpuBackend>, signals: Sender<Signal>) -> Prober {
        Prober {
            store,
            backend,
            signals,
        }
    }

    /// Polls the servers of an awaited fault's domains; a server in FAULT is a signal for its domain.
    pub fn run(&self, rx: Receiver<DomainProbe>) {
        while let Ok(mut p) = rx.recv() {
            while Instant::now() < p.until && !p.domains.is_empty() {
                let faulted: Vec<DomainId> = p
                    .domains
                    .iter()
                    .copied()
                    .filter(|d| self.backend.server_state(*d) == ServerState::Fault)
                    .collect();
                for d in faulted {
                    p.domains.remove(&d);
                    let mut s = Signal::new(Source::MpsStatus, GpuRef::Index(p.gpu), None);
                    s.domain = Some(d.slot);
                    s.detail = format!("{d} server in FAULT (get_server_status)");
                    let _ = self.signals.send(s);
                }
                std::thread::sleep(Duration::from_millis(25));
            }
            let mut st = self.store.lock();
            let still = st
                .history
                .iter()
                .rev()
                .find(|r| r.fault_id == p.fault_id)
                .is_some_and(|r| r.awaiting_domain);
            if still {
                let o = mpsr_proto::FaultOutcome::NoDomainShowed;
                tracing::warn!(fault_id = p.fault_id, gpu = p.gpu, "{o}");
                self.store.record(&mut st, p.fault_id, None, o);
            }
        }
    }
}
