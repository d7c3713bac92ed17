//! The plugin's calls to the node agent: each one bounded by `timeout_ms`. Only a socket that is
//! missing or refused is tried again, within `restart_wait_ms`: an agent restarting (an upgrade)
//! is back within a second, and a task launched meanwhile would otherwise run unprotected. A slow
//! agent is never retried (it must not hold up a job launch).

use crate::config::PlugConfig;
use mpsr_proto::{Client, ClientError, ErrorCode, GpuContext, Registration, Request, Response};
use std::time::{Duration, Instant};

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
    match call_through_restart(cfg, req) {
        Ok(Response::Error { code, message }) => Err(AgentError::Refused { code, message }),
        Ok(r) => Ok(r),
        Err(
            e @ (ClientError::Unavailable(..)
            | ClientError::Protocol(_)
            | ClientError::Version { .. }),
        ) => Err(AgentError::Unreachable(e.to_string())),
    }
}

/// One call; while the agent's socket is missing or refuses connections, tried again every 50 ms
/// until `restart_wait` (and never past `timeout`) has passed.
fn call_through_restart(cfg: &PlugConfig, req: &Request) -> Result<Response, ClientError> {
    let start = Instant::now();
    let retry_until = start + cfg.restart_wait.min(cfg.timeout);
    loop {
        let left = cfg.timeout.saturating_sub(start.elapsed());
        match Client::new(&cfg.agent_socket, left.max(Duration::from_millis(1))).call(req) {
            Err(ClientError::Unavailable(_, ref e))
                if restarting(e) && Instant::now() + RETRY_EVERY < retry_until =>
            {
                std::thread::sleep(RETRY_EVERY);
            }
            other => return other,
        }
    }
}

const RETRY_EVERY: Duration = Duration::from_millis(50);

/// No agent listens right now (a restart in progress), as opposed to one that does not answer.
fn restarting(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn cfg(dir: &std::path::Path, restart_wait_ms: u64) -> PlugConfig {
        PlugConfig {
            agent_socket: dir.join("agent.sock"),
            restart_wait: Duration::from_millis(restart_wait_ms),
            ..PlugConfig::default()
        }
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("mpsr-plugin-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_call_waits_for_an_agent_that_is_restarting() {
        let dir = scratch("restart");
        let c = cfg(&dir, 1000);
        let path = c.agent_socket.clone();
        // The agent's socket appears 300 ms after the call starts (a restart), then it answers.
        let agent = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let l = UnixListener::bind(&path).unwrap();
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..2 {
                let _: Request = mpsr_proto::read_frame(&mut s).unwrap();
                let reply = Response::Hello {
                    version: mpsr_proto::PROTOCOL_VERSION,
                    node: "n1".into(),
                    simulated: true,
                };
                mpsr_proto::write_frame(&mut s, &reply).unwrap();
            }
        });
        let t = Instant::now();
        let r = call(&c, &Request::GpuContexts { gpus: vec![0] });
        assert!(r.is_ok(), "{r:?}");
        assert!(t.elapsed() >= Duration::from_millis(300));
        agent.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_down_agent_costs_at_most_the_restart_wait() {
        let dir = scratch("down");
        for (wait_ms, at_least, below) in [(0, 0, 200), (400, 350, 1200)] {
            let t = Instant::now();
            let r = call(&cfg(&dir, wait_ms), &Request::GpuContexts { gpus: vec![0] });
            let took = t.elapsed();
            assert!(matches!(r, Err(AgentError::Unreachable(_))), "{r:?}");
            assert!(
                took >= Duration::from_millis(at_least) && took < Duration::from_millis(below),
                "restart_wait_ms={wait_ms}: {took:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
