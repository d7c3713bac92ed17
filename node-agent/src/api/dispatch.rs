//! One request in, one answer out. Who may ask what is decided here, in one table ([`access`]):
//! the requests of Slurm itself and of admins are refused to everyone else before any handler
//! runs; the others are open to every local user, and their handlers show or touch only the
//! caller's own jobs (the owner as Slurm reported it, `Durable::owner_of`).

use super::{admin, jobs, register, standby, tasks, views};
use crate::agent::Agent;
use mpsr_proto::{PeerCred, Request, Response};

use super::caller::denied;
pub use super::caller::Caller;

/// Who may make a request.
enum Access {
    /// Every local user; the handler limits it to the caller's own jobs.
    Anyone,
    /// Trusted uids only (Slurm's prolog and epilog, the state keeper, admins): why, for the refusal.
    Trusted(&'static str),
}

fn access(req: &Request) -> Access {
    use Access::*;
    match req {
        Request::JobStart { .. } => Trusted("job start is reported by the prolog (root) only"),
        Request::JobEnd { .. } => Trusted("job end is reported by the epilog (root) only"),
        Request::TaskOf { .. } => Trusted("task lookup is for root (the state keeper) only"),
        Request::SimInject { .. } => Trusted("fault injection is for root only"),
        Request::SimRecover { .. } => Trusted("GPU recovery is for root only"),
        Request::SimPathology { .. } => Trusted("pathology injection is for root only"),
        Request::TerminateClient { .. } => Trusted("terminating MPS clients is for root only"),
        Request::ClearGpu { .. } => Trusted("clearing a GPU is for root only"),
        Request::Hello { .. }
        | Request::GpuContexts { .. }
        | Request::Register(_)
        | Request::Deregister { .. }
        | Request::ResumeQuery { .. }
        | Request::StandbyPrepare { .. }
        | Request::StandbyArm { .. }
        | Request::JobReport { .. }
        | Request::Events { .. }
        | Request::Telemetry
        | Request::Status
        | Request::Health => Anyone,
    }
}

pub fn handle(agent: &Agent, peer: PeerCred, req: Request) -> Response {
    let caller = Caller {
        peer,
        trusted: agent.trusted.includes(peer.uid),
    };
    if let Access::Trusted(why) = access(&req) {
        if !caller.trusted {
            return denied(why);
        }
    }
    match req {
        Request::Hello { version } => tasks::hello(agent, caller, version),
        Request::GpuContexts { gpus } => tasks::gpu_contexts(agent, &gpus),
        Request::Register(r) => register::register(agent, caller, r),
        Request::Deregister {
            job_id,
            step_id,
            pid,
            exit_status,
        } => tasks::deregister(agent, caller, (job_id, step_id, pid), exit_status),
        Request::ResumeQuery {
            job_id,
            step_id,
            pid,
            wait_ms,
            may_move,
        } => tasks::resume_query(agent, caller, (job_id, step_id, pid), wait_ms, may_move),
        Request::TaskOf { pid } => tasks::task_of(agent, pid),
        Request::StandbyPrepare {
            job_id,
            step_id,
            pid,
            kind,
        } => standby::prepare(agent, caller, (job_id, step_id, pid), kind),
        Request::StandbyArm {
            job_id,
            step_id,
            pid,
            primary_pid,
            standby_pid,
        } => standby::arm(
            agent,
            caller,
            (job_id, step_id, pid),
            primary_pid,
            standby_pid,
        ),
        Request::JobStart {
            job_id,
            uid,
            restart_count,
        } => jobs::start(agent, job_id, uid, restart_count),
        Request::JobEnd { job_id } => jobs::end(agent, job_id),
        Request::JobReport { job_id } => jobs::report(agent, caller, job_id),
        Request::Status => views::status(agent, caller),
        Request::Events { limit } => views::events(agent, caller, limit),
        Request::Telemetry => views::telemetry(agent, caller),
        Request::Health => views::health(agent),
        Request::SimInject {
            gpu,
            xid,
            culprit,
            slot,
        } => admin::sim_inject(agent, gpu, xid, culprit, slot),
        Request::SimRecover { gpu } => admin::sim_recover(agent, gpu),
        Request::SimPathology {
            gpu,
            what,
            pid,
            secs,
        } => admin::sim_pathology(agent, gpu, what, pid, secs),
        Request::TerminateClient { gpu, pid, slot } => {
            admin::terminate_client(agent, caller, gpu, pid, slot)
        }
        Request::ClearGpu { gpu } => admin::clear_gpu(agent, gpu),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurms_and_admins_requests_are_for_trusted_callers_only() {
        let trusted_only = [
            Request::JobStart {
                job_id: 1,
                uid: 1000,
                restart_count: 0,
            },
            Request::JobEnd { job_id: 1 },
            Request::TaskOf { pid: 1 },
            Request::SimInject {
                gpu: 0,
                xid: 31,
                culprit: None,
                slot: None,
            },
            Request::SimRecover { gpu: 0 },
            Request::TerminateClient {
                gpu: 0,
                pid: 1,
                slot: None,
            },
            Request::ClearGpu { gpu: 0 },
        ];
        for r in &trusted_only {
            assert!(matches!(access(r), Access::Trusted(_)), "{r:?}");
        }
        let anyone = [
            Request::Status,
            Request::Health,
            Request::Telemetry,
            Request::Events { limit: 1 },
            Request::JobReport { job_id: 1 },
        ];
        for r in &anyone {
            assert!(matches!(access(r), Access::Anyone), "{r:?}");
        }
    }
}
