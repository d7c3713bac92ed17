//! Real GPUs through NVML (nvml-wrapper). A round reads the cheap getters (about 1-6 µs each on
//! an H200), the process lists and per-process utilization; a slow round adds what goes to the
//! GPU for counters (energy ~4 ms, violation times ~0.7 ms, PCIe replays ~0.15 ms, field values,
//! link and throughput). A call a GPU does not support leaves its field `None`; GpuLost (or any
//! failure of the first getter) makes the whole reading `Lost`.

use crate::sample::{ClientSample, GpuReading, GpuSample};
use crate::source::{Attached, Source};
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, PcieUtilCounter, PerformancePolicy, TemperatureSensor,
    TemperatureThreshold,
};
use nvml_wrapper::enums::device::{SampleValue, UsedGpuMemory};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::{gpm_metrics_get, GpmSample};
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::*;
use nvml_wrapper::{Device, Nvml};
use std::collections::BTreeMap;

pub struct NvmlSource {
    nvml: &'static Nvml,
    gpus: Vec<(u32, String)>,
    /// Per GPU: the last per-process utilization timestamp and GPM sample.
    last_seen: BTreeMap<u32, u64>,
    gpm: BTreeMap<u32, GpmSample<'static>>,
    /// The slow counters of the last slow round, carried into the rounds between.
    slow: BTreeMap<u32, GpuSample>,
    /// Per GPU: per-process utilization of the last slow round (2.7 ms of CPU per call on an
    /// H200, so not every round), and whether NVML answered.
    util: BTreeMap<u32, (BTreeMap<u32, f64>, bool)>,
}

/// A field value as a count; `None` when NVML gave none for this field.
fn field_u64<E>(
    r: Result<nvml_wrapper::struct_wrappers::device::FieldValueSample, E>,
) -> Option<u64> {
    match r.ok()?.value.ok()? {
        SampleValue::U32(x) => Some(x as u64),
        SampleValue::U64(x) => Some(x),
        SampleValue::I64(x) => u64::try_from(x).ok(),
        SampleValue::F64(x) => (x >= 0.0).then_some(x as u64),
    }
}

/// The MPS server process: NVML lists it as a compute process and credits it with all its
/// clients' utilization (measured, driver 580); it is no job's client.
fn is_mps_server(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|c| c.starts_with("nvidia-cuda-mps"))
}

impl NvmlSource {
    pub fn new(nvml: &'static Nvml, gpus: Vec<(u32, String)>) -> NvmlSource {
        NvmlSource {
            nvml,
            gpus,
            last_seen: BTreeMap::new(),
            gpm: BTreeMap::new(),
            slow: BTreeMap::new(),
            util: BTreeMap::new(),
        }
    }

    fn gpm(&mut self, gpu: u32, d: &Device<'static>, s: &mut GpuSample) {
        if !d.gpm_support().unwrap_or(false) {
            return;
        }
        let Ok(now) = d.gpm_sample() else { return };
        if let Some(prev) = self.gpm.get(&gpu) {
            use nvml_wrapper::enums::gpm::GpmMetricId as M;
            let ids = [M::SmUtil, M::SmOccupancy, M::AnyTensorUtil, M::DramBwUtil];
            if let Ok(res) = gpm_metrics_get(self.nvml, prev, &now, &ids) {
                let v: Vec<Option<f64>> = res
                    .into_iter()
                    .map(|r| r.ok().map(|m| m.value / 100.0))
                    .collect();
                s.sm_active = v[0];
                s.sm_occupancy = v[1];
                s.tensor_active = v[2];
                s.dram_active = v[3];
            }
        }
        self.gpm.insert(gpu, now);
    }

