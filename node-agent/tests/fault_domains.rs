//! The agent as a real process with the sim backend (tests/common), fault domains: a fault hits only the jobs of its MPS server, isolation kinds, and the driver patch's attribution and containment lines.

mod common;
use common::*;

/// With `max_domains_per_gpu = 2`, a job asking for a domain of its own right after the only job
/// domain's last task left takes that domain over: it is empty the moment the task leaves, not
/// once the once-a-second domain loop notices (issue 25.6).
#[test]
fn a_domain_is_free_the_moment_its_last_task_leaves() {
    use mpsr_proto::Isolation;
    let e = Env::with("", "max_domains_per_gpu = 2\n", "");
    let me = std::process::id();
    let own = |job| {
        let mut r = reg(job, me, &[0], Mode::Requeue, true);
        r.isolation = Some(Isolation::Job);
        e.call(&Request::Register(r)).unwrap()
    };
    for (job, next) in [(41, 42), (42, 43), (43, 44)] {
        let r = own(job);
        assert!(matches!(r, Response::Registered { .. }), "job {job}: {r:?}");
        let r = e
            .call(&Request::Deregister {
                job_id: job,
                step_id: mpsr_proto::BATCH_STEP,
                pid: me,
                exit_status: Some(0),
            })
            .unwrap();
        assert_eq!(r, Response::Ok);
        let r = own(next);
        assert!(
            matches!(r, Response::Registered { .. }),
            "job {next} right after job {job} left: {r:?}"
        );
        let r = e
            .call(&Request::Deregister {
                job_id: next,
                step_id: mpsr_proto::BATCH_STEP,
                pid: me,
                exit_status: Some(0),
            })
            .unwrap();
        assert_eq!(r, Response::Ok);
    }
}

#[test]
fn a_fault_hits_only_the_jobs_of_its_domain() {
    use mpsr_proto::{CulpritEvidence, DomainId, Isolation};
    let mut e = Env::with(&format!("trusted_uids = [0, {}]\n", uid()), "", "");
    let mut a = e.placed_client(31, Some(Isolation::Job), 60);
    let mut b = e.placed_client(32, Some(Isolation::Job), 60);
    let mut c = e.placed_client(33, Some(Isolation::Shared), 60);
    let mut d = e.placed_client(34, None, 60);
    assert!(!a.domain.is_shared() && !b.domain.is_shared() && a.domain != b.domain);
    assert_eq!(
        (c.domain, d.domain),
        (DomainId::shared(0), DomainId::shared(0))
    );

    // A fault in A's server: A alone dies, A alone is requeued, named the culprit.
    let killed = e.inject(0, 31, None, Some(a.domain.slot));
    assert_eq!(
        killed,
        vec![a.proc.id()],
        "the simulator killed A's client only"
    );
    assert_eq!(exit_code(&mut a.proc, Duration::from_secs(5)), Some(1));
    e.wait_for("requeue of A", |e| e.scontrol_log().contains("requeue 31"));
    e.wait_for("A's decision", |e| {
        e.events().first().is_some_and(|f| !f.hit_jobs.is_empty())
    });
    let f = e.events()[0].clone();
    assert_eq!(f.hit_jobs, vec![31], "{f}");
    assert_eq!(f.hit_domains, vec![a.domain], "{f}");
    assert_eq!(f.spared_jobs, vec![32, 33, 34], "{f}");
    assert_eq!(
        (f.culprit_job, f.culprit_evidence),
        (Some(31), Some(CulpritEvidence::SoleTenant))
    );
    // Its server said so: the server.log line or its state, whichever the agent saw first.
    assert!(
        f.sources
            .iter()
            .any(|s| matches!(s, SignalSource::MpsLog | SignalSource::MpsStatus)),
        "{f}"
    );
    for (p, what) in [(&mut b.proc, "B"), (&mut c.proc, "C"), (&mut d.proc, "D")] {
        assert_eq!(
            exit_code(p, Duration::from_millis(200)),
            None,
            "{what} runs on"
        );
    }
    assert_eq!(
        e.domain(b.domain).unwrap().state,
        mpsr_proto::ServerState::Active
    );

    // A fault in the shared server: C and D, not B.
    std::thread::sleep(Duration::from_millis(600)); // outside the correlation window
    e.inject(0, 43, None, Some(0));
    e.wait_for("requeue of C and D", |e| {
        let l = e.scontrol_log();
        l.contains("requeue 33") && l.contains("requeue 34")
    });
    let f = e.events().last().unwrap().clone();
    assert_eq!(
        (f.hit_jobs.clone(), f.hit_domains.clone()),
        (vec![33, 34], vec![DomainId::shared(0)]),
        "{f}"
    );
    assert_eq!(f.culprit_job, None, "two tenants: the culprit is not known");
    assert_eq!(
        exit_code(&mut b.proc, Duration::from_millis(200)),
        None,
        "B runs on"
    );
    assert!(!e.scontrol_log().contains("requeue 32"));

    // A's next run (a requeue) goes to a domain of its own although it asks for nothing.
    let job = match e.call(&Request::JobReport { job_id: 31 }).unwrap() {
        Response::JobReport(j) => j,
        r => panic!("{r:?}"),
    };
    assert!(
        job.actions.iter().any(|a| a.contains("quarantined")),
        "{:?}",
        job.actions
    );
    let a2 = e.placed_client(31, None, 60);
    assert!(!a2.domain.is_shared(), "quarantined culprit placed apart");

    // The agent crashes and comes back: every domain, its clients and B's process are intact.
    let before: Vec<DomainId> = {
        let Response::Status(s) = e.call(&Request::Status).unwrap() else {
            panic!()
        };
        s.gpus[0].domains.iter().map(|d| d.domain).collect()
    };
    assert!(before.len() >= 3, "{before:?}");
    e.kill_agent();
    e.start_agent();
    let Response::Status(s) = e.call(&Request::Status).unwrap() else {
        panic!()
    };
    let after: Vec<DomainId> = s.gpus[0].domains.iter().map(|d| d.domain).collect();
    assert_eq!(after, before);
    assert!(e.domain(b.domain).unwrap().clients.contains(&b.proc.id()));
    assert_eq!(exit_code(&mut b.proc, Duration::from_millis(100)), None);
    assert_eq!(
        s.tasks
            .iter()
            .filter(|t| t.domains.contains(&b.domain))
            .count(),
        1
    );
}

