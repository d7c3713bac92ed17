//! The pure fault core: one signal (already resolved to a GPU index) and the agent's state in, at
//! most one decision (or re-decision) recorded in that state, and the effects it asks for out.
//! No threads, no backend, no clock of its own (times come from the signals), no I/O: every
//! stateful case (storm coalescing, refuted containment, quarantine, victims that exited just
//! before, write-ahead ordering) is a unit test that runs in microseconds.
//!
//! What the state gains: the decision record (history), queued Slurm actions (`pending`, written
//! to disk before the Slurm worker acts on them), resume verdicts, servers to watch back to
//! ACTIVE, quarantines, per-job outcome lines. What leaves as [`Effect`]s: what needs a backend
//! (terminate a client, probe the servers), and what needs the persister or the Slurm worker.

use super::classify::{BlastRadius, Classifier, FaultClass};
use super::correlate::{FaultEvent, Merge, Signal};
use super::decide::{decide, Action, Decision};
use crate::act::takeover::Release;
use crate::domain::{jobs_by_domain, DomainProbe, Policy};
use crate::store::queue::{self, ActionKey, PendingAction, SlurmOp};
use crate::store::registry::{Registry, Task, TaskKey};
use crate::store::state::{
    push_outcome, Durable, Recovering, ResumeEntry, Standby, State, Takeover,
};
use mpsr_proto::{DecisionRecord, DomainId};
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// What the core reads besides the state: the admin's settings and the node's name.
pub struct Ctx<'a> {
    pub classifier: &'a Classifier,
    pub policy: &'a Policy,
    pub node: &'a str,
    pub faults: &'a crate::config::FaultConfig,
    pub quarantine_s: u64,
    pub simulated: bool,
    /// A process and its ancestors, nearest first (`/proc` in the agent, a table in tests).
    pub ancestry: &'a dyn Fn(u32) -> Vec<u32>,
    /// When the worker took the signal up: `decide_us` of the record counts from the fault's
    /// first signal to this.
    pub now: Instant,
}

/// What a signal asks of the world outside the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// End one client of one server (`terminate_client`), once `after` (the culprit job's
    /// line in Slurm's views: a finished job's can no longer be written) is done.
    Terminate {
        domain: DomainId,
        pid: u32,
        after: Option<ActionKey>,
    },
    /// Ask these domains' servers whether they are in FAULT (no domain has shown the fault yet).
    Probe(DomainProbe),
    /// The durable state changed (queued actions, resume verdicts, quarantine): write it, then
    /// wake the Slurm worker, which acts only once it is on disk (write-ahead).
    Persist,
    /// The decision history changed (a record added, replaced or given another source).
    History,
    /// A hit task's hot standby takes over: end the primary, then write the release.
    Release(Release),
    /// A standby waited in a server that faulted: it is poisoned (its next CUDA call fails) and
    /// holds that server in FAULT; it is ended (its supervisor runs on without one).
    EndStandby(Standby),
}

impl Ctx<'_> {
    /// How long the agent asks the domains' servers which one faulted: most of the correlation
    /// window, so a server seen in FAULT still joins this fault.
    pub fn probe_time(&self) -> Duration {
        Duration::from_millis(self.faults.correlation_window_ms * 4 / 5)
    }

    /// Whether a task that exited abnormally at `exited` may be a victim of a fault whose first
    /// signal came at `first`: not if it exited more than `victim_exit_before_ms` before.
    fn exit_may_be_victim(&self, exited: Instant, first: Instant) -> bool {
        exited + Duration::from_millis(self.faults.victim_exit_before_ms) >= first
    }
}

