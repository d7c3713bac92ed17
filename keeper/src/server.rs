//! The keeper's socket: peer credentials, authorization through the agent's registry, requests,
//! and the allocation's fd passed back with SCM_RIGHTS.

use crate::memory::{Device, MemError};
use crate::snapshot::Snapshots;
use crate::store::{Store, StoreError};
use mpsr_proto::keeper::{valid_name, KeeperRequest, KeeperResponse};
use mpsr_proto::{fdpass, Client, ErrorCode, PeerCred, Request, Response};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub struct Keeper {
    pub gpu: u32,
    pub dev: Box<dyn Device>,
    pub snaps: Snapshots,
    pub store: Mutex<Store>,
    pub agent_socket: PathBuf,
}

fn err(code: ErrorCode, message: impl Into<String>) -> KeeperResponse {
    KeeperResponse::Error {
        code,
        message: message.into(),
    }
}

impl Keeper {
    pub fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_fatal(&self, e: &MemError) {
        // After a sticky error no one can vouch for what the keeper holds: exit so the agent
        // starts a fresh keeper (snapshots bring the state back).
        if e.context_lost() {
            eprintln!("mpsr-keeper gpu{}: unrecoverable GPU error ({e}); exiting so a fresh keeper starts", self.gpu);
            std::process::exit(3);
        }
    }

    /// Which job the peer's process belongs to, according to the agent (never the message).
    fn authorize(&self, peer: PeerCred) -> Result<(u32, u32), KeeperResponse> {
        let c = Client::new(&self.agent_socket, Duration::from_secs(2));
        match c.call(&Request::TaskOf { pid: peer.pid }) {
            Ok(Response::TaskOf(t)) if t.uid != peer.uid => Err(err(
                ErrorCode::PermissionDenied,
                format!(
                    "process {} (uid {}) is not in a job of its user",
                    peer.pid, peer.uid
                ),
            )),
            Ok(Response::TaskOf(t)) if !t.gpus.contains(&self.gpu) => Err(err(
                ErrorCode::PermissionDenied,
                format!("job {} does not use gpu{}", t.job_id, self.gpu),
            )),
            Ok(Response::TaskOf(t)) => Ok((t.job_id, t.uid)),
            Ok(Response::Error { message, .. }) => Err(err(
                ErrorCode::PermissionDenied,
                format!(
                    "process {} is not part of a registered job: {message}",
                    peer.pid
                ),
            )),
            Ok(other) => Err(err(
                ErrorCode::Internal,
                format!("agent answered {other:?}"),
            )),
            Err(e) => Err(err(
                ErrorCode::Internal,
                format!("cannot verify the caller with the node agent: {e}"),
            )),
        }
    }

    fn store_error(&self, e: StoreError) -> KeeperResponse {
        match e {
            StoreError::Mem(m) => {
                self.check_fatal(&m);
                err(ErrorCode::Internal, format!("GPU memory: {m}"))
            }
            StoreError::NotFound(_) => err(ErrorCode::NotFound, e.to_string()),
            StoreError::OtherOwner { .. } => err(ErrorCode::PermissionDenied, e.to_string()),
            StoreError::Quota { .. } | StoreError::SizeMismatch { .. } => {
                err(ErrorCode::BadRequest, e.to_string())
            }
        }
    }

    /// One request; `Some(fd)` goes out after the reply.
    fn handle(&self, peer: PeerCred, req: KeeperRequest) -> Reply {
        match req {
            KeeperRequest::Ping => (
                KeeperResponse::Pong {
                    gpu: self.gpu,
                    kind: self.dev.kind(),
                    pid: std::process::id(),
                },
                None,
            ),
            KeeperRequest::Stats => self.stats(peer),
            KeeperRequest::JobEnd { job_id, keep_for_s } => self.job_end(peer, job_id, keep_for_s),
            KeeperRequest::Attach { name, bytes } => self.attach(peer, name, bytes),
            KeeperRequest::Detach { name } => match self.authorize(peer) {
                Ok((job, uid)) => match self.store().get_owned(job, &name, uid) {
                    Ok(_) => (KeeperResponse::Ok, None),
                    Err(e) => (self.store_error(e), None),
                },
                Err(r) => (r, None),
            },
            KeeperRequest::Release { name } => match self.authorize(peer) {
                Ok((job, uid)) => match self.store().release(job, &name, uid) {
                    Ok(()) => {
                        self.snaps.remove(job, &name);
                        (KeeperResponse::Ok, None)
                    }
                    Err(e) => (self.store_error(e), None),
                },
                Err(r) => (r, None),
            },
            KeeperRequest::Checkpoint { name } => self.checkpoint(peer, name),
        }
    }

    /// What the keeper holds (root only).
    fn stats(&self, peer: PeerCred) -> Reply {
        if peer.uid != 0 {
            return (err(ErrorCode::PermissionDenied, "stats are for root"), None);
        }
        let s = self.store();
        (
            KeeperResponse::Stats {
                allocs: s.list(),
                total_bytes: s.total_bytes(),
            },
            None,
        )
    }

    /// The agent says a job ended: its allocations are kept `keep_for_s` for a requeued run.
    fn job_end(&self, peer: PeerCred, job_id: u32, keep_for_s: u64) -> Reply {
        if peer.uid != 0 {
            return (
                err(
                    ErrorCode::PermissionDenied,
                    "job end is for the agent (root)",
                ),
                None,
            );
        }
        let n = self
            .store()
            .job_end(job_id, Duration::from_secs(keep_for_s));
        if keep_for_s == 0 {
            self.snaps.remove_job(job_id);
        }
        eprintln!(
            "mpsr-keeper gpu{}: job {job_id} ended; {n} allocation(s) freed in {keep_for_s} s",
            self.gpu
        );
        (KeeperResponse::Ok, None)
    }

