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
    /// Counts the changes of a hit task's lot (its server recovered, its standby released), with
    /// the condition its waiters wait on.
    recovery: (Mutex<u64>, Condvar),
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
            recovery: (Mutex::new(0), Condvar::new()),
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

    /// A hit task's lot changed (a server recovered, a standby was released): resume supervisors
    /// waiting for their verdict are answered now.
    pub fn recovery_changed(&self) {
        *lock(&self.recovery.0) += 1;
        self.recovery.1.notify_all();
    }

    /// The count of those changes so far (read before looking, then `wait_recovery` on it).
    pub fn recovery_seen(&self) -> u64 {
        *lock(&self.recovery.0)
    }

    /// Waits until a change after `seen`, or `at_most` has passed.
    pub fn wait_recovery(&self, seen: u64, at_most: Duration) {
        let g = lock(&self.recovery.0);
        let _ = self
            .recovery
            .1
            .wait_timeout_while(g, at_most, |n| *n == seen)
            .unwrap_or_else(|p| p.into_inner());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::queue::{ActionKey, PendingAction, SlurmOp};
    use std::sync::Arc;

    fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let st = crate::store::recover::recover(dir.path(), Duration::from_millis(100)).unwrap();
        let s = Store::new(st, dir.path());
        (dir, s)
    }

    fn decision(fault_id: u64) -> mpsr_proto::DecisionRecord {
        serde_json::from_value(serde_json::json!({
            "fault_id": fault_id, "at_ms": 1, "gpu": 0, "xids": [43], "class": "app_sm",
            "sources": [], "reported_pid": null, "culprit": null, "hit_jobs": [5],
            "spared_jobs": [], "actions": [], "decide_us": 3
        }))
        .unwrap()
    }

    /// One call: the fault's record gets the typed outcome, the job's report its line, and the
    /// history is written.
    #[test]
    fn an_outcome_is_recorded_once_on_the_fault_and_the_jobs_report() {
        let (dir, s) = store();
        s.lock().history.push_back(decision(7));
        let o = FaultOutcome::Slurm {
            done: true,
            detail: "requeued job 5".into(),
        };
        let mut st = s.lock();
        s.record(&mut st, 7, Some(5), o.clone());
        assert_eq!(st.history[0].outcomes, vec![o.clone()]);
        assert_eq!(st.durable.outcomes[&5], vec![format!("fault 7: {o}")]);
        let g = s.latest_gen();
        drop(st);
        s.persist_now();
        assert!(s.wait_durable(g));
        let on_disk = std::fs::read_to_string(dir.path().join("history.json")).unwrap();
        assert!(on_disk.contains("requeued job 5"), "{on_disk}");
        // An outcome of no job reaches no job's report.
        let mut st = s.lock();
        s.record(&mut st, 7, None, FaultOutcome::NoDomainShowed);
        assert_eq!(st.history[0].outcomes.len(), 2);
        assert_eq!(st.durable.outcomes[&5].len(), 1);
    }

    /// A termination waiting for its Slurm action goes on when the action settles, not at its
    /// next poll; without a settlement it gives up at its bound.
    #[test]
    fn a_waiter_goes_on_when_its_action_settles() {
        let (_dir, s) = store();
        let s = Arc::new(s);
        let key = ActionKey::Drain { fault: 3 };
        s.lock().durable.pending.push(PendingAction {
            key: key.clone(),
            not_before_ms: None,
            fault_id: 3,
            op: SlurmOp::Drain {
                node: "n1".into(),
                reason: "r".into(),
            },
            attempts: 0,
            last_error: None,
            fresh: true,
        });
        let gone = |st: &State| !st.durable.pending.iter().any(|p| p.key == key);
        let t = Instant::now();
        assert!(!s.wait_settled(Duration::from_millis(50), gone));
        assert!(t.elapsed() >= Duration::from_millis(50));
        let s2 = s.clone();
        let settler = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s2.lock().durable.pending.clear();
            s2.action_settled();
        });
        let t = Instant::now();
        assert!(s.wait_settled(Duration::from_secs(30), gone));
        assert!(t.elapsed() < Duration::from_secs(10));
        settler.join().unwrap();
    }
}
