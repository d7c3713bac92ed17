//! SIMULATED GPUs and their MPS servers, run as their own daemon (`mpsr-simgpu`) so that, as with
//! real MPS control daemons, they outlive an agent restart. Modelled on what KNOWLEDGE.md measured
//! on an H200, not on an ideal:
//! - one MPS server per GPU, ACTIVE or FAULT; in FAULT new clients are refused with 807 until every
//!   faulting client has gone, then it is ACTIVE again after `recovery_ms` (~0.2 s measured);
//! - a fault (Xid 31/43/13, HW classes) kills every client with work in flight on that GPU, not only
//!   the culprit; idle clients survive; clients of other GPUs are untouched;
//! - attribution is wrong: the kernel line for Xid 31 names the *first* client's pid, Xid 43 names
//!   the MPS server; the NVML-like event carries no pid; a misaligned store (13) also yields a 43;
//! - `isolation` models the driver patch: a memory fault kills only the culprit and an isolation
//!   line names it;
//! - device lost (79, 119, 120, 154) kills all clients and leaves the GPU LOST until `recover`.
//!
//! Clients are real processes (`mpsr-simclient`) that connect to `<pipe_dir>/mpsr-sim.sock` (found
//! via `CUDA_MPS_PIPE_DIRECTORY`, as a CUDA client finds its server) and really exit when killed.
//! The agent talks to this daemon over `<run_dir>/sim/control.sock` (JSON lines, [`SimRequest`]).

use crate::backend::GpuInfo;
use crate::kmsg::PciAddr;
use crate::xid::{Classifier, FaultClass};
use mpsr_proto::ServerState;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const SOCKET_NAME: &str = "mpsr-sim.sock";

/// Requests on the control socket, one JSON object per line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SimRequest {
    Ping,
    State {
        gpu: u32,
    },
    Clients {
        gpu: u32,
    },
    Terminate {
        gpu: u32,
        pid: u32,
    },
    Inject {
        gpu: u32,
        xid: u32,
        culprit: Option<u32>,
    },
    Recover {
        gpu: u32,
    },
    /// Turns the connection into a stream of [`SimEvent`] lines.
    Subscribe,
    Quit,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimReply {
    Pong { gpus: u32, pid: u32 },
    State(ServerState),
    Clients(Vec<u32>),
    Killed(Vec<u32>),
    Ok,
    Error(String),
    Event(SimEvent),
}

/// What the simulated hardware reports: an NVML-like event (never a pid) or a kernel-log line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimEvent {
    Nvml { gpu: u32, xid: u32 },
    Kmsg(String),
}

/// The GPUs both sides agree on (index, fake UUID and PCI address, pipe/log dirs).
pub fn gpu_infos(n: u32, run_dir: &Path) -> Vec<GpuInfo> {
    (0..n)
        .map(|i| {
            let base = run_dir.join(format!("gpu{i}"));
            GpuInfo {
                index: i,
                uuid: format!("GPU-5157-0000-0000-{i:012}"),
                pci: PciAddr {
                    domain: 0,
                    bus: 0x10 + i as u8,
                    device: 0,
                },
                pipe_dir: base.join("pipe").display().to_string(),
                log_dir: base.join("log").display().to_string(),
            }
        })
        .collect()
}

pub fn control_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("sim").join("control.sock")
}

struct Client {
    pid: u32,
    busy: bool,
    stream: UnixStream,
    conn: u64,
}

struct Gpu {
    info: GpuInfo,
    state: ServerState,
    clients: Vec<Client>,
    /// Faulted clients that have not disconnected yet (server stays in FAULT while any remain).
    faulted: Vec<u64>,
    recover_at: Option<Instant>,
}

