//! mpsr-run: the resume supervisor for `--mps-resilient=resume`.
//!
//! `srun --mps-resilient=resume mpsr-run -- ./app args` runs `./app` as a child. When the child dies
//! abnormally, mpsr-run asks the node agent whether a GPU fault hit this task: if so, it waits until
//! the GPU's MPS server is ACTIVE again and restarts the child in place (same task, same pid for
//! Slurm), or, where the agent says so, restarts it at once in the GPU's standby domain (whose
//! server runs while the hit one recovers) and keeps it there; a culprit, a lost GPU, or a failure
//! the agent knows nothing of ends the task with the child's status. Signals are forwarded to the
//! child and stop further restarts.
//!
//! Without a hot or warm standby, where the GPU runs another domain to restart in, it keeps a
//! cold standby (`standby`): a waiter of its own on a FIFO, armed with the agent like a standby.
//! The agent releases it at the fault's decision, after ending the hit child, and mpsr-run starts
//! the next incarnation in that domain at once, instead of waiting for the old child's exit (which
//! comes only once the GPU has handled the fault).
//!
//! With a standby (`--mps-standby[=hot|warm]`: MPSR_STANDBY=1 or warm), it also runs a second
//! incarnation of the command for another fault domain, which prepares itself and waits: a hot one
//! (MPSR_ROLE=standby) in `mpsr_state_ready()` with its CUDA context made, a warm one
//! (MPSR_ROLE=warm) in `mpsr_state_before_cuda()` with none. When a fault hits the task, the agent
//! ends the primary and releases the standby, which becomes the task's process (no restart, no wait
//! for the server's recovery).

mod standby;

use mpsr_proto::standby::Kind;
use mpsr_proto::{Client, Request, Response, ResumeVerdict, BATCH_STEP};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Runs COMMAND as a child; when a GPU fault ended it, restarts it in place once the GPU is ready.
#[derive(Debug, Clone, PartialEq, clap::Parser)]
#[command(
    name = "mpsr-run",
    version,
    about = "mps-resilient resume supervisor: restarts a task hit by a GPU fault in place",
    long_about = "Runs COMMAND as a child. When it dies abnormally, asks the node agent whether a GPU fault hit this task; if so, waits until the GPU's MPS server is ACTIVE again and restarts it in place (same Slurm task). Where the GPU runs another fault domain to restart in, the restart starts at the fault's decision there, without waiting for the old child's exit (a cold standby: a waiter of mpsr-run's own, released by the agent). A culprit, a lost GPU or a failure the agent knows nothing of ends the task with the child's status. Signals are forwarded to the child and stop further restarts. The child sees MPSR_RESTARTS (0 on the first run). On Slurm >= 23.11 the plugin inserts mpsr-run itself for --mps-resilient=resume.",
    after_help = "Environment: MPSR_SOCKET (agent socket, default /run/mps-resilient/agent.sock), SLURM_JOB_ID, SLURM_STEP_ID (set by Slurm)."
)]
struct Opts {
    /// Restarts at most this many times.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=1000))]
    max_restarts: u32,
    /// Wait before the second restart (doubled for each further one, up to 64 times). The first
    /// restart after a fault goes as soon as the agent says the GPU is ready.
    #[arg(long = "backoff-ms", value_name = "MS", default_value = "100", value_parser = millis)]
    backoff: Duration,
    /// How long an abnormal exit waits for the agent to attribute it to a fault.
    #[arg(long = "settle-ms", value_name = "MS", default_value = "1500", value_parser = millis)]
    settle: Duration,
    /// How long to wait for the GPU's MPS server to be ACTIVE again.
    #[arg(long = "wait-s", value_name = "S", default_value = "120", value_parser = secs)]
    wait: Duration,
    /// After a standby took over (or a cold one restarted the task), wait this long before
    /// preparing the next one: starting a process and its CUDA context beside the task's first
    /// steps would slow them down, and the domain a cold one would use may still recover.
    #[arg(long = "standby-delay-ms", value_name = "MS", default_value = "3000", value_parser = millis)]
    standby_delay: Duration,
    /// Restart only in the task's own fault domain, once its server is ACTIVE again. Without it
    /// the agent may restart a task hit in the GPU's shared domain at once in the GPU's standby
    /// domain (when that one's server runs; the node's `[standby] restart_in_standby_domain`),
    /// where it then runs (at the fault's decision, through a cold standby): back sooner, but in
    /// another MPS server than its neighbours.
    #[arg(long)]
    same_domain: bool,
    /// The command and its arguments (after `--`, or from the first word that is not an option).
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    cmd: Vec<String>,
}