#[test]
fn a_fault_no_log_shows_is_found_by_asking_each_server() {
    let e = Env::new("mps_logs = false\n");
    let c = e.client(0, 30.0, false);
    e.register(41, c.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, None);
    e.wait_for("requeue", |e| e.scontrol_log().contains("requeue 41"));
    let f = &e.events()[0];
    assert!(f.sources.contains(&SignalSource::MpsStatus), "{f}");
    assert!(!f.awaiting_domain);
}

#[test]
fn an_app_fault_no_registered_domain_shows_hits_nobody() {
    use mpsr_proto::Isolation;
    let e = Env::with(
        &format!("trusted_uids = [0, {}]\n", uid()),
        "",
        "mps_logs = false\n",
    );
    let shared = e.client(0, 30.0, false);
    e.register(51, shared.id(), &[0], Mode::Requeue, true);
    // Job 52's task ended (deregistered) but a process of it still uses its domain's server.
    let left = e.placed_client(52, Some(Isolation::Job), 30);
    let r = e
        .call(&Request::Deregister {
            job_id: 52,
            step_id: mpsr_proto::BATCH_STEP,
            pid: left.proc.id(),
            exit_status: Some(0),
        })
        .unwrap();
    assert_eq!(r, Response::Ok);
    e.inject(0, 31, None, Some(left.domain.slot));
    e.wait_for("the no-domain outcome", |e| {
        e.events()
            .iter()
            .any(|f| f.outcomes.contains(&FaultOutcome::NoDomainShowed))
    });
    let f = &e.events()[0];
    assert!(f.hit_jobs.is_empty() && f.awaiting_domain, "{f}");
    assert!(!e.scontrol_log().contains("requeue"));
}

