//! `mpsrctl top`: the agent's latest telemetry round as a table per GPU, its clients and jobs,
//! and the active pathology findings.

use mpsr_proto::TelemetryReply;
use mpsr_telemetry::sample::clock_event;
use mpsr_telemetry::{GpuReading, Severity};

const GIB: f64 = (1u64 << 30) as f64;

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.0}%", v * 100.0))
}

fn gib(v: Option<u64>) -> String {
    v.map_or("-".into(), |b| format!("{:.1}", b as f64 / GIB))
}

pub fn render(r: &TelemetryReply) -> String {
    let s = &r.snapshot;
    let mut out = String::new();
    if !r.enabled {
        return "telemetry is off in the agent's config ([telemetry] enabled = false)\n".into();
    }
    let sim = if s.simulated { " (SIMULATED GPUs)" } else { "" };
    out += &format!(
        "node {}{sim}: round {}, telemetry thread CPU {:.2} s\n",
        s.node, s.rounds, s.cpu_seconds
    );
    out += "GPU  UTIL  SM-ACT  MEM GiB used/total  SM MHz  POWER W  TEMP C  CLOCK EVENTS\n";
    for g in &s.tick.gpus {
        match g {
            GpuReading::Sample(g) => {
                let ev = g
                    .clock_events
                    .map(|b| clock_event::names(b).join(","))
                    .unwrap_or_default();
                out += &format!(
                    "{:<4} {:>5} {:>7} {:>9}/{:<9} {:>7} {:>8} {:>7}  {}\n",
                    g.gpu,
                    pct(g.util),
                    pct(g.sm_active),
                    gib(g.mem_used_bytes),
                    gib(g.mem_total_bytes),
                    g.sm_clock_mhz.map_or("-".into(), |c| c.to_string()),
                    g.power_w.map_or("-".into(), |p| format!("{p:.0}")),
                    g.temp_c.map_or("-".into(), |t| format!("{t:.0}")),
                    if ev.is_empty() { "-".into() } else { ev }
                );
            }
            GpuReading::Gap { gpu } => out += &format!("{gpu:<4} (not read this round)\n"),
            GpuReading::Lost { gpu } => out += &format!("{gpu:<4} LOST (NVML does not answer)\n"),
        }
    }
    out += "  GPU  PID      SLOT  JOB      STEP        TASK     UID     MEM GiB  SM\n";
    for c in &s.tick.clients {
        let (job, step, task, uid) = match c.owner {
            Some(o) => (
                o.job.to_string(),
                mpsr_agent::fault::decide::step_name(o.step),
                o.task.to_string(),
                o.uid.to_string(),
            ),
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        out += &format!(
            "  {:<4} {:<8} {:<5} {:<8} {:<11} {:<8} {:<7} {:>7}  {}\n",
            c.gpu,
            c.pid,
            c.slot.map_or("-".into(), |s| s.to_string()),
            job,
            step,
            task,
            uid,
            gib(c.mem_used_bytes),
            pct(c.sm_util)
        );
    }
    if s.findings.is_empty() {
        out += "no pathology findings\n";
    } else {
        out += "FINDINGS\n";
        for f in &s.findings {
            let sev = match f.severity {
                Severity::Hardware => "HARDWARE",
                Severity::Advisory => "advisory",
            };
            let at = f.gpu.map_or(String::new(), |g| format!(" gpu{g}"));
            let job = f.owner.map_or(String::new(), |o| format!(" job {}", o.job));
            out += &format!("  {} {sev}{at}{job}: {}\n", f.rule.name(), f.detail);
        }
    }
    out
}
