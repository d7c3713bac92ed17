//! mps-resilient node agent. Data path: intake (`backend`, `intake`, `kmsg`) -> `event` correlation ->
//! `xid` classification -> `decide` -> `agent` actions (`mps` terminate_client, `slurm` requeue/drain,
//! resume board). `server` + `handlers` serve the plugin and `mpsrctl`; `registry` + `persist` keep jobs.

pub mod agent;
pub mod backend;
pub mod config;
pub mod decide;
pub mod event;
pub mod handlers;
pub mod intake;
pub mod journal;
pub mod keeper;
pub mod kmsg;
pub mod logging;
pub mod mps;
pub mod persist;
pub mod registry;
pub mod server;
pub mod simgpu;
pub mod slurm;
pub mod spawn;
pub mod xid;
