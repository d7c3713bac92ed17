//! The agent as a real process with the sim backend (tests/common), who may do what: bad input refused, peer credentials, per-user connection caps, reports and metrics only to their owners.

mod common;
use common::*;

#[test]
fn bad_input_is_refused_and_the_agent_keeps_serving() {
    use std::os::unix::net::UnixStream;
    let e = Env::new("");
    // Malformed JSON.
    let mut s = UnixStream::connect(e.sock()).unwrap();
    s.write_all(&5u32.to_be_bytes()).unwrap();
    s.write_all(b"{oops").unwrap();
    let r: Response = mpsr_proto::read_frame(&mut s).unwrap();
    assert!(
        matches!(
            r,
            Response::Error {
                code: mpsr_proto::ErrorCode::BadRequest,
                ..
            }
        ),
        "{r:?}"
    );
    // Oversized frame.
    let mut s = UnixStream::connect(e.sock()).unwrap();
    s.write_all(&(10u32 << 20).to_be_bytes()).unwrap();
    let r: Response = mpsr_proto::read_frame(&mut s).unwrap();
    assert!(matches!(r, Response::Error { .. }));
    // Truncated frame then close; unknown op; unknown GPU; dead pid.
    let mut s = UnixStream::connect(e.sock()).unwrap();
    s.write_all(&100u32.to_be_bytes()).unwrap();
    drop(s);
    let r = {
        let mut s = UnixStream::connect(e.sock()).unwrap();
        let body = br#"{"op":"reboot_node"}"#;
        s.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
        s.write_all(body).unwrap();
        mpsr_proto::read_frame::<Response>(&mut s).unwrap()
    };
    assert!(matches!(r, Response::Error { .. }));
    let me = std::process::id();
    assert!(matches!(
        e.call(&Request::Register(reg(1, me, &[9], Mode::Requeue, true)))
            .unwrap(),
        Response::Error {
            code: mpsr_proto::ErrorCode::NotFound,
            ..
        }
    ));
    assert!(matches!(
        e.call(&Request::Register(reg(
            1,
            4_000_000,
            &[0],
            Mode::Requeue,
            true
        )))
        .unwrap(),
        Response::Error { .. }
    ));
    assert!(matches!(
        e.call(&Request::Hello {
            version: mpsr_proto::PROTOCOL_VERSION,
        })
        .unwrap(),
        Response::Hello {
            simulated: true,
            ..
        }
    ));
}