fn millis(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| format!("'{s}' is not a number of milliseconds"))
}

fn secs(s: &str) -> Result<Duration, String> {
    s.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("'{s}' is not a number of seconds"))
}

#[cfg(test)]
fn parse(args: &[String]) -> Result<Opts, clap::Error> {
    use clap::Parser;
    Opts::try_parse_from(std::iter::once("mpsr-run".to_string()).chain(args.iter().cloned()))
}

/// The task this supervisor belongs to, from Slurm's environment.
#[derive(Debug, Clone, Copy)]
struct TaskId {
    job: u32,
    step: u32,
}

fn task_from_env() -> Option<TaskId> {
    let job = std::env::var("SLURM_JOB_ID").ok()?.parse().ok()?;
    // The batch script has no SLURM_STEP_ID.
    let step = match std::env::var("SLURM_STEP_ID") {
        Ok(s) => s.parse().ok()?,
        Err(_) => BATCH_STEP,
    };
    Some(TaskId { job, step })
}

static CHILD: AtomicI32 = AtomicI32::new(0);
/// The standby, if any: termination signals reach it too.
static STANDBY: AtomicI32 = AtomicI32::new(0);
static STOPPING: AtomicI32 = AtomicI32::new(0);

/// Forwards termination signals to the child; a forwarded signal means "do not restart".
fn forward_signals() {
    let sigs = [
        libc::SIGTERM,
        libc::SIGINT,
        libc::SIGHUP,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGQUIT,
    ];
    // SAFETY: building a local sigset and blocking it in this (still single-threaded) process, so
    // only the waiter thread below receives these signals.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in sigs {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    std::thread::spawn(move || loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: set is a valid, initialized sigset; sig is a valid out-parameter.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            return;
        }
        if sig != libc::SIGUSR1 && sig != libc::SIGUSR2 {
            STOPPING.store(sig, Ordering::SeqCst);
        }
        for child in [CHILD.load(Ordering::SeqCst), STANDBY.load(Ordering::SeqCst)] {
            if child > 0 {
                // SAFETY: plain kill(2) on our own child's pid.
                unsafe { libc::kill(child, sig) };
            }
        }
    });
}

fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(s)) => 128u8.saturating_add(s as u8),
        _ => 1,
    }
}

fn agent() -> Client {
    let socket =
        std::env::var("MPSR_SOCKET").unwrap_or_else(|_| "/run/mps-resilient/agent.sock".into());
    Client::new(&socket, Duration::from_secs(2))
}

/// How long the agent may hold a "wait" verdict (it answers the moment the GPU is ready).
const HOLD: Duration = Duration::from_millis(1000);

/// What the agent said about this task's failed child.
struct Verdict {
    verdict: ResumeVerdict,
    reason: String,
    /// With `Restart`: the fault domain the task runs in from now on (its server runs while the
    /// one the fault hit recovers).
    moved_to: Option<mpsr_proto::GpuContext>,
}

fn said(verdict: ResumeVerdict, reason: String) -> Verdict {
    Verdict {
        verdict,
        reason,
        moved_to: None,
    }
}

