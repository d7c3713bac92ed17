//! Agent configuration (`/etc/mps-resilient/agent.toml`). Every key is documented with its default in
//! `etc/agent.toml`; unknown keys and bad values are rejected at start with the key named.

use crate::signal::{BlastRadius, ClassPolicy, JobAction};
use mpsr_proto::FaultClass;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/mps-resilient/agent.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path}: key `{key}`: {message}")]
    Value {
        path: PathBuf,
        key: String,
        message: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Nvml,
    Sim,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub backend: Backend,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    /// Slurm node name used in drain/resume; empty = short hostname.
    pub node_name: String,
    /// Uids allowed to act on any job (root is always trusted).
    pub trusted_uids: Vec<u32>,
    /// Slurm's SlurmUser, trusted like root; resolved at start. Empty = none.
    pub slurm_user: String,
    pub log: LogConfig,
    pub slurm: SlurmConfig,
    pub mps: MpsConfig,
    pub faults: FaultConfig,
    pub sim: SimConfig,
    pub keeper: KeeperConfig,
    pub telemetry: TelemetryConfig,
    pub standby: StandbyConfig,
}

/// Hot standbys (`--mps-standby`): a second incarnation of a resume-mode task, prepared in another
/// fault domain of the GPU, released by the agent when a fault hits the task.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StandbyConfig {
    /// Standbys per GPU at most (0: standbys refused). Each waiting standby holds its CUDA context
    /// (~518 MiB of GPU memory measured on an H200 for a small CUDA program, 772-838 MiB for a
    /// PyTorch one) plus what the application allocates before it waits.
    pub max_per_gpu: u32,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for each standby while it waits and after it took over
    /// (a client can only lower it), e.g. "8G"; empty: the job's own limit.
    pub memory_limit: String,
    /// Warm standbys (`--mps-standby=warm`) per GPU at most (0: refused). A warm standby holds no
    /// CUDA context while it waits: no GPU memory, no delay of the driver's fault reports; only
    /// host memory (what the application loaded before its first CUDA call).
    pub warm_max_per_gpu: u32,
    /// The host memory (resident) all waiting warm standbys of the node may hold together, e.g.
    /// "32G" (a PyTorch process with torch imported: ~0.5 GiB); a standby asked for beyond it is
    /// refused (the task runs without one). Empty: no cap.
    pub warm_host_memory: String,
    /// A resume task hit in a GPU's shared domain with no standby to take over is restarted at
    /// once in the GPU's standby domain when that domain's server runs (its new CUDA context is
    /// made while the shared server recovers) and runs there from then on, as a task whose
    /// standby took over does; one hit in the standby domain, in the shared one. False: it waits
    /// for its own server to be ACTIVE again.
    pub restart_in_standby_domain: bool,
}

impl Default for StandbyConfig {
    fn default() -> Self {
        StandbyConfig {
            max_per_gpu: 8,
            memory_limit: String::new(),
            warm_max_per_gpu: 32,
            warm_host_memory: "32G".into(),
            restart_in_standby_domain: true,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Sample GPUs, MPS clients and NICs in the agent's telemetry thread and run the pathology rules.
    pub enabled: bool,
    /// One round every this many ms (cheap getters, process lists, per-process utilization).
    pub interval_ms: u64,
    /// Every this many rounds, also the expensive counters (energy, violation times, PCIe replays,
    /// field values, link state).
    pub slow_every: u32,
    /// `/metrics` and `/v1/jobs/<id>` over HTTP, e.g. "127.0.0.1:9410"; empty = off.
    pub listen: String,
    /// Source networks allowed to read it (CIDR or address); others get 403.
    pub allow_from: Vec<String>,
    /// A file holding a bearer token every request must carry (`Authorization: Bearer ...`);
    /// empty = none. The file must not be readable by group or others.
    pub bearer_token_file: PathBuf,
    /// Hardware findings make the node unhealthy (the health check drains it with an mpsr: reason).
    pub drain_on_hardware: bool,
    /// Read NIC port counters under `sysfs`.
    pub nic: bool,
    pub sysfs: PathBuf,
    /// Where applications' step files are (`mpsr_step()`; the library's `MPSR_STEP_DIR`).
    pub step_dir: PathBuf,
    /// Findings kept for events and job reports.
    pub findings_kept: usize,
    /// Per-process series carry a `pid` label (a new series every run: off by default; ranks
    /// are told by `hpc_job`, `step` and `task`).
    pub pid_labels: bool,
    /// Per-rule changes: `[telemetry.rules.<name>]` enabled, raise, clear, window_s, clear_s.
    pub rules: BTreeMap<String, mpsr_telemetry::rules::Tuning>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            enabled: true,
            // 1 s rounds of the cheap getters (clock-event bits, temperature, ECC, link state: the
            // hardware-state rules see a change within seconds); the counters that cost ms per GPU
            // (energy, process utilization, replays, field values) once a minute. Measured cost:
            // BENCHMARKS.md (telemetry).
            interval_ms: 1_000,
            slow_every: 60,
            listen: String::new(),
            allow_from: vec!["127.0.0.1/32".into(), "::1/128".into()],
            bearer_token_file: PathBuf::new(),
            drain_on_hardware: true,
            nic: true,
            sysfs: "/sys".into(),
            step_dir: mpsr_telemetry::steps::DEFAULT_DIR.into(),
            findings_kept: 1_000,
            pid_labels: false,
            rules: BTreeMap::new(),
        }
    }
}

