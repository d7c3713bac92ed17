//! End-to-end tests on a real Slurm (munge + slurmctld + two slurmd on localhost) with the
//! mps-resilient plugin in plugstack.conf, the prolog/epilog/health-check scripts, and one agent
//! per node with SIMULATED GPUs. Every assertion is on Slurm's own state (scontrol show job/node,
//! exit codes) or on the agent's registry.
//!
//! Needs root and the Slurm packages (.ci/run installs them). Without them every test fails with
//! the list of what is missing, unless MPSR_SKIP_SLURM_TESTS=1 says to skip them (printed).

use mpsr_e2e::{wait_for, Cluster, Options};
use mpsr_proto::{Request, Response};
use mpsr_test_support::skip;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One cluster at a time: the machine has few cores and the tests time requeues.
static SERIAL: Mutex<()> = Mutex::new(());

fn cluster(opts: Options) -> Option<(std::sync::MutexGuard<'static, ()>, Cluster)> {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if std::env::var("MPSR_SKIP_SLURM_TESTS").is_ok_and(|v| v == "1") {
        skip("MPSR_SKIP_SLURM_TESTS=1 (real-Slurm tests not run)");
        return None;
    }
    let c = Cluster::start(opts).expect("starting the local Slurm cluster");
    Some((guard, c))
}

const SHORT: Duration = Duration::from_secs(30);
const LONG: Duration = Duration::from_secs(90);

/// A job script: a simulated MPS client that runs long on the first run and briefly after a
/// requeue, so a requeued job completes.
fn client_script(first_s: u32, again_s: u32) -> String {
    format!(
        "echo \"run ${{SLURM_RESTART_COUNT:-0}} gpu $MPSR_GPU pipe $CUDA_MPS_PIPE_DIRECTORY\"\n\
         if [ \"${{SLURM_RESTART_COUNT:-0}}\" -gt 0 ]; then s={again_s}; else s={first_s}; fi\n\
         exec mpsr-simclient --seconds $s"
    )
}

/// A batch script's first lines that keep `bytes` of GPU state named `name` in the keeper: filled
/// with `byte` on the first run, verified on a requeued one (which exits 1 if it was not kept).
fn keeps_state(name: &str, bytes: &str, byte: u8) -> String {
    format!(
        "if [ \"${{SLURM_RESTART_COUNT:-0}}\" -gt 0 ]; then mpsr-statetool {name} {bytes} --verify {byte} || exit 1; \
         else mpsr-statetool {name} {bytes} --fill {byte} || exit 1; fi\n"
    )
}

/// A task under mpsr-run with a hot standby: the primary fills `model` with `byte` and computes
/// long; the standby attaches it, waits, verifies it after the takeover and computes briefly.
fn standby_app(byte: u8) -> String {
    format!(
        "if [ \"$MPSR_ROLE\" = standby ]; then mpsr-statetool model 4M --ready --verify {byte} || exit 1; \
         else mpsr-statetool model 4M --fill {byte} || exit 1; fi; \
         MPSR_ROLE=primary exec mpsr-simclient --seconds $([ \"$MPSR_ROLE\" = standby ] && echo 5 || echo 120)"
    )
}

/// As `standby_app`, for a warm standby: it waits before its first CUDA call (the attach), holding
/// no context, and attaches the kept state once released.
fn warm_standby_app(byte: u8) -> String {
    format!(
        "if [ \"$MPSR_ROLE\" = warm ]; then mpsr-statetool model 4M --before-cuda --verify {byte} || exit 1; \
         else mpsr-statetool model 4M --fill {byte} || exit 1; fi; \
         MPSR_ROLE=primary exec mpsr-simclient --seconds $([ \"$MPSR_ROLE\" = warm ] && echo 5 || echo 120)"
    )
}

/// A protected batch job on n1's GPU 0 (as nobody), running and registered with the agent; its
/// client runs `first_s` seconds on the first run, 1 s on a later one.
fn protected_batch_job(c: &Cluster, first_s: u32) -> u32 {
    let id = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient",
            &client_script(first_s, 1),
        )
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    assert_eq!(c.wait_registered("n1", id, 1).unwrap(), vec![0]);
    id
}

fn admin_comment(c: &Cluster, job: u32) -> String {
    c.admin_comment(job)
}

fn not_drained(c: &Cluster, node: &str) -> bool {
    !c.node(node)
        .get("State")
        .is_some_and(|s| s.contains("DRAIN"))
}

/// Case 1: three batch jobs share GPU 0, one uses GPU 1; an Xid 31 on GPU 0 requeues exactly the
/// three, they complete on their second run; the GPU-1 job runs on untouched; nothing is drained.
#[test]
fn xid31_requeues_the_jobs_on_that_gpu_only() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let mut gpu0 = Vec::new();
    // The first job keeps state in the GPU's keeper; requeued back onto n1 within the keep time,
    // its second run finds it there.
    let keeps = keeps_state("ckpt", "4M", 3);
    for i in 0..3 {
        let id = c
            .sbatch(
                "nobody",
                "-w n1 --gres=shard:1 --mps-resilient=requeue",
                &format!(
                    "{}{}",
                    if i == 0 { keeps.as_str() } else { "" },
                    client_script(120, 1)
                ),
            )
            .unwrap();
        gpu0.push(id);
    }
    // GPU 0 has one shard left: a job asking for 4 lands on GPU 1.
    let other = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:4 --mps-resilient=requeue",
            &client_script(25, 1),
        )
        .unwrap();
    for &id in gpu0.iter().chain([&other]) {
        c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    }
    for &id in &gpu0 {
        assert_eq!(c.wait_registered("n1", id, 1).unwrap(), vec![0], "job {id}");
    }
    assert_eq!(c.wait_registered("n1", other, 1).unwrap(), vec![1]);
    wait_for("4 simulated clients attached", SHORT, || {
        (c.clients("n1", 0).len() == 3 && c.clients("n1", 1).len() == 1).then_some(())
    })
    .unwrap();
    let gpu1_client = c.clients("n1", 1)[0];

    let killed = c.inject("n1", 0, 31).unwrap();
    assert_eq!(killed.len(), 3, "stock MPS: every busy client on gpu0 dies");
    for &id in &gpu0 {
        wait_for(&format!("job {id} requeued"), LONG, || {
            (c.job_field(id, "Restarts") == "1").then_some(())
        })
        .unwrap();
    }
    // The GPU-1 job was never touched: same client, still attached, not requeued.
    assert_eq!(c.clients("n1", 1), vec![gpu1_client]);
    assert_eq!(c.job_field(other, "Restarts"), "0");
    assert_eq!(c.job_field(other, "JobState"), "RUNNING");
    assert!(not_drained(&c, "n1"), "{:?}", c.node("n1"));

    for &id in &gpu0 {
        c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
        assert!(
            c.job_output(id).contains("run 1 gpu 0"),
            "{}",
            c.job_output(id)
        );
    }
    let out = c.job_output(gpu0[0]);
    assert!(
        out.contains("origin=Kept") && out.contains("verified ckpt: every byte is 3"),
        "the requeued job must re-attach its kept state: {out}"
    );
    c.wait_job_state(other, &["COMPLETED"], LONG).unwrap();
    assert_eq!(c.job_field(other, "Restarts"), "0");
    assert_eq!(c.job_field(other, "ExitCode"), "0:0");
    assert!(not_drained(&c, "n1"));
    // The epilog wrote each job's fault report.
    let rep = std::fs::read_to_string(c.dir.join(format!("n1/reports/{}.txt", gpu0[0])))
        .unwrap_or_default();
    assert!(rep.contains("app_memory"), "report: {rep}");
    let rep =
        std::fs::read_to_string(c.dir.join(format!("n1/reports/{other}.txt"))).unwrap_or_default();
    assert!(rep.contains("hit by 0 fault"), "report: {rep}");
}

/// Case 2: an srun job (Slurm cannot requeue it) in resume mode: the hit task restarts in place
/// under mpsr-run once the GPU's MPS server is ACTIVE again, and the step completes.
#[test]
fn resume_restarts_an_srun_task_in_place() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    resume_case(&c, "mpsr-run -- ");
}

/// Slurm >= 23.11: resume mode works without the user typing `mpsr-run --`: the plugin inserts
/// the supervisor itself (spank_prepend_task_argv). Run on Slurm 24.11 by the test command.
#[test]
fn resume_needs_no_typed_supervisor_where_slurm_can_insert_it() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let v = c.cmd("scontrol -V").unwrap();
    let v = String::from_utf8_lossy(&v.stdout).to_string();
    let release: Vec<u32> = v
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .split('.')
        .take(2)
        .filter_map(|p| p.parse().ok())
        .collect();
    if release < vec![23, 11] {
        skip(&format!(
            "Slurm {} cannot insert mpsr-run (needs 23.11; the test command runs this on 24.11)",
            v.trim()
        ));
        return;
    }
    let bin = c.jobs().parent().unwrap().join("bin/mpsr-run");
    c.write_plugstack(&[format!("supervisor={}", bin.display())])
        .unwrap();
    resume_case(&c, "");
}

