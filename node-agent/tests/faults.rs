//! The agent as a real process with the sim backend (tests/common), what a fault of each class hits and what the agent does about it: exact hit sets, requeues, drains, victims told from jobs that failed on their own, storms and clock jumps.

mod common;
use common::*;

#[test]
fn xid31_hits_every_job_on_the_gpu_and_spares_the_other_gpu() {
    let e = Env::new("");
    let mut c1 = e.client(0, 30.0, false);
    let mut c2 = e.client(0, 30.0, false);
    let mut c3 = e.client(0, 30.0, false);
    let mut c4 = e.client(1, 30.0, false);
    e.register(1, c1.id(), &[0], Mode::Requeue, true);
    e.register(2, c2.id(), &[0], Mode::Requeue, true);
    e.register(3, c3.id(), &[0], Mode::Resume, false);
    e.register(4, c4.id(), &[1], Mode::Requeue, true);
    let mut killed = e.inject(0, 31, Some(c2.id()), None);
    killed.sort();
    let mut want = vec![c1.id(), c2.id(), c3.id()];
    want.sort();
    assert_eq!(killed, want, "stock MPS: every busy client on gpu0 dies");
    for c in [&mut c1, &mut c2, &mut c3] {
        assert_eq!(
            exit_code(c, Duration::from_secs(5)),
            Some(1),
            "victim really died"
        );
    }
    assert_eq!(
        exit_code(&mut c4, Duration::from_millis(300)),
        None,
        "gpu1 client untouched"
    );
    e.wait_for("requeues", |e| {
        let l = e.scontrol_log();
        l.contains("requeue 1") && l.contains("requeue 2")
    });
    let ev = e.events();
    assert_eq!(ev.len(), 1, "nvml + kmsg signals are one fault: {ev:?}");
    let f = &ev[0];
    assert_eq!(
        (f.gpu, f.xids.clone(), f.class),
        (0, vec![31], FaultClass::AppMemory)
    );
    assert_eq!(f.hit_jobs, vec![1, 2, 3]);
    assert_eq!(f.spared_jobs, vec![4]);
    assert!(
        f.sources.contains(&SignalSource::Nvml) && f.sources.contains(&SignalSource::Kmsg),
        "{f:?}"
    );
    // The kernel line named the first client, not the culprit; it was not blamed.
    assert_eq!(f.reported_pid, Some(c1.id()));
    assert_eq!(f.culprit, None);
    assert!(
        f.actions.contains(&FaultAction::Resume {
            job_id: 3,
            step_id: 0,
            pid: c3.id()
        }),
        "{:?}",
        f.actions
    );
    assert!(!e.scontrol_log().contains("requeue 4"));
    assert!(!e.scontrol_log().contains("DRAIN"));
    // The server recovers once the faulting clients are gone; a new client is accepted.
    e.wait_for("recovery", |e| {
        e.events()[0]
            .outcomes
            .iter()
            .any(|o| matches!(o, FaultOutcome::ServerActive { .. }))
    });
    let mut c5 = e.client(0, 0.2, false);
    assert_eq!(exit_code(&mut c5, Duration::from_secs(5)), Some(0));
    let _ = c4.kill();
}