    fn fast(&mut self, gpu: u32, uuid: &str, d: &Device<'static>) -> Result<GpuSample, NvmlError> {
        // The first call tells whether the GPU answers at all.
        let u = d.utilization_rates()?;
        let mut s = GpuSample {
            gpu,
            uuid: uuid.to_string(),
            util: Some(u.gpu as f64 / 100.0),
            mem_copy_util: Some(u.memory as f64 / 100.0),
            ..GpuSample::default()
        };
        if let Ok(m) = d.memory_info() {
            s.mem_used_bytes = Some(m.used);
            s.mem_total_bytes = Some(m.total);
        }
        s.sm_clock_mhz = d.clock_info(Clock::SM).ok();
        s.clock_events = d.current_throttle_reasons().ok().map(|r| r.bits());
        s.power_w = d.power_usage().ok().map(|mw| mw as f64 / 1000.0);
        s.temp_c = d.temperature(TemperatureSensor::Gpu).ok().map(f64::from);
        s.ecc_corrected_volatile = d
            .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
            .ok();
        s.ecc_uncorrected_volatile = d
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok();
        s.pcie_gen = d.current_pcie_link_gen().ok();
        s.pcie_width = d.current_pcie_link_width().ok();
        // Row-remap flags every round (two field values): a pending remap needs a reset now.
        let flags = [NVML_FI_DEV_REMAPPED_PENDING, NVML_FI_DEV_REMAPPED_FAILURE].map(FieldId);
        if let Ok(v) = d.field_values_for(&flags) {
            let v: Vec<Option<bool>> = v
                .into_iter()
                .map(|r| field_u64(r).map(|x| x != 0))
                .collect();
            s.remap_pending = v[0];
            s.remap_failure = v[1];
        }
        self.gpm(gpu, d, &mut s);
        Ok(s)
    }

    fn slow(&self, d: &Device<'static>, s: &mut GpuSample) {
        s.sm_clock_max_mhz = d.max_clock_info(Clock::SM).ok();
        s.power_limit_w = d.enforced_power_limit().ok().map(|mw| mw as f64 / 1000.0);
        s.energy_j = d
            .total_energy_consumption()
            .ok()
            .map(|mj| mj as f64 / 1000.0);
        s.temp_slowdown_c = d
            .temperature_threshold(TemperatureThreshold::Slowdown)
            .ok()
            .map(f64::from);
        s.ecc_corrected_aggregate = d
            .total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)
            .ok();
        s.ecc_uncorrected_aggregate = d
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate)
            .ok();
        s.pcie_replays = d.pcie_replay_counter().ok().map(u64::from);
        s.pcie_gen_max = d.max_pcie_link_gen().ok();
        s.pcie_width_max = d.max_pcie_link_width().ok();
        s.pcie_tx_bytes_per_s = d
            .pcie_throughput(PcieUtilCounter::Send)
            .ok()
            .map(|kb| kb as f64 * 1024.0);
        s.pcie_rx_bytes_per_s = d
            .pcie_throughput(PcieUtilCounter::Receive)
            .ok()
            .map(|kb| kb as f64 * 1024.0);
        s.violation_power_ns = d
            .violation_status(PerformancePolicy::Power)
            .ok()
            .map(|v| v.violation_time);
        s.violation_thermal_ns = d
            .violation_status(PerformancePolicy::Thermal)
            .ok()
            .map(|v| v.violation_time);
        let ids = [
            NVML_FI_DEV_REMAPPED_COR,
            NVML_FI_DEV_REMAPPED_UNC,
            NVML_FI_DEV_REMAPPED_PENDING,
            NVML_FI_DEV_REMAPPED_FAILURE,
            NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
            NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
            NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
            NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
        ]
        .map(FieldId);
        let vals: Vec<Option<u64>> = match d.field_values_for(&ids) {
            Ok(v) => v.into_iter().map(field_u64).collect(),
            Err(_) => vec![None; ids.len()],
        };
        s.remapped_rows_correctable = vals[0];
        s.remapped_rows_uncorrectable = vals[1];
        s.remap_pending = vals[2].map(|v| v != 0);
        s.remap_failure = vals[3].map(|v| v != 0);
        let nvl: Vec<u64> = vals[4..].iter().flatten().copied().collect();
        s.nvlink_errors = (!nvl.is_empty()).then(|| nvl.iter().sum());
    }

    /// `idle`: the GPU's utilization read 0 this round.
    fn clients(
        &mut self,
        gpu: u32,
        slow: bool,
        idle: bool,
        d: &Device<'static>,
        out: &mut Vec<ClientSample>,
    ) {
        let mut mem: BTreeMap<u32, Option<u64>> = BTreeMap::new();
        let lists = [
            d.running_compute_processes(),
            d.mps_running_compute_processes(),
        ];
        for p in lists.into_iter().flatten().flatten() {
            let m = match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            };
            let e = mem.entry(p.pid).or_insert(None);
            *e = e.or(m);
        }
        if slow || !self.util.contains_key(&gpu) {
            let last = self.last_seen.get(&gpu).copied();
            let mut util: BTreeMap<u32, f64> = BTreeMap::new();
            let answered = match d.process_utilization_stats(last) {
                Ok(samples) => {
                    for s in &samples {
                        let u = util.entry(s.pid).or_insert(0.0);
                        *u = u.max(s.sm_util as f64 / 100.0);
                    }
                    if let Some(ts) = samples.iter().map(|s| s.timestamp).max() {
                        self.last_seen.insert(gpu, ts);
                    }
                    true
                }
                // NotFound: no process ran a kernel in the period.
                Err(NvmlError::NotFound) => true,
                Err(_) => false,
            };
            self.util.insert(gpu, (util, answered));
        }
        let (util, answered) = self.util.get(&gpu).cloned().unwrap_or_default();
        for (pid, m) in mem {
            if is_mps_server(pid) {
                continue;
            }
            out.push(ClientSample {
                gpu,
                pid,
                slot: None,
                mem_used_bytes: m,
                // A process without a sample is taken as idle only when the whole GPU is: which
                // processes NVML samples under MPS is measured (BENCHMARKS.md), not assumed.
                sm_util: util
                    .get(&pid)
                    .copied()
                    .or((answered && idle).then_some(0.0)),
                owner: None,
                thread_pct: None,
                mem_limit_bytes: None,
                steps: None,
            });
        }
    }
}

