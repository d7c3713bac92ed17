//! SIMULATED telemetry: deterministic noisy series for a node's GPUs and jobs, with pathologies
//! injected over time windows. Used by the simulator backend (live, clock-driven) and by the
//! tests (seeded, many runs). Values and noise follow an H200 under a training load (BENCHMARKS.md
//! for the measured ones); counters grow the way healthy hardware does (rare ECC corrections,
//! replays well inside the PCIe bound).

use crate::sample::{clock_event, ClientSample, GpuReading, GpuSample, NicSample, Owner, Tick};
use serde::{Deserialize, Serialize};

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pathology {
    /// HW slowdown clock events, clocks down.
    Throttle,
    /// Temperature at the slowdown threshold.
    Thermal,
    /// Corrected ECC errors at 60 per minute.
    EccStorm,
    /// One uncorrectable ECC error.
    EccUncorrected,
    /// A pending row remap.
    RemapPending,
    /// PCIe replays at 300 per minute.
    ReplayGrowth,
    /// Link width x16 -> x8.
    LinkDowngrade,
    /// NVLink errors at 30 per minute.
    NvlinkErrors,
    /// The client's utilization at a quarter of its peers'.
    Straggler,
    /// The client holds 2.5x the memory of its peers.
    MemorySkew,
    /// The client takes almost all of its GPU; other clients get almost nothing.
    Hog,
    /// The GPU's memory 97 % used.
    NearOom,
    /// The client holds memory and computes nothing.
    IdleAllocation,
    /// The GPU's SM clock at 70 % of the others' (no clock-event bit set).
    ClockSkew,
    /// The NIC port's error counters grow.
    NicErrors,
    // Robustness: none of these may raise anything.
    /// Every counter of the GPU restarts from zero at the window's start.
    CounterReset,
    /// Counters read as not supported.
    NotSupported,
    /// No reading at all this round.
    Gap,
    /// NVML says the GPU is lost.
    GpuLost,
}

