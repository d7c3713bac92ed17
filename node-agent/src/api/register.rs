//! A task's registration, step by step: who registers (uid, and for a user: into a job Slurm runs
//! here for them), whether the request is sound, where the task goes (its fault domain), its
//! record (journaled before the answer), and its admission (held while its domain recovers).
//! Each step answers the caller itself when it refuses.

use super::caller::Caller;
use super::tasks::context;
use crate::agent::Agent;
use crate::domain::{Placement, PlacementError, Tenancy};
use crate::store::journal::Op;
use crate::store::persister::Durability;
use crate::store::registry::Task;
use crate::store::state::push_outcome;
use crate::sys::procfs;
use mpsr_proto::{DomainId, ErrorCode, Isolation, Registration, Response};
use std::time::{Duration, Instant};

/// A step's refusal: the error code and message the caller gets.
struct Refusal(ErrorCode, String);

type Step<T> = Result<T, Refusal>;

fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal(code, message.into())
}

fn denied(message: impl Into<String>) -> Refusal {
    refuse(ErrorCode::PermissionDenied, message)
}

pub fn register(agent: &Agent, caller: Caller, r: Registration) -> Response {
    match steps(agent, caller, &r) {
        Ok(placed) => Response::Registered {
            contexts: placed.iter().map(|p| context(agent, p)).collect(),
        },
        Err(Refusal(code, message)) => Response::error(code, message),
    }
}

fn steps(agent: &Agent, caller: Caller, r: &Registration) -> Step<Vec<Placement>> {
    let uid = registrant(agent, caller, r)?;
    let start = sound(agent, caller, r)?;
    tracing::info!(
        job = r.job_id,
        step = %crate::fault::decide::step_name(r.step_id),
        pid = r.pid,
        uid,
        gpus = ?r.gpus,
        mode = %r.mode,
        batch = r.batch,
        isolation = ?r.isolation,
        restart = r.restart_count,
        "task registered"
    );
    let placed = if caller.trusted {
        place(agent, r, uid)?
    } else {
        beside_the_job(agent, r, uid)
    };
    let mut task = Task::from_registration(r, uid, Some(start), caller.trusted);
    task.domains = placed
        .iter()
        .map(|p| p.domain)
        .filter(|d| !d.is_shared())
        .collect();
    let gen = record(agent, r, task, uid, &placed, caller.trusted)?;
    durable(agent, r.job_id, gen)?;
    admit(agent, r.job_id, &placed);
    Ok(placed)
}

/// The uid the task is registered for. Only slurmstepd (trusted) may name another uid. A user
/// may add a process only to a job Slurm runs on this node for them: never to another user's job,
/// nor to a job id that is pending, finished or elsewhere (its kept GPU state and its requeues
/// are its owner's).
fn registrant(agent: &Agent, caller: Caller, r: &Registration) -> Step<u32> {
    let peer = caller.peer;
    let uid = match (caller.trusted, r.uid) {
        (true, u) => return Ok(u.unwrap_or(peer.uid)),
        (false, Some(u)) if u != peer.uid => {
            tracing::warn!(
                peer_uid = peer.uid,
                claimed_uid = u,
                job = r.job_id,
                "registration with a false uid refused"
            );
            return Err(denied(format!(
                "uid {u} claimed, but the caller is uid {}",
                peer.uid
            )));
        }
        (false, _) => peer.uid,
    };
    let run = agent.store.lock().durable.running.get(&r.job_id).copied();
    if run.is_none_or(|run| run.uid != uid) {
        tracing::warn!(
            peer_uid = peer.uid,
            job = r.job_id,
            owner = ?run.map(|run| run.uid),
            "registration into a job Slurm does not run here for this uid refused"
        );
        return Err(denied(match run {
            Some(_) => format!("job {} belongs to another user", r.job_id),
            None => format!(
                "job {} is not running on node {} (as Slurm reported to this agent)",
                r.job_id, agent.node
            ),
        }));
    }
    Ok(uid)
}

/// The request names GPUs of this node, sane limits and a live process of the caller's; returns
/// the process's start time (a pid reused later is not this task).
fn sound(agent: &Agent, caller: Caller, r: &Registration) -> Step<u64> {
    if r.gpus.is_empty() {
        return Err(refuse(ErrorCode::BadRequest, "no GPUs given"));
    }
    if let Some(g) = r
        .gpus
        .iter()
        .find(|g| **g as usize >= agent.backend.gpus().len())
    {
        return Err(refuse(
            ErrorCode::NotFound,
            format!("no GPU {g} on node {}", agent.node),
        ));
    }
    if r.threads_pct.is_some_and(|p| p == 0 || p > 100) {
        return Err(refuse(
            ErrorCode::BadRequest,
            "threads_pct must be in 1..=100",
        ));
    }
    let Some(start) = procfs::start_ticks(r.pid) else {
        return Err(refuse(ErrorCode::NotFound, format!("no process {}", r.pid)));
    };
    if !caller.trusted && procfs::uid(r.pid) != Some(caller.peer.uid) {
        return Err(denied(format!(
            "process {} does not belong to uid {}",
            r.pid, caller.peer.uid
        )));
    }
    Ok(start)
}

