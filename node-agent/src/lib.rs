//! mps-resilient node agent. Each folder is a stage of the data path, in this order:
//!
//! - `intake`: kernel log and MPS log readers turn lines into signals (NVML events come from `gpu`).
//! - `fault`: signals are correlated into faults, classified and decided by a pure core over the
//!   state (who was hit, what to do); one worker feeds it and carries its effects out.
//! - `act`: what the decision asks for: Slurm requeue and drain, servers watched back to ACTIVE,
//!   resume verdicts, state keepers.
//! - `store`: the state, the task registry, and their durability.
//! - `api`: the socket and HTTP requests (registrations from the plugin, `mpsrctl`, keepers).
//!
//! Beside the path: `domain` (fault domains: placement and their MPS daemons), `gpu` (the GPU
//! backends, real and simulated), `telemetry` (the telemetry thread), `config`, `sys` (leaf OS
//! helpers), `signal` (the fault path's shared vocabulary: signals, GPU ids, reader positions; a
//! leaf), `agent` (the hub the workers share: its parts, the state read back at start) and
//! `wiring` (starts the workers).

pub mod act;
pub mod agent;
pub mod api;
pub mod config;
pub mod domain;
pub mod fault;
pub mod gpu;
pub mod intake;
pub mod signal;
pub mod store;
pub mod sys;
pub mod telemetry;
pub mod wiring;