/// A resume-mode srun step hit by a fault restarts in place and finds its kept state; `prefix`
/// is what the user types before the command (`mpsr-run -- ` or nothing).
fn resume_case(c: &Cluster, prefix: &str) {
    let out = c.jobs().join("srun-resume.out");
    let mut srun = c
        .spawn_as(
            "nobody",
            // The first attempt keeps its "model" in the GPU's state keeper; the restarted one
            // finds it there instead of loading it again.
            &format!("srun -u -w n1 --gres=shard:1 --mps-resilient=resume {prefix}sh -c 'echo attempt $MPSR_RESTARTS; if [ $MPSR_RESTARTS = 0 ]; then mpsr-statetool model 8M --fill 9 || exit 1; else mpsr-statetool model 8M --verify 9 || exit 1; fi; exec mpsr-simclient --seconds $([ $MPSR_RESTARTS = 0 ] && echo 120 || echo 2)'"),
            &out,
        )
        .unwrap();
    let job = wait_for("srun job registered", SHORT, || {
        let s = c.agent_status("n1").ok()?;
        s.tasks.first().map(|t| t.job_id)
    })
    .unwrap();
    wait_for("client attached", SHORT, || {
        (c.clients("n1", 0).len() == 1).then_some(())
    })
    .unwrap();
    let t0 = Instant::now();
    c.inject("n1", 0, 43).unwrap();
    let restarted = wait_for("task restarted in place", LONG, || {
        std::fs::read_to_string(&out)
            .ok()?
            .contains("attempt 1")
            .then(|| t0.elapsed())
    })
    .unwrap();
    println!(
        "resume: fault -> task running again in place: {} ms",
        restarted.as_millis()
    );
    let status = wait_for("srun exit", LONG, || srun.try_wait().ok().flatten()).unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(status.success(), "srun failed: {text}");
    assert!(text.contains("restarting in place (1/3)"), "{text}");
    assert!(text.contains("origin=New"), "{text}");
    assert!(
        text.contains("origin=Kept") && text.contains("verified model: every byte is 9"),
        "the restarted task must find its kept state: {text}"
    );
    // srun has returned; Slurm may still be finishing the job (COMPLETING) for a moment.
    c.wait_job_state(job, &["COMPLETED"], SHORT).unwrap();
    assert_eq!(c.job_field(job, "Restarts"), "0");
}

/// Case 3: Xid 79 (device lost) drains the node with an `mpsr:` reason and requeues the batch
/// job; the health check resumes the node only after the agent reports the GPU healthy, and never
/// resumes a node someone else drained.
#[test]
fn device_lost_drains_and_healthcheck_resumes_after_recovery() {
    let opts = Options {
        health_interval_s: 2,
        ..Options::default()
    };
    let Some((_g, c)) = cluster(opts) else {
        return;
    };
    c.cmd("scontrol update NodeName=n2 State=DRAIN Reason='admin: maintenance'")
        .unwrap();
    let id = protected_batch_job(&c, 120);
    c.inject("n1", 0, 79).unwrap();
    let reason = wait_for("n1 drained by the agent", SHORT, || {
        let n = c.node("n1");
        n.get("State")?
            .contains("DRAIN")
            .then(|| n.get("Reason").cloned().unwrap_or_default())
    })
    .unwrap();
    assert!(reason.starts_with("mpsr: xid 79"), "{reason}");
    wait_for("job requeued", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    // Several health-check rounds while the GPU is still lost: the node stays drained.
    std::thread::sleep(Duration::from_secs(5));
    assert!(!not_drained(&c, "n1"), "resumed while the GPU is lost");
    // The GPU comes back (a reset); the agent sees it answer and the health check resumes n1.
    assert!(matches!(
        c.agent_call("n1", &Request::SimRecover { gpu: 0 }).unwrap(),
        Response::Ok
    ));
    wait_for("n1 resumed by the health check", SHORT, || {
        not_drained(&c, "n1").then_some(())
    })
    .unwrap();
    // The requeued job comes back on n1 and completes.
    c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    // n2 was drained by someone else: left alone.
    let n2 = c.node("n2");
    assert!(n2["State"].contains("DRAIN"), "{n2:?}");
    assert!(n2["Reason"].starts_with("admin: maintenance"), "{n2:?}");
}

/// A hardware finding of the telemetry (a SIMULATED hardware slowdown) drains the node through the
/// health check with an `mpsr: telemetry` reason; once the finding has cleared (the rule's
/// hysteresis) the health check resumes it. The other node is never touched.
#[test]
fn a_hardware_telemetry_finding_drains_through_the_healthcheck_until_it_clears() {
    let opts = Options {
        health_interval_s: 2,
        agent_extra: "[telemetry]\ninterval_ms = 500\n[telemetry.rules.hw_slowdown]\nwindow_s = 2.0\nclear_s = 2.0\n".into(),
        ..Options::default()
    };
    let Some((_g, c)) = cluster(opts) else {
        return;
    };
    let throttle = Request::SimPathology {
        gpu: 0,
        what: mpsr_proto::telemetry::replay::Pathology::Throttle,
        pid: None,
        secs: 10,
    };
    assert!(matches!(
        c.agent_call("n1", &throttle).unwrap(),
        Response::Ok
    ));
    let reason = wait_for("n1 drained for the telemetry finding", SHORT, || {
        let n = c.node("n1");
        n.get("State")?
            .contains("DRAIN")
            .then(|| n.get("Reason").cloned().unwrap_or_default())
    })
    .unwrap();
    assert!(
        reason.starts_with("mpsr: telemetry hw_slowdown on gpu0 of n1"),
        "{reason}"
    );
    assert!(not_drained(&c, "n2"), "the other node is left alone");
    wait_for("n1 resumed once the finding cleared", SHORT, || {
        not_drained(&c, "n1").then_some(())
    })
    .unwrap();
}

/// Case 4: a job without --mps-resilient is left alone: no MPS context, not registered, not
/// requeued by a fault on its GPU.
#[test]
fn job_without_the_flag_is_left_alone() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let id = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1",
            "echo pipe=${CUDA_MPS_PIPE_DIRECTORY:-none} mode=${MPSR_MODE:-none}; sleep 8",
        )
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let s = c.agent_status("n1").unwrap();
    assert!(s.tasks.iter().all(|t| t.job_id != id), "{s:?}");
    c.inject("n1", 0, 31).unwrap();
    c.wait_job_state(id, &["COMPLETED"], SHORT).unwrap();
    assert_eq!(c.job_field(id, "Restarts"), "0");
    assert!(
        c.job_output(id).contains("pipe=none mode=none"),
        "{}",
        c.job_output(id)
    );
}

fn assert_fails(out: &std::process::Output, needle: &str) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "expected failure, got success: {text}"
    );
    assert!(text.contains(needle), "expected '{needle}' in: {text}");
}

/// Case 5: bad input never crashes, hangs or drains anything, and says what is wrong.
#[test]
fn bad_input_is_refused_clearly() {
    let Some((_g, mut c)) = cluster(Options::default()) else {
        return;
    };
    // Bad option values: srun and sbatch refuse them before anything runs.
    for (args, needle) in [
        ("--mps-resilient=sometimes", "--mps-resilient=sometimes"),
        ("--mps-resilient --mps-threads=0", "--mps-threads=0"),
        ("--mps-resilient --mps-mem=lots", "--mps-mem=lots"),
        ("--mps-threads=50", "need --mps-resilient"),
    ] {
        let out = c
            .cmd_as("nobody", &format!("srun -w n1 --gres=shard:1 {args} true"))
            .unwrap();
        assert_fails(&out, needle);
    }
    let out = c
        .cmd_as("nobody", "sbatch --wrap true --mps-resilient=bogus")
        .unwrap();
    assert_fails(&out, "--mps-resilient=bogus");
    // Protection without a GPU: refused at submission (etc/job_submit.lua), not at task start.
    for cmd in [
        "sbatch --wrap true --mps-resilient",
        "srun -w n1 --mps-resilient true",
    ] {
        let out = c.cmd_as("nobody", cmd).unwrap();
        assert_fails(&out, "asks for no GPU");
    }
    // With a GPU (shard or gpu GRES) the same check lets it through.
    let out = c
        .cmd_as(
            "nobody",
            "srun -w n1 --gres=shard:1 --mps-resilient echo accepted",
        )
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("accepted"),
        "{out:?}"
    );

    // Unknown plugstack.conf key: named in the error, nothing runs.
    c.write_plugstack(&["bogus_key=1".into()]).unwrap();
    let out = c.cmd_as("nobody", "srun -w n1 true").unwrap();
    assert_fails(&out, "unknown plugstack.conf key 'bogus_key'");
    c.write_plugstack(&[]).unwrap();

    // Agent down, required_agent=no: the job runs unprotected, with a warning on its stderr.
    c.stop_agent("n1", false);
    let t = Instant::now();
    let out = c
        .cmd_as(
            "nobody",
            "srun -w n1 --gres=shard:1 --mps-resilient echo ran-unprotected",
        )
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("ran-unprotected"), "{text}");
    assert!(text.contains("WITHOUT GPU fault protection"), "{text}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    // required_agent=yes: the job fails in task_init, saying why; the node is not drained.
    c.write_plugstack(&["required_agent=yes".into()]).unwrap();
    let out = c
        .cmd_as(
            "nobody",
            "srun -w n1 --gres=shard:1 --mps-resilient echo should-not-run",
        )
        .unwrap();
    assert_fails(&out, "required_agent=yes");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("should-not-run"));
    assert!(not_drained(&c, "n1"));
    c.write_plugstack(&[]).unwrap();
    c.start_agent("n1").unwrap();

    // Agent killed mid-job and restarted: the registration survives and a fault still requeues.
    let id = protected_batch_job(&c, 120);
    c.stop_agent("n1", true);
    c.start_agent("n1").unwrap();
    assert_eq!(c.wait_registered("n1", id, 1).unwrap(), vec![0]);

    // Another user cannot register into, read or requeue this job.
    let as_daemon = |args: String| {
        c.cmd_as(
            "daemon",
            &format!("mpsrctl --socket {} {args}", c.agent_socket("n1").display()),
        )
        .unwrap()
    };
    assert_fails(
        &as_daemon(format!("register --job {id} --pid $$ --gpus 0")),
        "belongs to another user",
    );
    assert_fails(&as_daemon(format!("report {id}")), "PermissionDenied");
    assert_fails(
        &as_daemon("sim inject --gpu 0 --xid 31".into()),
        "PermissionDenied",
    );
    assert_eq!(c.job_field(id, "Restarts"), "0");

    // The restarted agent still knows the job: a real fault requeues it.
    c.inject("n1", 0, 31).unwrap();
    wait_for("job requeued after agent restart", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    assert!(not_drained(&c, "n1"));
}

