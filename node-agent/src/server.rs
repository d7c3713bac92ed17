//! The agent's Unix socket: peer credentials, framing, bounded concurrency. Dispatch is in handlers.rs.

use crate::agent::Agent;
use mpsr_proto::{ErrorCode, FrameError, Request, Response};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

const MAX_CONNECTIONS: usize = 512;

use mpsr_proto::PeerCred;

pub fn bind(path: &std::path::Path) -> std::io::Result<UnixListener> {
    mpsr_proto::bind_world_socket(path, "agent")
}

pub fn serve(agent: Arc<Agent>, listener: UnixListener) {
    let limits = mpsr_proto::serve::Limits {
        max_connections: MAX_CONNECTIONS,
        io_timeout: Duration::from_secs(5),
    };
    mpsr_proto::serve::serve_connections(listener, "agent", limits, move |peer, s| {
        handle_conn(&agent, peer, s)
    });
}

fn handle_conn(agent: &Agent, peer: PeerCred, mut s: UnixStream) {
    loop {
        let body = match mpsr_proto::frame::read_body(&mut s) {
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
            Ok(req) => crate::handlers::handle(agent, peer, req),
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
