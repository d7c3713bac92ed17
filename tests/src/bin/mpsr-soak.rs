//! mpsr-soak: a long run of a busy node, printing numbers (not a test). A real Slurm on localhost,
//! one node with two SIMULATED GPUs, the agent; for the given time: job churn (short batch jobs in
//! shared, job and user domains), a fault every few seconds in a random occupied domain, an agent
//! restart (SIGTERM and SIGKILL in turn, never within 2 s of a fault: a fault while the agent is
//! down is not caught up on) every ten minutes, domains made and stopped as jobs come and go.
//! Every 30 s it samples the agent: RSS (and its anonymous part), open fds, threads, state-file, journal and history sizes,
//! decisions kept, registered tasks, domains, pending Slurm actions (CSV). At the end it checks
//! that no action was lost or doubled: every job completed (a hit job not requeued would fail),
//! and each job's Slurm restart count equals the successful `scontrol requeue` calls the agent made
//! for it.
//!
//!   mpsr-soak --minutes 120 --out target/soak [--restart-every 600]   (scripts/soak.sh plots it)

use mpsr_e2e::{Cluster, Options};
use mpsr_proto::{Request, Response};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

struct Args {
    minutes: f64,
    out: PathBuf,
    /// Seconds between agent restarts.
    restart_every: u64,
}

