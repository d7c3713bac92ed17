//! mps-resilient node agent. Each folder is a stage of the data path, in this order:
//!
//! - `intake`: kernel log and MPS log readers turn lines into signals (NVML events come from `gpu`).
//! - `fault`: signals are correlated into faults, classified and decided by a pure core over the
//!   state (who was hit, what to do); one worker feeds it and carries its effects out.
//! - `act`: what the decision asks for: Slurm requeue and drain, servers watched back to ACTIVE
//!   (escalated when they stay in FAULT), standby takeovers, resume verdicts, state keepers.
//! - `store`: the state, the task registry, the Slurm action queue and their durability; `Store` is
//!   the handle every worker holds.
//! - `api`: the socket and HTTP requests (registrations from the plugin, `mpsrctl`, keepers).
//!
//! Beside the path: `domain` (fault domains: placement and their MPS daemons), `gpu` (the GPU
//! backends, real and simulated, and the domains' directories), `telemetry` (the telemetry
//! thread), `config`, `logging`, `sys` (leaf OS helpers), `signal` (the fault path's shared
//! vocabulary: signals, GPU ids, reader positions, class policies; a leaf), `agent` (the parts the
//! requests are served from) and `wiring` (makes the channels, workers and handles, and starts
//! them).
//!
//! Imports run one way, bottom to top: sys, signal, config, logging, intake, gpu, store, domain,
//! act, fault, telemetry, agent, api, wiring (enforced by `tests/layers.rs`, which lists the two
//! arrows that run back up and why).

pub mod act;
pub mod agent;
pub mod api;
pub mod config;
pub mod domain;
pub mod fault;
pub mod gpu;
pub mod intake;
pub mod logging;
pub mod signal;
pub mod store;
pub mod sys;
pub mod telemetry;
pub mod wiring;