/// The data path: one signal in, at most one decision (or re-decision) out.
pub fn on_signal(st: &mut State, ctx: &Ctx, gpu: u32, s: &Signal) -> Vec<Effect> {
    let State {
        durable: d,
        correlator,
        ..
    } = st;
    let merged = correlator.merge(gpu, s, || {
        d.next_fault_id += 1;
        d.next_fault_id
    });
    let id = match merged {
        Merge::Ignored => return Vec::new(),
        Merge::Joined { id, changed: false } => {
            // Same fault seen by another source: note the source, decide nothing new.
            let Some(r) = st.history.iter_mut().rev().find(|r| r.fault_id == id) else {
                return Vec::new();
            };
            if !r.sources.contains(&s.source) {
                r.sources.push(s.source);
            }
            if r.reported_pid.is_none() {
                r.reported_pid = s.reported_pid;
            }
            return vec![Effect::History];
        }
        Merge::New(id) | Merge::Joined { id, .. } => id,
    };
    let Some(ev) = st.correlator.get(id).cloned() else {
        return Vec::new();
    };
    // The registry as it was at the fault: live tasks plus those that exited abnormally from
    // just before its first signal on (a victim may die before the agent hears of it; an exit
    // earlier than that is the task's own failure), and tasks whose standby took over during
    // this fault back where the fault found them. Copied only when there are such tasks.
    let open = |id: u64| st.correlator.get(id).is_some();
    st.moved.retain(|m| open(m.fault_id));
    let mut exited: Vec<&Task> = st
        .recent_exits
        .iter()
        .filter(|(at, t)| ctx.exit_may_be_victim(*at, ev.first) && t.gpus.contains(&ev.gpu))
        .map(|(_, t)| t)
        .collect();
    // A fault that happened while the agent was down (its evidence read back after the
    // restart): the tasks that exited meanwhile were its clients, as they were then.
    if ev.replayed {
        exited.extend(st.down_exits.on_gpu(ev.gpu, ctx.now));
    }
    let moved: Vec<_> = st.moved.iter().filter(|m| m.fault_id == ev.id).collect();
    let view: Cow<Registry> = if exited.is_empty() && moved.is_empty() {
        Cow::Borrowed(&st.durable.registry)
    } else {
        let mut v = st.durable.registry.clone();
        for t in exited {
            v.insert_exited(t.clone());
        }
        for m in moved {
            if let Some(t) = v.get_mut(m.task) {
                t.domains.retain(|d| d.gpu != m.from.gpu);
                if !m.from.is_shared() {
                    t.domains.push(m.from);
                }
            }
        }
        Cow::Owned(v)
    };
    let reg: &Registry = &view;
    let decision = decide(&ev, reg, ctx.classifier, ctx.node, |pid| {
        (ctx.ancestry)(pid)
            .into_iter()
            .find_map(|p| reg.task_by_pid(p).map(|t| t.job_id))
    });
    let probe = decision.awaiting_domain.then(|| DomainProbe {
        fault_id: ev.id,
        gpu: ev.gpu,
        domains: jobs_by_domain(reg.tasks(), ev.gpu).into_keys().collect(),
        until: ev.first + ctx.probe_time(),
    });
    let hit = HitTasks::of(reg, ev.gpu);
    drop(view);
    let decide_us = ctx.now.saturating_duration_since(ev.first).as_micros() as u64;
    let mut effects = apply(st, ctx, &ev, &decision, decide_us, &hit);
    effects.extend(probe.map(Effect::Probe));
    effects
}

/// Who the tasks in the decision's view are: owners of jobs, domains of tasks on the GPU.
struct HitTasks {
    owners: Vec<(u32, u32)>,
    slots: Vec<(TaskKey, u32)>,
}

impl HitTasks {
    fn of(reg: &Registry, gpu: u32) -> HitTasks {
        HitTasks {
            owners: reg
                .tasks()
                .map(|t| (t.job_id, t.uid))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
            slots: reg
                .tasks_on_gpu(gpu)
                .map(|t| {
                    let slot = t.domain_on(gpu).map_or(0, |d| d.slot);
                    ((t.job_id, t.step_id, t.pid), slot)
                })
                .collect(),
        }
    }

    fn slot_of(&self, k: TaskKey) -> u32 {
        self.slots
            .iter()
            .find(|(key, _)| *key == k)
            .map_or(0, |(_, s)| *s)
    }

    fn owner_of(&self, job: u32) -> Option<u32> {
        self.owners.iter().find(|(j, _)| *j == job).map(|(_, u)| *u)
    }
}

