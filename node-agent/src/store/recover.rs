//! The state read back at start: the state file with the registry journal replayed on top, the
//! decision history and telemetry log, reconciled with the processes alive now (tasks that exited
//! while the agent was down leave the registry, and their standbys and resume entries go).

use crate::store::state::{Durable, State, TelemetryLog};
use crate::sys::atomic_file::{self, PersistError};
use crate::sys::procfs;
use mpsr_proto::DecisionRecord;
use std::collections::VecDeque;
use std::path::Path;
use std::time::Duration;

/// Reads the state kept in `dir` (empty when there is none); `window` is the fault correlation
/// window of the correlator it starts with.
pub fn recover(dir: &Path, window: Duration) -> Result<State, PersistError> {
    let mut d: Durable = atomic_file::read(&dir.join("state.json"))?.unwrap_or_default();
    let journal_path = dir.join("registry.journal");
    let (replayed, last_seq) =
        crate::store::journal::Journal::replay(&journal_path, d.journal_seq, &mut d.registry);
    if replayed > 0 {
        tracing::info!(entries = replayed, "registry journal replayed");
    }
    let history: VecDeque<DecisionRecord> =
        atomic_file::read(&dir.join("history.json"))?.unwrap_or_default();
    let telemetry: TelemetryLog =
        atomic_file::read(&dir.join("telemetry.json"))?.unwrap_or_default();
    let gone = d.registry.reconcile(procfs::alive);
    d.tasks_left(&gone, crate::sys::now_ms());
    // Standbys of tasks that are gone, or whose standby process is.
    let live: std::collections::BTreeSet<_> = d
        .registry
        .tasks()
        .map(|t| (t.job_id, t.step_id, t.pid))
        .collect();
    let stale = d.drop_standbys(|s| {
        !live.contains(&s.task)
            || s.armed
                .is_some_and(|a| !procfs::alive(a.standby.0, a.standby.1))
    });
    crate::store::state::remove_fifos(&stale);
    for t in &gone {
        tracing::info!(
            job = t.job_id,
            step = t.step_id,
            pid = t.pid,
            "task exited while the agent was down; deregistered"
        );
        d.resume.remove((t.job_id, t.step_id, t.pid));
    }
    if !d.registry.is_empty() || !d.pending.is_empty() {
        tracing::info!(
            tasks = d.registry.len(),
            pending_actions = d.pending.len(),
            domains = d.domains.records().count(),
            "state recovered after restart"
        );
    }
    Ok(State::new(
        d,
        history,
        telemetry,
        window,
        gone,
        last_seq + 1,
    ))
}
