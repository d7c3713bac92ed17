//! What a fault is, as every part of the product names it: its class (from its Xids) and the
//! sources of its signals. Serialized as their snake_case names, as decision records have always
//! carried them; a name a newer agent adds reads as `unknown` / `other` here.

use crate::DomainId;
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// What every drain reason and AdminComment line the agent writes into Slurm starts with: the
/// agent's drains are told from an admin's by it (the health check and NHC check match it too).
pub const SLURM_TEXT_PREFIX: &str = "mpsr:";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultClass {
    /// Informational (e.g. 63 row remap recorded, 92 high SBE rate): nobody is hit.
    Info,
    /// Not in the table: logged, no action unless configured.
    Unknown,
    /// Application memory fault (31 MMU fault). Isolatable with the driver patch.
    AppMemory,
    /// Application SM/engine exception (13, 43, 45, 68, 109): handled in firmware; kills the GPU's clients.
    AppSm,
    /// A server's own fatal-error line (or the server seen in FAULT) before any Xid reached the
    /// agent: an application fault of that server, its Xid still to come. Decided at once (a hot
    /// standby is released on it); the Xid, when it comes, decides it again with its own class.
    AppServer,
    /// Hardware error contained by the GPU (94): hit clients die, the GPU stays usable.
    HwContained,
    /// Uncontained or memory hardware error (95, 48, 64, 140): GPU needs a reset; drain.
    HwUncontained,
    /// Interconnect errors (74 NVLink).
    Interconnect,
    /// The GPU is gone (79 fallen off the bus, 119/120 GSP, 154 reset required).
    DeviceLost,
}

impl FaultClass {
    pub const ALL: [FaultClass; 9] = [
        FaultClass::Info,
        FaultClass::Unknown,
        FaultClass::AppServer,
        FaultClass::AppMemory,
        FaultClass::AppSm,
        FaultClass::HwContained,
        FaultClass::HwUncontained,
        FaultClass::Interconnect,
        FaultClass::DeviceLost,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultClass::Info => "info",
            FaultClass::Unknown => "unknown",
            FaultClass::AppMemory => "app_memory",
            FaultClass::AppSm => "app_sm",
            FaultClass::AppServer => "app_server",
            FaultClass::HwContained => "hw_contained",
            FaultClass::HwUncontained => "hw_uncontained",
            FaultClass::Interconnect => "interconnect",
            FaultClass::DeviceLost => "device_lost",
        }
    }

    pub fn from_name(s: &str) -> Option<FaultClass> {
        FaultClass::ALL.into_iter().find(|c| c.name() == s)
    }

    /// Severity order used when several Xids of one fault are merged.
    pub fn severity(self) -> u8 {
        match self {
            FaultClass::Info => 0,
            FaultClass::Unknown => 1,
            FaultClass::AppServer => 2,
            FaultClass::AppMemory => 2,
            FaultClass::AppSm => 3,
            FaultClass::HwContained => 4,
            FaultClass::Interconnect => 5,
            FaultClass::HwUncontained => 6,
            FaultClass::DeviceLost => 7,
        }
    }

    /// Hardware classes are the only ones allowed to drain a node.
    pub fn is_hardware(self) -> bool {
        matches!(
            self,
            FaultClass::HwContained
                | FaultClass::HwUncontained
                | FaultClass::Interconnect
                | FaultClass::DeviceLost
        )
    }
}

impl fmt::Display for FaultClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What Xid 154 says the GPU needs now (`GPU recovery action changed from 0x0 (None) to 0x2
/// (Node Reboot Required)`), by its code, as NVML's `nvmlDeviceGpuRecoveryAction_t` numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryAction {
    None,
    GpuReset,
    NodeReboot,
    DrainP2p,
    DrainAndReset,
}

impl RecoveryAction {
    pub fn from_code(code: u32) -> Option<RecoveryAction> {
        Some(match code {
            0 => RecoveryAction::None,
            1 => RecoveryAction::GpuReset,
            2 => RecoveryAction::NodeReboot,
            3 => RecoveryAction::DrainP2p,
            4 => RecoveryAction::DrainAndReset,
            _ => return None,
        })
    }

