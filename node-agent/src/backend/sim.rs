//! Simulated GPUs for CI and the demo. It models what KNOWLEDGE.md measured on an H200, not an ideal:
//! - one MPS server per GPU, ACTIVE or FAULT; in FAULT new clients are refused with 807 until every
//!   faulting client has gone, then it is ACTIVE again after `recovery_ms` (~0.2 s measured);
//! - a fault (Xid 31/43/13, HW classes) kills every client with work in flight on that GPU, not only the
//!   culprit; idle clients survive; clients of other GPUs are untouched;
//! - attribution is wrong: the kernel line for Xid 31 names the *first* client's pid, Xid 43 names the
//!   MPS server; the NVML-like event carries no pid; a misaligned store (13) also yields a 43;
//! - `isolation = true` models the driver patch: a memory fault kills only the culprit and an isolation
//!   line names it;
//! - device lost (79, 119, 120, 154) kills all clients and leaves the GPU LOST until `sim_recover`.
//!
//! Clients are real processes (`mpsr-simclient`) that connect to `<pipe_dir>/mpsr-sim.sock` (found via
//! `CUDA_MPS_PIPE_DIRECTORY`, as a CUDA client finds its server) and really exit when killed.

use super::{BackendError, GpuBackend, GpuInfo};
use crate::event::{GpuRef, Signal, Source};
use crate::kmsg::{self, KernelLine, PciAddr};
use crate::xid::{Classifier, FaultClass};
use mpsr_proto::ServerState;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const SOCKET_NAME: &str = "mpsr-sim.sock";

struct SimClient {
    pid: u32,
    busy: bool,
    stream: UnixStream,
    conn: u64,
}

struct SimGpu {
    info: GpuInfo,
    state: ServerState,
    clients: Vec<SimClient>,
    /// Faulted clients that have not disconnected yet (server stays in FAULT while any remain).
    faulted: Vec<u64>,
    recover_at: Option<Instant>,
}

pub struct SimBackend {
    gpus: Vec<GpuInfo>,
    state: Arc<Vec<Mutex<SimGpu>>>,
    classifier: Classifier,
    isolation: bool,
    recovery: Duration,
    kmsg_log: PathBuf,
    tx: Mutex<Option<Sender<Signal>>>,
}

fn lock(m: &Mutex<SimGpu>) -> MutexGuard<'_, SimGpu> {
    // A panic elsewhere must not take the simulated GPUs down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// CUDA error a simulated client sees for each Xid (what the victims printed on the H200).
fn client_error(xid: u32) -> (u32, &'static str) {
    match xid {
        31 => (700, "an illegal memory access was encountered"),
        13 => (716, "misaligned address"),
        43 => (719, "unspecified launch failure"),
        79 | 119 | 120 | 154 => (999, "unknown error (GPU lost)"),
        48 | 64 | 94 | 95 | 140 => (214, "uncorrectable ECC error encountered"),
        _ => (719, "unspecified launch failure"),
    }
}

impl SimBackend {
    pub fn new(
        n: u32,
        run_dir: &Path,
        classifier: Classifier,
        isolation: bool,
        recovery_ms: u64,
    ) -> Result<SimBackend, BackendError> {
        let mut gpus = Vec::new();
        for i in 0..n {
            let base = run_dir.join(format!("gpu{i}"));
            gpus.push(GpuInfo {
                index: i,
                uuid: format!("GPU-5157-0000-0000-{i:012}"),
                pci: PciAddr {
                    domain: 0,
                    bus: 0x10 + i as u8,
                    device: 0,
                },
                pipe_dir: base.join("pipe").display().to_string(),
                log_dir: base.join("log").display().to_string(),
            });
        }
        let state = gpus
            .iter()
            .map(|g| {
                Mutex::new(SimGpu {
                    info: g.clone(),
                    state: ServerState::Active,
                    clients: Vec::new(),
                    faulted: Vec::new(),
                    recover_at: None,
                })
            })
            .collect();
        Ok(SimBackend {
            gpus,
            state: Arc::new(state),
            classifier,
            isolation,
            recovery: Duration::from_millis(recovery_ms),
            kmsg_log: run_dir.join("sim-kmsg.log"),
            tx: Mutex::new(None),
        })
    }

    fn gpu(&self, gpu: u32) -> Result<&Mutex<SimGpu>, BackendError> {
        self.state
            .get(gpu as usize)
            .ok_or(BackendError::NoSuchGpu(gpu))
    }

