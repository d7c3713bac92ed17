//! The agent's Unix socket: peer credentials, framing, bounded concurrency. Dispatch is in handlers.rs.

use crate::agent::Agent;
use mpsr_proto::{ErrorCode, FrameError, Request, Response};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAX_CONNECTIONS: usize = 512;

pub use mpsr_proto::{peer_cred, PeerCred};

pub fn bind(path: &std::path::Path) -> std::io::Result<UnixListener> {
    mpsr_proto::bind_world_socket(path, "agent")
}

pub fn serve(agent: Arc<Agent>, listener: UnixListener) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        if active.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
            tracing::warn!("too many connections; refusing one");
            continue; // dropping closes it
        }
        active.fetch_add(1, Ordering::Relaxed);
        let a = agent.clone();
        let act = active.clone();
        let spawned = std::thread::Builder::new()
            .name("conn".into())
            .spawn(move || {
                handle_conn(&a, stream);
                act.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn handle_conn(agent: &Agent, mut s: UnixStream) {
    let Ok(peer) = peer_cred(&s) else { return };
    // A slow or silent client cannot hold a thread for long.
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
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
