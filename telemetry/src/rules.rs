//! The pathology rules, as a table (like the Xid table): what each one measures, its thresholds
//! with hysteresis (raise at `raise`, clear only past `clear`), how long the condition must hold
//! (`window_s`) and how long it must be gone (`clear_s`), its severity and where the numbers come
//! from. A site tunes a rule by id in agent.toml (`[telemetry.rules.<id>]`); the detector only
//! reads this table.

use crate::sample::{clock_event, GpuSample};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleId {
    HwSlowdown,
    Thermal,
    EccUncorrected,
    EccStorm,
    RowRemapPending,
    RowRemapFailure,
    RowRemapUncorrectable,
    PcieReplays,
    PcieWidth,
    PcieGen,
    NvlinkErrors,
    GpuUnreadable,
    ClockSkew,
    Straggler,
    MemoryImbalance,
    NearOom,
    MpsHog,
    MpsContention,
    IdleAllocation,
    NicErrors,
    NodeSlowdown,
    StepSkew,
    StepSpike,
}

impl RuleId {
    pub fn name(self) -> &'static str {
        RULES
            .iter()
            .find(|r| r.id == self)
            .map(|r| r.name)
            .unwrap_or("unknown")
    }
    pub fn from_name(name: &str) -> Option<RuleId> {
        RULES.iter().find(|r| r.name == name).map(|r| r.id)
    }
}

/// Hardware findings make the node unhealthy (the health check drains it with an `mpsr:`
/// reason); advisory ones are events and go into the affected job's report, never a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Hardware,
    Advisory,
}

/// What a rule measures, and for which subject.
#[derive(Debug, Clone, Copy)]
pub enum Measure {
    /// A value of each GPU's sample; `None` = not supported or not applicable this round.
    Gpu(fn(&GpuSample) -> Option<f64>),
    /// Growth per minute of a GPU counter over the last minute (a counter that went down was
    /// reset: its history restarts).
    GpuRate(fn(&GpuSample) -> Option<u64>),
    /// PCIe replays per minute over the last minute, as a fraction of DCGM's bound for the
    /// link's generation and width (BER 1e-12 per lane).
    PcieReplayBound,
    /// 1 while the GPU does not answer telemetry at all.
    GpuUnreadable,
    /// A busy GPU's SM clock over the median clock of the node's other busy GPUs, among GPUs
    /// whose clocks no power or thermal management explains (no clock-event bit).
    ClockVsPeers,
    /// The node: the median over its busy GPUs of SM clock over maximum clock, where no
    /// clock-event bit explains a lower clock (all GPUs slow at once).
    NodeClockVsMax,
    /// Per rank: its pace against its job's other ranks on this node: its utilization over
    /// theirs (a rank near 0 is paused, e.g. writing a checkpoint, not slow), and, where every
    /// rank reads busy, the peers' tensor activity over its own (peers that spin in a collective
    /// waiting for a slow rank read 100 % busy too).
    RankUtilVsPeers,
    /// Per job: its largest rank's GPU memory over its smallest (1 when they differ by < 1 GiB).
    JobMemorySpread,
    /// Per client with a memory limit (`--mps-mem`): its memory over its limit; per GPU: memory
    /// used over total while it grew (by 1 GiB in 10 minutes: a server that preallocates 95 % and
    /// holds it is intended use).
    MemoryUsed,
    /// Per client: its share of the SM utilization of all clients on its GPU, while the GPU is
    /// saturated (95 %) and clients of other jobs share it.
    GpuShare,
    /// Per MPS server: the GPU's utilization while clients of two or more jobs share that server
    /// (and no other server on the GPU has clients) and their thread limits do not divide the GPU
    /// (a client without `--mps-threads`, or limits adding up to more than 100 %); 0 otherwise:
    /// packing under limits that divide the GPU is intended.
    ServerSaturated,
    /// Per job: 1 while every rank holds at least 1 GiB and computes nothing.
    IdleAllocation,
    /// Per NIC port: errors per minute over the last minute.
    NicErrorRate,
    /// Per rank marking steps: its step time over its job's other ranks' median.
    StepVsPeers,
    /// Per rank marking steps: its step time over its own recent median.
    StepVsBaseline,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Bad when the value is at or above `raise`; good again below `clear`.
    Above,
    /// Bad when the value is at or below `raise`; good again above `clear`.
    Below,
}

