//! mpsr-demo: the README's demo. A real Slurm on localhost (slurmctld + slurmd + the mps-resilient
//! plugin, prolog, epilog) and the node agent with two SIMULATED GPUs. Jobs share the GPUs through
//! MPS; an Xid 31 hits GPU 0; the timeline shows fault -> hit jobs -> actions -> outcome, and the
//! jobs on GPU 1 run on untouched. Exits 0 and prints "DEMO OK" when everything happened as it should.

use mpsr_e2e::{wait_for, Cluster, Options};
use mpsr_proto::{Request, Response};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

struct Job {
    id: u32,
    label: &'static str,
    gpu: u32,
    /// srun jobs are watched through their srun process.
    srun: Option<(std::process::Child, std::path::PathBuf)>,
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

fn client(first_s: u32) -> String {
    format!(
        "if [ \"${{SLURM_RESTART_COUNT:-0}}\" -gt 0 ]; then s=3; else s={first_s}; fi; exec mpsr-simclient --seconds $s"
    )
}

fn run() -> mpsr_e2e::Result<bool> {
    println!(
        "=== mps-resilient demo: real Slurm on localhost, SIMULATED GPUs (no real GPU is used) ==="
    );
    let t_start = Instant::now();
    let c = Cluster::start(Options {
        nodes: vec!["node1".into()],
        ..Options::default()
    })?;
    println!(
        "Slurm cluster up in {:.1} s: slurmctld + slurmd 'node1' with 2 simulated GPUs (4 MPS shards each),\n\
         plugin {} in plugstack.conf, node agent {}",
        t_start.elapsed().as_secs_f64(),
        c.bin.join("mps_resilient.so").display(),
        c.agent_socket("node1").display()
    );
    let mut jobs: Vec<Job> = Vec::new();
    let user = "nobody";
    println!("\n--- user '{user}' submits jobs that share the GPUs through MPS ---");
    for label in ["train-a", "train-b", "train-c"] {
        let id = c.sbatch(
            user,
            &format!("-w node1 -J {label} --gres=shard:1 --mps-resilient=requeue"),
            &client(120),
        )?;
        println!("$ sbatch -J {label} --gres=shard:1 --mps-resilient=requeue job.sh   -> job {id}");
        jobs.push(Job {
            id,
            label,
            gpu: 0,
            srun: None,
        });
    }
    let out = c.jobs().join("serve.out");
    let child = c.spawn_as(
        user,
        "srun -u -w node1 -J serve --gres=shard:1 --mps-resilient=resume mpsr-run -- sh -c 'echo serve attempt $MPSR_RESTARTS; exec mpsr-simclient --seconds $([ $MPSR_RESTARTS = 0 ] && echo 120 || echo 3)'",
        &out,
    )?;
    println!("$ srun -J serve --gres=shard:1 --mps-resilient=resume mpsr-run -- ./serve   (interactive: Slurm cannot requeue it)");
    let serve = wait_for("srun job to start", Duration::from_secs(30), || {
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
        srun: Some((child, out)),
    });
    for j in &jobs {
        c.wait_job_state(j.id, &["RUNNING"], Duration::from_secs(30))?;
        c.wait_registered("node1", j.id, 1)?;
    }
    // GPU 0's shards are taken: these two land on GPU 1.
    for (label, shards) in [("infer-x", 2), ("infer-y", 2)] {
        let id = c.sbatch(
            user,
            &format!("-w node1 -J {label} --gres=shard:{shards} --mps-resilient=requeue"),
            &client(40),
        )?;
        println!("$ sbatch -J {label} --gres=shard:{shards} --mps-resilient=requeue job.sh   -> job {id}");
        jobs.push(Job {
            id,
            label,
            gpu: 1,
            srun: None,
        });
    }
    for j in &jobs {
        c.wait_job_state(j.id, &["RUNNING"], Duration::from_secs(30))?;
        let gpus = c.wait_registered("node1", j.id, 1)?;
        if gpus != vec![j.gpu] {
            println!("unexpected placement: job {} on GPU {gpus:?}", j.id);
            return Ok(false);
        }
    }
    wait_for(
        "all 6 simulated MPS clients attached",
        Duration::from_secs(30),
        || (c.clients("node1", 0).len() == 4 && c.clients("node1", 1).len() == 2).then_some(()),
    )?;
    println!("\n--- running (agent's view: each job's MPS client on its GPU's own MPS server) ---");
    let s = c.agent_status("node1")?;
    for g in &s.gpus {
        let on: Vec<String> = jobs
            .iter()
            .filter(|j| j.gpu == g.gpu)
            .map(|j| format!("{} ({})", j.id, j.label))
            .collect();
        println!(
            "  gpu{} [SIMULATED] MPS server {:?}, clients {:?}: jobs {}",
            g.gpu,
            g.state,
            g.clients,
            on.join(", ")
        );
    }
    let gpu1_clients = c.clients("node1", 1);

    println!("\n>>> t=0: Xid 31 (illegal memory access, MMU fault) on gpu0 [SIMULATED]");
    let t0 = Instant::now();
    let killed = c.inject("node1", 0, 31)?;
    println!(
        "    stock MPS: the fault kills every client with work in flight on gpu0: pids {killed:?}"
    );

    // Watch Slurm's state of every job and print each change with its time.
    let mut seen: BTreeMap<u32, (String, String)> = BTreeMap::new();
    let mut restarted_serve = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
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
        if restarted_serve.is_none() {
            if let Some((_, out)) = jobs
                .iter()
                .find(|j| j.id == serve)
                .and_then(|j| j.srun.as_ref())
            {
                if std::fs::read_to_string(out)
                    .unwrap_or_default()
                    .contains("serve attempt 1")
                {
                    let t = t0.elapsed();
                    println!(
                        "  t+{:>5.2}s  job {serve} (serve, gpu0): task restarted in place by mpsr-run (server ACTIVE again)",
                        t.as_secs_f64()
                    );
                    restarted_serve = Some(t);
                }
            }
        }
        let done = jobs
            .iter()
            .filter(|j| j.gpu == 0)
            .all(|j| seen.get(&j.id).is_some_and(|s| s.0 == "COMPLETED"));
        if done || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    println!("\n=== the agent's decision (mpsrctl events) ===");
    if let Response::Events { events, .. } =
        c.agent_call("node1", &Request::Events { limit: 10 })?
    {
        for e in &events {
            println!("{e}");
        }
        println!(
            "(kernel-pid: the pid the kernel's Xid line named; wrong under MPS, never blamed)"
        );
    }

    println!("\n=== outcome per job (Slurm's own state) ===");
    let mut ok = true;
    for j in &jobs {
        let info = c.job(j.id);
        let state = info.get("JobState").cloned().unwrap_or_default();
        let restarts = info.get("Restarts").cloned().unwrap_or_default();
        let (want_state, want_restarts, what) = match (j.gpu, j.srun.is_some()) {
            (0, false) => (
                "COMPLETED",
                "1",
                "hit: requeued by Slurm, completed on its second run",
            ),
            (0, true) => (
                "RUNNING|COMPLETED",
                "0",
                "hit: restarted in place (srun jobs cannot be requeued)",
            ),
            _ => ("RUNNING|COMPLETED", "0", "not hit: never touched"),
        };
        let good = want_state.split('|').any(|s| s == state) && restarts == want_restarts;
        ok &= good;
        println!(
            "  job {:>3} {:<8} gpu{}  {:<10} Restarts={}  {}{}",
            j.id,
            j.label,
            j.gpu,
            state,
            restarts,
            what,
            if good { "" } else { "   <-- UNEXPECTED" }
        );
    }
    if c.clients("node1", 1) != gpu1_clients {
        println!(
            "  gpu1's MPS clients changed: {:?} -> {:?}   <-- UNEXPECTED",
            gpu1_clients,
            c.clients("node1", 1)
        );
        ok = false;
    } else {
        println!(
            "  gpu1's MPS clients are the same processes as before the fault: {gpu1_clients:?}"
        );
    }
    ok &= restarted_serve.is_some();
    let node = c.node("node1");
    let drained = node.get("State").is_some_and(|s| s.contains("DRAIN"));
    println!(
        "  node1: {} (an application fault never drains a node)",
        node.get("State").cloned().unwrap_or_default()
    );
    ok &= !drained;
    if let Some(t) = restarted_serve {
        println!(
            "\nfault -> interactive task running again in place: {} ms",
            t.as_millis()
        );
    }
    let first = jobs[0].id;
    let report = std::fs::read_to_string(c.dir.join(format!("node1/reports/{first}.txt")))
        .unwrap_or_else(|_| "(no report written)".into());
    println!(
        "\n=== fault report of job {first}, written by the epilog ===\n{}",
        report.trim_end()
    );
    Ok(ok)
}