    /// The class of an Xid 154 that names this action. A bare 154 (NVML's event carries no
    /// action) is `device_lost`, the table's. There is no class that drains without hitting the
    /// running jobs, so "drain and reset" hits them as an uncontained error does.
    pub fn class(self) -> FaultClass {
        match self {
            RecoveryAction::None => FaultClass::Info,
            RecoveryAction::DrainP2p => FaultClass::Interconnect,
            RecoveryAction::DrainAndReset => FaultClass::HwUncontained,
            RecoveryAction::GpuReset | RecoveryAction::NodeReboot => FaultClass::DeviceLost,
        }
    }
}

/// The Xid that carries a [`RecoveryAction`].
pub const XID_RECOVERY_ACTION: u32 = 154;

/// A decision record's class as written, read forward-compatibly: a class this release does not
/// know (a newer agent's) is `unknown`.
pub fn class_or_unknown<'de, D: Deserializer<'de>>(d: D) -> Result<FaultClass, D::Error> {
    let name = String::deserialize(d)?;
    Ok(FaultClass::from_name(&name).unwrap_or(FaultClass::Unknown))
}

/// Where a fault signal came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalSource {
    Nvml,
    Kmsg,
    MpsLog,
    /// A domain's server seen in FAULT (`get_server_status`), probed after a GPU-wide signal.
    MpsStatus,
    ClientExit,
    /// The driver patch's isolation line.
    Isolation,
    Sim,
    /// A source this release does not know (a newer agent's).
    #[serde(other)]
    Other,
}

impl SignalSource {
    pub fn name(self) -> &'static str {
        match self {
            SignalSource::Nvml => "nvml",
            SignalSource::Kmsg => "kmsg",
            SignalSource::MpsLog => "mps_log",
            SignalSource::MpsStatus => "mps_status",
            SignalSource::ClientExit => "client_exit",
            SignalSource::Isolation => "isolation",
            SignalSource::Sim => "sim",
            SignalSource::Other => "other",
        }
    }
}

impl fmt::Display for SignalSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A step id as people read it: `batch` for the batch step.
pub fn step_name(step: u32) -> String {
    if step == crate::BATCH_STEP {
        "batch".into()
    } else {
        step.to_string()
    }
}

fn parse_step(s: &str) -> Option<u32> {
    match s {
        "batch" => Some(crate::BATCH_STEP),
        n => n.parse().ok(),
    }
}

fn parse_domain(s: &str) -> Option<DomainId> {
    let (gpu, slot) = s.strip_prefix("gpu")?.split_once('/')?;
    let gpu = gpu.parse().ok()?;
    match slot {
        "shared" => Some(DomainId::shared(gpu)),
        d => Some(DomainId {
            gpu,
            slot: d.strip_prefix('d')?.parse().ok()?,
        }),
    }
}

/// What a decision does for a hit job or for the node. On the wire and on disk it is the line
/// people read ("requeue job 7"), as records always carried it, and it is read back into its
/// kind; a line this release cannot read (a newer agent's) is kept whole as `Other`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum FaultAction {
    /// End only this MPS client (`terminate_client`); the others keep running.
    TerminateClient { domain: DomainId, pid: u32 },
    /// `scontrol requeue` a batch job.
    Requeue { job_id: u32 },
    /// Hand the task to the resume path (restart in place once its server is ACTIVE).
    Resume { job_id: u32, step_id: u32, pid: u32 },
    /// The task must not be resumed (culprit, or GPU unusable): its supervisor is told to fail it.
    FailTask {
        job_id: u32,
        step_id: u32,
        pid: u32,
        why: String,
    },
    /// `scontrol update State=DRAIN Reason="mpsr: ..."` (hardware classes only).
    DrainNode { reason: String },
    /// Hit, but nothing to do; said why.
    None { job_id: u32, why: String },
    /// An action this release cannot read.
    Other(String),
}

impl fmt::Display for FaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultAction::TerminateClient { domain, pid } => {
                write!(f, "terminate_client {domain} pid {pid}")
            }
            FaultAction::Requeue { job_id } => write!(f, "requeue job {job_id}"),
            FaultAction::Resume {
                job_id,
                step_id,
                pid,
            } => write!(
                f,
                "resume job {job_id} step {} task pid {pid}",
                step_name(*step_id)
            ),
            FaultAction::FailTask {
                job_id,
                step_id,
                pid,
                why,
            } => write!(
                f,
                "fail job {job_id} step {} task pid {pid} ({why})",
                step_name(*step_id)
            ),
            FaultAction::DrainNode { reason } => write!(f, "drain node \"{reason}\""),
            FaultAction::None { job_id, why } => write!(f, "none for job {job_id} ({why})"),
            FaultAction::Other(line) => f.write_str(line),
        }
    }
}