impl TelemetryConfig {
    /// Who may read the HTTP endpoint (validated at load: bad networks and an unreadable or
    /// world-readable token file are refused there).
    pub fn http_access(&self) -> Result<crate::sys::http_access::Access, KeyError> {
        use crate::sys::http_access::{Access, Net};
        let mut allow_from = Vec::new();
        for n in &self.allow_from {
            allow_from.push(Net::parse(n).ok_or_else(|| KeyError {
                key: "telemetry.allow_from",
                message: format!("'{n}' is not a network like 10.0.0.0/8 or an address"),
            })?);
        }
        let token = if self.bearer_token_file.as_os_str().is_empty() {
            None
        } else {
            Some(read_token(&self.bearer_token_file)?)
        };
        Ok(Access { allow_from, token })
    }

    /// The rule table with this config's changes.
    pub fn rules(&self) -> Result<Vec<mpsr_telemetry::Rule>, mpsr_telemetry::rules::TuningError> {
        mpsr_telemetry::rules::tuned(self.rules.iter().map(|(k, v)| (k.as_str(), v)))
    }
}

/// Where the agent logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogTarget {
    /// Under systemd (not on a terminal): journald, else syslog; on a terminal: stderr.
    Auto,
    Stderr,
    /// syslog(3), for hosts without journald.
    Syslog,
    /// journald's native protocol: each event's fields (fault_id, gpu, hit, ...) stay fields
    /// (`journalctl MPSR_FAULT_ID=3`).
    Journald,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub target: LogTarget,
    /// tracing filter, e.g. `info` or `mpsr_agent=debug`.
    pub level: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmConfig {
    pub scontrol: PathBuf,
    /// squeue binary: a job's state, restarts and AdminComment are read with it (fields no user
    /// chooses, never from `scontrol show job`, where a job's name stands among the fields).
    pub squeue: PathBuf,
    /// sinfo binary: a node's state and drain reason are read with it.
    pub sinfo: PathBuf,
    /// Passed as SLURM_CONF to scontrol when set.
    pub slurm_conf: Option<PathBuf>,
    pub timeout_ms: u64,
    pub max_attempts: u32,
    pub retry_backoff_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MpsConfig {
    pub control_binary: PathBuf,
    /// `-multiuser-server`: one server for all users. A fault then also kills other users' clients.
    pub multiuser: bool,
    pub default_thread_pct: u8,
    /// e.g. "16G"; empty = no limit.
    pub default_pinned_mem_limit: String,
    pub command_timeout_ms: u64,
    pub health_interval_ms: u64,
    /// After a fault, hit jobs' CUDA processes still attached after this long are ended (SIGKILL) so
    /// the server can return to ACTIVE; other clients get `terminate_client`.
    pub fault_grace_ms: u64,
    /// A domain still in FAULT this long after the fault is stuck: the escalation ladder starts
    /// (its MPS server ended; then its control daemon ended and started again; then the domain
    /// fenced, and the node drained when it is a GPU's shared domain).
    pub fault_stuck_ms: u64,
    /// Time between two rungs of the escalation ladder.
    pub escalation_step_ms: u64,
    /// A task placed into a domain whose server is recovering from a fault waits this long at
    /// most (in its registration, before it starts) for the server to be ACTIVE again: MPS
    /// refuses a new client of a server in FAULT (CUDA error 807), which failed innocent jobs
    /// that started just after a neighbour's fault. Below the plugin's `timeout_ms`.
    pub admit_wait_ms: u64,
    /// Stop the MPS daemons when the agent stops. Off: an agent restart must not end running jobs'
    /// GPU work (the daemons keep serving; the restarted agent takes them over).
    pub quit_on_shutdown: bool,
    /// Fault domain of a job that does not ask (`--mps-isolation`): shared, job or user.
    pub isolation_default: mpsr_proto::Isolation,
    /// What users may ask for.
    pub isolation_allowed: Vec<mpsr_proto::Isolation>,
    /// MPS servers per GPU, the shared one included.
    pub max_domains_per_gpu: u32,
    /// A job or user domain with no tasks is stopped after this long (seconds).
    pub domain_linger_s: u64,
    /// Who is placed apart after being the culprit of a fault: "job", "user" or "off".
    pub quarantine: QuarantineRule,
    /// How long the quarantine lasts (seconds).
    pub quarantine_s: u64,
}

/// Who goes to a domain of their own after being the culprit of a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuarantineRule {
    Off,
    /// The job (its next run, e.g. after a requeue) gets a domain of its own.
    Job,
    /// Every job of the culprit's user gets a domain of its own.
    User,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Signals of one GPU within this window are one fault.
    pub correlation_window_ms: u64,
    /// A task that exited abnormally at most this long before a fault's first signal counts as
    /// one of its victims (its client may die before the agent hears of the fault). Measured on
    /// an H200: real victims exited at most ~0.15 s before the first signal; an exit earlier than
    /// this is the task's own failure, not the fault's.
    pub victim_exit_before_ms: u64,
    pub kmsg: bool,
    pub kmsg_path: PathBuf,
    /// Tail each GPU's MPS control.log.
    pub mps_logs: bool,
    pub history: usize,
    /// Xid -> class name, e.g. { "63" = "hw_contained" }.
    pub xid_classes: BTreeMap<String, String>,
    /// class name -> policy, e.g. [faults.policy.app_sm] radius="gpu" action="recover" drain=false isolatable=false
    pub policy: BTreeMap<String, ClassPolicy>,
}

