//! The agent's Unix socket: peer credentials, framing, bounded concurrency. Dispatch is in handlers.rs.

use crate::agent::Agent;
use mpsr_proto::{ErrorCode, FrameError, Request, Response};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use mpsr_proto::PeerCred;

/// Connection limits: users share 512 connections, at most 64 each; root and the trusted uids
/// (slurmstepd, prolog, epilog, mpsrctl as root) have 128 of their own that no user can fill.
/// A request frame must arrive whole within 2 s of its first byte.
pub const LIMITS: mpsr_proto::serve::Limits = mpsr_proto::serve::Limits {
    max_connections: 512,
    max_per_uid: 64,
    max_trusted: 128,
    idle_timeout: Duration::from_secs(5),
    frame_deadline: Duration::from_secs(2),
};

pub fn bind(path: &std::path::Path) -> std::io::Result<UnixListener> {
    mpsr_proto::bind_world_socket(path, "agent")
}

pub fn serve(agent: Arc<Agent>, listener: UnixListener) {
    let a = agent.clone();
    mpsr_proto::serve::serve_connections(
        listener,
        "agent",
        LIMITS,
        move |uid| a.trusted.includes(uid),
        move |peer, s| handle_conn(&agent, peer, s),
    );
}

fn handle_conn(agent: &Agent, peer: PeerCred, mut s: UnixStream) {
    loop {
        let body = match mpsr_proto::serve::next_frame(&mut s, &LIMITS) {
            Ok(b) => b,
            Err(FrameError::Closed) => return,
            Err(FrameError::TooLarge(n)) => {
                tracing::warn!(
                    uid = peer.uid,
                    pid = peer.pid,
                    bytes = n,
                    "oversized frame refused"
                );
                let _ = mpsr_proto::write_frame(
                    &mut s,
                    &Response::error(
                        ErrorCode::BadRequest,
                        format!(
                            "frame of {n} bytes exceeds limit of {}",
                            mpsr_proto::MAX_FRAME
                        ),
                    ),
                );
                return; // the stream position is unknown now
            }
            Err(_) => return,
        };
        let resp = match serde_json::from_slice::<Request>(&body) {
            Ok(req) => crate::api::dispatch::handle(agent, peer, req),
            Err(e) => {
                tracing::warn!(uid = peer.uid, pid = peer.pid, error = %e, "malformed request refused");
                Response::error(ErrorCode::BadRequest, format!("malformed request: {e}"))
            }
        };
        if mpsr_proto::write_frame(&mut s, &resp).is_err() {
            return;
        }
    }
}
