//! mpsr-statetool: attach, fill, verify and checkpoint kept state from the command line (tests,
//! the demo, and checking a node by hand). Runs inside a job (MPSR_KEEPER_SOCKET set).
//!
//!   mpsr-statetool NAME BYTES [--fill B] [--verify B] [--checkpoint] [--hold SECS] [--release]

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: mpsr-statetool NAME BYTES [--fill B] [--verify B] [--checkpoint] [--hold SECS] [--release]";
    let (Some(name), Some(bytes)) = (
        args.first(),
        args.get(1).and_then(|b| mpsr_proto::parse_size(b)),
    ) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
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
    let mut it = args[2..].iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--fill" | "--verify" => {
                let Some(b) = it.next().and_then(|v| v.parse::<u8>().ok()) else {
                    eprintln!("{flag} needs a byte value 0-255\n{usage}");
                    return ExitCode::from(2);
                };
                if flag == "--fill" {
                    if let Err(e) = mpsr_state::fill(name, b) {
                        eprintln!("mpsr-statetool: fill: {e}");
                        return ExitCode::from(1);
                    }
                    println!("filled {name} with {b}");
                } else {
                    match mpsr_state::verify(name, b) {
                        Ok(true) => println!("verified {name}: every byte is {b}"),
                        Ok(false) => {
                            println!("VERIFY FAILED {name}: not every byte is {b}");
                            return ExitCode::from(1);
                        }
                        Err(e) => {
                            eprintln!("mpsr-statetool: verify: {e}");
                            return ExitCode::from(1);
                        }
                    }
                }
            }
            "--checkpoint" => match mpsr_state::checkpoint(Some(name)) {
                Ok((b, ms)) => println!("checkpointed {name}: {b} bytes in {ms} ms"),
                Err(e) => {
                    eprintln!("mpsr-statetool: checkpoint: {e}");
                    return ExitCode::from(1);
                }
            },
            "--hold" => {
                let s = it.next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(1.0);
                std::thread::sleep(std::time::Duration::from_secs_f64(s));
            }
            "--release" => {
                if let Err(e) = mpsr_state::release(name) {
                    eprintln!("mpsr-statetool: release: {e}");
                    return ExitCode::from(1);
                }
                println!("released {name}");
            }
            other => {
                eprintln!("unknown flag {other}\n{usage}");
                return ExitCode::from(2);
            }
        }
    }
    ExitCode::SUCCESS
}
