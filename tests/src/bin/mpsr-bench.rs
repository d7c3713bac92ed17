//! mpsr-bench: benchmarks that print numbers and assert nothing (results go to BENCHMARKS.md).
//!
//!   mpsr-bench register [N]   registration throughput against an agent (SIMULATED GPUs), 1 and 32
//!                             concurrent callers, each registration acknowledged only once durable
//!   mpsr-bench launch [N]     `srun true` step-launch time on the local Slurm: no plugin, plugin
//!                             loaded, plugin + --mps-resilient (interleaved, N each), as ratios
//!   mpsr-bench requeue [R]    injected fault -> Slurm shows the job requeued (R rounds of 4 jobs)
//!
//! Needs root and the Slurm packages for `launch` and `requeue` (same as the end-to-end tests).

use mpsr_e2e::{wait_for, Cluster, Options};
use mpsr_proto::{Client, Mode, Registration, Request, Response};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((q * v.len() as f64) as usize).min(v.len() - 1)]
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n = |d: usize| args.get(1).and_then(|s| s.parse().ok()).unwrap_or(d);
    let r = match args.first().map(String::as_str) {
        Some("register") => register(n(20_000)),
        Some("launch") => launch(n(50)),
        Some("requeue") => requeue(n(3)),
        _ => {
            eprintln!("usage: mpsr-bench register [N] | launch [N] | requeue [ROUNDS]");
            return 2.into();
        }
    };
    match r {
        Ok(()) => 0.into(),
        Err(e) => {
            eprintln!("mpsr-bench: {e}");
            1.into()
        }
    }
}

struct Agent {
    child: Child,
    dir: std::path::PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn register(total: usize) -> mpsr_e2e::Result<()> {
    let bin = mpsr_e2e::build_dir()?;
    let dir = std::env::temp_dir().join(format!("mpsr-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let d = dir.display();
    std::fs::write(
        dir.join("agent.toml"),
        format!("backend = \"sim\"\nsocket = \"{d}/run/agent.sock\"\nstate_dir = \"{d}/state\"\nrun_dir = \"{d}/run\"\n[log]\ntarget = \"stderr\"\nlevel = \"warn\"\n[slurm]\nscontrol = \"/bin/true\"\n[mps]\nquit_on_shutdown = true\n[faults]\nkmsg = false\n[keeper]\nenabled = false\n[sim]\ngpus = 8\n"),
    )?;
    let agent = Agent {
        child: Command::new(bin.join("mpsr-agent"))
            .arg("--config")
            .arg(dir.join("agent.toml"))
            .stderr(Stdio::null())
            .spawn()?,
        dir: dir.clone(),
    };
    let sock = dir.join("run/agent.sock");
    wait_for("agent", Duration::from_secs(10), || {
        Client::new(&sock, Duration::from_secs(1))
            .call(&Request::Status)
            .ok()
    })?;
    println!("registration throughput (agent with 8 SIMULATED GPUs; every reply only once the registration");
    println!("is fsynced; one connection per request, as the plugin makes them)");
    for (threads, churn) in [(1usize, false), (32, false), (32, true)] {
        let count = if threads == 1 { total / 10 } else { total };
        let next = Arc::new(AtomicU32::new(1_000_000 * (threads as u32 + churn as u32)));
        let t0 = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let next = next.clone();
                let sock = sock.clone();
                let per = count / threads;
                std::thread::spawn(move || -> Vec<f64> {
                    let _ = churn;
                    let c = Client::new(&sock, Duration::from_secs(10));
                    let me = std::process::id();
                    let mut lat = Vec::with_capacity(per);
                    for _ in 0..per {
                        let job = next.fetch_add(1, Ordering::Relaxed);
                        let t = Instant::now();
                        let r = c.call(&Request::Register(Registration {
                            job_id: job,
                            step_id: 0,
                            pid: me,
                            uid: None,
                            gpus: vec![job % 8],
                            mode: Mode::Requeue,
                            batch: true,
                            threads_pct: None,
                            mem_limit: None,
                            restart_count: 0,
                            isolation: None,
                        }));
                        lat.push(t.elapsed().as_secs_f64() * 1e6);
                        assert!(matches!(r, Ok(Response::Registered { .. })), "{r:?}");
                        // Steady state: the task registered 384 ago ends (a node's worth stays).
                        if churn && job >= 384 {
                            let _ = c.call(&Request::Deregister {
                                job_id: job - 384,
                                step_id: 0,
                                pid: me,
                                exit_status: Some(0),
                            });
                        }
                    }
                    lat
                })
            })
            .collect();
        let mut lat: Vec<f64> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect();
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "  {threads:>2} caller(s){}: {} registrations in {secs:.2} s = {:.0} registrations/s; latency p50 {:.0} us, p99 {:.0} us",
            if churn { ", each also deregistering an old task" } else { "" },
            lat.len(),
            lat.len() as f64 / secs,
            pct(&mut lat, 0.5),
            pct(&mut lat, 0.99)
        );
    }
    drop(agent);
    Ok(())
}