fn args() -> Args {
    let mut a = Args {
        minutes: 120.0,
        out: "target/soak".into(),
        restart_every: 600,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < v.len() {
        match v[i].as_str() {
            "--minutes" => a.minutes = v[i + 1].parse().unwrap_or(a.minutes),
            "--out" => a.out = v[i + 1].clone().into(),
            "--restart-every" => a.restart_every = v[i + 1].parse().unwrap_or(a.restart_every),
            _ => {}
        }
        i += 2;
    }
    a
}

/// A small deterministic generator (the run is reproducible).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn file_size(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn agent_pid(c: &Cluster) -> Option<u32> {
    let out = std::process::Command::new("pgrep")
        .args([
            "-f",
            &format!(
                "mpsr-agent --config {}",
                c.dir.join("n1/agent.toml").display()
            ),
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

fn proc_field(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(true) => {
            println!("SOAK OK");
            0.into()
        }
        Ok(false) => {
            println!("SOAK FAILED (see above)");
            1.into()
        }
        Err(e) => {
            eprintln!("mpsr-soak: {e}");
            1.into()
        }
    }
}

fn run() -> mpsr_e2e::Result<bool> {
    let a = args();
    std::fs::create_dir_all(&a.out)?;
    let mut csv = std::fs::File::create(a.out.join("soak.csv"))?;
    writeln!(
        csv,
        "minute,rss_kib,fds,threads,state_bytes,journal_bytes,history_bytes,telemetry_bytes,decisions,tasks,domains,pending,jobs_submitted,faults,rss_anon_kib,history_decisions"
    )?;
    println!(
        "=== mpsr-soak: {} min, real Slurm, SIMULATED GPUs ===",
        a.minutes
    );
    let mut c = Cluster::start(Options {
        nodes: vec!["n1".into()],
        log_scontrol: true,
        // Room for every placement the churn makes (4 shard jobs per GPU, each maybe in a domain
        // of its own, beside the shared and the user domain): a refusal at the cap would be the
        // workload's doing, not the agent's.
        agent_mps: "max_domains_per_gpu = 6".into(),
        ..Options::default()
    })?;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(a.minutes * 60.0);
    let mut rng = Lcg(7);
    let mut jobs: BTreeMap<u32, (String, String)> = BTreeMap::new(); // id -> (state, restarts)
    let mut faults = 0u64;
    let mut restarts_of_agent = 0u32;
    let mut last_fault = t0;
    let (mut next_fault, mut next_sample, mut next_restart) =
        (t0, t0, t0 + Duration::from_secs(a.restart_every));
    let isolations = ["", "--mps-isolation=job", "--mps-isolation=user"];
    while Instant::now() < end {
        // Churn: about eight jobs in flight, each 5-40 s.
        let active = jobs
            .values()
            .filter(|(s, _)| !matches!(s.as_str(), "COMPLETED" | "FAILED" | "CANCELLED"))
            .count();
        if active < 8 {
            let iso = isolations[rng.next(3) as usize];
            let secs = 5 + rng.next(36);
            let script = format!(
                "if [ \"${{SLURM_RESTART_COUNT:-0}}\" -gt 0 ]; then s=3; else s={secs}; fi; exec mpsr-simclient --seconds $s"
            );
            if let Ok(id) = c.sbatch(
                "nobody",
                &format!("-w n1 --gres=shard:1 --mps-resilient {iso}"),
                &script,
            ) {
                jobs.insert(id, (String::new(), String::new()));
            }
        }
        // A fault every 3-8 s in an occupied domain of a random GPU; none in the 2 s before an
        // agent restart: a fault while the agent is down is not caught up on (a known gap).
        let quiet = next_restart.saturating_duration_since(Instant::now()) < Duration::from_secs(2);
        if Instant::now() >= next_fault && !quiet {
            if let Ok(s) = c.agent_status("n1") {
                let g = rng.next(2) as u32;
                let occupied: Vec<u32> = s
                    .gpus
                    .iter()
                    .filter(|x| x.gpu == g)
                    .flat_map(|x| x.domains.iter())
                    .filter(|d| !d.clients.is_empty())
                    .map(|d| d.domain.slot)
                    .collect();
                if !occupied.is_empty() {
                    let slot = occupied[rng.next(occupied.len() as u64) as usize];
                    let xid = [31, 43, 13][rng.next(3) as usize];
                    if c.inject_in("n1", g, xid, Some(slot)).is_ok() {
                        faults += 1;
                        last_fault = Instant::now();
                    }
                }
            }
            next_fault = Instant::now() + Duration::from_millis(3000 + rng.next(5000));
        }
        if Instant::now() >= next_restart && last_fault.elapsed() >= Duration::from_secs(2) {
            restarts_of_agent += 1;
            let kill = restarts_of_agent.is_multiple_of(2);
            c.stop_agent("n1", kill);
            c.start_agent("n1")?;
            println!(
                "  t+{:.0} min: agent restarted ({})",
                t0.elapsed().as_secs_f64() / 60.0,
                if kill { "SIGKILL" } else { "SIGTERM" }
            );
            next_restart = Instant::now() + Duration::from_secs(a.restart_every);
            next_fault = next_fault.max(Instant::now() + Duration::from_secs(1));
        }
        for (id, st) in jobs.iter_mut() {
            if matches!(st.0.as_str(), "COMPLETED" | "FAILED" | "CANCELLED") {
                continue;
            }
            let info = c.job(*id);
            if let (Some(s), Some(r)) = (info.get("JobState"), info.get("Restarts")) {
                *st = (s.clone(), r.clone());
            }
        }
        if Instant::now() >= next_sample {
            sample(&c, &mut csv, t0, jobs.len(), faults)?;
            next_sample = Instant::now() + Duration::from_secs(30);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("=== churn over; waiting for the jobs in flight ===");
    let drain = Instant::now() + Duration::from_secs(300);
    loop {
        let mut open = 0;
        for (id, st) in jobs.iter_mut() {
            if matches!(st.0.as_str(), "COMPLETED" | "FAILED" | "CANCELLED") {
                continue;
            }
            let info = c.job(*id);
            if let (Some(s), Some(r)) = (info.get("JobState"), info.get("Restarts")) {
                *st = (s.clone(), r.clone());
            }
            open += 1;
        }
        if open == 0 || Instant::now() > drain {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    sample(&c, &mut csv, t0, jobs.len(), faults)?;
    // The agent's successful requeues per job, from its scontrol calls.
    let log = std::fs::read_to_string(c.dir.join("n1/scontrol.log")).unwrap_or_default();
    let mut requeues: BTreeMap<u32, u32> = BTreeMap::new();
    for l in log.lines() {
        let mut w = l.split_whitespace();
        if let (Some("0"), Some("requeue"), Some(id)) = (w.next(), w.next(), w.next()) {
            if let Ok(id) = id.parse() {
                *requeues.entry(id).or_default() += 1;
            }
        }
    }
    let mut ok = true;
    let (mut completed, mut hit) = (0, 0);
    for (id, (state, restarts)) in &jobs {
        let r: u32 = restarts.parse().unwrap_or(0);
        let calls = requeues.get(id).copied().unwrap_or(0);
        hit += u32::from(r > 0);
        completed += u32::from(state == "COMPLETED");
        if state != "COMPLETED" || r != calls {
            ok = false;
            println!(
                "  job {id}: {state}, Slurm Restarts={r}, agent requeues={calls}   <-- UNEXPECTED"
            );
        }
    }
    let events = match c.agent_call("n1", &Request::Events { limit: 10_000 })? {
        Response::Events { events, .. } => events.len(),
        _ => 0,
    };
    println!(
        "{} jobs: {completed} completed, {hit} requeued at least once; {faults} faults injected; {restarts_of_agent} agent restarts; {events} decisions kept",
        jobs.len()
    );
    println!("samples: {}", a.out.join("soak.csv").display());
    if !ok {
        c.keep_on_drop();
    }
    Ok(ok)
}

fn sample(
    c: &Cluster,
    csv: &mut std::fs::File,
    t0: Instant,
    jobs: usize,
    faults: u64,
) -> mpsr_e2e::Result<()> {
    let pid = agent_pid(c).unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let state = c.dir.join("n1/state");
    let s = c.agent_status("n1").ok();
    // Decisions one `events` answer carries (bounded by the frame size), and those the history
    // keeps on disk (bounded by faults.history).
    let decisions = match c.agent_call("n1", &Request::Events { limit: 10_000 }) {
        Ok(Response::Events { events, .. }) => events.len(),
        _ => 0,
    };
    let kept = std::fs::read(state.join("history.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<serde_json::Value>>(&b).ok())
        .map_or(0, |v| v.len());
    let line = format!(
        "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
        t0.elapsed().as_secs_f64() / 60.0,
        proc_field(pid, "VmRSS:"),
        fds,
        proc_field(pid, "Threads:"),
        file_size(&state.join("state.json")),
        file_size(&state.join("registry.journal")),
        file_size(&state.join("history.json")),
        file_size(&state.join("telemetry.json")),
        decisions,
        s.as_ref().map_or(0, |s| s.tasks.len()),
        s.as_ref()
            .map_or(0, |s| s.gpus.iter().map(|g| g.domains.len()).sum::<usize>()),
        s.as_ref().map_or(0, |s| s.pending_actions),
        jobs,
        faults,
        proc_field(pid, "RssAnon:"),
        kept
    );
    writeln!(csv, "{line}")?;
    println!("  {line}");
    Ok(())
}
