//! mpsr-demo: the README's demo, the product's story in about a minute. A real Slurm on localhost
//! (slurmctld + slurmd + the mps-resilient plugin, prolog, epilog) and the node agent with two
//! SIMULATED GPUs (faults show at the times measured on an H200; the simulated kernel module
//! carries the driver patch's containment).
//!
//! GPU 0: two training jobs share the GPU's shared MPS server with an interactive `serve` task
//! that keeps a hot standby; a fourth job runs in an MPS server of its own. A neighbour's SM
//! exception (Xid 43) in the shared server: the training jobs are requeued by Slurm, `serve`'s
//! standby takes over without a restart, the job in its own server never notices.
//! GPU 1: a buggy job's MMU fault (Xid 31) is contained by the (simulated) driver patch: only the
//! culprit fails, the job beside it in the same server runs on.
//! Then what users and admins see: Slurm's own view of each job (its AdminComment line), a job's
//! report, the agent's decisions. Exits 0 and prints "DEMO OK" when everything happened as it
//! should.

use mpsr_e2e::{wait_for, Cluster, Options};
use mpsr_proto::{FaultOutcome, Request, Response};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const USER: &str = "nobody";
const WAIT: Duration = Duration::from_secs(60);

/// What should become of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Hit: requeued by Slurm, completes on its second run.
    Requeued,
    /// Hit: its hot standby took over (no restart, Restarts=0).
    TookOver,
    /// Not hit: its process runs on.
    Untouched,
    /// The culprit of a contained fault: failed, nobody else touched.
    Culprit,
}

struct Job {
    id: u32,
    label: &'static str,
    gpu: u32,
    how: &'static str,
    fate: Fate,
}

/// Whether the agent recorded that a standby took over a task of `job` (its decision record's
/// typed outcome, not the words mpsr-run prints).
fn standby_took_over(c: &Cluster, job: u32) -> bool {
    matches!(
        c.agent_call("node1", &Request::Events { limit: 50 }),
        Ok(Response::Events { events, .. }) if events.iter().any(|e| e.outcomes.iter().any(
            |o| matches!(o, FaultOutcome::StandbyTookOver { job: j, .. } if *j == job)
        ))
    )
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(true) => {
            println!("\nDEMO OK");
            0.into()
        }
        Ok(false) => {
            println!("\nDEMO FAILED (see above)");
            1.into()
        }
        Err(e) => {
            eprintln!("mpsr-demo: {e}");
            1.into()
        }
    }
}

/// A batch job's script: a simulated MPS client, long on the first run, short on a requeued one.
fn client(first_s: u32) -> String {
    format!(
        "if [ \"${{SLURM_RESTART_COUNT:-0}}\" -gt 0 ]; then s=3; else s={first_s}; fi; exec mpsr-simclient --seconds $s"
    )
}

fn sbatch(c: &Cluster, label: &str, opts: &str, secs: u32) -> mpsr_e2e::Result<u32> {
    let id = c.sbatch(USER, &format!("-w node1 -J {label} {opts}"), &client(secs))?;
    println!("$ sbatch -J {label} {opts} job.sh   -> job {id}");
    Ok(id)
}