/// Asks the agent what to do about this task's failed child.
fn verdict(o: &Opts, t: TaskId) -> Verdict {
    let client = agent();
    let mut req = Request::ResumeQuery {
        job_id: t.job,
        step_id: t.step,
        pid: std::process::id(),
        wait_ms: HOLD.as_millis() as u32,
        may_move: !o.same_domain,
    };
    let settle_until = Instant::now() + o.settle;
    let wait_until = Instant::now() + o.wait;
    loop {
        let asked = Instant::now();
        match client.call(&req) {
            Ok(Response::Resume {
                verdict,
                reason,
                moved_to,
            }) => match verdict {
                ResumeVerdict::Restart | ResumeVerdict::Fail | ResumeVerdict::TakenOver => {
                    return Verdict {
                        verdict,
                        reason,
                        moved_to,
                    }
                }
                // The fault may not have reached the agent yet: give it the settle time.
                ResumeVerdict::NotHit if Instant::now() >= settle_until => {
                    return said(verdict, reason)
                }
                ResumeVerdict::Wait if Instant::now() >= wait_until => {
                    return said(
                        ResumeVerdict::Fail,
                        format!("GPU not ready after {} s: {reason}", o.wait.as_secs()),
                    )
                }
                // The agent held the answer until it changed or its bound passed: ask again at
                // once (an agent before 0.3 answers at once: poll then).
                ResumeVerdict::Wait if asked.elapsed() >= HOLD / 2 => continue,
                _ => {}
            },
            // An agent before 0.3 refuses the fields it does not know (a rolling upgrade half
            // done): ask as before, polling, restarting in place.
            Ok(Response::Error {
                code: mpsr_proto::ErrorCode::BadRequest,
                ..
            }) if matches!(req, Request::ResumeQuery { wait_ms, .. } if wait_ms > 0) => {
                if let Request::ResumeQuery {
                    wait_ms, may_move, ..
                } = &mut req
                {
                    *wait_ms = 0;
                    *may_move = false;
                }
                continue;
            }
            Ok(Response::Error { message, .. }) => {
                return said(ResumeVerdict::NotHit, format!("agent refused: {message}"))
            }
            Ok(other) => return said(ResumeVerdict::NotHit, format!("unexpected reply {other:?}")),
            Err(e) => {
                if Instant::now() >= settle_until {
                    return said(ResumeVerdict::NotHit, e.to_string());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts one incarnation of the command: the primary (in the task's own MPS context), or with
/// `env` a standby's.
fn spawn(o: &Opts, restarts: u32, env: &[(&str, String)]) -> std::io::Result<u32> {
    let mut cmd = Command::new(&o.cmd[0]);
    cmd.args(&o.cmd[1..])
        .env("MPSR_RESTARTS", restarts.to_string())
        .env(mpsr_proto::standby::ROLE_ENV, "primary");
    for (k, v) in env {
        cmd.env(k, v);
    }
    // SAFETY: only sigemptyset/sigprocmask (async-signal-safe) between fork and exec. The
    // forwarded signals are blocked here (sigwait); the application must get them.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    // Reaped by `wait_any`, not through the Child.
    cmd.spawn().map(|c| c.id())
}

fn kill(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2) on one of our own children.
    unsafe { libc::kill(pid as i32, sig) };
}

/// Waits for any child, until `until` at most (None: for good); its pid and status, or None when
/// the time came first.
fn wait_any(until: Option<Instant>) -> std::io::Result<Option<(u32, std::process::ExitStatus)>> {
    use std::os::unix::process::ExitStatusExt;
    loop {
        let mut st: libc::c_int = 0;
        let flags = if until.is_some() { libc::WNOHANG } else { 0 };
        // SAFETY: st is a valid out-parameter.
        let pid = unsafe { libc::waitpid(-1, &mut st, flags) };
        if pid > 0 {
            return Ok(Some((pid as u32, std::process::ExitStatus::from_raw(st))));
        }
        if pid == 0 {
            // WNOHANG: nobody exited yet.
            match until {
                Some(t) if Instant::now() >= t => return Ok(None),
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
            continue;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn main() -> ExitCode {
    mpsr_manpage::print_if_asked(<Opts as clap::CommandFactory>::command());
    // clap prints usage errors (exit 2) and --help/--version (exit 0) itself.
    let o = <Opts as clap::Parser>::parse();
    let task = task_from_env();
    if task.is_none() {
        eprintln!("mpsr-run: not inside a Slurm job (no SLURM_JOB_ID): running without resume");
    }
    // `--mps-standby[=KIND]` (the plugin sets MPSR_STANDBY=1 or warm): keep a standby of the
    // command. Without one, a cold standby (nothing started ahead: the next incarnation starts
    // at the fault's decision) wherever the task may restart in another domain.
    let wanted = std::env::var(mpsr_proto::standby::WANTED_ENV)
        .ok()
        .and_then(|v| Kind::from_env_value(&v));
    let mut kind = wanted.unwrap_or(Kind::Cold);
    let mut cold = kind == Kind::Cold;
    // A hot or warm standby refused or gone: a cold one still starts the restart at the decision
    // (where the task may move).
    let fall_back = |kind: &mut Kind, cold: &mut bool| {
        let to_cold = !*cold && !o.same_domain;
        if to_cold {
            *kind = Kind::Cold;
            *cold = true;
        }
        to_cold
    };
    let standby_allowed = task.is_some() && (wanted.is_some() || !o.same_domain);
    let mut standby_wanted = standby_allowed;
    forward_signals();
    let mut restarts = 0u32;
    let mut primary: Option<u32> = None;
    let mut standby: Option<standby::Armed> = None;
    // The primary's MPS environment when the task was restarted in another fault domain than the
    // one Slurm's environment names (empty: that one).
    let mut home: Vec<(&'static str, String)> = Vec::new();
    // When the next standby may start: at once, or a while after a takeover (starting a process
    // and its CUDA context beside the task's first steps would slow them down).
    let mut standby_due = Instant::now();
    let mut started = Instant::now();
    loop {
        let p = match primary {
            Some(p) => p,
            None => {
                started = Instant::now();
                match spawn(&o, restarts, &home) {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("mpsr-run: cannot start {}: {e}", o.cmd[0]);
                        return ExitCode::from(127);
                    }
                }
            }
        };
        primary = Some(p);
        CHILD.store(p as i32, Ordering::SeqCst);
        // A cold standby's release restarts the task: not once the limit is reached.
        let may_arm = !cold || restarts < o.max_restarts;
        if let (true, true, None, Some(t)) = (standby_wanted, may_arm, &standby, task) {
            if Instant::now() >= standby_due {
                match standby::start(&o, t, kind, restarts, p) {
                    Ok(s) => standby = Some(s),
                    Err(e) => {
                        // A cold one is refused where the GPU has no other domain to restart
                        // in (most nodes): nothing to tell the user, the restart waits as before.
                        if !cold {
                            eprintln!(
                                "mpsr-run: no {} standby ({e}); a fault restarts the task instead",
                                kind.name()
                            );
                        }
                        standby_wanted = fall_back(&mut kind, &mut cold);
                    }
                }
            }
        }
        // A cold standby's waiter is no incarnation of the command: signals are not for it.
        let incarnation = standby.as_ref().filter(|_| !cold);
        STANDBY.store(incarnation.map_or(0, |s| s.pid as i32), Ordering::SeqCst);
        // A stop signal that came before CHILD was set was not forwarded: forward it now.
        let pending = STOPPING.load(Ordering::SeqCst);
        if pending != 0 {
            kill(p, pending);
            incarnation.inspect(|s| kill(s.pid, pending));
        }
        let until = (standby_wanted && may_arm && standby.is_none()).then_some(standby_due);
        let (pid, status) = match wait_any(until) {
            Ok(None) => continue, // time for the standby
            Ok(Some(done)) => done,
            Err(e) => {
                eprintln!("mpsr-run: waiting for {}: {e}", o.cmd[0]);
                return ExitCode::from(1);
            }
        };
        if Some(pid) != primary {
            let Some(s) = standby.as_ref().filter(|s| s.pid == pid) else {
                // An incarnation the agent ended at a cold standby's release, gone now.
                continue;
            };
            let released = cold && status.code() == Some(standby::RELEASED);
            let confirmed = match (released, task) {
                (true, Some(t)) => {
                    let v = verdict(&o, t);
                    (v.verdict == ResumeVerdict::TakenOver).then_some(v.reason)
                }
                _ => None,
            };
            let context = s.context.clone();
            standby = None;
            STANDBY.store(0, Ordering::SeqCst);
            match confirmed {
                Some(reason) => {
                    // The agent ended the primary and moved the task: start the next
                    // incarnation now, while the hit server still recovers.
                    if let Some(old) = primary.take() {
                        // Already SIGKILLed by the agent: a byte from anyone else must not
                        // leave two incarnations running.
                        kill(old, libc::SIGKILL);
                    }
                    CHILD.store(0, Ordering::SeqCst);
                    restart_at_once(&o, &mut restarts, &mut home, &context, &reason, started);
                    standby_due = Instant::now() + o.standby_delay;
                }
                None if cold => standby_wanted = false,
                None => {
                    eprintln!(
                        "mpsr-run: the {} standby (pid {pid}) ended before any fault (status {}); a fault restarts the task instead",
                        kind.name(),
                        exit_code(status)
                    );
                    standby_wanted = fall_back(&mut kind, &mut cold);
                }
            }
            continue;
        }
        primary = None;
        CHILD.store(0, Ordering::SeqCst);
        let code = exit_code(status);
        let end_standby = |standby: Option<standby::Armed>| {
            if let Some(s) = standby {
                kill(s.pid, libc::SIGKILL);
                // SAFETY: waitpid(2) reaping our own child; a null status pointer is allowed.
                unsafe { libc::waitpid(s.pid as i32, std::ptr::null_mut(), 0) };
            }
        };
        if status.success() || STOPPING.load(Ordering::SeqCst) != 0 {
            end_standby(standby);
            return ExitCode::from(code);
        }
        let Some(t) = task else {
            return ExitCode::from(code);
        };
        let Verdict {
            verdict: v,
            reason,
            moved_to,
        } = verdict(&o, t);
        match v {
            ResumeVerdict::TakenOver if cold => {
                // The cold standby was released (its waiter is gone or goes now): the next
                // incarnation starts in its domain.
                let Some(s) = standby.take() else {
                    eprintln!("mpsr-run: {reason}, but no cold standby is known here; exiting with status {code}");
                    return ExitCode::from(code);
                };
                restart_at_once(&o, &mut restarts, &mut home, &s.context, &reason, started);
                end_standby(Some(s));
                standby_due = Instant::now() + o.standby_delay;
            }
            ResumeVerdict::TakenOver => {
                // The standby is the task's process now; a new standby is prepared for it.
                primary = standby.take().map(|s| s.pid);
                standby_due = Instant::now() + o.standby_delay;
                eprintln!(
                    "mpsr-run: a GPU fault hit the task ({reason}); its {} standby took over",
                    kind.name()
                );
            }
            ResumeVerdict::Restart if restarts < o.max_restarts => {
                end_standby(standby.take());
                restarts += 1;
                standby_wanted = standby_allowed && (cold || standby_wanted);
                if let Some(ctx) = &moved_to {
                    home = standby::domain_env(ctx);
                }
                // The agent said the GPU is ready: the first restart goes at once; later ones
                // back off (a task that faults again and again must not spin).
                let backoff = match restarts {
                    1 => Duration::ZERO,
                    n => o.backoff * 2u32.saturating_pow(n - 2).min(64),
                };
                let domain = moved_to
                    .as_ref()
                    .map(|c| format!(", its clients in {} from now on", c.domain))
                    .unwrap_or_default();
                eprintln!(
                    "mpsr-run: child exited with status {code} after {:.1} s; {reason}; restarting in place ({restarts}/{}){domain}",
                    started.elapsed().as_secs_f64(),
                    o.max_restarts
                );
                std::thread::sleep(backoff);
            }
            ResumeVerdict::Restart => {
                end_standby(standby);
                eprintln!(
                    "mpsr-run: {reason}, but the restart limit ({}) is reached; exiting with status {code}",
                    o.max_restarts
                );
                return ExitCode::from(code);
            }
            ResumeVerdict::Fail => {
                end_standby(standby);
                eprintln!("mpsr-run: not restarting: {reason}; exiting with status {code}");
                return ExitCode::from(code);
            }
            ResumeVerdict::Wait | ResumeVerdict::NotHit => {
                end_standby(standby);
                // Its own failure, not a GPU fault of someone else's: nothing to resume.
                return ExitCode::from(code);
            }
        }
    }
}

/// A cold standby was released: the task restarts at once in its domain (counted as a restart;
/// no back-off: the agent released it for a fault of someone else's).
fn restart_at_once(
    o: &Opts,
    restarts: &mut u32,
    home: &mut Vec<(&'static str, String)>,
    to: &mpsr_proto::GpuContext,
    reason: &str,
    started: Instant,
) {
    *restarts += 1;
    *home = standby::domain_env(to);
    eprintln!(
        "mpsr-run: child hit after {:.1} s; {reason}; restarting in place ({restarts}/{}) at once, its clients in {} from now on",
        started.elapsed().as_secs_f64(),
        o.max_restarts,
        to.domain
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options() {
        let o = parse(&a(&["--max-restarts", "5", "--", "app", "--x"])).unwrap();
        assert_eq!(o.max_restarts, 5);
        assert_eq!(o.cmd, a(&["app", "--x"]));
        let o = parse(&a(&["app", "-v"])).unwrap();
        assert_eq!(o.cmd, a(&["app", "-v"]));
        assert_eq!(o.backoff, Duration::from_millis(100));
        let o = parse(&a(&["--wait-s", "7", "--settle-ms", "20", "app"])).unwrap();
        assert_eq!(
            (o.wait, o.settle),
            (Duration::from_secs(7), Duration::from_millis(20))
        );
        assert!(parse(&a(&[])).is_err());
        assert!(parse(&a(&["--max-restarts", "1001", "a"])).is_err());
        assert!(parse(&a(&["--"])).is_err());
        assert!(parse(&a(&["--max-restarts"])).is_err());
        assert!(parse(&a(&["--max-restarts", "x", "--", "a"])).is_err());
        assert!(parse(&a(&["--bogus", "--", "a"])).is_err());
        assert!(!parse(&a(&["app"])).unwrap().same_domain);
        assert!(parse(&a(&["--same-domain", "app"])).unwrap().same_domain);
    }
}
