//! `mpsr-detect-bench [--hours H] [--seeds N] [--sampling v0.2|fast] [--tsv] [--misses] [--cases]`: runs the labelled
//! cases through this build's detector and default rules and prints, per rule, recall (all cases,
//! and those lasting >= 30 s at >= 50 % duty), precision, time to detect p50/p95 and false alarms
//! per node-day. SIMULATED series: see the crate's documentation.

use mpsr_detect_bench::cases::{catalogue, Scale};
use mpsr_detect_bench::sampler::Sampling;
use mpsr_detect_bench::score::{percentile, score};
use mpsr_telemetry::{Detector, RULES};

fn main() {
    let mut hours = 72.0;
    let mut seeds = 3;
    let mut sampling = Sampling::FAST;
    let mut label = "fast".to_string();
    let mut tsv = false;
    let mut misses = false;
    let mut per_case = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--hours" => hours = args.next().and_then(|v| v.parse().ok()).unwrap_or(hours),
            "--seeds" => seeds = args.next().and_then(|v| v.parse().ok()).unwrap_or(seeds),
            "--sampling" => {
                label = args.next().unwrap_or_default();
                sampling = match label.as_str() {
                    "v0.2" => Sampling::V0_2,
                    "fast" => Sampling::FAST,
                    other => {
                        eprintln!("--sampling {other}: v0.2 (5 s rounds) or fast (1 s rounds)");
                        std::process::exit(2);
                    }
                }
            }
            "--tsv" => tsv = true,
            "--misses" => misses = true,
            "--cases" => per_case = true,
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    let cases = catalogue(Scale {
        seeds,
        healthy_hours: hours,
    });
    let rep = score(&cases, sampling, &|| Detector::new(RULES.to_vec()));
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    if !tsv {
        println!(
            "SIMULATED labelled detection benchmark: {} cases, {:.0} healthy node-hours, {} rounds ({} s each), {:.1} s",
            rep.cases, rep.healthy_hours, rep.ticks, sampling.interval_s, rep.seconds
        );
        println!(
            "{:<20} {:>6} {:>7} {:>9} {:>9} {:>7} {:>7} {:>9}",
            "rule", "cases", "recall", "recall>=30s", "precision", "ttd p50", "ttd p95", "FA/day"
        );
    }
    for (rule, s) in &rep.rules {
        let recall = s.found as f64 / s.cases.max(1) as f64;
        let goal = s.goal_found as f64 / s.goal_cases.max(1) as f64;
        let prec = s.right as f64 / (s.right + s.wrong).max(1) as f64;
        let line = [
            rule.clone(),
            s.cases.to_string(),
            if s.cases > 0 {
                format!("{recall:.2}")
            } else {
                "-".into()
            },
            if s.goal_cases > 0 {
                format!("{goal:.2}")
            } else {
                "-".into()
            },
            if s.right + s.wrong > 0 {
                format!("{prec:.2}")
            } else {
                "-".into()
            },
            fmt(percentile(&s.ttd, 0.5)),
            fmt(percentile(&s.ttd, 0.95)),
            format!("{:.1}", rep.false_alarms_per_day(s)),
        ];
        if tsv {
            println!("{label}\t{}", line.join("\t"));
        } else {
            println!(
                "{:<20} {:>6} {:>7} {:>9} {:>9} {:>7} {:>7} {:>9}",
                line[0], line[1], line[2], line[3], line[4], line[5], line[6], line[7]
            );
        }
    }
    if per_case {
        for (case, rule, ttd) in &rep.labels {
            println!(
                "case\t{case}\t{rule}\t{}",
                ttd.map_or("missed".into(), |t| format!("{t:.0}"))
            );
        }
    }
    if misses {
        for m in &rep.misses {
            println!("missed {m}");
        }
        for w in &rep.wrong {
            println!("false alarm {w}");
        }
    }
    if tsv {
        println!(
            "{label}\tALL\t-\t-\t-\t-\t-\t-\t{:.1}",
            rep.total_false_alarms_per_day()
        );
    } else {
        println!(
            "false alarms per node-day, all rules: {:.1}",
            rep.total_false_alarms_per_day()
        );
    }
}
