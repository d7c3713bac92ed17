//! SIMULATED GPUs for CI and the demo, as a backend: a client of the `mpsr-simgpu` daemon (crate
//! `mpsr-simgpu`), which holds the simulated MPS servers of every fault domain and their clients.
//! Like real MPS control daemons it is started once and outlives agent restarts; the agent
//! reconnects to it. What dies in a fault is the simulator's own business (its measured table):
//! the agent learns it only from what the hardware shows, as on a real node.

use super::{BackendError, GpuBackend, GpuInfo};
use crate::gpu::dirs::Started;
use crate::gpu::DomainSpec;
use crate::intake::kernel_line;
use crate::signal::PciAddr;
use crate::signal::{GpuRef, Signal, Source};
use mpsr_proto::{DomainId, ServerState};
use mpsr_simgpu::{DriverPatch, SimEvent, SimReply, SimRequest};
use mpsr_telemetry::replay::{Injection, Pathology};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CALL_TIMEOUT: Duration = Duration::from_secs(3);

pub struct SimBackend {
    gpus: Vec<GpuInfo>,
    run_dir: PathBuf,
    driver_patch: DriverPatch,
    timing: mpsr_simgpu::FaultTiming,
    recovery_ms: u64,
    /// Stop the daemon when the agent stops (tests); by default it stays, like MPS daemons.
    quit_on_shutdown: bool,
    /// SIMULATED telemetry: its clock and the pathologies injected into it.
    telemetry_started: Instant,
    injections: Arc<Mutex<Vec<Injection>>>,
}

impl SimBackend {
    fn start_request(&self, spec: &DomainSpec) -> SimRequest {
        SimRequest::StartDomain {
            domain: spec.id,
            pipe_dir: spec.pipe_dir.clone(),
            log_dir: spec.log_dir.clone(),
            owner_uid: spec.owner_uid,
            thread_pct: spec.thread_pct,
            mem_limit: spec.mem_limit,
        }
    }

    pub fn new(
        cfg: &crate::config::SimConfig,
        run_dir: &Path,
        quit_on_shutdown: bool,
    ) -> Result<SimBackend, BackendError> {
        let gpus = (0..cfg.gpus)
            .map(|i| {
                let pci = mpsr_simgpu::gpu_pci(i);
                Ok(GpuInfo {
                    index: i,
                    uuid: mpsr_simgpu::gpu_uuid(i),
                    pci: PciAddr::parse(&pci)
                        .ok_or_else(|| BackendError::Sim(format!("bad PCI id {pci}")))?,
                })
            })
            .collect::<Result<_, BackendError>>()?;
        Ok(SimBackend {
            gpus,
            run_dir: run_dir.to_path_buf(),
            driver_patch: cfg.driver_patch,
            timing: cfg.timing,
            recovery_ms: cfg.recovery_ms,
            quit_on_shutdown,
            telemetry_started: Instant::now(),
            injections: Arc::new(Mutex::new(Vec::new())),
        })
    }

    fn call(&self, req: &SimRequest) -> Result<SimReply, BackendError> {
        match mpsr_simgpu::call(&self.run_dir, req, CALL_TIMEOUT) {
            Ok(SimReply::Error(e)) => Err(BackendError::Sim(e)),
            Ok(r) => Ok(r),
            Err(e) => Err(BackendError::Sim(e.to_string())),
        }
    }

