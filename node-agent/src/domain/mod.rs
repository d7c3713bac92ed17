//! Fault domains: which MPS server of a GPU each job's clients use.
//!
//! A domain is one MPS control daemon and its server on one GPU, with its own pipe and log
//! directory ([`paths`]). A fault of an application class kills only the clients of the server it
//! happened in (measured on an H200 with two daemons on one GPU, KNOWLEDGE.md), so the placement
//! chosen here is what bounds a fault's blast radius. Slot 0 is the GPU's shared domain (always
//! there); others are created on demand for a job (`job`) or a user (`user`), capped per GPU,
//! and stopped after they have been empty for the linger time. The table is part of the durable
//! state: after an agent restart every recorded domain's daemon is adopted again.
//!
//! The price, also measured: clients of different servers are time-sliced, not concurrent, and
//! each server takes ~66 MiB of GPU memory (README, BENCHMARKS.md).
//!
//! `table` decides placement (pure data, durable); `lifecycle` starts, adopts, watches and stops
//! the domains' daemons for the agent (`lifecycle::placement` starts those a placement made);
//! `probe` asks servers whether they are in FAULT after a fault no domain showed yet; `tails`
//! follows each domain's MPS logs.

pub mod lifecycle;
pub mod probe;
mod table;
mod tails;

pub use lifecycle::{Placement, PlacementError};
pub use probe::DomainProbe;
pub use table::*;
pub use tails::LogTails;
