//! The agent as a real process with the sim backend (tests/common), operations: self-check, systemd readiness and watchdog, journald fields, the hot standby.

mod common;
use common::*;

/// On a machine without a GPU driver the self-check says what is missing and fails cleanly; on a
/// GPU node this test is skipped (tests/gpu/ covers the real backend).
#[test]
fn self_check_without_a_gpu_fails_cleanly() {
    if Path::new("/dev/nvidiactl").exists() {
        skip("a GPU driver is present; run tests/gpu/gpu_proof.py for the nvml backend");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{0}/s\"\nrun_dir = \"{0}/r\"\nsocket = \"{0}/r/a.sock\"\n",
            d.path().display()
        ),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg("--config")
        .arg(&cfg)
        .arg("--self-check")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("FAIL  NVML"), "{text}");
    assert!(!String::from_utf8_lossy(&o.stderr).contains("panicked"));
    // Starting the nvml backend without a GPU is an error message, not a crash.
    let o = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("NVML"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Under systemd (`Type=notify`) the agent says READY=1 once its socket serves; with
/// `WatchdogSec=` it pings WATCHDOG=1 while it answers on its socket, and stops while it is hung
/// (here SIGSTOPped: systemd would restart it).
#[test]
fn the_agent_tells_systemd_when_it_is_ready() {
    let mut e = Env::new("");
    e.kill_agent();
    let sock_path = e.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_millis(250)))
        .unwrap();
    let log_path = e.path().join("agent-notify.log");
    let child = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg("--config")
        .arg(e.path().join("agent.toml"))
        .env("NOTIFY_SOCKET", &sock_path)
        .env("WATCHDOG_USEC", "1000000")
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    e.agent = Some(child);
    let mut buf = [0u8; 256];
    // Generous: CI machines are loaded; a failure says why (the agent's log, or its exit).
    let deadline = Instant::now() + Duration::from_secs(60);
    let n = loop {
        match notify.recv(&mut buf) {
            Ok(n) => break n,
            Err(err) => {
                let exited = e.agent.as_mut().unwrap().try_wait().unwrap();
                if exited.is_some() || Instant::now() > deadline {
                    panic!(
                        "no readiness datagram ({err}); agent exit {exited:?}; its log:\n{}",
                        std::fs::read_to_string(&log_path).unwrap_or_default()
                    );
                }
            }
        }
    };
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.starts_with("READY=1\n"), "{msg}");
    assert!(msg.contains("STATUS=serving 2 GPU(s)"), "{msg}");
    // Ready means serving.
    assert!(matches!(
        e.call(&Request::Hello {
            version: mpsr_proto::PROTOCOL_VERSION
        }),
        Ok(Response::Hello { .. })
    ));
    let pings = |notify: &std::os::unix::net::UnixDatagram, for_: Duration| {
        let end = Instant::now() + for_;
        let (mut n, mut buf) = (0, [0u8; 64]);
        while Instant::now() < end {
            if let Ok(k) = notify.recv(&mut buf) {
                n += usize::from(&buf[..k] == b"WATCHDOG=1");
            }
        }
        n
    };
    assert!(
        pings(&notify, Duration::from_secs(3)) >= 3,
        "pinged every 0.5 s while it answers"
    );
    let pid = e.agent.as_ref().unwrap().id() as libc::pid_t;
    // SAFETY: signals to the agent child this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let _ = pings(&notify, Duration::from_millis(600));
    assert_eq!(
        pings(&notify, Duration::from_secs(2)),
        0,
        "a hung agent is not pinged for"
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
}

