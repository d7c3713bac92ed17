//! Integration: the agent as a real process with the sim backend, real client processes that really
//! die, faults of each class injected, exact hit sets and actions asserted. Slurm's scontrol is
//! replaced by a recording script here (the real-Slurm tests live in tests/ at the top level).

use mpsr_proto::{
    Client, CulpritEvidence, DomainId, EscalationRung, FaultAction, FaultClass, FaultOutcome, Mode,
    Registration, Request, Response, ServerState, SignalSource,
};
use mpsr_test_support::skip;
use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Env {
    dir: tempfile::TempDir,
    agent: Option<Child>,
    /// Extra environment of the agent process (e.g. a faked wall clock).
    agent_env: Vec<(String, String)>,
}

impl Env {
    fn new(extra: &str) -> Env {
        Env::with("", "", extra)
    }

    /// `top`: top-level keys; `mps`: keys of [mps]; `extra`: further tables.
    fn with(top: &str, mps: &str, extra: &str) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let shim = d.join("scontrol");
        std::fs::write(
            &shim,
            // `hold-before`: a requeue waits, then fails having done nothing; `hold-after`: it is
            // done, then the call waits (an agent killed meanwhile never hears of it).
            format!("#!/bin/sh\nD={}\nL=$D/scontrol.log\ncase \"$1 $2\" in\n  'show job') echo \"JobId=$3 JobState=RUNNING Restarts=$(grep -c \"^requeue $3\\$\" $L)\";;\n  'show node') echo 'NodeName=n1 State=IDLE ThreadsPerCore=1';;\n  'requeue '*)\n    if [ -e $D/hold-before ]; then touch $D/holding; while [ -e $D/hold-before ]; do sleep 0.05; done; exit 1; fi\n    echo \"$@\" >> $L\n    if [ -e $D/hold-after ]; then touch $D/holding; while [ -e $D/hold-after ]; do sleep 0.05; done; fi;;\n  *) echo \"$@\" >> $L;;\nesac\nexit 0\n", d.display()),
        )
        .unwrap();
        std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // squeue --json: every job listed, with no AdminComment yet; squeue -O: running, with
        // as many restarts as requeues were logged. sinfo: the node idle.
        let squeue = d.join("squeue");
        std::fs::write(
            &squeue,
            format!("#!/bin/sh\nL={}/scontrol.log\n[ \"$1\" = --json ] && echo \"{{\\\"jobs\\\":[{{\\\"job_id\\\":$4,\\\"admin_comment\\\":\\\"\\\"}}]}}\"\n[ \"$1\" = -h ] && echo \"$4|RUNNING|N/A|1|1|$(grep -c \"^requeue $4\\$\" $L 2>/dev/null)|\"\nexit 0\n", d.display()),
        )
        .unwrap();
        std::fs::set_permissions(&squeue, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let sinfo = d.join("sinfo");
        std::fs::write(&sinfo, "#!/bin/sh\necho 'idle|none|'\n").unwrap();
        std::fs::set_permissions(&sinfo, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        std::fs::write(
            d.join("agent.toml"),
            format!(
                "backend = \"sim\"\nsocket = \"{0}/run/agent.sock\"\nstate_dir = \"{0}/state\"\nrun_dir = \"{0}/run\"\nnode_name = \"n1\"\n{top}[log]\ntarget = \"stderr\"\n[slurm]\nscontrol = \"{0}/scontrol\"\nsqueue = \"{0}/squeue\"\nsinfo = \"{0}/sinfo\"\nretry_backoff_ms = 50\n[mps]\nfault_grace_ms = 300\nquit_on_shutdown = true\n{mps}[faults]\nkmsg = false\n{extra}",
                d.display()
            ),
        )
        .unwrap();
        let mut e = Env {
            dir,
            agent: None,
            agent_env: Vec::new(),
        };
        e.start_agent();
        e
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn start_agent(&mut self) {
        let log = std::fs::File::create(
            self.path()
                .join(format!("agent-{}.log", Instant::now().elapsed().as_nanos())),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
            .arg("--config")
            .arg(self.path().join("agent.toml"))
            .envs(self.agent_env.iter().map(|(k, v)| (k, v)))
            .stderr(log)
            .spawn()
            .unwrap();
        self.agent = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(
                self.call(&Request::Hello {
                    version: mpsr_proto::PROTOCOL_VERSION,
                }),
                Ok(Response::Hello { .. })
            ) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("agent did not come up");
    }

    fn kill_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn sock(&self) -> PathBuf {
        self.path().join("run/agent.sock")
    }

    fn call(&self, r: &Request) -> Result<Response, mpsr_proto::ClientError> {
        Client::new(self.sock(), Duration::from_secs(5)).call(r)
    }

    #[allow(clippy::zombie_processes)] // reaped by Proc's Drop
    fn client(&self, gpu: u32, secs: f64, idle: bool) -> Proc {
        let mut c = Command::new(simclient());
        c.arg("--seconds").arg(secs.to_string());
        if idle {
            c.arg("--idle");
        }
        let child = c
            .env(
                "CUDA_MPS_PIPE_DIRECTORY",
                self.path().join(format!("run/gpu{gpu}/pipe")),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the simulated server lists it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Response::Status(s)) = self.call(&Request::Status) {
                if s.gpus[gpu as usize].clients.contains(&child.id()) {
                    return Proc(child);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("client did not attach");
    }

    fn register(&self, job: u32, pid: u32, gpus: &[u32], mode: Mode, batch: bool) {
        let r = self
            .call(&Request::Register(reg(job, pid, gpus, mode, batch)))
            .unwrap();
        assert!(
            matches!(r, Response::Registered { .. }),
            "register job {job}: {r:?}"
        );
    }

    /// Injects a simulated fault (`slot`: the domain whose server faults); the clients it killed.
    fn inject(&self, gpu: u32, xid: u32, culprit: Option<u32>, slot: Option<u32>) -> Vec<u32> {
        match self
            .call(&Request::SimInject {
                gpu,
                xid,
                culprit,
                slot,
            })
            .unwrap()
        {
            Response::Injected { killed, .. } => killed,
            r => panic!("inject: {r:?}"),
        }
    }

    fn events(&self) -> Vec<mpsr_proto::DecisionRecord> {
        match self.call(&Request::Events { limit: 100 }).unwrap() {
            Response::Events { events, .. } => events,
            r => panic!("{r:?}"),
        }
    }

    fn wait_for(&self, what: &str, f: impl Fn(&Env) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if f(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let events: Vec<String> = self
            .call(&Request::Events { limit: 5 })
            .map(|r| match r {
                Response::Events { events, .. } => events.iter().map(|e| e.to_string()).collect(),
                _ => Vec::new(),
            })
            .unwrap_or_default();
        // The last agent's log, for the reader of a failure.
        let mut logs: Vec<PathBuf> = std::fs::read_dir(self.path())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        logs.retain(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("agent-"))
        });
        logs.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        let log = logs
            .last()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        let tail: String = log
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        panic!(
            "timed out waiting for {what}; scontrol log: {:?}; events: {events:#?}\nagent log (last lines):\n{tail}",
            self.scontrol_log()
        );
    }

    fn scontrol_log(&self) -> String {
        std::fs::read_to_string(self.path().join("scontrol.log")).unwrap_or_default()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // A clean stop also stops the simulated GPU daemon (quit_on_shutdown = true).
        if let Some(mut c) = self.agent.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A child process that is killed and reaped when the test lets go of it (also on panic).
struct Proc(Child);

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn reg(job: u32, pid: u32, gpus: &[u32], mode: Mode, batch: bool) -> Registration {
    Registration {
        job_id: job,
        step_id: if batch { mpsr_proto::BATCH_STEP } else { 0 },
        pid,
        uid: None,
        gpus: gpus.to_vec(),
        mode,
        batch,
        threads_pct: None,
        mem_limit: None,
        restart_count: 0,
        isolation: None,
    }
}

/// The simulated MPS client, built next to the agent (crate mpsr-simgpu).
fn simclient() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_mpsr-agent")).with_file_name("mpsr-simclient")
}

fn exit_code(c: &mut Child, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(s) = c.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

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

impl Env {
    fn client_raw(&self, gpu: u32) -> Proc {
        Proc(
            Command::new(simclient())
                .args(["--seconds", "0.1"])
                .env(
                    "CUDA_MPS_PIPE_DIRECTORY",
                    self.path().join(format!("run/gpu{gpu}/pipe")),
                )
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }
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
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        e.scontrol_log().matches("requeue 11").count(),
        1,
        "not repeated after restart"
    );
}

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
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !e.scontrol_log().contains("requeue 31"),
        "{}",
        e.scontrol_log()
    );
}

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

/// A task as slurmstepd starts one: registered first (the agent places it in a fault domain), then
/// it becomes the MPS client of that domain's server (same pid: `exec`).
struct Gated {
    proc: Proc,
    domain: mpsr_proto::DomainId,
}

impl Env {
    fn placed_client(
        &self,
        job: u32,
        isolation: Option<mpsr_proto::Isolation>,
        secs: u32,
    ) -> Gated {
        self.placed_client_as(job, isolation, secs, None)
    }

    /// As slurmstepd registers a task of a job owned by `uid` (None: the caller's).
    fn placed_client_as(
        &self,
        job: u32,
        isolation: Option<mpsr_proto::Isolation>,
        secs: u32,
        uid: Option<u32>,
    ) -> Gated {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "read d; CUDA_MPS_PIPE_DIRECTORY=\"$d\" exec {} --seconds {secs}",
                simclient().display()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut r = reg(job, child.id(), &[0], Mode::Requeue, true);
        r.isolation = isolation;
        r.uid = uid;
        let ctx = match self.call(&Request::Register(r)).unwrap() {
            Response::Registered { contexts } => contexts.into_iter().next().unwrap(),
            other => panic!("register job {job}: {other:?}"),
        };
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{}", ctx.pipe_dir).unwrap();
        let (pid, domain) = (child.id(), ctx.domain);
        self.wait_for("client attached to its domain", |e| {
            e.domain(domain).is_some_and(|d| d.clients.contains(&pid))
        });
        Gated {
            proc: Proc(child),
            domain,
        }
    }

    fn domain(&self, id: mpsr_proto::DomainId) -> Option<mpsr_proto::DomainStatus> {
        let Ok(Response::Status(s)) = self.call(&Request::Status) else {
            return None;
        };
        s.gpus
            .get(id.gpu as usize)?
            .domains
            .iter()
            .find(|d| d.domain == id)
            .cloned()
    }
}

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
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

/// Decision records as a user may see them: job 91 alone, no actions, outcomes or pids.
fn names_only_job_91(records: &serde_json::Value) {
    let records = records.as_array().expect("a list of decisions");
    assert!(!records.is_empty());
    for r in records {
        assert_eq!(r["hit_jobs"], serde_json::json!([91]), "{r}");
        assert_eq!(r["spared_jobs"], serde_json::json!([]), "{r}");
        assert_eq!(r["actions"], serde_json::json!([]), "{r}");
        assert_eq!(r["outcome"], serde_json::json!([]), "{r}");
        assert_eq!(r["outcomes"], serde_json::json!([]), "{r}");
        assert!(r["reported_pid"].is_null() && r["culprit"].is_null(), "{r}");
    }
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(out)
}

impl Env {
    fn telemetry(&self) -> mpsr_proto::TelemetryReply {
        match self.call(&Request::Telemetry).unwrap() {
            Response::Telemetry(t) => *t,
            r => panic!("{r:?}"),
        }
    }
    fn pathologies(&self) -> Vec<mpsr_proto::PathologyRecord> {
        match self.call(&Request::Events { limit: 100 }).unwrap() {
            Response::Events { pathologies, .. } => pathologies,
            r => panic!("{r:?}"),
        }
    }
    fn health(&self) -> mpsr_proto::HealthReply {
        match self.call(&Request::Health).unwrap() {
            Response::Health(h) => h,
            r => panic!("{r:?}"),
        }
    }
    fn pathology(&self, gpu: u32, what: &str, pid: Option<u32>, secs: u32) {
        let r = self
            .call(&Request::SimPathology {
                gpu,
                what: serde_json::from_value(serde_json::json!(what)).unwrap(),
                pid,
                secs,
            })
            .unwrap();
        assert_eq!(r, Response::Ok);
    }
}

/// SIMULATED telemetry: a straggler rank is found and named in the job's report (never a drain);
/// a hardware slowdown makes the node unhealthy for the health check, stays so across an agent
/// SIGKILL, and clears with the rule's hysteresis; /metrics passes promtool.
#[test]
fn telemetry_names_a_straggler_and_drains_only_for_hardware() {
    use mpsr_telemetry::{FindingState, RuleId, Subject};
    let port = free_port();
    let mut e = Env::new(&format!(
        "[telemetry]\ninterval_ms = 200\nlisten = \"127.0.0.1:{port}\"\n\
         [telemetry.rules.straggler]\nwindow_s = 1.0\nclear_s = 1.0\n\
         [telemetry.rules.hw_slowdown]\nwindow_s = 1.0\nclear_s = 1.0\n"
    ));
    let a = e.client(0, 120.0, false);
    let b = e.client(1, 120.0, false);
    e.register(50, a.id(), &[0], Mode::Requeue, true);
    e.register(50, b.id(), &[1], Mode::Requeue, true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let t = e.telemetry();
        if t.snapshot
            .tick
            .clients
            .iter()
            .filter(|c| c.owner.is_some_and(|o| o.job == 50))
            .count()
            == 2
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let t = e.telemetry();
    assert!(t.snapshot.simulated, "simulated telemetry says so");
    assert!(
        t.snapshot.findings.is_empty(),
        "clean: {:?}",
        t.snapshot.findings
    );

    e.pathology(0, "straggler", Some(a.id()), 30);
    e.wait_for("straggler raised", |e| {
        e.pathologies().iter().any(|p| {
            p.finding.rule == RuleId::Straggler
                && p.finding.state == FindingState::Raised
                && p.finding.subject
                    == Subject::Client {
                        gpu: 0,
                        pid: a.id(),
                    }
                && p.finding
                    .owner
                    .is_some_and(|o| o.job == 50 && o.task == a.id())
        })
    });
    assert!(e.health().healthy, "a straggler never drains");
    // job-skew asks each node's agent over HTTP (here the one node) and marks the slow rank.
    let out = Command::new(Path::new(env!("CARGO_BIN_EXE_mpsr-agent")).with_file_name("mpsrctl"))
        .args([
            "--json",
            "job-skew",
            "50",
            "--nodes",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .output()
        .unwrap();
    let skew: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let slow: Vec<u64> = skew["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["straggler"] == true)
        .map(|r| r["rank"]["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(slow, vec![a.id() as u64], "{skew}");
    assert_eq!(out.status.code(), Some(1), "a straggler: exit 1");
    match e.call(&Request::JobReport { job_id: 50 }).unwrap() {
        Response::JobReport(r) => assert!(
            r.pathologies
                .iter()
                .any(|p| p.finding.rule == RuleId::Straggler),
            "{r:?}"
        ),
        r => panic!("{r:?}"),
    }

    e.pathology(1, "throttle", None, 6);
    e.wait_for("hardware slowdown makes the node unhealthy", |e| {
        e.health()
            .reasons
            .iter()
            .any(|r| r.starts_with("telemetry hw_slowdown on gpu1 of n1"))
    });
    let metrics = http_get(port, "/metrics");
    assert!(
        metrics.contains("mpsr_gpu_utilization_ratio{gpu=\"0\""),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "mpsr_pathology_active{rule=\"hw_slowdown\",severity=\"hardware\",gpu=\"1\"} 1"
        ),
        "{metrics}"
    );
    assert!(metrics.contains(&format!(
        "hpc_job=\"50\",step=\"{}\"",
        mpsr_proto::BATCH_STEP
    )));
    let view: serde_json::Value = serde_json::from_str(&http_get(port, "/v1/jobs/50")).unwrap();
    assert_eq!(view["ranks"].as_array().map(Vec::len), Some(2), "{view}");
    match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(mut p) => {
            p.stdin
                .take()
                .unwrap()
                .write_all(metrics.as_bytes())
                .unwrap();
            let out = p.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(_) => skip("promtool not installed (Debian package prometheus): /metrics not linted"),
    }

    // Findings are kept in their own file, not in the state file every decision rewrites.
    e.wait_for("telemetry log written", |e| {
        std::fs::read_to_string(e.path().join("state/telemetry.json"))
            .is_ok_and(|t| t.contains("hw_slowdown"))
    });
    let state = std::fs::read_to_string(e.path().join("state/state.json")).unwrap();
    assert!(!state.contains("hw_slowdown"), "{state}");
    // The finding outlives an agent crash: the restarted agent does not report the node healthy.
    e.kill_agent();
    e.start_agent();
    assert!(!e.health().healthy, "restored after restart");
    // The throttle ends (6 s after injection; the sim clock restarted with the agent, so it has no
    // injection at all now): cleared after clear_s.
    e.wait_for("hardware finding cleared", |e| e.health().healthy);
    assert!(e
        .pathologies()
        .iter()
        .any(|p| p.finding.rule == RuleId::HwSlowdown && p.finding.state == FindingState::Cleared));
}

fn status(e: &Env) -> mpsr_proto::StatusReply {
    match e.call(&Request::Status).unwrap() {
        Response::Status(s) => s,
        r => panic!("{r:?}"),
    }
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
        std::thread::sleep(Duration::from_millis(500));
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
    }
}

/// Unmounts a test's tmpfs even when the test fails.
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(at: &Path, size: &str) -> Option<Mount> {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Mount(at.to_path_buf()))
    }

    fn remount(&self, opt: &str) {
        let s = Command::new("mount")
            .args(["-o", &format!("remount,{opt}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(s.success(), "remount {opt}");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
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

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
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
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(e.scontrol_log().matches(&want).count(), 1);
    }
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

/// One entry of journald's native protocol: `NAME=value\n`, or `NAME\n` + little-endian u64
/// length + value + `\n` for values that may hold newlines.
fn journal_fields(mut b: &[u8]) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    while let Some(nl) = b.iter().position(|c| *c == b'\n') {
        let line = &b[..nl];
        if let Some(eq) = line.iter().position(|c| *c == b'=') {
            out.insert(
                String::from_utf8_lossy(&line[..eq]).into_owned(),
                String::from_utf8_lossy(&line[eq + 1..]).into_owned(),
            );
            b = &b[nl + 1..];
        } else {
            let rest = &b[nl + 1..];
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            out.insert(
                String::from_utf8_lossy(line).into_owned(),
                String::from_utf8_lossy(&rest[8..8 + len]).into_owned(),
            );
            b = &rest[(8 + len + 1).min(rest.len())..];
        }
    }
    out
}

/// A resume-mode task under mpsr-run with a hot standby (`MPSR_STANDBY=1`, as `--mps-standby`
/// sets it): the standby waits as an idle client of the GPU's standby domain; a fault in the
/// shared server ends the primary and releases the standby at the decision, mpsr-run adopts it
/// (no restart); the job's other neighbour is requeued as usual. Returns the env, mpsr-run and
/// its stderr file.
fn standby_task(e: &Env, job: u32) -> (Proc, PathBuf) {
    let run = Path::new(env!("CARGO_BIN_EXE_mpsr-agent")).with_file_name("mpsr-run");
    let err = e.path().join(format!("mpsr-run-{job}.err"));
    // Registered (as slurmstepd does before the task execs) before mpsr-run asks for a standby.
    let sup = Proc(
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "sleep 0.5; exec {} --backoff-ms 0 -- {} --seconds 60",
                run.display(),
                simclient().display()
            ))
            .env("SLURM_JOB_ID", job.to_string())
            .env("SLURM_STEP_ID", "0")
            .env("MPSR_SOCKET", e.sock())
            .env("MPSR_STANDBY", "1")
            .env("CUDA_MPS_PIPE_DIRECTORY", e.path().join("run/gpu0/pipe"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap(),
    );
    e.register(job, sup.id(), &[0], Mode::Resume, false);
    (sup, err)
}

/// The armed standby of a job's task, as status shows it.
fn armed_standby(e: &Env, job: u32) -> Option<u32> {
    match e.call(&Request::Status).ok()? {
        Response::Status(s) => s
            .tasks
            .iter()
            .find(|t| t.job_id == job)
            .and_then(|t| t.standby.map(|(pid, _)| pid)),
        _ => None,
    }
}

fn standby_clients(e: &Env) -> Vec<u32> {
    match e.call(&Request::Status).unwrap() {
        Response::Status(s) => s.gpus[0]
            .domains
            .iter()
            .filter(|d| !d.domain.is_shared())
            .flat_map(|d| d.clients.clone())
            .collect(),
        r => panic!("{r:?}"),
    }
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

#[test]
fn a_standby_gone_before_the_fault_leads_to_the_ordinary_restart() {
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
    let neighbour = e.client(0, 30.0, false);
    e.register(54, neighbour.id(), &[0], Mode::Requeue, true);
    e.inject(0, 43, None, Some(0));
    e.wait_for("the restart in place", |_| {
        std::fs::read_to_string(&err).is_ok_and(|t| t.contains("restarting in place"))
    });
    assert!(!std::fs::read_to_string(&err).unwrap().contains("took over"));
    drop(sup);
}

/// A raw `GET` with optional headers; the status code and body.
fn http_get_status(port: u16, path: &str, headers: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n{headers}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (
        code,
        out.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or(out),
    )
}

fn wait_http(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "HTTP endpoint did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
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

/// One sample of a Prometheus text exposition: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// The samples of `/metrics` (comment lines skipped; label values without escapes, as ours are).
fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|kv| !kv.is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((k.to_string(), v.trim_end_matches('"').to_string()))
                })
                .collect();
            Some((name.to_string(), labels, value))
        })
        .collect()
}

fn series(name: &str, labels: &[(String, String)]) -> String {
    let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{name}{{{}}}", l.join(","))
}

fn with(labels: &[(String, String)], extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .cloned()
        .collect();
    l.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    l.sort();
    l
}

/// Step times (`mpsr_step()` in the state library): the agent reads each rank's step file, names
/// the rank whose steps take 1.5x its peers' (`step_skew`, with its job), exports
/// `mpsr_rank_step_seconds`, and ignores a file its job's user does not own (another user cannot
/// plant step times for someone else's process).
#[test]
fn step_times_name_the_skewed_rank_and_a_planted_file_is_ignored() {
    use mpsr_telemetry::steps::{encode, path};
    use mpsr_telemetry::{FindingState, RuleId, Subject};
    let port = free_port();
    let e = Env::new(&format!(
        "[telemetry]\ninterval_ms = 200\nlisten = \"127.0.0.1:{port}\"\nstep_dir = \"{}\"\n\
         [telemetry.rules.step_skew]\nwindow_s = 1.0\nclear_s = 1.0\n",
        e_steps_dir().display()
    ));
    let dir = e_steps_dir();
    let ranks: Vec<_> = (0..3).map(|k| e.client(k % 2, 60.0, false)).collect();
    for r in &ranks {
        e.register(60, r.id(), &[0, 1], Mode::Requeue, true);
    }
    let other = e.client(1, 60.0, false);
    e.register(61, other.id(), &[1], Mode::Requeue, true);
    // Rank 2 takes 150 ms a step, the others 100 ms; job 61's file belongs to another user.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, dir) = (stop.clone(), dir.clone());
        let pids: Vec<(u32, u64)> = ranks
            .iter()
            .enumerate()
            .map(|(k, r)| (r.id(), if k == 2 { 150_000 } else { 100_000 }))
            .chain([(other.id(), 100_000)])
            .collect();
        let planted = other.id();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mono0 = {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: a valid timespec to write into.
                unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
                ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
            };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let el = t0.elapsed().as_micros() as u64;
                for &(pid, us) in &pids {
                    let count = el / us;
                    let b = encode(count, mono0 + count * us * 1000, &vec![us as u32; 256]);
                    let tmp = dir.join(format!("tmp.{pid}"));
                    std::fs::write(&tmp, b).unwrap();
                    if pid == planted {
                        std::os::unix::fs::chown(&tmp, Some(65534), Some(65534)).unwrap();
                    }
                    std::fs::rename(&tmp, path(&dir, pid)).unwrap();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    e.wait_for("step_skew raised for rank 2", |e| {
        e.pathologies().iter().any(|p| {
            p.finding.rule == RuleId::StepSkew
                && p.finding.state == FindingState::Raised
                && p.finding.subject
                    == Subject::Client {
                        gpu: 0,
                        pid: ranks[2].id(),
                    }
                && p.finding.owner.is_some_and(|o| o.job == 60)
        })
    });
    let m = http_get(port, "/metrics");
    assert!(m.contains("mpsr_rank_step_seconds{"), "{m}");
    let t = e.telemetry();
    for c in &t.snapshot.tick.clients {
        if c.pid == other.id() {
            assert_eq!(c.steps, None, "a file of another user is not read");
        } else if ranks.iter().any(|r| r.id() == c.pid) {
            assert!(c.steps.is_some_and(|s| s.step_s.is_some()), "{c:?}");
        }
    }
    assert!(
        !e.pathologies()
            .iter()
            .any(|p| p.finding.rule == RuleId::StepSkew
                && p.finding.subject
                    != Subject::Client {
                        gpu: 0,
                        pid: ranks[2].id()
                    }),
        "only rank 2: {:?}",
        e.pathologies()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

fn e_steps_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("mpsr-steps-sim-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The shipped Prometheus rules agree with the agent (etc/prometheus/tests): a rank at 0.75x of
/// its peers without itself straggles in 2- and 4-rank jobs across nodes, a paused one does not,
/// a whole node clocked below the others is named. The old rule never fired on a 2-rank job at 0.6x.
#[test]
fn the_prometheus_rules_agree_with_the_agent_on_stragglers_and_slow_nodes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../etc/prometheus/tests");
    match Command::new("promtool")
        .args(["test", "rules", "mps-resilient.test.yml"])
        .current_dir(&dir)
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "promtool: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(_) => skip("promtool not installed (Debian package prometheus): rules not tested"),
    }
}

/// The shipped Prometheus rules (etc/prometheus) fire on what an agent really exports: a fault
/// that hit jobs, a GPU held unhealthy, a pathology finding, a straggler rank seen across two
/// nodes (the series of two nodes written from this agent's own series), an agent not scraped.
/// `promtool test rules` on series written from a real `/metrics`, so a renamed metric or label
/// fails here.
#[test]
fn the_prometheus_rules_fire_on_what_the_agent_exports() {
    if Command::new("promtool").arg("--version").output().is_err() {
        skip("promtool not installed (Debian package prometheus): rules not tested");
        return;
    }
    let port = free_port();
    let e = Env::new(&format!(
        "[telemetry]\ninterval_ms = 200\nlisten = \"127.0.0.1:{port}\"\n\
         [telemetry.rules.straggler]\nwindow_s = 1.0\nclear_s = 1.0\n"
    ));
    let a = e.client(0, 120.0, false);
    let b = e.client(1, 120.0, false);
    e.register(50, a.id(), &[0], Mode::Requeue, true);
    e.register(50, b.id(), &[1], Mode::Requeue, true);
    e.pathology(1, "straggler", Some(b.id()), 120);
    e.wait_for(
        "a rank's utilization and the straggler finding in /metrics",
        |_| {
            let m = http_get(port, "/metrics");
            m.contains("mpsr_rank_utilization_ratio{") && m.contains("rule=\"straggler\"")
        },
    );
    let before = samples(&http_get(port, "/metrics"));
    // A fault that hits job 50 on gpu0; a GPU lost (hardware) on gpu1.
    e.inject(0, 31, None, Some(0));
    e.inject(1, 79, None, None);
    e.wait_for("the faults in /metrics", |_| {
        let m = http_get(port, "/metrics");
        m.contains("mpsr_fault_hit_jobs_total{gpu=\"0\"} 1") && m.contains("mpsr_gpu_unhealthy{")
    });
    let after = samples(&http_get(port, "/metrics"));
    let node =
        |l: &[(String, String)], n: &str| with(l, &[("instance", n), ("job", "mps-resilient")]);
    let mut input = Vec::new(); // (series, values)
    let mut expect: Vec<(&str, Vec<(String, String)>)> = Vec::new();
    for (name, labels, v) in &after {
        match name.as_str() {
            "mpsr_fault_hit_jobs_total" => {
                input.push((series(name, &node(labels, "n1")), format!("0x15 {v}x10")));
                if *v > 0.0 {
                    let l = with(&node(labels, "n1"), &[("severity", "warning")]);
                    expect.push(("MpsrGpuFaultHitJobs", l));
                }
            }
            "mpsr_gpu_unhealthy" => {
                input.push((series(name, &node(labels, "n1")), "1x25".into()));
                let keep: Vec<(String, String)> = labels
                    .iter()
                    .filter(|(k, _)| k == "gpu" || k == "class")
                    .cloned()
                    .collect();
                let l = with(&keep, &[("instance", "n1"), ("severity", "critical")]);
                expect.push(("MpsrGpuUnhealthy", l));
            }
            "mpsr_slurm_actions_pending" => {
                input.push((series(name, &node(labels, "n1")), format!("{v}x25")));
                if *v > 0.0 {
                    let l = with(&node(labels, "n1"), &[("severity", "warning")]);
                    expect.push(("MpsrSlurmActionsStuck", l));
                }
            }
            _ => {}
        }
    }
    for (name, labels, _) in &before {
        match name.as_str() {
            "mpsr_pathology_active" => {
                input.push((series(name, &node(labels, "n1")), "1x25".into()));
                let keep: Vec<(String, String)> = labels
                    .iter()
                    .filter(|(k, _)| ["rule", "severity", "gpu", "hpc_job"].contains(&k.as_str()))
                    .cloned()
                    .collect();
                expect.push(("MpsrPathology", with(&keep, &[("instance", "n1")])));
            }
            "mpsr_rank_utilization_ratio"
                if labels.iter().any(|(k, v)| k == "hpc_job" && v == "50") =>
            {
                // Job 50's ranks as this node exports them, on n1 at full speed and on n2 with
                // the gpu1 rank at a fifth of the others.
                let gpu1 = labels.iter().any(|(k, v)| k == "gpu" && v == "1");
                input.push((series(name, &node(labels, "n1")), "0.9x25".into()));
                let slow = if gpu1 { "0.2x25" } else { "0.9x25" };
                input.push((series(name, &node(labels, "n2")), slow.into()));
                if gpu1 {
                    let keep: Vec<(String, String)> = labels
                        .iter()
                        .filter(|(k, _)| ["hpc_job", "gpu", "task"].contains(&k.as_str()))
                        .cloned()
                        .collect();
                    let l = with(&keep, &[("instance", "n2"), ("severity", "warning")]);
                    expect.push(("MpsrJobStraggler", l));
                }
            }
            _ => {}
        }
    }
    assert!(
        expect.iter().any(|(a, _)| *a == "MpsrJobStraggler"),
        "no rank series of job 50 in {before:?}"
    );
    input.push((
        r#"up{instance="n1",job="mps-resilient"}"#.into(),
        "1x25".into(),
    ));
    input.push((
        r#"up{instance="n3",job="mps-resilient"}"#.into(),
        "0x25".into(),
    ));
    expect.push((
        "MpsrAgentNotScraped",
        with(
            &[],
            &[
                ("instance", "n3"),
                ("job", "mps-resilient"),
                ("severity", "critical"),
            ],
        ),
    ));
    // The test file promtool reads (YAML; JSON strings are valid YAML scalars).
    let rules =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../etc/prometheus/mps-resilient.rules.yml");
    let q = |s: &str| serde_json::to_string(s).unwrap();
    let mut t = format!(
        "rule_files:\n  - {}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n",
        q(&rules.display().to_string())
    );
    for (s, v) in &input {
        t += &format!("      - series: {}\n        values: {}\n", q(s), q(v));
    }
    t += "    alert_rule_test:\n";
    let mut names: Vec<&str> = expect.iter().map(|(a, _)| *a).collect();
    names.extend(["MpsrSlurmActionsStuck"]);
    names.sort();
    names.dedup();
    for name in names {
        t += &format!("      - eval_time: 20m\n        alertname: {name}\n        exp_alerts:");
        let mine: Vec<_> = expect.iter().filter(|(a, _)| *a == name).collect();
        if mine.is_empty() {
            t += " []\n";
            continue;
        }
        t += "\n";
        for (_, labels) in mine {
            t += "          - exp_labels:\n";
            for (k, v) in labels {
                t += &format!("              {k}: {}\n", q(v));
            }
            t += "            exp_annotations:\n";
            for (k, v) in annotations(name, labels) {
                t += &format!("              {k}: {}\n", q(&v));
            }
        }
    }
    let file = e.path().join("rules.test.yml");
    std::fs::write(&file, &t).unwrap();
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool test rules:\n{}{}\n{t}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    drop((a, b));
}

/// The annotations the shipped rules give an alert with these labels (etc/prometheus).
fn annotations(alert: &str, labels: &[(String, String)]) -> Vec<(&'static str, String)> {
    let l = |k: &str| {
        labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    match alert {
        "MpsrGpuFaultHitJobs" => vec![
            ("summary", format!("GPU {} of {}: a GPU fault hit jobs in the last 10 minutes", l("gpu"), l("instance"))),
            ("description", "`mpsrctl events` on the node names the fault, its class and what was done; each hit job's AdminComment has its line.".into()),
        ],
        "MpsrGpuUnhealthy" => vec![
            ("summary", format!("GPU {} of {} has a hardware fault ({}): the node is drained", l("gpu"), l("instance"), l("class"))),
            ("description", format!("After repairing it: mpsrctl clear-gpu {} (the health check then resumes the node).", l("gpu"))),
        ],
        "MpsrPathology" => vec![(
            "summary",
            format!("{}: telemetry finding {} ({})", l("instance"), l("rule"), l("severity")),
        )],
        "MpsrJobStraggler" => vec![(
            "summary",
            format!("Job {}: its rank on {} GPU {} runs at 0.75x of its peers or less", l("hpc_job"), l("instance"), l("gpu")),
        )],
        "MpsrAgentNotScraped" => vec![(
            "summary",
            format!("The mps-resilient agent of {} cannot be scraped: GPU faults there are not watched", l("instance")),
        )],
        "MpsrSlurmActionsStuck" => vec![(
            "summary",
            format!("{}: Slurm actions pending for 15 minutes (is slurmctld reachable?)", l("instance")),
        )],
        other => panic!("no annotations known for {other}"),
    }
}

/// Sends a test-control request to the SIMULATED GPU daemon of `e` (a control daemon that hangs).
fn sim_control(e: &Env, req: &mpsr_simgpu::SimRequest) {
    let r = mpsr_simgpu::call(&e.path().join("run"), req, Duration::from_secs(3)).unwrap();
    assert_eq!(r, mpsr_simgpu::SimReply::Ok, "{req:?}");
}

fn has_outcome(e: &Env, f: impl Fn(&FaultOutcome) -> bool) -> bool {
    e.events()
        .first()
        .is_some_and(|r| r.outcomes.iter().any(&f))
}

const LADDER: &str = "fault_stuck_ms = 1000\nescalation_step_ms = 600\n";

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
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(e.events().len(), 1, "{:?}", e.events());
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
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(e.events().len(), 1, "{:?}", e.events());
    assert_eq!(e.scontrol_log().matches("requeue 94").count(), 1);
}
