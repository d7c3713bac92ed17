//! Who is asking, and the answer that refuses them: what every handler and the dispatcher share
//! (a leaf: the handlers import it, not the dispatcher that imports them).

use mpsr_proto::{ErrorCode, PeerCred, Response};

/// Who is asking: the kernel's word (SO_PEERCRED), and whether that uid may act on every job
/// (root, `slurm_user`, `trusted_uids`).
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub peer: PeerCred,
    pub trusted: bool,
}

/// A refusal: permission denied, with why.
pub fn denied(msg: impl Into<String>) -> Response {
    Response::error(ErrorCode::PermissionDenied, msg)
}
