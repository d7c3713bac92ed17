//! The requests of tasks: the protocol greeting, a GPU's shared context, registration (and its
//! fault domain), deregistration, resume verdicts for `mpsr-run`, and the task a process runs under
//! (for the state keeper).

use super::dispatch::{denied, Caller};
use crate::agent::Agent;
use crate::domain::{paths, Placement, PlacementError};
use crate::store::registry::{Task, TaskKey};
use crate::sys::procfs;
use mpsr_proto::{DomainId, ErrorCode, GpuContext, Isolation, Registration, Response};
use std::time::Duration;

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
    let mut st = agent.state();
    let Some(t) = st.d.registry.get((job_id, step_id, pid)).cloned() else {
        return Response::error(
            ErrorCode::NotFound,
            format!("task {job_id}.{step_id} pid {pid} is not registered"),
        );
    };
    if !trusted && t.uid != peer.uid {
        return denied(format!("job {job_id} belongs to another user"));
    }
    st.d.registry.remove((job_id, step_id, pid));
    st.d.tasks_left([&t], crate::sys::now_ms());
    let standbys = st.d.drop_standbys(|s| s.task == (job_id, step_id, pid));
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
    super::standby::remove_fifos(&standbys);
    tracing::info!(job = job_id, step = %crate::fault::decide::step_name(step_id), pid, exit_status = ?exit_status, "task deregistered");
    agent.client_exit_signal(&t.gpus, exit_status);
    // Not waited for: a deregistration lost in a crash is redone by the restart's
    // reconciliation (the pid is gone by then).
    agent.mark_journaled();
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
        let mut c = context(
            agent,
            &Placement {
                domain: DomainId::shared(*g),
                isolation: Isolation::Shared,
                quarantined: false,
                quarantine_waived: false,
            },
        );
        c.state = Some(agent.backend.server_state(DomainId::shared(*g)));
        out.push(c);
    }
    Response::GpuContexts { contexts: out }
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

