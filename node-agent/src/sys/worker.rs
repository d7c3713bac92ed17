//! Worker threads that cannot die silently. A worker is a loop the agent depends on (the Slurm
//! worker requeues and drains, the fault worker decides): if one panicked and the agent went on,
//! no job of any user would be requeued from then on (seen: a forged restart count overflowed in
//! the Slurm worker). So a panicking worker ends the agent with a non-zero status, and systemd
//! (`Restart=on-failure`) starts it again from its durable state.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Exit status of an agent ended by a worker's panic (EX_SOFTWARE).
pub const PANIC_EXIT: i32 = 70;

/// Runs `work`; if it panics, `on_panic` gets the worker's name and the panic's message.
pub fn guarded(name: &str, work: impl FnOnce(), on_panic: impl FnOnce(&str, &str)) {
    if let Err(p) = catch_unwind(AssertUnwindSafe(work)) {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        on_panic(name, &msg);
    }
}

/// What the agent does when a worker panicked: says so and exits for systemd to restart it.
pub fn exit_on_panic(name: &str, msg: &str) {
    tracing::error!(
        worker = name,
        panic = msg,
        "agent worker panicked; exiting for a restart from the durable state"
    );
    eprintln!("mpsr-agent: worker {name} panicked: {msg}; exiting ({PANIC_EXIT})");
    std::process::exit(PANIC_EXIT);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_worker_is_reported_never_swallowed() {
        let mut seen = None;
        guarded(
            "slurm",
            || {
                let n: u32 = u32::MAX;
                let _ = n.checked_add(1).expect("restart count overflow");
            },
            |name, msg| seen = Some((name.to_string(), msg.to_string())),
        );
        assert_eq!(
            seen,
            Some(("slurm".into(), "restart count overflow".into()))
        );
        let mut called = false;
        guarded("persist", || {}, |_, _| called = true);
        assert!(!called, "a worker that returns is no panic");
    }
}
