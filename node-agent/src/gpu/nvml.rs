//! Real GPUs: NVML (loaded at run time by nvml-wrapper) for devices and Xid events, and one real
//! `nvidia-cuda-mps-control` daemon per GPU.

use super::{BackendError, CheckFailed, CheckLine, GpuBackend, GpuInfo};
use crate::config::Config;
use crate::gpu::dirs::Started;
use crate::gpu::mps::MpsDaemon;
use crate::gpu::DomainSpec;
use crate::signal::PciAddr;
use crate::signal::{GpuRef, Signal, Source};
use mpsr_proto::{DomainId, ServerState};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc::Sender;
use std::sync::Mutex;
use std::time::Duration;

pub struct NvmlBackend {
    nvml: &'static Nvml,
    gpus: Vec<GpuInfo>,
    /// One control daemon per fault domain.
    daemons: Mutex<BTreeMap<DomainId, MpsDaemon>>,
    binary: std::path::PathBuf,
    multiuser: bool,
    timeout: Duration,
    kmsg: Option<(std::path::PathBuf, std::path::PathBuf)>,
    quit_on_shutdown: bool,
}

/// What works on this node, for `mpsr-agent --self-check`.
pub fn self_check(cfg: &Config) -> Vec<CheckLine> {
    let mut out = Vec::new();
    let nvml = Nvml::init();
    match &nvml {
        Ok(n) => {
            out.push((
                "NVML".into(),
                n.sys_driver_version()
                    .map(|v| format!("driver {v}"))
                    .map_err(CheckFailed::of),
            ));
            match n.device_count() {
                Ok(c) => {
                    for i in 0..c {
                        let d = n.device_by_index(i);
                        out.push((
                            format!("GPU {i}"),
                            d.and_then(|d| {
                                Ok(format!(
                                    "{} {} {}",
                                    d.name()?,
                                    d.uuid()?,
                                    d.pci_info()?.bus_id
                                ))
                            })
                            .map_err(CheckFailed::of),
                        ));
                    }
                }
                Err(e) => out.push(("GPU count".into(), Err(CheckFailed::of(e)))),
            }
        }
        Err(e) => out.push((
            "NVML".into(),
            Err(CheckFailed(format!(
                "{e} (is libnvidia-ml.so.1 installed?)"
            ))),
        )),
    }
    let bin = &cfg.mps.control_binary;
    let found = which(bin);
    out.push((
        "nvidia-cuda-mps-control".into(),
        found
            .map(|p| p.display().to_string())
            .ok_or_else(|| CheckFailed(format!("{} not found in PATH", bin.display()))),
    ));
    out.push((
        "kernel log".into(),
        std::fs::File::open(&cfg.faults.kmsg_path)
            .map(|_| format!("{} readable", cfg.faults.kmsg_path.display()))
            .map_err(|e| CheckFailed(format!("{}: {e}", cfg.faults.kmsg_path.display()))),
    ));
    out
}

fn which(bin: &Path) -> Option<std::path::PathBuf> {
    if bin.is_absolute() {
        return bin.exists().then(|| bin.to_path_buf());
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.exists())
}

impl NvmlBackend {
    pub fn new(cfg: &Config) -> Result<NvmlBackend, BackendError> {
        let nvml = Nvml::init().map_err(|e| BackendError::Nvml(format!("init: {e}")))?;
        // The agent keeps NVML for its whole life; leaking one handle gives threads a 'static borrow.
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let n = nvml
            .device_count()
            .map_err(|e| BackendError::Nvml(e.to_string()))?;
        let mut gpus = Vec::new();
        for i in 0..n {
            let d = nvml
                .device_by_index(i)
                .map_err(|e| BackendError::Nvml(format!("device {i}: {e}")))?;
            let uuid = d.uuid().map_err(|e| BackendError::Nvml(e.to_string()))?;
            let bus = d
                .pci_info()
                .map_err(|e| BackendError::Nvml(e.to_string()))?
                .bus_id;
            let pci = PciAddr::parse(&bus)
                .ok_or_else(|| BackendError::Nvml(format!("unparsable PCI bus id {bus}")))?;
            gpus.push(GpuInfo {
                index: i,
                uuid,
                pci,
            });
        }
        Ok(NvmlBackend {
            nvml,
            gpus,
            daemons: Mutex::new(BTreeMap::new()),
            binary: cfg.mps.control_binary.clone(),
            multiuser: cfg.mps.multiuser,
            timeout: Duration::from_millis(cfg.mps.command_timeout_ms),
            kmsg: cfg.faults.kmsg.then(|| {
                (
                    cfg.faults.kmsg_path.clone(),
                    cfg.state_dir.join(crate::intake::readers::KMSG_CURSOR_FILE),
                )
            }),
            quit_on_shutdown: cfg.mps.quit_on_shutdown,
        })
    }