/// Records a decision's actions in the state; returns the effects they need.
fn apply(
    st: &mut State,
    ctx: &Ctx,
    ev: &FaultEvent,
    dec: &Decision,
    decide_us: u64,
    hit: &HitTasks,
) -> Vec<Effect> {
    let mut effects = Vec::new();
    for a in &dec.actions {
        match a {
            Action::TerminateClient { domain, pid } => effects.push(Effect::Terminate {
                domain: *domain,
                pid: *pid,
                after: dec
                    .culprit_job()
                    .map(|job| ActionKey::Annotate { fault: ev.id, job }),
            }),
            Action::Requeue { job_id } => requeue(st, ev, *job_id),
            Action::DrainNode { reason } => drain(st, ctx, ev, dec, reason),
            Action::Resume {
                job_id,
                step_id,
                pid,
            } => effects.extend(resume(st, ctx, ev, dec, hit, (*job_id, *step_id, *pid))),
            Action::FailTask {
                job_id,
                step_id,
                pid,
                why,
            } => {
                let k = (*job_id, *step_id, *pid);
                let line = format!("not resumed: {why}");
                hand_to_resume_board(
                    &mut st.durable,
                    ev,
                    k,
                    hit.slot_of(k),
                    Some(why.clone()),
                    line,
                );
            }
            Action::None { job_id, why } => push_outcome(
                &mut st.durable.outcomes,
                *job_id,
                format!("fault {}: no action ({why})", ev.id),
            ),
            // Only read from records of a newer agent; a decision never makes one.
            Action::Other(_) => {}
        }
    }
    for &job in &dec.hit {
        let released = st.durable.resume.job_takeover_kind(job, ev.id);
        let line = fault_line(ctx, ev, dec, job, released);
        annotate(st, ctx, ev, dec, job, line);
    }
    for d in watch_servers(st, ctx, ev, dec) {
        // A hot standby there holds a context of the faulted server; a warm one holds none and
        // is not touched by the fault.
        for sb in st
            .durable
            .drop_standbys(|s| s.domain == d && s.kind == mpsr_proto::standby::Kind::Hot)
        {
            effects.push(Effect::EndStandby(sb));
        }
    }
    if let Some((job, _)) = dec.culprit {
        if let Some(uid) = hit.owner_of(job) {
            quarantine(st, ctx, ev, job, uid);
        }
    }
    record(st, ctx, ev, dec, decide_us);
    effects.push(Effect::History);
    effects.push(Effect::Persist);
    // Releases first: a standby's takeover is the latency a hit task feels.
    effects.sort_by_key(|e| !matches!(e, Effect::Release(_)));
    effects
}

/// The hit run of a batch job goes back to Slurm's queue (once per run, however many faults).
fn requeue(st: &mut State, ev: &FaultEvent, job_id: u32) {
    let restarts_before = run_of(st, job_id);
    queue::enqueue(
        &mut st.durable,
        ev.id,
        SlurmOp::Requeue {
            job_id,
            restarts_before,
        },
    );
}

/// A hardware fault drains the node, once per GPU and class.
fn drain(st: &mut State, ctx: &Ctx, ev: &FaultEvent, dec: &Decision, reason: &str) {
    let known = st
        .durable
        .unhealthy
        .insert(ev.gpu, (dec.class, reason.to_string()));
    // Already drained for this GPU and class: no second call (a node an admin resumed
    // meanwhile is drained again by the health check).
    if known.is_some_and(|(c, _)| c == dec.class) {
        return;
    }
    queue::enqueue(
        &mut st.durable,
        ev.id,
        SlurmOp::Drain {
            node: ctx.node.to_string(),
            reason: reason.to_string(),
        },
    );
}

