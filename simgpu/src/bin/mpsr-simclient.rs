//! A SIMULATED MPS client for CI and the demo: a real process that attaches to the simulated MPS
//! server named by CUDA_MPS_PIPE_DIRECTORY and "computes" for a while. It really dies when its
//! server faults (like a CUDA client under MPS), printing the CUDA error a real client saw.

use clap::Parser;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(version, about = "a SIMULATED MPS client (no real GPU)")]
struct Args {
    /// How long to "compute".
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Attach but keep no work in flight (sleeps; a fault reaches it only at its next GPU call).
    #[arg(long)]
    idle: bool,
    /// GPU memory this client holds, in MiB (shown in the domain's memory).
    #[arg(long, default_value_t = 0)]
    mem_mib: u64,
}

/// Connects to the simulated server as an idle or busy client; exits as a CUDA client would if
/// the server refuses it.
fn attach(path: &std::path::Path, idle: bool, mem_mib: u64) -> (UnixStream, BufReader<UnixStream>) {
    let mut s = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("CUDA error 805: MPS client failed to connect to the MPS control daemon ({}: {e}) [simulated]", path.display());
            std::process::exit(1);
        }
    };
    let kind = if idle { "idle" } else { "busy" };
    let _ = writeln!(s, "HELLO {kind} {}", mem_mib << 20);
    let Ok(clone) = s.try_clone() else {
        eprintln!("mpsr-simclient: cannot use the socket");
        std::process::exit(1);
    };
    let mut r = BufReader::new(clone);
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
    (s, r)
}

fn main() {
    mpsr_manpage::print_if_asked(<Args as clap::CommandFactory>::command());
    let a = Args::parse();
    let Some(dir) = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY") else {
        eprintln!("mpsr-simclient: CUDA_MPS_PIPE_DIRECTORY is not set (not an MPS client context)");
        std::process::exit(2);
    };
    let path = std::path::Path::new(&dir).join(mpsr_simgpu::SOCKET_NAME);
    // A warm standby waits before its first CUDA call: no client of any server (no context, no
    // memory) until the agent releases it; then it attaches as a new client would.
    if std::env::var(mpsr_proto::standby::ROLE_ENV).as_deref() == Ok("warm") {
        let t = Instant::now();
        if let Err(e) = mpsr_proto::standby::before_cuda() {
            eprintln!("mpsr-simclient: warm standby cannot wait for its release: {e}");
            std::process::exit(1);
        }
        println!(
            "simulated warm standby {} released after waiting {:.1} s",
            std::process::id(),
            t.elapsed().as_secs_f64()
        );
    }
    // A hot standby (mpsr-run's second incarnation): its context is prepared (an idle client of
    // its own server), then it waits until the agent releases it, and computes from then on.
    let standby = std::env::var(mpsr_proto::standby::ROLE_ENV).as_deref() == Ok("standby");
    let (mut s, mut r) = attach(&path, a.idle || standby, a.mem_mib);
    if standby {
        let t = Instant::now();
        if let Err(e) = mpsr_proto::standby::ready() {
            eprintln!("mpsr-simclient: standby cannot wait for its release: {e}");
            std::process::exit(1);
        }
        println!(
            "simulated standby {} took over after waiting {:.1} s",
            std::process::id(),
            t.elapsed().as_secs_f64()
        );
        // Its first kernel: a busy client of the same server from now on.
        drop(s);
        (s, r) = attach(&path, a.idle, a.mem_mib);
    }
    let _keep = &mut s;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = r.read_line(&mut l);
        let _ = tx.send(l);
    });
    let end = Instant::now() + Duration::from_secs_f64(a.seconds);
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