/// The fault domain of a job's tasks on a node's GPU 0, and the clients in it.
fn domain_of(c: &Cluster, job: u32) -> (mpsr_proto::DomainId, Vec<u32>) {
    let s = c.agent_status("n1").unwrap();
    let d = s
        .tasks
        .iter()
        .find(|t| t.job_id == job)
        .and_then(|t| t.domains.first().copied())
        .unwrap_or_else(|| panic!("job {job} not registered: {s:?}"));
    let clients = s
        .gpus
        .iter()
        .filter(|g| g.gpu == d.gpu)
        .flat_map(|g| g.domains.iter())
        .find(|x| x.domain == d)
        .map(|x| x.clients.clone())
        .unwrap_or_default();
    (d, clients)
}

/// The domain of a running job's task on n1 once its client is attached to that domain's server.
fn attached_domain(c: &Cluster, job: u32) -> mpsr_proto::DomainId {
    wait_for(&format!("job {job}'s client attached"), SHORT, || {
        let s = c.agent_status("n1").ok()?;
        let t = s.tasks.iter().find(|t| t.job_id == job)?;
        let d = *t.domains.first()?;
        let g = s.gpus.iter().find(|g| g.gpu == d.gpu)?;
        g.domains
            .iter()
            .any(|x| x.domain == d && x.clients.contains(&t.pid))
            .then_some(d)
    })
    .unwrap()
}

/// Case 7 (fault domains): A and B each in a domain of their own (`--mps-isolation=job`), C and D
/// in the GPU's shared one. The agent crashes and comes back with all three domains. A fault in
/// A's server requeues A only; one in the shared server requeues C and D only. The jobs not hit
/// keep their very processes.
#[test]
fn a_fault_requeues_only_the_jobs_of_its_fault_domain() {
    let Some((_g, mut c)) = cluster(Options::default()) else {
        return;
    };
    let submit = |iso: &str| {
        c.sbatch(
            "nobody",
            &format!("-w n1 --gres=shard:1 --mps-resilient=requeue {iso}"),
            &client_script(120, 1),
        )
        .unwrap()
    };
    let a = submit("--mps-isolation=job");
    let b = submit("--mps-isolation=job");
    let cc = submit("--mps-isolation=shared");
    let d = submit("");
    for id in [a, b, cc, d] {
        c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
        assert_eq!(c.wait_registered("n1", id, 1).unwrap(), vec![0], "job {id}");
    }
    wait_for("one client per job in its domain", SHORT, || {
        [a, b, cc, d]
            .iter()
            .all(|j| domain_of(&c, *j).1.len() == if *j == cc || *j == d { 2 } else { 1 })
            .then_some(())
    })
    .unwrap();
    let (da, _) = domain_of(&c, a);
    let (db, b_clients) = domain_of(&c, b);
    let (dc, shared_clients) = domain_of(&c, cc);
    assert!(!da.is_shared() && !db.is_shared() && da != db, "{da} {db}");
    assert!(dc.is_shared() && domain_of(&c, d).0.is_shared());
    assert!(
        c.job_output(a).contains(&format!("gpu0/d{}/pipe", da.slot)),
        "{}",
        c.job_output(a)
    );

    // The agent is killed and restarted: every domain is adopted with its clients.
    let domains = |c: &Cluster| {
        c.agent_status("n1").unwrap().gpus[0]
            .domains
            .iter()
            .map(|x| (x.domain, x.clients.clone()))
            .collect::<Vec<_>>()
    };
    let before = domains(&c);
    assert_eq!(before.len(), 3, "{before:?}");
    c.stop_agent("n1", true);
    c.start_agent("n1").unwrap();
    assert_eq!(
        domains(&c),
        before,
        "domains and clients across an agent crash"
    );

    // A fault in A's server.
    let killed = c.inject_in("n1", 0, 31, Some(da.slot)).unwrap();
    assert_eq!(killed.len(), 1, "only A's client dies: {killed:?}");
    wait_for("A requeued", LONG, || {
        (c.job_field(a, "Restarts") == "1").then_some(())
    })
    .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    for id in [b, cc, d] {
        assert_eq!(c.job_field(id, "Restarts"), "0", "job {id}");
        assert_eq!(c.job_field(id, "JobState"), "RUNNING", "job {id}");
    }
    assert_eq!(domain_of(&c, b).1, b_clients, "B's process untouched");
    assert_eq!(
        domain_of(&c, cc).1,
        shared_clients,
        "C and D's processes untouched"
    );
    let ev = match c.agent_call("n1", &Request::Events { limit: 10 }).unwrap() {
        Response::Events { events, .. } => events,
        r => panic!("{r:?}"),
    };
    let f = ev
        .iter()
        .find(|f| f.hit_jobs == vec![a])
        .expect("A's decision");
    assert_eq!(f.hit_domains, vec![da], "{f}");
    assert_eq!(f.culprit_job, Some(a), "{f}");

    // A fault in the shared server: C and D, not B.
    let killed = c.inject_in("n1", 0, 43, Some(0)).unwrap();
    assert_eq!(killed.len(), 2, "{killed:?}");
    for id in [cc, d] {
        wait_for(&format!("job {id} requeued"), LONG, || {
            (c.job_field(id, "Restarts") == "1").then_some(())
        })
        .unwrap();
    }
    assert_eq!(c.job_field(b, "Restarts"), "0");
    assert_eq!(c.job_field(b, "JobState"), "RUNNING");
    assert_eq!(domain_of(&c, b).1, b_clients, "B's process untouched");
    for id in [a, cc, d] {
        c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    }
    assert!(not_drained(&c, "n1"));
}

/// Chaos: slurmctld is down when a fault hits a protected batch job. The agent's requeue fails
/// and is retried; once slurmctld is back it is done, exactly once. The job's name forges Slurm
/// fields in `scontrol show job`'s line (a retry reads the job first): read from scontrol, it
/// said the job had ended with 99 restarts and the requeue was never sent.
#[test]
fn a_requeue_while_slurmctld_is_down_is_done_once_it_is_back() {
    let Some((_g, mut c)) = cluster(Options::default()) else {
        return;
    };
    let id = c
        .sbatch(
            "nobody",
            "-w n1 -J 'x Restarts=99 JobState=COMPLETED BatchFlag=0 Requeue=0' --gres=shard:1 --mps-resilient",
            &client_script(120, 1),
        )
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    assert_eq!(c.wait_registered("n1", id, 1).unwrap(), vec![0]);
    wait_for("its client attached", SHORT, || {
        (!c.clients("n1", 0).is_empty()).then_some(())
    })
    .unwrap();
    c.stop_slurmctld();
    let killed = c.inject("n1", 0, 31).unwrap();
    assert_eq!(killed.len(), 1);
    // The agent tried and failed (scontrol cannot reach slurmctld); it keeps the actions pending:
    // the requeue and the job's fault line.
    wait_for("a failed requeue attempt", SHORT, || {
        let s = c.agent_status("n1").ok()?;
        (s.pending_actions == 2).then_some(())
    })
    .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        c.agent_status("n1").unwrap().pending_actions,
        2,
        "still pending, not dropped"
    );
    c.start_slurmctld().unwrap();
    wait_for("job requeued once slurmctld is back", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    assert_eq!(c.job_field(id, "Restarts"), "1", "requeued exactly once");
    wait_for("every action done", SHORT, || {
        (c.agent_status("n1").ok()?.pending_actions == 0).then_some(())
    })
    .unwrap();
    assert_eq!(
        c.admin_comment(id).matches("mpsr: fault").count(),
        1,
        "{}",
        c.admin_comment(id)
    );
}

