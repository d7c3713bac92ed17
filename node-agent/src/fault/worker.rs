//! The fault worker: the one door into the fault path. Signals from every intake (kernel log, NVML,
//! MPS logs, server probes, task exits reported by requests) arrive on one channel; for each, the
//! worker resolves the GPU, runs the pure core under the state lock, and hands the effects on:
//! terminations to a bounded worker of their own, probes to the probe loop, durability to the
//! persister (which the Slurm worker waits on before it acts).

use super::core::{self, Ctx, Effect};
use super::correlate::{GpuRef, Signal, Source};
use crate::agent::Agent;
use crate::sys::procfs;
use mpsr_proto::DomainId;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

/// Terminations waiting for the terminate worker; past this a storm's extra ones are dropped
/// (logged): the health loop still ends hit clients that outlive the grace.
const TERMINATIONS_QUEUED: usize = 1024;

/// A client to end, and the Slurm action to wait for first.
type Termination = (DomainId, u32, Option<crate::act::slurm::queue::ActionKey>);

/// How long a termination waits for the action before it (Slurm may be slow or down: the culprit
/// of a contained fault computes on scratch data meanwhile and must not run on for long).
const AFTER_AT_MOST: std::time::Duration = std::time::Duration::from_secs(2);

impl Agent {
    pub(crate) fn fault_loop(self: Arc<Self>, rx: Receiver<Signal>) {
        let (tx, terminations) = std::sync::mpsc::sync_channel(TERMINATIONS_QUEUED);
        let a = self.clone();
        let worker = std::thread::Builder::new()
            .name("terminate".into())
            .spawn(move || a.terminate_loop(terminations));
        if let Err(e) = worker {
            tracing::error!(error = %e, "terminate worker not started; clients are ended by the health loop only");
        }
        while let Ok(s) = rx.recv() {
            self.on_signal(s, &tx);
        }
    }

    fn terminate_loop(&self, rx: Receiver<Termination>) {
        while let Ok((domain, pid, after)) = rx.recv() {
            if let Some(key) = after {
                self.wait_done(&key, AFTER_AT_MOST);
            }
            if let Err(e) = self.backend.terminate_client(domain, pid) {
                tracing::warn!(%domain, pid, error = %e, "terminate_client failed");
            }
        }
    }

    /// Waits until the Slurm action `key` is done (or gone, or `at_most` has passed).
    fn wait_done(&self, key: &crate::act::slurm::queue::ActionKey, at_most: std::time::Duration) {
        let until = Instant::now() + at_most;
        while Instant::now() < until {
            let st = self.state();
            if st.durable.done_keys.contains(key)
                || !st.durable.pending.iter().any(|p| &p.key == key)
            {
                return;
            }
            drop(st);
            std::thread::sleep(std::time::Duration::from_millis(5));
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
            let mut st = self.state();
            let effects = core::on_signal(&mut st, &ctx, gpu, &s);
            // Kept with the decision it led to (persisted together): after a restart the reader
            // goes on past it.
            if let Some(c) = &s.cursor {
                st.durable.cursors.advance(c);
            }
            effects
        };
        if s.cursor.is_some() {
            self.mark_dirty();
        }
        for e in effects {
            match e {
                Effect::History => self.persister.history_changed(),
                Effect::Persist => {
                    self.mark_dirty();
                    self.slurm_wake.notify_all();
                }
                Effect::Probe(p) => self.request_probe(p),
                Effect::Release(r) => self.release_standby(r),
                Effect::EndStandby(sb) => self.end_standby(sb),
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

    /// Every domain of every GPU.
    pub fn all_domains(&self, st: &crate::store::state::State) -> Vec<DomainId> {
        self.backend
            .gpus()
            .iter()
            .flat_map(|g| st.domains_of_gpu(g.index))
            .collect()
    }

    /// Adds an outcome line to a fault's record and has the history written.
    pub fn add_outcome(
        &self,
        st: &mut crate::store::state::State,
        fault_id: u64,
        outcome: mpsr_proto::FaultOutcome,
    ) {
        st.add_outcome(fault_id, outcome);
        self.persister.history_changed();
        self.mark_journaled();
    }

    /// A task ended (reported by slurmstepd's deregistration). An abnormal exit on a GPU with an
    /// open fault corroborates it (it does not say which domain faulted: a job may crash on its
    /// own at that moment). Sent to the fault worker like any other signal: the request thread
    /// does not run the decision.
    pub fn client_exit_signal(&self, gpus: &[u32], exit_status: Option<i32>) {
        if exit_status.is_none_or(|s| s == 0) {
            return;
        }
        let Some(tx) = self.signal_sender() else {
            return;
        };
        for g in gpus {
            let mut s = Signal::new(Source::ClientExit, GpuRef::Index(*g), None);
            s.detail = format!("task exit status {exit_status:?}");
            let _ = tx.send(s);
        }
    }
}
