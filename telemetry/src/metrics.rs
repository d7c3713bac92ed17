//! Prometheus exposition of the latest round (prometheus-client, Prometheus text 0.0.4). Label
//! names follow dcgm-exporter where they mean the same (`gpu`, `UUID`, `hpc_job`), so dashboards
//! join the two; job labels go on per-client and per-job series only (dcgm-exporter copies a
//! device value onto every job of a shared GPU, which says nothing about each job).

use crate::detect::Subject;
use crate::sample::{clock_event, GpuReading, GpuSample};
use crate::snapshot::Snapshot;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A series' labels, in order.
pub type Labels = Vec<(String, String)>;

/// One metric family: its rows, each a label set and a value.
#[derive(Debug, Clone)]
pub struct Family {
    name: &'static str,
    help: &'static str,
    counter: bool,
    rows: Vec<(Labels, f64)>,
}

/// Labels from `(name, value)` pairs.
pub fn l(pairs: &[(&str, String)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// Metric families being built; encoded by prometheus-client (values escaped as the text
/// format wants). The agent's own families are built with it too (node-agent api/fault_metrics).
#[derive(Debug, Default)]
pub struct Families(Vec<Family>);

impl Families {
    /// A row; one with the same labels as an earlier row of the family is merged into it (a
    /// counter or a `_bytes` gauge summed, another gauge its maximum): without `pid` labels two
    /// processes of one task on one GPU share a label set.
    pub fn add(
        &mut self,
        name: &'static str,
        help: &'static str,
        counter: bool,
        labels: Labels,
        v: f64,
    ) {
        if !v.is_finite() {
            return;
        }
        match self.0.iter_mut().find(|f| f.name == name) {
            Some(f) => match f.rows.iter_mut().find(|(ls, _)| *ls == labels) {
                Some((_, old)) if counter || name.ends_with("_bytes") => *old += v,
                Some((_, old)) => *old = old.max(v),
                None => f.rows.push((labels, v)),
            },
            None => self.0.push(Family {
                name,
                help,
                counter,
                rows: vec![(labels, v)],
            }),
        }
    }
    /// A row when there is a value.
    pub fn opt(
        &mut self,
        name: &'static str,
        help: &'static str,
        counter: bool,
        labels: Labels,
        v: Option<f64>,
    ) {
        if let Some(v) = v {
            self.add(name, help, counter, labels, v)
        }
    }
}

fn families(s: &Snapshot) -> Vec<Family> {
    let mut out = Families::default();
    out.add(
        "mpsr_telemetry_info",
        "1; labels say the node and whether its GPUs are SIMULATED",
        false,
        l(&[
            ("node", s.node.clone()),
            ("simulated", s.simulated.to_string()),
        ]),
        1.0,
    );
    out.add(
        "mpsr_telemetry_rounds",
        "Telemetry rounds taken",
        true,
        vec![],
        s.rounds as f64,
    );
    out.add(
        "mpsr_telemetry_cpu_seconds",
        "CPU time of the agent's telemetry thread",
        true,
        vec![],
        s.cpu_seconds,
    );
    let uuid_of: BTreeMap<u32, String> = s
        .tick
        .gpus
        .iter()
        .filter_map(GpuReading::sample)
        .map(|g| (g.gpu, g.uuid.clone()))
        .collect();
    for r in &s.tick.gpus {
        gpu_families(&mut out, r, &uuid_of);
    }
    client_and_job_families(&mut out, s, &uuid_of);
    nic_and_finding_families(&mut out, s);
    out.0
}

/// A GPU's series (`mpsr_gpu_up` for each, the rest for one that answered).
fn gpu_families(out: &mut Families, r: &GpuReading, uuid_of: &BTreeMap<u32, String>) {
    let gl = |extra: &[(&str, String)]| {
        let mut v = l(&[
            ("gpu", r.gpu().to_string()),
            ("UUID", uuid_of.get(&r.gpu()).cloned().unwrap_or_default()),
        ]);
        v.extend(l(extra));
        v
    };
    out.add(
        "mpsr_gpu_up",
        "1 when the GPU answered this round, 0 when lost or not read",
        false,
        gl(&[]),
        matches!(r, GpuReading::Sample(_)) as u8 as f64,
    );
    let Some(g) = r.sample() else { return };
    gpu_activity(out, g, &gl);
    gpu_power(out, g, &gl);
    gpu_errors(out, g, &gl);
    gpu_links(out, g, &gl);
    gpu_limits_and_pipes(out, g, &gl);
}

/// Utilization, memory and clocks.
fn gpu_activity(out: &mut Families, g: &GpuSample, gl: &impl Fn(&[(&str, String)]) -> Labels) {
    let f = |v: Option<u64>| v.map(|v| v as f64);
    out.opt(
        "mpsr_gpu_utilization_ratio",
        "Fraction of time a kernel ran (NVML)",
        false,
        gl(&[]),
        g.util,
    );
    out.opt(
        "mpsr_gpu_memory_copy_utilization_ratio",
        "Fraction of time memory was read or written (NVML)",
        false,
        gl(&[]),
        g.mem_copy_util,
    );
    out.opt(
        "mpsr_gpu_memory_used_bytes",
        "GPU memory used",
        false,
        gl(&[]),
        f(g.mem_used_bytes),
    );
    out.opt(
        "mpsr_gpu_memory_total_bytes",
        "GPU memory in total",
        false,
        gl(&[]),
        f(g.mem_total_bytes),
    );
    out.opt(
        "mpsr_gpu_sm_clock_hertz",
        "SM clock",
        false,
        gl(&[]),
        g.sm_clock_mhz.map(|m| m as f64 * 1e6),
    );
    out.opt(
        "mpsr_gpu_sm_clock_max_hertz",
        "Maximum SM clock",
        false,
        gl(&[]),
        g.sm_clock_max_mhz.map(|m| m as f64 * 1e6),
    );
    if let Some(bits) = g.clock_events {
        for name in clock_event::names(u64::MAX) {
            let on = clock_event::names(bits).contains(&name);
            out.add(
                "mpsr_gpu_clock_event_active",
                "1 while this clocks-event reason holds the clocks (NVML)",
                false,
                gl(&[("reason", name.to_string())]),
                on as u8 as f64,
            );
        }
    }
}

/// Power, energy and temperature.
fn gpu_power(out: &mut Families, g: &GpuSample, gl: &impl Fn(&[(&str, String)]) -> Labels) {
    out.opt(
        "mpsr_gpu_power_watts",
        "Power draw (NVML, 1 s average on Hopper)",
        false,
        gl(&[]),
        g.power_w,
    );
    out.opt(
        "mpsr_gpu_power_limit_watts",
        "Enforced power limit",
        false,
        gl(&[]),
        g.power_limit_w,
    );
    out.opt(
        "mpsr_gpu_energy_joules",
        "Energy since the driver loaded",
        true,
        gl(&[]),
        g.energy_j,
    );
    out.opt(
        "mpsr_gpu_temperature_celsius",
        "GPU temperature",
        false,
        gl(&[]),
        g.temp_c,
    );
    out.opt(
        "mpsr_gpu_slowdown_temperature_celsius",
        "Temperature at which the GPU slows down",
        false,
        gl(&[]),
        g.temp_slowdown_c,
    );
}

/// ECC errors, row remapping and PCIe replays: what wears out.
fn gpu_errors(out: &mut Families, g: &GpuSample, gl: &impl Fn(&[(&str, String)]) -> Labels) {
    let f = |v: Option<u64>| v.map(|v| v as f64);
    for (kind, counter, v) in [
        ("corrected", "volatile", g.ecc_corrected_volatile),
        ("uncorrected", "volatile", g.ecc_uncorrected_volatile),
        ("corrected", "aggregate", g.ecc_corrected_aggregate),
        ("uncorrected", "aggregate", g.ecc_uncorrected_aggregate),
    ] {
        out.opt(
            "mpsr_gpu_ecc_errors",
            "ECC errors (volatile: since the driver loaded; aggregate: lifetime)",
            true,
            gl(&[("type", kind.into()), ("counter", counter.into())]),
            f(v),
        );
    }
    for (cause, v) in [
        ("correctable", g.remapped_rows_correctable),
        ("uncorrectable", g.remapped_rows_uncorrectable),
    ] {
        out.opt(
            "mpsr_gpu_remapped_rows",
            "Rows remapped, by the error that caused it",
            true,
            gl(&[("cause", cause.into())]),
            f(v),
        );
    }
    out.opt(
        "mpsr_gpu_row_remap_pending",
        "1 when a row remap waits for a GPU reset",
        false,
        gl(&[]),
        g.remap_pending.map(|b| b as u8 as f64),
    );
    out.opt(
        "mpsr_gpu_row_remap_failure",
        "1 when a row remap failed",
        false,
        gl(&[]),
        g.remap_failure.map(|b| b as u8 as f64),
    );
    out.opt(
        "mpsr_gpu_pcie_replays",
        "PCIe replays",
        true,
        gl(&[]),
        f(g.pcie_replays),
    );
}

/// PCIe and NVLink links.
fn gpu_links(out: &mut Families, g: &GpuSample, gl: &impl Fn(&[(&str, String)]) -> Labels) {
    let f = |v: Option<u64>| v.map(|v| v as f64);
    out.opt(
        "mpsr_gpu_pcie_link_gen",
        "Current PCIe link generation",
        false,
        gl(&[]),
        g.pcie_gen.map(f64::from),
    );
    out.opt(
        "mpsr_gpu_pcie_link_gen_max",
        "Maximum PCIe link generation",
        false,
        gl(&[]),
        g.pcie_gen_max.map(f64::from),
    );
    out.opt(
        "mpsr_gpu_pcie_link_width",
        "Current PCIe link width (lanes)",
        false,
        gl(&[]),
        g.pcie_width.map(f64::from),
    );
    out.opt(
        "mpsr_gpu_pcie_link_width_max",
        "Maximum PCIe link width (lanes)",
        false,
        gl(&[]),
        g.pcie_width_max.map(f64::from),
    );
    out.opt(
        "mpsr_gpu_pcie_bytes_per_second",
        "PCIe throughput (NVML, 20 ms window)",
        false,
        gl(&[("direction", "tx".into())]),
        g.pcie_tx_bytes_per_s,
    );
    out.opt(
        "mpsr_gpu_pcie_bytes_per_second",
        "PCIe throughput (NVML, 20 ms window)",
        false,
        gl(&[("direction", "rx".into())]),
        g.pcie_rx_bytes_per_s,
    );
    out.opt(
        "mpsr_gpu_nvlink_errors",
        "NVLink replay, recovery and CRC errors, all links",
        true,
        gl(&[]),
        f(g.nvlink_errors),
    );
}

/// Time clocks were held down by a limit, and GPM pipe activity.
fn gpu_limits_and_pipes(
    out: &mut Families,
    g: &GpuSample,
    gl: &impl Fn(&[(&str, String)]) -> Labels,
) {
    out.opt(
        "mpsr_gpu_clock_violation_seconds",
        "Time clocks were held down by a limit",
        true,
        gl(&[("limit", "power".into())]),
        g.violation_power_ns.map(|n| n as f64 / 1e9),
    );
    out.opt(
        "mpsr_gpu_clock_violation_seconds",
        "Time clocks were held down by a limit",
        true,
        gl(&[("limit", "thermal".into())]),
        g.violation_thermal_ns.map(|n| n as f64 / 1e9),
    );
    out.opt(
        "mpsr_gpu_sm_active_ratio",
        "Fraction of cycles an SM had a warp (GPM)",
        false,
        gl(&[]),
        g.sm_active,
    );
    out.opt(
        "mpsr_gpu_sm_occupancy_ratio",
        "Resident warps over the maximum (GPM)",
        false,
        gl(&[]),
        g.sm_occupancy,
    );
    out.opt(
        "mpsr_gpu_tensor_active_ratio",
        "Fraction of cycles a tensor pipe was active (GPM)",
        false,
        gl(&[]),
        g.tensor_active,
    );
    out.opt(
        "mpsr_gpu_dram_active_ratio",
        "Fraction of cycles the memory interface was active (GPM)",
        false,
        gl(&[]),
        g.dram_active,
    );
}

/// Per-process series of the GPU clients, and per-job sums of them.
fn client_and_job_families(out: &mut Families, s: &Snapshot, uuid_of: &BTreeMap<u32, String>) {
    let mut jobs: BTreeMap<(u32, u32), (f64, u32)> = BTreeMap::new();
    for c in &s.tick.clients {
        let mut labels = l(&[
            ("gpu", c.gpu.to_string()),
            ("UUID", uuid_of.get(&c.gpu).cloned().unwrap_or_default()),
        ]);
        // A pid is a new series every run (churn in Prometheus): off unless asked for; a rank is
        // told by its job, step and task.
        if s.pid_labels {
            labels.push(("pid".into(), c.pid.to_string()));
        }
        if let Some(o) = c.owner {
            labels.extend(l(&[
                ("hpc_job", o.job.to_string()),
                ("step", o.step.to_string()),
                ("task", o.task.to_string()),
                ("uid", o.uid.to_string()),
            ]));
            let j = jobs.entry((o.job, o.uid)).or_default();
            j.0 += c.mem_used_bytes.unwrap_or(0) as f64;
            j.1 += 1;
        }
        if let Some(m) = c.mem_used_bytes {
            out.add(
                "mpsr_client_memory_used_bytes",
                "GPU memory of one process (NVML)",
                false,
                labels.clone(),
                m as f64,
            );
        }
        if let Some(u) = c.sm_util {
            out.add(
                "mpsr_client_sm_utilization_ratio",
                "SM utilization NVML reports for one process",
                false,
                labels.clone(),
                u,
            );
        }
        // A job's rank: what `mpsrctl job-skew` and the straggler rule compare (the process's
        // own utilization, else its GPU's when it is the GPU's only client: under MPS NVML
        // gives a client none of its own).
        if let (Some(_), Some(st)) = (c.owner, c.steps) {
            if let Some(step) = st.step_s {
                out.add(
                    "mpsr_rank_step_seconds",
                    "A job rank's step time (median of its last steps; the application marks steps with mpsr_step)",
                    false,
                    labels.clone(),
                    step,
                );
            }
            out.add(
                "mpsr_rank_steps",
                "Steps a job rank has marked (mpsr_step)",
                true,
                labels.clone(),
                st.steps as f64,
            );
        }
        if let (Some(_), Some(u)) = (c.owner, crate::detect::client_util(&s.tick, c)) {
            out.add(
                "mpsr_rank_utilization_ratio",
                "A job rank's utilization (its own, or its GPU's where it is the only client)",
                false,
                labels,
                u,
            );
        }
    }
    for ((job, uid), (mem, n)) in jobs {
        let labels = l(&[("hpc_job", job.to_string()), ("uid", uid.to_string())]);
        out.add(
            "mpsr_job_gpu_memory_used_bytes",
            "GPU memory of a job's processes on this node",
            false,
            labels.clone(),
            mem,
        );
        out.add(
            "mpsr_job_gpu_clients",
            "GPU processes of a job on this node",
            false,
            labels,
            n as f64,
        );
    }
}

/// Network ports, and the pathology findings active now.
fn nic_and_finding_families(out: &mut Families, s: &Snapshot) {
    for n in &s.tick.nics {
        let labels = l(&[("port", n.port.clone())]);
        for (name, help, v) in [
            (
                "mpsr_nic_receive_bytes",
                "Bytes received on the port",
                n.rx_bytes,
            ),
            (
                "mpsr_nic_transmit_bytes",
                "Bytes sent on the port",
                n.tx_bytes,
            ),
            (
                "mpsr_nic_errors",
                "Error counters of the port, summed",
                n.errors,
            ),
        ] {
            if let Some(v) = v {
                out.add(name, help, true, labels.clone(), v as f64);
            }
        }
    }
    for f in &s.findings {
        let mut labels = l(&[
            ("rule", f.rule.name().to_string()),
            ("severity", format!("{:?}", f.severity).to_lowercase()),
        ]);
        if let Some(g) = f.gpu {
            labels.push(("gpu".into(), g.to_string()));
        }
        match (&f.subject, f.owner) {
            (_, Some(o)) => labels.push(("hpc_job".into(), o.job.to_string())),
            (Subject::Job { job }, None) => labels.push(("hpc_job".into(), job.to_string())),
            _ => {}
        }
        match &f.subject {
            Subject::Client { pid, .. } if s.pid_labels => {
                labels.push(("pid".into(), pid.to_string()))
            }
            Subject::Client { .. } => {
                if let Some(o) = f.owner {
                    labels.push(("task".into(), o.task.to_string()));
                }
            }
            Subject::Nic { port } => labels.push(("port".into(), port.clone())),
            Subject::Server { slot, .. } => labels.push(("server".into(), slot.to_string())),
            _ => {}
        }
        out.add(
            "mpsr_pathology_active",
            "1 while a pathology rule's finding holds",
            false,
            labels,
            1.0,
        );
    }
}

/// Encodes a snapshot on each scrape.
#[derive(Debug, Default, Clone)]
pub struct Exporter(pub Arc<Mutex<Snapshot>>);

impl Collector for Exporter {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snap = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        encode_families(encoder, families(&snap))
    }
}

/// Families built elsewhere (the agent's own), encoded as a collector.
#[derive(Debug)]
struct Built(Mutex<Vec<Family>>);

impl Collector for Built {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let fams = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        encode_families(encoder, fams)
    }
}