#[test]
fn a_user_cannot_lie_about_uid_or_touch_another_users_job() {
    if !is_root() {
        skip("needs root to run a second uid");
        return;
    }
    let e = Env::new("");
    // Root registers job 21 for uid 1000.
    let me = std::process::id();
    let mut r = reg(21, me, &[0], Mode::Requeue, true);
    r.uid = Some(1000);
    assert!(matches!(
        e.call(&Request::Register(r)).unwrap(),
        Response::Registered { .. }
    ));
    let ctl = env!("CARGO_BIN_EXE_mpsrctl");
    let sock = e.sock();
    let as_nobody = |args: &[&str]| {
        let out = Command::new(ctl)
            .arg("--socket")
            .arg(&sock)
            .args(args)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // nobody claims uid 0 for its own process: refused.
    let sleeper = Command::new("sleep")
        .arg("30")
        .uid(65534)
        .gid(65534)
        .spawn()
        .unwrap();
    let pid = sleeper.id().to_string();
    let (code, err) = as_nobody(&[
        "register", "--job", "22", "--pid", &pid, "--gpus", "0", "--uid", "0",
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("PermissionDenied"), "{err}");
    // nobody registers into uid 1000's job: refused.
    let (code, err) = as_nobody(&["register", "--job", "21", "--pid", &pid, "--gpus", "0"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("another user"), "{err}");
    // nobody registers root's process: refused.
    let (code, err) = as_nobody(&[
        "register",
        "--job",
        "23",
        "--pid",
        &me.to_string(),
        "--gpus",
        "0",
    ]);
    assert_eq!(code, Some(1), "{err}");
    // nobody reads or deregisters the other job, or injects faults: refused.
    assert_eq!(as_nobody(&["report", "21"]).0, Some(1));
    assert_eq!(
        as_nobody(&[
            "deregister",
            "--job",
            "21",
            "--step",
            &mpsr_proto::BATCH_STEP.to_string(),
            "--pid",
            &me.to_string()
        ])
        .0,
        Some(1)
    );
    assert_eq!(
        as_nobody(&["sim", "inject", "--gpu", "0", "--xid", "31"]).0,
        Some(1)
    );
    // A job Slurm has not reported running here takes no registration from a user: nobody
    // cannot claim job 24 for itself before Slurm says it is nobody's.
    let (code, err) = as_nobody(&["register", "--job", "24", "--pid", &pid, "--gpus", "0"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not running on node"), "{err}");
    // Slurm's prolog reports job 24 for nobody: its own registration works, and status shows
    // only its own task.
    assert_eq!(
        e.call(&Request::JobStart {
            job_id: 24,
            uid: 65534,
            restart_count: 0
        })
        .unwrap(),
        Response::Ok
    );
    assert_eq!(
        as_nobody(&["register", "--job", "24", "--pid", &pid, "--gpus", "0"]).0,
        Some(0)
    );
    let out = Command::new(ctl)
        .arg("--socket")
        .arg(&sock)
        .args(["--json", "status"])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("\"job_id\": 24") && !s.contains("\"job_id\": 21"),
        "{s}"
    );
    drop(sleeper);
}

#[test]
fn bad_config_is_rejected_with_the_key_named() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("a.toml");
    std::fs::write(&p, "backend = \"sim\"\n[mps]\ndefault_thread_pct = 300\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg("--config")
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("default_thread_pct"));
    let out = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg("--config")
        .arg(d.path().join("missing.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// One user holding many connections, each trickling a byte now and then, locks out neither root
/// (slurmstepd, the prolog) nor another user (issue 25.3): users are capped per uid, root draws on
/// slots of its own, and a frame must arrive whole within its deadline.
#[test]
fn a_user_holding_connections_locks_out_neither_root_nor_other_users() {
    if !is_root() {
        skip("needs root to run two other uids");
        return;
    }
    let e = Env::new("");
    let script = r#"
        use IO::Socket::UNIX; $SIG{PIPE} = 'IGNORE'; $| = 1;
        my @c;
        for (1..530) { my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Peer => $ARGV[0]); push @c, $s if $s; }
        print "ready
";
        for my $round (1..30) { for my $s (@c) { syswrite($s, "\0"); } sleep 1; }
    "#;
    let mut attacker = Proc(
        Command::new("perl")
            .args(["-e", script])
            .arg(e.sock())
            .uid(65534)
            .gid(65534)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(attacker.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "ready");
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(800));
        let t = Instant::now();
        assert!(
            matches!(e.call(&Request::Status), Ok(Response::Status(_))),
            "root is served"
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let out = Command::new(env!("CARGO_BIN_EXE_mpsrctl"))
            .arg("--socket")
            .arg(e.sock())
            .arg("status")
            .uid(65533)
            .gid(65533)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "another user is served: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The owner of a finished job reads its report and events; what they show names no other job.
#[test]
fn the_owner_reads_a_finished_jobs_report_naming_no_other_job() {
    if !is_root() {
        skip("needs root to run a second uid");
        return;
    }
    let e = Env::new("");
    let r = e
        .call(&Request::JobStart {
            job_id: 91,
            uid: 65534,
            restart_count: 0,
        })
        .unwrap();
    assert_eq!(r, Response::Ok);
    let mut mine = Command::new("sleep")
        .arg("30")
        .uid(65534)
        .gid(65534)
        .spawn()
        .unwrap();
    let mut r91 = reg(91, mine.id(), &[0], Mode::Requeue, true);
    r91.uid = Some(65534);
    assert!(matches!(
        e.call(&Request::Register(r91)).unwrap(),
        Response::Registered { .. }
    ));
    let other = e.client(0, 30.0, false);
    let mut r92 = reg(92, other.id(), &[0], Mode::Requeue, true);
    r92.uid = Some(1000);
    assert!(matches!(
        e.call(&Request::Register(r92)).unwrap(),
        Response::Registered { .. }
    ));
    e.inject(0, 43, None, None);
    e.wait_for("both requeued", |e| {
        let l = e.scontrol_log();
        l.contains("requeue 91") && l.contains("requeue 92")
    });
    let _ = mine.kill();
    let _ = mine.wait();
    e.call(&Request::Deregister {
        job_id: 91,
        step_id: mpsr_proto::BATCH_STEP,
        pid: mine.id(),
        exit_status: Some(9),
    })
    .unwrap();
    // What the epilog gets (and writes into the owner's report file) names no other job.
    let Response::JobReport(rep) = e.call(&Request::JobEnd { job_id: 91 }).unwrap() else {
        panic!()
    };
    assert_eq!(rep.faults.len(), 1, "{rep:?}");
    names_only_job_91(&serde_json::to_value(&rep.faults).unwrap());
    let ctl = env!("CARGO_BIN_EXE_mpsrctl");
    let as_nobody = |args: &[&str]| {
        Command::new(ctl)
            .arg("--socket")
            .arg(e.sock())
            .arg("--json")
            .args(args)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    let out = as_nobody(&["report", "91"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    names_only_job_91(&v["faults"]);
    let out = as_nobody(&["events"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["events"].as_array().map(|a| a.len()), Some(1), "{v}");
    names_only_job_91(&v["events"]);
    // Another user sees neither.
    let out = Command::new(ctl)
        .arg("--socket")
        .arg(e.sock())
        .args(["report", "91"])
        .uid(1)
        .gid(1)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

/// The metrics port shows job ids, uids and pids (issue 24): only allowed sources get an answer
/// (loopback by default), and with a token file only requests carrying the token. A token file
/// others can read is refused at start.
#[test]
fn the_metrics_port_answers_only_allowed_sources_with_the_token() {
    let port = free_port();
    let e = Env::new(&format!(
        "[telemetry]\nlisten = \"127.0.0.1:{port}\"\nallow_from = [\"10.0.0.0/8\"]\n"
    ));
    wait_http(port);
    let (code, body) = http_get_status(port, "/metrics", "");
    assert_eq!(code, 403, "{body}");
    assert!(!body.contains("hpc_job"), "{body}");
    drop(e);

    let d = tempfile::tempdir().unwrap();
    let tok = d.path().join("token");
    std::fs::write(&tok, "0123456789abcdef0123\n").unwrap();
    std::fs::set_permissions(&tok, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let port = free_port();
    let e = Env::new(&format!(
        "[telemetry]\nlisten = \"127.0.0.1:{port}\"\nbearer_token_file = \"{}\"\n",
        tok.display()
    ));
    wait_http(port);
    assert_eq!(http_get_status(port, "/metrics", "").0, 401);
    assert_eq!(
        http_get_status(
            port,
            "/v1/jobs/1",
            "Authorization: Bearer wrong-token-here\r\n"
        )
        .0,
        401
    );
    let (code, body) = http_get_status(
        port,
        "/metrics",
        "Authorization: Bearer 0123456789abcdef0123\r\n",
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("mpsr_"), "{body}");
    drop(e);

    // A token others can read is no secret: the agent refuses to start with the key named.
    std::fs::set_permissions(&tok, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let cfg = d.path().join("a.toml");
    std::fs::write(
        &cfg,
        format!(
            "backend = \"sim\"\n[telemetry]\nlisten = \"127.0.0.1:1\"\nbearer_token_file = \"{}\"\n",
            tok.display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("telemetry.bearer_token_file") && err.contains("chmod 600"),
        "{err}"
    );
}

/// `mpsrctl events --limit 1000` never drops records silently: what did not fit in one reply is
/// counted in it and said by mpsrctl. Before, 89 of 1000 came back and nothing said why.
#[test]
fn events_left_out_of_a_full_reply_are_counted_and_said() {
    let e = Env::new("history = 2000\ncorrelation_window_ms = 5\n[sim]\nrecovery_ms = 1\n");
    let faults = 400u32;
    for i in 0..faults {
        e.inject(i % 2, 43, None, None);
        std::thread::sleep(Duration::from_millis(8));
    }
    e.wait_for("every fault decided", |e| {
        matches!(e.call(&Request::Events { limit: 10 }), Ok(Response::Events { events, events_left_out, .. }) if events.len() == 10 && events_left_out == 0)
            && status(e).pending_actions == 0
    });
    let (events, left) = match e.call(&Request::Events { limit: 1000 }).unwrap() {
        Response::Events {
            events,
            events_left_out,
            ..
        } => (events, events_left_out),
        r => panic!("{r:?}"),
    };
    assert!(left > 0, "{} records fit in one reply", events.len());
    // Fault ids count from 1; injections close together may have been one fault (the
    // correlation window), so the newest id is how many faults there were.
    let newest = events.last().unwrap().fault_id;
    assert!(newest > faults as u64 / 2, "{newest} faults decided");
    assert!(
        events.len() as u64 + u64::from(left) >= newest,
        "{} sent + {left} left out < {newest} faults",
        events.len()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_mpsrctl"))
        .arg("--socket")
        .arg(e.sock())
        .args(["events", "--limit", "1000"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // As many or more than a moment ago (a late record may have come since).
    let said: u32 = err
        .split(" older decision(s)")
        .next()
        .and_then(|h| h.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(said >= left, "mpsrctl says what it left out: {err}");
}
