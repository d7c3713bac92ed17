//! Leaf helpers on the operating system, used by every stage: /proc facts, starting programs with
//! a deadline, telling systemd, atomic file writes, the wall clock, poison-tolerant locks and the HTTP
//! endpoint's allow list (`http_access`). Nothing here knows about faults, jobs or GPUs.

pub mod atomic_file;
pub mod http_access;
pub mod memory;
pub mod notify;
pub mod process;
pub mod procfs;
pub mod watchdog;
pub mod worker;

use std::sync::{Mutex, MutexGuard};

/// Unix milliseconds of the wall clock (what outlives a restart: quarantine, linger).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Locks a mutex; a thread that panicked holding it must not wedge the agent: go on with the data
/// as it is.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the agent runs as root (ownership changes need it; tests run either way).
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