#[test]
fn server_refuses_clients_while_in_fault_and_lingering_clients_are_terminated() {
    let e = Env::new("[sim]\nrecovery_ms = 200\n");
    let c1 = e.client(0, 30.0, false);
    e.register(1, c1.id(), &[0], Mode::Requeue, true);
    // Stop the victim so it cannot exit: the server stays in FAULT until the agent ends it.
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(c1.id() as i32, libc::SIGSTOP) };
    e.inject(0, 43, None, None);
    // The driver reports the fault ~14 ms after it (SIMULATED as measured): FAULT from then on.
    e.wait_for("the server in FAULT", |e| {
        matches!(e.call(&Request::Status), Ok(Response::Status(s)) if s.gpus[0].state == ServerState::Fault)
    });
    let mut refused = e.client_raw(0);
    assert_eq!(
        exit_code(&mut refused, Duration::from_secs(5)),
        Some(1),
        "807 while in FAULT"
    );
    // A hit job's client still attached after the grace is ended (SIGKILL: terminate_client
    // does not reach a client that is not calling CUDA, and blocks the control daemon).
    e.wait_for("the lingering client ended", |e| {
        e.events().first().is_some_and(|f| {
            f.outcomes
                .iter()
                .any(|o| matches!(o, FaultOutcome::HitClientKilled { error: None, .. }))
        })
    });
    // SAFETY: as above.
    unsafe { libc::kill(c1.id() as i32, libc::SIGKILL) };
}

