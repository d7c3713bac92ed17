//! The agent as a real process with the sim backend (tests/common), telemetry: stragglers, hardware findings through the health check, step times, /metrics and the Prometheus rules.

mod common;
use common::*;

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
