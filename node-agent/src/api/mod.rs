//! How the agent is asked. What enters: requests on the Unix socket (the plugin in slurmstepd, the
//! prolog and epilog, `mpsr-run`, `mpsrctl`, the state keepers), each with the caller's kernel
//! credentials, and HTTP scrapes. What leaves: answers, registrations into the store, task exits
//! sent to the fault worker as signals.
//!
//! - `socket`: the listening socket, connection limits, framing.
//! - `handlers`: one function per request, the authorization rule in one place.
//! - `http`: `/metrics` and the job endpoints.

pub mod handlers;
pub mod http;
pub mod socket;
