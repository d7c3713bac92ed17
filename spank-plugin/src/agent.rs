//! The plugin's calls to the node agent: each one bounded by `timeout_ms`, none retried (a slow
//! agent must not hold up a job launch).

use crate::config::PlugConfig;
use mpsr_proto::{Client, ClientError, ErrorCode, GpuContext, Registration, Request, Response};

#[derive(Debug)]
pub enum AgentError {
    /// Down, not answering in time, or speaking garbage.
    Unreachable(String),
    /// The agent answered with a refusal.
    Refused { code: ErrorCode, message: String },
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentError::Unreachable(m) => f.write_str(m),
            AgentError::Refused { code, message } => {
                write!(f, "node agent refused: {message} ({code:?})")
            }
        }
    }
}

fn call(cfg: &PlugConfig, req: &Request) -> Result<Response, AgentError> {
    let c = Client::new(&cfg.agent_socket, cfg.timeout);
    match c.call(req) {
        Ok(Response::Error { code, message }) => Err(AgentError::Refused { code, message }),
        Ok(r) => Ok(r),
        Err(
            e @ (ClientError::Unavailable(..)
            | ClientError::Protocol(_)
            | ClientError::Version { .. }),
        ) => Err(AgentError::Unreachable(e.to_string())),
    }
}

pub fn gpu_contexts(cfg: &PlugConfig, gpus: &[u32]) -> Result<Vec<GpuContext>, AgentError> {
    match call(
        cfg,
        &Request::GpuContexts {
            gpus: gpus.to_vec(),
        },
    )? {
        Response::GpuContexts { contexts } if contexts.len() == gpus.len() => Ok(contexts),
        other => Err(AgentError::Unreachable(format!(
            "unexpected reply to gpu_contexts: {other:?}"
        ))),
    }
}

/// Registers a task; the reply says which fault domain (MPS server) each of its GPUs uses.
pub fn register(cfg: &PlugConfig, r: Registration) -> Result<Vec<GpuContext>, AgentError> {
    let n = r.gpus.len();
    match call(cfg, &Request::Register(r))? {
        Response::Registered { contexts } if contexts.len() == n => Ok(contexts),
        other => Err(AgentError::Unreachable(format!(
            "unexpected reply to register: {other:?}"
        ))),
    }
}

pub fn deregister(
    cfg: &PlugConfig,
    job_id: u32,
    step_id: u32,
    pid: u32,
    exit_status: Option<i32>,
) -> Result<(), AgentError> {
    call(
        cfg,
        &Request::Deregister {
            job_id,
            step_id,
            pid,
            exit_status,
        },
    )
    .map(|_| ())
}