/// A task that starts while its domain's server recovers from a neighbour's fault is held in its
/// registration until the server is ACTIVE again: MPS refuses a new client of a server in FAULT
/// (807), which failed innocent jobs that started just after a fault (found by the soak).
#[test]
fn a_task_starting_while_its_domain_recovers_is_held_until_the_server_is_active() {
    let e = Env::new("[sim]\nrecovery_ms = 400\n");
    let c1 = e.client(0, 30.0, false);
    e.register(1, c1.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    e.wait_for("the fault decided and the server in FAULT", |e| {
        !e.events().is_empty()
            && matches!(e.call(&Request::Status), Ok(Response::Status(s)) if s.gpus[0].state == ServerState::Fault)
    });
    // Job 2's task registers now (slurmstepd, before the task's program starts).
    let task = Proc(Command::new("sleep").arg("30").spawn().unwrap());
    let t = Instant::now();
    e.register(2, task.id(), &[0], Mode::Requeue, true);
    let held = t.elapsed();
    assert!(
        matches!(e.call(&Request::Status), Ok(Response::Status(s)) if s.gpus[0].state != ServerState::Fault),
        "answered only once the server left FAULT (after {held:?})"
    );
    let mut first = e.client_raw(0);
    assert_eq!(
        exit_code(&mut first, Duration::from_secs(5)),
        Some(0),
        "its first client is accepted"
    );
    let Response::JobReport(rep) = e.call(&Request::JobReport { job_id: 2 }).unwrap() else {
        panic!("no report")
    };
    assert!(
        rep.actions.iter().any(|l| l.contains("held")),
        "{:?}",
        rep.actions
    );
    drop(c1);
}

#[test]
fn hardware_classes_drain_and_application_classes_do_not() {
    let e = Env::new("");
    let mut c = e.client(1, 30.0, false);
    e.register(7, c.id(), &[1], Mode::Requeue, true);
    e.inject(1, 79, None, None);
    assert_eq!(exit_code(&mut c, Duration::from_secs(5)), Some(1));
    e.wait_for("drain + requeue", |e| {
        let l = e.scontrol_log();
        l.contains("requeue 7")
            && l.contains("State=DRAIN Reason=mpsr: xid 79 (device_lost) on gpu1 of n1")
    });
    match e.call(&Request::Health).unwrap() {
        Response::Health(h) => assert!(!h.healthy && h.reasons[0].starts_with("mpsr:")),
        r => panic!("{r:?}"),
    }
    e.call(&Request::SimRecover { gpu: 1 }).unwrap();
    e.wait_for(
        "healthy after reset",
        |e| matches!(e.call(&Request::Health), Ok(Response::Health(h)) if h.healthy),
    );
    // Info and unknown Xids: nobody hit, no action.
    let c2 = e.client(0, 30.0, false);
    e.register(8, c2.id(), &[0], Mode::Requeue, true);
    for x in [63, 4242] {
        e.inject(0, x, None, None);
        std::thread::sleep(Duration::from_millis(600)); // outside the correlation window
    }
    let ev = e.events();
    let last2: Vec<_> = ev.iter().rev().take(2).collect();
    assert!(
        last2
            .iter()
            .all(|f| f.hit_jobs.is_empty() && f.actions.is_empty()),
        "{last2:?}"
    );
    assert!(!e.scontrol_log().contains("requeue 8"));
}

/// A victim's task may be reported dead (Slurm's task_exit -> deregister) before the fault's first
/// signal reaches the agent: it is still in the hit set, and a task that ended cleanly is not.
#[test]
fn a_victim_that_deregistered_just_before_the_fault_is_still_hit() {
    let e = Env::new("");
    let c1 = e.client(0, 30.0, false);
    let c2 = e.client(0, 30.0, false);
    e.register(21, c1.id(), &[0], Mode::Requeue, true);
    e.register(22, c2.id(), &[0], Mode::Requeue, true);
    for (job, pid, status) in [(21, c1.id(), 1), (22, c2.id(), 0)] {
        let r = e
            .call(&Request::Deregister {
                job_id: job,
                step_id: mpsr_proto::BATCH_STEP,
                pid,
                exit_status: Some(status),
            })
            .unwrap();
        assert_eq!(r, Response::Ok);
    }
    e.inject(0, 43, None, None);
    e.wait_for("requeue of the early-exited victim", |e| {
        e.scontrol_log().contains("requeue 21")
    });
    let f = &e.events()[0];
    assert_eq!(f.hit_jobs, vec![21], "{f:?}");
    assert!(!e.scontrol_log().contains("requeue 22"));
}

/// A task that failed on its own (exit status 1, no GPU fault) shortly before another job's
/// fault is not counted as the fault's victim: only an exit within `victim_exit_before_ms` of the
/// fault's first signal is (issue 25.5: such a job was requeued, 0.38 s before a fault).
#[test]
fn a_job_that_failed_on_its_own_before_a_fault_is_not_its_victim() {
    let e = Env::new("");
    let c1 = e.client(0, 30.0, false);
    let c2 = e.client(0, 30.0, false);
    e.register(31, c1.id(), &[0], Mode::Requeue, true);
    e.register(32, c2.id(), &[0], Mode::Requeue, true);
    let r = e
        .call(&Request::Deregister {
            job_id: 31,
            step_id: mpsr_proto::BATCH_STEP,
            pid: c1.id(),
            exit_status: Some(1),
        })
        .unwrap();
    assert_eq!(r, Response::Ok);
    drop(c1);
    std::thread::sleep(Duration::from_millis(450));
    e.inject(0, 43, None, None);
    e.wait_for("requeue of the job the fault hit", |e| {
        e.scontrol_log().contains("requeue 32")
    });
    let f = &e.events()[0];
    assert_eq!(f.hit_jobs, vec![32], "{f:?}");
    e.barrier(1);
    assert!(
        !e.scontrol_log().contains("requeue 31"),
        "{}",
        e.scontrol_log()
    );
}

/// A job with one task per GPU (the two-GPU case of issue 6, simulated): a fault on GPU 0 hits the
/// job as a whole (one requeue), the fault itself kills only GPU 0's clients, and GPU 1's server
/// stays ACTIVE and accepts new clients throughout.
#[test]
fn a_job_spanning_both_gpus_is_hit_as_a_whole_and_gpu1_keeps_serving() {
    let e = Env::new("");
    let mut t0 = e.client(0, 30.0, false);
    let mut t1 = e.client(1, 30.0, false);
    let mut other1 = e.client(1, 30.0, false);
    e.register(31, t0.id(), &[0], Mode::Requeue, true);
    e.register(31, t1.id(), &[1], Mode::Requeue, true);
    e.register(32, other1.id(), &[1], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    assert_eq!(
        exit_code(&mut t0, Duration::from_secs(5)),
        Some(1),
        "GPU 0 task dies"
    );
    // GPU 1 accepts a new client right after the fault on GPU 0.
    let mut fresh = e.client(1, 0.2, false);
    assert_eq!(exit_code(&mut fresh, Duration::from_secs(5)), Some(0));
    e.wait_for("requeue of the spanning job", |e| {
        e.scontrol_log().contains("requeue 31")
    });
    let f = &e.events()[0];
    assert_eq!(f.hit_jobs, vec![31]);
    assert_eq!(f.spared_jobs, vec![32]);
    assert_eq!(e.scontrol_log().matches("requeue 31").count(), 1);
    assert!(!e.scontrol_log().contains("requeue 32"));
    assert_eq!(
        exit_code(&mut t1, Duration::from_millis(300)),
        None,
        "the fault does not reach GPU 1"
    );
    assert_eq!(exit_code(&mut other1, Duration::from_millis(10)), None);
    let _ = t1.kill();
    let _ = other1.kill();
}

/// An idle client (no CUDA call in flight) is not reached by terminate_client and holds its
/// server in FAULT (measured on an H200). After twice the grace the agent ends a hit job's client;
/// a client of no hit job is reported as the blocker, not killed.
#[test]
fn an_idle_hit_client_is_ended_so_its_server_recovers() {
    use std::os::unix::process::ExitStatusExt;
    let e = Env::new("");
    let mut idle = e.client(0, 60.0, true);
    e.register(81, idle.id(), &[0], Mode::Requeue, true);
    let mut stranger = e.client(0, 60.0, true);
    e.inject(0, 43, None, None);
    e.wait_for("the blocker reported", |e| {
        e.events().first().is_some_and(|f| {
            f.outcomes
                .iter()
                .any(|o| matches!(o, FaultOutcome::ServerHeld { pid, .. } if *pid == stranger.id()))
        })
    });
    let st = idle.wait().unwrap();
    assert_eq!(
        st.signal(),
        Some(libc::SIGKILL),
        "the hit job's idle client was ended"
    );
    assert!(
        exit_code(&mut stranger, Duration::from_millis(100)).is_none(),
        "a client of no hit job is never killed"
    );
    let f = &e.events()[0];
    assert!(
        f.outcomes
            .iter()
            .any(|o| matches!(o, FaultOutcome::HitClientKilled { error: None, .. })),
        "{f}"
    );
    assert!(
        !f.outcomes
            .iter()
            .any(|o| matches!(o, FaultOutcome::ServerActive { .. })),
        "{f}"
    );
    let _ = stranger.kill();
    e.wait_for("server ACTIVE once the blocker is gone", |e| {
        e.events()[0]
            .outcomes
            .iter()
            .any(|o| matches!(o, FaultOutcome::ServerActive { .. }))
    });
}

/// Chaos: a fault storm, 100 faults/s over both GPUs for 10 s, Xids of every class. Every
/// job hit is requeued exactly once (one requeue per run however many faults hit it), the
/// agent keeps answering, its history stays at its bound and its memory does not grow with the
/// number of faults.
#[test]
fn a_fault_storm_acts_on_each_job_once_with_bounded_memory() {
    let e = Env::new("history = 100\ncorrelation_window_ms = 5\n");
    let agent_pid = e.agent.as_ref().unwrap().id();
    let rss_before = rss_kib(agent_pid);
    let mut procs = Vec::new();
    let mut jobs = BTreeSet::new();
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    // Four jobs per GPU (a server in FAULT refuses new clients, as measured, so they come first).
    for gpu in 0..2u32 {
        for k in 0..4 {
            let job = 500 + 10 * gpu + k;
            let c = e.client(gpu, 60.0, false);
            e.register(job, c.id(), &[gpu], Mode::Requeue, true);
            jobs.insert(job);
            procs.push(c);
        }
    }
    for i in 0..1000u32 {
        // Mostly application faults; now and then a hardware one (double-bit ECC) that drains.
        let xid = if i % 100 == 50 {
            48
        } else {
            [43, 31, 13, 45][(i % 4) as usize]
        };
        let t = Instant::now();
        e.inject(i % 2, xid, None, None);
        slowest = slowest.max(t.elapsed());
        // 100 per second.
        let due = started + Duration::from_millis(10 * u64::from(i + 1));
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    }
    e.wait_for("every job requeued", |e| {
        let l = e.scontrol_log();
        jobs.iter().all(|j| l.contains(&format!("requeue {j}\n")))
    });
    e.wait_for("no action left", |e| status(e).pending_actions == 0);
    let log = e.scontrol_log();
    for j in &jobs {
        assert_eq!(
            log.matches(&format!("requeue {j}\n")).count(),
            1,
            "job {j} requeued once"
        );
    }
    assert_eq!(
        log.matches("State=DRAIN").count(),
        1,
        "one drain however many hardware faults: {log}"
    );
    let t = Instant::now();
    let _ = status(&e);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "status took {:?}",
        t.elapsed()
    );
    let events = match e.call(&Request::Events { limit: 10_000 }).unwrap() {
        Response::Events { events, .. } => events,
        r => panic!("{r:?}"),
    };
    assert!(events.len() <= 100, "history bounded: {}", events.len());
    let grown = rss_kib(agent_pid).saturating_sub(rss_before);
    eprintln!(
        "storm: {} decisions kept, {} jobs, RSS +{grown} KiB, slowest injection {slowest:?}",
        events.len(),
        jobs.len()
    );
    assert!(grown < 32 * 1024, "RSS grew {grown} KiB");
}

/// Chaos: the wall clock jumps a day ahead and then two days back under a running agent (libfaketime
/// with the monotonic clock left alone, as an NTP step does). Fault correlation, grace periods and
/// retries run on the monotonic clock: each fault is still decided and each job requeued once.
#[test]
fn a_wall_clock_jump_changes_no_decision() {
    let lib = Path::new("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1");
    if !lib.exists() {
        skip("libfaketime is not installed (apt install faketime)");
        return;
    }
    let mut e = Env::new("");
    e.kill_agent();
    let clock = e.path().join("faketime");
    std::fs::write(&clock, "+0\n").unwrap();
    e.agent_env = vec![
        ("LD_PRELOAD".into(), lib.display().to_string()),
        (
            "FAKETIME_TIMESTAMP_FILE".into(),
            clock.display().to_string(),
        ),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
        ("DONT_FAKE_MONOTONIC".into(), "1".into()),
    ];
    e.start_agent();
    let day_ms: i64 = 86_400_000;
    for (job, gpu, offset, shift) in [(41u32, 0u32, "+1d", day_ms), (42, 1, "-1d", -day_ms)] {
        let c = e.client(gpu, 60.0, false);
        e.register(job, c.id(), &[gpu], Mode::Requeue, true);
        std::fs::write(&clock, format!("{offset}\n")).unwrap();
        let before = mpsr_agent::sys::now_ms() as i64;
        e.inject(gpu, 43, None, None);
        let want = format!("requeue {job}\n");
        e.wait_for("the requeue after the jump", |e| {
            e.scontrol_log().contains(&want)
        });
        let rec = e
            .events()
            .into_iter()
            .find(|r| r.hit_jobs.contains(&job))
            .expect("decided");
        // Recorded on the agent's (jumped) wall clock, decided as fast as ever.
        let skew = rec.at_ms as i64 - before - shift;
        assert!(
            skew.abs() < 60_000,
            "at_ms off by {skew} ms from the jumped clock"
        );
        assert!(rec.decide_us < 5_000_000, "{rec:?}");
        // A second requeue would be queued by this decision: none is left to run.
        e.wait_for("no Slurm action pending", |e| {
            status(e).pending_actions == 0
        });
        assert_eq!(e.scontrol_log().matches(&want).count(), 1);
    }
}