/// Chaos: a fault storm on real Slurm, 100 simulated faults/s over both GPUs of a node for 10 s.
/// Each protected job there is requeued exactly once (Slurm's own restart count says so), none is
/// lost, the node is not drained (application faults only) and the agent still answers.
#[test]
fn a_fault_storm_requeues_each_job_once() {
    let Some((_g, c)) = cluster(Options {
        // Requeued jobs come back only after the storm.
        cred_expire_s: 30,
        ..Options::default()
    }) else {
        return;
    };
    let jobs: Vec<u32> = (0..4)
        .map(|_| {
            let id = c
                .sbatch(
                    "nobody",
                    "-w n1 --gres=shard:1 --mps-resilient",
                    &client_script(300, 1),
                )
                .unwrap();
            c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
            c.wait_registered("n1", id, 1).unwrap();
            id
        })
        .collect();
    let started = Instant::now();
    for i in 0..1000u32 {
        let _ = c.inject("n1", i % 2, [31, 43, 13][(i % 3) as usize]);
        let due = started + Duration::from_millis(10 * u64::from(i + 1));
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    }
    let storm = started.elapsed();
    assert!(
        c.agent_status("n1").is_ok(),
        "the agent answers after the storm"
    );
    for id in &jobs {
        wait_for(&format!("job {id} requeued"), LONG, || {
            (c.job_field(*id, "Restarts") == "1").then_some(())
        })
        .unwrap();
    }
    for id in &jobs {
        c.wait_job_state(*id, &["COMPLETED"], LONG).unwrap();
        assert_eq!(
            c.job_field(*id, "Restarts"),
            "1",
            "job {id} requeued exactly once"
        );
    }
    assert!(not_drained(&c, "n1"));
    println!(
        "storm: 1000 faults in {storm:?}; {} jobs requeued once each",
        jobs.len()
    );
}

/// A job spanning two nodes: a fault on one node's GPU requeues the whole job.
#[test]
fn multi_node_job_is_requeued_as_a_whole() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let id = c
        .sbatch(
            "nobody",
            "-N2 --ntasks-per-node=1 --gres=shard:1 --mps-resilient",
            "if [ \"${SLURM_RESTART_COUNT:-0}\" -gt 0 ]; then s=1; else s=120; fi\nsrun mpsr-simclient --seconds $s",
        )
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    // The batch script on the first node, and one srun task on each node.
    c.wait_registered("n1", id, 2).unwrap();
    c.wait_registered("n2", id, 1).unwrap();
    c.inject("n2", 0, 43).unwrap();
    wait_for("job requeued", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
}

/// Case 6: the README's demo runs through this same real Slurm and reports success.
#[test]
fn the_demo_runs_through_real_slurm() {
    let Some((_g, c)) = cluster(Options {
        nodes: vec!["warmup".into()],
        ..Options::default()
    }) else {
        return;
    };
    drop(c); // the demo starts its own cluster; this one only proved the host can run one
    let demo = mpsr_e2e::build_dir().unwrap().join("mpsr-demo");
    let out = std::process::Command::new(&demo).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("DEMO OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("SIMULATED"),
        "the demo must say its GPUs are simulated"
    );
}

/// The driver patch's containment (phase B, SIMULATED: `[sim] driver_patch = "containment"`) on
/// real Slurm: two batch jobs share GPU 0's server; an MMU fault of one is contained to it. The
/// agent terminates the culprit's client, so its job ends FAILED and is never requeued; the other
/// job's process is untouched and completes on its first run; nothing is drained.
#[test]
fn a_contained_fault_fails_only_the_culprit_job() {
    let Some((_g, c)) = cluster(Options {
        agent_extra: "driver_patch = \"containment\"\n".into(),
        ..Options::default()
    }) else {
        return;
    };
    let victim = protected_batch_job(&c, 20);
    let culprit = protected_batch_job(&c, 300);
    let pid_of = |job: u32| {
        wait_for(&format!("job {job} registered on gpu0"), SHORT, || {
            c.agent_status("n1")
                .ok()?
                .tasks
                .into_iter()
                .find(|t| t.job_id == job && t.gpus == vec![0])
                .map(|t| t.pid)
        })
        .unwrap()
    };
    let (victim_pid, culprit_pid) = (pid_of(victim), pid_of(culprit));
    // Registered at task start, attached to the server only once the script's client runs: a
    // fault comes from an attached client.
    wait_for("both clients attached to gpu0's server", SHORT, || {
        let attached = c.clients("n1", 0);
        (attached.contains(&victim_pid) && attached.contains(&culprit_pid)).then_some(())
    })
    .unwrap();
    let killed = c.inject_culprit("n1", 0, 31, culprit_pid).unwrap();
    assert!(
        killed.is_empty(),
        "the contained fault kills nobody: {killed:?}"
    );
    c.wait_job_state(culprit, &["FAILED"], LONG).unwrap();
    assert_eq!(
        c.job_field(culprit, "Restarts"),
        "0",
        "the culprit is not requeued"
    );
    assert!(
        c.clients("n1", 0).contains(&victim_pid),
        "the victim's client runs on in the same server"
    );
    c.wait_job_state(victim, &["COMPLETED"], LONG).unwrap();
    assert_eq!(c.job_field(victim, "Restarts"), "0");
    let ev = match c.agent_call("n1", &Request::Events { limit: 10 }).unwrap() {
        Response::Events { events, .. } => events,
        r => panic!("{r:?}"),
    };
    let f = ev
        .iter()
        .find(|f| f.culprit == Some(culprit_pid))
        .expect("the decision");
    assert!(f.contained, "{f}");
    assert_eq!(f.hit_jobs, vec![culprit], "{f}");
    assert!(f.spared_jobs.contains(&victim), "{f}");
    assert!(not_drained(&c, "n1"));
}

/// A job hit in each of its runs is requeued each time (issue 25.1): its second run is a run of
/// its own (Slurm's restart count 1), not the first one whose requeue is done. A job in a domain of
/// its own is hit in its first and second run; it completes on its third with Restarts=2.
#[test]
fn a_job_hit_in_each_of_its_runs_is_requeued_each_time() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let id = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient --mps-isolation=job",
            "echo \"run ${SLURM_RESTART_COUNT:-0}\"\n\
             if [ \"${SLURM_RESTART_COUNT:-0}\" -ge 2 ]; then s=1; else s=120; fi\n\
             exec mpsr-simclient --seconds $s",
        )
        .unwrap();
    for run in 0..2u32 {
        c.wait_job_state(id, &["RUNNING"], LONG).unwrap();
        let d = attached_domain(&c, id);
        assert!(!d.is_shared(), "a domain of its own: {d}");
        let killed = c.inject_in("n1", d.gpu, 31, Some(d.slot)).unwrap();
        assert_eq!(killed.len(), 1, "run {run}: {killed:?}");
        wait_for(&format!("run {run} requeued"), LONG, || {
            (c.job_field(id, "Restarts") == (run + 1).to_string()).then_some(())
        })
        .unwrap();
    }
    c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    assert_eq!(c.job_field(id, "Restarts"), "2");
    assert!(c.job_output(id).contains("run 2"), "{}", c.job_output(id));
    // Each hit run left its line where Slurm shows the job.
    let comment = admin_comment(&c, id);
    assert_eq!(
        comment.matches("mpsr: fault").count(),
        2,
        "AdminComment: {comment}"
    );
    assert!(
        comment.contains("xid 31 (app_memory) on n1 gpu") && comment.contains("requeued"),
        "AdminComment: {comment}"
    );
    assert!(not_drained(&c, "n1"));
}

/// A local user cannot register a process into another user's job, protected or not, running
/// or requeued (issue 25.2): such a registration once made a fault requeue an unprotected job
/// of someone else and let the squatter take a requeued job's kept GPU state.
#[test]
fn a_user_cannot_squat_another_users_job_nor_its_kept_state() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    // Alice (nobody): an unprotected job P and a protected job K that keeps GPU state; both on
    // gpu0's shared domain.
    let p = c
        .sbatch("nobody", "-w n1 --gres=shard:1", "exec sleep 300")
        .unwrap();
    let keeps = keeps_state("ckpt", "4M", 3);
    let k = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient",
            &format!("{keeps}{}", client_script(120, 1)),
        )
        .unwrap();
    c.wait_job_state(p, &["RUNNING"], SHORT).unwrap();
    c.wait_job_state(k, &["RUNNING"], SHORT).unwrap();
    assert!(attached_domain(&c, k).is_shared());
    // Bob (daemon) registers a process of his own under each job id.
    let sock = c.agent_socket("n1");
    let squat = |job: u32| {
        let out = c
            .cmd_as(
                "daemon",
                &format!(
                    "sleep 30 & s=$!; mpsrctl --socket {} register --job {job} --pid $s --gpus 0 --batch; rc=$?; kill $s; exit $rc",
                    sock.display()
                ),
            )
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    for job in [p, k] {
        let (code, err) = squat(job);
        assert_eq!(code, Some(1), "bob registered into job {job}: {err}");
        assert!(err.contains("PermissionDenied"), "{err}");
    }
    assert!(
        c.agent_status("n1")
            .unwrap()
            .tasks
            .iter()
            .all(|t| t.job_id == k),
        "only K's own task is registered"
    );
    // A fault in the shared domain requeues K, and not P, which never asked for protection.
    let killed = c.inject_in("n1", 0, 31, Some(0)).unwrap();
    assert_eq!(killed.len(), 1, "{killed:?}");
    wait_for("K requeued", LONG, || {
        (c.job_field(k, "Restarts") == "1").then_some(())
    })
    .unwrap();
    // While K waits for its next run, bob cannot take its place (its kept state waits in the
    // keeper), nor read its fault report.
    let (code, err) = squat(k);
    assert_eq!(code, Some(1), "bob registered into requeued job {k}: {err}");
    let out = c
        .cmd_as(
            "daemon",
            &format!("mpsrctl --socket {} report {k}", sock.display()),
        )
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "bob read K's report");
    c.wait_job_state(k, &["COMPLETED"], LONG).unwrap();
    let out = c.job_output(k);
    assert!(
        out.contains("origin=Kept") && out.contains("verified ckpt: every byte is 3"),
        "K's kept state, untouched: {out}"
    );
    assert_eq!(c.job_field(p, "Restarts"), "0", "P was never requeued");
    assert_eq!(c.job_field(p, "JobState"), "RUNNING");
}

