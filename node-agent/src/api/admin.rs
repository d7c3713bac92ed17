//! Admin and test requests (trusted callers only, checked by the dispatch): simulated faults,
//! recoveries and pathologies, ending one MPS client, clearing a GPU an operator fixed.

use super::caller::Caller;
use crate::agent::Agent;
use mpsr_proto::{DomainId, ErrorCode, Response};

pub fn sim_inject(
    agent: &Agent,
    gpu: u32,
    xid: u32,
    culprit: Option<u32>,
    slot: Option<u32>,
) -> Response {
    match agent.backend.sim_inject(gpu, xid, culprit, slot) {
        Ok(killed) => Response::Injected {
            fault_id_hint: agent.store.lock().durable.next_fault_id + 1,
            killed,
        },
        Err(e) => Response::error(ErrorCode::Unsupported, e.to_string()),
    }
}

pub fn sim_recover(agent: &Agent, gpu: u32) -> Response {
    match agent.backend.sim_recover(gpu) {
        Ok(()) => Response::Ok,
        Err(e) => Response::error(ErrorCode::Unsupported, e.to_string()),
    }
}

pub fn sim_pathology(
    agent: &Agent,
    gpu: u32,
    what: mpsr_telemetry::replay::Pathology,
    pid: Option<u32>,
    secs: u32,
) -> Response {
    match agent.backend.sim_pathology(what, gpu, pid, secs) {
        Ok(()) => Response::Ok,
        Err(e) => Response::error(ErrorCode::Unsupported, e.to_string()),
    }
}

pub fn terminate_client(
    agent: &Agent,
    caller: Caller,
    gpu: u32,
    pid: u32,
    slot: Option<u32>,
) -> Response {
    if gpu as usize >= agent.backend.gpus().len() {
        return Response::error(ErrorCode::NotFound, format!("no GPU {gpu}"));
    }
    let domain = DomainId {
        gpu,
        slot: slot.unwrap_or(0),
    };
    tracing::info!(%domain, pid, peer_uid = caller.peer.uid, "terminate_client requested");
    match agent.backend.terminate_client(domain, pid) {
        Ok(()) => Response::Ok,
        Err(e) => Response::error(ErrorCode::Internal, e.to_string()),
    }
}

pub fn clear_gpu(agent: &Agent, gpu: u32) -> Response {
    let removed = agent.store.lock().durable.unhealthy.remove(&gpu);
    agent.store.mark_dirty();
    match removed {
        Some(_) => Response::Ok,
        None => Response::error(
            ErrorCode::NotFound,
            format!("gpu{gpu} is not marked unhealthy"),
        ),
    }
}