#[test]
fn isolation_outside_the_allowed_list_is_refused() {
    use mpsr_proto::Isolation;
    let e = Env::with(
        &format!("trusted_uids = [0, {}]\n", uid()),
        "isolation_allowed = [\"shared\", \"user\"]\n",
        "",
    );
    let me = std::process::id();
    let mut r = reg(61, me, &[0], Mode::Requeue, true);
    r.isolation = Some(Isolation::Job);
    match e.call(&Request::Register(r)).unwrap() {
        Response::Error { code, message } => {
            assert_eq!(code, mpsr_proto::ErrorCode::Refused);
            assert!(message.contains("not allowed"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// `user` isolation: one server per uid. A fault in a user's server hits that user's jobs, no one
/// else's.
#[test]
fn user_isolation_shares_a_server_between_a_users_jobs_only() {
    use mpsr_proto::Isolation;
    if !is_root() {
        skip("needs root: a user's domain belongs to that uid (0700)");
        return;
    }
    let e = Env::new("");
    let mut a1 = e.placed_client_as(71, Some(Isolation::User), 60, Some(1000));
    let mut a2 = e.placed_client_as(72, Some(Isolation::User), 60, Some(1000));
    let mut b = e.placed_client_as(73, Some(Isolation::User), 60, Some(1001));
    let mut s = e.placed_client_as(74, None, 60, Some(1002));
    assert_eq!(a1.domain, a2.domain, "one server per user");
    assert!(!a1.domain.is_shared() && a1.domain != b.domain && !b.domain.is_shared());
    assert!(s.domain.is_shared());
    let mut killed = e.inject(0, 43, None, Some(a1.domain.slot));
    killed.sort();
    let mut want = vec![a1.proc.id(), a2.proc.id()];
    want.sort();
    assert_eq!(killed, want);
    for p in [&mut a1.proc, &mut a2.proc] {
        assert_eq!(exit_code(p, Duration::from_secs(5)), Some(1));
    }
    e.wait_for("the user's two jobs requeued", |e| {
        let l = e.scontrol_log();
        l.contains("requeue 71") && l.contains("requeue 72")
    });
    let f = e.events().last().unwrap().clone();
    assert_eq!(f.hit_jobs, vec![71, 72], "{f}");
    assert_eq!(f.hit_domains, vec![a1.domain], "{f}");
    assert_eq!(
        f.culprit_job, None,
        "two jobs in the server: the culprit is not known"
    );
    for (p, what) in [
        (&mut b.proc, "the other user's job"),
        (&mut s.proc, "the shared job"),
    ] {
        assert_eq!(
            exit_code(p, Duration::from_millis(200)),
            None,
            "{what} runs on"
        );
    }
    let l = e.scontrol_log();
    assert!(
        !l.contains("requeue 73") && !l.contains("requeue 74"),
        "{l}"
    );
}

/// Driver patch phase B (containment, SIMULATED as designed: the line alone, no Xid, no server
/// fault): the culprit runs on until the agent terminates it; the other job in the same server
/// never notices and the server never leaves ACTIVE.
#[test]
fn a_contained_fault_ends_only_the_culprit_in_a_shared_server() {
    let e = Env::new("[sim]\ndriver_patch = \"containment\"\n");
    let mut a = e.client(0, 30.0, false);
    let mut b = e.client(0, 30.0, false);
    e.register(1, a.id(), &[0], Mode::Requeue, true);
    e.register(2, b.id(), &[0], Mode::Requeue, true);
    assert!(
        e.inject(0, 31, Some(b.id()), None).is_empty(),
        "the contained fault itself kills nobody"
    );
    // Ended by the agent's terminate_client (the simulated client says so and exits 1).
    assert_eq!(exit_code(&mut b, Duration::from_secs(5)), Some(1));
    assert_eq!(
        exit_code(&mut a, Duration::from_millis(500)),
        None,
        "victim survives with containment"
    );
    e.wait_for("decision with culprit", |e| {
        e.events()
            .first()
            .is_some_and(|f| f.culprit == Some(b.id()))
    });
    let f = &e.events()[0];
    assert_eq!(f.sources, vec![SignalSource::Isolation]);
    assert_eq!(f.hit_jobs, vec![2]);
    assert_eq!(f.spared_jobs, vec![1]);
    assert_eq!(f.culprit_job, Some(2));
    assert_eq!(f.culprit_evidence, Some(CulpritEvidence::Isolation));
    assert!(f.contained);
    assert!(f
        .actions
        .iter()
        .any(|x| matches!(x, FaultAction::TerminateClient { domain, .. } if domain.gpu == 0)));
    assert_eq!(status(&e).gpus[0].state, ServerState::Active);
    assert!(
        !f.outcomes
            .iter()
            .any(|o| matches!(o, FaultOutcome::ServerActive { .. })),
        "no server faulted, so none is watched back: {:?}",
        f.outcomes
    );
    assert!(
        !e.scontrol_log().contains("requeue"),
        "the culprit is failed, not requeued; nobody else is touched"
    );
    let _ = a.kill();
}

/// Driver patch phase A (attribution only): the line names the culprit, but the cancel still
/// takes the whole shared server down: both jobs are hit, the named one failed, the other
/// requeued.
#[test]
fn an_attributed_fault_names_the_culprit_and_still_hits_its_server() {
    let e = Env::new("[sim]\ndriver_patch = \"attribution\"\n");
    let mut a = e.client(0, 30.0, false);
    let mut b = e.client(0, 30.0, false);
    e.register(1, a.id(), &[0], Mode::Requeue, true);
    e.register(2, b.id(), &[0], Mode::Requeue, true);
    e.inject(0, 31, Some(b.id()), None);
    assert_eq!(exit_code(&mut a, Duration::from_secs(5)), Some(1));
    assert_eq!(exit_code(&mut b, Duration::from_secs(5)), Some(1));
    e.wait_for("both hit, culprit named, victim requeued", |e| {
        e.events()
            .first()
            .is_some_and(|f| f.culprit_job == Some(2) && f.hit_jobs == vec![1, 2])
            && e.scontrol_log().contains("requeue 1")
    });
    let f = &e.events()[0];
    assert_eq!(f.culprit_evidence, Some(CulpritEvidence::Isolation));
    assert!(!f.contained, "the cancel ran: an Xid followed");
    assert!(
        f.sources.contains(&SignalSource::Isolation) && f.sources.contains(&SignalSource::Kmsg)
    );
    assert!(
        !e.scontrol_log().contains("requeue 2"),
        "the culprit is failed"
    );
}

/// A line that lies: `contained=1` for a client whose fault is then cancelled after all (the
/// stock driver's Xid and server fault follow within the correlation window). The agent first
/// acts on the claim (the culprit alone), then re-decides on the refutation: everyone in the
/// server is hit, the named culprit failed, the other job requeued.
#[test]
fn a_contained_claim_refuted_by_the_xid_that_follows_hits_the_whole_server() {
    let e = Env::new("");
    let mut a = e.client(0, 30.0, false);
    let mut b = e.client(0, 30.0, false);
    e.register(1, a.id(), &[0], Mode::Requeue, true);
    e.register(2, b.id(), &[0], Mode::Requeue, true);
    let line = format!(
        "NVRM: mpsr-isolate (PCI:{}): xid=31 culprit_pid={} contained=1 (simulated lie)",
        mpsr_simgpu::gpu_pci(0),
        b.id()
    );
    let r = mpsr_simgpu::call(
        &e.path().join("run"),
        &mpsr_simgpu::SimRequest::KernelLine { line },
        Duration::from_secs(3),
    );
    assert!(matches!(r, Ok(mpsr_simgpu::SimReply::Ok)), "{r:?}");
    // The stock fault (no driver patch): both clients die, Xid and server fault reported.
    e.inject(0, 31, None, None);
    assert_eq!(exit_code(&mut a, Duration::from_secs(5)), Some(1));
    assert_eq!(exit_code(&mut b, Duration::from_secs(5)), Some(1));
    e.wait_for("re-decided: both hit, the other job requeued", |e| {
        e.events()
            .first()
            .is_some_and(|f| f.hit_jobs == vec![1, 2] && !f.contained)
            && e.scontrol_log().contains("requeue 1")
    });
    let f = &e.events()[0];
    assert_eq!(f.culprit_job, Some(2), "{f:?}");
    assert!(f.sources.contains(&SignalSource::Isolation), "{f:?}");
    assert!(
        !e.scontrol_log().contains("requeue 2"),
        "the named culprit is failed"
    );
}

/// A line naming a process that is no registered task (here: an unregistered client of the
/// same server) is not trusted: nobody is terminated, and with no server showing a fault nobody
/// is hit.
#[test]
fn an_isolation_line_naming_an_unregistered_process_ends_nobody() {
    let e = Env::new("[sim]\ndriver_patch = \"containment\"\n");
    let mut a = e.client(0, 30.0, false);
    let mut stranger = e.client(0, 30.0, false);
    e.register(1, a.id(), &[0], Mode::Requeue, true);
    e.inject(0, 31, Some(stranger.id()), None);
    e.wait_for("a decision", |e| !e.events().is_empty());
    std::thread::sleep(Duration::from_millis(800));
    let f = &e.events()[0];
    assert_eq!(f.culprit_job, None, "{f:?}");
    assert!(f.hit_jobs.is_empty(), "{f:?}");
    assert!(
        !f.actions
            .iter()
            .any(|x| matches!(x, FaultAction::TerminateClient { .. })),
        "{f:?}"
    );
    assert_eq!(exit_code(&mut stranger, Duration::from_millis(200)), None);
    assert_eq!(exit_code(&mut a, Duration::from_millis(200)), None);
    let _ = (a.kill(), stranger.kill());
}
