//! A SIMULATED MPS client for CI and the demo: a real process that attaches to the simulated MPS server
//! of the GPU named by CUDA_MPS_PIPE_DIRECTORY and "computes" for a while. It really dies when the
//! simulated GPU faults (like a CUDA client under MPS), printing the CUDA error a real client saw.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

fn main() {
    let mut secs = 5.0f64;
    let mut idle = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => secs = args.next().and_then(|v| v.parse().ok()).unwrap_or(secs),
            "--idle" => idle = true,
            other => {
                eprintln!("mpsr-simclient: unknown argument {other}\nusage: mpsr-simclient [--seconds N] [--idle]");
                std::process::exit(2);
            }
        }
    }
    let Some(dir) = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY") else {
        eprintln!("mpsr-simclient: CUDA_MPS_PIPE_DIRECTORY is not set (not an MPS client context)");
        std::process::exit(2);
    };
    let path = std::path::Path::new(&dir).join("mpsr-sim.sock");
    let mut s = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("CUDA error 805: MPS client failed to connect to the MPS control daemon ({}: {e}) [simulated]", path.display());
            std::process::exit(1);
        }
    };
    let _ = writeln!(s, "HELLO {}", if idle { "idle" } else { "busy" });
    let mut r = BufReader::new(s.try_clone().expect("clone"));
    let mut line = String::new();
    let _ = r.read_line(&mut line);
    if let Some(err) = line.strip_prefix("ERR ") {
        eprintln!("CUDA error {} [simulated]", err.trim());
        std::process::exit(1);
    }
    println!(
        "simulated MPS client {} attached ({})",
        std::process::id(),
        line.trim()
    );
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = r.read_line(&mut l);
        let _ = tx.send(l);
    });
    let end = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(msg) if msg.starts_with("FAULT ") => {
                let m = msg["FAULT ".len()..].trim();
                let (code, text) = m.split_once(' ').unwrap_or((m, ""));
                eprintln!("CUDA error {code}: {text} [simulated]");
                std::process::exit(1);
            }
            Ok(msg) if msg.starts_with("TERMINATED") => {
                eprintln!(
                    "CUDA error 810: the MPS client has been terminated by the server [simulated]"
                );
                std::process::exit(1);
            }
            Ok(_) => {
                eprintln!("CUDA error 806: MPS server connection lost [simulated]");
                std::process::exit(1);
            }
            Err(_) => {}
        }
    }
    println!("simulated MPS client {} done", std::process::id());
}