/// A quarantined job whose GPU has no fault domain free runs where it asked instead of failing
/// (issue 25.4): a job alone in the shared domain is hit (so it is the culprit) while the only
/// other domain is in use; its requeued run is placed in the shared domain, completes, and its
/// report says why the quarantine was not applied.
#[test]
fn a_quarantined_job_with_no_domain_free_runs_shared_instead_of_failing() {
    let Some((_g, c)) = cluster(Options {
        gpus_per_node: 1,
        agent_mps: "max_domains_per_gpu = 2".into(),
        ..Options::default()
    }) else {
        return;
    };
    let a = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient --mps-isolation=job",
            &client_script(300, 1),
        )
        .unwrap();
    let q = protected_batch_job(&c, 120);
    c.wait_job_state(a, &["RUNNING"], SHORT).unwrap();
    assert!(!attached_domain(&c, a).is_shared());
    assert!(attached_domain(&c, q).is_shared());
    let killed = c.inject_in("n1", 0, 31, Some(0)).unwrap();
    assert_eq!(killed.len(), 1, "{killed:?}");
    wait_for("Q requeued", LONG, || {
        (c.job_field(q, "Restarts") == "1").then_some(())
    })
    .unwrap();
    c.wait_job_state(q, &["COMPLETED"], LONG).unwrap();
    assert_eq!(c.job_field(q, "ExitCode"), "0:0", "{}", c.job_output(q));
    let rep = match c
        .agent_call("n1", &Request::JobReport { job_id: q })
        .unwrap()
    {
        Response::JobReport(r) => r,
        r => panic!("{r:?}"),
    };
    assert!(
        rep.actions.iter().any(|l| l.contains("quarantined"))
            && rep
                .actions
                .iter()
                .any(|l| l.contains("quarantine not applied")),
        "{:?}",
        rep.actions
    );
    assert_eq!(c.job_field(a, "JobState"), "RUNNING", "A untouched");
    assert_eq!(c.job_field(a, "Restarts"), "0");
}

/// Starts, as nobody, an srun task in resume mode under mpsr-run with `standby_flag`, writing to
/// the job file `name`: the output file, the srun, the job and its GPU once registered.
fn start_resume_srun(
    c: &Cluster,
    name: &str,
    standby_flag: &str,
    app: &str,
) -> (std::path::PathBuf, std::process::Child, u32, u32) {
    let out = c.jobs().join(name);
    let srun = c
        .spawn_as(
            "nobody",
            &format!("srun -u -w n1 --gres=shard:1 --mps-resilient=resume {standby_flag} mpsr-run -- sh -c '{app}'"),
            &out,
        )
        .unwrap();
    let job = wait_for("srun job registered", SHORT, || {
        let s = c.agent_status("n1").ok()?;
        s.tasks.first().map(|t| t.job_id)
    })
    .unwrap();
    let gpu = c.agent_status("n1").unwrap().tasks[0].gpus[0];
    (out, srun, job, gpu)
}

/// The task's `kind` standby took over (what the task printed: `text`): no restart, the kept
/// state as the primary left it (`byte` everywhere, after the standby's `released` line), the step
/// completed with Restarts=0 and the job's AdminComment says how.
fn taken_over_in_place(c: &Cluster, job: u32, text: &str, kind: &str, released: &str, byte: u8) {
    assert!(
        text.contains(&format!("its {kind} standby took over")),
        "{text}"
    );
    assert!(!text.contains("restarting in place"), "{text}");
    assert!(
        text.contains(released)
            && text.contains("origin=Kept")
            && text.contains(&format!("verified model: every byte is {byte}")),
        "the standby found the kept state as the primary left it: {text}"
    );
    c.wait_job_state(job, &["COMPLETED"], SHORT).unwrap();
    assert_eq!(c.job_field(job, "Restarts"), "0");
    let line = format!("victim; its {kind} standby took over");
    wait_for("the job's fault line", SHORT, || {
        admin_comment(c, job).contains(&line).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: AdminComment={}", admin_comment(c, job)));
}

/// A neighbour's batch job joins the srun task's shared server on `gpu` (so the task is a victim
/// of the fault, not its culprit), an Xid 43 hits that server, and the srun ends successfully:
/// the neighbour's id and what the srun printed.
fn hit_beside_a_neighbour(
    c: &Cluster,
    gpu: u32,
    srun: &mut std::process::Child,
    out: &std::path::Path,
) -> (u32, String) {
    let neighbour = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient",
            &client_script(120, 1),
        )
        .unwrap();
    c.wait_job_state(neighbour, &["RUNNING"], SHORT).unwrap();
    assert_eq!(c.wait_registered("n1", neighbour, 1).unwrap(), vec![gpu]);
    wait_for("both clients busy in the shared server", SHORT, || {
        (c.clients("n1", gpu).len() == 2).then_some(())
    })
    .unwrap();
    c.inject_in("n1", gpu, 43, Some(0)).unwrap();
    let status = wait_for("srun exit", LONG, || srun.try_wait().ok().flatten()).unwrap();
    let text = std::fs::read_to_string(out).unwrap();
    assert!(status.success(), "srun failed: {text}");
    (neighbour, text)
}

/// A hot standby on real Slurm (`--mps-resilient=resume --mps-standby`): mpsr-run runs the task
/// and a standby of it in the GPU's standby domain; the standby attaches the task's kept state and
/// waits. A fault in the shared server hits the task and a neighbour's batch job: the standby
/// takes over at the decision (no restart: same job and step, Restarts=0, the kept state as the
/// primary left it), the neighbour is requeued, and the step completes.
#[test]
fn a_hot_standby_takes_over_a_hit_srun_task() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let (out, mut srun, job, gpu) =
        start_resume_srun(&c, "srun-standby.out", "--mps-standby", &standby_app(9));
    // The standby waits in a domain of its own kind: the GPU's standby domain, not the shared one.
    wait_for("the standby prepared in the standby domain", SHORT, || {
        let text = std::fs::read_to_string(&out).ok()?;
        let s = c.agent_status("n1").ok()?;
        let g = s.gpus.iter().find(|g| g.gpu == gpu)?;
        let waiting = g
            .domains
            .iter()
            .any(|d| d.tenancy == "standby" && !d.domain.is_shared());
        let armed = s
            .tasks
            .iter()
            .any(|t| t.job_id == job && t.standby.is_some());
        (waiting && armed && text.matches("origin=").count() >= 2).then_some(())
    })
    .unwrap();
    let (neighbour, text) = hit_beside_a_neighbour(&c, gpu, &mut srun, &out);
    // The fault in Slurm's own view of the job, and on the task's stderr.
    taken_over_in_place(&c, job, &text, "hot", "ready: took over", 9);
    assert!(
        text.contains("mpsr-run: a GPU fault hit the task (hit by fault"),
        "{text}"
    );
    wait_for("the neighbour's fault line", LONG, || {
        admin_comment(&c, neighbour)
            .contains("victim; requeued")
            .then_some(())
    })
    .unwrap();
    wait_for("the neighbour requeued", LONG, || {
        (c.job_field(neighbour, "Restarts") == "1").then_some(())
    })
    .unwrap();
    assert!(not_drained(&c, "n1"));
}

/// `--mps-standby=warm`: the standby waits before its first CUDA call, a client of no MPS server
/// (no GPU memory); a fault of the task's server releases it, it attaches the kept state and the
/// task completes without a restart; Slurm's view of the job says so.
#[test]
fn a_warm_standby_takes_over_a_hit_srun_task() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let (out, mut srun, job, gpu) = start_resume_srun(
        &c,
        "srun-warm.out",
        "--mps-standby=warm",
        &warm_standby_app(7),
    );
    let standby = wait_for("the warm standby armed", SHORT, || {
        let text = std::fs::read_to_string(&out).ok()?;
        let s = c.agent_status("n1").ok()?;
        let t = s.tasks.iter().find(|t| t.job_id == job)?;
        (text.contains("origin=")).then_some(t.standby?.0)
    })
    .unwrap();
    // Waiting, it is a client of no server of the GPU: no context, no GPU memory.
    std::thread::sleep(Duration::from_millis(500));
    let s = c.agent_status("n1").unwrap();
    let g = s.gpus.iter().find(|g| g.gpu == gpu).unwrap();
    assert!(
        g.domains.iter().all(|d| !d.clients.contains(&standby)),
        "{:?}",
        g.domains
    );
    let (_neighbour, text) = hit_beside_a_neighbour(&c, gpu, &mut srun, &out);
    taken_over_in_place(&c, job, &text, "warm", "before cuda: took over", 7);
    assert!(not_drained(&c, "n1"));
}

