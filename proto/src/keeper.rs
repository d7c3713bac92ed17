//! Protocol of the state keeper (one per GPU, outside MPS): a job's processes attach named GPU
//! allocations that outlive them. Same framing as the agent's protocol; an `Attached` reply is
//! followed by the allocation's fd (SCM_RIGHTS, see `fdpass`). Who may attach what is decided
//! from SO_PEERCRED and the agent's registry, never from the message.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum KeeperRequest {
    Ping,
    /// Attach (create on first use) the caller's job's allocation `name` of at least `bytes`.
    Attach {
        name: String,
        bytes: u64,
    },
    /// The caller unmapped it; the keeper keeps it for the job.
    Detach {
        name: String,
    },
    /// Copy one allocation (or all of the job's, `name` = None) to node-local snapshot files.
    Checkpoint {
        #[serde(default)]
        name: Option<String>,
    },
    /// Free one allocation of the caller's job now (and its snapshot).
    Release {
        name: String,
    },
    /// The job ended on this node (root): free its allocations after `keep_for_s` seconds (a
    /// requeued job that comes back in time re-attaches them), and its snapshots then too.
    JobEnd {
        job_id: u32,
        keep_for_s: u64,
    },
    /// What the keeper holds (root).
    Stats,
}

/// Where an attached allocation's contents came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Created now, zeroed.
    New,
    /// Kept in GPU memory from an earlier process of the job.
    Kept,
    /// Restored from a host snapshot (after the GPU memory was lost).
    Snapshot,
}

/// What the fd refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// A CUDA allocation exported as a POSIX fd: import with cuMemImportFromShareableHandle.
    Cuda,
    /// SIMULATED GPU memory (a memfd): mmap it.
    HostSim,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptAlloc {
    pub job_id: u32,
    pub name: String,
    pub bytes: u64,
    pub uid: u32,
    /// Seconds until it is freed, if its job has ended.
    pub release_in_s: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum KeeperResponse {
    Pong {
        gpu: u32,
        kind: MemKind,
        pid: u32,
    },
    /// Followed by the fd.
    Attached {
        job_id: u32,
        bytes: u64,
        origin: Origin,
        kind: MemKind,
    },
    Ok,
    Checkpointed {
        files: Vec<String>,
        bytes: u64,
        ms: u64,
    },
    Stats {
        allocs: Vec<KeptAlloc>,
        total_bytes: u64,
    },
    Error {
        code: crate::ErrorCode,
        message: String,
    },
}

/// Allocation names become file names: letters, digits, `.`, `_`, `-`; 1..=64 long; no leading dot.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_escape_the_snapshot_dir() {
        for ok in ["weights", "kv-cache.0", "A_b"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "",
            "..",
            "../x",
            "a/b",
            ".hidden",
            "x y",
            &"n".repeat(65),
            "é",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn unknown_fields_rejected() {
        assert!(serde_json::from_str::<KeeperRequest>(
            r#"{"op":"attach","name":"w","bytes":1,"job_id":9}"#
        )
        .is_err());
        let r: KeeperRequest = serde_json::from_str(r#"{"op":"checkpoint"}"#).unwrap();
        assert_eq!(r, KeeperRequest::Checkpoint { name: None });
    }
}