impl Source for NvmlSource {
    fn read(&mut self, slow: bool, _attached: &[Attached]) -> (Vec<GpuReading>, Vec<ClientSample>) {
        let mut readings = Vec::new();
        let mut clients = Vec::new();
        for (gpu, uuid) in self.gpus.clone() {
            let Ok(d) = self.nvml.device_by_index(gpu) else {
                readings.push(GpuReading::Lost { gpu });
                continue;
            };
            match self.fast(gpu, &uuid, &d) {
                Ok(mut s) => {
                    if slow {
                        let mut sl = GpuSample::default();
                        self.slow(&d, &mut sl);
                        self.slow.insert(gpu, sl);
                    }
                    if let Some(sl) = self.slow.get(&gpu) {
                        merge_slow(&mut s, sl);
                    }
                    let idle = s.util == Some(0.0);
                    self.clients(gpu, slow, idle, &d, &mut clients);
                    readings.push(GpuReading::Sample(Box::new(s)));
                }
                Err(_) => readings.push(GpuReading::Lost { gpu }),
            }
        }
        (readings, clients)
    }
}

/// Copies the slow counters of the last slow round into a fast round's sample.
fn merge_slow(s: &mut GpuSample, sl: &GpuSample) {
    s.sm_clock_max_mhz = sl.sm_clock_max_mhz;
    s.power_limit_w = sl.power_limit_w;
    s.energy_j = sl.energy_j;
    s.temp_slowdown_c = sl.temp_slowdown_c;
    s.ecc_corrected_aggregate = sl.ecc_corrected_aggregate;
    s.ecc_uncorrected_aggregate = sl.ecc_uncorrected_aggregate;
    s.pcie_replays = sl.pcie_replays;
    s.pcie_gen_max = sl.pcie_gen_max;
    s.pcie_width_max = sl.pcie_width_max;
    s.pcie_tx_bytes_per_s = sl.pcie_tx_bytes_per_s;
    s.pcie_rx_bytes_per_s = sl.pcie_rx_bytes_per_s;
    s.violation_power_ns = sl.violation_power_ns;
    s.violation_thermal_ns = sl.violation_thermal_ns;
    s.remapped_rows_correctable = sl.remapped_rows_correctable;
    s.remapped_rows_uncorrectable = sl.remapped_rows_uncorrectable;
    // Read every round where NVML answers; the slow round's value only where it did not.
    s.remap_pending = s.remap_pending.or(sl.remap_pending);
    s.remap_failure = s.remap_failure.or(sl.remap_failure);
    s.nvlink_errors = sl.nvlink_errors;
}