    fn emit(&self, s: Signal) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.send(s);
        }
    }

    /// A kernel-log line goes through the same parser as real `/dev/kmsg` lines.
    fn emit_kmsg(&self, line: String) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.kmsg_log)
        {
            let _ = writeln!(f, "{line}");
        }
        if let Some(parsed) = kmsg::parse_line(&line) {
            if let Some(s) = signal_from_kernel(&parsed, Source::Kmsg) {
                self.emit(s);
            }
        }
    }

    fn accept_loop(
        state: Arc<Vec<Mutex<SimGpu>>>,
        idx: usize,
        listener: UnixListener,
        me: Arc<SimBackendShared>,
    ) {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let state = state.clone();
            let me = me.clone();
            std::thread::spawn(move || Self::serve_client(state, idx, stream, me));
        }
    }

    fn serve_client(
        state: Arc<Vec<Mutex<SimGpu>>>,
        idx: usize,
        stream: UnixStream,
        me: Arc<SimBackendShared>,
    ) {
        let pid = peer_pid(&stream).unwrap_or(0);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut reader = BufReader::new(match stream.try_clone() {
            Ok(s) => s,
            Err(_) => return,
        });
        let mut hello = String::new();
        if reader.read_line(&mut hello).is_err() {
            return;
        }
        let busy = !hello.contains("idle");
        let conn = me
            .next_conn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        {
            let mut g = lock(&state[idx]);
            g.tick();
            let mut w = &stream;
            match g.state {
                ServerState::Active | ServerState::Idle => {
                    let Ok(c) = stream.try_clone() else { return };
                    g.clients.push(SimClient {
                        pid,
                        busy,
                        stream: c,
                        conn,
                    });
                    g.state = ServerState::Active;
                    let _ = writeln!(w, "OK {} simulated-gpu{}", std::process::id(), idx);
                }
                ServerState::Lost => {
                    let _ = writeln!(w, "ERR 999 simulated GPU is lost (needs reset)");
                    return;
                }
                _ => {
                    let _ = writeln!(w, "ERR 807 MPS server is not ready (simulated)");
                    return;
                }
            }
        }
        let _ = stream.set_read_timeout(None);
        // Block until the client goes away (it holds the connection for its lifetime).
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let mut g = lock(&state[idx]);
        g.clients.retain(|c| c.conn != conn);
        if let Some(pos) = g.faulted.iter().position(|c| *c == conn) {
            g.faulted.remove(pos);
            if g.faulted.is_empty() && g.state == ServerState::Fault {
                g.recover_at = Some(Instant::now() + me.recovery);
            }
        }
    }
}

/// What accept threads need from the backend (kept apart so they need not own it).
struct SimBackendShared {
    recovery: Duration,
    next_conn: std::sync::atomic::AtomicU64,
}

impl SimGpu {
    /// Lazily apply the FAULT -> ACTIVE transition.
    fn tick(&mut self) {
        if self.state == ServerState::Fault && self.faulted.is_empty() {
            if let Some(at) = self.recover_at {
                if Instant::now() >= at {
                    self.state = ServerState::Active;
                    self.recover_at = None;
                }
            }
        }
    }
}

pub fn signal_from_kernel(line: &KernelLine, source: Source) -> Option<Signal> {
    match line {
        KernelLine::Xid(x) => {
            let mut s = Signal::new(source, GpuRef::Pci(x.pci), Some(x.xid));
            s.reported_pid = x.pid;
            s.secondary = x.secondary;
            s.detail = x.detail.clone();
            Some(s)
        }
        KernelLine::Isolation {
            pci,
            xid,
            culprit_pid,
            contained,
        } => {
            let mut s = Signal::new(Source::Isolation, GpuRef::Pci(*pci), Some(*xid));
            s.culprit = Some((*culprit_pid, *contained));
            Some(s)
        }
    }
}

