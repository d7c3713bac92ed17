//! The requests of tasks: the protocol greeting, a GPU's shared context, deregistration (the
//! registration is `register`'s), resume verdicts for `mpsr-run`, and the task a process runs under
//! (for the state keeper).

use super::caller::{denied, Caller};
use crate::agent::Agent;
use crate::domain::{paths, Placement};
use crate::store::registry::TaskKey;
use crate::sys::procfs;
use mpsr_proto::{DomainId, ErrorCode, GpuContext, Isolation, Response};
use std::time::{Duration, Instant};

pub fn hello(agent: &Agent, caller: Caller, version: u32) -> Response {
    let peer = caller.peer;
    if version != mpsr_proto::PROTOCOL_VERSION {
        // The client refuses to go on (it names both revisions to its user).
        tracing::warn!(
            peer_uid = peer.uid,
            peer_pid = peer.pid,
            client = version,
            agent = mpsr_proto::PROTOCOL_VERSION,
            "client of another protocol revision"
        );
    }
    Response::Hello {
        version: mpsr_proto::PROTOCOL_VERSION,
        node: agent.node.clone(),
        simulated: agent.backend.simulated(),
    }
}

pub fn deregister(
    agent: &Agent,
    caller: Caller,
    (job_id, step_id, pid): TaskKey,
    exit_status: Option<i32>,
) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let mut st = agent.store.lock();
    let Some(t) = st.durable.registry.get((job_id, step_id, pid)).cloned() else {
        return Response::error(
            ErrorCode::NotFound,
            format!("task {job_id}.{step_id} pid {pid} is not registered"),
        );
    };
    if !trusted && t.uid != peer.uid {
        return denied(format!("job {job_id} belongs to another user"));
    }
    st.durable.registry.remove((job_id, step_id, pid));
    st.durable.tasks_left([&t], crate::sys::now_ms());
    let standbys = st
        .durable
        .drop_standbys(|s| s.task == (job_id, step_id, pid));
    st.journal(crate::store::journal::Op::Remove {
        job: job_id,
        step: step_id,
        pid,
    });
    if exit_status.is_some_and(|s| s != 0) {
        let keep = agent.cfg.faults.exit_memory();
        st.note_exit(t.clone(), keep);
    }
    drop(st);
    crate::store::state::remove_fifos(&standbys);
    tracing::info!(job = job_id, step = %crate::fault::decide::step_name(step_id), pid, exit_status = ?exit_status, "task deregistered");
    crate::fault::worker::client_exit_signal(&agent.signals, &t.gpus, exit_status);
    // Not waited for: a deregistration lost in a crash is redone by the restart's
    // reconciliation (the pid is gone by then).
    agent.store.mark_journaled();
    Response::Ok
}

/// The shared domain's context of each GPU: what a task uses when it cannot register (agent down).
pub fn gpu_contexts(agent: &Agent, gpus: &[u32]) -> Response {
    let mut out = Vec::new();
    for g in gpus {
        if *g as usize >= agent.backend.gpus().len() {
            return Response::error(
                ErrorCode::NotFound,
                format!("no GPU {g} on node {}", agent.node),
            );
        }
        let mut c = open_context(agent, DomainId::shared(*g));
        c.state = Some(agent.backend.server_state(DomainId::shared(*g)));
        out.push(c);
    }
    Response::GpuContexts { contexts: out }
}

/// The context of a domain every user's tasks may use (a GPU's shared or standby domain): not a
/// placement of the task's own.
pub(super) fn open_context(agent: &Agent, domain: DomainId) -> GpuContext {
    context(
        agent,
        &Placement {
            domain,
            isolation: Isolation::Shared,
            quarantined: false,
            quarantine_waived: false,
        },
    )
}

pub(super) fn context(agent: &Agent, p: &Placement) -> GpuContext {
    let gpu = p.domain.gpu;
    let (pipe, log) = paths(&agent.cfg.run_dir, p.domain);
    GpuContext {
        gpu,
        uuid: agent
            .backend
            .gpus()
            .get(gpu as usize)
            .map(|i| i.uuid.clone())
            .unwrap_or_default(),
        domain: p.domain,
        isolation: p.isolation,
        pipe_dir: pipe.display().to_string(),
        log_dir: log.display().to_string(),
        state: None,
        keeper_socket: agent
            .keepers
            .enabled()
            .then(|| agent.keepers.socket(gpu).display().to_string()),
    }
}

/// The longest a verdict to wait for is held (the supervisor's call times out after 2 s).
const MAX_HOLD_MS: u32 = 1000;
/// How often a held verdict is looked at again without a change being signalled.
const RECHECK: Duration = Duration::from_millis(50);

/// The asker is the registered task or runs under it (mpsr-run started by a wrapper).
pub fn resume_query(
    agent: &Agent,
    caller: Caller,
    (job_id, step_id, pid): TaskKey,
    wait_ms: u32,
    may_move: bool,
) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let task = {
        let st = agent.store.lock();
        st.durable
            .registry
            .get((job_id, step_id, pid))
            .or_else(|| {
                // Only a trusted caller may speak for another process.
                let from = if trusted { pid } else { peer.pid };
                st.durable
                    .registry
                    .task_in_ancestry(job_id, &procfs::ancestry(from))
            })
            .cloned()
    };
    let Some(t) = task else {
        if trusted {
            return Response::Resume {
                verdict: mpsr_proto::ResumeVerdict::NotHit,
                reason: format!("task {job_id}.{step_id} pid {pid} is not registered"),
                moved_to: None,
            };
        }
        return denied(format!(
            "task {job_id}.{step_id} pid {pid} is not a registered task of uid {}",
            peer.uid
        ));
    };
    if !trusted && t.uid != peer.uid {
        return denied(format!(
            "task {job_id}.{step_id} pid {pid} is not a registered task of uid {}",
            peer.uid
        ));
    }
    // A verdict to wait for is held (bounded) and answered the moment the recovery changes.
    let until = Instant::now() + Duration::from_millis(u64::from(wait_ms.min(MAX_HOLD_MS)));
    let may_move = may_move && agent.cfg.standby.restart_in_standby_domain;
    loop {
        let seen = agent.store.recovery_seen();
        let v = agent
            .recovery
            .resume_verdict((t.job_id, t.step_id, t.pid), may_move);
        let left = until.saturating_duration_since(Instant::now());
        if v.verdict != mpsr_proto::ResumeVerdict::Wait || left.is_zero() {
            let moved_to = v.moved_to.map(|domain| open_context(agent, domain));
            return Response::Resume {
                verdict: v.verdict,
                reason: v.reason,
                moved_to,
            };
        }
        // Woken by the change; the slice bounds what a missed one (a backend that recovered
        // without the health loop seeing it yet) costs.
        agent.store.wait_recovery(seen, left.min(RECHECK));
    }
}

pub fn task_of(agent: &Agent, pid: u32) -> Response {
    let ancestry = procfs::ancestry(pid);
    let found = agent
        .store
        .lock()
        .durable
        .registry
        .tasks()
        .find(|t| ancestry.contains(&t.pid))
        .filter(|t| procfs::alive(t.pid, t.start_ticks))
        .map(|t| t.status());
    match found {
        Some(t) => Response::TaskOf(t),
        None => Response::error(
            ErrorCode::NotFound,
            format!("process {pid} is not (under) a registered task"),
        ),
    }
}
