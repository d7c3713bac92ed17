//! mpsrctl: talk to the node agent.

mod skew;
mod top;

use clap::{Parser, Subcommand};
use mpsr_proto::{Client, Isolation, Mode, Registration, Request, Response};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(version, about = "Control and inspect the mps-resilient node agent")]
struct Args {
    #[arg(
        long,
        env = "MPSR_SOCKET",
        default_value = "/run/mps-resilient/agent.sock"
    )]
    socket: PathBuf,
    /// Print the raw JSON reply.
    #[arg(long)]
    json: bool,
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// GPUs, MPS server states and registered tasks.
    Status,
    /// Recent decisions (fault -> hit jobs -> actions -> outcome).
    Events {
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// What hit a job and what was done.
    Report { job_id: u32 },
    /// Node health as the health check sees it (exit 5 when unhealthy; 1 is an error reply,
    /// 3 no agent).
    Health {
        /// Print only the drain reason (the first, as the agent words it; nothing when healthy).
        #[arg(long)]
        reason: bool,
    },
    /// Register a task (what the SPANK plugin does).
    Register {
        #[arg(long)]
        job: u32,
        #[arg(long, default_value_t = 0)]
        step: u32,
        #[arg(long)]
        pid: u32,
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<u32>,
        #[arg(long, default_value = "requeue")]
        mode: Mode,
        #[arg(long)]
        batch: bool,
        #[arg(long)]
        uid: Option<u32>,
        /// Fault domain: shared, job or user (default: the node's).
        #[arg(long)]
        isolation: Option<Isolation>,
    },
    Deregister {
        #[arg(long)]
        job: u32,
        #[arg(long, default_value_t = 0)]
        step: u32,
        #[arg(long)]
        pid: u32,
        #[arg(long)]
        exit_status: Option<i32>,
    },
    /// Mark a GPU healthy after an operator fixed it.
    ClearGpu { gpu: u32 },
    /// End one MPS client of a GPU's server (terminate_client); the others keep running.
    Terminate {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        pid: u32,
        /// The client's fault domain on that GPU (0 = shared).
        #[arg(long)]
        slot: Option<u32>,
    },
    /// A job starts on this node (the prolog calls this; root only).
    JobStart {
        job_id: u32,
        #[arg(long)]
        uid: u32,
        #[arg(long, default_value_t = 0)]
        restart_count: u32,
    },
    /// A job ended on this node: print its fault report (the epilog calls this; root only).
    /// Exit status 0: the job was hit by no fault; 4: it was hit (the report says by what).
    JobEnd { job_id: u32 },
    /// Live telemetry: GPUs, MPS clients with their jobs, active pathology findings.
    Top {
        /// Print once and exit.
        #[arg(long)]
        once: bool,
        #[arg(long, default_value_t = 2)]
        interval_s: u64,
        /// Stop after this many screens (0 = until interrupted).
        #[arg(long, default_value_t = 0)]
        count: u32,
    },
    /// Compare a job's ranks across all its nodes (each node's agent at telemetry.listen).
    /// Exit status 1 when a rank is a straggler.
    JobSkew {
        job_id: u32,
        /// Nodes to ask (default: the job's nodes from scontrol).
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
        /// The agents' telemetry port (telemetry.listen).
        #[arg(long, default_value_t = 9410)]
        port: u16,
        /// A file with the bearer token the agents ask for (telemetry.bearer_token_file).
        #[arg(long)]
        token_file: Option<std::path::PathBuf>,
    },
    /// Simulated GPUs only.
    Sim {
        #[command(subcommand)]
        cmd: SimCmd,
    },
}

