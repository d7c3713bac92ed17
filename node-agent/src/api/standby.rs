//! The requests of a resume supervisor that keeps a standby (hot or warm) of its task: where the
//! standby may wait (a fault domain other than the task's) with the FIFO that releases it, and
//! arming it once it runs. The release itself is the fault worker's (`fault::worker`).

use super::caller::{denied, Caller};
use super::tasks::open_context;
use crate::agent::Agent;
use crate::store::registry::{Task, TaskKey};
use crate::store::state::{Armed, Standby};
use crate::sys::procfs;
use mpsr_proto::standby::Kind;
use mpsr_proto::{ErrorCode, Mode, Response};
use std::path::PathBuf;

/// The registered task `(job, step, pid)` names, or the one the caller runs under; only the
/// task's owner (or a trusted caller) gets it.
fn own_task(agent: &Agent, caller: Caller, (job, step, pid): TaskKey) -> Result<Task, NotOwnTask> {
    let st = agent.store.lock();
    let from = if caller.trusted { pid } else { caller.peer.pid };
    let t = st
        .durable
        .registry
        .get((job, step, pid))
        .filter(|_| caller.trusted || procfs::ancestry(from).contains(&pid))
        .or_else(|| {
            st.durable
                .registry
                .task_in_ancestry(job, &procfs::ancestry(from))
        })
        .cloned();
    match t {
        Some(t) if caller.trusted || t.uid == caller.peer.uid => Ok(t),
        _ => Err(NotOwnTask {
            task: (job, step, pid),
            uid: caller.peer.uid,
        }),
    }
}

/// The caller named no task of its own.
#[derive(Debug, thiserror::Error)]
#[error("task {}.{} pid {} is not a registered task of uid {uid} (or the caller does not run under it)", task.0, task.1, task.2)]
struct NotOwnTask {
    task: TaskKey,
    uid: u32,
}

/// Where the task's standbys' release FIFOs live (root's directory; each FIFO its owner's).
fn fifo_dir(agent: &Agent) -> PathBuf {
    agent.cfg.run_dir.join("standby")
}

pub fn prepare(agent: &Agent, caller: Caller, key: TaskKey, kind: Kind) -> Response {
    let t = match own_task(agent, caller, key) {
        Ok(t) => t,
        Err(e) => return denied(e.to_string()),
    };
    if t.mode != Mode::Resume {
        return Response::error(
            ErrorCode::BadRequest,
            format!(
                "job {} is not in resume mode: a standby takes over in place only there",
                t.job_id
            ),
        );
    }
    let Some(gpu) = t.gpus.first().copied() else {
        return Response::error(ErrorCode::BadRequest, "the task uses no GPU");
    };
    let task = (t.job_id, t.step_id, t.pid);
    let of = t
        .domain_on(gpu)
        .unwrap_or(mpsr_proto::DomainId::shared(gpu));
    let domain = {
        let mut st = agent.store.lock();
        // A task has one standby: a new one replaces the last (its supervisor started again).
        let old = st.durable.drop_standbys(|s| s.task == task);
        crate::store::state::remove_fifos(&old);
        match kind {
            Kind::Cold => cold_domain(agent, &st.durable.domains, of),
            _ => match over_limit(
                &agent.cfg.standby,
                &st.durable.standbys,
                gpu,
                kind,
                procfs::rss_bytes,
            ) {
                Some(why) => Err(why),
                // Placed outside the state lock (it may start a server).
                None => Ok(None),
            },
        }
    };
    let domain = match domain {
        Ok(Some(d)) => d,
        Ok(None) => match agent.domains.place_standby(of) {
            Ok(d) => d,
            Err(e) => return Response::error(ErrorCode::Refused, e.to_string()),
        },
        Err(why) => return Response::error(ErrorCode::Refused, why),
    };
    let dir = fifo_dir(agent);
    let fifo = dir.join(format!("{}.{}.{}", t.job_id, t.step_id, t.pid));
    if let Err(e) = make_fifo(&dir, &fifo, t.uid) {
        return Response::error(
            ErrorCode::Internal,
            format!("standby FIFO {}: {e}", fifo.display()),
        );
    }
    agent.store.lock().durable.standbys.push(Standby {
        task,
        uid: t.uid,
        domain,
        fifo: fifo.clone(),
        armed: None,
        kind,
    });
    agent.store.mark_dirty();
    tracing::info!(job = t.job_id, step = t.step_id, pid = t.pid, %domain, kind = kind.name(), "standby prepared");
    let mut ctx = open_context(agent, domain);
    ctx.state = Some(agent.backend.server_state(domain));
    Response::Standby {
        context: ctx,
        release_fifo: fifo.display().to_string(),
        mem_limit: crate::config::parse_size(&agent.cfg.standby.memory_limit)
            .filter(|_| kind != Kind::Cold),
    }
}

