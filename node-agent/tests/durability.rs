//! The agent as a real process with the sim backend (tests/common), what survives: agent restarts and kills, a full or read-only disk, servers stuck in FAULT escalated, faults while the agent was down.

mod common;
use common::*;

#[test]
fn registry_survives_agent_restart_and_actions_are_not_duplicated() {
    let mut e = Env::new("");
    let c = e.client(0, 60.0, true);
    e.register(11, c.id(), &[0], Mode::Requeue, true);
    e.kill_agent();
    e.start_agent();
    let Response::Status(s) = e.call(&Request::Status).unwrap() else {
        panic!()
    };
    assert_eq!(s.tasks.len(), 1, "registration kept across a crash");
    assert_eq!(s.tasks[0].job_id, 11);
    // A fault now: the idle client survives (no work in flight) but the job is still hit by policy.
    let c2 = e.client(0, 60.0, false);
    e.register(11, c2.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    e.wait_for("requeue", |e| e.scontrol_log().contains("requeue 11"));
    e.kill_agent();
    e.start_agent();
    e.barrier(1);
    assert_eq!(
        e.scontrol_log().matches("requeue 11").count(),
        1,
        "not repeated after restart"
    );
}

/// Chaos: the agent is SIGKILLed while a requeue it decided is under way, once before the
/// requeue took effect and once after (but before the agent heard of it). Each job is requeued
/// exactly once, by the restarted agent or by the killed one, never twice and never not at all.
#[test]
fn an_agent_killed_between_decision_and_action_requeues_exactly_once() {
    let mut e = Env::new("");
    let (holding, before, after) = (
        e.path().join("holding"),
        e.path().join("hold-before"),
        e.path().join("hold-after"),
    );
    for (job, hold) in [(21u32, &before), (22, &after)] {
        let _ = std::fs::remove_file(&holding);
        std::fs::write(hold, "").unwrap();
        let c = e.client(0, 60.0, false);
        e.register(job, c.id(), &[0], Mode::Requeue, true);
        e.inject(0, 43, None, None);
        e.wait_for("the requeue call", |_| holding.exists());
        e.kill_agent();
        if hold == &before {
            // The killed agent's call fails having done nothing.
            std::fs::remove_file(hold).unwrap();
        }
        e.start_agent();
        let want = format!("requeue {job}\n");
        e.wait_for("the requeue after the restart", |e| {
            e.scontrol_log().contains(&want) && status(e).pending_actions == 0
        });
        let _ = std::fs::remove_file(hold);
        e.barrier(1);
        assert_eq!(
            e.scontrol_log().matches(&want).count(),
            1,
            "job {job} requeued once: {}",
            e.scontrol_log()
        );
        let Response::Events { events, .. } = e.call(&Request::Events { limit: 100 }).unwrap()
        else {
            panic!()
        };
        assert!(
            events.iter().any(|r| r.hit_jobs.contains(&job)),
            "the decision survived the kill: {events:?}"
        );
        // The next round's client needs the server back (a server in FAULT refuses clients).
        e.wait_for("gpu0's server ACTIVE again", |e| {
            e.domain(mpsr_proto::DomainId::shared(0)).is_some_and(|d| {
                matches!(
                    d.state,
                    mpsr_proto::ServerState::Active | mpsr_proto::ServerState::Idle
                )
            })
        });
    }
}

/// Chaos: the state directory fills up, then turns read-only. The agent keeps registering tasks
/// and acting on faults from memory, says in status that the disk refuses writes (with the OS
/// error), and writes everything once the disk takes it again: a restart then loses nothing.
#[test]
fn a_full_or_read_only_state_dir_loses_no_job_and_no_action() {
    if !is_root() {
        skip("needs root: mounts a small tmpfs as the state directory");
        return;
    }
    let mut e = Env::new("");
    e.kill_agent();
    let state = e.path().join("state");
    let Some(m) = Mount::tmpfs(&state, "512k") else {
        skip("mount -t tmpfs failed (no CAP_SYS_ADMIN here)");
        return;
    };
    e.start_agent();
    let c1 = e.client(0, 60.0, false);
    e.register(31, c1.id(), &[0], Mode::Requeue, true);
    assert!(status(&e).persist_failing.is_none());

    // Full: fill every free byte.
    {
        let mut f = std::fs::File::create(state.join("filler")).unwrap();
        let chunk = vec![0u8; 4096];
        while f.write_all(&chunk).is_ok() {}
    }
    let c2 = e.client(0, 60.0, false);
    e.register(32, c2.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    e.wait_for("both requeues on a full disk", |e| {
        let l = e.scontrol_log();
        l.contains("requeue 31\n") && l.contains("requeue 32\n")
    });
    e.wait_for("status naming ENOSPC", |e| {
        status(e)
            .persist_failing
            .is_some_and(|f| f.errno == Some(libc::ENOSPC))
    });
    std::fs::remove_file(state.join("filler")).unwrap();
    e.wait_for("the state written once there is room", |e| {
        status(e).persist_failing.is_none()
    });

    // Read-only.
    m.remount("ro");
    let c3 = e.client(1, 60.0, false);
    e.register(33, c3.id(), &[1], Mode::Requeue, true);
    e.inject(1, 43, None, None);
    e.wait_for("the requeue on a read-only disk", |e| {
        e.scontrol_log().contains("requeue 33\n")
    });
    e.wait_for("status naming EROFS", |e| {
        status(e)
            .persist_failing
            .is_some_and(|f| f.errno == Some(libc::EROFS))
    });
    m.remount("rw");
    e.wait_for("the state written once writable", |e| {
        status(e).persist_failing.is_none()
    });

    // A crash now loses nothing that happened while the disk refused writes.
    e.kill_agent();
    e.start_agent();
    let s = status(&e);
    let jobs: BTreeSet<u32> = s.tasks.iter().map(|t| t.job_id).collect();
    assert!(jobs.is_superset(&[31, 32, 33].into()), "{jobs:?}");
    let hit: BTreeSet<u32> = e.events().iter().flat_map(|r| r.hit_jobs.clone()).collect();
    assert!(hit.is_superset(&[31, 32, 33].into()), "{hit:?}");
    for j in [31, 32, 33] {
        assert_eq!(
            e.scontrol_log().matches(&format!("requeue {j}\n")).count(),
            1
        );
    }
    e.kill_agent();
    drop(m);
}

/// A shared server held in FAULT by a client of no job (the H100 case: a client that never goes)
/// is stuck: the ladder's first rung ends the server, the domain is ACTIVE again and a new task
/// can compute there. Before, it stayed in FAULT for good and every new client died of 807.
#[test]
fn a_server_stuck_in_fault_by_a_client_of_no_job_is_escalated_until_it_serves_again() {
    let e = Env::with("", LADDER, "[sim]\nrecovery_ms = 100\n");
    let busy = e.client(0, 60.0, false);
    e.register(71, busy.id(), &[0], Mode::Requeue, true);
    // Idle and of no job: terminate_client does not reach it and the agent never kills it.
    let mut stranger = e.client(0, 600.0, true);
    e.inject(0, 43, None, None);
    e.wait_for("the server's end recorded", |e| {
        has_outcome(e, |o| {
            matches!(
                o,
                FaultOutcome::Escalated {
                    rung: EscalationRung::EndServer,
                    error: None,
                    ..
                }
            )
        })
    });
    e.wait_for("the server ACTIVE again", |e| {
        has_outcome(e, |o| matches!(o, FaultOutcome::ServerActive { .. }))
    });
    let f = &e.events()[0];
    let after = |o: &FaultOutcome| match o {
        FaultOutcome::Escalated { after_ms, .. } => Some(*after_ms),
        _ => None,
    };
    let ms = f.outcomes.iter().find_map(after).unwrap();
    assert!(
        (1000..3000).contains(&ms),
        "escalated {ms} ms after the fault: {f}"
    );
    assert!(
        !f.outcomes.iter().any(|o| matches!(
            o,
            FaultOutcome::Escalated {
                rung: EscalationRung::RestartDaemon | EscalationRung::Fence,
                ..
            }
        )),
        "one rung was enough: {f}"
    );
    let mut next = e.client_raw(0);
    assert_eq!(
        exit_code(&mut next, Duration::from_secs(5)),
        Some(0),
        "a new client computes"
    );
    let _ = stranger.kill();
    assert!(
        status(&e).gpus[0].domains.iter().all(|d| !d.fenced),
        "nothing fenced"
    );
}

/// A control daemon that stops answering right after a fault (seen on an H100: `quit` hung 30 s)
/// is ended and started again by the ladder's second rung; the domain then serves again.
#[test]
fn a_hung_control_daemon_of_a_stuck_domain_is_escalated_to_a_restart() {
    let e = Env::with("", LADDER, "[sim]\nrecovery_ms = 100\n");
    let busy = e.client(0, 60.0, false);
    e.register(72, busy.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    sim_control(
        &e,
        &mpsr_simgpu::SimRequest::Hang {
            domain: DomainId::shared(0),
            for_good: false,
        },
    );
    e.wait_for("the daemon restarted", |e| {
        has_outcome(e, |o| {
            matches!(
                o,
                FaultOutcome::Escalated {
                    rung: EscalationRung::RestartDaemon,
                    error: None,
                    ..
                }
            )
        })
    });
    e.wait_for("the server ACTIVE again", |e| {
        has_outcome(e, |o| matches!(o, FaultOutcome::ServerActive { .. }))
    });
    let mut next = e.client_raw(0);
    assert_eq!(
        exit_code(&mut next, Duration::from_secs(5)),
        Some(0),
        "a new client computes"
    );
}

/// A shared domain that cannot be brought back (its daemon hangs again after every restart) is
/// fenced: a new task there is refused with the reason instead of dying of 807, status names it,
/// /metrics counts it, and the node is drained with an `mpsr:` reason.
#[test]
fn a_stuck_domain_that_cannot_be_brought_back_is_fenced_and_the_node_drained() {
    let e = Env::with("", LADDER, "[sim]\nrecovery_ms = 100\n");
    let busy = e.client(0, 60.0, false);
    e.register(73, busy.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    sim_control(
        &e,
        &mpsr_simgpu::SimRequest::Hang {
            domain: DomainId::shared(0),
            for_good: true,
        },
    );
    e.wait_for("the domain fenced", |e| {
        has_outcome(e, |o| matches!(o, FaultOutcome::DomainFenced { .. }))
    });
    let st = status(&e);
    assert!(st.gpus[0].domains[0].fenced, "{:?}", st.gpus[0].domains);
    assert!(!st.gpus[1].domains[0].fenced, "the other GPU serves on");
    let r = e
        .call(&Request::Register(reg(
            74,
            std::process::id(),
            &[0],
            Mode::Requeue,
            true,
        )))
        .unwrap();
    assert!(
        matches!(
            r,
            Response::Error {
                code: mpsr_proto::ErrorCode::Refused,
                ..
            }
        ),
        "a task on the fenced GPU is refused: {r:?}"
    );
    e.register(75, std::process::id(), &[1], Mode::Requeue, true);
    e.wait_for("the node drained", |e| {
        e.scontrol_log().lines().any(|l| {
            l.contains("State=DRAIN") && l.contains("Reason=mpsr: gpu0 shared MPS server stuck")
        })
    });
}

/// A fault while the agent is down (an upgrade, a crash, an OOM kill) is caught up at its start:
/// the MPS log lines written meanwhile are read from where the last decision left them, the
/// task that died meanwhile is its victim, and its job is requeued once. Before, it was lost.
#[test]
fn a_fault_while_the_agent_was_down_is_decided_at_its_restart_exactly_once() {
    let mut e = Env::new("[sim]\nrecovery_ms = 100\n");
    let mut victim = e.client(0, 60.0, false);
    e.register(93, victim.id(), &[0], Mode::Requeue, true);
    e.kill_agent();
    let r = mpsr_simgpu::call(
        &e.path().join("run"),
        &mpsr_simgpu::SimRequest::Inject {
            gpu: 0,
            xid: 43,
            culprit: None,
            slot: None,
        },
        Duration::from_secs(3),
    )
    .unwrap();
    assert!(
        matches!(r, mpsr_simgpu::SimReply::Killed(ref k) if k == &vec![victim.id()]),
        "{r:?}"
    );
    assert!(
        exit_code(&mut victim, Duration::from_secs(5)).is_some(),
        "the victim died"
    );
    // The requeue of the caught-up fault is held after Slurm carried it out and the agent is
    // killed then, before it could write it down: its next start must not send it again.
    let (holding, hold) = (e.path().join("holding"), e.path().join("hold-after"));
    std::fs::write(&hold, "").unwrap();
    e.start_agent();
    e.wait_for("the requeue call", |_| holding.exists());
    assert!(e.scontrol_log().contains("requeue 93"));
    let f = &e.events()[0];
    assert_eq!(f.hit_jobs, vec![93], "{f}");
    e.kill_agent();
    std::fs::remove_file(&hold).unwrap();
    e.start_agent();
    e.wait_for("the requeue settled", |e| status(e).pending_actions == 0);
    // Restarted again: nothing is decided twice.
    e.kill_agent();
    e.start_agent();
    e.barrier(1);
    assert_eq!(e.faults().len(), 1, "{:?}", e.events());
    assert_eq!(
        e.scontrol_log().matches("requeue 93").count(),
        1,
        "{}",
        e.scontrol_log()
    );
}

/// A fault decided before the agent stopped is not decided again from the logs it reads at its
/// restart, and a line written before the last decision is not news.
#[test]
fn a_fault_decided_before_a_restart_is_not_replayed_while_the_agent_was_down() {
    let mut e = Env::new("[sim]\nrecovery_ms = 100\n");
    let victim = e.client(0, 60.0, false);
    e.register(94, victim.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    e.wait_for("the job requeued", |e| {
        e.scontrol_log().contains("requeue 94")
    });
    e.wait_for("the server ACTIVE again", |e| {
        has_outcome(e, |o| matches!(o, FaultOutcome::ServerActive { .. }))
    });
    e.kill_agent();
    e.start_agent();
    e.barrier(1);
    assert_eq!(e.faults().len(), 1, "{:?}", e.events());
    assert_eq!(e.scontrol_log().matches("requeue 94").count(), 1);
}

/// The simulated GPUs' daemon (standing in for an MPS control daemon) is killed under the agent:
/// the agent starts it again with its domains, and new clients run.
#[test]
fn a_killed_mps_daemon_is_started_again() {
    let e = Env::new("");
    let daemon = |e: &Env| match mpsr_simgpu::call(
        &e.path().join("run"),
        &mpsr_simgpu::SimRequest::Ping,
        Duration::from_secs(2),
    ) {
        Ok(mpsr_simgpu::SimReply::Pong { pid, .. }) => Some(pid),
        _ => None,
    };
    let pid = daemon(&e).expect("the simulated GPU daemon runs");
    // SAFETY: kill(2) on the simulator daemon this test's agent started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(15);
    while daemon(&e).is_none_or(|p| p == pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        daemon(&e).is_some_and(|p| p != pid),
        "daemon not started again"
    );
    e.wait_for("gpu0's shared server ready", |e| {
        matches!(e.call(&Request::Status), Ok(Response::Status(s))
            if s.gpus[0].state != mpsr_proto::ServerState::Down)
    });
    let mut c = e.client(0, 0.2, false);
    assert_eq!(exit_code(&mut c, Duration::from_secs(5)), Some(0));
}