#[derive(Subcommand)]
enum SimCmd {
    /// Inject a simulated Xid on a simulated GPU.
    Inject {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        xid: u32,
        #[arg(long)]
        culprit: Option<u32>,
        /// The fault domain whose server faults (0 = shared; default: the culprit's, else shared).
        #[arg(long)]
        slot: Option<u32>,
    },
    /// Bring a simulated lost GPU back (models a GPU reset).
    Recover {
        #[arg(long)]
        gpu: u32,
    },
    /// Inject a pathology into the simulated telemetry for a while.
    Pathology {
        #[arg(long)]
        gpu: u32,
        /// throttle, thermal, ecc_storm, straggler, hog, near_oom, ... (see mpsr-telemetry replay)
        #[arg(long)]
        what: String,
        /// The client it applies to (per-client pathologies).
        #[arg(long)]
        pid: Option<u32>,
        #[arg(long, default_value_t = 600)]
        secs: u32,
    },
}

/// `job-end`'s exit status for a job that was hit by a fault.
const HIT_EXIT: u8 = 4;
/// `health`'s exit status for an unhealthy node: distinct from an error reply (1) and from no
/// agent (3), so the health check never drains on either.
const UNHEALTHY_EXIT: u8 = 5;

fn main() -> std::process::ExitCode {
    mpsr_manpage::print_if_asked(<Args as clap::CommandFactory>::command());
    let a = Args::parse();
    let timeout = Duration::from_millis(a.timeout_ms);
    match &a.cmd {
        Cmd::Top {
            once,
            interval_s,
            count,
        } => return top(&a, timeout, *once, *interval_s, *count),
        Cmd::JobSkew {
            job_id,
            nodes,
            port,
            token_file,
        } => return job_skew(&a, *job_id, nodes, *port, token_file.as_deref(), timeout),
        _ => {}
    }
    let req = match request_of(&a.cmd) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let resp = match Client::new(&a.socket, Duration::from_millis(a.timeout_ms)).call(&req) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mpsrctl: {e}");
            return 3.into();
        }
    };
    match (&a.cmd, &resp) {
        _ if a.json => println!(
            "{}",
            serde_json::to_string_pretty(&resp).unwrap_or_default()
        ),
        (Cmd::Health { reason: true }, Response::Health(h)) => {
            if let Some(r) = h.reasons.first().filter(|_| !h.healthy) {
                println!("{r}");
            }
        }
        _ => print_human(&resp),
    }
    match resp {
        Response::Error { .. } => 1.into(),
        Response::Health(h) if !h.healthy => UNHEALTHY_EXIT.into(),
        Response::JobReport(r) if matches!(a.cmd, Cmd::JobEnd { .. }) && !r.faults.is_empty() => {
            HIT_EXIT.into()
        }
        _ => 0.into(),
    }
}

/// The one request a command sends (`top` and `job-skew` are not one request).
fn request_of(cmd: &Cmd) -> Result<Request, std::process::ExitCode> {
    Ok(match cmd {
        Cmd::Top { .. } | Cmd::JobSkew { .. } => unreachable!("handled before: not one request"),
        Cmd::Status => Request::Status,
        Cmd::Events { limit } => Request::Events { limit: *limit },
        Cmd::Report { job_id } => Request::JobReport { job_id: *job_id },
        Cmd::Health { .. } => Request::Health,
        Cmd::Register {
            job,
            step,
            pid,
            gpus,
            mode,
            batch,
            uid,
            isolation,
        } => Request::Register(Registration {
            job_id: *job,
            step_id: *step,
            pid: *pid,
            uid: *uid,
            gpus: gpus.clone(),
            mode: *mode,
            batch: *batch,
            threads_pct: None,
            mem_limit: None,
            restart_count: 0,
            isolation: *isolation,
        }),
        Cmd::Deregister {
            job,
            step,
            pid,
            exit_status,
        } => Request::Deregister {
            job_id: *job,
            step_id: *step,
            pid: *pid,
            exit_status: *exit_status,
        },
        Cmd::ClearGpu { gpu } => Request::ClearGpu { gpu: *gpu },
        Cmd::JobStart {
            job_id,
            uid,
            restart_count,
        } => Request::JobStart {
            job_id: *job_id,
            uid: *uid,
            restart_count: *restart_count,
        },
        Cmd::JobEnd { job_id } => Request::JobEnd { job_id: *job_id },
        Cmd::Terminate { gpu, pid, slot } => Request::TerminateClient {
            gpu: *gpu,
            pid: *pid,
            slot: *slot,
        },
        Cmd::Sim { cmd } => return sim_request(cmd),
    })
}