/// Without a standby of its own, a resume srun task whose GPU runs a standby domain (another
/// task's warm standby waits there) keeps a cold one: nothing of the task runs for it, and the
/// agent releases it at the decision of a fault in the shared server, so mpsr-run restarts the
/// task at once in the standby domain; the restarted task finds its kept state, the step completes
/// with Restarts=0 and the job's AdminComment says how. The warm task's standby takes over.
#[test]
fn a_hit_srun_task_without_a_standby_restarts_at_once_in_the_standby_domain() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let (w_out, mut w_srun, w_job, gpu) = start_resume_srun(
        &c,
        "srun-warm-beside.out",
        "--mps-standby=warm",
        &warm_standby_app(7),
    );
    wait_for("the warm standby armed", SHORT, || {
        let s = c.agent_status("n1").ok()?;
        s.tasks
            .iter()
            .find(|t| t.job_id == w_job)?
            .standby
            .map(|_| ())
    })
    .unwrap();
    let out = c.jobs().join("srun-cold.out");
    let mut srun = c
        .spawn_as(
            "nobody",
            "srun -u -w n1 --gres=shard:1 --mps-resilient=resume mpsr-run -- sh -c 'echo attempt $MPSR_RESTARTS; if [ $MPSR_RESTARTS = 0 ]; then mpsr-statetool model 8M --fill 5 || exit 1; else mpsr-statetool model 8M --verify 5 || exit 1; fi; exec mpsr-simclient --seconds $([ $MPSR_RESTARTS = 0 ] && echo 120 || echo 2)'",
            &out,
        )
        .unwrap();
    let (job, cold) = wait_for("its cold standby armed", SHORT, || {
        let s = c.agent_status("n1").ok()?;
        let t = s.tasks.iter().find(|t| t.job_id != w_job)?;
        let cold = t
            .standby
            .filter(|_| t.standby_kind == Some(mpsr_proto::standby::Kind::Cold));
        Some((t.job_id, cold?))
    })
    .unwrap();
    let task_gpu = c.wait_registered("n1", job, 1).unwrap()[0];
    assert_eq!(
        task_gpu, gpu,
        "both tasks on one GPU (Slurm fills a GPU's shards first)"
    );
    assert!(
        !cold.1.is_shared(),
        "it waits for the standby domain: {cold:?}"
    );
    wait_for("both primaries busy in the shared server", SHORT, || {
        (c.clients("n1", gpu).len() == 2).then_some(())
    })
    .unwrap();
    assert!(
        !c.clients("n1", gpu).contains(&cold.0),
        "a cold standby is no client"
    );
    c.inject_in("n1", gpu, 43, Some(0)).unwrap();
    let status = wait_for("srun exit", LONG, || srun.try_wait().ok().flatten()).unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(status.success(), "srun failed: {text}");
    assert!(
        text.contains(&format!(
            "restarting in place (1/3) at once, its clients in gpu{gpu}/d"
        )),
        "{text}"
    );
    assert!(
        text.contains("attempt 1") && text.contains("verified model: every byte is 5"),
        "the restarted task found its kept state: {text}"
    );
    c.wait_job_state(job, &["COMPLETED"], SHORT).unwrap();
    assert_eq!(c.job_field(job, "Restarts"), "0");
    wait_for("the job's fault line", SHORT, || {
        admin_comment(&c, job)
            .contains("victim; restarted at once in another fault domain")
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: AdminComment={}", admin_comment(&c, job)));
    let w_status = wait_for("the warm task's srun exit", LONG, || {
        w_srun.try_wait().ok().flatten()
    })
    .unwrap();
    let w_text = std::fs::read_to_string(&w_out).unwrap();
    assert!(w_status.success(), "{w_text}");
    assert!(w_text.contains("its warm standby took over"), "{w_text}");
    assert!(not_drained(&c, "n1"));
}

/// Slurm's own GPU sharing, gres/mps (issue 23): a job asking `--gres=mps:50 --mps-resilient` is
/// protected like a shard job: registered on its GPU (from Slurm's environment), Slurm's thread
/// percentage (50) is what its clients get, and a fault in its server requeues it.
#[test]
fn a_gres_mps_job_is_protected_like_a_shard_job() {
    let Some((_g, c)) = cluster(Options {
        gres_mps: true,
        ..Options::default()
    }) else {
        return;
    };
    let script = "echo \"run ${SLURM_RESTART_COUNT:-0} threads $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE gpu $MPSR_GPU\"\n\
                  if [ \"${SLURM_RESTART_COUNT:-0}\" -gt 0 ]; then s=1; else s=120; fi\n\
                  exec mpsr-simclient --seconds $s";
    let id = c
        .sbatch("nobody", "-w n1 --gres=mps:50 --mps-resilient", script)
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    let gpus = c.wait_registered("n1", id, 1).unwrap();
    assert_eq!(gpus.len(), 1);
    let d = attached_domain(&c, id);
    assert_eq!(d.gpu, gpus[0]);
    let killed = c.inject_in("n1", d.gpu, 43, Some(d.slot)).unwrap();
    assert_eq!(killed.len(), 1, "{killed:?}");
    wait_for("requeued", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    let out = c.job_output(id);
    // (Slurm rewrites the output file for the second run.)
    assert!(out.contains("run 1 threads 50"), "{out}");
    assert!(admin_comment(&c, id).contains("requeued"));
}

/// Jobs tracked and confined by cgroups as production sites run them (issue 23):
/// `ProctrackType=proctrack/cgroup`, `TaskPlugin=task/cgroup,task/affinity`,
/// `ConstrainDevices=yes`. From inside its cgroup a job still reaches its MPS server's pipe
/// directory and the state keeper; a fault requeues the batch job, which finds its kept state on
/// its second run; an srun task's hot standby takes over under mpsr-run.
#[test]
fn jobs_confined_by_cgroups_are_protected_too() {
    let Some((_g, c)) = cluster(Options {
        cgroup: true,
        ..Options::default()
    }) else {
        return;
    };
    let keeps = keeps_state("ckpt", "4M", 5);
    let batch = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient",
            &format!(
                "cat /proc/self/cgroup | grep -E 'freezer|devices' | sed 's/^/cgroup /'\n{keeps}{}",
                client_script(120, 1)
            ),
        )
        .unwrap();
    c.wait_job_state(batch, &["RUNNING"], SHORT).unwrap();
    let out = c.jobs().join("srun-cgroup.out");
    let app = standby_app(7);
    let mut srun = c
        .spawn_as(
            "nobody",
            &format!("srun -u -w n1 --gres=shard:1 --mps-resilient=resume --mps-standby mpsr-run -- sh -c '{app}'"),
            &out,
        )
        .unwrap();
    let srun_job = wait_for("the srun job's standby armed", SHORT, || {
        let s = c.agent_status("n1").ok()?;
        s.tasks
            .iter()
            .find(|t| t.job_id != batch && t.standby.is_some())
            .map(|t| t.job_id)
    })
    .unwrap();
    let gpu = c.wait_registered("n1", batch, 1).unwrap()[0];
    assert_eq!(c.wait_registered("n1", srun_job, 1).unwrap(), vec![gpu]);
    wait_for("both clients busy in the shared server", SHORT, || {
        (c.clients("n1", gpu).len() == 2).then_some(())
    })
    .unwrap();
    let text = c.job_output(batch);
    assert!(
        text.contains("cgroup") && text.contains(&format!("job_{batch}")),
        "the job runs in its cgroup: {text}"
    );
    c.inject_in("n1", gpu, 43, Some(0)).unwrap();
    wait_for("the batch job requeued", LONG, || {
        (c.job_field(batch, "Restarts") == "1").then_some(())
    })
    .unwrap();
    let status = wait_for("srun exit", LONG, || srun.try_wait().ok().flatten()).unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(status.success(), "srun failed: {text}");
    assert!(
        text.contains("its hot standby took over")
            && text.contains("verified model: every byte is 7"),
        "{text}"
    );
    c.wait_job_state(batch, &["COMPLETED"], LONG).unwrap();
    let text = c.job_output(batch);
    assert!(
        text.contains("origin=Kept") && text.contains("verified ckpt: every byte is 5"),
        "the requeued job found its kept state from inside its cgroup: {text}"
    );
    assert!(not_drained(&c, "n1"));
}

/// The hot standby's other paths on real Slurm (issue 21): a standby gone before the fault means
/// the ordinary restart in place; the culprit's standby is never released (a contained fault,
/// SIMULATED driver patch: the culprit is failed, its standby not used, its neighbour untouched).
#[test]
fn a_lost_standby_means_a_restart_and_a_culprits_standby_is_never_released() {
    let Some((_g, c)) = cluster(Options {
        agent_extra: "driver_patch = \"containment\"\n".into(),
        ..Options::default()
    }) else {
        return;
    };
    let run_with_standby = |name: &str| {
        let out = c.jobs().join(format!("{name}.out"));
        let child = c
            .spawn_as(
                "nobody",
                &format!(
                    "srun -u -w n1 -J {name} --gres=shard:1 --mps-resilient=resume --mps-standby mpsr-run -- sh -c '{}'",
                    standby_app(3)
                ),
                &out,
            )
            .unwrap();
        let (job, standby) = wait_for(&format!("{name}'s standby armed"), SHORT, || {
            let s = c.agent_status("n1").ok()?;
            let o = c.cmd(&format!("squeue -h -n {name} -o %i")).ok()?;
            let id: u32 = String::from_utf8_lossy(&o.stdout).trim().parse().ok()?;
            let t = s.tasks.iter().find(|t| t.job_id == id)?;
            Some((id, t.standby?.0))
        })
        .unwrap();
        (child, out, job, standby)
    };
    let neighbour = protected_batch_job(&c, 120);

    // A: its standby dies before the fault; the fault restarts A in place.
    let (mut a, a_out, a_job, a_standby) = run_with_standby("lost");
    c.cmd(&format!("kill -9 {a_standby}")).unwrap();
    wait_for("mpsr-run saw its standby end", SHORT, || {
        std::fs::read_to_string(&a_out)
            .ok()?
            .contains("ended before any fault")
            .then_some(())
    })
    .unwrap();
    wait_for(
        "A's primary and the neighbour busy in the shared server",
        SHORT,
        || (c.clients("n1", 0).len() == 2).then_some(()),
    )
    .unwrap();
    c.inject_in("n1", 0, 43, Some(0)).unwrap();
    wait_for("A restarted in place", LONG, || {
        std::fs::read_to_string(&a_out)
            .ok()?
            .contains("restarting in place")
            .then_some(())
    })
    .unwrap();
    let text = std::fs::read_to_string(&a_out).unwrap();
    assert!(!text.contains("took over"), "{text}");
    assert_eq!(c.job_field(a_job, "Restarts"), "0");
    wait_for("the neighbour requeued", LONG, || {
        (c.job_field(neighbour, "Restarts") == "1").then_some(())
    })
    .unwrap();
    let _ = a.kill();
    c.cmd(&format!("scancel {a_job} {neighbour}")).unwrap();
    wait_for("A and the neighbour gone from the GPUs", LONG, || {
        (c.clients("n1", 0).is_empty() && c.clients("n1", 1).is_empty()).then_some(())
    })
    .unwrap();

    // B: the culprit of a contained fault on gpu1, beside a neighbour there.
    let other = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:2 --mps-resilient",
            &client_script(120, 1),
        )
        .unwrap();
    c.wait_job_state(other, &["RUNNING"], SHORT).unwrap();
    let (mut b, b_out, b_job, b_standby) = run_with_standby("culprit");
    let gpu = c.wait_registered("n1", b_job, 1).unwrap()[0];
    assert_eq!(c.wait_registered("n1", other, 1).unwrap(), vec![gpu]);
    // B's primary: B's own client (A's or the neighbour's may still be attached under load).
    let primary = wait_for("B's primary attached", SHORT, || {
        c.job_clients("n1", gpu, b_job).first().copied()
    })
    .unwrap();
    let killed = c.inject_culprit("n1", gpu, 31, primary).unwrap();
    assert!(killed.is_empty(), "contained: {killed:?}");
    let status = wait_for("B's srun ends", LONG, || b.try_wait().ok().flatten()).unwrap();
    let text = std::fs::read_to_string(&b_out).unwrap();
    assert!(!status.success(), "the culprit is failed: {text}");
    assert!(text.contains("not restarting"), "{text}");
    assert!(
        !text.contains("took over"),
        "its standby is never released: {text}"
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{b_standby}")).exists(),
        "its standby ended with the task"
    );
    assert_eq!(
        c.job_field(other, "JobState"),
        "RUNNING",
        "the neighbour runs on"
    );
    assert_eq!(c.job_field(other, "Restarts"), "0");
    assert!(
        c.admin_comment(b_job).contains("culprit"),
        "{}",
        c.admin_comment(b_job)
    );
}