fn peer_pid(s: &UnixStream) -> Option<u32> {
    crate::server::peer_cred(s).ok().map(|c| c.pid)
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
        *self.tx.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        let shared = Arc::new(SimBackendShared {
            recovery: self.recovery,
            next_conn: 0.into(),
        });
        for (i, g) in self.gpus.iter().enumerate() {
            for d in [&g.pipe_dir, &g.log_dir] {
                std::fs::create_dir_all(d)?;
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
            }
            let sock = Path::new(&g.pipe_dir).join(SOCKET_NAME);
            let _ = std::fs::remove_file(&sock);
            let l = UnixListener::bind(&sock)?;
            // Any user's job may be a client, as with a real MPS pipe directory.
            std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))?;
            std::fs::write(
                Path::new(&g.log_dir).join("control.log"),
                format!("simulated MPS control daemon for gpu{i} ({})\n", g.uuid),
            )?;
            let st = self.state.clone();
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("sim-gpu{i}"))
                .spawn(move || SimBackend::accept_loop(st, i, l, sh))?;
        }
        Ok(())
    }

    fn server_state(&self, gpu: u32) -> ServerState {
        match self.gpu(gpu) {
            Ok(m) => {
                let mut g = lock(m);
                g.tick();
                g.state
            }
            Err(_) => ServerState::Down,
        }
    }

    fn clients(&self, gpu: u32) -> Vec<u32> {
        self.gpu(gpu)
            .map(|m| lock(m).clients.iter().map(|c| c.pid).collect())
            .unwrap_or_default()
    }

    fn terminate_client(&self, gpu: u32, pid: u32) -> Result<(), BackendError> {
        let mut g = lock(self.gpu(gpu)?);
        let Some(c) = g.clients.iter_mut().find(|c| c.pid == pid) else {
            return Ok(()); // already gone: terminating is idempotent
        };
        let _ = writeln!(
            &c.stream,
            "TERMINATED the MPS client has been terminated by the server"
        );
        let _ = c.stream.shutdown(std::net::Shutdown::Write);
        Ok(())
    }

    fn probe_healthy(&self, gpu: u32) -> bool {
        self.server_state(gpu) != ServerState::Lost
    }

    fn shutdown(&self) {
        for g in &self.gpus {
            let _ = std::fs::remove_file(Path::new(&g.pipe_dir).join(SOCKET_NAME));
        }
    }

    fn sim_inject(
        &self,
        gpu: u32,
        xid: u32,
        culprit: Option<u32>,
    ) -> Result<Vec<u32>, BackendError> {
        let m = self.gpu(gpu)?;
        let class = self.classifier.class_of(xid);
        let mut g = lock(m);
        g.tick();
        let pci = g.info.pci;
        let first_client = g.clients.first().map(|c| c.pid);
        let isolated = self.isolation && class == FaultClass::AppMemory && culprit.is_some();
        let lost = class == FaultClass::DeviceLost;
        let (code, msg) = client_error(if xid == 13 { 13 } else { xid });
        let mut killed = Vec::new();
        if !matches!(class, FaultClass::Info | FaultClass::Unknown) {
            for c in &g.clients {
                let dies = if isolated {
                    Some(c.pid) == culprit
                } else {
                    c.busy || lost
                };
                if dies {
                    let _ = writeln!(&c.stream, "FAULT {code} {msg}");
                    killed.push((c.pid, c.conn));
                }
            }
            if !killed.is_empty() {
                g.faulted.extend(killed.iter().map(|(_, c)| *c));
                g.state = ServerState::Fault;
                g.recover_at = None;
            }
            if lost {
                g.state = ServerState::Lost;
            }
        }
        drop(g);

        // The patched driver prints its isolation line before it raises the Xid (driver-patch/).
        if isolated {
            self.emit_kmsg(format!(
                "NVRM: mpsr-isolate (PCI:{pci}): xid={xid} culprit_pid={} contained=1 (simulated)",
                culprit.unwrap_or(0)
            ));
        }
        // The NVML-like event: an Xid and a device, never a pid. A misaligned store reports 43 there.
        let nvml_xid = if xid == 13 { 43 } else { xid };
        self.emit(Signal::new(
            Source::Nvml,
            GpuRef::Index(gpu),
            Some(nvml_xid),
        ));
        // Kernel lines with the attribution measured under MPS.
        let server_pid = std::process::id();
        let line = match xid {
            31 => format!(
                "NVRM: Xid (PCI:{pci}): 31, pid={}, name=simclient, channel 0x0000000e, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8 faulted @ 0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE (simulated)",
                first_client.map(|p| p.to_string()).unwrap_or_else(|| "'<unknown>'".into())
            ),
            43 => format!("NVRM: Xid (PCI:{pci}): 43, pid={server_pid}, name=nvidia-cuda-mps, channel 0x0000000a (simulated)"),
            13 => format!("NVRM: Xid (PCI:{pci}): 13, Graphics SM Warp Exception on (GPC 1, TPC 4, SM 0): Misaligned Address (simulated)"),
            79 => format!("NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. (simulated)"),
            x => format!("NVRM: Xid (PCI:{pci}): {x}, pid='<unknown>', name=<unknown>, {} (simulated)", Classifier::description(x)),
        };
        self.emit_kmsg(line);
        if xid == 13 {
            self.emit_kmsg(format!(
                "NVRM: Xid (PCI:{pci}): 43, pid={server_pid}, name=nvidia-cuda-mps, channel 0x0000000a (simulated)"
            ));
        }
        Ok(killed.into_iter().map(|(p, _)| p).collect())
    }

    fn sim_recover(&self, gpu: u32) -> Result<(), BackendError> {
        let mut g = lock(self.gpu(gpu)?);
        if g.state == ServerState::Lost {
            g.state = if g.faulted.is_empty() {
                ServerState::Active
            } else {
                ServerState::Fault
            };
            if g.faulted.is_empty() {
                g.recover_at = None;
            }
        }
        Ok(())
    }
}