impl FaultConfig {
    /// How long an abnormally exited task is remembered as a possible victim (re-decisions of a
    /// fault come within the correlation window).
    pub fn exit_memory(&self) -> std::time::Duration {
        std::time::Duration::from_millis((2 * self.correlation_window_ms).max(1000))
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    pub gpus: u32,
    /// The driver patch the simulated kernel module carries: `off`, `attribution` (an isolation
    /// line names the culprit of an Xid 31, the fault kills as before) or `containment` (the
    /// culprit's MMU fault is contained: the line alone, nobody else notices).
    pub driver_patch: mpsr_simgpu::DriverPatch,
    /// When a simulated fault shows: "measured" (an Xid 43 reported after ~14 ms, an Xid 31 after
    /// ~100 ms, victims failing after ~150/125 ms, as on an H200) or "instant".
    pub timing: mpsr_simgpu::FaultTiming,
    /// Time for a FAULT server to become ACTIVE after its last faulting client left (measured ~0.2 s).
    pub recovery_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            backend: Backend::Nvml,
            socket: "/run/mps-resilient/agent.sock".into(),
            state_dir: "/var/lib/mps-resilient".into(),
            run_dir: "/run/mps-resilient".into(),
            node_name: String::new(),
            trusted_uids: vec![0],
            slurm_user: "slurm".into(),
            log: LogConfig::default(),
            slurm: SlurmConfig::default(),
            mps: MpsConfig::default(),
            faults: FaultConfig::default(),
            sim: SimConfig::default(),
            keeper: KeeperConfig::default(),
            telemetry: TelemetryConfig::default(),
            standby: StandbyConfig::default(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            target: LogTarget::Auto,
            level: "info".into(),
        }
    }
}

