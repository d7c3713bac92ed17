//! What a caller may see of the node: status, decisions and findings, telemetry, health. A user
//! sees their own jobs only: decisions and findings are redacted to them.

use super::caller::Caller;
use crate::agent::Agent;
use mpsr_proto::{DecisionRecord, DomainId, GpuStatus, HealthReply, Response, StatusReply};

pub fn status(agent: &Agent, caller: Caller) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let (tasks, pending, unhealthy) = {
        let st = agent.store.lock();
        (
            st.durable
                .registry
                .tasks()
                .filter(|t| trusted || t.uid == peer.uid)
                .map(|t| {
                    let mut s = t.status();
                    let armed =
                        st.durable.standbys.iter().find(|sb| {
                            sb.task == (t.job_id, t.step_id, t.pid) && sb.armed.is_some()
                        });
                    s.standby = armed.map(|sb| (sb.pid(), sb.domain));
                    s.standby_kind = armed.map(|sb| sb.kind);
                    s
                })
                .collect::<Vec<_>>(),
            st.durable.pending.len() as u32,
            st.durable.unhealthy.clone(),
        )
    };
    let own: Option<std::collections::BTreeSet<u32>> =
        (!trusted).then(|| tasks.iter().map(|t| t.job_id).collect());
    let gpus = agent
        .backend
        .gpus()
        .iter()
        .map(|g| GpuStatus {
            domains: agent.domains.domain_status(g.index, own.as_ref()),
            gpu: g.index,
            uuid: g.uuid.clone(),
            pci_bus_id: g.pci.to_string(),
            state: agent.backend.server_state(DomainId::shared(g.index)),
            // Client pids of other users are not shown to a user.
            clients: if trusted {
                agent.backend.clients(DomainId::shared(g.index))
            } else {
                vec![]
            },
            unhealthy: unhealthy.get(&g.index).map(|(_, r)| r.clone()),
        })
        .collect();
    Response::Status(StatusReply {
        node: agent.node.clone(),
        backend: agent.backend.name().into(),
        simulated: agent.backend.simulated(),
        gpus,
        tasks,
        pending_actions: pending,
        persist_failing: agent.store.persist_failing(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        protocol: mpsr_proto::PROTOCOL_VERSION,
    })
}

pub fn events(agent: &Agent, caller: Caller, limit: u32) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let st = agent.store.lock();
    let own = st.durable.jobs_of(peer.uid);
    let n = limit.clamp(1, 10_000) as usize;
    let mut events = newest(st.history.iter(), n, |r| {
        if trusted {
            Some(r.clone())
        } else {
            redact(r, &own)
        }
    });
    let mut pathologies = newest(st.telemetry.records.iter(), n, |p| {
        if trusted {
            Some(p.clone())
        } else {
            redact_pathology(p, &own)
        }
    });
    // Both within one frame: findings get at most half of it, decisions the rest.
    let budget = mpsr_proto::MAX_FRAME - 1024;
    let (used, pathologies_left_out) = fit_frame(&mut pathologies, budget / 2);
    let (_, events_left_out) = fit_frame(&mut events, budget - used);
    Response::Events {
        events,
        pathologies,
        events_left_out,
        pathologies_left_out,
    }
}

pub fn telemetry(agent: &Agent, caller: Caller) -> Response {
    let (peer, trusted) = (caller.peer, caller.trusted);
    let mut snapshot = crate::sys::lock(&agent.exporter.0).clone();
    if !trusted {
        let own = agent.store.lock().durable.jobs_of(peer.uid);
        snapshot
            .tick
            .clients
            .retain(|c| c.owner.is_some_and(|o| own.contains(&o.job)));
        snapshot.findings = snapshot
            .findings
            .iter()
            .filter_map(|f| crate::telemetry::redact(f, &own))
            .collect();
    }
    Response::Telemetry(Box::new(mpsr_proto::TelemetryReply {
        enabled: agent.cfg.telemetry.enabled,
        snapshot,
    }))
}

pub fn health(agent: &Agent) -> Response {
    let st = agent.store.lock();
    let mut reasons: Vec<String> = st
        .durable
        .unhealthy
        .values()
        .map(|(_, r)| r.clone())
        .collect();
    reasons.extend(crate::telemetry::reasons(
        &agent.cfg,
        &agent.node,
        &st.telemetry.active,
    ));
    drop(st);
    Response::Health(HealthReply {
        node: agent.node.clone(),
        healthy: reasons.is_empty(),
        reasons,
    })
}

/// A decision as a user may see it: only their own jobs, no actions or outcomes (they name other
/// jobs), no pids; `None` when it concerns none of their jobs.
pub(super) fn redact(
    r: &DecisionRecord,
    own: &std::collections::BTreeSet<u32>,
) -> Option<DecisionRecord> {
    let mut r = r.clone();
    r.hit_jobs.retain(|j| own.contains(j));
    r.spared_jobs.retain(|j| own.contains(j));
    if r.hit_jobs.is_empty() && r.spared_jobs.is_empty() {
        return None;
    }
    r.culprit_job = r.culprit_job.filter(|j| own.contains(j));
    if r.culprit_job.is_none() {
        r.culprit_evidence = None;
    }
    r.actions.clear();
    r.outcome.clear();
    r.outcomes.clear();
    r.reported_pid = None;
    r.culprit = None;
    Some(r)
}

pub(super) fn redact_pathology(
    p: &mpsr_proto::PathologyRecord,
    own: &std::collections::BTreeSet<u32>,
) -> Option<mpsr_proto::PathologyRecord> {
    Some(mpsr_proto::PathologyRecord {
        at_ms: p.at_ms,
        finding: crate::telemetry::redact(&p.finding, own)?,
    })
}

/// The newest `n` items `keep` lets through (and maps), oldest first.
fn newest<'a, T: 'a, U>(
    items: impl DoubleEndedIterator<Item = &'a T>,
    n: usize,
    keep: impl FnMut(&T) -> Option<U>,
) -> Vec<U> {
    let mut v: Vec<U> = items.rev().filter_map(keep).take(n).collect();
    v.reverse();
    v
}

/// Drops the oldest items until `v` serializes within `budget` bytes (one always stays); returns
/// the size it serializes to and how many were dropped.
fn fit_frame<T: serde::Serialize>(v: &mut Vec<T>, budget: usize) -> (usize, u32) {
    let size = |v: &Vec<T>| serde_json::to_vec(v).map_or(0, |b| b.len());
    let mut dropped = 0;
    while v.len() > 1 && size(v) > budget {
        let drop_n = (v.len() / 10).max(1);
        v.drain(..drop_n);
        dropped += drop_n as u32;
    }
    (size(v), dropped)
}