/// A hit task resumes: its armed standby is released to take over (at the first decision;
/// never the culprit's: it would fault again, in the domain where the other standbys wait),
/// else its supervisor restarts it in place.
fn resume(
    st: &mut State,
    ctx: &Ctx,
    ev: &FaultEvent,
    dec: &Decision,
    hit: &HitTasks,
    k: TaskKey,
) -> Option<Effect> {
    let standby = (dec.culprit_job() != Some(k.0))
        .then(|| take_armed_standby(&mut st.durable, k))
        .flatten();
    let from = DomainId {
        gpu: ev.gpu,
        slot: hit.slot_of(k),
    };
    // A cold standby that cannot restart the task at once is ended: its supervisor restarts the
    // task once the hit server is ACTIVE again, as without one.
    let (standby, ended) = match standby {
        Some(sb)
            if sb.kind == mpsr_proto::standby::Kind::Cold
                && !cold_restart_goes(st, ctx, ev, dec, from, sb.domain) =>
        {
            (None, Some(Effect::EndStandby(sb)))
        }
        s => (s, None),
    };
    let line = match &standby {
        Some(sb) if sb.kind == mpsr_proto::standby::Kind::Cold => {
            format!("restarted at once in {} while {from} recovers", sb.domain)
        }
        Some(sb) => format!(
            "{} standby pid {} released to take over",
            sb.kind.name(),
            sb.pid()
        ),
        None => "resume in place handed over".to_string(),
    };
    hand_to_resume_board(&mut st.durable, ev, k, from.slot, None, line);
    let Some(sb) = standby else {
        return ended;
    };
    if let Some(e) = st.durable.resume.get_mut(k) {
        e.takeover = Some(Takeover::Releasing(sb.pid()));
        e.standby_kind = sb.kind;
    }
    Some(Effect::Release(Release {
        fault_id: ev.id,
        task: k,
        standby: sb,
        first: ev.first,
    }))
}

/// Slurm's restart count of the job's run the fault hit, when known: the one requeue that run
/// gets is keyed by it.
fn run_of(st: &State, job: u32) -> Option<u32> {
    st.durable
        .registry
        .tasks()
        .chain(st.recent_exits.iter().map(|(_, t)| t))
        // A task that died while the agent was down: its run is the one a caught-up fault hit.
        .chain(st.down_exits.tasks.iter())
        .filter(|t| t.job_id == job)
        .map(|t| t.restart_count)
        .chain(st.durable.running.get(&job).map(|r| r.restart_count))
        .max()
}

/// Servers expected in FAULT now: the health loop watches them back to ACTIVE. Returns them.
fn watch_servers(st: &mut State, ctx: &Ctx, ev: &FaultEvent, dec: &Decision) -> Vec<DomainId> {
    let watched = faulted_servers(st, ctx, ev, dec);
    for d in &watched {
        let r = st.recovering.entry(*d).or_insert(Recovering {
            fault_id: ev.id,
            since: ev.first,
            hit_jobs: BTreeSet::new(),
            killed: BTreeSet::new(),
            scanned_at: None,
            blockers_reported: BTreeSet::new(),
            fenced_pids: Vec::new(),
            climbed: 0,
            escalating: false,
            primaries_ended: false,
        });
        r.hit_jobs.extend(dec.hit.iter().copied());
    }
    watched
}

/// The domains whose server the fault put in FAULT.
fn faulted_servers(st: &State, ctx: &Ctx, ev: &FaultEvent, dec: &Decision) -> Vec<DomainId> {
    match ctx.classifier.policy(dec.class).radius {
        // Contained: no server faulted.
        _ if dec.contained => Vec::new(),
        BlastRadius::Gpu => st.domains_of_gpu(ev.gpu),
        BlastRadius::Domain => dec.hit_domains.iter().copied().collect(),
        BlastRadius::None => Vec::new(),
    }
}

/// Whether a cold standby may restart hit task `k` now: in the domain a task hit where it was may
/// restart while its server recovers (`DomainTable::restart_elsewhere`: the same one as when it
/// was prepared), whose server neither this fault nor an earlier one is holding.
fn cold_restart_goes(
    st: &State,
    ctx: &Ctx,
    ev: &FaultEvent,
    dec: &Decision,
    from: DomainId,
    to: DomainId,
) -> bool {
    st.durable.domains.restart_elsewhere(from) == Some(to)
        && !st.recovering.contains_key(&to)
        && !faulted_servers(st, ctx, ev, dec).contains(&to)
}

