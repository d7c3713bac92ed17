//! slurmstepd (remote) context: find the step's GPUs, register each task with the agent (which
//! places it in a fault domain: an MPS server of the GPU), put that domain's MPS client context
//! into the task's environment, deregister it at exit. The GPUs' shared contexts fetched in
//! user_init are the fallback when the agent is unreachable.
//!
//! Call order in slurmstepd: init -> user_init (once per step, euid = user) -> per task, in the
//! forked task process: task_init_privileged (root) -> task_init (user) -> exec; in slurmstepd:
//! task_exit. The task process inherits what user_init stored, so contexts are fetched once per
//! step. Errors are kept and returned by task_init (fails the job, never drains the node).

use crate::agent::{self, AgentError};
use crate::config::{self, PlugConfig};
use crate::gpus;
use crate::options::{self, OptValues, OPT_ISOLATION, OPT_MEM, OPT_MODE, OPT_STANDBY, OPT_THREADS};
use crate::sys::{self, Spank};
use mpsr_proto::{ErrorCode, GpuContext, Isolation, Mode, Registration, BATCH_STEP};
use std::sync::Mutex;

/// Steps that are not user work: the extern step (job containment) and interactive steps.
const EXTERN_STEP: u32 = 0xffff_fffc;
const INTERACTIVE_STEP: u32 = 0xffff_fffa;

/// A protected step, as found by user_init.
#[derive(Debug, Clone)]
struct Protected {
    cfg: PlugConfig,
    job_id: u32,
    step_id: u32,
    uid: u32,
    mode: Mode,
    /// A batch job (Slurm can requeue it): the batch step, or a step run from a batch script.
    batch_job: bool,
    restart_count: u32,
    gpus: Vec<u32>,
    contexts: Vec<GpuContext>,
    threads: Option<u8>,
    mem: Option<u64>,
    isolation: Option<Isolation>,
    /// `--mps-standby[=KIND]` (resume mode): mpsr-run keeps a standby of each task.
    standby: Option<mpsr_proto::standby::Kind>,
}

#[derive(Debug, Default)]
struct StepState {
    protected: Option<Protected>,
    /// Fails the job in task_init with this message.
    error: Option<String>,
    /// Printed on the task's stderr by task_init; the job runs on.
    warning: Option<String>,
}

static STEP: Mutex<StepState> = Mutex::new(StepState {
    protected: None,
    error: None,
    warning: None,
});

fn step() -> std::sync::MutexGuard<'static, StepState> {
    STEP.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn init(sp: Spank, args: &[String]) -> i32 {
    if let Err(e) = config::load(args) {
        // Failing init here would drain the node for a batch job: defer to task_init.
        sys::log_error(&e.to_string());
        step().error = Some(e.to_string());
    }
    for o in &options::OPTIONS {
        if let Err(e) = sp.register_option(o) {
            sys::log_error(&format!("cannot register option: {e}"));
        }
    }
    0
}

/// The options as given to this job (slurmstepd learns them from srun/sbatch).
fn job_options(sp: Spank) -> Result<OptValues, String> {
    let mut v = OptValues::default();
    for val in [OPT_MODE, OPT_THREADS, OPT_MEM, OPT_ISOLATION, OPT_STANDBY] {
        match sp.getopt(options::entry(val)) {
            Ok(Some(arg)) => v.apply(val, arg.as_deref())?,
            Ok(None) => {}
            Err(e) => return Err(format!("reading options: {e}")),
        }
    }
    Ok(v)
}

/// Unreachable agent: fail the job or run it unprotected, per `required_agent`.
fn agent_problem(st: &mut StepState, cfg: &PlugConfig, what: &str, e: AgentError) {
    let msg = format!("{what}: {e}");
    sys::log_error(&msg);
    if cfg.required_agent {
        st.error = Some(format!(
            "{msg} (required_agent=yes, so the job is not started)"
        ));
    } else {
        st.warning = Some(format!(
            "WARNING: {msg}; this job runs WITHOUT GPU fault protection"
        ));
    }
}

/// This node's Slurm name. slurmd exports SLURMD_NODENAME into its own environment, which
/// slurmstepd inherits; the job's environment may carry a stale one (a step started from a batch
/// script on another node), so it is not used. SLURM_TOPOLOGY_ADDR ends with the node name.
fn node_name(sp: Spank) -> String {
    std::env::var("SLURMD_NODENAME")
        .ok()
        .filter(|v| !v.is_empty())
        .or_else(|| {
            sp.getenv("SLURM_TOPOLOGY_ADDR")
                .ok()
                .flatten()
                .and_then(|a| a.rsplit('.').next().map(String::from))
        })
        .unwrap_or_default()
}

