//! What the agent's telemetry thread reads of the truth: a round every `interval_s`, the slow
//! counters (PCIe replays and link maxima, NVLink errors, row remaps, the slowdown temperature)
//! and per-process lists only every `slow_every` rounds and carried between, as the NVML source
//! does. MPS clients get no utilization of their own from NVML (measured on an H200). Rounds
//! are handed to the detector as JSON, so one benchmark drives any version of the telemetry crate.

use crate::model::{Truth, MEM_TOTAL, SLOWDOWN_C, SM_MAX_MHZ};
use serde_json::{json, Value};

/// How a version of the agent samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub interval_s: f64,
    pub slow_every: u32,
    /// Whether NIC transmit discards (congestion) are counted apart from errors; before, the NIC
    /// reader summed them into `errors`.
    pub discards_apart: bool,
    /// Whether the row-remap pending/failure flags are read every round (two NVML field values)
    /// rather than with the slow counters.
    pub remap_fast: bool,
}

impl Sampling {
    /// What 0.2.0 (main at 3270ff1) did: 5 s rounds, slow counters every 12th.
    pub const V0_2: Sampling = Sampling {
        interval_s: 5.0,
        slow_every: 12,
        discards_apart: false,
        remap_fast: false,
    };
    /// The agent's defaults now: 1 s rounds of the cheap fields, slow counters every 60 s.
    pub const FAST: Sampling = Sampling {
        interval_s: 1.0,
        slow_every: 60,
        discards_apart: true,
        remap_fast: true,
    };
}

/// The slow fields of the last slow round, per GPU.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub sampling: Sampling,
    round: u64,
    slow: Vec<Value>,
}

impl Sampler {
    pub fn new(sampling: Sampling) -> Sampler {
        Sampler {
            sampling,
            round: 0,
            slow: Vec::new(),
        }
    }

    /// One round: the Tick as JSON.
    pub fn round(&mut self, truth: &Truth) -> Value {
        let slow_round = self.round.is_multiple_of(self.sampling.slow_every as u64);
        self.round += 1;
        if self.slow.len() < truth.gpus.len() {
            self.slow.resize(truth.gpus.len(), Value::Null);
        }
        let mut gpus = Vec::new();
        for g in &truth.gpus {
            if g.lost {
                gpus.push(json!({"kind": "lost", "gpu": g.gpu}));
                continue;
            }
            if slow_round || self.slow[g.gpu as usize].is_null() {
                self.slow[g.gpu as usize] = json!({
                    "sm_clock_max_mhz": SM_MAX_MHZ as u32,
                    "temp_slowdown_c": SLOWDOWN_C,
                    "power_limit_w": 700.0,
                    "pcie_replays": g.replays,
                    "pcie_gen_max": 5,
                    "pcie_width_max": 16,
                    "nvlink_errors": g.nvlink_errors,
                    "remap_pending": g.remap_pending,
                    "remap_failure": false,
                    "remapped_rows_correctable": 0,
                    "remapped_rows_uncorrectable": 0,
                });
            }
            let mut s = json!({
                "kind": "sample",
                "gpu": g.gpu,
                "uuid": format!("GPU-bench-{:04}", g.gpu),
                "util": g.util,
                "mem_copy_util": g.util * 0.4,
                "mem_used_bytes": g.mem_used,
                "mem_total_bytes": MEM_TOTAL,
                "sm_clock_mhz": g.clock_mhz as u32,
                "clock_events": g.events,
                "power_w": g.power_w,
                "temp_c": g.temp_c,
                "ecc_corrected_volatile": g.ecc_sbe,
                "ecc_uncorrected_volatile": g.ecc_dbe,
                "pcie_gen": g.pcie_gen,
                "pcie_width": g.pcie_width,
                "sm_active": g.sm_active,
                "sm_occupancy": g.sm_occupancy,
                "tensor_active": g.tensor_active,
                "dram_active": g.dram_active,
            });
            if let (Some(o), Some(sl)) = (s.as_object_mut(), self.slow[g.gpu as usize].as_object())
            {
                for (k, v) in sl {
                    o.insert(k.clone(), v.clone());
                }
            }
            if let (true, Some(o)) = (self.sampling.remap_fast, s.as_object_mut()) {
                o.insert("remap_pending".into(), json!(g.remap_pending));
                o.insert("remap_failure".into(), json!(false));
            }
            gpus.push(s);
        }
        let clients: Vec<Value> = truth
            .clients
            .iter()
            .filter(|c| !truth.gpus[c.gpu as usize].lost)
            .map(|c| {
                json!({
                    "gpu": c.gpu,
                    "pid": c.pid,
                    "slot": 0,
                    "mem_used_bytes": c.mem,
                    "sm_util": null,
                    "owner": {"job": c.job, "step": 0, "task": c.pid, "uid": c.uid},
                    "thread_pct": c.thread_pct,
                    "mem_limit_bytes": c.mem_limit,
                    "steps": c.step.map(|st| {
                        // What the agent reads of the step file this round: steps that ended
                        // (none while stalled or idle) and how long the one under way has run.
                        let moving = st.stalled_for.is_none() && !st.idle;
                        json!({
                            "steps": (truth.t / st.step_s) as u64,
                            "step_s": st.step_s,
                            "max_s": moving.then_some(st.step_s * 1.08),
                            "age_s": if st.idle { None } else { Some(st.stalled_for.unwrap_or(st.step_s * 0.5)) },
                        })
                    }),
                })
            })
            .collect();
        let nics: Vec<Value> = truth
            .nics
            .iter()
            .map(|n| {
                let errors = if self.sampling.discards_apart {
                    n.errors
                } else {
                    n.errors + n.discards
                };
                json!({"port": n.port, "rx_bytes": 0, "tx_bytes": 0, "errors": errors, "discards": n.discards})
            })
            .collect();
        json!({"t": truth.t, "gpus": gpus, "clients": clients, "nics": nics})
    }
}
