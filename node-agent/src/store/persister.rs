//! Group commit of the agent's state: mutations bump a generation; one writer thread persists and
//! bumps the durable generation. Registry changes alone go to the journal (cheap); anything else
//! rewrites the state file.

use crate::store::state::State;
use crate::sys::atomic_file::{self, PersistError};
use crate::sys::lock;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub struct Persister {
    gens: Mutex<(u64, u64)>,
    cv: Condvar,
    full: AtomicBool,
    journal: Mutex<crate::store::journal::Journal>,
    /// The decision history changed (kept in its own file; not needed for correctness).
    history: AtomicBool,
    /// The telemetry log changed (its own file too).
    telemetry: AtomicBool,
    /// Set while writes fail (disk full, read-only): shown in status, cleared by the next success.
    failing: Mutex<Option<mpsr_proto::PersistFailure>>,
}

/// Whether a change reached the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    Durable,
    /// The state directory refuses writes (see `Persister::failing`).
    Failing,
    /// Not yet written within the bound.
    Slow,
}

/// A full state file after this many journal entries.
const JOURNAL_MAX: usize = 20_000;

impl Persister {
    pub fn new(journal_path: &std::path::Path) -> Persister {
        Persister {
            gens: Mutex::new((1, 0)),
            cv: Condvar::new(),
            // The first write is a full one: it folds the replayed journal into the state file.
            full: AtomicBool::new(true),
            journal: Mutex::new(crate::store::journal::Journal::new(journal_path)),
            history: AtomicBool::new(false),
            telemetry: AtomicBool::new(false),
            failing: Mutex::new(None),
        }
    }

    /// Why the state directory refuses writes, while it does.
    pub fn failing(&self) -> Option<mpsr_proto::PersistFailure> {
        lock(&self.failing).clone()
    }

    fn record(&self, result: &Result<(), PersistError>) {
        let mut f = lock(&self.failing);
        match result {
            Ok(()) => {
                if let Some(was) = f.take() {
                    tracing::warn!(
                        since_ms = was.since_ms,
                        "the state directory takes writes again"
                    );
                }
            }
            Err(e) => {
                let since_ms = f
                    .as_ref()
                    .map_or_else(crate::sys::now_ms, |was| was.since_ms);
                *f = Some(mpsr_proto::PersistFailure {
                    since_ms,
                    errno: e.errno(),
                    error: e.to_string(),
                });
            }
        }
    }

    /// Marks the decision history changed (written off the fault path).
    pub fn history_changed(&self) {
        self.history.store(true, SeqCst);
    }
}

impl Persister {
    /// Marks the telemetry log changed: written without the state file.
    pub fn telemetry_changed(&self) -> u64 {
        self.telemetry.store(true, SeqCst);
        self.mark_journaled()
    }

    /// Marks the durable state changed; returns the generation to wait for.
    pub fn mark_dirty(&self) -> u64 {
        let mut g = lock(&self.gens);
        self.full.store(true, SeqCst);
        g.0 += 1;
        self.cv.notify_all();
        g.0
    }

    /// Marks registry changes recorded with `State::journal` (only a journal append is needed).
    pub fn mark_journaled(&self) -> u64 {
        let mut g = lock(&self.gens);
        g.0 += 1;
        self.cv.notify_all();
        g.0
    }

    /// The generation of the latest change: waiting for it covers everything changed so far.
    pub fn latest_gen(&self) -> u64 {
        lock(&self.gens).0
    }

    /// Waits up to `bound` for generation `gen` to be on disk; returns at once when the state
    /// directory is known to refuse writes (waiting would only delay what must happen anyway).
    pub fn wait_durable_within(&self, gen: u64, bound: Duration) -> Durability {
        let mut g = lock(&self.gens);
        let deadline = Instant::now() + bound;
        while g.1 < gen {
            if self.failing().is_some() {
                return Durability::Failing;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Durability::Slow;
            }
            g = self
                .cv
                .wait_timeout(g, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Durability::Durable
    }

    /// Writes what changed in `state` to `dir`: the journal's new entries, or the whole state
    /// file (after a non-registry change, or once the journal is long); the side files whose
    /// flag is set.
    pub fn persist(&self, state: &Mutex<State>, dir: &Path) {
        let (target, mut full) = {
            let g = lock(&self.gens);
            (g.0, self.full.swap(false, SeqCst))
        };
        let mut journal = lock(&self.journal);
        full |= journal.len > JOURNAL_MAX;
        let result = if full {
            let body = {
                let mut st = lock(state);
                // Everything journaled so far is in memory, hence in this file.
                st.durable.journal_seq = st.next_seq - 1;
                st.journal_pending.clear();
                serde_json::to_vec(&st.durable)
            };
            body.map_err(|source| PersistError::Encode {
                what: "state.json",
                source,
            })
            .and_then(|b| atomic_file::write_atomic_bytes(&dir.join("state.json"), &b))
            .and_then(|_| journal.reset().map_err(PersistError::Journal))
        } else {
            let entries = std::mem::take(&mut lock(state).journal_pending);
            if entries.is_empty() {
                Ok(())
            } else {
                journal.append(&entries).map_err(PersistError::Journal)
            }
        };
        write_side_file(&self.history, state, dir, "history.json", |st| {
            serde_json::to_vec(&st.history)
        });
        write_side_file(&self.telemetry, state, dir, "telemetry.json", |st| {
            serde_json::to_vec(&st.telemetry)
        });
        self.record(&result);
        match result {
            Ok(()) => {
                let mut g = lock(&self.gens);
                g.1 = g.1.max(target);
                self.cv.notify_all();
            }
            Err(e) => {
                // The next attempt writes the whole state, which holds whatever was lost here.
                self.full.store(true, SeqCst);
                tracing::error!(error = %e, "persisting state failed; will retry");
            }
        }
    }

    /// The writer thread: persists each new generation (group commit), until the process ends.
    pub fn run(&self, state: &Mutex<State>, dir: &Path) {
        let mut memory = crate::sys::memory::Releaser::default();
        loop {
            {
                let mut g = lock(&self.gens);
                while g.1 >= g.0 {
                    g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            }
            let before = lock(&self.gens).1;
            self.persist(state, dir);
            // The state file's buffer was the largest allocation of the round.
            memory.tick();
            if lock(&self.gens).1 == before {
                std::thread::sleep(Duration::from_millis(200)); // write failed; back off
            }
        }
    }
}

/// Writes one of the side files (history, telemetry log) if its flag was set.
fn write_side_file(
    flag: &AtomicBool,
    state: &Mutex<State>,
    dir: &Path,
    name: &'static str,
    body: impl FnOnce(&State) -> serde_json::Result<Vec<u8>>,
) {
    if !flag.swap(false, SeqCst) {
        return;
    }
    let body = body(&lock(state));
    if let Err(e) = body
        .map_err(|source| PersistError::Encode { what: name, source })
        .and_then(|b| atomic_file::write_atomic_bytes(&dir.join(name), &b))
    {
        // Written again with the next round.
        flag.store(true, SeqCst);
        tracing::warn!(file = name, error = %e, "writing a side file failed");
    }
}
