//! SIMULATED GPUs and their MPS servers for CI and the demo (`mpsr-simgpu`), modelled on what was
//! measured on an H200 (../shared/KNOWLEDGE.md), not on an ideal. This crate knows nothing of the
//! agent: it decides who dies from its own table of measured effects ([`physics`]), so the agent's
//! Xid classification is tested against the simulated hardware, not against itself.
//!
//! - Each GPU holds fault domains: one simulated MPS control daemon + server each, started and
//!   stopped by the agent, with the pipe and log directories the agent chose. Slot 0 is the GPU's
//!   shared domain.
//! - A fault of an application class kills the clients of the faulting server only; the other
//!   servers of the same GPU and their clients run on (two daemons on one GPU were measured so).
//! - Clients are real processes (`mpsr-simclient`) connected to `<pipe_dir>/mpsr-sim.sock`.
//!
//! The agent talks to the daemon over `<run_dir>/sim/control.sock` (JSON lines, [`SimRequest`]).

mod daemon;
pub mod physics;

pub use daemon::SimGpus;
pub use mpsr_proto::{DomainId, ServerState};

use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Which phase of the driver patch (driver-patch/) the simulated kernel module carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DriverPatch {
    /// The stock driver: no isolation line.
    #[default]
    Off,
    /// Phase A: an Xid 31 with a known culprit is first named by `mpsr-isolate ... contained=0`;
    /// the fault then kills its server's clients as the stock driver's does.
    Attribution,
    /// Phase B: an Xid 31 with a known culprit is contained: only the line with `contained=1`;
    /// no Xid, no NVML event, the server stays ACTIVE and the culprit runs on (on scratch data)
    /// until it is terminated.
    Containment,
}

impl DriverPatch {
    pub fn name(self) -> &'static str {
        match self {
            DriverPatch::Off => "off",
            DriverPatch::Attribution => "attribution",
            DriverPatch::Containment => "containment",
        }
    }
}

/// When a simulated fault shows (`physics::timing`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum FaultTiming {
    /// As measured on an H200: the driver reports an Xid 43 after ~14 ms and an Xid 31 after
    /// ~100 ms; the victims get their CUDA error after ~150 ms and ~125 ms.
    #[default]
    Measured,
    /// Everything at the injection (victims first, then the reports).
    Instant,
}

impl FaultTiming {
    pub fn name(self) -> &'static str {
        match self {
            FaultTiming::Measured => "measured",
            FaultTiming::Instant => "instant",
        }
    }
}

/// The socket a simulated client finds in its `CUDA_MPS_PIPE_DIRECTORY`.
pub const SOCKET_NAME: &str = "mpsr-sim.sock";

/// GPU memory a simulated MPS server takes while it runs (measured: ~66 MiB per server, H200).
pub const SERVER_MEMORY_BYTES: u64 = 66 << 20;

/// Requests on the control socket, one JSON object per line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum SimRequest {
    Ping,
    /// Starts a domain's control daemon (idempotent: an existing one is kept).
    StartDomain {
        domain: DomainId,
        pipe_dir: PathBuf,
        log_dir: PathBuf,
        /// Only this uid's processes may connect (the pipe directory is theirs, mode 0700).
        #[serde(default)]
        owner_uid: Option<u32>,
        #[serde(default)]
        thread_pct: Option<u8>,
        #[serde(default)]
        mem_limit: Option<u64>,
    },
    /// Stops a domain without clients.
    StopDomain {
        domain: DomainId,
    },
    Domains {
        gpu: u32,
    },
    State {
        domain: DomainId,
    },
    Clients {
        domain: DomainId,
    },
    Terminate {
        domain: DomainId,
        pid: u32,
    },
    /// A fault on a GPU. Which server faults: `domain`'s, else the culprit's, else the shared one.
    Inject {
        gpu: u32,
        xid: u32,
        #[serde(default)]
        culprit: Option<u32>,
        #[serde(default)]
        slot: Option<u32>,
    },
    Recover {
        gpu: u32,
    },
    /// Test control: the domain's control daemon hangs, as a real one was seen to (a `quit` and
    /// every query unanswered for > 30 s): it answers nothing about its domain from now on. With
    /// `for_good`, a daemon started again there hangs too (the domain cannot be brought back).
    Hang {
        domain: DomainId,
        #[serde(default)]
        for_good: bool,
    },
    /// Escalation: the domain's server process is killed. Its clients lose their server (their
    /// connections close); the control daemon starts a fresh server for the next client. A hung
    /// daemon stays hung.
    KillServer {
        domain: DomainId,
    },
    /// Escalation: the domain's control daemon and server are killed and the daemon started again:
    /// no clients, ACTIVE, answering (unless it hangs for good).
    RestartDaemon {
        domain: DomainId,
    },
    /// Prints a kernel-log line as a driver would, nothing else happening: for tests of lines
    /// that lie (an isolation line claiming `contained=1` for a fault that is then cancelled).
    KernelLine {
        line: String,
    },
    /// Turns the connection into a stream of [`SimEvent`] lines.
    Subscribe,
    Quit,
}

/// One simulated domain as the daemon sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainInfo {
    pub domain: DomainId,
    pub state: ServerState,
    pub clients: Vec<u32>,
    /// GPU memory of the server and its clients.
    pub memory_bytes: u64,
    pub thread_pct: Option<u8>,
    pub mem_limit: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimReply {
    Pong { gpus: u32, pid: u32 },
    State(ServerState),
    Clients(Vec<u32>),
    Domains(Vec<DomainInfo>),
    Killed(Vec<u32>),
    Ok,
    Error(String),
    Event(SimEvent),
}

/// What the simulated hardware reports: an NVML-like event (never a pid) or a kernel-log line.
/// MPS server log lines are written to each domain's log directory, as real MPS does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimEvent {
    Nvml { gpu: u32, xid: u32 },
    Kmsg(String),
}

/// A simulated GPU's fixed identity.
pub fn gpu_uuid(i: u32) -> String {
    format!("GPU-5157-0000-0000-{i:012}")
}

/// A simulated GPU's PCI bus id, as the kernel prints it (`0000:10:00`).
pub fn gpu_pci(i: u32) -> String {
    format!("0000:{:02x}:00", 0x10 + i)
}

pub fn control_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("sim").join("control.sock")
}

pub fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

#[derive(Debug)]
pub enum CallError {
    Unreachable(std::io::Error),
    NoAnswer(std::io::Error),
    BadReply(serde_json::Error),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(e) => write!(f, "simulated GPU daemon not reachable: {e}"),
            CallError::NoAnswer(e) => write!(f, "simulated GPU daemon did not answer: {e}"),
            CallError::BadReply(e) => write!(f, "bad reply from simulated GPU daemon: {e}"),
        }
    }
}

impl std::error::Error for CallError {}

/// One request/reply on the control socket, bounded by `timeout`.
pub fn call(run_dir: &Path, req: &SimRequest, timeout: Duration) -> Result<SimReply, CallError> {
    let s = UnixStream::connect(control_socket(run_dir)).map_err(CallError::Unreachable)?;
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    writeln!(&s, "{}", json(req)).map_err(CallError::NoAnswer)?;
    let mut line = String::new();
    BufReader::new(&s)
        .read_line(&mut line)
        .map_err(CallError::NoAnswer)?;
    serde_json::from_str(&line).map_err(CallError::BadReply)
}
