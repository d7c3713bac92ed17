//! Wire protocol between the SPANK plugin, `mpsrctl` and the node agent.
//!
//! One request and one response per frame: a 4-byte big-endian length, then a JSON body of at most
//! [`MAX_FRAME`] bytes. The caller's uid is never taken from a message: the agent reads it from the
//! socket (SO_PEERCRED). Only root/SlurmUser may name another uid (`Registration::uid`).
//!
//! This crate is deliberately small (serde + libc) so the plugin does not link the agent's dependencies.

mod client;
pub mod fault;
pub mod fdpass;
pub mod frame;
pub mod keeper;
mod peer;
pub mod serve;
pub mod standby;
pub use peer::{bind_world_socket, peer_cred, PeerCred};

pub use client::{Client, ClientError};
pub use fault::{step_name, EscalationRung, FaultAction, FaultClass, FaultOutcome, SignalSource};
pub use frame::{read_frame, write_frame, FrameError, MAX_FRAME};

use serde::{Deserialize, Serialize};

/// Protocol revision; bumped on incompatible changes.
/// The telemetry types the protocol carries (findings, samples, pathologies to inject).
pub use mpsr_telemetry as telemetry;

pub const PROTOCOL_VERSION: u32 = 2;

/// Slurm's step id of a batch script (`SLURM_BATCH_SCRIPT`).
pub const BATCH_STEP: u32 = 0xffff_fffb;

/// What the agent does for a job hit by a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Requeue the batch job through Slurm.
    Requeue,
    /// Restart the hit tasks in place (srun jobs cannot be requeued).
    Resume,
    /// Registered for bookkeeping only; the agent takes no action.
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "requeue" => Ok(Mode::Requeue),
            "resume" => Ok(Mode::Resume),
            "off" => Ok(Mode::Off),
            other => Err(format!(
                "invalid mode '{other}': expected requeue, resume or off"
            )),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Requeue => "requeue",
            Mode::Resume => "resume",
            Mode::Off => "off",
        })
    }
}

/// One fault domain: an MPS control daemon and its server on one GPU, with its own pipe and log
/// directory. A fault kills the clients of its own server only (measured on an H200, KNOWLEDGE.md);
/// slot 0 is the GPU's shared domain, which always exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DomainId {
    pub gpu: u32,
    pub slot: u32,
}

impl DomainId {
    pub const fn shared(gpu: u32) -> DomainId {
        DomainId { gpu, slot: 0 }
    }
    pub const fn is_shared(self) -> bool {
        self.slot == 0
    }
}

impl std::fmt::Display for DomainId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_shared() {
            write!(f, "gpu{}/shared", self.gpu)
        } else {
            write!(f, "gpu{}/d{}", self.gpu, self.slot)
        }
    }
}

/// How the agent knows which job caused a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CulpritEvidence {
    /// The driver patch's isolation line named one of the job's processes.
    Isolation,
    /// The faulting domain held this job alone.
    SoleTenant,
}

/// Which jobs share a fault domain (`--mps-isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// The GPU's one shared server: full MPS concurrency, shared fate.
    Shared,
    /// A server of the job's own: its ranks share it; other jobs are time-sliced against it.
    Job,
    /// One server per user: a user's jobs share fate with each other only.
    User,
}

impl Isolation {
    pub const ALL: [Isolation; 3] = [Isolation::Shared, Isolation::Job, Isolation::User];
    pub fn name(self) -> &'static str {
        match self {
            Isolation::Shared => "shared",
            Isolation::Job => "job",
            Isolation::User => "user",
        }
    }
}

impl std::str::FromStr for Isolation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Isolation::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| format!("invalid isolation '{s}': expected shared, job or user"))
    }
}

