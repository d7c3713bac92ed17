//! CPU (thread CPU time) and wall time of each NVML call the telemetry round makes, on GPU 0, 50
//! calls each after a warm-up. Run on a GPU node:
//! `nvml_cost` (built with `cargo build --release -p mpsr-telemetry --example nvml_cost`).

use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, PcieUtilCounter, PerformancePolicy, TemperatureSensor,
};
use nvml_wrapper::Nvml;
use std::time::Instant;

fn cpu() -> f64 {
    let mut ts = libc_timespec::default();
    // SAFETY: ts is a valid timespec-sized buffer; CLOCK_THREAD_CPUTIME_ID = 3 on Linux.
    unsafe { clock_gettime(3, &mut ts) };
    ts.s as f64 + ts.ns as f64 / 1e9
}

#[repr(C)]
#[derive(Default)]
struct libc_timespec {
    s: i64,
    ns: i64,
}

extern "C" {
    fn clock_gettime(clk: i32, ts: *mut libc_timespec) -> i32;
}

fn main() {
    let nvml = Nvml::init().expect("NVML");
    let d = nvml.device_by_index(0).expect("GPU 0");
    let n = 50;
    let time = |name: &str, f: &mut dyn FnMut() -> bool| {
        f();
        let (c0, w0) = (cpu(), Instant::now());
        let mut ok = true;
        for _ in 0..n {
            ok &= f();
        }
        let (c, w) = (cpu() - c0, w0.elapsed().as_secs_f64());
        println!(
            "{name:<36} cpu {:>9.1} us  wall {:>9.1} us  {}",
            c / n as f64 * 1e6,
            w / n as f64 * 1e6,
            if ok { "ok" } else { "error/unsupported" }
        );
    };
    time("utilization_rates", &mut || d.utilization_rates().is_ok());
    time("memory_info", &mut || d.memory_info().is_ok());
    time("clock_info(SM)", &mut || d.clock_info(Clock::SM).is_ok());
    time("current_throttle_reasons", &mut || {
        d.current_throttle_reasons().is_ok()
    });
    time("power_usage", &mut || d.power_usage().is_ok());
    time("temperature", &mut || {
        d.temperature(TemperatureSensor::Gpu).is_ok()
    });
    time("total_ecc_errors x2 (volatile)", &mut || {
        d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
            .is_ok()
            && d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                .is_ok()
    });
    time("pcie link gen+width", &mut || {
        d.current_pcie_link_gen().is_ok() && d.current_pcie_link_width().is_ok()
    });
    time("gpm_sample", &mut || d.gpm_sample().is_ok());
    time("running_compute_processes", &mut || {
        d.running_compute_processes().is_ok()
    });
    time("mps_running_compute_processes", &mut || {
        d.mps_running_compute_processes().is_ok()
    });
    time("process_utilization_stats", &mut || {
        matches!(
            d.process_utilization_stats(None),
            Ok(_) | Err(nvml_wrapper::error::NvmlError::NotFound)
        )
    });
    time("total_energy_consumption", &mut || {
        d.total_energy_consumption().is_ok()
    });
    time("violation_status x2", &mut || {
        d.violation_status(PerformancePolicy::Power).is_ok()
            && d.violation_status(PerformancePolicy::Thermal).is_ok()
    });
    time("pcie_replay_counter", &mut || {
        d.pcie_replay_counter().is_ok()
    });
    time("pcie_throughput x2", &mut || {
        d.pcie_throughput(PcieUtilCounter::Send).is_ok()
            && d.pcie_throughput(PcieUtilCounter::Receive).is_ok()
    });
}
