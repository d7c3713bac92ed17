//! One function per request. Authorization rule: a caller may touch only jobs of its own uid
//! (SO_PEERCRED); root and configured trusted uids (SlurmUser) may touch all.

use crate::agent::Agent;
use crate::domain::{paths, Placement, PlacementError};
use crate::store::registry::Task;
use crate::sys::procfs;
use mpsr_proto::{
    DecisionRecord, DomainId, ErrorCode, GpuContext, GpuStatus, HealthReply, Isolation, JobReport,
    PeerCred, Registration, Request, Response, StatusReply,
};
use std::time::Duration;

fn denied(msg: impl Into<String>) -> Response {
    Response::error(ErrorCode::PermissionDenied, msg)
}

pub fn handle(agent: &Agent, peer: PeerCred, req: Request) -> Response {
    let trusted = agent.is_trusted(peer.uid);
    match req {
        Request::Hello { version } => {
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
            hello(agent)
        }
        Request::GpuContexts { gpus } => gpu_contexts(agent, &gpus),
        Request::Register(r) => register(agent, peer, trusted, r),
        Request::Deregister {
            job_id,
            step_id,
            pid,
            exit_status,
        } => deregister(agent, peer, trusted, (job_id, step_id, pid), exit_status),
        Request::JobStart {
            job_id,
            uid,
            restart_count,
        } => {
            if !trusted {
                return denied("job start is reported by the prolog (root) only");
            }
            let mut st = agent.state();
            // Leftovers of an earlier run of this job id (a requeue) whose processes are gone.
            let stale: Vec<_> =
                st.d.registry
                    .tasks()
                    .filter(|t| t.job_id == job_id && !procfs::alive(t.pid, t.start_ticks))
                    .map(|t| (t.job_id, t.step_id, t.pid))
                    .collect();
            let left: Vec<Task> = stale
                .iter()
                .filter_map(|k| st.d.registry.remove(*k))
                .collect();
            st.d.tasks_left(&left, crate::sys::now_ms());
            st.d.resume.remove_job(job_id);
            st.d.start_run(job_id, uid, restart_count);
            if restart_count > 0 {
                crate::store::state::push_outcome(
                    &mut st.d.outcomes,
                    job_id,
                    format!(
                        "started again on {} (restart {restart_count}, uid {uid})",
                        agent.node
                    ),
                );
            }
            drop(st);
            agent.mark_dirty();
            Response::Ok
        }
        Request::JobEnd { job_id } => {
            if !trusted {
                return denied("job end is reported by the epilog (root) only");
            }
            let mut st = agent.state();
            let owner = st.d.owner_of(job_id);
            st.d.running.remove(&job_id);
            let left = st.d.registry.remove_job(job_id);
            st.d.tasks_left(&left, crate::sys::now_ms());
            st.d.resume.remove_job(job_id);
            let rep = job_report(&st.history, &st.d.outcomes, &st.telemetry.records, job_id);
            if let Some(uid) = owner {
                crate::store::state::archive_report(&mut st.d, uid, rep.clone());
            }
            // A requeued job may come back here: its kept GPU state waits for it a while. Its
            // requeue may also still be queued (Slurm ends the job before the agent's call runs).
            let requeued = st.d.requeued.remove(&job_id).is_some()
                || st.d.pending.iter().any(|p| {
                    matches!(p.op, crate::act::slurm::queue::SlurmOp::Requeue { job_id: j, .. } if j == job_id)
                });
            drop(st);
            agent.mark_dirty();
            let keep = if requeued {
                agent.keepers.keep_after_requeue
            } else {
                Duration::ZERO
            };
            let keepers = agent.keepers.clone();
            std::thread::spawn(move || keepers.job_end(job_id, keep));
            // The epilog hands this to the job's owner: only what the owner may see.
            let mut rep = rep;
            let own: std::collections::BTreeSet<u32> = match owner {
                Some(uid) => agent.state().d.jobs_of(uid),
                None => [job_id].into(),
            };
            rep.faults = rep.faults.iter().filter_map(|r| redact(r, &own)).collect();
            rep.pathologies = rep
                .pathologies
                .iter()
                .filter_map(|p| redact_pathology(p, &own))
                .collect();
            Response::JobReport(rep)
        }
        Request::Status => status(agent, peer, trusted),
        Request::Events { limit } => {
            let st = agent.state();
            let own = st.d.jobs_of(peer.uid);
            let n = limit.clamp(1, 10_000) as usize;
            let mut events = newest(st.history.iter(), n, |r| {
                if trusted {
                    Some(r.clone())
                } else {
                    redact(r, &own)
                }
            });
            let mut pathologies = newest(st.telemetry.records.iter(), n, |p| {
                if trusted {
                    Some(p.clone())
                } else {
                    redact_pathology(p, &own)
                }
            });
            // Both within one frame: findings get at most half of it, decisions the rest.
            let budget = mpsr_proto::MAX_FRAME - 1024;
            let used = fit_frame(&mut pathologies, budget / 2);
            fit_frame(&mut events, budget - used);
            Response::Events {
                events,
                pathologies,
            }
        }
        Request::Telemetry => {
            let mut snapshot = crate::sys::lock(&agent.telemetry.exporter.0).clone();
            if !trusted {
                let own = agent.state().d.jobs_of(peer.uid);
                snapshot
                    .tick
                    .clients
                    .retain(|c| c.owner.is_some_and(|o| own.contains(&o.job)));
                snapshot.findings = snapshot
                    .findings
                    .iter()
                    .filter_map(|f| crate::telemetry::redact(f, &own))
                    .collect();
            }
            Response::Telemetry(Box::new(mpsr_proto::TelemetryReply {
                enabled: agent.cfg.telemetry.enabled,
                snapshot,
            }))
        }
        Request::SimPathology {
            gpu,
            what,
            pid,
            secs,
        } => {
            if !trusted {
                return denied("pathology injection is for root only");
            }
            match agent.backend.sim_pathology(what, gpu, pid, secs) {
                Ok(()) => Response::Ok,
                Err(e) => Response::error(ErrorCode::Unsupported, e.to_string()),
            }
        }
        Request::JobReport { job_id } => {
            let st = agent.state();
            if !trusted && st.d.owner_of(job_id) != Some(peer.uid) {
                return denied(format!(
                    "job {job_id} is not a known job of uid {}",
                    peer.uid
                ));
            }
            let mut rep = job_report(&st.history, &st.d.outcomes, &st.telemetry.records, job_id);
            if !trusted {
                let own = st.d.jobs_of(peer.uid);
                rep.faults = rep.faults.iter().filter_map(|r| redact(r, &own)).collect();
                rep.pathologies = rep
                    .pathologies
                    .iter()
                    .filter_map(|p| redact_pathology(p, &own))
                    .collect();
            }
            Response::JobReport(rep)
        }
        Request::ResumeQuery {
            job_id,
            step_id,
            pid,
        } => {
            // The asker is the registered task or runs under it (mpsr-run started by a wrapper).
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
        Request::Health => health(agent),
        Request::TaskOf { pid } => {
            if !trusted {
                return denied("task lookup is for root (the state keeper) only");
            }
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
        Request::SimInject {
            gpu,
            xid,
            culprit,
            slot,
        } => {
            if !trusted {
                return denied("fault injection is for root only");
            }
            match agent.backend.sim_inject(gpu, xid, culprit, slot) {
                Ok(killed) => Response::Injected {
                    fault_id_hint: agent.state().d.next_fault_id + 1,
                    killed,
                },
                Err(e) => Response::error(ErrorCode::Unsupported, e.to_string()),
            }
        }
        Request::SimRecover { gpu } => {
            if !trusted {
                return denied("GPU recovery is for root only");
            }
            match agent.backend.sim_recover(gpu) {
                Ok(()) => Response::Ok,
                Err(e) => Response::error(ErrorCode::Unsupported, e.to_string()),
            }
        }
        Request::TerminateClient { gpu, pid, slot } => {
            if !trusted {
                return denied("terminating MPS clients is for root only");
            }
            if gpu as usize >= agent.backend.gpus().len() {
                return Response::error(ErrorCode::NotFound, format!("no GPU {gpu}"));
            }
            let domain = DomainId {
                gpu,
                slot: slot.unwrap_or(0),
            };
            tracing::info!(%domain, pid, peer_uid = peer.uid, "terminate_client requested");
            match agent.backend.terminate_client(domain, pid) {
                Ok(()) => Response::Ok,
                Err(e) => Response::error(ErrorCode::Internal, e.to_string()),
            }
        }
        Request::ClearGpu { gpu } => {
            if !trusted {
                return denied("clearing a GPU is for root only");
            }
            let removed = agent.state().d.unhealthy.remove(&gpu);
            agent.mark_dirty();
            match removed {
                Some(_) => Response::Ok,
                None => Response::error(
                    ErrorCode::NotFound,
                    format!("gpu{gpu} is not marked unhealthy"),
                ),
            }
        }
    }
}

fn hello(agent: &Agent) -> Response {
    Response::Hello {
        version: mpsr_proto::PROTOCOL_VERSION,
        node: agent.node.clone(),
        simulated: agent.backend.simulated(),
    }
}

fn deregister(
    agent: &Agent,
    peer: PeerCred,
    trusted: bool,
    (job_id, step_id, pid): crate::store::registry::TaskKey,
    exit_status: Option<i32>,
) -> Response {
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
    tracing::info!(job = job_id, step = %crate::fault::decide::step_name(step_id), pid, exit_status = ?exit_status, "task deregistered");
    agent.client_exit_signal(&t.gpus, exit_status);
    // Not waited for: a deregistration lost in a crash is redone by the restart's
    // reconciliation (the pid is gone by then).
    agent.mark_journaled();
    Response::Ok
}

/// The shared domain's context of each GPU: what a task uses when it cannot register (agent down).
fn gpu_contexts(agent: &Agent, gpus: &[u32]) -> Response {
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

fn context(agent: &Agent, p: &Placement) -> GpuContext {
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

fn register(agent: &Agent, peer: PeerCred, trusted: bool, r: Registration) -> Response {
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

fn status(agent: &Agent, peer: PeerCred, trusted: bool) -> Response {
    let (tasks, pending, unhealthy) = {
        let st = agent.state();
        (
            st.d.registry
                .tasks()
                .filter(|t| trusted || t.uid == peer.uid)
                .map(|t| t.status())
                .collect::<Vec<_>>(),
            st.d.pending.len() as u32,
            st.d.unhealthy.clone(),
        )
    };
    let own: Option<std::collections::BTreeSet<u32>> =
        (!trusted).then(|| tasks.iter().map(|t| t.job_id).collect());
    let gpus = agent
        .backend
        .gpus()
        .iter()
        .map(|g| GpuStatus {
            domains: agent.domain_status(g.index, own.as_ref()),
            gpu: g.index,
            uuid: g.uuid.clone(),
            pci_bus_id: g.pci.to_string(),
            state: agent.backend.server_state(DomainId::shared(g.index)),
            // Client pids of other users are not shown to a user.
            clients: if trusted {
                agent.backend.clients(DomainId::shared(g.index))
            } else {
                vec![]
            },
            unhealthy: unhealthy.get(&g.index).map(|(_, r)| r.clone()),
        })
        .collect();
    Response::Status(StatusReply {
        node: agent.node.clone(),
        backend: agent.backend.name().into(),
        simulated: agent.backend.simulated(),
        gpus,
        tasks,
        pending_actions: pending,
        persist_failing: agent.persister.failing(),
    })
}

fn health(agent: &Agent) -> Response {
    let st = agent.state();
    let mut reasons: Vec<String> = st.d.unhealthy.values().map(|(_, r)| r.clone()).collect();
    reasons.extend(agent.telemetry_reasons(&st.telemetry.active));
    drop(st);
    Response::Health(HealthReply {
        node: agent.node.clone(),
        healthy: reasons.is_empty(),
        reasons,
    })
}

/// A decision as a user may see it: only their own jobs, no actions or outcomes (they name other
/// jobs), no pids; `None` when it concerns none of their jobs.
fn redact(r: &DecisionRecord, own: &std::collections::BTreeSet<u32>) -> Option<DecisionRecord> {
    let mut r = r.clone();
    r.hit_jobs.retain(|j| own.contains(j));
    r.spared_jobs.retain(|j| own.contains(j));
    if r.hit_jobs.is_empty() && r.spared_jobs.is_empty() {
        return None;
    }
    r.culprit_job = r.culprit_job.filter(|j| own.contains(j));
    if r.culprit_job.is_none() {
        r.culprit_evidence = None;
    }
    r.actions.clear();
    r.outcome.clear();
    r.reported_pid = None;
    r.culprit = None;
    Some(r)
}

fn redact_pathology(
    p: &mpsr_proto::PathologyRecord,
    own: &std::collections::BTreeSet<u32>,
) -> Option<mpsr_proto::PathologyRecord> {
    Some(mpsr_proto::PathologyRecord {
        at_ms: p.at_ms,
        finding: crate::telemetry::redact(&p.finding, own)?,
    })
}

/// The newest `n` items `keep` lets through (and maps), oldest first.
fn newest<'a, T: 'a, U>(
    items: impl DoubleEndedIterator<Item = &'a T>,
    n: usize,
    keep: impl FnMut(&T) -> Option<U>,
) -> Vec<U> {
    let mut v: Vec<U> = items.rev().filter_map(keep).take(n).collect();
    v.reverse();
    v
}

/// Drops the oldest items until `v` serializes within `budget` bytes (one always stays); returns
/// the size it serializes to.
fn fit_frame<T: serde::Serialize>(v: &mut Vec<T>, budget: usize) -> usize {
    let size = |v: &Vec<T>| serde_json::to_vec(v).map_or(0, |b| b.len());
    while v.len() > 1 && size(v) > budget {
        let drop_n = (v.len() / 10).max(1);
        v.drain(..drop_n);
    }
    size(v)
}

fn job_report(
    history: &std::collections::VecDeque<DecisionRecord>,
    outcomes: &std::collections::BTreeMap<u32, Vec<String>>,
    pathologies: &std::collections::VecDeque<mpsr_proto::PathologyRecord>,
    job_id: u32,
) -> JobReport {
    JobReport {
        job_id,
        faults: history
            .iter()
            .filter(|r| r.hit_jobs.contains(&job_id))
            .cloned()
            .collect(),
        actions: outcomes.get(&job_id).cloned().unwrap_or_default(),
        pathologies: pathologies
            .iter()
            .filter(|p| p.finding.jobs().contains(&job_id))
            .cloned()
            .collect(),
    }
}
