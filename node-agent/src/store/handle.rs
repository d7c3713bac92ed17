//! The handle every worker holds on the state: the lock, its durability (the persister) and the
//! wake-ups that go with a change (an action queued for the Slurm worker, an action settled for
//! whoever waits on it). Workers hold an `Arc<Store>` and nothing else of each other's.

use crate::store::persister::{Durability, Persister};
use crate::store::state::{push_outcome, State};
use crate::sys::lock;
use mpsr_proto::FaultOutcome;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub struct Store {
    state: Mutex<State>,
    persister: Persister,
    /// Notified when a Slurm action is queued (the Slurm worker waits on it).
    queued: Condvar,
    /// Notified when a Slurm action leaves the queue (done or failed for good).
    settled: Condvar,
    dir: PathBuf,
}

impl Store {
    /// The state read back at start, kept in `dir` from now on.
    pub fn new(state: State, dir: &Path) -> Store {
        Store {
            state: Mutex::new(state),
            persister: Persister::new(&dir.join("registry.journal")),
            queued: Condvar::new(),
            settled: Condvar::new(),
            dir: dir.to_path_buf(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Marks the durable state changed; returns the generation to wait for.
    pub fn mark_dirty(&self) -> u64 {
        self.persister.mark_dirty()
    }

    /// Marks registry changes recorded with `State::journal` (only a journal append is needed).
    pub fn mark_journaled(&self) -> u64 {
        self.persister.mark_journaled()
    }

    /// Marks the telemetry log changed (written without the state file).
    pub fn telemetry_changed(&self) {
        self.persister.telemetry_changed();
    }

    /// Marks the decision history changed (its own file).
    pub fn history_changed(&self) {
        self.persister.history_changed();
    }

    /// The generation of the latest change: waiting for it covers everything changed so far.
    pub fn latest_gen(&self) -> u64 {
        self.persister.latest_gen()
    }

    /// Blocks until generation `gen` is on disk (bounded: a stuck disk must not hang callers).
    pub fn wait_durable(&self, gen: u64) -> bool {
        self.wait_durable_within(gen, Duration::from_secs(5)) == Durability::Durable
    }

    /// Waits up to `bound` for generation `gen` to be on disk (see `Persister`).
    pub fn wait_durable_within(&self, gen: u64, bound: Duration) -> Durability {
        self.persister.wait_durable_within(gen, bound)
    }

    /// Why the state directory refuses writes, while it does.
    pub fn persist_failing(&self) -> Option<mpsr_proto::PersistFailure> {
        self.persister.failing()
    }

    /// Writes what changed now, on the caller's thread (at start and at shutdown).
    pub fn persist_now(&self) {
        self.persister.persist(&self.state, &self.dir);
    }

    /// The writer thread (group commit of the state), until the process ends.
    pub fn run_persister(&self) {
        self.persister.run(&self.state, &self.dir);
    }

    /// Records what came of fault `fault_id`, once: typed on its decision record (history) and,
    /// when it concerns a job, as a line of that job's report (rendered here, for people).
    pub fn record(&self, st: &mut State, fault_id: u64, job: Option<u32>, o: FaultOutcome) {
        if let Some(j) = job {
            push_outcome(
                &mut st.durable.outcomes,
                j,
                format!("fault {fault_id}: {o}"),
            );
        }
        st.add_outcome(fault_id, o);
        self.persister.history_changed();
        self.persister.mark_journaled();
    }

    /// A Slurm action was queued: the Slurm worker looks at the queue now.
    pub fn action_queued(&self) {
        self.queued.notify_all();
    }

    /// Waits (holding nothing) until an action may have been queued, or `at_most` has passed.
    pub fn wait_queued<'a>(
        &self,
        st: MutexGuard<'a, State>,
        at_most: Duration,
    ) -> MutexGuard<'a, State> {
        self.queued
            .wait_timeout(st, at_most)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    /// A Slurm action left the queue: whoever waits for it goes on.
    pub fn action_settled(&self) {
        self.settled.notify_all();
    }

    /// Waits until `done(state)` holds, re-checked whenever an action settles; false if `at_most`
    /// passed first.
    pub fn wait_settled(&self, at_most: Duration, done: impl Fn(&State) -> bool) -> bool {
        let until = Instant::now() + at_most;
        let mut st = self.lock();
        loop {
            if done(&st) {
                return true;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .settled
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