fn srun_time(c: &Cluster, flag: &str) -> mpsr_e2e::Result<f64> {
    let t = Instant::now();
    let o = c.cmd(&format!("srun -w n1 --gres=shard:1 {flag} true"))?;
    if !o.status.success() {
        return Err(format!(
            "srun {flag} true failed: {}",
            String::from_utf8_lossy(&o.stderr)
        )
        .into());
    }
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

fn launch(n: usize) -> mpsr_e2e::Result<()> {
    let c = Cluster::start(Options {
        nodes: vec!["n1".into()],
        ..Options::default()
    })?;
    let with_plugin = std::fs::read_to_string(c.dir.join("etc/plugstack.conf"))?;
    let set = |on: bool| {
        std::fs::write(
            c.dir.join("etc/plugstack.conf"),
            if on {
                with_plugin.as_str()
            } else {
                "# mps-resilient plugin off for this launch\n"
            },
        )
    };
    // Warm up every variant once.
    set(false)?;
    srun_time(&c, "")?;
    set(true)?;
    srun_time(&c, "")?;
    srun_time(&c, "--mps-resilient")?;
    let (mut none, mut loaded, mut used) = (Vec::new(), Vec::new(), Vec::new());
    // Rotate which variant goes first, so none of them always follows a plugstack rewrite.
    for i in 0..n {
        for v in 0..3 {
            match (i + v) % 3 {
                0 => {
                    set(false)?;
                    none.push(srun_time(&c, "")?);
                }
                1 => {
                    set(true)?;
                    loaded.push(srun_time(&c, "")?);
                }
                _ => {
                    set(true)?;
                    used.push(srun_time(&c, "--mps-resilient")?);
                }
            }
        }
    }
    let (a, b, u) = (mean(&none), mean(&loaded), mean(&used));
    println!("step launch: `srun -w n1 --gres=shard:1 true` on the local Slurm (SIMULATED GPUs), {n} launches each, interleaved");
    println!(
        "  no plugin:                 mean {a:.1} ms, p50 {:.1} ms",
        pct(&mut none, 0.5)
    );
    println!(
        "  plugin loaded, no flag:    mean {b:.1} ms, p50 {:.1} ms   ratio {:.3}",
        pct(&mut loaded, 0.5),
        b / a
    );
    println!(
        "  plugin + --mps-resilient:  mean {u:.1} ms, p50 {:.1} ms   ratio {:.3}",
        pct(&mut used, 0.5),
        u / a
    );
    Ok(())
}

fn requeue(rounds: usize) -> mpsr_e2e::Result<()> {
    let c = Cluster::start(Options {
        nodes: vec!["n1".into()],
        ..Options::default()
    })?;
    let mut samples = Vec::new();
    for round in 0..rounds {
        let ids: Vec<u32> = (0..4)
            .map(|_| {
                c.sbatch(
                    "nobody",
                    "-w n1 --gres=shard:1 --mps-resilient",
                    "exec mpsr-simclient --seconds 300",
                )
            })
            .collect::<Result<_, _>>()?;
        for &id in &ids {
            c.wait_job_state(id, &["RUNNING"], Duration::from_secs(60))?;
            c.wait_registered("n1", id, 1)?;
        }
        wait_for("clients attached", Duration::from_secs(30), || {
            (c.clients("n1", 0).len() == 4).then_some(())
        })?;
        let t0 = Instant::now();
        c.inject("n1", 0, 31)?;
        let mut pending: Vec<u32> = ids.clone();
        while !pending.is_empty() && t0.elapsed() < Duration::from_secs(60) {
            pending.retain(|&id| {
                if c.job_field(id, "Restarts") == "1" {
                    samples.push(t0.elapsed().as_secs_f64() * 1000.0);
                    false
                } else {
                    true
                }
            });
        }
        println!("  round {round}: {} of 4 jobs requeued", 4 - pending.len());
        let _ = c.cmd(&format!(
            "scancel {}",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        ));
        std::thread::sleep(Duration::from_secs(2));
    }
    println!(
        "fault -> `scontrol show job` shows Restarts=1 (SIMULATED Xid 31, 4 jobs per fault, {} samples): mean {:.0} ms, p50 {:.0} ms, max {:.0} ms",
        samples.len(),
        mean(&samples),
        pct(&mut samples, 0.5),
        samples.iter().cloned().fold(0.0, f64::max)
    );
    Ok(())
}
