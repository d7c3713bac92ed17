//! How the agent starts other programs. The agent blocks SIGTERM/SIGINT in all its threads (one
//! thread sigwaits for them), and a blocked mask survives fork and exec: without this, the MPS
//! control daemon, scontrol, the keepers and the simulated GPU daemon would start with SIGTERM
//! blocked and could not be stopped normally.

use std::os::unix::process::CommandExt;
use std::process::Command;

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
}