    /// A task of the caller's job maps (or first creates) the named allocation: its fd goes back.
    fn attach(&self, peer: PeerCred, name: String, bytes: u64) -> Reply {
        if !valid_name(&name) {
            return (
                err(
                    ErrorCode::BadRequest,
                    format!("invalid name '{name}' (letters, digits, . _ -; at most 64)"),
                ),
                None,
            );
        }
        let (job, uid) = match self.authorize(peer) {
            Ok(j) => j,
            Err(r) => return (r, None),
        };
        let mut s = self.store();
        let (bytes, origin, fd) =
            match s.attach(self.dev.as_ref(), &self.snaps, job, uid, &name, bytes) {
                Ok((a, origin)) => (a.mem.bytes(), origin, a.mem.export_fd()),
                Err(e) => return (self.store_error(e), None),
            };
        match fd {
            Ok(fd) => (
                KeeperResponse::Attached {
                    job_id: job,
                    bytes,
                    origin,
                    kind: self.dev.kind(),
                },
                Some(fd),
            ),
            Err(e) => {
                self.check_fatal(&e);
                (err(ErrorCode::Internal, format!("export: {e}")), None)
            }
        }
    }

    /// Snapshots the caller's allocations (one, or all of its job) to disk.
    fn checkpoint(&self, peer: PeerCred, name: Option<String>) -> Reply {
        let (job, uid) = match self.authorize(peer) {
            Ok(j) => j,
            Err(r) => return (r, None),
        };
        let t = Instant::now();
        let s = self.store();
        let names = match name {
            Some(n) => match s.get_owned(job, &n, uid) {
                Ok(_) => vec![n],
                Err(e) => return (self.store_error(e), None),
            },
            None => s.names(job),
        };
        let mut files = Vec::new();
        let mut total = 0;
        for n in names {
            let Ok(a) = s.get_owned(job, &n, uid) else {
                continue;
            };
            match self.snaps.save(job, &n, uid, a.mem.as_ref()) {
                Ok((p, b)) => {
                    files.push(p.display().to_string());
                    total += b;
                }
                Err(e) => {
                    return (
                        err(ErrorCode::Internal, format!("checkpoint '{n}': {e}")),
                        None,
                    )
                }
            }
        }
        (
            KeeperResponse::Checkpointed {
                files,
                bytes: total,
                ms: t.elapsed().as_millis() as u64,
            },
            None,
        )
    }

    /// Snapshots every allocation (the periodic schedule).
    pub fn checkpoint_all(&self) {
        let s = self.store();
        for k in s.list() {
            if let Some(a) = s.get(k.job_id, &k.name) {
                if let Err(e) = self.snaps.save(k.job_id, &k.name, a.uid, a.mem.as_ref()) {
                    eprintln!(
                        "mpsr-keeper gpu{}: scheduled snapshot of job {} '{}': {e}",
                        self.gpu, k.job_id, k.name
                    );
                }
            }
        }
    }

    /// Frees allocations whose job ended long enough ago, with their snapshots.
    pub fn sweep(&self) {
        let freed = self.store().sweep(Instant::now());
        for (job, name) in freed {
            self.snaps.remove(job, &name);
            eprintln!(
                "mpsr-keeper gpu{}: freed job {job} '{name}' (kept time over)",
                self.gpu
            );
        }
    }
}

pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    mpsr_proto::bind_world_socket(path, "keeper")
}

/// A keeper answer, with the fd of an attached allocation.
type Reply = (KeeperResponse, Option<std::os::fd::OwnedFd>);

/// Connections: users share 256, at most 32 each (one user cannot exhaust the keeper's threads
/// nor lock out another user's jobs); root (the agent) has 32 of its own. An idle connection is
/// closed after 30 s; a request frame must arrive whole within 2 s of its first byte.
pub const LIMITS: mpsr_proto::serve::Limits = mpsr_proto::serve::Limits {
    max_connections: 256,
    max_per_uid: 32,
    max_trusted: 32,
    idle_timeout: Duration::from_secs(30),
    frame_deadline: Duration::from_secs(2),
};

pub fn serve(k: Arc<Keeper>, l: UnixListener) {
    mpsr_proto::serve::serve_connections(
        l,
        "keeper",
        LIMITS,
        |uid| uid == 0,
        move |peer, s| handle_conn(&k, peer, s),
    );
}

fn handle_conn(k: &Keeper, peer: PeerCred, mut s: UnixStream) {
    loop {
        let body = match mpsr_proto::serve::next_frame(&mut s, &LIMITS) {
            Ok(b) => b,
            Err(mpsr_proto::FrameError::TooLarge(n)) => {
                let _ = mpsr_proto::write_frame(
                    &mut s,
                    &err(
                        ErrorCode::BadRequest,
                        format!("frame of {n} bytes too large"),
                    ),
                );
                return;
            }
            Err(_) => return,
        };
        let (resp, fd) = match serde_json::from_slice::<KeeperRequest>(&body) {
            Ok(req) => k.handle(peer, req),
            Err(e) => (
                err(ErrorCode::BadRequest, format!("malformed request: {e}")),
                None,
            ),
        };
        if mpsr_proto::write_frame(&mut s, &resp).is_err() {
            return;
        }
        if let Some(fd) = fd {
            if fdpass::send_fd(&s, fd.as_raw_fd()).is_err() {
                return;
            }
        }
    }
}