fn quarantine(st: &mut State, ctx: &Ctx, ev: &FaultEvent, job: u32, uid: u32) {
    // The wall clock of the fault: quarantine outlives agent restarts.
    let Some(who) = st
        .durable
        .domains
        .quarantine(ctx.policy, job, uid, ev.first_ms)
    else {
        return;
    };
    tracing::warn!(
        fault_id = ev.id,
        job,
        uid,
        ?who,
        "culprit quarantined: placed in a domain of its own on its next run"
    );
    push_outcome(
        &mut st.durable.outcomes,
        job,
        format!(
            "fault {}: culprit; quarantined ({who:?}) on {} for {} s: its next run here gets a fault domain of its own (a run Slurm starts on another node is not quarantined there)",
            ev.id, ctx.node, ctx.quarantine_s
        ),
    );
}

/// The decision record: added, or replacing the earlier decision of the same fault (its outcome
/// lines are kept).
fn record(st: &mut State, ctx: &Ctx, ev: &FaultEvent, dec: &Decision, decide_us: u64) {
    let record = DecisionRecord {
        fault_id: ev.id,
        at_ms: ev.first_ms,
        gpu: ev.gpu,
        xids: ev.xids.clone(),
        class: dec.class,
        sources: ev.sources.iter().copied().collect(),
        reported_pid: ev.reported_pid,
        culprit: ev.culprit,
        hit_domains: dec.hit_domains.iter().copied().collect(),
        culprit_job: dec.culprit_job(),
        culprit_evidence: dec.culprit.map(|c| c.1),
        contained: dec.contained,
        awaiting_domain: dec.awaiting_domain,
        hit_jobs: dec.hit.iter().copied().collect(),
        spared_jobs: dec.spared.iter().copied().collect(),
        actions: dec.actions.clone(),
        decide_us,
        outcome: Vec::new(),
        outcomes: Vec::new(),
    };
    // One structured line per decision.
    tracing::info!(
        target: "mpsr_decision",
        fault_id = record.fault_id,
        gpu = record.gpu,
        xids = ?record.xids,
        class = %record.class,
        sources = ?record.source_names(),
        reported_pid = ?record.reported_pid,
        culprit = ?record.culprit,
        hit_domains = ?record.hit_domains,
        culprit_job = ?record.culprit_job,
        awaiting_domain = record.awaiting_domain,
        hit = ?record.hit_jobs,
        spared = ?record.spared_jobs,
        actions = ?record.actions.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        decide_us = record.decide_us,
        simulated = ctx.simulated,
        "decision"
    );
    // Each Xid of the fault counted once (a fault decided again counts only its new Xids), by
    // its own class: an unknown one is surfaced (metric, alert), not only logged.
    let seen: Vec<u32> = st
        .history
        .iter()
        .rev()
        .find(|r| r.fault_id == ev.id)
        .map(|r| r.xids.clone())
        .unwrap_or_default();
    for x in ev.xids.iter().filter(|x| !seen.contains(x)) {
        let class = ctx.classifier.class_of_fault(&[*x], ev.recovery);
        *st.xid_totals.entry((ev.gpu, *x, class)).or_default() += 1;
    }
    let totals = st.totals.entry(ev.gpu).or_default();
    if let Some(old) = st.history.iter_mut().rev().find(|r| r.fault_id == ev.id) {
        totals.hit_jobs += record
            .hit_jobs
            .iter()
            .filter(|j| !old.hit_jobs.contains(j))
            .count() as u64;
        let (lines, outcomes) = (
            std::mem::take(&mut old.outcome),
            std::mem::take(&mut old.outcomes),
        );
        *old = record;
        old.outcome = lines;
        old.outcomes = outcomes;
    } else {
        totals.faults += 1;
        totals.hit_jobs += record.hit_jobs.len() as u64;
        st.history.push_back(record);
        while st.history.len() > ctx.faults.history {
            st.history.pop_front();
        }
    }
}