impl std::fmt::Display for Isolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One task of a job step using GPUs through the agent's MPS daemons.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub job_id: u32,
    pub step_id: u32,
    /// The task's pid on this node.
    pub pid: u32,
    /// Owner of the job. Only a trusted caller (root/SlurmUser) may set it; others get their own uid.
    #[serde(default)]
    pub uid: Option<u32>,
    /// GPU indexes (node-local, as the agent numbers them).
    pub gpus: Vec<u32>,
    pub mode: Mode,
    /// True when the job is a batch job (requeueable by Slurm).
    #[serde(default)]
    pub batch: bool,
    #[serde(default)]
    pub threads_pct: Option<u8>,
    /// Pinned device memory limit in bytes.
    #[serde(default)]
    pub mem_limit: Option<u64>,
    /// Slurm restart count of the job when this task started.
    #[serde(default)]
    pub restart_count: u32,
    /// The fault domain asked for (`--mps-isolation`); none = the node's default.
    #[serde(default)]
    pub isolation: Option<Isolation>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

/// Requests to the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Liveness and version check.
    Hello {
        version: u32,
    },
    /// MPS client context for these GPUs (pipe and log dirs, limits).
    GpuContexts {
        gpus: Vec<u32>,
    },
    Register(Registration),
    /// A task ended. `exit_status` is the raw wait status when known.
    Deregister {
        job_id: u32,
        step_id: u32,
        pid: u32,
        #[serde(default)]
        exit_status: Option<i32>,
    },
    /// A job starts on this node (prolog): forget leftovers of an earlier run of the same job id.
    JobStart {
        job_id: u32,
        uid: u32,
        #[serde(default)]
        restart_count: u32,
    },
    /// A job ended on this node: drop what is left of it and return its fault report.
    JobEnd {
        job_id: u32,
    },
    /// Jobs, GPUs and MPS server states (filtered to the caller's jobs unless trusted).
    Status,
    /// The most recent decisions.
    Events {
        limit: u32,
    },
    /// What hit this job and what was done.
    JobReport {
        job_id: u32,
    },
    /// Asked by a resume supervisor after its child died: may it restart?
    ResumeQuery {
        job_id: u32,
        step_id: u32,
        pid: u32,
        /// While the verdict is `Wait` (the task's server recovers), the agent holds the answer up
        /// to this long (at most 1000 ms; absent from supervisors before 0.3: at once) and answers
        /// the moment it changes: the restart follows the server's recovery at once, not a poll.
        /// Not sent when 0 (an agent before 0.3 refuses fields it does not know: the supervisor
        /// asks without it when refused so).
        #[serde(default, skip_serializing_if = "is_zero")]
        wait_ms: u32,
        /// The supervisor can restart the task in another fault domain of its GPU (it sets the
        /// task's MPS environment from `Resume.moved_to`): while the task's own server recovers,
        /// the agent may answer `Restart` at once for the GPU's standby domain, whose server runs.
        /// Not sent when false (as `wait_ms`).
        #[serde(default, skip_serializing_if = "is_false")]
        may_move: bool,
    },
    /// Node health for the health check.
    Health,
    /// Which registered task a process belongs to (itself or an ancestor); trusted callers only
    /// (the state keeper asks it to authorize a process).
    TaskOf {
        pid: u32,
    },
    /// Inject a simulated fault (sim backend only, trusted callers only).
    SimInject {
        gpu: u32,
        xid: u32,
        #[serde(default)]
        culprit: Option<u32>,
        /// The domain whose server faults; none = the culprit's, else the shared one.
        #[serde(default)]
        slot: Option<u32>,
    },
    /// Bring a simulated lost GPU back (models a GPU reset; sim backend only).
    SimRecover {
        gpu: u32,
    },
    /// Mark a GPU healthy again after an operator fixed it (trusted callers only).
    ClearGpu {
        gpu: u32,
    },
    /// The latest telemetry round and active pathology findings (a user sees only the clients
    /// and findings of their own jobs).
    Telemetry,
    /// Inject a simulated pathology into the simulated telemetry (sim backend, trusted only).
    SimPathology {
        gpu: u32,
        what: mpsr_telemetry::replay::Pathology,
        #[serde(default)]
        pid: Option<u32>,
        secs: u32,
    },
    /// End one MPS client of a GPU's server (`terminate_client`; trusted callers only).
    TerminateClient {
        gpu: u32,
        pid: u32,
        /// The client's domain on that GPU; none = the shared one.
        #[serde(default)]
        slot: Option<u32>,
    },
    /// A resume supervisor (`pid`, the registered task or a process under it) wants a standby
    /// for its task: where it may run (a fault domain other than the task's) and the FIFO that
    /// releases it. Answered with `Standby`.
    StandbyPrepare {
        job_id: u32,
        step_id: u32,
        pid: u32,
        /// Hot (absent from supervisors before 0.3) or warm. Sent only when warm: an agent before
        /// 0.3 refuses fields it does not know, and its standby is a hot one.
        #[serde(default, skip_serializing_if = "standby::Kind::is_hot")]
        kind: standby::Kind,
    },
    /// The supervisor started the standby: the agent releases it when a fault hits the task, and
    /// ends the primary first (two incarnations never both own the kept state).
    StandbyArm {
        job_id: u32,
        step_id: u32,
        pid: u32,
        primary_pid: u32,
        standby_pid: u32,
    },
}