impl Gpu {
    /// Lazily applies the FAULT -> ACTIVE transition.
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

pub struct SimGpus {
    gpus: Vec<Mutex<Gpu>>,
    classifier: Classifier,
    isolation: bool,
    recovery: Duration,
    run_dir: PathBuf,
    next_conn: AtomicU64,
    subscribers: Mutex<Vec<UnixStream>>,
}

fn lock(m: &Mutex<Gpu>) -> MutexGuard<'_, Gpu> {
    // A panic in one connection thread must not take the simulated GPUs down with it.
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

fn peer_pid(s: &UnixStream) -> Option<u32> {
    crate::server::peer_cred(s).ok().map(|c| c.pid)
}

impl SimGpus {
    pub fn new(n: u32, run_dir: &Path, isolation: bool, recovery_ms: u64) -> SimGpus {
        SimGpus {
            gpus: gpu_infos(n, run_dir)
                .into_iter()
                .map(|info| {
                    Mutex::new(Gpu {
                        info,
                        state: ServerState::Active,
                        clients: Vec::new(),
                        faulted: Vec::new(),
                        recover_at: None,
                    })
                })
                .collect(),
            // The hardware does not read the agent's config: the default table decides who dies.
            classifier: Classifier::default(),
            isolation,
            recovery: Duration::from_millis(recovery_ms),
            run_dir: run_dir.to_path_buf(),
            next_conn: AtomicU64::new(0),
            subscribers: Mutex::new(Vec::new()),
        }
    }

    fn gpu(&self, gpu: u32) -> Result<&Mutex<Gpu>, String> {
        self.gpus
            .get(gpu as usize)
            .ok_or_else(|| format!("no simulated GPU {gpu}"))
    }

