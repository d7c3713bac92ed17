//! The agent's own series in `/metrics` (beside telemetry's): what it decided and did, and which
//! GPUs it holds unhealthy. Built from the state on each scrape and encoded by prometheus-client
//! (telemetry's [`Families`]: label values escaped, one help and type per family).

use crate::store::state::State;
use mpsr_telemetry::metrics::{l, Families};

/// The families' text; `gpus` are the node's GPU indexes (a GPU without faults shows 0, so a
/// rule sees the series before the first fault). Counter families are named without `_total`:
/// the encoder adds it to their samples.
pub fn render(st: &State, gpus: &[u32], node: &str, simulated: bool) -> String {
    let mut f = Families::default();
    let gpu = |g: u32| l(&[("gpu", g.to_string())]);
    let t = |g: u32| st.totals.get(&g).copied().unwrap_or_default();
    for g in gpus {
        f.add(
            "mpsr_faults",
            "GPU faults the agent decided, since it started",
            true,
            gpu(*g),
            t(*g).faults as f64,
        );
        f.add(
            "mpsr_fault_hit_jobs",
            "Jobs those faults hit (once per job and fault)",
            true,
            gpu(*g),
            t(*g).hit_jobs as f64,
        );
        f.add(
            "mpsr_standby_takeovers",
            "Hot standbys that took over a hit task",
            true,
            gpu(*g),
            t(*g).takeovers as f64,
        );
    }
    for ((g, x, class), n) in &st.xid_totals {
        f.add(
            "mpsr_xids",
            "Xids in the faults the agent decided, by Xid and its class (class=\"unknown\": not in the table, no action taken; classify it in faults.xid_classes)",
            true,
            l(&[
                ("gpu", g.to_string()),
                ("xid", x.to_string()),
                ("class", class.to_string()),
            ]),
            *n as f64,
        );
    }
    for (g, (class, _)) in &st.durable.unhealthy {
        f.add(
            "mpsr_gpu_unhealthy",
            "1 while a hardware fault class holds the GPU unhealthy (the health check drains the node)",
            false,
            l(&[("gpu", g.to_string()), ("class", class.to_string())]),
            1.0,
        );
    }
    for g in gpus {
        for rung in mpsr_proto::EscalationRung::ALL {
            let n = st.escalations.get(&(*g, rung)).copied().unwrap_or(0);
            f.add(
                "mpsr_escalations",
                "Rungs of the escalation ladder climbed for servers stuck in FAULT (end_server, restart_daemon, fence)",
                true,
                l(&[("gpu", g.to_string()), ("rung", rung.name().to_string())]),
                n as f64,
            );
        }
    }
    for d in st.durable.domains.fenced() {
        f.add(
            "mpsr_domain_fenced",
            "1 while a fault domain is fenced: its MPS server could not be brought back after a fault and no task is placed there",
            false,
            l(&[("gpu", d.gpu.to_string()), ("slot", d.slot.to_string())]),
            1.0,
        );
    }
    f.add(
        "mpsr_slurm_actions_pending",
        "Slurm actions (requeue, drain, fault lines) queued or being retried",
        false,
        Vec::new(),
        st.durable.pending.len() as f64,
    );
    f.add(
        "mpsr_agent_info",
        "The agent: its node and whether its GPUs are SIMULATED",
        false,
        l(&[
            ("node", node.to_string()),
            ("simulated", simulated.to_string()),
            ("version", env!("CARGO_PKG_VERSION").to_string()),
        ]),
        1.0,
    );
    mpsr_telemetry::metrics::encode(f)
}