/// A rolling upgrade and a downgrade with jobs running (issue 24). The node runs the previous
/// release (0.1.0: agent, plugin, mpsr-run, state library); a batch job keeps state and an srun
/// task runs under that mpsr-run. The packages of this release are installed and the agent
/// restarted as its unit would: the old processes and the old plugin in slurmstepd talk to the new
/// agent; a fault requeues the batch job (its second run finds its kept state) and restarts the
/// task in place. Then back to 0.1.0 while a task of this release runs: the new mpsr-run with the
/// old agent restarts it in place after a fault. The compatibility promise is in README.
#[test]
fn a_rolling_upgrade_and_a_downgrade_keep_running_jobs_protected() {
    use mpsr_e2e::Release;
    if std::env::var_os("MPSR_PREV_BUILD_DIR").is_none_or(|d| d.is_empty()) {
        skip("MPSR_PREV_BUILD_DIR not set: the previous release was not built (scripts/prev-release.sh)");
        return;
    }
    if std::env::var_os("MPSR_SLURM_ROOT").is_some() {
        skip("the previous release's plugin is built against this host's Slurm (22.05) only");
        return;
    }
    let Some((_g, mut c)) = cluster(Options {
        previous_release: true,
        ..Options::default()
    }) else {
        return;
    };
    assert_eq!(
        c.agent_status("n1").unwrap().agent_version,
        "",
        "0.1.0 does not say its version"
    );
    let resume_task = |c: &Cluster, name: &str| {
        let out = c.jobs().join(format!("{name}.out"));
        let child = c
            .spawn_as(
                "nobody",
                &format!("srun -u -w n1 -J {name} --gres=shard:1 --mps-resilient=resume mpsr-run -- sh -c 'echo attempt $MPSR_RESTARTS; if [ $MPSR_RESTARTS = 0 ]; then mpsr-statetool model 4M --fill 9 || exit 1; else mpsr-statetool model 4M --verify 9 || exit 1; fi; exec mpsr-simclient --seconds $([ $MPSR_RESTARTS = 0 ] && echo 120 || echo 2)'"),
                &out,
            )
            .unwrap();
        let job = wait_for(&format!("{name} running"), SHORT, || {
            let o = c.cmd(&format!("squeue -h -n {name} -t R -o %i")).ok()?;
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u32>()
                .ok()
        })
        .unwrap();
        (child, out, job)
    };
    let batch = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient",
            &format!("{}{}", keeps_state("ckpt", "4M", 5), client_script(120, 1)),
        )
        .unwrap();
    c.wait_job_state(batch, &["RUNNING"], SHORT).unwrap();
    let (mut old_task, old_out, old_job) = resume_task(&c, "old");
    for j in [batch, old_job] {
        assert_eq!(c.wait_registered("n1", j, 1).unwrap(), vec![0], "job {j}");
    }
    wait_for("both clients attached to gpu0's server", SHORT, || {
        (c.clients("n1", 0).len() == 2).then_some(())
    })
    .unwrap();

    // Upgrade: this release's files, the agent restarted; the jobs' processes stay 0.1.0's.
    c.install(Release::Current).unwrap();
    let s = c.agent_status("n1").unwrap();
    assert_eq!(s.agent_version, env!("CARGO_PKG_VERSION"));
    assert!(
        [batch, old_job]
            .iter()
            .all(|j| s.tasks.iter().any(|t| t.job_id == *j)),
        "the registrations of 0.1.0 carried over: {s:?}"
    );
    c.inject("n1", 0, 43).unwrap();
    wait_for("the batch job requeued", LONG, || {
        (c.job_field(batch, "Restarts") == "1").then_some(())
    })
    .unwrap();
    let status = wait_for("the old task ends", LONG, || {
        old_task.try_wait().ok().flatten()
    })
    .unwrap();
    let text = std::fs::read_to_string(&old_out).unwrap();
    assert!(status.success(), "{text}");
    assert!(
        text.contains("restarting in place (1/3)")
            && text.contains("verified model: every byte is 9"),
        "0.1.0's mpsr-run restarted its task through the new agent: {text}"
    );
    c.wait_job_state(batch, &["COMPLETED"], LONG).unwrap();
    let out = c.job_output(batch);
    assert!(
        out.contains("origin=Kept") && out.contains("verified ckpt: every byte is 5"),
        "the requeued job found what it kept under 0.1.0: {out}"
    );

    // Downgrade: back to 0.1.0 while a task of this release runs.
    let (mut new_task, new_out, new_job) = resume_task(&c, "new");
    c.wait_registered("n1", new_job, 1).unwrap();
    wait_for("its client attached", SHORT, || {
        (c.clients("n1", 0).len() == 1).then_some(())
    })
    .unwrap();
    c.install(Release::Previous).unwrap();
    assert_eq!(c.agent_status("n1").unwrap().agent_version, "");
    c.inject("n1", 0, 43).unwrap();
    let status = wait_for("the new task ends", LONG, || {
        new_task.try_wait().ok().flatten()
    })
    .unwrap();
    let text = std::fs::read_to_string(&new_out).unwrap();
    assert!(status.success(), "{text}");
    assert!(
        text.contains("restarting in place (1/3)")
            && text.contains("verified model: every byte is 9"),
        "this release's mpsr-run restarted its task through 0.1.0's agent: {text}"
    );
    assert!(not_drained(&c, "n1"));
}