/// slurmstepd's registration: placement needs the job's owner, so only it may create or join a
/// job or user domain.
fn place(agent: &Agent, r: &Registration, uid: u32) -> Step<Vec<Placement>> {
    let placed = agent
        .domains
        .place_task(
            r.job_id,
            uid,
            &r.gpus,
            r.isolation,
            (r.threads_pct, r.mem_limit),
        )
        .map_err(|e| match e {
            PlacementError::Refused(e) => {
                tracing::warn!(job = r.job_id, uid, error = %e, "placement refused");
                refuse(ErrorCode::Refused, e.to_string())
            }
            e => {
                tracing::error!(job = r.job_id, error = %e, "placement failed");
                refuse(ErrorCode::Internal, e.to_string())
            }
        })?;
    for p in placed.iter().filter(|p| p.quarantined) {
        tracing::warn!(job = r.job_id, uid, domain = %p.domain, "quarantined culprit placed in a domain of its own");
    }
    Ok(placed)
}

/// A user's own extra registration goes where the job already is.
fn beside_the_job(agent: &Agent, r: &Registration, uid: u32) -> Vec<Placement> {
    let st = agent.store.lock();
    r.gpus
        .iter()
        .map(|g| {
            let domain = st
                .durable
                .registry
                .tasks()
                .filter(|t| t.job_id == r.job_id && t.uid == uid)
                .find_map(|t| t.domain_on(*g))
                .unwrap_or(DomainId::shared(*g));
            Placement {
                domain,
                isolation: match st.durable.domains.tenancy(domain) {
                    Tenancy::Shared | Tenancy::Standby => Isolation::Shared,
                    Tenancy::Job(_) => Isolation::Job,
                    Tenancy::User(_) => Isolation::User,
                },
                quarantined: false,
                quarantine_waived: false,
            }
        })
        .collect()
}

/// Adds the task to the registry and its journal; returns the journal generation to wait for.
/// A registration from slurmstepd also says which run of the job this is.
fn record(
    agent: &Agent,
    r: &Registration,
    mut task: Task,
    uid: u32,
    placed: &[Placement],
    trusted: bool,
) -> Step<u64> {
    let mut st = agent.store.lock();
    if trusted {
        task.restart_count = st.durable.note_running(r.job_id, uid, r.restart_count);
    } else if let Some(run) = st.durable.running.get(&r.job_id) {
        task.restart_count = run.restart_count;
    }
    let evicted = st
        .durable
        .registry
        .register(task.clone())
        .map_err(|e| denied(e.to_string()))?;
    for t in &evicted {
        st.journal(Op::Remove {
            job: t.job_id,
            step: t.step_id,
            pid: t.pid,
        });
    }
    st.journal(Op::Register { task });
    st.durable.tasks_left(&evicted, crate::sys::now_ms());
    for d in placed
        .iter()
        .filter(|p| p.quarantine_waived)
        .map(|p| p.domain)
    {
        tracing::warn!(job = r.job_id, uid, domain = %d, "quarantined job placed where it asked: no fault domain free on its GPU");
        push_outcome(
            &mut st.durable.outcomes,
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
    drop(st);
    Ok(agent.store.mark_journaled())
}

/// Reply only once the registration is on disk: an agent crash right after loses nothing. A
/// state directory that refuses writes (full, read-only) must not stop jobs from starting: the
/// task is protected from memory, status says the disk fails, and it is written once it can be.
fn durable(agent: &Agent, job: u32, gen: u64) -> Step<()> {
    match agent.store.wait_durable_within(gen, Duration::from_secs(5)) {
        Durability::Durable => Ok(()),
        Durability::Failing => {
            tracing::warn!(
                job,
                "registered in memory only: the state directory refuses writes"
            );
            Ok(())
        }
        Durability::Slow => Err(refuse(
            ErrorCode::Internal,
            "registration not yet persisted (state dir slow?)",
        )),
    }
}

/// Holds a task that is about to start while its domain's server recovers from a fault (its
/// first CUDA call would fail with 807 and end an innocent job), within `mps.admit_wait_ms`.
fn admit(agent: &Agent, job: u32, placed: &[Placement]) {
    let domains: Vec<DomainId> = placed.iter().map(|p| p.domain).collect();
    let t = Instant::now();
    let still = agent
        .recovery
        .await_recovered(&domains, Duration::from_millis(agent.cfg.mps.admit_wait_ms));
    let ms = t.elapsed().as_millis();
    let line = match still.first() {
        Some(d) => {
            tracing::warn!(job, domain = %d, waited_ms = ms, "task starts while its fault domain still recovers: its first CUDA calls may be refused (807)");
            format!("started while {d} still recovered from a fault (waited {ms} ms)")
        }
        None if ms >= 10 => {
            tracing::info!(
                job,
                waited_ms = ms,
                "task held until its fault domain recovered"
            );
            format!("held {ms} ms at start until its fault domain recovered from a fault")
        }
        None => return,
    };
    push_outcome(&mut agent.store.lock().durable.outcomes, job, line);
    agent.store.mark_dirty();
}
