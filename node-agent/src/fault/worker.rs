//! The fault worker: the one door into the fault path. Signals from every intake (kernel log, NVML,
//! MPS logs, server probes, task exits reported by requests) arrive on one channel; for each, the
//! worker resolves the GPU, runs the pure core under the state lock, and hands the effects on:
//! terminations to a bounded worker of their own, probes to the probe loop, durability to the
//! persister (which the Slurm worker waits on before it acts).

use super::classify::Classifier;
use super::core::{self, Ctx, Effect};
use super::correlate::{GpuRef, Signal, Source};
use crate::config::Config;
use crate::domain::probe::DomainProbe;
use crate::domain::Policy;
use crate::gpu::GpuBackend;
use crate::store::queue::ActionKey;
use crate::store::Store;
use crate::sys::procfs;
use mpsr_proto::DomainId;
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Terminations waiting for the terminate worker; past this a storm's extra ones are dropped
/// (logged): the health loop still ends hit clients that outlive the grace.
const TERMINATIONS_QUEUED: usize = 1024;

/// A client to end, and the Slurm action to wait for first.
type Termination = (DomainId, u32, Option<ActionKey>);

/// How long a termination waits for the action before it (Slurm may be slow or down: the culprit
/// of a contained fault computes on scratch data meanwhile and must not run on for long).
const AFTER_AT_MOST: Duration = Duration::from_secs(2);

/// The fault worker and the handles it needs.
pub struct FaultWorker {
    cfg: Arc<Config>,
    node: String,
    store: Arc<Store>,
    backend: Arc<dyn GpuBackend>,
    classifier: Classifier,
    policy: Policy,
    probes: Sender<DomainProbe>,
}

impl FaultWorker {
    pub fn new(
        cfg: Arc<Config>,
        node: String,
        store: Arc<Store>,
        backend: Arc<dyn GpuBackend>,
        classifier: Classifier,
        probes: Sender<DomainProbe>,
    ) -> FaultWorker {
        FaultWorker {
            policy: crate::domain::Policy::from_config(&cfg.mps),
            cfg,
            node,
            store,
            backend,
            classifier,
            probes,
        }
    }

    /// Decides each signal until every sender is gone.
    pub fn run(self, rx: Receiver<Signal>) {
        let (tx, terminations) = std::sync::mpsc::sync_channel(TERMINATIONS_QUEUED);
        let (store, backend) = (self.store.clone(), self.backend.clone());
        let worker = std::thread::Builder::new()
            .name("terminate".into())
            .spawn(move || terminate_loop(&store, backend.as_ref(), terminations));
        if let Err(e) = worker {
            tracing::error!(error = %e, "terminate worker not started; clients are ended by the health loop only");
        }
        while let Ok(s) = rx.recv() {
            self.on_signal(s, &tx);
        }
    }

    fn gpu_of(&self, s: &Signal) -> Option<u32> {
        match s.gpu {
            GpuRef::Index(i) if (i as usize) < self.backend.gpus().len() => Some(i),
            GpuRef::Pci(p) => {
                let g = self.backend.gpu_by_pci(p);
                if g.is_none() {
                    tracing::warn!(pci = %p, xid = ?s.xid, "Xid for a GPU this agent does not manage; ignored");
                }
                g
            }
            GpuRef::Index(i) => {
                tracing::warn!(gpu = i, xid = ?s.xid, "signal for unknown GPU index; ignored");
                None
            }
        }
    }

    fn on_signal(&self, s: Signal, terminations: &SyncSender<Termination>) {
        let Some(gpu) = self.gpu_of(&s) else { return };
        if let Some(x) = s.xid.filter(|x| !core::known_xid(&self.classifier, *x)) {
            tracing::warn!(gpu, xid = x, source = s.source.name(), detail = %s.detail, "unknown Xid: logged, no action (classify it in faults.xid_classes)");
        }
        let ancestry = procfs::ancestry;
        let ctx = Ctx {
            classifier: &self.classifier,
            policy: &self.policy,
            node: &self.node,
            faults: &self.cfg.faults,
            quarantine_s: self.cfg.mps.quarantine_s,
            simulated: self.backend.simulated(),
            ancestry: &ancestry,
            now: Instant::now(),
        };
        let effects = {
            let mut st = self.store.lock();
            let effects = core::on_signal(&mut st, &ctx, gpu, &s);
            // Kept with the decision it led to (persisted together): after a restart the reader
            // goes on past it.
            if let Some(c) = &s.cursor {
                st.durable.cursors.advance(c);
            }
            effects
        };
        if s.cursor.is_some() {
            self.store.mark_dirty();
        }
        for e in effects {
            match e {
                Effect::History => self.store.history_changed(),
                Effect::Persist => {
                    self.store.mark_dirty();
                    self.store.action_queued();
                }
                Effect::Probe(p) => {
                    let _ = self.probes.send(p);
                }
                Effect::Release(r) => crate::act::takeover::release_standby(&self.store, r),
                Effect::EndStandby(sb) => crate::act::takeover::end_standby(sb),
                Effect::Terminate { domain, pid, after } => {
                    match terminations.try_send((domain, pid, after)) {
                        Ok(()) => {}
                        Err(TrySendError::Full(_)) => {
                            tracing::warn!(%domain, pid, "terminations queue full; left to the health loop")
                        }
                        Err(TrySendError::Disconnected(_)) => {
                            tracing::warn!(%domain, pid, "terminate worker gone; left to the health loop")
                        }
                    }
                }
            }
        }
    }
}

fn terminate_loop(store: &Store, backend: &dyn GpuBackend, rx: Receiver<Termination>) {
    while let Ok((domain, pid, after)) = rx.recv() {
        if let Some(key) = after {
            // Until the Slurm action is done (or gone, or the bound has passed).
            store.wait_settled(AFTER_AT_MOST, |st| {
                st.durable.done_keys.contains(&key)
                    || !st.durable.pending.iter().any(|p| p.key == key)
            });
        }
        if let Err(e) = backend.terminate_client(domain, pid) {
            tracing::warn!(%domain, pid, error = %e, "terminate_client failed");
        }
    }
}

/// A task ended (reported by slurmstepd's deregistration). An abnormal exit on a GPU with an open
/// fault corroborates it (it does not say which domain faulted: a job may crash on its own at that
/// moment). Sent to the fault worker like any other signal: the request thread does not run the
/// decision.
pub fn client_exit_signal(tx: &Sender<Signal>, gpus: &[u32], exit_status: Option<i32>) {
    if exit_status.is_none_or(|s| s == 0) {
        return;
    }
    for g in gpus {
        let mut s = Signal::new(Source::ClientExit, GpuRef::Index(*g), None);
        s.detail = format!("task exit status {exit_status:?}");
        let _ = tx.send(s);
    }
}
