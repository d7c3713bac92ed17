//! What the agent keeps and how it survives a restart. What enters: tasks (registrations), decisions
//! and their actions (from the fault core and the workers). What leaves: the state file, the
//! registry journal and the decision history on disk, written atomically (temp + fsync + rename +
//! dir fsync, `sys::atomic_file`), and read back at start.
//!
//! - `state`: the agent's state, durable and in memory.
//! - `registry`: the registered tasks of jobs.
//! - `journal`: registry changes appended between full state writes.
//! - `queue`: the Slurm actions decisions queue (idempotent by key, coalesced in a storm).
//! - `persister`: what to write when (generations, group commit), the writer thread, and the
//!   durability waits.
//! - `handle`: the `Store` every worker holds: the state lock, durability, outcomes recorded once,
//!   and the wake-ups of the Slurm action queue.
//! - `recover`: the state read back at start.

pub mod handle;
pub mod journal;
pub mod persister;
pub mod queue;
pub mod recover;
pub mod registry;
pub mod state;

pub use handle::Store;