/// A job's name and work directory are the user's: with a newline and `AdminComment=` in them,
/// the multi-line `scontrol show job` once gave the agent a forged comment, which root then wrote
/// into the job's real AdminComment, erasing the admin's note (issue 31). Read from squeue's one
/// field, the admin's note is kept and nothing the user wrote gets in.
#[test]
fn a_forged_admin_comment_in_a_jobs_name_or_workdir_never_reaches_slurm() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let forged = "w\n   AdminComment=forged by workdir";
    let wd = c.jobs().join(forged.replace("\\n", "\n"));
    std::fs::create_dir_all(&wd).unwrap();
    std::fs::set_permissions(&wd, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let id = c
        .sbatch(
            "nobody",
            &format!(
                "-w n1 -J \"$(printf 'x\\n   AdminComment=forged by name')\" -D \"$(printf '{}/{forged}')\" --gres=shard:1 --mps-resilient",
                c.jobs().display()
            ),
            &client_script(120, 1),
        )
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    assert_eq!(c.wait_registered("n1", id, 1).unwrap(), vec![0]);
    let show = c.cmd(&format!("scontrol show job {id}")).unwrap();
    assert!(
        String::from_utf8_lossy(&show.stdout).contains("\n   AdminComment=forged by name"),
        "the name does forge a line in scontrol's text (else this test proves nothing)"
    );
    c.cmd(&format!(
        "scontrol update JobId={id} AdminComment='site: billing 42'"
    ))
    .unwrap();
    c.inject("n1", 0, 31).unwrap();
    wait_for("the fault line", LONG, || {
        admin_comment(&c, id).contains("mpsr: fault").then_some(())
    })
    .unwrap();
    let comment = admin_comment(&c, id);
    assert!(
        comment.starts_with("site: billing 42 | mpsr: fault ") && !comment.contains("forged"),
        "AdminComment: {comment}"
    );
}

/// A fault while the agent is down (SIGKILLed 10 ms after the fault, started again at once): the
/// hit job is requeued once all the same, completes on its second run, and its report names the
/// fault (issue 31: it was lost, Restarts 0, "hit by 0 fault(s)").
#[test]
fn a_job_hit_while_the_agent_was_down_is_requeued_once_it_is_back() {
    let Some((_g, mut c)) = cluster(Options::default()) else {
        return;
    };
    let id = protected_batch_job(&c, 120);
    // The simulated driver reports an Xid 31 ~100 ms after it (as measured): the agent is gone
    // before the first line of it.
    c.inject("n1", 0, 31).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    c.stop_agent("n1", true);
    std::thread::sleep(Duration::from_millis(500));
    c.start_agent("n1").unwrap();
    wait_for("the requeue", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    assert_eq!(c.job_field(id, "Restarts"), "1", "requeued exactly once");
    let report = match c
        .agent_call("n1", &Request::JobReport { job_id: id })
        .unwrap()
    {
        Response::JobReport(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(report.faults.len(), 1, "{report:?}");
    assert!(report.faults[0].hit_jobs.contains(&id), "{report:?}");
    assert!(
        admin_comment(&c, id).contains("mpsr: fault"),
        "{}",
        admin_comment(&c, id)
    );
    assert!(not_drained(&c, "n1"));
}

/// GPU state kept for a requeued job waits for its next run (600 s by default); a job cancelled
/// while pending never comes back: its state is freed as soon as Slurm says it ended (issue 31).
#[test]
fn a_requeued_job_cancelled_while_pending_frees_its_kept_state() {
    use mpsr_proto::keeper::{KeeperRequest, KeeperResponse};
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let id = c
        .sbatch(
            "nobody",
            "-w n1 --gres=shard:1 --mps-resilient",
            &format!(
                "{}{}",
                keeps_state("ckpt", "4M", 5),
                client_script(120, 120)
            ),
        )
        .unwrap();
    c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
    c.wait_registered("n1", id, 1).unwrap();
    let sock = c.dir.join("n1/run/gpu0/keeper.sock");
    let kept = || {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        mpsr_proto::write_frame(&mut s, &KeeperRequest::Stats).ok()?;
        match mpsr_proto::read_frame(&mut s).ok()? {
            KeeperResponse::Stats { total_bytes, .. } => Some(total_bytes),
            _ => None,
        }
    };
    wait_for("the state kept", SHORT, || (kept()? > 0).then_some(())).unwrap();
    // Held, so it cannot start again here before it is cancelled.
    c.inject("n1", 0, 43).unwrap();
    wait_for("the requeue", LONG, || {
        (c.job_field(id, "Restarts") == "1").then_some(())
    })
    .unwrap();
    c.cmd(&format!("scontrol hold {id}")).unwrap();
    assert_eq!(kept(), Some(4 << 20), "kept for the next run");
    c.cmd(&format!("scancel {id}")).unwrap();
    wait_for("the kept state freed", LONG, || {
        (kept()? == 0).then_some(())
    })
    .unwrap();
}

/// A cluster with shards on some nodes and gres/mps on others (issue 31): Slurm 22.05 then gives a
/// shard step only `GPU_DEVICE_ORDINAL` (and `SLURM_SHARDS_ON_NODE`) for its GPU, and every
/// `--gres=shard:1 --mps-resilient` job failed with "needs GPUs". Both kinds are protected.
#[test]
fn shards_on_one_node_and_gres_mps_on_another_are_both_protected() {
    let Some((_g, c)) = cluster(Options {
        gres_mixed: true,
        ..Options::default()
    }) else {
        return;
    };
    let script = "env | grep -E '^(GPU_DEVICE_ORDINAL|CUDA_VISIBLE_DEVICES|SLURM_(STEP|JOB)_GPUS|SLURM_SHARDS_ON_NODE)=' | sort\n\
                  echo \"run ${SLURM_RESTART_COUNT:-0} gpu $MPSR_GPU\"\n\
                  if [ \"${SLURM_RESTART_COUNT:-0}\" -gt 0 ]; then s=1; else s=120; fi\n\
                  exec mpsr-simclient --seconds $s";
    let shard = c
        .sbatch("nobody", "-w n1 --gres=shard:1 --mps-resilient", script)
        .unwrap();
    let mps = c
        .sbatch("nobody", "-w n2 --gres=mps:50 --mps-resilient", script)
        .unwrap();
    for (id, node) in [(shard, "n1"), (mps, "n2")] {
        c.wait_job_state(id, &["RUNNING"], SHORT).unwrap();
        let gpus = c.wait_registered(node, id, 1).unwrap_or_else(|e| {
            panic!(
                "job {id} on {node} not registered: {e}; output: {}",
                c.job_output(id)
            )
        });
        assert_eq!(gpus.len(), 1, "{}", c.job_output(id));
        c.inject(node, gpus[0], 43).unwrap();
        wait_for(&format!("job {id} requeued"), LONG, || {
            (c.job_field(id, "Restarts") == "1").then_some(())
        })
        .unwrap();
    }
    for id in [shard, mps] {
        c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
        assert!(
            c.job_output(id).contains("run 1 gpu"),
            "{}",
            c.job_output(id)
        );
    }
}

/// The job's environment is the user's: a job submitted with `SLURM_RESTART_COUNT=4294967295`
/// overflowed the agent's requeue bookkeeping, and in the debug build its Slurm worker died, so
/// no job of any user on that node was requeued from then on (issue 31). Now Slurm's own count
/// (the prolog's) wins: the forger's job is requeued like any other, and so are the others after.
#[test]
fn a_forged_restart_count_neither_kills_the_slurm_worker_nor_skips_a_requeue() {
    let Some((_g, c)) = cluster(Options::default()) else {
        return;
    };
    let forged = c
        .sbatch_env(
            "nobody",
            "SLURM_RESTART_COUNT=4294967295",
            "-w n1 --gres=shard:1 --mps-resilient --mps-isolation=job",
            &client_script(120, 1),
        )
        .unwrap();
    c.wait_job_state(forged, &["RUNNING"], SHORT).unwrap();
    c.wait_registered("n1", forged, 1).unwrap();
    let d = attached_domain(&c, forged);
    c.inject_in("n1", d.gpu, 31, Some(d.slot)).unwrap();
    wait_for("the forger's job requeued", LONG, || {
        (c.job_field(forged, "Restarts") == "1").then_some(())
    })
    .unwrap();
    // The worker lives on: another job's fault is requeued too.
    let other = protected_batch_job(&c, 120);
    let d = attached_domain(&c, other);
    c.inject_in("n1", d.gpu, 43, Some(d.slot)).unwrap();
    wait_for("the next job requeued", LONG, || {
        (c.job_field(other, "Restarts") == "1").then_some(())
    })
    .unwrap();
    for id in [forged, other] {
        c.wait_job_state(id, &["COMPLETED"], LONG).unwrap();
    }
}
