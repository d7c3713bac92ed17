//! Slurm actions: `listing` (what Slurm lists of a job or node, from fields no user chooses), `queue` (what a decision queues, with its idempotency key), `scontrol` (one
//! call, judged by Slurm's own fields), `worker` (the thread that carries the queue out, after the
//! decision is on disk, with retries and backoff).

pub mod listing;
pub mod queue;
pub mod scontrol;
mod worker;

/// What every reason and comment line the agent writes into Slurm starts with: a drain the agent
/// made is told from an admin's by it.
pub const DRAIN_PREFIX: &str = "mpsr:";