impl Default for SlurmConfig {
    fn default() -> Self {
        SlurmConfig {
            scontrol: "scontrol".into(),
            squeue: "squeue".into(),
            sinfo: "sinfo".into(),
            slurm_conf: None,
            timeout_ms: 10_000,
            max_attempts: 8,
            retry_backoff_ms: 500,
        }
    }
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            control_binary: "nvidia-cuda-mps-control".into(),
            multiuser: false,
            default_thread_pct: 100,
            default_pinned_mem_limit: String::new(),
            command_timeout_ms: 3_000,
            health_interval_ms: 1_000,
            fault_grace_ms: 2_000,
            fault_stuck_ms: 10_000,
            escalation_step_ms: 5_000,
            admit_wait_ms: 1_500,
            quit_on_shutdown: false,
            isolation_default: mpsr_proto::Isolation::Shared,
            isolation_allowed: mpsr_proto::Isolation::ALL.to_vec(),
            max_domains_per_gpu: 4,
            domain_linger_s: 60,
            quarantine: QuarantineRule::Job,
            quarantine_s: 86_400,
        }
    }
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            correlation_window_ms: 500,
            victim_exit_before_ms: 300,
            kmsg: true,
            kmsg_path: "/dev/kmsg".into(),
            mps_logs: true,
            history: 1000,
            xid_classes: BTreeMap::new(),
            policy: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeeperConfig {
    /// Run a state keeper per GPU (kept GPU state for `mpsr_state_attach`).
    pub enabled: bool,
    /// The mpsr-keeper binary; empty = next to mpsr-agent.
    pub binary: PathBuf,
    /// Most bytes one job may keep per GPU, e.g. "64G".
    pub max_bytes_per_job: String,
    /// How long a requeued job's allocations are kept for it to come back (seconds).
    pub keep_after_requeue_s: u64,
    /// Host snapshots of kept allocations (node-local).
    pub snapshot_dir: PathBuf,
    /// Snapshot every allocation this often (seconds); 0 = only when the application asks.
    pub snapshot_interval_s: u64,
}

impl Default for KeeperConfig {
    fn default() -> Self {
        KeeperConfig {
            enabled: true,
            binary: PathBuf::new(),
            max_bytes_per_job: "64G".into(),
            keep_after_requeue_s: 600,
            snapshot_dir: "/var/lib/mps-resilient/snapshots".into(),
            snapshot_interval_s: 0,
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            gpus: 2,
            driver_patch: mpsr_simgpu::DriverPatch::Off,
            timing: mpsr_simgpu::FaultTiming::Measured,
            recovery_ms: 200,
        }
    }
}

pub use mpsr_proto::parse_size;

/// A bad value found outside `validate`: the key and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    pub key: &'static str,
    pub message: String,
}

/// The bearer token in `path`: its first line, from a file only its owner may read.
fn read_token(path: &std::path::Path) -> Result<String, KeyError> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |message: String| KeyError {
        key: "telemetry.bearer_token_file",
        message,
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(bad(format!(
            "{} is readable by others (mode {:o}); chmod 600 it",
            path.display(),
            meta.permissions().mode() & 0o777
        )));
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.len() < 16 {
        return Err(bad(format!(
            "the token in {} is shorter than 16 characters",
            path.display()
        )));
    }
    Ok(token)
}

