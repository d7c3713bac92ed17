//! One round of telemetry: per GPU, per MPS client (with the job it belongs to), per NIC port.
//! Every counter a GPU or driver may not support is an `Option`: `None` = not supported or not
//! read this round, never zero.

use serde::{Deserialize, Serialize};

/// NVML clocks-event reason bits (nvml.h `nvmlClocksEventReason*`).
pub mod clock_event {
    pub const GPU_IDLE: u64 = 0x1;
    pub const APPLICATIONS_CLOCKS: u64 = 0x2;
    pub const SW_POWER_CAP: u64 = 0x4;
    pub const HW_SLOWDOWN: u64 = 0x8;
    pub const SYNC_BOOST: u64 = 0x10;
    pub const SW_THERMAL: u64 = 0x20;
    pub const HW_THERMAL: u64 = 0x40;
    pub const HW_POWER_BRAKE: u64 = 0x80;
    pub const DISPLAY_CLOCK: u64 = 0x100;
    /// The bits that mean the hardware slowed the clocks down by itself.
    pub const HARDWARE: u64 = HW_SLOWDOWN | HW_THERMAL | HW_POWER_BRAKE;

    /// Names of the set bits, for people.
    pub fn names(bits: u64) -> Vec<&'static str> {
        [
            (GPU_IDLE, "gpu_idle"),
            (APPLICATIONS_CLOCKS, "applications_clocks"),
            (SW_POWER_CAP, "sw_power_cap"),
            (HW_SLOWDOWN, "hw_slowdown"),
            (SYNC_BOOST, "sync_boost"),
            (SW_THERMAL, "sw_thermal"),
            (HW_THERMAL, "hw_thermal"),
            (HW_POWER_BRAKE, "hw_power_brake"),
            (DISPLAY_CLOCK, "display_clock"),
        ]
        .into_iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| n)
        .collect()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub gpu: u32,
    pub uuid: String,
    /// Fraction of time a kernel ran over NVML's last sample period (0..1).
    pub util: Option<f64>,
    pub mem_copy_util: Option<f64>,
    pub mem_used_bytes: Option<u64>,
    pub mem_total_bytes: Option<u64>,
    pub sm_clock_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    pub clock_events: Option<u64>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    /// Counter since driver load.
    pub energy_j: Option<f64>,
    pub temp_c: Option<f64>,
    pub temp_slowdown_c: Option<f64>,
    pub ecc_corrected_volatile: Option<u64>,
    pub ecc_uncorrected_volatile: Option<u64>,
    pub ecc_corrected_aggregate: Option<u64>,
    pub ecc_uncorrected_aggregate: Option<u64>,
    pub remapped_rows_correctable: Option<u64>,
    pub remapped_rows_uncorrectable: Option<u64>,
    pub remap_pending: Option<bool>,
    pub remap_failure: Option<bool>,
    pub pcie_replays: Option<u64>,
    pub pcie_gen: Option<u32>,
    pub pcie_gen_max: Option<u32>,
    pub pcie_width: Option<u32>,
    pub pcie_width_max: Option<u32>,
    pub pcie_tx_bytes_per_s: Option<f64>,
    pub pcie_rx_bytes_per_s: Option<f64>,
    /// Sum of the DL replay, recovery and CRC error counters over the GPU's links.
    pub nvlink_errors: Option<u64>,
    /// Time the clocks were held down by power / thermal limits (counters, ns).
    pub violation_power_ns: Option<u64>,
    pub violation_thermal_ns: Option<u64>,
    /// GPM (Hopper and later): fractions of the last sample period.
    pub sm_active: Option<f64>,
    pub sm_occupancy: Option<f64>,
    pub tensor_active: Option<f64>,
    pub dram_active: Option<f64>,
}

/// A GPU's reading in one round: a sample, a gap (nothing read this round, e.g. a call timed
/// out or was skipped), or the GPU not answering (lost).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GpuReading {
    Sample(Box<GpuSample>),
    Gap { gpu: u32 },
    Lost { gpu: u32 },
}

impl GpuReading {
    pub fn gpu(&self) -> u32 {
        match self {
            GpuReading::Sample(s) => s.gpu,
            GpuReading::Gap { gpu } | GpuReading::Lost { gpu } => *gpu,
        }
    }
    pub fn sample(&self) -> Option<&GpuSample> {
        match self {
            GpuReading::Sample(s) => Some(s),
            _ => None,
        }
    }
}

/// Who a GPU client belongs to (from the agent's registry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Owner {
    pub job: u32,
    pub step: u32,
    /// The registered Slurm task's pid (the client may be one of its descendants).
    pub task: u32,
    pub uid: u32,
}

/// One process using a GPU (an MPS client, or a plain CUDA process without MPS).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientSample {
    pub gpu: u32,
    pub pid: u32,
    /// The MPS server (fault domain slot) it is a client of, where known.
    pub slot: Option<u32>,
    pub mem_used_bytes: Option<u64>,
    /// SM utilization NVML reports for this process (0..1); `None` where NVML gives none.
    pub sm_util: Option<f64>,
    pub owner: Option<Owner>,
    /// Its job's `--mps-threads` (its intended share of the GPU), where set.
    #[serde(default)]
    pub thread_pct: Option<u8>,
    /// Its job's `--mps-mem`, where set.
    #[serde(default)]
    pub mem_limit_bytes: Option<u64>,
    /// Its step times, where the application marks steps (`mpsr_step()`).
    #[serde(default)]
    pub steps: Option<crate::steps::StepSample>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NicSample {
    /// "mlx5_0/1" for an InfiniBand port, "eth0" for a network interface.
    pub port: String,
    pub rx_bytes: Option<u64>,
    pub tx_bytes: Option<u64>,
    /// Error counters summed (symbol, receive, link-downed, rx/tx errors).
    pub errors: Option<u64>,
    /// Transmit discards: congestion (a full queue), not a broken link; kept apart.
    #[serde(default)]
    pub discards: Option<u64>,
}

/// One round of telemetry. `t` is in seconds on a monotonic clock.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    pub t: f64,
    pub gpus: Vec<GpuReading>,
    pub clients: Vec<ClientSample>,
    pub nics: Vec<NicSample>,
}

impl Tick {
    pub fn gpu(&self, gpu: u32) -> Option<&GpuSample> {
        self.gpus
            .iter()
            .filter_map(GpuReading::sample)
            .find(|s| s.gpu == gpu)
    }
}
