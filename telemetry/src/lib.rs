//! Telemetry for mps-resilient: what is sampled (`sample`), the pathology rules as a table
//! (`rules`), the detector that turns samples into findings with windows and hysteresis
//! (`detect`), what a round publishes (`snapshot`), Prometheus exposition (`metrics`), and the sources: NVML (`nvml`), node NIC
//! counters (`nic`) and a replay of synthetic series with injected pathologies (`replay`, used
//! by the simulator and the tests). Nothing here touches the fault path.

pub mod detect;
#[cfg(feature = "prometheus")]
pub mod metrics;
pub mod nic;
#[cfg(feature = "nvml")]
pub mod nvml;
pub mod replay;
pub mod rules;
pub mod sample;
pub mod skew;
pub mod snapshot;
pub mod source;
pub mod steps;

pub use detect::{Detector, Finding, FindingState, Subject};
pub use rules::{Rule, RuleId, Severity, RULES};
pub use sample::{ClientSample, GpuReading, GpuSample, NicSample, Owner, Tick};
pub use snapshot::Snapshot;