/// The simulator's commands (sim backend only).
fn sim_request(cmd: &SimCmd) -> Result<Request, std::process::ExitCode> {
    Ok(match cmd {
        SimCmd::Pathology {
            gpu,
            what,
            pid,
            secs,
        } => {
            let what = match serde_json::from_value(serde_json::Value::String(what.clone())) {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("mpsrctl: unknown pathology '{what}': {e}");
                    return Err(2.into());
                }
            };
            Request::SimPathology {
                gpu: *gpu,
                what,
                pid: *pid,
                secs: *secs,
            }
        }
        SimCmd::Inject {
            gpu,
            xid,
            culprit,
            slot,
        } => Request::SimInject {
            gpu: *gpu,
            xid: *xid,
            culprit: *culprit,
            slot: *slot,
        },
        SimCmd::Recover { gpu } => Request::SimRecover { gpu: *gpu },
    })
}

fn print_human(r: &Response) {
    match r {
        Response::Ok => println!("ok"),
        Response::Error { code, message } => eprintln!("mpsrctl: {code:?}: {message}"),
        Response::Status(s) => print_status(s),
        Response::Events {
            events,
            pathologies,
            events_left_out,
            pathologies_left_out,
        } => {
            for e in events {
                print_event(e);
            }
            for p in pathologies {
                println!("pathology {p}");
            }
            if events_left_out + pathologies_left_out > 0 {
                eprintln!(
                    "mpsrctl: {events_left_out} older decision(s) and {pathologies_left_out} older finding(s) left out: one reply holds at most {} bytes; ask for fewer with --limit",
                    mpsr_proto::MAX_FRAME
                );
            }
        }
        Response::Telemetry(t) => print!("{}", top::render(t)),
        Response::JobReport(j) => {
            println!("job {}: hit by {} fault(s)", j.job_id, j.faults.len());
            for e in &j.faults {
                print_event(e);
            }
            for a in &j.actions {
                println!("  {a}");
            }
            for p in &j.pathologies {
                println!("  pathology {p}");
            }
        }
        Response::Health(h) => {
            if h.healthy {
                println!("node {} healthy", h.node);
            } else {
                println!("node {} UNHEALTHY: {}", h.node, h.reasons.join("; "));
            }
        }
        Response::Registered { contexts } => {
            for c in contexts {
                println!(
                    "registered: gpu{} domain {} ({}) pipe {}",
                    c.gpu, c.domain, c.isolation, c.pipe_dir
                );
            }
        }
        Response::Injected { killed, .. } => {
            println!("injected (simulated); clients killed: {killed:?}")
        }
        other => println!("{}", serde_json::to_string(other).unwrap_or_default()),
    }
}