/// MPS server state as the agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerState {
    /// No server running yet (the control daemon starts one on the first client).
    Idle,
    Active,
    /// Blocked on a fatal fault: new clients are refused (CUDA error 807).
    Fault,
    /// The GPU is gone (device lost / needs reset).
    Lost,
    /// The control daemon is not running or not answering.
    Down,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuContext {
    pub gpu: u32,
    pub uuid: String,
    /// The fault domain whose server this task's clients use on this GPU.
    pub domain: DomainId,
    pub isolation: Isolation,
    pub pipe_dir: String,
    pub log_dir: String,
    /// The server's state when asked for (`GpuContexts`); not looked up on the registration path
    /// (that would cost an MPS control command per task).
    #[serde(default)]
    pub state: Option<ServerState>,
    /// The GPU's state keeper socket, when the keeper is enabled.
    #[serde(default)]
    pub keeper_socket: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub gpu: u32,
    pub uuid: String,
    pub pci_bus_id: String,
    pub state: ServerState,
    pub clients: Vec<u32>,
    /// Why the GPU is unhealthy (hardware fault class), if it is.
    pub unhealthy: Option<String>,
    /// Its fault domains (the shared one first).
    #[serde(default)]
    pub domains: Vec<DomainStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainStatus {
    pub domain: DomainId,
    /// "shared", "job N" or "uid N".
    pub tenancy: String,
    pub state: ServerState,
    /// Client pids (shown to trusted callers only).
    pub clients: Vec<u32>,
    /// Registered jobs using it (a user sees only their own).
    pub jobs: Vec<u32>,
    /// GPU memory of its server and clients, where the backend can tell.
    pub memory_bytes: Option<u64>,
    /// Its server could not be brought back after a fault: no task is placed there.
    #[serde(default)]
    pub fenced: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskStatus {
    pub job_id: u32,
    pub step_id: u32,
    pub pid: u32,
    pub uid: u32,
    pub gpus: Vec<u32>,
    pub mode: Mode,
    pub batch: bool,
    /// The fault domain of each of its GPUs.
    #[serde(default)]
    pub domains: Vec<DomainId>,
    /// Its armed standby: the standby's pid (a cold one's: its supervisor's waiter) and the
    /// domain it waits in.
    #[serde(default)]
    pub standby: Option<(u32, DomainId)>,
    /// That standby's kind (absent from agents before 0.3: hot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_kind: Option<standby::Kind>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    pub node: String,
    pub backend: String,
    pub simulated: bool,
    pub gpus: Vec<GpuStatus>,
    pub tasks: Vec<TaskStatus>,
    pub pending_actions: u32,
    /// Set while the agent cannot write its state directory (full, read-only): it keeps acting
    /// from memory and retries; what it decided meanwhile is written once the disk takes it.
    #[serde(default)]
    pub persist_failing: Option<PersistFailure>,
    /// The agent's release and protocol revision (empty and 0 from agents older than 0.2.0).
    #[serde(default)]
    pub agent_version: String,
    #[serde(default)]
    pub protocol: u32,
}

/// The state directory has refused writes since `since_ms` (Unix ms).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistFailure {
    pub since_ms: u64,
    /// The OS error number of the last failed write, when there was one (ENOSPC, EROFS, ...).
    pub errno: Option<i32>,
    /// For people.
    pub error: String,
}

/// One decision of the agent, as shown by `mpsrctl events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionRecord {
    pub fault_id: u64,
    /// Unix time in milliseconds when the first signal of the fault arrived.
    pub at_ms: u64,
    pub gpu: u32,
    pub xids: Vec<u32>,
    #[serde(deserialize_with = "fault::class_or_unknown")]
    pub class: FaultClass,
    pub sources: Vec<SignalSource>,
    /// The pid the kernel log named (unreliable under MPS; never acted on alone).
    pub reported_pid: Option<u32>,
    /// The culprit, if an isolation source named it.
    pub culprit: Option<u32>,
    /// The fault domains whose servers showed the fault (their jobs are the hit ones).
    #[serde(default)]
    pub hit_domains: Vec<DomainId>,
    /// The job that caused the fault, when known for sure, and how it is known.
    #[serde(default)]
    pub culprit_job: Option<u32>,
    #[serde(default)]
    pub culprit_evidence: Option<CulpritEvidence>,
    /// The driver patch contained the fault to the culprit: no server faulted, nobody else was
    /// touched.
    #[serde(default)]
    pub contained: bool,
    /// An application fault no domain has shown yet: nobody is hit until one does.
    #[serde(default)]
    pub awaiting_domain: bool,
    pub hit_jobs: Vec<u32>,
    pub spared_jobs: Vec<u32>,
    pub actions: Vec<FaultAction>,
    /// Microseconds from first signal to decision.
    pub decide_us: u64,
    /// What happened afterwards (server back to ACTIVE, Slurm action results), appended as it
    /// happens, as the lines people read (what 0.1.0 carried; `outcomes` holds the same, typed).
    #[serde(default)]
    pub outcome: Vec<String>,
    /// What happened afterwards, typed (absent in records of 0.1.0).
    #[serde(default)]
    pub outcomes: Vec<FaultOutcome>,
}