/// The Prometheus text of `families`.
pub fn encode(families: Families) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(Built(Mutex::new(families.0))));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &reg);
    out
}

fn encode_families(
    mut encoder: DescriptorEncoder,
    fams: Vec<Family>,
) -> Result<(), std::fmt::Error> {
    {
        for fam in fams {
            let ty = if fam.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut m = encoder.encode_descriptor(fam.name, fam.help, None, ty)?;
            for (labels, v) in &fam.rows {
                let e = m.encode_family(labels)?;
                if fam.counter {
                    ConstCounter::new(*v).encode(e)?;
                } else {
                    ConstGauge::new(*v).encode(e)?;
                }
            }
        }
    }
    Ok(())
}

/// The text a scrape returns.
pub fn render(exporter: &Exporter) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(exporter.clone()));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{ClientSample, GpuSample, Owner, Tick};

    #[test]
    fn renders_gpu_client_and_job_series_with_dcgm_label_names() {
        let snap = Snapshot {
            node: "n1".into(),
            simulated: true,
            tick: Tick {
                t: 1.0,
                gpus: vec![
                    GpuReading::Sample(Box::new(GpuSample {
                        gpu: 0,
                        uuid: "GPU-x".into(),
                        util: Some(0.5),
                        energy_j: Some(10.0),
                        clock_events: Some(clock_event::SW_POWER_CAP),
                        ..GpuSample::default()
                    })),
                    GpuReading::Lost { gpu: 1 },
                ],
                clients: vec![ClientSample {
                    gpu: 0,
                    pid: 42,
                    slot: Some(0),
                    mem_used_bytes: Some(1 << 30),
                    sm_util: None,
                    owner: Some(Owner {
                        job: 7,
                        step: 0,
                        task: 40,
                        uid: 1000,
                    }),
                    thread_pct: None,
                    mem_limit_bytes: None,
                    steps: None,
                }],
                nics: vec![],
            },
            findings: vec![],
            rounds: 3,
            cpu_seconds: 0.01,
            pid_labels: false,
        };
        let text = render(&Exporter(Arc::new(Mutex::new(snap.clone()))));
        assert!(!text.contains("pid="), "no pid labels by default: {text}");
        assert!(text.contains(r#"task="#), "{text}");
        let with_pids = render(&Exporter(Arc::new(Mutex::new(Snapshot {
            pid_labels: true,
            ..snap
        }))));
        assert!(with_pids.contains(r#"pid="42""#), "{with_pids}");
        assert!(
            text.contains(r#"mpsr_gpu_utilization_ratio{gpu="0",UUID="GPU-x"} 0.5"#),
            "{text}"
        );
        assert!(text.contains(r#"mpsr_gpu_up{gpu="1",UUID=""} 0"#), "{text}");
        assert!(text.contains("mpsr_gpu_energy_joules_total"), "{text}");
        assert!(text.contains(r#"hpc_job="7""#), "{text}");
        assert!(text.contains(r#"reason="sw_power_cap"} 1"#), "{text}");
        assert!(
            !text.contains("mpsr_client_sm_utilization_ratio"),
            "no value, no series"
        );
    }

    /// Label values are escaped (a node name or reason with a quote or backslash stays one
    /// value), and rows with one label set are merged, not repeated (invalid exposition).
    #[test]
    fn built_families_are_escaped_and_merged() {
        let mut f = Families::default();
        let labels = l(&[("node", "a\"b\\c".to_string())]);
        f.add("x_bytes", "h", false, labels.clone(), 1.0);
        f.add("x_bytes", "h", false, labels.clone(), 2.0);
        f.add("x_ratio", "h", false, labels.clone(), 0.2);
        f.add("x_ratio", "h", false, labels, 0.7);
        let text = encode(f);
        assert!(text.contains(r#"x_bytes{node="a\"b\\c"} 3"#), "{text}");
        assert!(text.contains(r#"x_ratio{node="a\"b\\c"} 0.7"#), "{text}");
    }
}
