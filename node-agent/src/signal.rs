//! The vocabulary of the fault path, shared by every stage and depending on none (a leaf): what
//! an intake source sends to the fault worker ([`Signal`]: where, which Xid, from which source),
//! the GPU ids it names, and where each reader was just past it ([`Cursor`], kept with the
//! decision so a restarted agent reads on from there).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A PCI address without the function number (the driver prints none; NVML prints `.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
}

impl PciAddr {
    /// Accepts `0000:00:06`, `00000000:3b:00.0`, `3b:00`, `0000:3b:00.0`.
    pub fn parse(s: &str) -> Option<PciAddr> {
        let s = s.trim();
        let s = s.split('.').next()?;
        let parts: Vec<&str> = s.split(':').collect();
        let (d, b, dev) = match parts.as_slice() {
            [d, b, dev] => (*d, *b, *dev),
            [b, dev] => ("0", *b, *dev),
            _ => return None,
        };
        Some(PciAddr {
            domain: u32::from_str_radix(d, 16).ok()?,
            bus: u8::from_str_radix(b, 16).ok()?,
            device: u8::from_str_radix(dev, 16).ok()?,
        })
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}",
            self.domain, self.bus, self.device
        )
    }
}

pub use mpsr_proto::SignalSource as Source;

/// Where a signal says the fault happened: NVML knows the index, the kernel log only the PCI address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuRef {
    Index(u32),
    Pci(PciAddr),
}

#[derive(Debug, Clone)]
pub struct Signal {
    pub source: Source,
    pub gpu: GpuRef,
    /// `None` for signals without an Xid (a FAULT line in an MPS log, a client exit).
    pub xid: Option<u32>,
    /// The pid the source printed (unreliable under MPS).
    pub reported_pid: Option<u32>,
    /// Set only by an isolation source: the process that really faulted, and whether it was contained.
    pub culprit: Option<(u32, bool)>,
    /// The fault domain (slot on this GPU) whose server showed the fault: its server.log's fatal
    /// error line or its state. GPU-wide sources (NVML, kernel log) leave it unset.
    pub domain: Option<u32>,
    pub secondary: bool,
    /// What an Xid 154 line says the GPU needs now.
    pub recovery: Option<mpsr_proto::fault::RecoveryAction>,
    pub detail: String,
    pub at: Instant,
    pub at_ms: u64,
    /// Read after an agent restart, about what happened while the agent was down (a kernel
    /// record or MPS log line older than the reader): tasks that exited meanwhile are its victims.
    pub replayed: bool,
    /// The reader's position just past this signal: kept with the decision, so a restarted agent
    /// reads on from there (nothing decided twice, nothing lost).
    pub cursor: Option<Cursor>,
}

impl Signal {
    pub fn new(source: Source, gpu: GpuRef, xid: Option<u32>) -> Signal {
        Signal {
            source,
            gpu,
            xid,
            reported_pid: None,
            culprit: None,
            domain: None,
            secondary: false,
            recovery: None,
            detail: String::new(),
            at: Instant::now(),
            at_ms: crate::sys::now_ms(),
            replayed: false,
            cursor: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KmsgCursor {
    pub boot_id: String,
    pub seq: u64,
}

/// A position in one MPS log file (its inode, and the offset just past the last line used).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogCursor {
    pub ino: u64,
    pub offset: u64,
}

/// Where a reader was just past a signal it sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cursor {
    Kmsg(KmsgCursor),
    Log { path: PathBuf, at: LogCursor },
}

/// The readers' positions the fault worker has used, kept in the durable state with the decisions
/// made from them: after a restart each reader goes on from there, so a fault that happened while
/// the agent was down is decided, and one decided before is not decided again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursors {
    #[serde(default)]
    pub kmsg: Option<KmsgCursor>,
    /// Log file path -> position.
    #[serde(default)]
    pub logs: std::collections::BTreeMap<PathBuf, LogCursor>,
}

impl Cursors {
    pub fn advance(&mut self, c: &Cursor) {
        match c {
            Cursor::Kmsg(k) => {
                if self
                    .kmsg
                    .as_ref()
                    .is_none_or(|o| o.boot_id != k.boot_id || o.seq < k.seq)
                {
                    self.kmsg = Some(k.clone());
                }
            }
            Cursor::Log { path, at } => {
                let e = self.logs.entry(path.clone()).or_default();
                if e.ino != at.ino || e.offset < at.offset {
                    *e = *at;
                }
            }
        }
    }

    /// Forgets the logs of a directory (its domain stopped; its files go with the next start).
    pub fn forget_dir(&mut self, dir: &Path) {
        self.logs.retain(|p, _| !p.starts_with(dir));
    }
}

/// Who a fault of a class hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlastRadius {
    /// Nobody.
    None,
    /// Every client of the MPS server the fault happened in (measured: an application fault kills
    /// its server's clients; other servers of the same GPU run on), narrowed to the culprit only
    /// when an isolation source names it and the class is isolatable.
    Domain,
    /// Every client of every fault domain of the GPU (hardware).
    Gpu,
}

/// What to do with the hit jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobAction {
    /// Log only.
    None,
    /// Per the job's mode: requeue (batch) or resume in place.
    Recover,
    /// Requeue only (resume in place is impossible, e.g. the GPU is gone).
    RequeueOnly,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassPolicy {
    pub radius: BlastRadius,
    pub action: JobAction,
    /// Drain the node (hardware classes only; refused for others at config load).
    pub drain: bool,
    /// A culprit named by an isolation source can be terminated alone (memory faults with the patch).
    pub isolatable: bool,
}