/// `mpsrctl status`: the node, each GPU and its fault domains, each task.
fn print_status(s: &mpsr_proto::StatusReply) {
    let sim = if s.simulated { " (SIMULATED GPUs)" } else { "" };
    println!("node {} backend {}{sim}", s.node, s.backend);
    let agent = if s.agent_version.is_empty() {
        "older than 0.2.0".to_string()
    } else {
        format!("{} protocol {}", s.agent_version, s.protocol)
    };
    println!(
        "  agent {agent}; mpsrctl {} protocol {}",
        env!("CARGO_PKG_VERSION"),
        mpsr_proto::PROTOCOL_VERSION
    );
    for g in &s.gpus {
        println!(
            "  gpu{} {} pci {} server {:?} clients {:?}{}",
            g.gpu,
            g.uuid,
            g.pci_bus_id,
            g.state,
            g.clients,
            g.unhealthy
                .as_ref()
                .map(|u| format!(" UNHEALTHY: {u}"))
                .unwrap_or_default()
        );
        for d in &g.domains {
            println!(
                "    domain {} ({}) server {:?} jobs {:?} clients {:?} memory {}{}",
                d.domain,
                d.tenancy,
                d.state,
                d.jobs,
                d.clients,
                d.memory_bytes
                    .map(|b| format!("{} MiB", b >> 20))
                    .unwrap_or_else(|| "-".into()),
                if d.fenced {
                    " FENCED: its server could not be brought back after a fault; no task is placed there"
                } else {
                    ""
                }
            );
        }
    }
    for t in &s.tasks {
        let domains: Vec<String> = t.domains.iter().map(|d| d.to_string()).collect();
        let standby = match (t.standby, t.standby_kind.unwrap_or_default()) {
            (Some((pid, d)), mpsr_proto::standby::Kind::Cold) => {
                format!(" restarts at once in {d} (cold standby: waiter pid {pid})")
            }
            (Some((pid, d)), k) => format!(" {} standby pid {pid} in {d}", k.name()),
            (None, _) => String::new(),
        };
        println!(
            "  job {} step {} pid {} uid {} gpus {:?} mode {}{} domains [{}]{standby}",
            t.job_id,
            mpsr_agent::fault::decide::step_name(t.step_id),
            t.pid,
            t.uid,
            t.gpus,
            t.mode,
            if t.batch { " batch" } else { "" },
            domains.join(" ")
        );
    }
    println!("  pending Slurm actions: {}", s.pending_actions);
    if let Some(f) = &s.persist_failing {
        println!(
            "  STATE DIR REFUSES WRITES since {} ms ago: {} (acting from memory; written once it can be)",
            mpsr_agent::sys::now_ms().saturating_sub(f.since_ms),
            f.error
        );
    }
}

fn print_event(e: &mpsr_proto::DecisionRecord) {
    println!("{e}");
}

fn top(
    a: &Args,
    timeout: Duration,
    once: bool,
    interval_s: u64,
    count: u32,
) -> std::process::ExitCode {
    let client = Client::new(&a.socket, timeout);
    let mut shown = 0;
    loop {
        match client.call(&Request::Telemetry) {
            Ok(Response::Telemetry(t)) => {
                if a.json {
                    println!("{}", serde_json::to_string(&t).unwrap_or_default());
                } else {
                    if !once && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                        print!("\x1b[2J\x1b[H");
                    }
                    print!("{}", top::render(&t));
                }
            }
            Ok(other) => {
                print_human(&other);
                return 1.into();
            }
            Err(e) => {
                eprintln!("mpsrctl: {e}");
                return 3.into();
            }
        }
        shown += 1;
        if once || (count > 0 && shown >= count) {
            return 0.into();
        }
        std::thread::sleep(Duration::from_secs(interval_s.max(1)));
    }
}

fn job_skew(
    a: &Args,
    job: u32,
    nodes: &[String],
    port: u16,
    token_file: Option<&std::path::Path>,
    timeout: Duration,
) -> std::process::ExitCode {
    let token = match token_file.map(std::fs::read_to_string).transpose() {
        Ok(t) => t.map(|t| t.lines().next().unwrap_or("").trim().to_string()),
        Err(e) => {
            eprintln!("mpsrctl: reading the token file: {e}");
            return 2.into();
        }
    };
    let nodes = if nodes.is_empty() {
        match skew::nodes_of(job, timeout) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("mpsrctl: {e} (give --nodes)");
                return 2.into();
            }
        }
    } else {
        nodes.to_vec()
    };
    let mut views = Vec::new();
    let mut errors = Vec::new();
    for n in &nodes {
        match skew::fetch(n, port, job, token.as_deref(), timeout) {
            Ok(v) => views.push(v),
            Err(e) => errors.push(e),
        }
    }
    let verdicts = skew::compare(&views);
    if a.json {
        let errs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        println!(
            "{}",
            serde_json::json!({"job": job, "ranks": verdicts, "errors": errs})
        );
    } else {
        print!("{}", skew::render(job, &verdicts, &errors));
    }
    if verdicts.iter().any(|v| v.straggler) {
        1.into()
    } else if verdicts.is_empty() && !errors.is_empty() {
        3.into()
    } else {
        0.into()
    }
}
