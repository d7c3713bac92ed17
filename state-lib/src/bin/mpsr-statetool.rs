//! mpsr-statetool: attach, fill, verify and checkpoint kept state from the command line (tests,
//! the demo, and checking a node by hand). Runs inside a job (MPSR_KEEPER_SOCKET set).
//!
//!   mpsr-statetool NAME BYTES [--before-cuda] [--fill B] [--verify B] [--checkpoint] [--hold SECS] [--ready] [--release]
//!
//! The steps run in the order given (`--fill 3 --checkpoint --verify 3`).

use clap::{Arg, ArgAction, ArgMatches, Command};
use std::process::ExitCode;

fn command() -> Command {
    Command::new("mpsr-statetool")
        .version(env!("CARGO_PKG_VERSION"))
        .about("Attach, fill, verify and checkpoint GPU state kept by the mps-resilient keeper")
        .long_about("Attaches the named allocation of BYTES (creating it, or getting back what the keeper kept across a fault or a requeue), then runs the steps in the order given. Runs inside a Slurm job whose tasks are registered with the agent (MPSR_KEEPER_SOCKET set by the plugin). Exit status 1 when a step fails (a --verify that finds other bytes included).")
        .arg(Arg::new("name").value_name("NAME").required(true).help("Allocation name (per job)"))
        .arg(
            Arg::new("bytes")
                .value_name("BYTES")
                .required(true)
                .value_parser(|v: &str| mpsr_proto::parse_size(v).ok_or(format!("'{v}' is not a size (e.g. 4M)")))
                .help("Its size (e.g. 8M, 2G)"),
        )
        .arg(step("fill", "B", "Fill every byte with B (0-255)").value_parser(clap::value_parser!(u8)))
        .arg(step("verify", "B", "Check every byte is B; fails otherwise").value_parser(clap::value_parser!(u8)))
        .arg(Arg::new("checkpoint").long("checkpoint").action(ArgAction::Count).help("Snapshot it to the host now"))
        .arg(step("hold", "SECS", "Keep it attached this long").value_parser(clap::value_parser!(f64)))
        .arg(Arg::new("before-cuda").long("before-cuda").action(ArgAction::SetTrue).help("Warm standby: wait here, before the attach (no CUDA context yet), until this standby takes over (returns at once in a primary)"))
        .arg(Arg::new("ready").long("ready").action(ArgAction::Count).help("Hot standby: wait here until this standby takes over (returns at once in a primary)"))
        .arg(Arg::new("release").long("release").action(ArgAction::Count).help("Free it (the keeper forgets it)"))
}

fn step(name: &'static str, value: &'static str, help: &'static str) -> Arg {
    Arg::new(name)
        .long(name)
        .value_name(value)
        .action(ArgAction::Append)
        .help(help)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    Fill(u8),
    Verify(u8),
    Checkpoint,
    Hold(f64),
    Ready,
    Release,
}

/// The steps in the order they were given on the command line.
fn steps(m: &ArgMatches) -> Vec<Step> {
    let mut out: Vec<(usize, Step)> = Vec::new();
    let mut valued = |id: &str, f: &dyn Fn(&ArgMatches, usize) -> Step| {
        // Only what was typed: a flag's default (a count of 0) has an index too.
        if m.value_source(id) != Some(clap::parser::ValueSource::CommandLine) {
            return;
        }
        if let Some(ix) = m.indices_of(id) {
            out.extend(ix.enumerate().map(|(n, i)| (i, f(m, n))));
        }
    };
    valued("fill", &|m, n| {
        Step::Fill(*m.get_many::<u8>("fill").unwrap().nth(n).unwrap())
    });
    valued("verify", &|m, n| {
        Step::Verify(*m.get_many::<u8>("verify").unwrap().nth(n).unwrap())
    });
    valued("hold", &|m, n| {
        Step::Hold(*m.get_many::<f64>("hold").unwrap().nth(n).unwrap())
    });
    valued("checkpoint", &|_, _| Step::Checkpoint);
    valued("ready", &|_, _| Step::Ready);
    valued("release", &|_, _| Step::Release);
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, s)| s).collect()
}

