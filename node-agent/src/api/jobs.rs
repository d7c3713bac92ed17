//! The requests about jobs: a run starting and ending on this node (Slurm's prolog and epilog),
//! and a job's report for its owner.

use super::caller::{denied, Caller};
use super::views::{redact, redact_pathology};
use crate::agent::Agent;
use crate::store::registry::Task;
use crate::sys::procfs;
use mpsr_proto::{DecisionRecord, JobReport, Response};
use std::time::Duration;

/// A run of a job starts here (the prolog): Slurm says whose it is and which run.
pub fn start(agent: &Agent, job_id: u32, uid: u32, restart_count: u32) -> Response {
    let mut st = agent.store.lock();
    // Leftovers of an earlier run of this job id (a requeue) whose processes are gone.
    let stale: Vec<_> = st
        .durable
        .registry
        .tasks()
        .filter(|t| t.job_id == job_id && !procfs::alive(t.pid, t.start_ticks))
        .map(|t| (t.job_id, t.step_id, t.pid))
        .collect();
    let left: Vec<Task> = stale
        .iter()
        .filter_map(|k| st.durable.registry.remove(*k))
        .collect();
    st.durable.tasks_left(&left, crate::sys::now_ms());
    st.durable.resume.remove_job(job_id);
    let standbys = st.durable.drop_standbys(|s| s.task.0 == job_id);
    st.durable.start_run(job_id, uid, restart_count);
    // Its next run is here: what was kept for it is its own again.
    st.durable.kept_for_requeue.remove(&job_id);
    if restart_count > 0 {
        crate::store::state::push_outcome(
            &mut st.durable.outcomes,
            job_id,
            format!(
                "started again on {} (restart {restart_count}, uid {uid})",
                agent.node
            ),
        );
    }
    drop(st);
    crate::store::state::remove_fifos(&standbys);
    agent.store.mark_dirty();
    Response::Ok
}

/// A run of a job ended here (the epilog): its tasks go, its report is kept for its owner.
pub fn end(agent: &Agent, job_id: u32) -> Response {
    let mut st = agent.store.lock();
    let owner = st.durable.owner_of(job_id);
    st.durable.running.remove(&job_id);
    let left = st.durable.registry.remove_job(job_id);
    st.durable.tasks_left(&left, crate::sys::now_ms());
    st.durable.resume.remove_job(job_id);
    let standbys = st.durable.drop_standbys(|s| s.task.0 == job_id);
    let rep = job_report(
        &st.history,
        &st.durable.outcomes,
        &st.telemetry.records,
        job_id,
    );
    if let Some(uid) = owner {
        crate::store::state::archive_report(&mut st.durable, uid, rep.clone());
    }
    // A requeued job may come back here: its kept GPU state waits for it a while. Its
    // requeue may also still be queued (Slurm ends the job before the agent's call runs).
    let requeued = st.durable.requeued.remove(&job_id).is_some()
        || st.durable.pending.iter().any(|p| {
            matches!(p.op, crate::store::queue::SlurmOp::Requeue { job_id: j, .. } if j == job_id)
        });
    if requeued {
        let until = crate::sys::now_ms()
            .saturating_add(agent.keepers.keep_after_requeue.as_millis() as u64);
        st.durable.kept_for_requeue.insert(job_id, until);
    }
    drop(st);
    crate::store::state::remove_fifos(&standbys);
    agent.store.mark_dirty();
    let keep = if requeued {
        agent.keepers.keep_after_requeue
    } else {
        Duration::ZERO
    };
    let keepers = agent.keepers.clone();
    std::thread::spawn(move || keepers.job_end(job_id, keep));
    // The epilog hands this to the job's owner: only what the owner may see.
    let own: std::collections::BTreeSet<u32> = match owner {
        Some(uid) => agent.store.lock().durable.jobs_of(uid),
        None => [job_id].into(),
    };
    Response::JobReport(redacted(rep, &own))
}

/// A report as one user may see it: decisions and findings that name only their own jobs.
fn redacted(mut rep: JobReport, own: &std::collections::BTreeSet<u32>) -> JobReport {
    rep.faults = rep.faults.iter().filter_map(|r| redact(r, own)).collect();
    rep.pathologies = rep
        .pathologies
        .iter()
        .filter_map(|p| redact_pathology(p, own))
        .collect();
    rep
}

pub fn report(agent: &Agent, caller: Caller, job_id: u32) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let st = agent.store.lock();
    if !trusted && st.durable.owner_of(job_id) != Some(peer.uid) {
        return denied(format!(
            "job {job_id} is not a known job of uid {}",
            peer.uid
        ));
    }
    let rep = job_report(
        &st.history,
        &st.durable.outcomes,
        &st.telemetry.records,
        job_id,
    );
    if trusted {
        return Response::JobReport(rep);
    }
    Response::JobReport(redacted(rep, &st.durable.jobs_of(peer.uid)))
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