#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub id: RuleId,
    /// The id as written in config, events and metrics.
    pub name: &'static str,
    pub severity: Severity,
    pub measure: Measure,
    pub direction: Direction,
    pub raise: f64,
    pub clear: f64,
    pub window_s: f64,
    pub clear_s: f64,
    /// Share of the readings in `window_s` that must be bad to raise (windowed evidence: a
    /// condition that flaps at this duty cycle is found; one good reading restarts nothing).
    pub duty: f64,
    /// What the finding means, for people.
    pub what: &'static str,
    /// Where the threshold comes from.
    pub source: &'static str,
}

impl Rule {
    pub fn breaches(&self, v: f64) -> bool {
        match self.direction {
            Direction::Above => v >= self.raise,
            Direction::Below => v <= self.raise,
        }
    }
    pub fn recovered(&self, v: f64) -> bool {
        match self.direction {
            Direction::Above => v < self.clear,
            Direction::Below => v > self.clear,
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;
pub const IDLE_ALLOCATION_BYTES: u64 = 1 << 30;

fn flag(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

pub static RULES: &[Rule] = &[
    Rule {
        id: RuleId::HwSlowdown,
        name: "hw_slowdown",
        severity: Severity::Hardware,
        measure: Measure::Gpu(|s| s.clock_events.map(|b| flag(b & clock_event::HARDWARE != 0))),
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 10.0,
        clear_s: 120.0,
        duty: 0.4,
        what: "clocks held down by the hardware (HW slowdown, HW thermal or power-brake clock events)",
        source: "NVML clocks-event reasons; DCGM THERMAL/POWER watches need 1 min of data; Azure HPC \
                 throttling check ignores GPU_IDLE and SW_POWER_CAP, so do we",
    },
    Rule {
        id: RuleId::Thermal,
        name: "thermal",
        severity: Severity::Hardware,
        measure: Measure::Gpu(|s| Some(s.temp_c? - s.temp_slowdown_c?)),
        direction: Direction::Above,
        raise: -3.0,
        clear: -8.0,
        window_s: 10.0,
        clear_s: 120.0,
        // A quarter of the readings: a GPU at its threshold reads above it about half the time
        // (sensor noise), and flaps on top of that; healthy GPUs stay far below it.
        duty: 0.25,
        what: "GPU within 3 °C of its slowdown temperature",
        source: "NVML temperature threshold SLOWDOWN; DCGM THERMAL watch (1 min of data)",
    },
    Rule {
        id: RuleId::EccUncorrected,
        name: "ecc_uncorrected",
        severity: Severity::Hardware,
        measure: Measure::GpuRate(|s| s.ecc_uncorrected_volatile),
        direction: Direction::Above,
        raise: f64::MIN_POSITIVE,
        clear: f64::MIN_POSITIVE,
        window_s: 0.0,
        clear_s: 3600.0,
        duty: 0.4,
        what: "uncorrectable ECC errors grew",
        source: "DCGM MEM watch: any DBE fails the GPU (Xid 48)",
    },
    Rule {
        id: RuleId::EccStorm,
        name: "ecc_storm",
        severity: Severity::Hardware,
        measure: Measure::GpuRate(|s| s.ecc_corrected_volatile),
        direction: Direction::Above,
        raise: 10.0,
        clear: 1.0,
        window_s: 0.0,
        clear_s: 600.0,
        duty: 0.4,
        what: "corrected ECC errors at 10 per minute or more",
        source: "DCGM MAX_SBE_RATE 10 (DcgmGPUHardwareLimits.h)",
    },
    Rule {
        id: RuleId::RowRemapPending,
        name: "row_remap_pending",
        severity: Severity::Hardware,
        measure: Measure::Gpu(|s| s.remap_pending.map(flag)),
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 0.0,
        clear_s: 0.0,
        duty: 0.4,
        what: "a row remap is pending: the GPU needs a reset",
        source: "nvmlDeviceGetRemappedRows isPending; DCGM Xid 63 WARN; Azure azure_gpu_ecc.nhc",
    },
    Rule {
        id: RuleId::RowRemapFailure,
        name: "row_remap_failure",
        severity: Severity::Hardware,
        measure: Measure::Gpu(|s| s.remap_failure.map(flag)),
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 0.0,
        clear_s: 0.0,
        duty: 0.4,
        what: "a row remap failed",
        source: "nvmlDeviceGetRemappedRows failureOccurred; DCGM Xid 64 FAIL",
    },
    Rule {
        id: RuleId::RowRemapUncorrectable,
        name: "row_remap_uncorrectable",
        severity: Severity::Hardware,
        measure: Measure::Gpu(|s| s.remapped_rows_uncorrectable.map(|v| v as f64)),
        direction: Direction::Above,
        raise: 512.0,
        clear: 512.0,
        window_s: 0.0,
        clear_s: 0.0,
        duty: 0.4,
        what: "512 or more rows remapped for uncorrectable errors",
        source: "DCGM MAX_ROW_REMAP_UNCORRECTABLE 512; Azure azure_gpu_ecc.nhc",
    },
    Rule {
        id: RuleId::PcieReplays,
        name: "pcie_replays",
        severity: Severity::Hardware,
        measure: Measure::PcieReplayBound,
        direction: Direction::Above,
        raise: 1.0,
        clear: 0.5,
        window_s: 0.0,
        clear_s: 600.0,
        duty: 0.4,
        what: "PCIe replays per minute above the link's BER bound",
        source: "DCGM PCIE health: ceil(lanes x per-lane rate), Gen1..6 = 0.15/0.3/0.48/0.96/1.92/3.84 per min",
    },
    Rule {
        id: RuleId::PcieWidth,
        name: "pcie_width",
        severity: Severity::Hardware,
        measure: Measure::Gpu(|s| Some(flag(s.pcie_width? < s.pcie_width_max?))),
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 5.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "PCIe link narrower than the GPU's maximum",
        source: "NVML current/max link width (the width does not change with load)",
    },
    Rule {
        id: RuleId::PcieGen,
        name: "pcie_gen",
        severity: Severity::Hardware,
        // The link trains down at idle to save power: only a busy GPU's link counts.
        measure: Measure::Gpu(|s| {
            if s.util? < 0.5 {
                return None;
            }
            Some(flag(s.pcie_gen? < s.pcie_gen_max?))
        }),
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 15.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "PCIe link below its maximum generation while the GPU is busy",
        source: "NVML current/max link generation",
    },
    Rule {
        id: RuleId::NvlinkErrors,
        name: "nvlink_errors",
        severity: Severity::Hardware,
        measure: Measure::GpuRate(|s| s.nvlink_errors),
        direction: Direction::Above,
        raise: 1.0,
        clear: 0.1,
        window_s: 0.0,
        clear_s: 600.0,
        duty: 0.4,
        what: "NVLink replay/recovery/CRC errors growing",
        source: "DCGM MAX_NVLINK_ERROR 1 (DcgmGPUHardwareLimits.h)",
    },
    Rule {
        id: RuleId::GpuUnreadable,
        name: "gpu_unreadable",
        severity: Severity::Hardware,
        measure: Measure::GpuUnreadable,
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 5.0,
        clear_s: 10.0,
        duty: 0.6,
        what: "NVML does not answer for this GPU (lost)",
        source: "NVML GpuLost; the fault path drains at once on Xid 79, this catches a silent loss",
    },
    Rule {
        id: RuleId::ClockSkew,
        name: "clock_skew",
        severity: Severity::Advisory,
        measure: Measure::ClockVsPeers,
        direction: Direction::Below,
        raise: 0.9,
        clear: 0.95,
        window_s: 20.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "busy GPU clocked 10 % or more below the node's other busy GPUs, no clock-event bit explaining it",
        source: "fail-slow detection by peer comparison (Falcon/Greyhound); threshold ours",
    },
    Rule {
        id: RuleId::Straggler,
        name: "straggler",
        severity: Severity::Advisory,
        measure: Measure::RankUtilVsPeers,
        direction: Direction::Below,
        // 0.75, not 0.7: a rank at 0.7x reads around 0.7 with noise, half of it above a 0.7 line.
        raise: 0.75,
        clear: 0.85,
        window_s: 20.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "rank at 0.7x or less of its peers' pace (utilization, or tensor activity where the peers wait for it)",
        source: "nvidia-resiliency-ext straggler detection: relative score vs peers, its 0.7 example \
                 threshold; a rank below 0.15x is paused (a checkpoint), not slow",
    },
    Rule {
        id: RuleId::MemoryImbalance,
        name: "memory_imbalance",
        severity: Severity::Advisory,
        measure: Measure::JobMemorySpread,
        direction: Direction::Above,
        raise: 1.5,
        clear: 1.25,
        window_s: 20.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "a job's largest rank holds 1.5x the GPU memory of its smallest (and 1 GiB more)",
        source: "ours (uneven partitioning / KV cache skew, telemetry.md section 1)",
    },
    Rule {
        id: RuleId::NearOom,
        name: "near_oom",
        severity: Severity::Advisory,
        measure: Measure::MemoryUsed,
        direction: Direction::Above,
        raise: 0.95,
        clear: 0.90,
        window_s: 10.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "a client at 95 % of its own memory limit, or a GPU 95 % full and still growing",
        source: "ours",
    },
    Rule {
        id: RuleId::MpsHog,
        name: "mps_hog",
        severity: Severity::Advisory,
        measure: Measure::GpuShare,
        direction: Direction::Above,
        raise: 0.9,
        clear: 0.7,
        window_s: 30.0,
        clear_s: 30.0,
        duty: 0.4,
        what: "one client takes 90 % of a saturated GPU shared with other jobs (they may be starved)",
        source: "ours; needs per-process utilization, which NVML gives for processes without MPS \
                 only (under MPS see mps_contention)",
    },
    Rule {
        id: RuleId::MpsContention,
        name: "mps_contention",
        severity: Severity::Advisory,
        measure: Measure::ServerSaturated,
        direction: Direction::Above,
        raise: 0.95,
        clear: 0.9,
        window_s: 20.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "an MPS server shared by several jobs keeps the GPU saturated and a client has no --mps-threads limit: it may starve the others (all limited: the packing asked for)",
        source: "measured on an H200: a bf16 GEMM beside a small-kernel client cut its rate 14x \
                 (72.7k -> 4.9k/s, p99 23 us -> 1.6 ms); NVML gives no per-client utilization under \
                 MPS, so the saturated shared server is the signal; limit with --mps-threads",
    },
    Rule {
        id: RuleId::IdleAllocation,
        name: "idle_allocation",
        severity: Severity::Advisory,
        measure: Measure::IdleAllocation,
        direction: Direction::Above,
        raise: 0.5,
        clear: 0.5,
        window_s: 1800.0,
        clear_s: 60.0,
        duty: 0.9,
        what: "every rank of a job holds 1 GiB or more of GPU memory and has computed nothing for 30 minutes",
        source: "ours",
    },
    Rule {
        id: RuleId::NicErrors,
        name: "nic_errors",
        severity: Severity::Advisory,
        measure: Measure::NicErrorRate,
        direction: Direction::Above,
        raise: 3.0,
        clear: 0.5,
        window_s: 0.0,
        clear_s: 600.0,
        duty: 0.4,
        what: "network port error counters growing at 3 per minute or more (congestion discards apart)",
        source: "ours (IB/RoCE faults show as GPUs waiting in collectives, telemetry.md section 1); \
                 3 events in 10 s are needed for a short-span rate, a few background errors an hour \
                 never reach it; port_xmit_discards is congestion, not an error (kept apart)",
    },
    Rule {
        id: RuleId::NodeSlowdown,
        name: "node_slowdown",
        severity: Severity::Advisory,
        measure: Measure::NodeClockVsMax,
        direction: Direction::Below,
        raise: 0.9,
        clear: 0.95,
        window_s: 20.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "the node's busy GPUs clocked 10 % or more below their maximum with no clock-event bit: \
               the whole node is slow (peers on the node cannot show it)",
        source: "arXiv 2509.18114 (node-level skews); a busy GPU runs at its boost clock unless a \
                 clock-event reason says why not (NVML); threshold ours",
    },
    Rule {
        id: RuleId::StepSkew,
        name: "step_skew",
        severity: Severity::Advisory,
        measure: Measure::StepVsPeers,
        direction: Direction::Above,
        // 1.33x the peers' step time: the straggler rule's 0.75x pace.
        raise: 1.33,
        clear: 1.15,
        window_s: 20.0,
        clear_s: 60.0,
        duty: 0.4,
        what: "a rank's step time (mpsr_step) 1.33x its job's other ranks' median or more (a step still running counts as long as it has run)",
        source: "arXiv 2509.18114 (per-rank skew in multi-GPU inference); the straggler rule's 0.75x pace",
    },
    Rule {
        id: RuleId::StepSpike,
        name: "step_spike",
        severity: Severity::Advisory,
        measure: Measure::StepVsBaseline,
        direction: Direction::Above,
        raise: 2.0,
        clear: 1.3,
        window_s: 5.0,
        clear_s: 30.0,
        duty: 0.4,
        what: "a rank's step time twice its own median of the 5 minutes before or more: a latency spike, or a host-side stall (data loader, CPU) while no step ends",
        source: "arXiv 2509.18114 (latency spikes: TTFT, per-token, iteration time); threshold ours",
    },
];

/// DCGM's expected PCIe replays per minute for a link (BER 1e-12 per lane).
pub fn pcie_replay_bound_per_min(gen: u32, width: u32) -> Option<f64> {
    let per_lane = match gen {
        1 => 0.15,
        2 => 0.3,
        3 => 0.48,
        4 => 0.96,
        5 => 1.92,
        6 => 3.84,
        _ => return None,
    };
    Some((per_lane * width as f64).ceil().max(1.0))
}

/// A site's change to one rule (`[telemetry.rules.<name>]`); unset keys keep the table's value.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tuning {
    pub enabled: Option<bool>,
    pub raise: Option<f64>,
    pub clear: Option<f64>,
    pub window_s: Option<f64>,
    pub clear_s: Option<f64>,
    /// Share of bad readings in the window that raises (0..1].
    pub duty: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TuningError {
    UnknownRule(String),
    /// The clear threshold is on the wrong side of the raise threshold (no hysteresis).
    Hysteresis {
        rule: &'static str,
    },
    Negative {
        rule: &'static str,
    },
}

impl std::fmt::Display for TuningError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TuningError::UnknownRule(r) => {
                let known: Vec<&str> = RULES.iter().map(|r| r.name).collect();
                write!(f, "unknown rule `{r}` (rules: {})", known.join(", "))
            }
            TuningError::Hysteresis { rule } => write!(
                f,
                "rule {rule}: `clear` must be on the good side of `raise` (or equal)"
            ),
            TuningError::Negative { rule } => {
                write!(
                    f,
                    "rule {rule}: window_s and clear_s must be >= 0, duty in (0, 1]"
                )
            }
        }
    }
}

/// The table with a site's tunings applied; disabled rules are left out.
pub fn tuned<'a>(
    tunings: impl IntoIterator<Item = (&'a str, &'a Tuning)>,
) -> Result<Vec<Rule>, TuningError> {
    let mut rules: Vec<(Rule, bool)> = RULES.iter().map(|r| (*r, true)).collect();
    for (name, t) in tunings {
        let (r, on) = rules
            .iter_mut()
            .find(|(r, _)| r.name == name)
            .ok_or_else(|| TuningError::UnknownRule(name.to_string()))?;
        if let Some(e) = t.enabled {
            *on = e;
        }
        r.raise = t.raise.unwrap_or(r.raise);
        r.clear = t.clear.unwrap_or(r.clear);
        r.window_s = t.window_s.unwrap_or(r.window_s);
        r.duty = t.duty.unwrap_or(r.duty);
        r.clear_s = t.clear_s.unwrap_or(r.clear_s);
        let ok = match r.direction {
            Direction::Above => r.clear <= r.raise,
            Direction::Below => r.clear >= r.raise,
        };
        if !ok {
            return Err(TuningError::Hysteresis { rule: r.name });
        }
        if !(r.duty > 0.0 && r.duty <= 1.0) {
            return Err(TuningError::Negative { rule: r.name });
        }
        if !(r.window_s >= 0.0 && r.clear_s >= 0.0) {
            return Err(TuningError::Negative { rule: r.name });
        }
    }
    Ok(rules
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|(r, _)| r)
        .collect())
}