/// Queues (or, on a re-decision, rewrites while still queued) the line a hit job's AdminComment
/// gets. Sent at once when the class is known; a fault decided on a server's line alone waits for
/// its Xid (at most the correlation window), so the line names the class.
fn annotate(st: &mut State, ctx: &Ctx, ev: &FaultEvent, dec: &Decision, job_id: u32, line: String) {
    let not_before_ms = (dec.class == FaultClass::AppServer)
        .then_some(ev.first_ms + ctx.faults.correlation_window_ms);
    let restarts = run_of(st, job_id);
    let op = SlurmOp::Annotate {
        job_id,
        line,
        restarts,
    };
    let key = op.key(ev.id);
    if st.durable.done_keys.contains(&key) {
        return;
    }
    if let Some(p) = st.durable.pending.iter_mut().find(|p| p.key == key) {
        p.op = op;
        p.not_before_ms = not_before_ms;
        return;
    }
    // One line per run of a job: a storm's later faults are in its report, not in Slurm's views.
    let queued = st
        .durable
        .pending
        .iter()
        .any(|p| matches!(p.op, SlurmOp::Annotate { job_id: j, .. } if j == job_id));
    if queued
        || op
            .run_key()
            .is_some_and(|k| st.durable.done_keys.contains(&k))
    {
        return;
    }
    st.durable.pending.push(PendingAction {
        key,
        not_before_ms,
        fault_id: ev.id,
        op,
        attempts: 0,
        last_error: None,
        fresh: true,
    });
}

/// The job's line in Slurm's own views: the fault, the job's part in it, what was done.
fn fault_line(
    ctx: &Ctx,
    ev: &FaultEvent,
    dec: &Decision,
    job: u32,
    released: Option<mpsr_proto::standby::Kind>,
) -> String {
    let xids: Vec<String> = ev.xids.iter().map(|x| x.to_string()).collect();
    let part = match dec.culprit {
        Some((j, _)) if j == job => "culprit",
        _ => "victim",
    };
    let done: Vec<String> = dec
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Requeue { job_id } if *job_id == job => Some("requeued".to_string()),
            Action::Resume { job_id, .. } if *job_id == job => Some(match released {
                Some(mpsr_proto::standby::Kind::Cold) => {
                    "restarted at once in another fault domain".to_string()
                }
                Some(k) => format!("its {} standby took over", k.name()),
                None => "restarted in place".to_string(),
            }),
            Action::FailTask { job_id, .. } if *job_id == job => {
                Some("ended, not restarted".to_string())
            }
            Action::None { job_id, why } if *job_id == job => Some(format!("no action ({why})")),
            _ => None,
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    format!(
        "{} fault {} xid {} ({}) on {} gpu{}: {part}; {}",
        mpsr_proto::fault::SLURM_TEXT_PREFIX,
        ev.id,
        if xids.is_empty() {
            "-".to_string()
        } else {
            xids.join("+")
        },
        dec.class,
        ctx.node,
        ev.gpu,
        if done.is_empty() {
            "nothing done".to_string()
        } else {
            done.join(", ")
        }
    )
}

/// The task's armed standby, taken off the list (a standby is released once).
fn take_armed_standby(d: &mut Durable, task: TaskKey) -> Option<Standby> {
    let i = d
        .standbys
        .iter()
        .position(|s| s.task == task && s.armed.is_some())?;
    Some(d.standbys.remove(i))
}

/// Records a hit task's resume verdict (restart, or fail with a reason) and the job's outcome line.
fn hand_to_resume_board(
    d: &mut Durable,
    ev: &FaultEvent,
    (job_id, step_id, pid): TaskKey,
    slot: u32,
    fail: Option<String>,
    line: String,
) {
    // A re-decision of the same fault keeps where the task's standby takeover stands, and a
    // verdict its supervisor already had.
    let (takeover, standby_kind, consumed) = d
        .resume
        .get((job_id, step_id, pid))
        .filter(|e| e.fault_id == ev.id)
        .map_or((None, Default::default(), false), |e| {
            (e.takeover, e.standby_kind, e.consumed)
        });
    d.resume.insert(
        (job_id, step_id, pid),
        ResumeEntry {
            fault_id: ev.id,
            gpu: ev.gpu,
            slot,
            fail,
            takeover,
            standby_kind,
            consumed,
        },
    );
    push_outcome(&mut d.outcomes, job_id, format!("fault {}: {line}", ev.id));
}

/// Whether the class of `xid` is one the table knows (an unknown one is logged, not acted on).
pub fn known_xid(classifier: &Classifier, xid: u32) -> bool {
    classifier.class_of(xid) != FaultClass::Unknown
}

#[cfg(test)]
mod tests;