/// Where a cold standby's task restarts: the GPU's other running domain a hit task of `of` may
/// restart in (`DomainTable::restart_elsewhere`), only where the node allows restarting there.
/// None is made for it: a new server would cost GPU memory for a standby that costs none.
fn cold_domain(
    agent: &Agent,
    domains: &crate::domain::DomainTable,
    of: mpsr_proto::DomainId,
) -> Result<Option<mpsr_proto::DomainId>, String> {
    if !agent.cfg.standby.restart_in_standby_domain {
        return Err("restarting in another fault domain is off on this node ([standby] restart_in_standby_domain)".into());
    }
    domains
        .restart_elsewhere(of)
        .map(Some)
        .ok_or_else(|| format!("{of} has no other running domain on its GPU to restart in"))
}

pub fn arm(
    agent: &Agent,
    caller: Caller,
    key: TaskKey,
    primary_pid: u32,
    standby_pid: u32,
) -> Response {
    let t = match own_task(agent, caller, key) {
        Ok(t) => t,
        Err(e) => return denied(e.to_string()),
    };
    // Both incarnations must run under the task and be the owner's: the agent kills one of them.
    for pid in [primary_pid, standby_pid] {
        let under = procfs::ancestry(pid).contains(&t.pid) && pid != t.pid;
        if !under || procfs::uid(pid) != Some(t.uid) {
            return denied(format!(
                "process {pid} is not an incarnation of task {}.{} (a process of uid {} under pid {})",
                t.job_id, t.step_id, t.uid, t.pid
            ));
        }
    }
    let task = (t.job_id, t.step_id, t.pid);
    let mut st = agent.store.lock();
    let Some(sb) = st.durable.standbys.iter_mut().find(|s| s.task == task) else {
        return Response::error(
            ErrorCode::NotFound,
            format!("no standby prepared for task {}.{}", t.job_id, t.step_id),
        );
    };
    sb.armed = Some(Armed {
        primary: (primary_pid, procfs::start_ticks(primary_pid)),
        standby: (standby_pid, procfs::start_ticks(standby_pid)),
    });
    let domain = sb.domain;
    drop(st);
    agent.store.mark_dirty();
    tracing::info!(job = t.job_id, step = t.step_id, primary_pid, standby_pid, %domain, "standby armed");
    Response::Ok
}

/// Why one more standby of `kind` on `gpu` is refused, if it is: hot ones by count (each holds a
/// CUDA context), warm ones by count and by the host memory the node's waiting warm standbys hold
/// (`rss` reads a process's resident bytes).
fn over_limit(
    cfg: &crate::config::StandbyConfig,
    standbys: &[Standby],
    gpu: u32,
    kind: Kind,
    rss: impl Fn(u32) -> u64,
) -> Option<String> {
    let on_gpu = standbys
        .iter()
        .filter(|s| s.domain.gpu == gpu && s.kind == kind)
        .count();
    let (limit, key) = match kind {
        Kind::Hot => (cfg.max_per_gpu, "standby.max_per_gpu"),
        Kind::Warm => (cfg.warm_max_per_gpu, "standby.warm_max_per_gpu"),
        // No process and no context: nothing to bound.
        Kind::Cold => return None,
    };
    if on_gpu >= limit as usize {
        return Some(format!(
            "gpu{gpu} already has {on_gpu} {} standbys ({key} = {limit})",
            kind.name()
        ));
    }
    let cap = crate::config::parse_size(&cfg.warm_host_memory).filter(|_| kind == Kind::Warm)?;
    let held: u64 = standbys
        .iter()
        .filter(|s| s.kind == Kind::Warm && s.pid() != 0)
        .map(|s| rss(s.pid()))
        .sum();
    (held >= cap).then(|| {
        format!(
            "the node's warm standbys hold {} MiB of host memory (standby.warm_host_memory = {})",
            held >> 20,
            cfg.warm_host_memory
        )
    })
}

