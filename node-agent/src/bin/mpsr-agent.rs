//! mpsr-agent: the per-node daemon (root, systemd).

use clap::Parser;
use mpsr_agent::agent::Trusted;
use mpsr_agent::config::{Backend, Config, DEFAULT_PATH};
use mpsr_agent::fault::classify::Classifier;
use mpsr_agent::gpu::{nvml::NvmlBackend, sim::SimBackend, CheckFailed, CheckLine, GpuBackend};
use mpsr_agent::wiring;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(version, about = "mps-resilient node agent")]
struct Args {
    /// Configuration file.
    #[arg(long, default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Print what works on this node (NVML, driver, MPS binary, kernel log) and exit.
    #[arg(long)]
    self_check: bool,
}

fn main() -> std::process::ExitCode {
    mpsr_manpage::print_if_asked(<Args as clap::CommandFactory>::command());
    let args = Args::parse();
    let cfg = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mpsr-agent: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if args.self_check {
        let mut ok = true;
        let checks = match cfg.backend {
            mpsr_agent::config::Backend::Nvml => mpsr_agent::gpu::nvml::self_check(&cfg),
            mpsr_agent::config::Backend::Sim => sim_self_check(),
        };
        for (what, r) in checks {
            match r {
                Ok(m) => println!("ok    {what}: {m}"),
                Err(m) => {
                    ok = false;
                    println!("FAIL  {what}: {m}")
                }
            }
        }
        return if ok { 0.into() } else { 1.into() };
    }
    mpsr_agent::sys::memory::configure();
    mpsr_agent::logging::init(&cfg.log, c"mpsr-agent");
    match run(cfg) {
        Ok(()) => 0.into(),
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("mpsr-agent: {e}");
            1.into()
        }
    }
}

/// backend = "sim": there are no GPUs to check, only the simulator's binaries.
fn sim_self_check() -> Vec<CheckLine> {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut out = vec![(
        "backend".to_string(),
        Ok("sim: SIMULATED GPUs (no NVML, MPS or kernel log checked)".to_string()),
    )];
    for bin in ["mpsr-simgpu", "mpsr-simclient"] {
        let p = exe.with_file_name(bin);
        out.push((
            bin.to_string(),
            if p.is_file() {
                Ok(p.display().to_string())
            } else {
                Err(CheckFailed(format!(
                    "{} not found (cargo build -p mpsr-simgpu)",
                    p.display()
                )))
            },
        ));
    }
    out
}

fn node_name(cfg: &Config) -> String {
    if !cfg.node_name.is_empty() {
        return cfg.node_name.clone();
    }
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    h.trim()
        .split('.')
        .next()
        .unwrap_or("localhost")
        .to_string()
}

fn resolve_uid(user: &str) -> Option<u32> {
    if user.is_empty() {
        return None;
    }
    let c = std::ffi::CString::new(user).ok()?;
    // SAFETY: c is a valid NUL-terminated string; getpwnam returns NULL or a pointer to static data
    // that we read immediately on this thread.
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    if pw.is_null() {
        None
    } else {
        // SAFETY: pw is non-NULL and points to a passwd struct.
        Some(unsafe { (*pw).pw_uid })
    }
}

fn run(cfg: Config) -> Result<(), Box<dyn std::error::Error>> {
    let path = PathBuf::from("agent.toml");
    let classifier = Classifier::new(&cfg.xid_overrides(&path)?, &cfg.policy_overrides(&path)?);
    let backend: Arc<dyn GpuBackend> = match cfg.backend {
        Backend::Sim => {
            tracing::warn!(
                gpus = cfg.sim.gpus,
                "SIMULATED GPUs: backend = sim (no real GPU is used)"
            );
            Arc::new(SimBackend::new(
                &cfg.sim,
                &cfg.run_dir,
                cfg.mps.quit_on_shutdown,
            )?)
        }
        Backend::Nvml => Arc::new(NvmlBackend::new(&cfg)?),
    };
    let mut trusted: std::collections::BTreeSet<u32> = cfg.trusted_uids.iter().copied().collect();
    trusted.extend(resolve_uid(&cfg.slurm_user));
    let node = node_name(&cfg);
    // Block SIGTERM/SIGINT in every thread; one thread waits for them.
    // SAFETY: sigset operations on a local, initialized set; pthread_sigmask before threads start.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let listener = mpsr_agent::api::socket::bind(&cfg.socket)?;
    let socket = cfg.socket.clone();
    let agent = wiring::start(
        cfg,
        node.clone(),
        backend.clone(),
        classifier,
        Trusted(trusted),
    )?;
    tracing::info!(node = %node, backend = backend.name(), simulated = backend.simulated(), gpus = backend.gpus().len(), socket = %socket.display(), "agent ready");
    let a = agent.clone();
    std::thread::spawn(move || mpsr_agent::api::socket::serve(a, listener));
    // Ready once the socket is bound and every domain's daemon is up: slurmd is ordered after it.
    let gpus = backend.gpus().len();
    if let Err(e) =
        mpsr_agent::sys::notify::notify(&format!("READY=1\nSTATUS=serving {gpus} GPU(s)"))
    {
        tracing::warn!(error = %e, "telling systemd we are ready failed");
    }
    // systemd's watchdog, pinged only while the agent answers on its own socket.
    if let Some(every) = mpsr_agent::sys::watchdog::interval() {
        mpsr_agent::sys::watchdog::spawn(socket.clone(), every);
    }
    let mut sig: libc::c_int = 0;
    // SAFETY: set is a valid sigset and sig a valid out-parameter.
    unsafe { libc::sigwait(&set, &mut sig) };
    tracing::info!(signal = sig, "shutting down");
    let _ = mpsr_agent::sys::notify::notify("STOPPING=1");
    wiring::shutdown(&agent);
    let _ = std::fs::remove_file(&socket);
    Ok(())
}