impl DecisionRecord {
    /// The sources' names, as people read them.
    pub fn source_names(&self) -> Vec<&'static str> {
        self.sources.iter().map(|s| s.name()).collect()
    }
}

/// The decision as people read it (mpsrctl events, job reports, the demo).
impl std::fmt::Display for DecisionRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let opt = |v: Option<u32>, none: &str| v.map(|p| p.to_string()).unwrap_or(none.into());
        write!(
            f,
            "fault {} gpu{} xid {:?} class {} sources {:?} kernel-pid {} culprit {} | domains [{}] hit {:?} spared {:?} | decided in {} us",
            self.fault_id,
            self.gpu,
            self.xids,
            self.class,
            self.source_names(),
            opt(self.reported_pid, "-"),
            opt(self.culprit, "unknown"),
            self.hit_domains
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(" "),
            self.hit_jobs,
            self.spared_jobs,
            self.decide_us
        )?;
        if let Some(j) = self.culprit_job {
            let how = match self.culprit_evidence {
                Some(CulpritEvidence::Isolation) => "named by the isolation line",
                Some(CulpritEvidence::SoleTenant) => "sole job of the faulting domain",
                None => "",
            };
            write!(f, "\n    culprit job: {j} ({how})")?;
        }
        if self.contained {
            write!(f, "\n    contained to the culprit by the driver patch")?;
        }
        if self.awaiting_domain {
            write!(f, "\n    waiting for a domain to show the fault")?;
        }
        for a in &self.actions {
            write!(f, "\n    action: {a}")?;
        }
        for o in &self.outcome {
            write!(f, "\n    outcome: {o}")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobReport {
    pub job_id: u32,
    pub faults: Vec<DecisionRecord>,
    /// Outcome of each Slurm action for this job ("requeue: done", ...).
    pub actions: Vec<String>,
    /// Pathology findings (raised and cleared) that concern this job.
    #[serde(default)]
    pub pathologies: Vec<PathologyRecord>,
}

/// A pathology finding as the agent logged it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathologyRecord {
    /// Wall clock, ms since the epoch.
    pub at_ms: u64,
    pub finding: mpsr_telemetry::Finding,
}