impl From<FaultAction> for String {
    fn from(a: FaultAction) -> String {
        a.to_string()
    }
}

impl From<String> for FaultAction {
    fn from(line: String) -> FaultAction {
        FaultAction::parse(&line).unwrap_or(FaultAction::Other(line))
    }
}

impl FaultAction {
    /// Reads a line `Display` wrote.
    fn parse(line: &str) -> Option<FaultAction> {
        // "(why)" at the end of a line, and what comes before it.
        let with_why = |rest: &str| -> Option<(String, String)> {
            let (head, why) = rest.split_once(" (")?;
            Some((head.to_string(), why.strip_suffix(')')?.to_string()))
        };
        let words = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>();
        if let Some(rest) = line.strip_prefix("terminate_client ") {
            let w = words(rest);
            return match &w[..] {
                [d, p, pid] if p == "pid" => Some(FaultAction::TerminateClient {
                    domain: parse_domain(d)?,
                    pid: pid.parse().ok()?,
                }),
                _ => None,
            };
        }
        if let Some(rest) = line.strip_prefix("requeue job ") {
            return Some(FaultAction::Requeue {
                job_id: rest.parse().ok()?,
            });
        }
        if let Some(rest) = line.strip_prefix("resume job ") {
            let w = words(rest);
            return match &w[..] {
                [job, s, step, t, p, pid] if s == "step" && t == "task" && p == "pid" => {
                    Some(FaultAction::Resume {
                        job_id: job.parse().ok()?,
                        step_id: parse_step(step)?,
                        pid: pid.parse().ok()?,
                    })
                }
                _ => None,
            };
        }
        if let Some(rest) = line.strip_prefix("fail job ") {
            let (head, why) = with_why(rest)?;
            let w = words(&head);
            return match &w[..] {
                [job, s, step, t, p, pid] if s == "step" && t == "task" && p == "pid" => {
                    Some(FaultAction::FailTask {
                        job_id: job.parse().ok()?,
                        step_id: parse_step(step)?,
                        pid: pid.parse().ok()?,
                        why,
                    })
                }
                _ => None,
            };
        }
        if let Some(rest) = line.strip_prefix("drain node \"") {
            return Some(FaultAction::DrainNode {
                reason: rest.strip_suffix('"')?.to_string(),
            });
        }
        if let Some(rest) = line.strip_prefix("none for job ") {
            let (job, why) = with_why(rest)?;
            return Some(FaultAction::None {
                job_id: job.parse().ok()?,
                why,
            });
        }
        None
    }
}

/// What happened after a decision, in order. Records carry these (`outcomes`) and, for clients
/// of 0.1.0, the same as the lines people read (`outcome`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FaultOutcome {
    /// The domain's server is ACTIVE again, `ms` after the fault.
    ServerActive { domain: DomainId, ms: u64 },
    /// A client of a hit job still held its server in FAULT after the grace: SIGKILLed (`error`:
    /// why the kill failed).
    HitClientKilled {
        domain: DomainId,
        pid: u32,
        grace_ms: u64,
        error: Option<String>,
    },
    /// A client of no hit job holds the server in FAULT: terminate_client sent, never killed.
    ServerHeld { domain: DomainId, pid: u32 },
    /// What terminate_client answered for a client.
    ClientTerminated {
        domain: DomainId,
        pid: u32,
        error: Option<String>,
    },
    /// A Slurm action carried out (`done`) or given up; what Slurm said, for people.
    Slurm { done: bool, detail: String },
    /// A hot standby took over the task, released `released_us` after the fault's first signal.
    StandbyTookOver {
        job: u32,
        step: u32,
        standby: u32,
        primary: u32,
        primary_ended: bool,
        released_us: u64,
    },
    /// The task's standby was gone: restarted in place instead.
    StandbyGone { job: u32, step: u32, standby: u32 },
    /// The hit task was restarted at once in `domain` (its server running: the GPU's standby
    /// domain, or the shared one for a task that ran in the standby domain) while `from`, where
    /// the fault hit it, recovered; it runs there from now on.
    RestartedElsewhere {
        job: u32,
        step: u32,
        from: DomainId,
        domain: DomainId,
    },
    /// No domain showed an application fault: nobody was acted on.
    NoDomainShowed,
    /// The domain stayed in FAULT past `mps.fault_stuck_ms`: one rung of the escalation ladder
    /// was climbed, `after_ms` after the fault (`ended`: the processes it ended; `error`: why
    /// the step failed).
    Escalated {
        domain: DomainId,
        rung: EscalationRung,
        after_ms: u64,
        ended: Vec<u32>,
        error: Option<String>,
    },
    /// Every rung climbed and the domain still not back: fenced (no task is placed there; the
    /// node is drained when it is a GPU's shared domain).
    DomainFenced { domain: DomainId, after_ms: u64 },
    /// A fenced domain answers and is ACTIVE again: placed into again.
    DomainUnfenced { domain: DomainId },
    /// An outcome of a newer agent this build does not know.
    #[serde(other)]
    Other,
}

