//! mps-resilient node agent. Data path: intake (`backend`, `intake`, `kmsg`) -> `fault` (correlate,
//! classify, decide which fault `domain` showed it, record the actions: a pure core fed by one
//! worker) -> actions (`slurm_exec` requeue/drain, resume board, `recovery` watches servers back).
//! `server` + `handlers` serve the plugin and `mpsrctl`; `registry`, `state`, `persister`,
//! `journal` keep jobs and domains.

pub mod agent;
pub mod backend;
pub mod config;
pub mod domain;
pub mod fault;
pub mod file_watch;
pub mod handlers;
pub mod http;
pub mod intake;
pub mod journal;
pub mod keeper;
pub mod kmsg;
pub mod logging;
pub mod mps;
pub mod notify;
pub mod persist;
pub mod persister;
pub mod recovery;
pub mod registry;
pub mod server;
pub mod slurm;
pub mod slurm_exec;
pub mod spawn;
pub mod state;
pub mod telemetry;
