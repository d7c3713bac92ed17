//! Slurm actions: `listing` (what Slurm lists of a job or node, from fields no user chooses),
//! `scontrol` (one call, judged by Slurm's own fields), `worker` (the thread that carries the queue out, after the
//! decision is on disk, with retries and backoff). The queue itself is durable state (`store::queue`).

pub mod listing;
pub mod scontrol;
pub mod worker;

/// What every drain reason and comment line the agent writes into Slurm starts with.
pub const DRAIN_PREFIX: &str = mpsr_proto::fault::SLURM_TEXT_PREFIX;