fn main() -> ExitCode {
    mpsr_manpage::print_if_asked(command());
    let m = command().get_matches();
    let name = m.get_one::<String>("name").expect("required").as_str();
    let bytes = *m.get_one::<u64>("bytes").expect("required");
    if m.get_flag("before-cuda") {
        match mpsr_proto::standby::before_cuda() {
            Ok(mpsr_proto::standby::Ready::Primary) => println!("before cuda: primary"),
            Ok(mpsr_proto::standby::Ready::TookOver) => println!("before cuda: took over"),
            Err(e) => {
                eprintln!("mpsr-statetool: before cuda: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let a = match mpsr_state::attach(name, bytes) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mpsr-statetool: attach {name}: {e}");
            return ExitCode::from(1);
        }
    };
    println!(
        "attached {name} {} bytes origin={:?} kind={:?}",
        a.bytes, a.origin, a.kind
    );
    for step in steps(&m) {
        match step {
            Step::Fill(b) => {
                if let Err(e) = mpsr_state::fill(name, b) {
                    eprintln!("mpsr-statetool: fill: {e}");
                    return ExitCode::from(1);
                }
                println!("filled {name} with {b}");
            }
            Step::Verify(b) => match mpsr_state::verify(name, b) {
                Ok(true) => println!("verified {name}: every byte is {b}"),
                Ok(false) => {
                    println!("VERIFY FAILED {name}: not every byte is {b}");
                    return ExitCode::from(1);
                }
                Err(e) => {
                    eprintln!("mpsr-statetool: verify: {e}");
                    return ExitCode::from(1);
                }
            },
            Step::Checkpoint => match mpsr_state::checkpoint(Some(name)) {
                Ok((b, ms)) => println!("checkpointed {name}: {b} bytes in {ms} ms"),
                Err(e) => {
                    eprintln!("mpsr-statetool: checkpoint: {e}");
                    return ExitCode::from(1);
                }
            },
            Step::Hold(s) => std::thread::sleep(std::time::Duration::from_secs_f64(s.max(0.0))),
            Step::Ready => match mpsr_proto::standby::ready() {
                Ok(mpsr_proto::standby::Ready::Primary) => println!("ready: primary"),
                Ok(mpsr_proto::standby::Ready::TookOver) => println!("ready: took over"),
                Err(e) => {
                    eprintln!("mpsr-statetool: ready: {e}");
                    return ExitCode::from(1);
                }
            },
            Step::Release => {
                if let Err(e) = mpsr_state::release(name) {
                    eprintln!("mpsr-statetool: release: {e}");
                    return ExitCode::from(1);
                }
                println!("released {name}");
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_keep_their_order() {
        let m = command().get_matches_from([
            "mpsr-statetool",
            "x",
            "4M",
            "--fill",
            "3",
            "--checkpoint",
            "--verify",
            "3",
            "--hold",
            "0.5",
            "--fill",
            "4",
            "--release",
        ]);
        assert_eq!(
            steps(&m),
            vec![
                Step::Fill(3),
                Step::Checkpoint,
                Step::Verify(3),
                Step::Hold(0.5),
                Step::Fill(4),
                Step::Release
            ]
        );
        assert_eq!(*m.get_one::<u64>("bytes").unwrap(), 4 << 20);
        let only_fill = command().get_matches_from(["mpsr-statetool", "x", "8M", "--fill", "9"]);
        assert_eq!(steps(&only_fill), vec![Step::Fill(9)]);
        let none = command().get_matches_from(["mpsr-statetool", "x", "8M"]);
        assert!(steps(&none).is_empty());
        assert!(command()
            .try_get_matches_from(["mpsr-statetool", "x", "lots"])
            .is_err());
        assert!(command()
            .try_get_matches_from(["mpsr-statetool", "x", "1M", "--fill", "256"])
            .is_err());
    }
}