    /// Binds every socket and serves until `Quit` (or until the run dir disappears).
    pub fn serve(self: Arc<Self>) -> std::io::Result<()> {
        for (i, m) in self.gpus.iter().enumerate() {
            let info = lock(m).info.clone();
            for d in [&info.pipe_dir, &info.log_dir] {
                std::fs::create_dir_all(d)?;
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
            }
            let sock = Path::new(&info.pipe_dir).join(SOCKET_NAME);
            let _ = std::fs::remove_file(&sock);
            let l = UnixListener::bind(&sock)?;
            // Any user's job may be a client, as with a real MPS pipe directory.
            std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))?;
            std::fs::write(
                Path::new(&info.log_dir).join("control.log"),
                format!(
                    "simulated MPS control daemon for gpu{i} ({}), pid {}\n",
                    info.uuid,
                    std::process::id()
                ),
            )?;
            let me = self.clone();
            std::thread::Builder::new()
                .name(format!("sim-gpu{i}"))
                .spawn(move || {
                    for s in l.incoming().flatten() {
                        let me = me.clone();
                        std::thread::spawn(move || me.serve_client(i, s));
                    }
                })?;
        }
        let ctl = control_socket(&self.run_dir);
        if let Some(d) = ctl.parent() {
            std::fs::create_dir_all(d)?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))?;
        }
        let _ = std::fs::remove_file(&ctl);
        let l = UnixListener::bind(&ctl)?;
        std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o600))?;
        // A test that removed its directory does not leave this daemon behind.
        let dir = self.run_dir.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            if !dir.exists() {
                std::process::exit(0);
            }
        });
        for s in l.incoming().flatten() {
            let me = self.clone();
            std::thread::spawn(move || me.serve_control(s));
        }
        Ok(())
    }

    fn serve_control(&self, s: UnixStream) {
        let Ok(r) = s.try_clone() else { return };
        let mut w = &s;
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { return };
            let reply = match serde_json::from_str::<SimRequest>(&line) {
                Ok(SimRequest::Subscribe) => {
                    if let Ok(c) = s.try_clone() {
                        self.subscribers
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(c);
                    }
                    return;
                }
                Ok(SimRequest::Quit) => {
                    let _ = writeln!(w, "{}", json(&SimReply::Ok));
                    self.shutdown();
                    std::process::exit(0);
                }
                Ok(req) => self.handle(req),
                Err(e) => SimReply::Error(format!("bad request: {e}")),
            };
            if writeln!(w, "{}", json(&reply)).is_err() {
                return;
            }
        }
    }

    fn handle(&self, req: SimRequest) -> SimReply {
        let r = match req {
            SimRequest::Ping => Ok(SimReply::Pong {
                gpus: self.gpus.len() as u32,
                pid: std::process::id(),
            }),
            SimRequest::State { gpu } => self.gpu(gpu).map(|m| {
                let mut g = lock(m);
                g.tick();
                SimReply::State(g.state)
            }),
            SimRequest::Clients { gpu } => self
                .gpu(gpu)
                .map(|m| SimReply::Clients(lock(m).clients.iter().map(|c| c.pid).collect())),
            SimRequest::Terminate { gpu, pid } => self.terminate(gpu, pid).map(|_| SimReply::Ok),
            SimRequest::Inject { gpu, xid, culprit } => {
                self.inject(gpu, xid, culprit).map(SimReply::Killed)
            }
            SimRequest::Recover { gpu } => self.recover(gpu).map(|_| SimReply::Ok),
            SimRequest::Subscribe | SimRequest::Quit => Ok(SimReply::Ok),
        };
        r.unwrap_or_else(SimReply::Error)
    }

    fn emit(&self, ev: SimEvent) {
        let line = json(&SimReply::Event(ev));
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        subs.retain(|s| writeln!(&*s, "{line}").is_ok());
    }

    /// A kernel-log line: kept in `<run_dir>/sim/kmsg.log` and sent to subscribers.
    fn emit_kmsg(&self, line: String) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.run_dir.join("sim").join("kmsg.log"))
        {
            let _ = writeln!(f, "{line}");
        }
        self.emit(SimEvent::Kmsg(line));
    }

    fn serve_client(&self, idx: usize, stream: UnixStream) {
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
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut g = lock(&self.gpus[idx]);
            g.tick();
            let mut w = &stream;
            match g.state {
                ServerState::Active | ServerState::Idle => {
                    let Ok(c) = stream.try_clone() else { return };
                    g.clients.push(Client {
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
        let mut g = lock(&self.gpus[idx]);
        g.clients.retain(|c| c.conn != conn);
        if let Some(pos) = g.faulted.iter().position(|c| *c == conn) {
            g.faulted.remove(pos);
            if g.faulted.is_empty() && g.state == ServerState::Fault {
                g.recover_at = Some(Instant::now() + self.recovery);
            }
        }
    }

    fn terminate(&self, gpu: u32, pid: u32) -> Result<(), String> {
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

    fn recover(&self, gpu: u32) -> Result<(), String> {
        let mut g = lock(self.gpu(gpu)?);
        if g.state == ServerState::Lost {
            if g.faulted.is_empty() {
                g.state = ServerState::Active;
                g.recover_at = None;
            } else {
                g.state = ServerState::Fault;
            }
        }
        Ok(())
    }

    fn inject(&self, gpu: u32, xid: u32, culprit: Option<u32>) -> Result<Vec<u32>, String> {
        let m = self.gpu(gpu)?;
        let class = self.classifier.class_of(xid);
        let mut g = lock(m);
        g.tick();
        let pci = g.info.pci;
        let first_client = g.clients.first().map(|c| c.pid);
        let isolated = self.isolation && class == FaultClass::AppMemory && culprit.is_some();
        let lost = class == FaultClass::DeviceLost;
        let (code, msg) = client_error(xid);
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
        self.emit(SimEvent::Nvml { gpu, xid: nvml_xid });
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

    fn shutdown(&self) {
        for m in &self.gpus {
            let g = lock(m);
            let _ = std::fs::remove_file(Path::new(&g.info.pipe_dir).join(SOCKET_NAME));
        }
        let _ = std::fs::remove_file(control_socket(&self.run_dir));
    }
}

pub fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// One request/reply on the control socket, bounded by `timeout`.
pub fn call(run_dir: &Path, req: &SimRequest, timeout: Duration) -> Result<SimReply, String> {
    let s = UnixStream::connect(control_socket(run_dir))
        .map_err(|e| format!("simulated GPU daemon not reachable: {e}"))?;
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    writeln!(&s, "{}", json(req)).map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&s)
        .read_line(&mut line)
        .map_err(|e| format!("simulated GPU daemon did not answer: {e}"))?;
    serde_json::from_str(&line).map_err(|e| format!("bad reply from simulated GPU daemon: {e}"))
}
