//! The agent's own series in `/metrics` (beside telemetry's): what it decided and did, and which
//! GPUs it holds unhealthy. Prometheus text, built from the state on each scrape.

use crate::store::state::State;
use std::fmt::Write;

/// The families, one `# HELP`/`# TYPE` each; `gpus` are the node's GPU indexes (a GPU without
/// faults shows 0, so a rule sees the series before the first fault).
pub fn render(st: &State, gpus: &[u32], node: &str, simulated: bool) -> String {
    let mut out = String::new();
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let per_gpu = |out: &mut String, name: &str, kind: &str, help: &str, v: &dyn Fn(u32) -> u64| {
        family(out, name, kind, help);
        for g in gpus {
            let _ = writeln!(out, "{name}{{gpu=\"{g}\"}} {}", v(*g));
        }
    };
    let t = |g: u32| st.totals.get(&g).copied().unwrap_or_default();
    per_gpu(
        &mut out,
        "mpsr_faults_total",
        "counter",
        "GPU faults the agent decided, since it started",
        &|g| t(g).faults,
    );
    per_gpu(
        &mut out,
        "mpsr_fault_hit_jobs_total",
        "counter",
        "Jobs those faults hit (once per job and fault)",
        &|g| t(g).hit_jobs,
    );
    per_gpu(
        &mut out,
        "mpsr_standby_takeovers_total",
        "counter",
        "Hot standbys that took over a hit task",
        &|g| t(g).takeovers,
    );
    family(
        &mut out,
        "mpsr_xids_total",
        "counter",
        "Xids in the faults the agent decided, by Xid and its class (class=\"unknown\": not in the table, no action taken; classify it in faults.xid_classes)",
    );
    for ((g, x, class), n) in &st.xid_totals {
        let _ = writeln!(
            out,
            "mpsr_xids_total{{gpu=\"{g}\",xid=\"{x}\",class=\"{class}\"}} {n}"
        );
    }
    family(
        &mut out,
        "mpsr_gpu_unhealthy",
        "gauge",
        "1 while a hardware fault class holds the GPU unhealthy (the health check drains the node)",
    );
    for (g, (class, _)) in &st.durable.unhealthy {
        let _ = writeln!(out, "mpsr_gpu_unhealthy{{gpu=\"{g}\",class=\"{class}\"}} 1");
    }
    family(
        &mut out,
        "mpsr_escalations_total",
        "counter",
        "Rungs of the escalation ladder climbed for servers stuck in FAULT (end_server, restart_daemon, fence)",
    );
    for g in gpus {
        for rung in mpsr_proto::EscalationRung::ALL {
            let n = st.escalations.get(&(*g, rung)).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "mpsr_escalations_total{{gpu=\"{g}\",rung=\"{}\"}} {n}",
                rung.name()
            );
        }
    }
    family(
        &mut out,
        "mpsr_domain_fenced",
        "gauge",
        "1 while a fault domain is fenced: its MPS server could not be brought back after a fault and no task is placed there",
    );
    for d in st.durable.domains.fenced() {
        let _ = writeln!(
            out,
            "mpsr_domain_fenced{{gpu=\"{}\",slot=\"{}\"}} 1",
            d.gpu, d.slot
        );
    }
    family(
        &mut out,
        "mpsr_slurm_actions_pending",
        "gauge",
        "Slurm actions (requeue, drain, fault lines) queued or being retried",
    );
    let _ = writeln!(
        out,
        "mpsr_slurm_actions_pending {}",
        st.durable.pending.len()
    );
    family(
        &mut out,
        "mpsr_agent_info",
        "gauge",
        "The agent: its node and whether its GPUs are SIMULATED",
    );
    let _ = writeln!(
        out,
        "mpsr_agent_info{{node=\"{node}\",simulated=\"{simulated}\",version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    out
}