impl std::fmt::Display for PathologyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let x = &self.finding;
        let what = match x.state {
            mpsr_telemetry::FindingState::Raised => "raised",
            mpsr_telemetry::FindingState::Cleared => "cleared",
        };
        write!(f, "{} {what} {:?}", x.rule.name(), x.severity)?;
        if let Some(g) = x.gpu {
            write!(f, " gpu{g}")?;
        }
        if let Some(o) = x.owner {
            write!(f, " job {} (task pid {})", o.job, o.task)?;
        }
        if let mpsr_telemetry::Subject::Client { pid, .. } = x.subject {
            write!(f, " pid {pid}")?;
        }
        if !x.others.is_empty() {
            let o: Vec<String> = x.others.iter().map(|o| o.job.to_string()).collect();
            write!(f, " others: jobs {}", o.join(","))?;
        }
        write!(f, ": {}", x.detail)
    }
}

/// The telemetry as `mpsrctl top` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TelemetryReply {
    /// False when telemetry is off in the agent's config.
    pub enabled: bool,
    pub snapshot: mpsr_telemetry::Snapshot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeVerdict {
    /// The task was hit and its GPU's MPS server is ACTIVE again: restart it.
    Restart,
    /// The task was hit; the server has not recovered yet: ask again.
    Wait,
    /// The task was the culprit or cannot be resumed (lost GPU): do not restart.
    Fail,
    /// The agent knows no fault that hit this task: its exit is its own.
    NotHit,
    /// The task was hit and its hot standby took over (already running in another fault domain):
    /// do not restart; the standby is the task's process from now on.
    TakenOver,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthReply {
    pub node: String,
    pub healthy: bool,
    /// Reasons (one per unhealthy GPU), each ready for a drain reason after the `mpsr:` prefix.
    pub reasons: Vec<String>,
}

/// Error kinds a client can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    PermissionDenied,
    NotFound,
    Unsupported,
    /// The node's policy refuses the request (e.g. an isolation the admin does not allow).
    Refused,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Response {
    Ok,
    Hello {
        version: u32,
        node: String,
        simulated: bool,
    },
    GpuContexts {
        contexts: Vec<GpuContext>,
    },
    /// Registered; the task's clients use these domains (set its MPS environment from them).
    Registered {
        contexts: Vec<GpuContext>,
    },
    Status(StatusReply),
    Events {
        events: Vec<DecisionRecord>,
        /// Pathology findings, most recent last.
        #[serde(default)]
        pathologies: Vec<PathologyRecord>,
        /// The oldest of those asked for that did not fit in one reply (its size is bounded):
        /// never dropped silently.
        #[serde(default)]
        events_left_out: u32,
        #[serde(default)]
        pathologies_left_out: u32,
    },
    JobReport(JobReport),
    Telemetry(Box<TelemetryReply>),
    Resume {
        verdict: ResumeVerdict,
        reason: String,
        /// With `Restart` to a supervisor that may move the task: the fault domain it runs in
        /// from now on (its clients' MPS environment), when not the one it was hit in. Left out
        /// otherwise (a supervisor before 0.3 never asked, never sees it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        moved_to: Option<GpuContext>,
    },
    Health(HealthReply),
    Injected {
        fault_id_hint: u64,
        killed: Vec<u32>,
    },
    TaskOf(TaskStatus),
    /// Where a hot standby runs (its MPS context, in another fault domain than its task's) and
    /// the FIFO it waits on (`standby::wait_release`).
    Standby {
        context: GpuContext,
        release_fifo: String,
        /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for the standby, in bytes (the admin's limit).
        #[serde(default)]
        mem_limit: Option<u64>,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
}

impl Response {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Response::Error {
            code,
            message: message.into(),
        }
    }
}

/// Parses a size like `900M`, `16G`, `1024` (bytes). Shared by the agent config and the plugin.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (s, 1u64),
        Some((i, _)) => {
            let m = match s[i..].to_ascii_uppercase().trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return None,
            };
            (&s[..i], m)
        }
    };
    num.parse::<u64>()
        .ok()?
        .checked_mul(mult)
        .filter(|v| *v > 0)
}

