//! The fault path: one signal in, at most one decision (or re-decision) out, and the decision's
//! actions recorded (Slurm actions queued, resume board, quarantine, terminate_client).

use crate::agent::Agent;
use crate::decide::{decide, Action, Decision};
use crate::domain::{jobs_by_domain, DomainProbe};
use crate::event::{FaultEvent, GpuRef, Merge, Signal, Source};
use crate::registry::procfs;
use crate::slurm::{PendingAction, SlurmOp};
use crate::state::{push_outcome, Durable, Recovering, ResumeEntry, State};
use crate::xid::{BlastRadius, FaultClass};
use mpsr_proto::{DecisionRecord, DomainId};
use std::collections::BTreeSet;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Agent {
    pub(crate) fn fault_loop(self: Arc<Self>, rx: Receiver<Signal>) {
        while let Ok(s) = rx.recv() {
            self.on_signal(s);
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

    /// The data path: one signal in, at most one decision (or re-decision) out.
    pub fn on_signal(&self, s: Signal) {
        let Some(gpu) = self.gpu_of(&s) else { return };
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
        // The registry as it was at the fault: live tasks plus those that exited abnormally
        // from just before its first signal on (a victim may die before the agent hears of
        // it). An exit earlier than that is the task's own failure. Copied only when there are
        // such exits: the common case decides on the registry itself.
        let exited: Vec<&crate::registry::Task> = st
            .recent_exits
            .iter()
            .filter(|(at, t)| self.exit_may_be_victim(*at, ev.first) && t.gpus.contains(&ev.gpu))
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
        let probe = decision.awaiting_domain.then(|| DomainProbe {
            fault_id: ev.id,
            gpu: ev.gpu,
            domains: jobs_by_domain(reg.tasks(), ev.gpu).into_keys().collect(),
            until: ev.first + self.probe_time(),
        });
        let owners: Vec<(u32, u32)> = reg
            .tasks()
            .map(|t| (t.job_id, t.uid))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let slots: Vec<((u32, u32, u32), u32)> = reg
            .tasks_on_gpu(ev.gpu)
            .map(|t| {
                let slot = t.domain_on(ev.gpu).map_or(0, |d| d.slot);
                ((t.job_id, t.step_id, t.pid), slot)
            })
            .collect();
        drop(view);
        let decide_us = ev.first.elapsed().as_micros() as u64;
        self.apply(&mut st, &ev, &decision, decide_us, &owners, &slots);
        drop(st);
        if let Some(p) = probe {
            self.request_probe(p);
        }
    }

    /// How long the agent asks the domains' servers which one faulted: most of the correlation
    /// window, so a server seen in FAULT still joins this fault.
    fn probe_time(&self) -> Duration {
        Duration::from_millis(self.cfg.faults.correlation_window_ms * 4 / 5)
    }

    fn apply(
        &self,
        st: &mut State,
        ev: &FaultEvent,
        dec: &Decision,
        decide_us: u64,
        owners: &[(u32, u32)],
        slots: &[((u32, u32, u32), u32)],
    ) {
        let mut action_lines = Vec::new();
        let mut terminate = Vec::new();
        let slot_of = |k: (u32, u32, u32)| {
            slots
                .iter()
                .find(|(key, _)| *key == k)
                .map_or(0, |(_, s)| *s)
        };
        for a in &dec.actions {
            action_lines.push(a.to_string());
            match a {
                Action::TerminateClient { domain, pid } => terminate.push((*domain, *pid)),
                Action::Requeue { job_id } => {
                    // One requeue per job and fault, however often the fault is re-decided.
                    let key = format!("f{}:requeue:{job_id}", ev.id);
                    let restarts_before =
                        st.d.registry
                            .tasks()
                            .chain(st.recent_exits.iter().map(|(_, t)| t))
                            .filter(|t| t.job_id == *job_id)
                            .map(|t| t.restart_count)
                            .chain(st.d.running.get(job_id).map(|r| r.restart_count))
                            .max();
                    enqueue(
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
                    let known = st.d.unhealthy.insert(ev.gpu, (dec.class, reason.clone()));
                    // Already drained for this GPU and class: no second call (a node an
                    // admin resumed meanwhile is drained again by the health check).
                    if known.is_some_and(|(c, _)| c == dec.class) {
                        continue;
                    }
                    enqueue(
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
                    slot_of((*job_id, *step_id, *pid)),
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
                    slot_of((*job_id, *step_id, *pid)),
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
        // Servers expected in FAULT now: the health loop watches them back to ACTIVE.
        let watched: Vec<DomainId> = match self.classifier.policy(dec.class).radius {
            // Contained: no server faulted.
            _ if dec.contained => Vec::new(),
            BlastRadius::Gpu => self.domains_of_gpu(st, ev.gpu),
            BlastRadius::Domain => dec.hit_domains.iter().copied().collect(),
            BlastRadius::None => Vec::new(),
        };
        for d in watched {
            let r = st.recovering.entry(d).or_insert(Recovering {
                fault_id: ev.id,
                since: ev.first,
                hit_jobs: BTreeSet::new(),
                killed: BTreeSet::new(),
                scanned_at: None,
                blockers_reported: BTreeSet::new(),
            });
            r.hit_jobs.extend(dec.hit.iter().copied());
        }
        if let Some((job, _)) = dec.culprit {
            let uid = owners.iter().find(|(j, _)| *j == job).map(|(_, u)| *u);
            if let Some(uid) = uid {
                let now = crate::event::now_ms();
                if let Some(who) = st.d.domains.quarantine(&self.policy, job, uid, now) {
                    tracing::warn!(
                        fault_id = ev.id,
                        job,
                        uid,
                        ?who,
                        "culprit quarantined: placed in a domain of its own on its next run"
                    );
                    push_outcome(
                        &mut st.d.outcomes,
                        job,
                        format!(
                            "fault {}: culprit; quarantined ({who:?}) for {} s: its next run gets a fault domain of its own",
                            ev.id, self.cfg.mps.quarantine_s
                        ),
                    );
                }
            }
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
            hit_domains: dec.hit_domains.iter().copied().collect(),
            culprit_job: dec.culprit_job(),
            culprit_evidence: dec.culprit.map(|c| c.1),
            contained: dec.contained,
            awaiting_domain: dec.awaiting_domain,
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
            hit_domains = ?record.hit_domains,
            culprit_job = ?record.culprit_job,
            awaiting_domain = record.awaiting_domain,
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
        self.persister.history_changed();
        self.mark_dirty();
        self.slurm_wake.notify_all();
        for (domain, pid) in terminate {
            let b = self.backend.clone();
            std::thread::spawn(move || {
                if let Err(e) = b.terminate_client(domain, pid) {
                    tracing::warn!(%domain, pid, error = %e, "terminate_client failed");
                }
            });
        }
    }

    /// Every domain of a GPU whose daemon the agent runs (the shared one first).
    pub fn domains_of_gpu(&self, st: &State, gpu: u32) -> Vec<DomainId> {
        std::iter::once(DomainId::shared(gpu))
            .chain(
                st.d.domains
                    .records()
                    .map(|r| r.id)
                    .filter(|d| d.gpu == gpu),
            )
            .collect()
    }

    /// Every domain of every GPU.
    pub fn all_domains(&self, st: &State) -> Vec<DomainId> {
        self.backend
            .gpus()
            .iter()
            .flat_map(|g| self.domains_of_gpu(st, g.index))
            .collect()
    }

    pub fn add_outcome(&self, st: &mut State, fault_id: u64, line: String) {
        if let Some(r) = st.history.iter_mut().rev().find(|r| r.fault_id == fault_id) {
            r.outcome.push(line);
        }
        self.persister.history_changed();
        self.mark_journaled();
    }

    /// Whether a task that exited abnormally at `exited` may be a victim of a fault whose first
    /// signal came at `first`: not if it exited more than `victim_exit_before_ms` before.
    fn exit_may_be_victim(&self, exited: Instant, first: Instant) -> bool {
        exited + Duration::from_millis(self.cfg.faults.victim_exit_before_ms) >= first
    }

    /// How long an abnormally exited task is remembered (re-decisions of a fault come within
    /// the correlation window).
    pub fn exit_memory(&self) -> Duration {
        Duration::from_millis((2 * self.cfg.faults.correlation_window_ms).max(1000))
    }

    /// Called when a task ends. An abnormal exit on a GPU with an open fault corroborates it (it
    /// does not say which domain faulted: a job may crash on its own at that moment).
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
}

fn enqueue(st: &mut State, key: String, fault_id: u64, op: SlurmOp) {
    if st.d.done_keys.contains(&key) || st.d.pending.iter().any(|p| p.key == key) {
        return;
    }
    // A fault storm hits the same job and node again and again: one requeue per run of a job and
    // one drain in flight per node, however many faults come (each fault still records the hit).
    let coalesced = match &op {
        SlurmOp::Requeue { job_id, .. } => {
            st.d.pending
                .iter()
                .find_map(|p| {
                    matches!(p.op, SlurmOp::Requeue { job_id: j, .. } if j == *job_id)
                        .then_some(p.fault_id)
                })
                .or_else(|| {
                    let run = op.run_key()?;
                    st.d.done_keys
                        .contains(&run)
                        .then(|| st.d.requeued.get(job_id).copied().unwrap_or(fault_id))
                })
        }
        SlurmOp::Drain { .. } => {
            st.d.pending
                .iter()
                .find_map(|p| matches!(p.op, SlurmOp::Drain { .. }).then_some(p.fault_id))
        }
    };
    if let Some(earlier) = coalesced {
        if let SlurmOp::Requeue { job_id, .. } = op {
            push_outcome(
                &mut st.d.outcomes,
                job_id,
                format!("fault {fault_id}: requeue already under way for fault {earlier}"),
            );
        }
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

/// Records a hit task's resume verdict (restart, or fail with a reason) and the job's outcome line.
fn hand_to_resume_board(
    d: &mut Durable,
    ev: &FaultEvent,
    (job_id, step_id, pid): crate::registry::TaskKey,
    slot: u32,
    fail: Option<String>,
    line: String,
) {
    d.resume.insert(
        (job_id, step_id, pid),
        ResumeEntry {
            fault_id: ev.id,
            gpu: ev.gpu,
            slot,
            fail,
        },
    );
    push_outcome(&mut d.outcomes, job_id, format!("fault {}: {line}", ev.id));
}