pub fn register(agent: &Agent, caller: Caller, r: Registration) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let uid = match (trusted, r.uid) {
        (true, u) => u.unwrap_or(peer.uid),
        (false, Some(u)) if u != peer.uid => {
            tracing::warn!(
                peer_uid = peer.uid,
                claimed_uid = u,
                job = r.job_id,
                "registration with a false uid refused"
            );
            return denied(format!(
                "uid {u} claimed, but the caller is uid {}",
                peer.uid
            ));
        }
        (false, _) => peer.uid,
    };
    // A user may add a process only to a job Slurm runs on this node for them: never to another
    // user's job, nor to a job id that is pending, finished or elsewhere (its kept GPU state
    // and its requeues are its owner's).
    if !trusted {
        let run = agent.state().d.running.get(&r.job_id).copied();
        if run.is_none_or(|run| run.uid != uid) {
            tracing::warn!(
                peer_uid = peer.uid,
                job = r.job_id,
                owner = ?run.map(|run| run.uid),
                "registration into a job Slurm does not run here for this uid refused"
            );
            return denied(match run {
                Some(_) => format!("job {} belongs to another user", r.job_id),
                None => format!(
                    "job {} is not running on node {} (as Slurm reported to this agent)",
                    r.job_id, agent.node
                ),
            });
        }
    }
    if r.gpus.is_empty() {
        return Response::error(ErrorCode::BadRequest, "no GPUs given");
    }
    if let Some(g) = r
        .gpus
        .iter()
        .find(|g| **g as usize >= agent.backend.gpus().len())
    {
        return Response::error(
            ErrorCode::NotFound,
            format!("no GPU {g} on node {}", agent.node),
        );
    }
    if r.threads_pct.is_some_and(|p| p == 0 || p > 100) {
        return Response::error(ErrorCode::BadRequest, "threads_pct must be in 1..=100");
    }
    let Some(start) = procfs::start_ticks(r.pid) else {
        return Response::error(ErrorCode::NotFound, format!("no process {}", r.pid));
    };
    if !trusted && procfs::uid(r.pid) != Some(peer.uid) {
        return denied(format!(
            "process {} does not belong to uid {}",
            r.pid, peer.uid
        ));
    }
    tracing::info!(
        job = r.job_id,
        step = %crate::fault::decide::step_name(r.step_id),
        pid = r.pid,
        uid,
        gpus = ?r.gpus,
        mode = %r.mode,
        batch = r.batch,
        isolation = ?r.isolation,
        "task registered"
    );
    // Placement needs the job's owner: only a registration from slurmstepd (trusted) may create
    // or join a job or user domain; a user's own extra registration goes where the job already is.
    let placed = if trusted {
        match agent.place_task(
            r.job_id,
            uid,
            &r.gpus,
            r.isolation,
            (r.threads_pct, r.mem_limit),
        ) {
            Ok(p) => p,
            Err(PlacementError::Refused(e)) => {
                tracing::warn!(job = r.job_id, uid, error = %e, "placement refused");
                return Response::error(ErrorCode::Refused, e.to_string());
            }
            Err(e) => {
                tracing::error!(job = r.job_id, error = %e, "placement failed");
                return Response::error(ErrorCode::Internal, e.to_string());
            }
        }
    } else {
        let st = agent.state();
        r.gpus
            .iter()
            .map(|g| {
                let domain =
                    st.d.registry
                        .tasks()
                        .filter(|t| t.job_id == r.job_id && t.uid == uid)
                        .find_map(|t| t.domain_on(*g))
                        .unwrap_or(DomainId::shared(*g));
                Placement {
                    domain,
                    isolation: match st.d.domains.tenancy(domain) {
                        crate::domain::Tenancy::Shared => Isolation::Shared,
                        crate::domain::Tenancy::Job(_) => Isolation::Job,
                        crate::domain::Tenancy::User(_) => Isolation::User,
                        crate::domain::Tenancy::Standby => Isolation::Shared,
                    },
                    quarantined: false,
                    quarantine_waived: false,
                }
            })
            .collect()
    };
    let mut task = Task::from_registration(&r, uid, Some(start), trusted);
    task.domains = placed
        .iter()
        .map(|p| p.domain)
        .filter(|d| !d.is_shared())
        .collect();
    for p in placed.iter().filter(|p| p.quarantined) {
        tracing::warn!(job = r.job_id, uid, domain = %p.domain, "quarantined culprit placed in a domain of its own");
    }
    let waived: Vec<DomainId> = placed
        .iter()
        .filter(|p| p.quarantine_waived)
        .map(|p| p.domain)
        .collect();
    let gen = {
        let mut st = agent.state();
        if trusted {
            task.restart_count = st.d.note_running(r.job_id, uid, r.restart_count);
        } else if let Some(run) = st.d.running.get(&r.job_id) {
            task.restart_count = run.restart_count;
        }
        match st.d.registry.register(task.clone()) {
            Ok(evicted) => {
                for t in &evicted {
                    st.journal(crate::store::journal::Op::Remove {
                        job: t.job_id,
                        step: t.step_id,
                        pid: t.pid,
                    });
                }
                st.journal(crate::store::journal::Op::Register { task });
                st.d.tasks_left(&evicted, crate::sys::now_ms());
                for d in &waived {
                    tracing::warn!(job = r.job_id, uid, domain = %d, "quarantined job placed where it asked: no fault domain free on its GPU");
                    crate::store::state::push_outcome(
                        &mut st.d.outcomes,
                        r.job_id,
                        format!(
                            "quarantine not applied on gpu{}: all {} fault domains in use; placed in {} as asked",
                            d.gpu, agent.cfg.mps.max_domains_per_gpu, d
                        ),
                    );
                }
                for t in evicted {
                    tracing::warn!(
                        job = t.job_id,
                        squatter_uid = t.uid,
                        pid = t.pid,
                        owner_uid = uid,
                        "a user had registered into a job id Slurm gives to another user; evicted"
                    );
                }
            }
            Err(e) => return denied(e.to_string()),
        }
        agent.mark_journaled()
    };
    // Reply only once the registration is on disk: an agent crash right after loses nothing. A
    // state directory that refuses writes (full, read-only) must not stop jobs from starting: the
    // task is protected from memory, status says the disk fails, and it is written once it can be.
    match agent.wait_durable_within(gen, Duration::from_secs(5)) {
        crate::store::persister::Durability::Durable => {}
        crate::store::persister::Durability::Failing => {
            tracing::warn!(
                job = r.job_id,
                "registered in memory only: the state directory refuses writes"
            );
        }
        crate::store::persister::Durability::Slow => {
            return Response::error(
                ErrorCode::Internal,
                "registration not yet persisted (state dir slow?)",
            );
        }
    }
    Response::Registered {
        contexts: placed.iter().map(|p| context(agent, p)).collect(),
    }
}

/// The asker is the registered task or runs under it (mpsr-run started by a wrapper).
pub fn resume_query(agent: &Agent, caller: Caller, (job_id, step_id, pid): TaskKey) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let task = {
        let st = agent.state();
        st.d.registry
            .get((job_id, step_id, pid))
            .or_else(|| {
                // Only a trusted caller may speak for another process.
                let from = if trusted { pid } else { peer.pid };
                st.d.registry
                    .task_in_ancestry(job_id, &procfs::ancestry(from))
            })
            .cloned()
    };
    let Some(t) = task else {
        if trusted {
            return Response::Resume {
                verdict: mpsr_proto::ResumeVerdict::NotHit,
                reason: format!("task {job_id}.{step_id} pid {pid} is not registered"),
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
    let (verdict, reason) = agent.resume_verdict((t.job_id, t.step_id, t.pid));
    Response::Resume { verdict, reason }
}

pub fn task_of(agent: &Agent, pid: u32) -> Response {
    let ancestry = procfs::ancestry(pid);
    let found = agent
        .state()
        .d
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