#[cfg(test)]
mod tests {

    /// Fields added in 0.3 are sent only when they say something: an agent before 0.3 refuses
    /// fields it does not know, and the defaults are what it does anyway.
    #[test]
    fn new_request_fields_are_left_out_at_their_defaults() {
        let q = |wait_ms| {
            serde_json::to_string(&Request::ResumeQuery {
                job_id: 1,
                step_id: 0,
                pid: 2,
                wait_ms,
                may_move: wait_ms > 0,
            })
            .unwrap()
        };
        assert!(!q(0).contains("wait_ms"), "{}", q(0));
        assert!(!q(0).contains("may_move"), "{}", q(0));
        assert!(q(1000).contains("\"wait_ms\":1000"));
        assert!(q(1000).contains("\"may_move\":true"));
        let p = |kind| {
            serde_json::to_string(&Request::StandbyPrepare {
                job_id: 1,
                step_id: 0,
                pid: 2,
                kind,
            })
            .unwrap()
        };
        assert!(!p(standby::Kind::Hot).contains("kind"));
        assert!(p(standby::Kind::Warm).contains("\"kind\":\"warm\""));
        // And read back without them, as from a supervisor before 0.3.
        let old: Request =
            serde_json::from_str(r#"{"op":"standby_prepare","job_id":1,"step_id":0,"pid":2}"#)
                .unwrap();
        assert!(matches!(
            old,
            Request::StandbyPrepare {
                kind: standby::Kind::Hot,
                ..
            }
        ));
    }

    use super::*;

    #[test]
    fn request_roundtrip_and_unknown_fields_rejected() {
        let r = Request::Register(Registration {
            job_id: 7,
            step_id: 0,
            pid: 42,
            uid: None,
            gpus: vec![0, 1],
            mode: Mode::Requeue,
            batch: true,
            threads_pct: Some(50),
            mem_limit: None,
            restart_count: 0,
            isolation: Some(Isolation::Job),
        });
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        let bad = r#"{"op":"deregister","job_id":1,"step_id":0,"pid":3,"evil":1}"#;
        assert!(serde_json::from_str::<Request>(bad).is_err());
        let bad_op = r#"{"op":"format_disk"}"#;
        assert!(serde_json::from_str::<Request>(bad_op).is_err());
    }

    #[test]
    fn isolation_parse_and_wire_names() {
        assert_eq!("user".parse::<Isolation>().unwrap(), Isolation::User);
        assert!("gpu"
            .parse::<Isolation>()
            .unwrap_err()
            .contains("shared, job or user"));
        assert_eq!(serde_json::to_string(&Isolation::Job).unwrap(), "\"job\"");
        assert_eq!(DomainId { gpu: 1, slot: 2 }.to_string(), "gpu1/d2");
        assert_eq!(DomainId::shared(0).to_string(), "gpu0/shared");
    }

    #[test]
    fn mode_parse() {
        assert_eq!("resume".parse::<Mode>().unwrap(), Mode::Resume);
        assert!("Resume".parse::<Mode>().is_err());
        assert!("".parse::<Mode>().is_err());
    }
}
