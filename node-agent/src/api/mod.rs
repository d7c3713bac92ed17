//! How the agent is asked. What enters: requests on the Unix socket (the plugin in slurmstepd, the
//! prolog and epilog, `mpsr-run`, `mpsrctl`, the state keepers), each with the caller's kernel
//! credentials, and HTTP scrapes. What leaves: answers, registrations into the store, task exits
//! sent to the fault worker as signals.
//!
//! - `socket`: the listening socket, connection limits, framing.
//! - `caller`: who is asking, and the refusal (a leaf every handler shares).
//! - `dispatch`: who may ask what (one table), and the handler of each request.
//! - `tasks`, `register`, `standby`, `jobs`, `views`, `admin`: the handlers, one module per request
//!   family (`register`: a task's registration, step by step).
//! - `http`: `/metrics` and the job endpoints (who may read them: `sys::http_access`).

mod admin;
pub mod caller;
pub mod dispatch;
mod fault_metrics;
pub mod http;
mod jobs;
mod register;
pub mod socket;
pub mod standby;
mod tasks;
mod views;
