//! The task's standby: prepared with the agent (where it waits, the FIFO that releases it), started
//! and armed. A hot or warm one is an incarnation of the command that waits on the FIFO itself; a
//! cold one is a small process of mpsr-run's own that waits on it and exits when released, so
//! that mpsr-run starts the next incarnation at once (see `mpsr_proto::standby`).

use crate::{agent, spawn, Opts, TaskId};
use mpsr_proto::standby::{self, Kind};
use mpsr_proto::{GpuContext, Request, Response};

/// A standby that runs and is armed.
pub struct Armed {
    /// The standby's process (a cold one's: the waiter).
    pub pid: u32,
    /// The fault domain it waits for (where the task runs once it was released).
    pub context: GpuContext,
}

/// Starts a standby of `kind` for the fault domain the agent gives it, and arms it.
pub fn start(
    o: &Opts,
    t: TaskId,
    kind: Kind,
    restarts: u32,
    primary: u32,
) -> Result<Armed, String> {
    let c = agent();
    let me = std::process::id();
    let (ctx, fifo, mem) = match c.call(&Request::StandbyPrepare {
        job_id: t.job,
        step_id: t.step,
        pid: me,
        kind,
    }) {
        Ok(Response::Standby {
            context,
            release_fifo,
            mem_limit,
        }) => (context, release_fifo, mem_limit),
        Ok(Response::Error { message, .. }) => return Err(message),
        Ok(other) => return Err(format!("unexpected reply {other:?}")),
        Err(e) => return Err(e.to_string()),
    };
    let pid = match kind {
        Kind::Cold => cold_waiter(&fifo).map_err(|e| format!("cannot start its waiter: {e}"))?,
        Kind::Hot | Kind::Warm => {
            let mut env = domain_env(&ctx);
            env.extend([
                (standby::ROLE_ENV, kind.role().to_string()),
                (standby::FIFO_ENV, fifo),
            ]);
            if let Some(bytes) = mem {
                env.push((
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                    format!("0={}M", (bytes >> 20).max(1)),
                ));
            }
            spawn(o, restarts, &env).map_err(|e| format!("cannot start it: {e}"))?
        }
    };
    match c.call(&Request::StandbyArm {
        job_id: t.job,
        step_id: t.step,
        pid: me,
        primary_pid: primary,
        standby_pid: pid,
    }) {
        Ok(Response::Ok) => Ok(Armed { pid, context: ctx }),
        r => {
            crate::kill(pid, libc::SIGKILL);
            let why = match r {
                Ok(Response::Error { message, .. }) => message,
                Ok(other) => format!("unexpected reply {other:?}"),
                Err(e) => e.to_string(),
            };
            Err(format!("the agent did not arm it: {why}"))
        }
    }
}

/// The MPS environment of an incarnation whose clients use fault domain `ctx`.
pub fn domain_env(ctx: &GpuContext) -> Vec<(&'static str, String)> {
    vec![
        ("CUDA_MPS_PIPE_DIRECTORY", ctx.pipe_dir.clone()),
        ("CUDA_MPS_LOG_DIRECTORY", ctx.log_dir.clone()),
        ("MPSR_DOMAIN", ctx.domain.to_string()),
    ]
}

/// How a cold standby's waiter ends: released (one byte on its FIFO), or anything else (killed,
/// the FIFO closed without a byte, or it could not wait).
pub const RELEASED: i32 = 0;

/// Forks the process that waits on a cold standby's FIFO and exits with `RELEASED` when one byte
/// comes. A child of mpsr-run (the agent arms only a process under the task), killed with it.
fn cold_waiter(fifo: &str) -> std::io::Result<u32> {
    let path = std::ffi::CString::new(fifo)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: fork(2); the child runs only the block below.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        // SAFETY: the child calls only async-signal-safe functions (prctl, getppid, open, read,
        // _exit) on memory prepared before the fork: mpsr-run has other threads,
        // whose locks (malloc's among them) the child must not touch.
        0 => unsafe {
            // Dies with mpsr-run; a parent gone before the prctl is seen by getppid.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                libc::_exit(2);
            }
            // It keeps mpsr-run's mask (the forwarded signals blocked): a SIGUSR1 for the
            // application must not end it. mpsr-run ends it with SIGKILL.
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                libc::_exit(2);
            }
            let mut b = 0u8;
            loop {
                let n = libc::read(fd, (&mut b as *mut u8).cast(), 1);
                if n == 1 {
                    libc::_exit(RELEASED);
                }
                if n == 0 || *libc::__errno_location() != libc::EINTR {
                    libc::_exit(1);
                }
            }
        },
        pid => Ok(pid as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::process::ExitStatusExt;

    fn wait(pid: u32) -> std::process::ExitStatus {
        let mut st = 0;
        // SAFETY: st is a valid out-parameter; pid is our child.
        assert_eq!(unsafe { libc::waitpid(pid as i32, &mut st, 0) }, pid as i32);
        std::process::ExitStatus::from_raw(st)
    }

    fn fifo(d: &std::path::Path) -> String {
        let f = d.join("release");
        let c = std::ffi::CString::new(f.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        f.to_str().unwrap().to_string()
    }

    /// As the agent releases it: a non-blocking open (which needs the waiter there), one byte.
    fn release(f: &str) -> std::io::Result<()> {
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(f)?;
        std::io::Write::write_all(&mut w, b"g")
    }

    #[test]
    fn a_cold_waiter_exits_released_on_one_byte_only() {
        let d = tempfile::tempdir().unwrap();
        let f = fifo(d.path());
        let pid = cold_waiter(&f).unwrap();
        // Its open registers it as the reader: retried until the child got there.
        let t = std::time::Instant::now();
        while release(&f).is_err() {
            assert!(
                t.elapsed().as_secs() < 5,
                "the waiter never opened its FIFO"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(wait(pid).code(), Some(RELEASED));

        // A writer that goes without a byte is no release.
        let pid = cold_waiter(&f).unwrap();
        let t = std::time::Instant::now();
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&f)
            {
                Ok(w) => {
                    drop(w);
                    break;
                }
                Err(_) => assert!(t.elapsed().as_secs() < 5),
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_ne!(wait(pid).code(), Some(RELEASED));

        // No FIFO: it cannot wait.
        let pid = cold_waiter(d.path().join("none").to_str().unwrap()).unwrap();
        assert_ne!(wait(pid).code(), Some(RELEASED));
        // Killed (as the agent ends a standby): not released either.
        let pid = cold_waiter(&f).unwrap();
        crate::kill(pid, libc::SIGKILL);
        assert_eq!(wait(pid).signal(), Some(libc::SIGKILL));
    }
}