/// A config value that fails its check: the key and why.
fn invalid(key: &'static str, message: String) -> KeyError {
    KeyError { key, message }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim().replace('\n', " "),
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let checks = [
            Config::check_telemetry,
            Config::check_mps,
            Config::check_limits,
            Config::check_storage,
        ];
        for check in checks {
            check(self).map_err(|e| ConfigError::Value {
                path: path.to_path_buf(),
                key: e.key.to_string(),
                message: e.message,
            })?;
        }
        self.xid_overrides(path)?;
        self.policy_overrides(path)?;
        Ok(())
    }

    fn check_telemetry(&self) -> Result<(), KeyError> {
        let t = &self.telemetry;
        if let Err(e) = t.rules() {
            return Err(invalid("telemetry.rules", e.to_string()));
        }
        if t.interval_ms < 100 {
            return Err(invalid(
                "telemetry.interval_ms",
                format!("{} is below 100", t.interval_ms),
            ));
        }
        if t.slow_every == 0 {
            return Err(invalid("telemetry.slow_every", "must be at least 1".into()));
        }
        if !t.listen.is_empty() && t.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "telemetry.listen",
                format!("'{}' is not an address:port like 127.0.0.1:9410", t.listen),
            ));
        }
        t.http_access()?;
        Ok(())
    }

    fn check_mps(&self) -> Result<(), KeyError> {
        let m = &self.mps;
        if m.fault_stuck_ms <= m.fault_grace_ms {
            return Err(invalid(
                "mps.fault_stuck_ms",
                format!(
                    "{} ms must be longer than mps.fault_grace_ms ({} ms): the hit clients are ended first",
                    m.fault_stuck_ms, m.fault_grace_ms
                ),
            ));
        }
        if m.escalation_step_ms < 100 {
            return Err(invalid(
                "mps.escalation_step_ms",
                format!(
                    "{} ms is too short for a step to act (at least 100)",
                    m.escalation_step_ms
                ),
            ));
        }
        if m.admit_wait_ms > 30_000 {
            return Err(invalid(
                "mps.admit_wait_ms",
                format!(
                    "{} ms is longer than any plugin timeout should be (at most 30000)",
                    m.admit_wait_ms
                ),
            ));
        }
        if !(1..=100).contains(&m.default_thread_pct) {
            return Err(invalid(
                "mps.default_thread_pct",
                format!("{} is not in 1..=100", m.default_thread_pct),
            ));
        }
        if !m.default_pinned_mem_limit.is_empty()
            && parse_size(&m.default_pinned_mem_limit).is_none()
        {
            return Err(invalid(
                "mps.default_pinned_mem_limit",
                format!(
                    "'{}' is not a size like 900M or 16G",
                    m.default_pinned_mem_limit
                ),
            ));
        }
        if m.isolation_allowed.is_empty() {
            return Err(invalid(
                "mps.isolation_allowed",
                "must name at least one of shared, job, user".into(),
            ));
        }
        if !m.isolation_allowed.contains(&m.isolation_default) {
            return Err(invalid(
                "mps.isolation_default",
                format!("'{}' is not in mps.isolation_allowed", m.isolation_default),
            ));
        }
        if !(1..=48).contains(&m.max_domains_per_gpu) {
            return Err(invalid(
                "mps.max_domains_per_gpu",
                format!("{} is not in 1..=48", m.max_domains_per_gpu),
            ));
        }
        let apart = m
            .isolation_allowed
            .iter()
            .any(|i| *i != mpsr_proto::Isolation::Shared);
        if m.max_domains_per_gpu == 1 && apart {
            return Err(invalid(
                "mps.max_domains_per_gpu",
                "1 leaves no room for job or user domains; allow only \"shared\" or raise it"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Timeouts, windows, attempts and counts.
    fn check_limits(&self) -> Result<(), KeyError> {
        for (key, v) in [
            ("slurm.timeout_ms", self.slurm.timeout_ms),
            ("mps.command_timeout_ms", self.mps.command_timeout_ms),
            ("mps.health_interval_ms", self.mps.health_interval_ms),
            (
                "faults.correlation_window_ms",
                self.faults.correlation_window_ms,
            ),
        ] {
            if v == 0 || v > 600_000 {
                return Err(invalid(key, format!("{v} is not in 1..=600000")));
            }
        }
        if self.faults.victim_exit_before_ms > 10_000 {
            return Err(invalid(
                "faults.victim_exit_before_ms",
                format!("{} is not in 0..=10000", self.faults.victim_exit_before_ms),
            ));
        }
        if self.slurm.max_attempts == 0 {
            return Err(invalid("slurm.max_attempts", "must be at least 1".into()));
        }
        if self.faults.history == 0 || self.faults.history > 1_000_000 {
            return Err(invalid("faults.history", "must be in 1..=1000000".into()));
        }
        if self.backend == Backend::Sim && !(1..=64).contains(&self.sim.gpus) {
            return Err(invalid(
                "sim.gpus",
                format!("{} is not in 1..=64", self.sim.gpus),
            ));
        }
        Ok(())
    }

    /// Sizes and paths of what the agent keeps.
    fn check_storage(&self) -> Result<(), KeyError> {
        if !self.standby.warm_host_memory.is_empty()
            && parse_size(&self.standby.warm_host_memory).is_none()
        {
            return Err(invalid(
                "standby.warm_host_memory",
                format!("'{}' is not a size like 32G", self.standby.warm_host_memory),
            ));
        }
        if !self.standby.memory_limit.is_empty() && parse_size(&self.standby.memory_limit).is_none()
        {
            return Err(invalid(
                "standby.memory_limit",
                format!("'{}' is not a size like 8G", self.standby.memory_limit),
            ));
        }
        if parse_size(&self.keeper.max_bytes_per_job).is_none() {
            return Err(invalid(
                "keeper.max_bytes_per_job",
                format!("'{}' is not a size like 64G", self.keeper.max_bytes_per_job),
            ));
        }
        if !self.keeper.snapshot_dir.is_absolute() {
            return Err(invalid(
                "keeper.snapshot_dir",
                format!(
                    "{} is not an absolute path",
                    self.keeper.snapshot_dir.display()
                ),
            ));
        }
        for rel in [&self.socket, &self.state_dir, &self.run_dir] {
            if !rel.is_absolute() {
                return Err(invalid(
                    "socket/state_dir/run_dir",
                    format!("{} is not an absolute path", rel.display()),
                ));
            }
        }
        Ok(())
    }

    pub fn xid_overrides(&self, path: &Path) -> Result<BTreeMap<u32, FaultClass>, ConfigError> {
        let mut out = BTreeMap::new();
        for (k, v) in &self.faults.xid_classes {
            let key = format!("faults.xid_classes.{k}");
            let xid: u32 = k.parse().map_err(|_| ConfigError::Value {
                path: path.to_path_buf(),
                key: key.clone(),
                message: "not an Xid number".into(),
            })?;
            let class = FaultClass::from_name(v).ok_or_else(|| ConfigError::Value {
                path: path.to_path_buf(),
                key: key.clone(),
                message: format!("unknown class '{v}'"),
            })?;
            out.insert(xid, class);
        }
        Ok(out)
    }

    pub fn policy_overrides(
        &self,
        path: &Path,
    ) -> Result<BTreeMap<FaultClass, ClassPolicy>, ConfigError> {
        let mut out = BTreeMap::new();
        for (k, p) in &self.faults.policy {
            let key = format!("faults.policy.{k}");
            let class = FaultClass::from_name(k).ok_or_else(|| ConfigError::Value {
                path: path.to_path_buf(),
                key: key.clone(),
                message: "unknown class".into(),
            })?;
            // Draining a node for an application's bug would let any user take nodes out of service.
            if p.drain && !class.is_hardware() {
                return Err(ConfigError::Value {
                    path: path.to_path_buf(),
                    key: format!("{key}.drain"),
                    message: "only hardware classes may drain the node".into(),
                });
            }
            if p.radius == BlastRadius::None && p.action != JobAction::None {
                return Err(ConfigError::Value {
                    path: path.to_path_buf(),
                    key: format!("{key}.action"),
                    message: "an action needs radius = \"domain\" or \"gpu\"".into(),
                });
            }
            out.insert(class, *p);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<Config, ConfigError> {
        Config::parse(t, Path::new("test.toml"))
    }

    #[test]
    fn shipped_example_parses_and_equals_defaults() {
        let text = include_str!("../../etc/agent.toml");
        let c = parse(text).expect("etc/agent.toml must parse");
        let d = Config::default();
        assert_eq!(c.socket, d.socket);
        assert_eq!(c.mps.fault_grace_ms, d.mps.fault_grace_ms);
        assert_eq!(
            c.faults.correlation_window_ms,
            d.faults.correlation_window_ms
        );
        assert_eq!(c.sim.recovery_ms, d.sim.recovery_ms);
        assert_eq!(c.slurm.max_attempts, d.slurm.max_attempts);
        assert_eq!(
            crate::domain::Policy::from_config(&c.mps),
            crate::domain::Policy::from_config(&d.mps)
        );
        assert_eq!(c.mps.domain_linger_s, d.mps.domain_linger_s);
        assert_eq!(c.telemetry.interval_ms, d.telemetry.interval_ms);
        assert_eq!(c.telemetry.slow_every, d.telemetry.slow_every);
        assert_eq!(c.telemetry.listen, d.telemetry.listen);
        assert_eq!(c.telemetry.drain_on_hardware, d.telemetry.drain_on_hardware);
    }

    #[test]
    fn telemetry_keys_are_checked() {
        let e = parse("[telemetry.rules.stragler]\nwindow_s = 1.0\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("telemetry.rules") && e.contains("stragler"),
            "{e}"
        );
        let e = parse("[telemetry.rules.near_oom]\nraise = 0.8\nclear = 0.9\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("near_oom") && e.contains("clear"), "{e}");
        let e = parse("[telemetry.rules.straggler]\nwindow = 1.0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("window"), "{e}");
        let e = parse("[telemetry]\nlisten = \"localhost\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("telemetry.listen"), "{e}");
        let e = parse("[telemetry]\ninterval_ms = 5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("telemetry.interval_ms"), "{e}");
    }

    #[test]
    fn unknown_key_named() {
        let e = parse("bakend = \"sim\"\n").unwrap_err().to_string();
        assert!(e.contains("bakend"), "{e}");
        let e = parse("[mps]\nthreads = 3\n").unwrap_err().to_string();
        assert!(e.contains("threads"), "{e}");
    }

    #[test]
    fn bad_values_named() {
        let e = parse("backend = \"cuda\"\n").unwrap_err().to_string();
        assert!(e.contains("cuda"), "{e}");
        let e = parse("[mps]\ndefault_thread_pct = 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("mps.default_thread_pct"), "{e}");
        let e = parse("[mps]\ndefault_pinned_mem_limit = \"12Q\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("default_pinned_mem_limit"), "{e}");
        let e = parse("[faults.xid_classes]\n\"31\" = \"scary\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("faults.xid_classes.31"), "{e}");
        let e = parse("socket = \"rel.sock\"\n").unwrap_err().to_string();
        assert!(e.contains("absolute"), "{e}");
        let e = parse("[faults.policy.app_sm]\nradius=\"gpu\"\naction=\"recover\"\ndrain=true\nisolatable=false\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("faults.policy.app_sm.drain"), "{e}");
        let e = parse("[slurm]\ntimeout_ms = 0\n").unwrap_err().to_string();
        assert!(e.contains("slurm.timeout_ms"), "{e}");
        assert!(parse("this is = not toml [").is_err());
        let e = parse("[mps]\nisolation_default = \"job\"\nisolation_allowed = [\"shared\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("mps.isolation_default"), "{e}");
        let e = parse("[mps]\nisolation_allowed = [\"gpu\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpu"), "{e}");
        let e = parse("[mps]\nmax_domains_per_gpu = 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("mps.max_domains_per_gpu"), "{e}");
        let e = parse("[mps]\nquarantine = \"forever\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("forever"), "{e}");
        assert!(
            parse("[mps]\nmax_domains_per_gpu = 1\nisolation_allowed = [\"shared\"]\n").is_ok()
        );
    }

    #[test]
    fn overrides_parse() {
        let c = parse("[faults.xid_classes]\n\"63\" = \"hw_contained\"\n[faults.policy.app_sm]\nradius=\"gpu\"\naction=\"requeue_only\"\ndrain=false\nisolatable=false\n").unwrap();
        let p = Path::new("x");
        assert_eq!(c.xid_overrides(p).unwrap()[&63], FaultClass::HwContained);
        assert_eq!(
            c.policy_overrides(p).unwrap()[&FaultClass::AppSm].action,
            JobAction::RequeueOnly
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("900M"), Some(900 << 20));
        assert_eq!(parse_size("16G"), Some(16 << 30));
        assert_eq!(parse_size("16GB"), Some(16 << 30));
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("0"), None);
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("-1G"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }
}
