//! The fault path, in the order a fault goes through it. What enters: [`correlate::Signal`]s from
//! the intakes (kernel log, NVML, MPS logs, server probes, task exits). What leaves: the decision
//! recorded in the state (history, queued Slurm actions, resume verdicts, servers to watch,
//! quarantines) and [`core::Effect`]s for the world outside it.
//!
//! - `correlate`: signals of one GPU within the window are one fault.
//! - `classify`: the Xid table (class and policy of each Xid).
//! - `decide`: which domains showed the fault, who was hit, what to do for each job (pure).
//! - `core`: the two above over the agent's state, and the actions recorded (pure, no I/O).
//! - `worker`: the thread that feeds the core and carries its effects out.

pub mod classify;
pub mod core;
pub mod correlate;
pub mod decide;
pub mod worker;