    /// Connects to a running daemon with the same GPU count, or starts one.
    fn ensure_daemon(&self) -> Result<(), BackendError> {
        match self.call(&SimRequest::Ping) {
            Ok(SimReply::Pong { gpus, pid }) if gpus == self.gpus.len() as u32 => {
                tracing::info!(pid, "reconnected to the running SIMULATED GPU daemon");
                return Ok(());
            }
            Ok(SimReply::Pong { gpus, pid }) => {
                return Err(BackendError::Sim(format!(
                    "a simulated GPU daemon (pid {pid}) with {gpus} GPUs already serves {}; sim.gpus = {}",
                    self.run_dir.display(),
                    self.gpus.len()
                )))
            }
            _ => {}
        }
        let exe = std::env::current_exe()?.with_file_name("mpsr-simgpu");
        let dir = self.run_dir.join("sim");
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("simgpu.log"))?;
        let mut c = Command::new(&exe);
        c.arg("--run-dir")
            .arg(&self.run_dir)
            .arg("--gpus")
            .arg(self.gpus.len().to_string())
            .arg("--recovery-ms")
            .arg(self.recovery_ms.to_string());
        c.arg("--driver-patch").arg(self.driver_patch.name());
        c.arg("--timing").arg(self.timing.name());
        // Its own session: the daemon outlives the agent, as MPS control daemons do.
        crate::sys::process::prepare(&mut c, true);
        c.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| BackendError::Sim(format!("starting {}: {e}", exe.display())))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.call(&SimRequest::Ping), Ok(SimReply::Pong { .. })) {
                tracing::warn!("started the SIMULATED GPU daemon (mpsr-simgpu)");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(BackendError::Sim(
            "simulated GPU daemon did not come up".into(),
        ))
    }

    /// Streams the daemon's NVML-like events and kernel lines into the fault pipeline; reconnects.
    fn event_loop(run_dir: PathBuf, tx: Sender<Signal>) {
        loop {
            if let Ok(s) = UnixStream::connect(mpsr_simgpu::control_socket(&run_dir)) {
                if writeln!(&s, "{}", mpsr_simgpu::json(&SimRequest::Subscribe)).is_ok() {
                    for line in BufReader::new(&s).lines() {
                        let Ok(line) = line else { break };
                        let sig = match serde_json::from_str::<SimReply>(&line) {
                            Ok(SimReply::Event(SimEvent::Nvml { gpu, xid })) => {
                                let mut s =
                                    Signal::new(Source::Nvml, GpuRef::Index(gpu), Some(xid));
                                s.detail = "simulated NVML XidCriticalError".into();
                                Some(s)
                            }
                            Ok(SimReply::Event(SimEvent::Kmsg(l))) => kernel_line::parse_line(&l)
                                .and_then(|k| {
                                    crate::intake::readers::signal_from_kernel(&k, Source::Kmsg)
                                }),
                            _ => None,
                        };
                        if let Some(sig) = sig {
                            if tx.send(sig).is_err() {
                                return;
                            }
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn domains(&self, gpu: u32) -> Vec<mpsr_simgpu::DomainInfo> {
        match self.call(&SimRequest::Domains { gpu }) {
            Ok(SimReply::Domains(d)) => d,
            _ => Vec::new(),
        }
    }
}

impl GpuBackend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn simulated(&self) -> bool {
        true
    }
    fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    fn start(&self, tx: Sender<Signal>) -> Result<(), BackendError> {
        self.ensure_daemon()?;
        let dir = self.run_dir.clone();
        std::thread::Builder::new()
            .name("sim-events".into())
            .spawn(move || SimBackend::event_loop(dir, tx))?;
        Ok(())
    }

    fn start_domain(&self, spec: &DomainSpec) -> Result<Started, BackendError> {
        // A daemon that answers is adopted with its directories; else they are made fresh.
        if self.server_state(spec.id) != ServerState::Down {
            self.call(&self.start_request(spec))?;
            crate::gpu::dirs::harden_adopted(&spec.log_dir)?;
            return Ok(Started::Adopted);
        }
        crate::gpu::dirs::fresh(&spec.pipe_dir, &spec.log_dir, spec.owner_uid)?;
        let req = self.start_request(spec);
        if self.call(&req).is_ok() {
            return Ok(Started::Fresh);
        }
        // The simulated GPUs' daemon died (like an MPS control daemon can): start it again.
        self.ensure_daemon()?;
        self.call(&req).map(|_| Started::Fresh)
    }

    fn end_server(&self, id: DomainId) -> Result<Vec<u32>, BackendError> {
        match self.call(&SimRequest::KillServer { domain: id })? {
            SimReply::Killed(k) => Ok(k),
            other => Err(BackendError::Sim(format!("unexpected reply {other:?}"))),
        }
    }

    fn restart_daemon(&self, spec: &DomainSpec) -> Result<(), BackendError> {
        self.call(&SimRequest::RestartDaemon { domain: spec.id })?;
        // Answering again: its directories are made fresh as for any start.
        if self.server_state(spec.id) == ServerState::Down {
            return Err(BackendError::Sim(format!(
                "{} does not answer after its restart",
                spec.id
            )));
        }
        Ok(())
    }

    fn stop_domain(&self, id: DomainId) -> Result<(), BackendError> {
        self.call(&SimRequest::StopDomain { domain: id })
            .map(|_| ())
    }

    fn server_state(&self, id: DomainId) -> ServerState {
        match self.call(&SimRequest::State { domain: id }) {
            Ok(SimReply::State(s)) => s,
            _ => ServerState::Down,
        }
    }

    fn clients(&self, id: DomainId) -> Vec<u32> {
        match self.call(&SimRequest::Clients { domain: id }) {
            Ok(SimReply::Clients(c)) => c,
            _ => vec![],
        }
    }

    fn terminate_client(&self, id: DomainId, pid: u32) -> Result<(), BackendError> {
        self.call(&SimRequest::Terminate { domain: id, pid })
            .map(|_| ())
    }

    fn domain_memory(&self, id: DomainId) -> Option<u64> {
        self.domains(id.gpu)
            .into_iter()
            .find(|d| d.domain == id)
            .map(|d| d.memory_bytes)
    }

    fn probe_healthy(&self, gpu: u32) -> bool {
        !matches!(
            self.server_state(DomainId::shared(gpu)),
            ServerState::Lost | ServerState::Down
        )
    }

    fn shutdown(&self, _domains: &[DomainId]) {
        if self.quit_on_shutdown {
            let _ = self.call(&SimRequest::Quit);
        }
    }

    fn sim_inject(
        &self,
        gpu: u32,
        xid: u32,
        culprit: Option<u32>,
        slot: Option<u32>,
    ) -> Result<Vec<u32>, BackendError> {
        match self.call(&SimRequest::Inject {
            gpu,
            xid,
            culprit,
            slot,
        })? {
            SimReply::Killed(k) => Ok(k),
            other => Err(BackendError::Sim(format!("unexpected reply {other:?}"))),
        }
    }

    fn sim_recover(&self, gpu: u32) -> Result<(), BackendError> {
        self.call(&SimRequest::Recover { gpu }).map(|_| ())
    }
    fn telemetry_source(&self) -> Box<dyn mpsr_telemetry::source::Source> {
        Box::new(mpsr_telemetry::source::SimSource::new(
            self.gpus.len() as u32,
            0x6d70_7372,
            self.telemetry_started,
            self.injections.clone(),
        ))
    }
    fn sim_pathology(
        &self,
        what: Pathology,
        gpu: u32,
        pid: Option<u32>,
        secs: u32,
    ) -> Result<(), BackendError> {
        if gpu as usize >= self.gpus.len() {
            return Err(BackendError::NoSuchGpu(gpu));
        }
        let now = self.telemetry_started.elapsed().as_secs_f64();
        let mut inj = self.injections.lock().unwrap_or_else(|p| p.into_inner());
        inj.retain(|i| i.end_s > now);
        inj.push(Injection {
            what,
            gpu,
            pid,
            start_s: now,
            end_s: now + secs as f64,
        });
        Ok(())
    }
}