    fn daemon(&self, id: DomainId) -> Result<MpsDaemon, BackendError> {
        self.daemons
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or(BackendError::NoSuchDomain(id))
    }

    fn mps(id: DomainId) -> impl Fn(crate::sys::process::RunError) -> BackendError {
        move |source| BackendError::Mps { domain: id, source }
    }

    fn xid_loop(nvml: &'static Nvml, n: u32, tx: Sender<Signal>) {
        let set = (|| -> Result<_, NvmlError> {
            let mut set = nvml.create_event_set()?;
            for i in 0..n {
                let d = nvml.device_by_index(i)?;
                set = d
                    .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                    .map_err(|e| e.error)?;
            }
            Ok(set)
        })();
        let set = match set {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot register NVML Xid events; relying on the kernel log");
                return;
            }
        };
        loop {
            // Bounded wait so the thread notices errors and never blocks forever in the driver.
            match set.wait(1000) {
                Ok(ev) => {
                    let idx = ev.device.index().unwrap_or(u32::MAX);
                    let xid = match ev.event_data {
                        Some(XidError::Value(v)) => v as u32,
                        _ => 0,
                    };
                    let mut s = Signal::new(Source::Nvml, GpuRef::Index(idx), Some(xid));
                    s.detail = "NVML XidCriticalError".into();
                    if tx.send(s).is_err() {
                        return;
                    }
                }
                Err(NvmlError::Timeout) => {}
                Err(NvmlError::GpuLost) => {
                    // Which GPU is lost is not said here; find it and report it as Xid 79.
                    for i in 0..n {
                        if matches!(
                            nvml.device_by_index(i).and_then(|d| d.uuid()),
                            Err(NvmlError::GpuLost)
                        ) {
                            let mut s = Signal::new(Source::Nvml, GpuRef::Index(i), Some(79));
                            s.detail = "NVML: GPU is lost".into();
                            let _ = tx.send(s);
                        }
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "NVML event wait failed");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    }
}

/// SIGKILL; whether it was delivered.
fn kill(pid: u32) -> bool {
    // SAFETY: kill(2) with a constant signal; pids 0 and 1 (groups, init) are never passed.
    pid > 1 && unsafe { libc::kill(pid as i32, libc::SIGKILL) == 0 }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }
    fn telemetry_source(&self) -> Box<dyn mpsr_telemetry::source::Source> {
        Box::new(mpsr_telemetry::nvml::NvmlSource::new(
            self.nvml,
            self.gpus
                .iter()
                .map(|g| (g.index, g.uuid.clone()))
                .collect(),
        ))
    }
    fn simulated(&self) -> bool {
        false
    }
    fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    fn start(&self, tx: Sender<Signal>) -> Result<(), BackendError> {
        let nvml = self.nvml;
        let n = self.gpus.len() as u32;
        let t = tx.clone();
        std::thread::Builder::new()
            .name("nvml-xid".into())
            .spawn(move || NvmlBackend::xid_loop(nvml, n, t))?;
        if let Some((path, cursor)) = &self.kmsg {
            if let Err(e) =
                crate::intake::readers::spawn_kmsg_reader(path.clone(), cursor.clone(), tx)
            {
                tracing::warn!(error = %e, path = %path.display(), "kernel log not readable; NVML events only");
            }
        }
        Ok(())
    }

    fn start_domain(&self, spec: &DomainSpec) -> Result<Started, BackendError> {
        let gpu = self
            .gpus
            .get(spec.id.gpu as usize)
            .ok_or(BackendError::NoSuchGpu(spec.id.gpu))?;
        let d = MpsDaemon {
            domain: spec.id,
            uuid: gpu.uuid.clone(),
            pipe_dir: spec.pipe_dir.clone(),
            log_dir: spec.log_dir.clone(),
            binary: self.binary.clone(),
            multiuser: self.multiuser,
            timeout: self.timeout,
        };
        let err = Self::mps(spec.id);
        let started = d.start(spec.owner_uid).map_err(&err)?;
        d.set_defaults(spec.thread_pct, spec.mem_limit)
            .map_err(&err)?;
        self.daemons
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(spec.id, d);
        Ok(started)
    }

    fn end_server(&self, id: DomainId) -> Result<Vec<u32>, BackendError> {
        let d = self.daemon(id)?;
        // What the daemon lists, and what /proc shows (it may not answer).
        let mut pids = d.server_list().unwrap_or_default();
        for p in d.processes().1 {
            if !pids.contains(&p) {
                pids.push(p);
            }
        }
        Ok(pids.into_iter().filter(|p| kill(*p)).collect())
    }

    fn restart_daemon(&self, spec: &DomainSpec) -> Result<(), BackendError> {
        let d = self.daemon(spec.id)?;
        let (control, servers) = d.processes();
        for p in control.iter().chain(&servers) {
            kill(*p);
        }
        // Gone within a bound, or started beside (its directories are new ones).
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < deadline
            && control
                .iter()
                .chain(&servers)
                .any(|p| crate::sys::procfs::alive(*p, None))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.start_domain(spec).map(drop)
    }

    fn stop_domain(&self, id: DomainId) -> Result<(), BackendError> {
        let d = self.daemon(id)?;
        d.quit().map_err(Self::mps(id))?;
        self.daemons
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        Ok(())
    }

    fn server_state(&self, id: DomainId) -> ServerState {
        match self.daemon(id) {
            Ok(d) => d.state(),
            Err(_) => ServerState::Down,
        }
    }

    fn clients(&self, id: DomainId) -> Vec<u32> {
        let Ok(d) = self.daemon(id) else {
            return vec![];
        };
        let Ok(servers) = d.server_list() else {
            return vec![];
        };
        servers
            .iter()
            .flat_map(|s| d.client_list(*s).unwrap_or_default())
            .collect()
    }

    fn terminate_client(&self, id: DomainId, pid: u32) -> Result<(), BackendError> {
        let d = self.daemon(id)?;
        let servers = d.server_list().map_err(Self::mps(id))?;
        for s in servers {
            let clients = d.client_list(s).unwrap_or_default();
            if clients.contains(&pid) {
                return d.terminate_client(s, pid).map_err(Self::mps(id));
            }
        }
        Ok(())
    }

    fn domain_memory(&self, id: DomainId) -> Option<u64> {
        let d = self.daemon(id).ok()?;
        let servers = d.server_list().ok()?;
        let mut pids: Vec<u32> = servers.clone();
        for s in &servers {
            pids.extend(d.client_list(*s).unwrap_or_default());
        }
        let dev = self.nvml.device_by_index(id.gpu).ok()?;
        let procs = dev.running_compute_processes().ok()?;
        Some(
            procs
                .iter()
                .filter(|p| pids.contains(&p.pid))
                .map(|p| match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                })
                .sum(),
        )
    }

    fn probe_healthy(&self, gpu: u32) -> bool {
        self.nvml
            .device_by_index(gpu)
            .and_then(|d| d.uuid())
            .is_ok()
    }

    fn shutdown(&self, domains: &[DomainId]) {
        if !self.quit_on_shutdown {
            return;
        }
        for id in domains {
            if let Ok(d) = self.daemon(*id) {
                if let Err(e) = d.quit() {
                    tracing::warn!(domain = %id, error = %e, "MPS control daemon quit failed");
                }
            }
        }
    }
}