pub(crate) fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_has_hysteresis_and_a_unique_name() {
        let mut names = std::collections::BTreeSet::new();
        for r in RULES {
            assert!(names.insert(r.name), "{} twice", r.name);
            assert_eq!(RuleId::from_name(r.name), Some(r.id));
            let ok = match r.direction {
                Direction::Above => r.clear <= r.raise,
                Direction::Below => r.clear >= r.raise,
            };
            assert!(ok, "{}", r.name);
            assert!(!r.source.is_empty() && !r.what.is_empty());
        }
    }

    #[test]
    fn tunings_are_checked() {
        let t = Tuning {
            window_s: Some(1.0),
            ..Tuning::default()
        };
        let rules = tuned([("straggler", &t)]).unwrap();
        assert_eq!(
            rules
                .iter()
                .find(|r| r.id == RuleId::Straggler)
                .unwrap()
                .window_s,
            1.0
        );
        assert!(matches!(
            tuned([("nope", &t)]),
            Err(TuningError::UnknownRule(_))
        ));
        let bad = Tuning {
            clear: Some(0.1),
            ..Tuning::default()
        };
        assert_eq!(
            tuned([("straggler", &bad)]).err(),
            Some(TuningError::Hysteresis { rule: "straggler" })
        );
        let off = Tuning {
            enabled: Some(false),
            ..Tuning::default()
        };
        assert!(tuned([("nic_errors", &off)])
            .unwrap()
            .iter()
            .all(|r| r.id != RuleId::NicErrors));
    }

    #[test]
    fn pcie_bound_matches_dcgm() {
        assert_eq!(pcie_replay_bound_per_min(5, 16), Some(31.0));
        assert_eq!(pcie_replay_bound_per_min(4, 16), Some(16.0));
        assert_eq!(pcie_replay_bound_per_min(0, 16), None);
    }
}
