//! A hot standby takes over a hit task: the old incarnation is ended (SIGKILL), the standby's FIFO
//! gets its one byte, and the task is recorded as running in the standby's domain. Run on the
//! fault worker right after the decision: this is the latency a hit task feels (the restart path
//! waits for the faulted server to recover and a new process to start).
//!
//! Ordering: the primary and its descendants (read from the kernel's children lists: a few reads)
//! are killed before the release is written. SIGKILL is delivered, not awaited: a primary hit by
//! the fault cannot write GPU memory any more (its context is poisoned); what it could still do on
//! the host in the moment it takes to die is the application's to make idempotent (README).

use crate::store::registry::TaskKey;
use crate::store::state::Standby;
use crate::store::state::Takeover;
use crate::store::Store;
use crate::sys::procfs;
use mpsr_proto::FaultOutcome;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::time::Instant;

/// A standby to release, with what fences the old incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub fault_id: u64,
    pub task: TaskKey,
    pub standby: Standby,
    /// When the fault's first signal came (the takeover is timed from it).
    pub first: Instant,
}

/// Releases the standby of a hit task (see the module's comment); records what came of it.
pub fn release_standby(store: &Store, r: Release) {
    let Some(armed) = r.standby.armed else {
        return;
    };
    let (primary, primary_ticks) = armed.primary;
    let (standby, standby_ticks) = armed.standby;
    // The old incarnation and its children (a shell's command, a launcher's workers), found
    // before it dies: its orphans would be the init process's children after.
    let family = procfs::alive(primary, primary_ticks)
        .then(|| procfs::descendants(primary))
        .flatten();
    // Known by pid and start time: while they linger, they are this fault's hit clients.
    let mut ended: Vec<(u32, Option<u64>)> = vec![(primary, primary_ticks)];
    ended.extend(
        family
            .iter()
            .flatten()
            .map(|p| (*p, procfs::start_ticks(*p))),
    );
    let fenced = kill_if_alive(primary, primary_ticks);
    for p in family.iter().flatten() {
        kill_if_alive(*p, None);
    }
    let released = procfs::alive(standby, standby_ticks) && write_release(&r.standby.fifo);
    let ms = r.first.elapsed().as_secs_f64() * 1000.0;
    if family.is_none() {
        // No children lists in this kernel: a scan of /proc, once the standby runs.
        for p in procfs::under(&[primary]) {
            kill_if_alive(p, None);
        }
    }
    let _ = std::fs::remove_file(&r.standby.fifo);
    let (job, step, pid) = r.task;
    let gpu = r.standby.domain.gpu;
    let cold = r.standby.kind == mpsr_proto::standby::Kind::Cold;
    let mut st = store.lock();
    let hit_domain = st
        .durable
        .registry
        .get(r.task)
        .and_then(|t| t.domain_on(gpu))
        .unwrap_or(mpsr_proto::DomainId::shared(gpu));
    let o = match (released, cold) {
        // A cold standby is the supervisor's word to start the next incarnation: a restart.
        (true, true) => FaultOutcome::RestartedElsewhere {
            job,
            step,
            from: hit_domain,
            domain: r.standby.domain,
        },
        (true, false) => FaultOutcome::StandbyTookOver {
            job,
            step,
            standby,
            primary,
            primary_ended: fenced,
            released_us: (ms * 1000.0) as u64,
        },
        (false, _) => FaultOutcome::StandbyGone { job, step, standby },
    };
    tracing::info!(
        fault_id = r.fault_id,
        job,
        pid,
        standby,
        released,
        ms,
        primary_ended = fenced,
        kind = r.standby.kind.name(),
        "{o}"
    );
    if let Some(e) = st.durable.resume.get_mut(r.task) {
        e.takeover = Some(if released {
            Takeover::Released(standby)
        } else {
            Takeover::Unavailable
        });
    }
    if let Some(rec) = st.recovering.get_mut(&hit_domain) {
        rec.fenced_pids.extend(ended);
    }
    if released {
        if !cold {
            st.totals.entry(gpu).or_default().takeovers += 1;
        }
        st.move_task(r.fault_id, r.task, r.standby.domain);
    }
    store.record(&mut st, r.fault_id, Some(job), o);
    drop(st);
    store.mark_dirty();
    store.recovery_changed();
}

/// Ends a standby whose own server faulted (poisoned: it would hold that server in FAULT).
pub fn end_standby(sb: crate::store::state::Standby) {
    if let Some(a) = sb.armed {
        if kill_if_alive(a.standby.0, a.standby.1) {
            tracing::info!(job = sb.task.0, pid = a.standby.0, domain = %sb.domain, "standby in a faulted server ended");
        }
    }
    let _ = std::fs::remove_file(&sb.fifo);
}

/// SIGKILLs `pid` if it is still the process that started at `ticks` (a reused pid is left
/// alone); whether it was there.
fn kill_if_alive(pid: u32, ticks: Option<u64>) -> bool {
    if pid <= 1 || !procfs::alive(pid, ticks) {
        return false;
    }
    // SAFETY: kill(2) with a checked pid and a constant signal.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) == 0 }
}

/// Writes the release byte. Non-blocking: with no standby reading the FIFO (it died), the open
/// fails at once (ENXIO) and the task is restarted instead.
fn write_release(fifo: &std::path::Path) -> bool {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(fifo);
    let Ok(mut f) = f else { return false };
    // The agent made it in its own directory; still, only a FIFO is written to.
    if !f.metadata().is_ok_and(|m| m.file_type().is_fifo()) {
        return false;
    }
    f.write_all(b"g").is_ok()
}