fn run() -> mpsr_e2e::Result<bool> {
    println!(
        "=== mps-resilient demo: real Slurm on localhost, SIMULATED GPUs (no real GPU is used) ==="
    );
    let t_start = Instant::now();
    let c = Cluster::start(Options {
        nodes: vec!["node1".into()],
        // The simulated kernel module carries the driver patch's containment (driver-patch/).
        agent_extra: "driver_patch = \"containment\"\n".into(),
        ..Options::default()
    })?;
    println!(
        "Slurm cluster up in {:.1} s: slurmctld + slurmd 'node1' with 2 SIMULATED GPUs (4 MPS shards each),\n\
         the plugin in plugstack.conf, the node agent at {}",
        t_start.elapsed().as_secs_f64(),
        c.agent_socket("node1").display()
    );

    println!("\n--- user '{USER}' submits jobs that share GPU 0 through MPS ---");
    let mut jobs = Vec::new();
    for label in ["train-a", "train-b"] {
        let id = sbatch(&c, label, "--gres=shard:1 --mps-resilient", 120)?;
        jobs.push(Job {
            id,
            label,
            gpu: 0,
            how: "shared server",
            fate: Fate::Requeued,
        });
    }
    let id = sbatch(
        &c,
        "safe",
        "--gres=shard:1 --mps-resilient --mps-isolation=job",
        40,
    )?;
    jobs.push(Job {
        id,
        label: "safe",
        gpu: 0,
        how: "a server of its own",
        fate: Fate::Untouched,
    });
    let serve_out = c.jobs().join("serve.out");
    let mut serve_srun = c.spawn_as(
        USER,
        "srun -u -w node1 -J serve --gres=shard:1 --mps-resilient=resume --mps-standby mpsr-run -- sh -c 'echo \"serve: $MPSR_ROLE ready\"; exec mpsr-simclient --seconds 25'",
        &serve_out,
    )?;
    println!("$ srun -J serve --gres=shard:1 --mps-resilient=resume --mps-standby mpsr-run -- ./serve   (interactive, with a hot standby)");
    let serve = wait_for("the serve job to start", Duration::from_secs(30), || {
        let o = c.cmd("squeue -h -n serve -o %i").ok()?;
        String::from_utf8_lossy(&o.stdout)
            .trim()
            .parse::<u32>()
            .ok()
    })?;
    jobs.push(Job {
        id: serve,
        label: "serve",
        gpu: 0,
        how: "shared server, standby in another",
        fate: Fate::TookOver,
    });
    println!("\n--- and GPU 1 (its shards are the rest) ---");
    let infer = sbatch(&c, "infer", "--gres=shard:2 --mps-resilient", 40)?;
    jobs.push(Job {
        id: infer,
        label: "infer",
        gpu: 1,
        how: "shared server",
        fate: Fate::Untouched,
    });
    let buggy = sbatch(&c, "buggy", "--gres=shard:2 --mps-resilient", 120)?;
    jobs.push(Job {
        id: buggy,
        label: "buggy",
        gpu: 1,
        how: "shared server",
        fate: Fate::Culprit,
    });
    for j in &jobs {
        c.wait_job_state(j.id, &["RUNNING"], Duration::from_secs(30))?;
        let gpus = c.wait_registered("node1", j.id, 1)?;
        if gpus != vec![j.gpu] {
            println!("unexpected placement: job {} on GPU {gpus:?}", j.id);
            return Ok(false);
        }
    }
    // Everyone's simulated CUDA client attached, and serve's standby armed.
    let status = wait_for("every client attached, the standby armed", WAIT, || {
        let s = c.agent_status("node1").ok()?;
        // Six jobs' clients and serve's standby.
        let clients: usize = s
            .gpus
            .iter()
            .flat_map(|g| g.domains.iter())
            .map(|d| d.clients.len())
            .sum();
        let attached = clients == jobs.len() + 1;
        let armed = s
            .tasks
            .iter()
            .any(|t| t.job_id == serve && t.standby.is_some());
        (attached && armed).then_some(s)
    })?;
    println!("\n--- running: the agent's fault domains (one MPS server each) ---");
    for g in &status.gpus {
        for d in &g.domains {
            let on: Vec<String> = jobs
                .iter()
                .filter(|j| d.jobs.contains(&j.id))
                .map(|j| format!("{} ({})", j.id, j.label))
                .collect();
            let standbys: Vec<String> = status
                .tasks
                .iter()
                .filter(|t| t.standby.is_some_and(|(_, sd)| sd == d.domain))
                .map(|t| format!("standby of {}", t.job_id))
                .collect();
            println!(
                "  {} [SIMULATED] {:<8} {:?}: {}",
                d.domain,
                d.tenancy,
                d.state,
                on.into_iter()
                    .chain(standbys)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let safe = jobs[2].id;
    let pids = |job: u32| -> Vec<u32> {
        c.agent_status("node1")
            .map(|s| {
                s.tasks
                    .iter()
                    .filter(|t| t.job_id == job)
                    .map(|t| t.pid)
                    .collect()
            })
            .unwrap_or_default()
    };
    let (safe_pids, infer_pids) = (pids(safe), pids(infer));

    println!(
        "\n>>> t=0: a neighbour's SM exception (Xid 43) in gpu0's shared MPS server [SIMULATED]"
    );
    let t0 = Instant::now();
    let killed = c.inject_in("node1", 0, 43, Some(0))?;
    println!("    stock MPS: it kills every busy client of that server: pids {killed:?}");
    let buggy_pid = pids(buggy).first().copied().unwrap_or(0);
    let mut contained_at = None;
    let mut seen: BTreeMap<u32, (String, String)> = BTreeMap::new();
    let mut took_over = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        // Act 2, once act 1 is under way: the buggy job's MMU fault, contained.
        if contained_at.is_none() && t0.elapsed() > Duration::from_secs(2) {
            println!(
                "\n>>> t+{:.2}s: job {buggy} (buggy) stores to an unmapped address on gpu1 (Xid 31); the driver patch contains it [SIMULATED]",
                t0.elapsed().as_secs_f64()
            );
            let k = c.inject_culprit("node1", 1, 31, buggy_pid)?;
            println!("    nobody dies of it: killed {k:?}; the agent ends the culprit's client\n");
            contained_at = Some(t0.elapsed());
        }
        for j in &jobs {
            let info = c.job(j.id);
            let st = (
                info.get("JobState").cloned().unwrap_or_default(),
                info.get("Restarts").cloned().unwrap_or_default(),
            );
            if seen.get(&j.id) != Some(&st) {
                if seen.contains_key(&j.id) {
                    println!(
                        "  t+{:>5.2}s  job {} ({}, gpu{}): {} (Restarts={})",
                        t0.elapsed().as_secs_f64(),
                        j.id,
                        j.label,
                        j.gpu,
                        st.0,
                        st.1
                    );
                }
                seen.insert(j.id, st);
            }
        }
        if took_over.is_none() && standby_took_over(&c, serve) {
            took_over = Some(t0.elapsed());
            println!(
                "  t+{:>5.2}s  job {serve} (serve, gpu0): its hot standby took over, no restart",
                t0.elapsed().as_secs_f64()
            );
        }
        let state = |id: u32| seen.get(&id).map(|s| s.0.as_str()).unwrap_or("");
        let done = jobs.iter().all(|j| match j.fate {
            Fate::Requeued => state(j.id) == "COMPLETED",
            Fate::Culprit => state(j.id) == "FAILED",
            Fate::TookOver => took_over.is_some(),
            Fate::Untouched => true,
        });
        if done || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    println!("\n=== outcome per job (Slurm's own state) ===");
    let mut ok = true;
    for j in &jobs {
        let info = c.job(j.id);
        let state = info.get("JobState").cloned().unwrap_or_default();
        let restarts = info.get("Restarts").cloned().unwrap_or_default();
        let (want_state, want_restarts, what) = match j.fate {
            Fate::Requeued => (
                "COMPLETED",
                "1",
                "hit: requeued by Slurm, completed on its second run",
            ),
            Fate::TookOver => (
                "RUNNING|COMPLETED",
                "0",
                "hit: its hot standby took over in place",
            ),
            Fate::Untouched => (
                "RUNNING|COMPLETED",
                "0",
                "not hit: the same process runs on",
            ),
            Fate::Culprit => (
                "FAILED",
                "0",
                "the culprit of a contained fault: failed alone",
            ),
        };
        let mut good = want_state.split('|').any(|s| s == state) && restarts == want_restarts;
        if j.fate == Fate::TookOver {
            good &= took_over.is_some();
        }
        ok &= good;
        println!(
            "  job {:>3} {:<8} gpu{} {:<34} {:<10} Restarts={}  {}{}",
            j.id,
            j.label,
            j.gpu,
            j.how,
            state,
            restarts,
            what,
            if good { "" } else { "   <-- UNEXPECTED" }
        );
    }
    for (label, job, before) in [("safe", safe, &safe_pids), ("infer", infer, &infer_pids)] {
        let now = pids(job);
        let same = now == *before || c.job_field(job, "JobState") == "COMPLETED";
        println!(
            "  {label}'s task: {}",
            if same {
                format!("the same process as before the faults ({before:?})")
            } else {
                format!("changed {before:?} -> {now:?}   <-- UNEXPECTED")
            }
        );
        ok &= same;
    }
    let node = c.node("node1");
    let drained = node.get("State").is_some_and(|s| s.contains("DRAIN"));
    println!(
        "  node1: {} (application faults never drain a node)",
        node.get("State").cloned().unwrap_or_default()
    );
    ok &= !drained;
    if let Some(t) = took_over {
        println!(
            "\nfault -> serve computing again through its standby: {} ms (as mpsr-run saw it; SIMULATED timing, see BENCHMARKS.md for the H200)",
            t.as_millis()
        );
    }

    println!("\n=== what the users see in Slurm: scontrol show job <id> | grep AdminComment ===");
    for j in &jobs {
        let comment = c.admin_comment(j.id);
        if !comment.is_empty() {
            println!("  job {} ({}): AdminComment={comment}", j.id, j.label);
        }
        if matches!(j.fate, Fate::Requeued | Fate::Culprit) && !comment.contains("mpsr: fault") {
            println!(
                "  job {} ({}): no fault line   <-- UNEXPECTED",
                j.id, j.label
            );
            ok = false;
        }
    }
    let first = jobs[0].id;
    println!("\n=== mpsrctl report {first} (the job's owner may run it) ===");
    if let Response::JobReport(r) = c.agent_call("node1", &Request::JobReport { job_id: first })? {
        for f in &r.faults {
            println!("  {f}");
        }
        for a in &r.actions {
            println!("  - {a}");
        }
    }
    println!("\n=== the agent's decisions (mpsrctl events) ===");
    if let Response::Events { events, .. } =
        c.agent_call("node1", &Request::Events { limit: 10 })?
    {
        for e in &events {
            println!("{e}");
        }
    }
    let _ = serve_srun.kill();
    let _ = serve_srun.wait();
    println!(
        "\nRead next in README.md: \"Choosing an isolation (fault domains)\", \"Hot standby\", \
         \"Keeping GPU state across faults\", \"Install (sysadmins)\"; the H200 figures: BENCHMARKS.md."
    );
    if !ok {
        let log = std::fs::read_to_string(c.dir.join("node1/agent.log")).unwrap_or_default();
        println!("\n=== the agent's log (the demo went wrong) ===");
        for l in log
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            println!("{l}");
        }
    }
    Ok(ok)
}