pub fn user_init(sp: Spank) {
    let mut st = step();
    if st.error.is_some() {
        return;
    }
    let opts = match job_options(sp) {
        Ok(o) => o,
        Err(e) => {
            st.error = Some(e);
            return;
        }
    };
    if !opts.enabled() {
        return; // not asked for: leave the job alone
    }
    let node = node_name(sp);
    let cfg = match config::loaded() {
        Ok(c) => c.for_node(&node),
        Err(e) => {
            st.error = Some(e.to_string());
            return;
        }
    };
    let ids = (sp.job_id(), sp.step_id(), sp.job_uid());
    let (Ok(job_id), Ok(step_id), Ok(uid)) = ids else {
        st.error = Some(format!("cannot read job/step/uid from Slurm: {ids:?}"));
        return;
    };
    if step_id == EXTERN_STEP || step_id == INTERACTIVE_STEP {
        return;
    }
    let mode = opts.mode(cfg.default_mode).unwrap_or(cfg.default_mode);
    let gpus = match gpus::from_env(|k| sp.getenv(k).ok().flatten()) {
        Ok((g, _)) if g.is_empty() => {
            st.error = Some(
                format!(
                    "--mps-resilient needs GPUs, but this step has none (ask for --gres=gpu:N, --gres=shard:N or --gres=mps:N; looked at {})",
                    gpus::SOURCES.join(", ")
                ),
            );
            return;
        }
        Ok((g, _)) => g,
        Err(e) => {
            st.error = Some(e.to_string());
            return;
        }
    };
    let contexts = match agent::gpu_contexts(&cfg, &gpus) {
        Ok(c) => c,
        Err(e) => {
            agent_problem(
                &mut st,
                &cfg,
                "cannot get MPS contexts from the node agent",
                e,
            );
            return;
        }
    };
    sys::log_verbose(&format!(
        "job {job_id} step {step_id}: mode {mode}, GPUs {gpus:?}"
    ));
    let cfg_isolation = cfg.isolation;
    st.protected = Some(Protected {
        cfg,
        job_id,
        step_id,
        uid,
        mode,
        // Slurm sets ENVIRONMENT=BATCH in a batch script; srun passes it on to the steps it runs.
        batch_job: step_id == BATCH_STEP
            || sp.getenv("ENVIRONMENT").ok().flatten().as_deref() == Some("BATCH"),
        restart_count: restart_count(sp),
        gpus,
        contexts,
        // gres/mps (--gres=mps:N): Slurm set the percentage in the job's environment; it is the
        // default of a domain of the job's own, as --mps-threads is.
        threads: opts.threads.or_else(|| {
            sp.getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
                .ok()
                .flatten()
                .and_then(|v| options::parse_threads(&v).ok())
        }),
        mem: opts.mem,
        isolation: opts.isolation.or(cfg_isolation),
        standby: opts.standby.filter(|_| mode == Mode::Resume),
    });
    if opts.standby.is_some() && mode != Mode::Resume {
        st.warning = Some(format!(
            "note: --mps-standby works in resume mode only; this job's mode is {mode}: no standby"
        ));
    }
}

/// Slurm's restart count of this run of the job. The SPANK item reads 0 in the batch step of a
/// requeued job on Slurm 22.05, while the job's environment carries the true count
/// (`SLURM_RESTART_COUNT`): the larger of the two. A wrong 0 would make the agent take a second
/// run for the first, whose requeue is done, and leave it unrequeued when hit.
fn restart_count(sp: Spank) -> u32 {
    let item = sp.restart_count().unwrap_or(0);
    let env = sp
        .getenv("SLURM_RESTART_COUNT")
        .ok()
        .flatten()
        .and_then(|v| v.trim().parse::<u16>().ok())
        .map_or(0, u32::from);
    // The environment is the user's: Slurm keeps the count in 16 bits, so anything larger is
    // ignored, and the agent lets the prolog's count (slurmd's) win over this one.
    item.max(env)
}

