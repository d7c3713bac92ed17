//! Where rounds come from: NVML on real GPUs, or the SIMULATED replay. The agent calls `read`
//! from its telemetry thread only.

use crate::replay::{Injection, Rank, Scenario};
use crate::sample::{ClientSample, GpuReading, Owner};
use std::sync::{Arc, Mutex};

/// A client an MPS daemon reports, with the registered task it belongs to (for sources that
/// cannot see processes themselves).
#[derive(Debug, Clone, PartialEq)]
pub struct Attached {
    pub gpu: u32,
    pub slot: u32,
    pub pid: u32,
    pub owner: Option<Owner>,
}

pub trait Source: Send {
    /// One round over every GPU; `slow` adds the expensive counters.
    fn read(&mut self, slow: bool, attached: &[Attached]) -> (Vec<GpuReading>, Vec<ClientSample>);
}

/// SIMULATED telemetry for the sim backend: the replay's series for the clients the simulated
/// MPS daemons report, with pathologies injected at run time (`mpsrctl sim-pathology`).
pub struct SimSource {
    pub scenario: Scenario,
    pub injections: Arc<Mutex<Vec<Injection>>>,
    started: std::time::Instant,
    round: u64,
}

/// Nominal load of a simulated client: utilization and memory.
pub const SIM_CLIENT_UTIL: f64 = 0.85;
pub const SIM_CLIENT_MEM: u64 = 8 << 30;

impl SimSource {
    /// `started` is the clock injections are given in (seconds since it).
    pub fn new(
        gpus: u32,
        seed: u64,
        started: std::time::Instant,
        injections: Arc<Mutex<Vec<Injection>>>,
    ) -> SimSource {
        SimSource {
            scenario: Scenario {
                seed,
                gpus,
                ranks: Vec::new(),
                nics: Vec::new(),
                injections: Vec::new(),
                // Measured: NVML gives MPS clients no utilization of their own.
                per_client_util: false,
            },
            injections,
            started,
            round: 0,
        }
    }

    /// Seconds on the injections' clock.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

impl Source for SimSource {
    fn read(&mut self, _slow: bool, attached: &[Attached]) -> (Vec<GpuReading>, Vec<ClientSample>) {
        self.scenario.ranks = attached
            .iter()
            .map(|a| Rank {
                gpu: a.gpu,
                pid: a.pid,
                owner: a.owner,
                util: SIM_CLIENT_UTIL,
                mem_bytes: SIM_CLIENT_MEM,
            })
            .collect();
        self.scenario.injections = self
            .injections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        self.round += 1;
        let mut tick = self.scenario.tick(self.round, self.now());
        for c in &mut tick.clients {
            c.slot = attached
                .iter()
                .find(|a| a.gpu == c.gpu && a.pid == c.pid)
                .map(|a| a.slot);
        }
        (tick.gpus, tick.clients)
    }
}