/// `log.target = "journald"`: every decision reaches the journal with its fields as fields
/// (MPSR_FAULT_ID, MPSR_GPU, MPSR_HIT, ...), so `journalctl MPSR_FAULT_ID=1` finds it. The agent runs
/// in a mount namespace whose /run holds this test's socket in place of journald's.
#[test]
fn decisions_reach_journald_with_their_fields() {
    if !is_root() {
        skip(
            "needs root: runs the agent in a mount namespace with a stand-in for journald's socket",
        );
        return;
    }
    let ns = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            "mount --make-rprivate / && mount -t tmpfs tmpfs /mnt",
        ])
        .status();
    if !ns.is_ok_and(|s| s.success()) {
        skip("unshare -m with mounts does not work here");
        return;
    }
    let mut e = Env::new("");
    e.kill_agent();
    let fake_run = e.path().join("fake-run");
    std::fs::create_dir_all(fake_run.join("systemd/journal")).unwrap();
    let journal =
        std::os::unix::net::UnixDatagram::bind(fake_run.join("systemd/journal/socket")).unwrap();
    journal
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let cfg = e.path().join("agent.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("target = \"stderr\"", "target = \"journald\""),
    )
    .unwrap();
    let child = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            "mount --make-rprivate / && mount --bind \"$1\" /run && exec \"$2\" --config \"$3\"",
            "sh",
        ])
        .arg(&fake_run)
        .arg(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg(&cfg)
        .stderr(std::fs::File::create(e.path().join("agent-journald.log")).unwrap())
        .spawn()
        .unwrap();
    e.agent = Some(child);
    let up = Instant::now() + Duration::from_secs(20);
    while !matches!(
        e.call(&Request::Hello {
            version: mpsr_proto::PROTOCOL_VERSION
        }),
        Ok(Response::Hello { .. })
    ) {
        if Instant::now() > up || e.agent.as_mut().unwrap().try_wait().unwrap().is_some() {
            panic!(
                "the agent with log.target = journald did not start: {}",
                std::fs::read_to_string(e.path().join("agent-journald.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let c = e.client(0, 60.0, false);
    e.register(61, c.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = vec![0u8; 1 << 16];
    let decision = loop {
        assert!(
            Instant::now() < deadline,
            "no decision entry reached the journal"
        );
        let Ok(n) = journal.recv(&mut buf) else {
            continue;
        };
        let entry = journal_fields(&buf[..n]);
        // The first decision may still await the domain, or come from the server's line before
        // the Xid; the one naming the hit job and the Xid counts.
        if entry.get("MESSAGE").map(String::as_str) == Some("decision")
            && entry.get("MPSR_HIT").is_some_and(|h| h.contains("61"))
            && entry.get("MPSR_XIDS").is_some_and(|x| x != "[]")
        {
            break entry;
        }
    };
    for field in ["MPSR_FAULT_ID", "MPSR_HIT", "MPSR_CLASS", "PRIORITY"] {
        assert!(
            decision.contains_key(field),
            "{field} missing in {decision:?}"
        );
    }
    assert_eq!(decision["MPSR_GPU"], "0");
    assert_eq!(decision["SYSLOG_IDENTIFIER"], "mpsr-agent");
    assert_eq!(decision["MPSR_XIDS"], "[43]");
}

#[test]
fn a_hot_standby_takes_over_a_hit_task_without_a_restart() {
    let e = Env::new("");
    let (sup, err) = standby_task(&e, 51);
    e.wait_for(
        "the standby attached to the standby domain and armed",
        |e| standby_clients(e).len() == 1 && armed_standby(e, 51).is_some(),
    );
    let standby = standby_clients(&e)[0];
    assert_eq!(armed_standby(&e, 51), Some(standby));
    let primary = e.client(0, 30.0, false); // a neighbour's job in the shared server
    e.register(52, primary.id(), &[0], Mode::Requeue, true);
    let killed = e.inject(0, 43, None, Some(0));
    assert_eq!(
        killed.len(),
        2,
        "the task's primary and the neighbour: {killed:?}"
    );
    e.wait_for("the takeover", |_| {
        std::fs::read_to_string(&err).is_ok_and(|t| t.contains("took over"))
    });
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(!text.contains("restarting in place"), "{text}");
    // The standby is the task's process now; it computes as a busy client of its server.
    assert!(std::path::Path::new(&format!("/proc/{standby}")).exists());
    let f = &e.events()[0];
    assert!(
        f.hit_jobs.contains(&51) && f.hit_jobs.contains(&52),
        "{f:?}"
    );
    e.wait_for("the outcome line", |e| {
        e.events()[0].outcomes.iter().any(|o| {
            matches!(o, FaultOutcome::StandbyTookOver { standby: s, job: 51, .. } if *s == standby)
        })
    });
    e.wait_for("the neighbour requeued", |e| {
        e.scontrol_log().contains("requeue 52")
    });
    assert!(!e.scontrol_log().contains("requeue 51"));
    drop(sup);
}

/// A warm standby waits before its first CUDA call: armed, but no client of any server (no
/// context, no GPU memory) until the fault; released at the task's fault, it attaches and the
/// task goes on without a restart.
#[test]
fn a_warm_standby_waits_without_a_context_and_takes_over() {
    let e = Env::new("");
    let (sup, err) = standby_task_of(&e, 55, "warm");
    e.wait_for("the warm standby armed", |e| armed_standby(e, 55).is_some());
    let standby = armed_standby(&e, 55).unwrap();
    assert!(std::path::Path::new(&format!("/proc/{standby}")).exists());
    // Armed and waiting, yet a client of no server.
    std::thread::sleep(Duration::from_millis(300));
    assert!(standby_clients(&e).is_empty(), "{:?}", standby_clients(&e));
    let all: Vec<u32> = match e.call(&Request::Status).unwrap() {
        Response::Status(s) => s.gpus[0]
            .domains
            .iter()
            .flat_map(|d| d.clients.clone())
            .collect(),
        r => panic!("{r:?}"),
    };
    assert!(!all.contains(&standby), "{all:?}");
    let neighbour = e.client(0, 30.0, false);
    e.register(56, neighbour.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, Some(0));
    e.wait_for("the takeover", |_| {
        std::fs::read_to_string(&err).is_ok_and(|t| t.contains("warm standby took over"))
    });
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(!text.contains("restarting in place"), "{text}");
    // Released, it attached to its (standby) domain's server and computes there.
    e.wait_for("the released standby a client of the standby domain", |e| {
        standby_clients(e) == vec![standby]
    });
    e.wait_for("the outcome line", |e| {
        e.events()[0].outcomes.iter().any(|o| {
            matches!(o, FaultOutcome::StandbyTookOver { standby: s, job: 55, .. } if *s == standby)
        })
    });
    drop(sup);
}

/// A hot standby that dies before any fault is not replaced by another; its supervisor keeps a
/// cold one instead (the GPU's standby domain runs), so the fault's restart still starts at the
/// decision, in that domain.
#[test]
fn a_standby_gone_before_the_fault_leaves_a_cold_one_for_the_restart() {
    let e = Env::new("");
    let (sup, err) = standby_task(&e, 53);
    e.wait_for("the standby attached and armed", |e| {
        standby_clients(e).len() == 1 && armed_standby(e, 53).is_some()
    });
    let standby = standby_clients(&e)[0];
    // SAFETY: kill(2) on a process of this test.
    unsafe { libc::kill(standby as i32, libc::SIGKILL) };
    e.wait_for("mpsr-run saw its standby end", |_| {
        std::fs::read_to_string(&err).is_ok_and(|t| t.contains("ended before any fault"))
    });
    // It falls back to a cold standby: the standby domain still runs, so the restart still
    // starts at the decision.
    e.wait_for("a cold standby armed instead", |e| {
        status(e)
            .tasks
            .iter()
            .any(|t| t.job_id == 53 && t.standby_kind == Some(mpsr_proto::standby::Kind::Cold))
    });
    let neighbour = e.client(0, 30.0, false);
    e.register(54, neighbour.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, Some(0));
    e.wait_for("the restart in place", |_| {
        std::fs::read_to_string(&err).is_ok_and(|t| t.contains("restarting in place"))
    });
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(!text.contains("took over"), "{text}");
    assert!(
        text.contains("(1/3) at once, its clients in gpu0/d"),
        "{text}"
    );
    drop(sup);
}

/// A resume supervisor that asks while its task's server recovers is held and answered `Restart`
/// the moment the server is ACTIVE again, instead of `Wait` to poll once more; an older
/// supervisor (no hold asked) gets `Wait` at once, as before.
#[test]
fn a_held_resume_query_is_answered_when_the_server_recovers() {
    let e = Env::new("[sim]\nrecovery_ms = 500\n");
    let task = e.client(0, 30.0, false);
    let neighbour = e.client(0, 30.0, false);
    e.register(61, task.id(), &[0], Mode::Resume, false);
    e.register(62, neighbour.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, Some(0));
    e.wait_for("the decision", |e| !e.events().is_empty());
    let ask = |wait_ms| match e
        .call(&Request::ResumeQuery {
            job_id: 61,
            step_id: 0,
            pid: task.id(),
            wait_ms,
            may_move: true,
        })
        .unwrap()
    {
        Response::Resume { verdict, .. } => verdict,
        r => panic!("{r:?}"),
    };
    assert_eq!(
        ask(0),
        mpsr_proto::ResumeVerdict::Wait,
        "the server still recovers"
    );
    assert_eq!(ask(1000), mpsr_proto::ResumeVerdict::Restart);
}

/// A resume task hit in the shared domain with no standby of its own is restarted at once in the
/// GPU's standby domain, whose server runs (another task's standby waits there), while the
/// shared server still recovers: its supervisor keeps a cold standby there (its own waiter on a
/// FIFO, armed like a standby: nothing of the task's runs there before the fault), is released at
/// the decision, and its next child is a client of that domain; the task is recorded there and the
/// fault's record says so. The old way (its own server once ACTIVE) is what an agent told
/// `restart_in_standby_domain = false` does: it refuses the cold standby.
#[test]
fn a_hit_task_restarts_at_once_in_the_running_standby_domain() {
    for allowed in [true, false] {
        let e = Env::new(&format!(
            "[sim]\nrecovery_ms = 4000\n[standby]\nrestart_in_standby_domain = {allowed}\n"
        ));
        let (_sb, _) = standby_task(&e, 71);
        e.wait_for("the standby in its domain", |e| {
            standby_clients(e).len() == 1 && armed_standby(e, 71).is_some()
        });
        let (_sup, err) = supervised_task(&e, 72, None);
        e.wait_for("the task in the shared domain", |e| {
            shared_clients(e).len() == 2
        });
        let standby = standby_clients(&e)[0];
        if allowed {
            e.wait_for("the task's cold standby armed", |e| {
                armed_standby(e, 72).is_some()
            });
            let cold = armed_standby(&e, 72).unwrap();
            let kind_of = |job| {
                status(&e)
                    .tasks
                    .into_iter()
                    .find(|t| t.job_id == job)
                    .and_then(|t| t.standby_kind)
            };
            assert_eq!(kind_of(72), Some(mpsr_proto::standby::Kind::Cold));
            assert_eq!(kind_of(71), Some(mpsr_proto::standby::Kind::Hot));
            assert!(
                standby_clients(&e) == vec![standby],
                "a cold standby is no client: {:?}",
                standby_clients(&e)
            );
            assert_ne!(cold, standby);
        } else {
            // Given time to ask: refused.
            std::thread::sleep(std::time::Duration::from_millis(300));
            assert_eq!(armed_standby(&e, 72), None);
        }
        e.inject(0, 43, None, Some(0));
        e.wait_for("the restart", |_| {
            std::fs::read_to_string(&err).is_ok_and(|t| t.contains("restarting in place"))
        });
        let text = std::fs::read_to_string(&err).unwrap();
        let shared = status(&e).gpus[0].domains[0].clone();
        assert!(shared.domain.is_shared());
        if !allowed {
            assert!(!text.contains("its clients in"), "{text}");
            assert_eq!(shared.state, mpsr_proto::ServerState::Active, "{text}");
            continue;
        }
        assert!(text.contains("at once, its clients in gpu0/d"), "{text}");
        assert_ne!(
            shared.state,
            mpsr_proto::ServerState::Active,
            "restarted while the shared server recovers: {text}"
        );
        e.wait_for("the restarted child a client of the standby domain", |e| {
            standby_clients(e).iter().any(|p| *p != standby)
        });
        let task = status(&e)
            .tasks
            .into_iter()
            .find(|t| t.job_id == 72)
            .unwrap();
        assert!(
            task.domains.iter().any(|d| !d.is_shared()),
            "recorded in the standby domain: {task:?}"
        );
        e.wait_for("the outcome line", |e| {
            e.events().iter().any(|f| {
                f.outcomes.iter().any(|o| {
                    matches!(o, FaultOutcome::RestartedElsewhere { job: 72, from, .. } if from.is_shared())
                })
            })
        });
    }
}