pub fn task_init_privileged(sp: Spank) {
    let mut st = step();
    let Some(p) = st.protected.clone() else {
        return;
    };
    let task = sp.task_id().unwrap_or(0).max(0) as u32;
    let Some(i) = gpus::for_task(&p.gpus, task) else {
        return;
    };
    let reg = Registration {
        job_id: p.job_id,
        step_id: p.step_id,
        // This is the task process itself; exec keeps the pid.
        pid: std::process::id(),
        uid: Some(p.uid),
        gpus: vec![p.gpus[i]],
        mode: p.mode,
        batch: p.batch_job,
        threads_pct: p.threads,
        mem_limit: p.mem,
        restart_count: p.restart_count,
        isolation: p.isolation,
    };
    let ctx = match agent::register(&p.cfg, reg) {
        Ok(c) => c
            .into_iter()
            .next()
            .unwrap_or_else(|| p.contexts[i].clone()),
        Err(AgentError::Refused {
            code: ErrorCode::Refused,
            message,
        }) => {
            // The admin's policy (isolation not allowed, GPU full): never run it otherwise.
            st.error = Some(format!("the node agent refused this job: {message}"));
            return;
        }
        Err(e) => {
            agent_problem(
                &mut st,
                &p.cfg,
                "cannot register the task with the node agent",
                e,
            );
            p.contexts[i].clone()
        }
    };
    let mut env = vec![
        ("CUDA_MPS_PIPE_DIRECTORY", ctx.pipe_dir.clone()),
        ("CUDA_MPS_LOG_DIRECTORY", ctx.log_dir.clone()),
        // The GPU's MPS server sees only that GPU: to its clients it is device 0.
        ("CUDA_VISIBLE_DEVICES", "0".to_string()),
        ("MPSR_GPU", ctx.gpu.to_string()),
        ("MPSR_MODE", p.mode.to_string()),
        ("MPSR_ISOLATION", ctx.isolation.to_string()),
        ("MPSR_DOMAIN", ctx.domain.to_string()),
        ("MPSR_SOCKET", p.cfg.agent_socket.display().to_string()),
    ];
    if let Some(k) = &ctx.keeper_socket {
        env.push(("MPSR_KEEPER_SOCKET", k.clone()));
    }
    match p.standby {
        // "1": what mpsr-run of 0.2 reads as a hot standby (a job may run an older one).
        Some(mpsr_proto::standby::Kind::Hot) => {
            env.push((mpsr_proto::standby::WANTED_ENV, "1".to_string()))
        }
        Some(mpsr_proto::standby::Kind::Warm) => {
            env.push((mpsr_proto::standby::WANTED_ENV, "warm".to_string()))
        }
        // Not an option users give: mpsr-run keeps one by itself.
        Some(mpsr_proto::standby::Kind::Cold) | None => {}
    }
    if let Some(t) = p.threads {
        env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", t.to_string()));
    }
    if let Some(m) = p.mem {
        env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", gpus::mem_limit_env(m)));
    }
    for (k, v) in &env {
        if let Err(e) = sp.setenv(k, v) {
            st.error = Some(format!("cannot set {k} for the task: {e}"));
            return;
        }
    }
    if p.gpus.len() > 1 && sp.local_task_count().unwrap_or(1) < p.gpus.len() as u32 {
        st.warning = Some(format!(
            "note: each task uses one GPU (one MPS server per GPU); task {task} uses GPU {} of {:?}. Run one task per GPU to use them all.",
            ctx.gpu, p.gpus
        ));
    }
}

/// Whether the task is in resume mode and does not already run under mpsr-run.
fn needs_supervisor(sp: Spank, p: &Protected) -> bool {
    if p.mode != Mode::Resume {
        return false;
    }
    let argv = sp.job_argv().unwrap_or_default();
    let first = argv
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_string());
    first.as_deref() != Some("mpsr-run")
}

/// Resume mode needs the supervisor in front of the task. From Slurm 23.11 the plugin puts it there
/// (unless the user already did); older Slurm has no way to, so users write `mpsr-run --` themselves.
#[cfg(mpsr_have_prepend_argv)]
fn supervise(sp: Spank, p: &Protected) -> Option<String> {
    if !needs_supervisor(sp, p) {
        return None;
    }
    let sup = p.cfg.supervisor.display().to_string();
    match sp.prepend_task_argv(&[sup.as_str(), "--"]) {
        Ok(()) => None,
        Err(e) => Some(format!(
            "cannot put {sup} in front of the task ({e}); it runs without in-place resume"
        )),
    }
}

#[cfg(not(mpsr_have_prepend_argv))]
fn supervise(sp: Spank, p: &Protected) -> Option<String> {
    needs_supervisor(sp, p).then(|| {
        "note: resume mode restarts a task in place only under the supervisor: run `mpsr-run -- COMMAND` (this Slurm is older than 23.11 and cannot add it)".to_string()
    })
}

pub fn task_init(sp: Spank) -> i32 {
    let note = step().protected.clone().and_then(|p| supervise(sp, &p));
    if let Some(n) = note {
        eprintln!("mps-resilient: {n}");
    }
    let st = step();
    if let Some(w) = &st.warning {
        // The task's stderr is the job's stderr by now.
        eprintln!("mps-resilient: {w}");
    }
    if let Some(e) = &st.error {
        sys::log_error(e);
        eprintln!("mps-resilient: error: {e}");
        return -1;
    }
    0
}

pub fn task_exit(sp: Spank) {
    let st = step();
    let Some(p) = &st.protected else { return };
    let Ok(pid) = sp.task_pid() else { return };
    let status = sp.task_exit_status().ok();
    if let Err(e) = agent::deregister(&p.cfg, p.job_id, p.step_id, pid as u32, status) {
        // Not fatal: the agent also notices dead pids and the epilog ends the job.
        sys::log_verbose(&format!("deregister task {pid}: {e}"));
    }
}
