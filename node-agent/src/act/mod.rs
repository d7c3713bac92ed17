//! What is done about a decided fault, outside the fault core. What enters: the actions the core
//! recorded in the state (queued Slurm actions, servers to watch, resume verdicts). What leaves:
//! Slurm calls, killed clients, released standbys, verdicts for `mpsr-run`, kept GPU state freed or kept.
//!
//! - `slurm`: requeue and drain through `scontrol`.
//! - `recovery`: hit servers watched back to ACTIVE (hit clients ended), healed GPUs cleared,
//!   resume verdicts.
//! - `escalation`: a server still in FAULT past a bound: its server ended, its daemon restarted,
//!   then the domain fenced.
//! - `takeover`: a hit task's hot standby released, its old incarnation ended.
//! - `keepers`: the per-GPU state keeper processes; `keeper_watch` keeps one on each GPU and frees
//!   state kept for requeued jobs that will not come back.

pub mod escalation;
pub mod keeper_watch;
pub mod keepers;
pub mod recovery;
pub mod slurm;
pub mod takeover;
