//! How the agent starts other programs: with a clean signal mask, and (`run_bounded`) with a
//! hard deadline. The agent blocks SIGTERM/SIGINT in all its threads (one
//! thread sigwaits for them), and a blocked mask survives fork and exec: without this, the MPS
//! control daemon, scontrol, the keepers and the simulated GPU daemon would start with SIGTERM
//! blocked and could not be stopped normally.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Child starts with no blocked signals; with `new_session`, in its own session (a daemon that
/// must outlive the agent and not get signals meant for the agent's process group).
pub fn prepare(c: &mut Command, new_session: bool) {
    // SAFETY: only async-signal-safe calls (sigemptyset, sigprocmask, setsid) between fork and exec.
    unsafe {
        c.pre_exec(move || {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            if new_session {
                libc::setsid();
            }
            Ok(())
        });
    }
}

/// Why a command run by the agent gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot run {binary}: {source}")]
    Spawn {
        binary: String,
        source: std::io::Error,
    },
    #[error("`{command}` timed out after {ms} ms")]
    Timeout { command: String, ms: u128 },
    #[error("`{command}` failed: {output}")]
    Failed { command: String, output: String },
}

/// Runs a command with optional stdin and a hard deadline: past it, the command and everything
/// it started are killed (it runs in a process group of its own; a wrapper's child, e.g. a
/// `timeout` or `chroot` around scontrol, would otherwise run on holding the pipes).
pub fn run_bounded(
    mut c: Command,
    stdin: Option<&str>,
    timeout: Duration,
    what: &str,
) -> Result<(bool, String), RunError> {
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let binary = format!("{:?}", c.get_program());
    prepare(&mut c, false);
    c.process_group(0);
    let mut child = c
        .spawn()
        .map_err(|source| RunError::Spawn { binary, source })?;
    if let (Some(input), Some(mut si)) = (stdin, child.stdin.take()) {
        let _ = si.write_all(input.as_bytes());
        let _ = si.write_all(b"\n");
    }
    // Readers on threads so a chatty child cannot block on a full pipe while we wait.
    let mut so = child.stdout.take();
    let mut se = child.stderr.take();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = so.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = se.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() >= deadline => {
                // SAFETY: kill(2) on the child's own process group (its pgid is its pid, set at
                // spawn); no memory is touched.
                unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
                let _ = child.kill();
                let _ = child.wait();
                return Err(RunError::Timeout {
                    command: what.into(),
                    ms: timeout.as_millis(),
                });
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                return Err(RunError::Failed {
                    command: what.into(),
                    output: e.to_string(),
                })
            }
        }
    };
    // A daemonizing child may leave its pipes open in the grandchild; do not wait for them forever.
    let out = join_bounded(t_out, Duration::from_millis(200));
    let err = join_bounded(t_err, Duration::from_millis(200));
    let text = if err.trim().is_empty() {
        out
    } else {
        format!("{out}{err}")
    };
    Ok((status.success(), text.trim().to_string()))
}

fn join_bounded(h: std::thread::JoinHandle<String>, wait: Duration) -> String {
    let deadline = Instant::now() + wait;
    while !h.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    if h.is_finished() {
        h.join().unwrap_or_default()
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_start_with_an_empty_signal_mask() {
        // Block SIGTERM in this thread like the agent does, then look at a child's mask.
        // SAFETY: local sigset; pthread_sigmask on this test thread only.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        let mut c = Command::new("sh");
        c.args(["-c", "grep SigBlk /proc/self/status"]);
        prepare(&mut c, false);
        let out = String::from_utf8(c.output().unwrap().stdout).unwrap();
        assert!(out.trim().ends_with("0000000000000000"), "{out}");
    }

    /// Dead or a zombie (an orphan's reaper may be slow, or absent in a container).
    fn gone(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(s) => s
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z')),
        }
    }

    /// A command past its deadline is killed with what it started: a wrapper's child (here a
    /// sleep the shell waits for) does not run on. Before, only the direct child was killed.
    #[test]
    fn a_timeout_kills_the_command_and_its_children() {
        let dir = std::env::temp_dir().join(format!("mpsr-pg-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let f = dir.join("pid");
        let mut c = Command::new("sh");
        c.args(["-c", &format!("sleep 30 & echo $! > {}; wait", f.display())]);
        let r = run_bounded(c, None, Duration::from_millis(300), "sh");
        assert!(matches!(r, Err(RunError::Timeout { .. })), "{r:?}");
        let pid: i32 = std::fs::read_to_string(&f).unwrap().trim().parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gone(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone(pid), "the command's child {pid} still runs");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
