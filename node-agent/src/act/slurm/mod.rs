//! Slurm actions: `queue` (what a decision queues, with its idempotency key), `scontrol` (one
//! call, judged by Slurm's own fields), `worker` (the thread that carries the queue out, after the
//! decision is on disk, with retries and backoff).

pub mod queue;
pub mod scontrol;
mod worker;