/// The escalation ladder for a server stuck in FAULT, in the order it is climbed (killing the hit
/// clients at `mps.fault_grace_ms` comes before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EscalationRung {
    /// The domain's MPS server process is ended: every client of a faulted server is dead in GPU
    /// terms already; the control daemon starts a fresh server for the next client.
    EndServer,
    /// The control daemon (and its servers) ended and started again in fresh directories.
    RestartDaemon,
    /// The domain is fenced.
    Fence,
}

impl EscalationRung {
    pub const ALL: [EscalationRung; 3] = [
        EscalationRung::EndServer,
        EscalationRung::RestartDaemon,
        EscalationRung::Fence,
    ];

    pub fn name(self) -> &'static str {
        match self {
            EscalationRung::EndServer => "end_server",
            EscalationRung::RestartDaemon => "restart_daemon",
            EscalationRung::Fence => "fence",
        }
    }
}

impl fmt::Display for FaultOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultOutcome::ServerActive { domain, ms } => {
                write!(f, "{domain} MPS server ACTIVE again {ms} ms after the fault")
            }
            FaultOutcome::HitClientKilled {
                domain,
                pid,
                grace_ms,
                error,
            } => write!(
                f,
                "client {pid} of a hit job still held {domain} in FAULT after {grace_ms} ms (not calling CUDA?): {}",
                match error {
                    None => "ended with SIGKILL".to_string(),
                    Some(e) => format!("SIGKILL failed: {e}"),
                }
            ),
            FaultOutcome::ServerHeld { domain, pid } => write!(
                f,
                "{domain} stays in FAULT: client {pid} is no registered task of a hit job; not killed, terminate_client sent (an operator can also: mpsrctl terminate --gpu {} --slot {} --pid {pid})",
                domain.gpu, domain.slot
            ),
            FaultOutcome::ClientTerminated { domain, pid, error } => write!(
                f,
                "terminate_client {pid} on {domain}: {}",
                error.as_deref().unwrap_or("ok")
            ),
            FaultOutcome::Slurm { done: true, detail } => f.write_str(detail),
            FaultOutcome::Slurm { done: false, detail } => write!(f, "FAILED: {detail}"),
            FaultOutcome::StandbyTookOver {
                job,
                step,
                standby,
                primary,
                primary_ended,
                released_us,
            } => write!(
                f,
                "standby pid {standby} took over task {job}.{} (released {:.1} ms after the fault's first signal; primary pid {primary} {})",
                step_name(*step),
                *released_us as f64 / 1000.0,
                if *primary_ended { "ended" } else { "already gone" }
            ),
            FaultOutcome::StandbyGone { job, step, standby } => write!(
                f,
                "standby pid {standby} of task {job}.{} was gone: restarted in place instead",
                step_name(*step)
            ),
            FaultOutcome::RestartedElsewhere {
                job,
                step,
                from,
                domain,
            } => write!(
                f,
                "task {job}.{} restarted at once in {domain} while {from} recovers",
                step_name(*step)
            ),
            FaultOutcome::NoDomainShowed => f.write_str(
                "no fault domain showed the fault (no server.log fatal error, no server in FAULT): nobody was acted on",
            ),
            FaultOutcome::Escalated {
                domain,
                rung,
                after_ms,
                ended,
                error,
            } => {
                let what = match rung {
                    EscalationRung::EndServer => "its MPS server ended",
                    EscalationRung::RestartDaemon => "its control daemon ended and started again",
                    EscalationRung::Fence => "fenced",
                };
                write!(f, "{domain} still in FAULT {after_ms} ms after the fault: {what}")?;
                if !ended.is_empty() {
                    write!(f, " (pids {ended:?})")?;
                }
                match error {
                    Some(e) => write!(f, ": FAILED: {e}"),
                    None => Ok(()),
                }
            }
            FaultOutcome::DomainFenced { domain, after_ms } => write!(
                f,
                "{domain} could not be brought back {after_ms} ms after the fault: fenced (no task is placed there{})",
                if domain.is_shared() {
                    "; the node is drained"
                } else {
                    ""
                }
            ),
            FaultOutcome::DomainUnfenced { domain } => {
                write!(f, "{domain} answers and is ACTIVE again: no longer fenced")
            }
            FaultOutcome::Other => f.write_str("(an outcome of a newer agent)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_on_the_wire_are_the_snake_case_ones_and_unknown_ones_read_forward() {
        for c in FaultClass::ALL {
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
        assert_eq!(
            serde_json::to_string(&SignalSource::MpsLog).unwrap(),
            "\"mps_log\""
        );
        let s: SignalSource = serde_json::from_str("\"tomorrow\"").unwrap();
        assert_eq!(s, SignalSource::Other);
        #[derive(Deserialize)]
        struct R {
            #[serde(deserialize_with = "class_or_unknown")]
            class: FaultClass,
        }
        let r: R = serde_json::from_str(r#"{"class": "app_quantum"}"#).unwrap();
        assert_eq!(r.class, FaultClass::Unknown);
        let r: R = serde_json::from_str(r#"{"class": "app_sm"}"#).unwrap();
        assert_eq!(r.class, FaultClass::AppSm);
    }

    #[test]
    fn actions_go_as_their_lines_and_are_read_back() {
        let all = [
            FaultAction::TerminateClient {
                domain: DomainId { gpu: 0, slot: 2 },
                pid: 41,
            },
            FaultAction::TerminateClient {
                domain: DomainId::shared(1),
                pid: 42,
            },
            FaultAction::Requeue { job_id: 7 },
            FaultAction::Resume {
                job_id: 3,
                step_id: 0,
                pid: 100,
            },
            FaultAction::Resume {
                job_id: 3,
                step_id: crate::BATCH_STEP,
                pid: 101,
            },
            FaultAction::FailTask {
                job_id: 4,
                step_id: 2,
                pid: 102,
                why: "app_sm: GPU unusable (and not a batch job)".into(),
            },
            FaultAction::DrainNode {
                reason: "mpsr: xid 79 (device_lost) on gpu0 of n1".into(),
            },
            FaultAction::None {
                job_id: 9,
                why: "no action for class info".into(),
            },
        ];
        for a in all {
            let wire = serde_json::to_string(&a).unwrap();
            assert_eq!(wire, serde_json::to_string(&a.to_string()).unwrap());
            let back: FaultAction = serde_json::from_str(&wire).unwrap();
            assert_eq!(back, a, "{wire}");
        }
        assert_eq!(
            serde_json::to_string(&FaultAction::Requeue { job_id: 27 }).unwrap(),
            "\"requeue job 27\"",
            "the line records always carried"
        );
        let later: FaultAction = serde_json::from_str("\"migrate job 5 to gpu1\"").unwrap();
        assert_eq!(later, FaultAction::Other("migrate job 5 to gpu1".into()));
    }

    #[test]
    fn outcomes_read_as_the_lines_they_replace_and_travel_typed() {
        let d = DomainId { gpu: 0, slot: 2 };
        let cases = [
            (
                FaultOutcome::ServerActive { domain: d, ms: 375 },
                "gpu0/d2 MPS server ACTIVE again 375 ms after the fault",
            ),
            (
                FaultOutcome::HitClientKilled {
                    domain: d,
                    pid: 9,
                    grace_ms: 2000,
                    error: None,
                },
                "client 9 of a hit job still held gpu0/d2 in FAULT after 2000 ms (not calling CUDA?): ended with SIGKILL",
            ),
            (
                FaultOutcome::Slurm {
                    done: false,
                    detail: "gave up after 5 attempts: timeout".into(),
                },
                "FAILED: gave up after 5 attempts: timeout",
            ),
            (
                FaultOutcome::StandbyTookOver {
                    job: 51,
                    step: 0,
                    standby: 77,
                    primary: 76,
                    primary_ended: true,
                    released_us: 34_812,
                },
                "standby pid 77 took over task 51.0 (released 34.8 ms after the fault's first signal; primary pid 76 ended)",
            ),
        ];
        for (o, line) in cases {
            assert_eq!(o.to_string(), line);
            let back: FaultOutcome =
                serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
            assert_eq!(back, o);
        }
    }
}