fn make_fifo(dir: &std::path::Path, fifo: &std::path::Path, uid: u32) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    let _ = std::fs::remove_file(fifo);
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid NUL-terminated path; the results are checked.
    unsafe {
        if libc::mkfifo(c.as_ptr(), 0o600) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::chown(c.as_ptr(), uid, u32::MAX) != 0 {
            let e = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(fifo);
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::state::Armed;
    use mpsr_proto::DomainId;

    fn sb(gpu: u32, pid: u32, kind: Kind) -> Standby {
        Standby {
            task: (pid, 0, pid),
            uid: 1000,
            domain: DomainId { gpu, slot: 3 },
            fifo: "/run/x".into(),
            armed: Some(Armed {
                primary: (pid + 1, None),
                standby: (pid, None),
            }),
            kind,
        }
    }

    /// Hot and warm standbys are counted apart; warm ones are capped by the host memory the
    /// node's waiting ones hold, hot ones are not.
    #[test]
    fn hot_and_warm_standbys_have_their_own_limits() {
        let cfg = crate::config::StandbyConfig {
            max_per_gpu: 1,
            warm_max_per_gpu: 2,
            warm_host_memory: "1G".into(),
            ..Default::default()
        };
        let half_gib = |_| 512 << 20;
        let none: Vec<Standby> = Vec::new();
        assert_eq!(over_limit(&cfg, &none, 0, Kind::Hot, half_gib), None);
        let one_hot = vec![sb(0, 10, Kind::Hot)];
        assert!(over_limit(&cfg, &one_hot, 0, Kind::Hot, half_gib)
            .unwrap()
            .contains("standby.max_per_gpu = 1"));
        assert_eq!(over_limit(&cfg, &one_hot, 1, Kind::Hot, half_gib), None);
        assert_eq!(over_limit(&cfg, &one_hot, 0, Kind::Warm, half_gib), None);
        let warm = vec![sb(0, 10, Kind::Warm), sb(1, 11, Kind::Hot)];
        assert_eq!(over_limit(&cfg, &warm, 1, Kind::Warm, half_gib), None);
        // Two warm ones of 0.5 GiB hold the node's 1 GiB: a third is refused on any GPU.
        let two = vec![sb(0, 10, Kind::Warm), sb(1, 12, Kind::Warm)];
        assert!(over_limit(&cfg, &two, 2, Kind::Warm, half_gib)
            .unwrap()
            .contains("standby.warm_host_memory = 1G"));
        // Cold ones (no process, no context) are not bounded at all.
        let many_cold: Vec<Standby> = (0..64).map(|p| sb(0, 100 + p, Kind::Cold)).collect();
        assert_eq!(
            over_limit(&cfg, &many_cold, 0, Kind::Cold, |_| 1 << 40),
            None
        );
        assert_eq!(over_limit(&cfg, &many_cold, 0, Kind::Hot, half_gib), None);
        let two_on_gpu0 = vec![sb(0, 10, Kind::Warm), sb(0, 12, Kind::Warm)];
        assert!(over_limit(&cfg, &two_on_gpu0, 0, Kind::Warm, |_| 1)
            .unwrap()
            .contains("standby.warm_max_per_gpu = 2"));
        // Hot standbys are not capped by host memory.
        assert_eq!(over_limit(&cfg, &two, 2, Kind::Hot, half_gib), None);
    }
}