impl Pathology {
    /// Whether the injection is one a detector must stay silent about.
    pub fn benign(self) -> bool {
        matches!(
            self,
            Pathology::CounterReset | Pathology::NotSupported | Pathology::Gap
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Injection {
    pub what: Pathology,
    pub gpu: u32,
    /// The client it applies to, for per-client pathologies.
    #[serde(default)]
    pub pid: Option<u32>,
    pub start_s: f64,
    pub end_s: f64,
}

/// A job rank on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rank {
    pub gpu: u32,
    pub pid: u32,
    pub owner: Option<Owner>,
    /// Its nominal utilization (0..1) and memory.
    pub util: f64,
    pub mem_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scenario {
    pub seed: u64,
    pub gpus: u32,
    pub ranks: Vec<Rank>,
    pub nics: Vec<String>,
    pub injections: Vec<Injection>,
    /// Whether NVML gives per-process utilization. false for MPS clients: measured on an H200
    /// (driver 580), NVML credits all of an MPS server's utilization to the server process.
    pub per_client_util: bool,
}

const H200_MEM: u64 = 143_771_222_016;
const SM_MAX: u32 = 1980;

/// splitmix64: a small deterministic generator keyed by (seed, round, stream).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Scenario {
    fn noise(&self, round: u64, stream: u64) -> f64 {
        let x = mix(self.seed ^ mix(round.wrapping_mul(1_000_003) ^ stream));
        (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0 // -1..1
    }

    fn active(&self, t: f64, gpu: u32, what: Pathology) -> Option<&Injection> {
        self.injections
            .iter()
            .find(|i| i.what == what && i.gpu == gpu && t >= i.start_s && t < i.end_s)
    }

    fn client_hit(&self, t: f64, pid: u32, what: Pathology) -> bool {
        self.injections
            .iter()
            .any(|i| i.what == what && i.pid == Some(pid) && t >= i.start_s && t < i.end_s)
    }

    /// Seconds `what` has been active on `gpu` up to `t`, summed over its windows.
    fn active_for(&self, t: f64, gpu: u32, what: Pathology) -> f64 {
        self.injections
            .iter()
            .filter(|i| i.what == what && i.gpu == gpu && t >= i.start_s)
            .map(|i| t.min(i.end_s) - i.start_s)
            .sum()
    }

    /// The start of the latest counter reset on `gpu` before `t`.
    fn reset_at(&self, t: f64, gpu: u32) -> f64 {
        self.injections
            .iter()
            .filter(|i| i.what == Pathology::CounterReset && i.gpu == gpu && t >= i.start_s)
            .map(|i| i.start_s)
            .fold(0.0, f64::max)
    }

    /// A healthy counter: `per_hour` events on average since the start, monotonic.
    fn counter(&self, t: f64, per_hour: f64, stream: u64) -> u64 {
        let phase = (mix(self.seed ^ stream) >> 11) as f64 / (1u64 << 53) as f64;
        (t.max(0.0) * per_hour / 3600.0 + phase).floor() as u64
    }

    /// The GPU's raw counters at `t`: corrected and uncorrected ECC, PCIe replays, NVLink errors.
    fn raw_counters(&self, t: f64, gpu: u32) -> [u64; 4] {
        let g = gpu as u64 * 64;
        let storm = self.active_for(t, gpu, Pathology::EccStorm) as u64; // 60 per minute
        let dbe = (self.active_for(t, gpu, Pathology::EccUncorrected) > 0.0) as u64;
        let replay = (self.active_for(t, gpu, Pathology::ReplayGrowth) * 300.0 / 60.0) as u64;
        let nvl = (self.active_for(t, gpu, Pathology::NvlinkErrors) * 30.0 / 60.0) as u64;
        [
            self.counter(t, 0.5, g + 6) + storm,
            dbe,
            self.counter(t, 30.0, g + 7) + replay,
            nvl,
        ]
    }

    /// The round at time `t` (seconds); `round` keys the noise.
    pub fn tick(&self, round: u64, t: f64) -> Tick {
        let mut tick = Tick {
            t,
            ..Tick::default()
        };
        for gpu in 0..self.gpus {
            if self.active(t, gpu, Pathology::GpuLost).is_some() {
                tick.gpus.push(GpuReading::Lost { gpu });
                continue;
            }
            if self.active(t, gpu, Pathology::Gap).is_some() {
                tick.gpus.push(GpuReading::Gap { gpu });
                continue;
            }
            let ranks: Vec<&Rank> = self.ranks.iter().filter(|r| r.gpu == gpu).collect();
            let cu = self.client_utils(round, t, &ranks);
            let s = self.gpu_sample(round, t, gpu, &ranks, &cu);
            tick.gpus.push(GpuReading::Sample(Box::new(s)));
            for (r, u) in ranks.into_iter().zip(cu) {
                tick.clients.push(ClientSample {
                    gpu,
                    pid: r.pid,
                    slot: Some(0),
                    mem_used_bytes: Some(self.rank_mem(r, t)),
                    sm_util: self.per_client_util.then_some(u),
                    owner: r.owner,
                    thread_pct: None,
                    mem_limit_bytes: None,
                    steps: None,
                });
            }
        }
        for (i, port) in self.nics.iter().enumerate() {
            let errs = (self.injections.iter())
                .filter(|j| j.what == Pathology::NicErrors && j.gpu == i as u32 && t >= j.start_s)
                .map(|j| ((t.min(j.end_s) - j.start_s) * 20.0 / 60.0) as u64)
                .sum::<u64>();
            tick.nics.push(NicSample {
                port: port.clone(),
                rx_bytes: Some((t * 1e9) as u64),
                tx_bytes: Some((t * 1e9) as u64),
                errors: Some(errs),
                discards: Some(0),
            });
        }
        tick
    }

    /// Each client's utilization this round (a straggler, an idle allocation, a hog and the
    /// others beside it).
    fn client_utils(&self, round: u64, t: f64, ranks: &[&Rank]) -> Vec<f64> {
        let hog = ranks
            .iter()
            .find(|r| self.client_hit(t, r.pid, Pathology::Hog))
            .map(|r| r.pid);
        ranks
            .iter()
            .map(|r| {
                let mut u = r.util + 0.04 * self.noise(round, 1000 + r.pid as u64);
                if self.client_hit(t, r.pid, Pathology::Straggler) {
                    u *= 0.25;
                }
                if self.client_hit(t, r.pid, Pathology::IdleAllocation) {
                    u = 0.0;
                }
                match hog {
                    Some(h) if h == r.pid => u = 0.99,
                    Some(_) => u = 0.01,
                    None => {}
                }
                u.clamp(0.0, 1.0)
            })
            .collect()
    }

    /// The SM clock and NVML's clock-event bits of a GPU this busy.
    fn clocks(&self, round: u64, t: f64, gpu: u32, util: f64) -> (f64, u64) {
        let g = gpu as u64 * 64;
        let mut clock = SM_MAX as f64 - 20.0 * self.noise(round, g + 2).abs();
        let mut events = if util < 0.05 {
            clock_event::GPU_IDLE
        } else {
            0
        };
        if util > 0.5 && self.noise(round, g + 3) > 0.6 {
            events |= clock_event::SW_POWER_CAP; // normal under load
            clock -= 60.0;
        }
        if self.active(t, gpu, Pathology::Throttle).is_some() {
            events |= clock_event::HW_SLOWDOWN;
            clock *= 0.6;
        }
        if self.active(t, gpu, Pathology::ClockSkew).is_some() {
            clock *= 0.7;
        }
        (clock, events)
    }

    /// The error counters since the last counter reset (corrected and uncorrected ECC, PCIe
    /// replays, NVLink errors), and the raw ones.
    fn error_counters(&self, t: f64, gpu: u32) -> ([u64; 4], [u64; 4]) {
        let from = self.reset_at(t, gpu);
        let now = self.raw_counters(t, gpu);
        let base = if from > 0.0 {
            self.raw_counters(from, gpu)
        } else {
            [0; 4]
        };
        ([0, 1, 2, 3].map(|i| now[i] - base[i]), now)
    }

    /// One GPU's reading: its clients' work (`cu`) makes its utilization, clocks, power and heat.
    fn gpu_sample(&self, round: u64, t: f64, gpu: u32, ranks: &[&Rank], cu: &[f64]) -> GpuSample {
        let g = gpu as u64 * 64;
        // The GPU's utilization is the time any of its clients ran a kernel.
        let busy = 1.0 - cu.iter().map(|u| 1.0 - u).product::<f64>();
        // An idle GPU reads exactly 0 (as NVML's does).
        let util = if ranks.is_empty() || busy < 0.005 {
            0.0
        } else {
            (busy + 0.02 * self.noise(round, g + 1)).clamp(0.0, 1.0)
        };
        let (clock, events) = self.clocks(round, t, gpu, util);
        let slowdown = 87.0;
        let temp = if self.active(t, gpu, Pathology::Thermal).is_some() {
            slowdown - 1.0 + self.noise(round, g + 4)
        } else {
            40.0 + 20.0 * util + 2.0 * self.noise(round, g + 4)
        };
        let unsupported = self.active(t, gpu, Pathology::NotSupported).is_some();
        let c = |v: u64| (!unsupported).then_some(v);
        let ([sbe, dbe, replay, nvl], now) = self.error_counters(t, gpu);
        let mut mem_used: u64 = ranks.iter().map(|r| self.rank_mem(r, t)).sum::<u64>()
            + 600 * (1 << 20) * (!ranks.is_empty()) as u64;
        if self.active(t, gpu, Pathology::NearOom).is_some() {
            mem_used = (H200_MEM as f64 * 0.97) as u64;
        }
        let downgraded = self.active(t, gpu, Pathology::LinkDowngrade).is_some();
        GpuSample {
            gpu,
            uuid: format!("GPU-sim{gpu:04}-0000-0000-0000-000000000000"),
            util: Some(util),
            mem_copy_util: Some((util * 0.4).clamp(0.0, 1.0)),
            mem_used_bytes: Some(mem_used),
            mem_total_bytes: Some(H200_MEM),
            sm_clock_mhz: Some(clock.max(0.0) as u32),
            sm_clock_max_mhz: Some(SM_MAX),
            clock_events: Some(events),
            power_w: Some(90.0 + 560.0 * util + 15.0 * self.noise(round, g + 5)),
            power_limit_w: Some(700.0),
            energy_j: Some(t * (90.0 + 560.0 * busy)),
            temp_c: Some(temp),
            temp_slowdown_c: Some(slowdown),
            ecc_corrected_volatile: c(sbe),
            ecc_uncorrected_volatile: c(dbe),
            ecc_corrected_aggregate: c(now[0] + 12),
            ecc_uncorrected_aggregate: c(now[1]),
            remapped_rows_correctable: c(0),
            remapped_rows_uncorrectable: c(0),
            remap_pending: (!unsupported)
                .then_some(self.active(t, gpu, Pathology::RemapPending).is_some()),
            remap_failure: (!unsupported).then_some(false),
            pcie_replays: c(replay),
            pcie_gen: Some(if util < 0.05 { 1 } else { 5 }),
            pcie_gen_max: Some(5),
            pcie_width: Some(if downgraded { 8 } else { 16 }),
            pcie_width_max: Some(16),
            pcie_tx_bytes_per_s: Some(2e8 * util),
            pcie_rx_bytes_per_s: Some(4e8 * util),
            nvlink_errors: c(nvl),
            violation_power_ns: c((t * 1e8 * util) as u64),
            violation_thermal_ns: c(0),
            sm_active: Some((util * 0.9).clamp(0.0, 1.0)),
            sm_occupancy: Some((util * 0.5).clamp(0.0, 1.0)),
            tensor_active: Some((util * 0.6).clamp(0.0, 1.0)),
            dram_active: Some((util * 0.5).clamp(0.0, 1.0)),
        }
    }

    fn rank_mem(&self, r: &Rank, t: f64) -> u64 {
        if self.client_hit(t, r.pid, Pathology::MemorySkew) {
            (r.mem_bytes as f64 * 2.5) as u64
        } else {
            r.mem_bytes
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_series() {
        let s = Scenario {
            seed: 7,
            gpus: 2,
            ranks: vec![],
            nics: vec![],
            injections: vec![],
            per_client_util: true,
        };
        assert_eq!(s.tick(3, 15.0), s.tick(3, 15.0));
        assert_ne!(
            s.tick(3, 15.0).gpus,
            Scenario {
                seed: 8,
                ..s.clone()
            }
            .tick(3, 15.0)
            .gpus
        );
    }
}
