//! The simulated GPUs' daemon: fault domains (one simulated MPS server each) per GPU, their clients,
//! fault injection with the measured effects of `physics`, and the event stream to the agent.
//!
//! Modelled behaviour (KNOWLEDGE.md): a server in FAULT refuses new clients with 807 until every
//! faulted client has gone, then is ACTIVE again after `recovery`; an idle client of a faulted
//! server is not told at once (it would fail at its next GPU call) and holds the server in FAULT
//! while it lives; the kernel line of an Xid 31 names the GPU's *first* client, whatever server
//! faulted, and a 43 names an MPS server; the NVML-like event has no pid; a 13 also yields a 43.

use crate::physics::{self, Reach};
use crate::{
    control_socket, gpu_pci, gpu_uuid, json, DomainId, DomainInfo, DriverPatch, FaultTiming,
    SimEvent, SimReply, SimRequest, SERVER_MEMORY_BYTES, SOCKET_NAME,
};
use mpsr_proto::ServerState;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct Client {
    pid: u32,
    busy: bool,
    mem: u64,
    stream: UnixStream,
    conn: u64,
}

/// One simulated MPS control daemon and its server.
struct Server {
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    state: ServerState,
    clients: Vec<Client>,
    /// Faulted clients still connected (the server stays in FAULT while any remain).
    faulted: Vec<u64>,
    recover_at: Option<Instant>,
    stop: Arc<AtomicBool>,
    thread_pct: Option<u8>,
    mem_limit: Option<u64>,
    /// The control daemon answers nothing (`Hang`); `hang_for_good`: again after a restart.
    hung: bool,
    hang_for_good: bool,
}

/// Why the simulated daemon refused a request (sent to the agent as text: it is for people).
#[derive(Debug, thiserror::Error)]
enum SimError {
    #[error("no simulated GPU {0}")]
    NoGpu(u32),
    #[error("no simulated domain {0}")]
    NoDomain(DomainId),
    #[error("domain {domain} already serves {}", pipe_dir.display())]
    Serving { domain: DomainId, pipe_dir: PathBuf },
    #[error("domain {domain} still has {clients} clients")]
    HasClients { domain: DomainId, clients: usize },
    /// A hung control daemon: the real one answers nothing (the agent's command times out).
    #[error("domain {0}: control daemon not answering (simulated hang)")]
    Hung(DomainId),
    #[error("domain {domain}: {source}")]
    Io {
        domain: DomainId,
        source: std::io::Error,
    },
}

impl Server {
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

    fn log(&self, file: &str, line: &str) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(file))
        {
            let _ = writeln!(f, "[{}] {line}", stamp());
        }
    }

    fn info(&self, domain: DomainId) -> DomainInfo {
        let running = !self.clients.is_empty();
        DomainInfo {
            domain,
            state: self.state,
            clients: self.clients.iter().map(|c| c.pid).collect(),
            memory_bytes: if running { SERVER_MEMORY_BYTES } else { 0 }
                + self.clients.iter().map(|c| c.mem).sum::<u64>(),
            thread_pct: self.thread_pct,
            mem_limit: self.mem_limit,
        }
    }
}

/// One injected fault, as it unfolds.
struct Fault {
    gpu: u32,
    xid: u32,
    /// The servers it faults.
    slots: Vec<u32>,
    lost: bool,
    /// The GPU's first client (an Xid 31's kernel line names it, whoever faulted).
    first_client: Option<u32>,
}

/// The victims get their CUDA error (a simulated client exits on it).
fn tell_victims(victims: &[UnixStream], (code, msg): (u32, &str)) {
    for v in victims {
        let _ = writeln!(&*v, "FAULT {code} {msg}");
    }
}

fn stamp() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:03} simulated", t.as_secs(), t.subsec_millis())
}

struct Gpu {
    servers: BTreeMap<u32, Server>,
    lost: bool,
}

pub struct SimGpus {
    gpus: Vec<Mutex<Gpu>>,
    /// The driver patch's phase, for an Xid 31 with a known culprit.
    driver_patch: DriverPatch,
    timing: FaultTiming,
    recovery: Duration,
    run_dir: PathBuf,
    next_conn: AtomicU64,
    subscribers: Mutex<Vec<UnixStream>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in one connection thread must not take the simulated GPUs down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn peer(s: &UnixStream) -> Option<mpsr_proto::PeerCred> {
    mpsr_proto::peer_cred(s).ok()
}

impl SimGpus {
    pub fn new(
        n: u32,
        run_dir: &Path,
        driver_patch: DriverPatch,
        timing: FaultTiming,
        recovery_ms: u64,
    ) -> SimGpus {
        SimGpus {
            gpus: (0..n)
                .map(|_| {
                    Mutex::new(Gpu {
                        servers: BTreeMap::new(),
                        lost: false,
                    })
                })
                .collect(),
            driver_patch,
            timing,
            recovery: Duration::from_millis(recovery_ms),
            run_dir: run_dir.to_path_buf(),
            next_conn: AtomicU64::new(0),
            subscribers: Mutex::new(Vec::new()),
        }
    }

    fn gpu(&self, gpu: u32) -> Result<&Mutex<Gpu>, SimError> {
        self.gpus.get(gpu as usize).ok_or(SimError::NoGpu(gpu))
    }

    /// Serves the control socket until `Quit` (or until the run dir disappears).
    pub fn serve(self: Arc<Self>) -> std::io::Result<()> {
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

    fn serve_control(self: Arc<Self>, s: UnixStream) {
        let Ok(r) = s.try_clone() else { return };
        let mut w = &s;
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { return };
            let reply = match serde_json::from_str::<SimRequest>(&line) {
                Ok(SimRequest::Subscribe) => {
                    if let Ok(c) = s.try_clone() {
                        lock(&self.subscribers).push(c);
                    }
                    return;
                }
                Ok(SimRequest::Quit) => {
                    let _ = writeln!(w, "{}", json(&SimReply::Ok));
                    self.shutdown();
                    std::process::exit(0);
                }
                Ok(req) => self.clone().handle(req),
                Err(e) => SimReply::Error(format!("bad request: {e}")),
            };
            if writeln!(w, "{}", json(&reply)).is_err() {
                return;
            }
        }
    }

    fn handle(self: Arc<Self>, req: SimRequest) -> SimReply {
        let r = match req {
            SimRequest::Ping => Ok(SimReply::Pong {
                gpus: self.gpus.len() as u32,
                pid: std::process::id(),
            }),
            SimRequest::StartDomain {
                domain,
                pipe_dir,
                log_dir,
                owner_uid,
                thread_pct,
                mem_limit,
            } => self
                .start_domain(domain, pipe_dir, log_dir, owner_uid, thread_pct, mem_limit)
                .map(|_| SimReply::Ok),
            SimRequest::StopDomain { domain } => self.stop_domain(domain).map(|_| SimReply::Ok),
            SimRequest::Domains { gpu } => self.gpu(gpu).map(|m| {
                let mut g = lock(m);
                SimReply::Domains(
                    g.servers
                        .iter_mut()
                        .map(|(slot, s)| {
                            s.tick();
                            s.info(DomainId { gpu, slot: *slot })
                        })
                        .collect(),
                )
            }),
            SimRequest::State { domain } => self
                .with_server(domain, |s, lost| {
                    s.tick();
                    if s.hung {
                        ServerState::Down
                    } else if lost {
                        ServerState::Lost
                    } else {
                        s.state
                    }
                })
                .map(SimReply::State)
                .or(Ok(SimReply::State(ServerState::Down))),
            SimRequest::Clients { domain } => self
                .with_server(domain, |s, _| {
                    (!s.hung).then(|| s.clients.iter().map(|c| c.pid).collect())
                })
                .and_then(|c| c.ok_or(SimError::Hung(domain)))
                .map(SimReply::Clients),
            SimRequest::Terminate { domain, pid } => {
                self.terminate(domain, pid).map(|_| SimReply::Ok)
            }
            SimRequest::Inject {
                gpu,
                xid,
                culprit,
                slot,
            } => self.inject(gpu, xid, culprit, slot).map(SimReply::Killed),
            SimRequest::Recover { gpu } => self.recover(gpu).map(|_| SimReply::Ok),
            SimRequest::Hang { domain, for_good } => self
                .with_server(domain, |s, _| {
                    s.hung = true;
                    s.hang_for_good = for_good;
                    s.log("control.log", "control daemon hangs (simulated)");
                })
                .map(|_| SimReply::Ok),
            SimRequest::KillServer { domain } => self.kill_server(domain).map(SimReply::Killed),
            SimRequest::RestartDaemon { domain } => {
                self.restart_daemon(domain).map(|_| SimReply::Ok)
            }
            SimRequest::KernelLine { line } => {
                self.emit_kmsg(line);
                Ok(SimReply::Ok)
            }
            SimRequest::Subscribe | SimRequest::Quit => Ok(SimReply::Ok),
        };
        r.unwrap_or_else(|e| SimReply::Error(e.to_string()))
    }

    fn with_server<T>(
        &self,
        d: DomainId,
        f: impl FnOnce(&mut Server, bool) -> T,
    ) -> Result<T, SimError> {
        let mut g = lock(self.gpu(d.gpu)?);
        let lost = g.lost;
        let s = g.servers.get_mut(&d.slot).ok_or(SimError::NoDomain(d))?;
        Ok(f(s, lost))
    }

    fn start_domain(
        self: Arc<Self>,
        domain: DomainId,
        pipe_dir: PathBuf,
        log_dir: PathBuf,
        owner_uid: Option<u32>,
        thread_pct: Option<u8>,
        mem_limit: Option<u64>,
    ) -> Result<(), SimError> {
        let mut g = lock(self.gpu(domain.gpu)?);
        if let Some(s) = g.servers.get(&domain.slot) {
            if s.hung {
                return Err(SimError::Hung(domain));
            }
            if s.pipe_dir == pipe_dir {
                return Ok(()); // already serving, like a control daemon that answers
            }
            return Err(SimError::Serving {
                domain,
                pipe_dir: s.pipe_dir.clone(),
            });
        }
        let io = |source| SimError::Io { domain, source };
        for d in [&pipe_dir, &log_dir] {
            std::fs::create_dir_all(d).map_err(io)?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).map_err(io)?;
        }
        let sock = pipe_dir.join(SOCKET_NAME);
        let _ = std::fs::remove_file(&sock);
        let l = UnixListener::bind(&sock).map_err(io)?;
        // Any user may reach a shared pipe directory; an owned one only its owner (and root).
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).map_err(io)?;
        if let Some(uid) = owner_uid {
            std::os::unix::fs::chown(&pipe_dir, Some(uid), None).map_err(io)?;
            std::fs::set_permissions(&pipe_dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io)?;
        }
        l.set_nonblocking(true).map_err(io)?;
        let stop = Arc::new(AtomicBool::new(false));
        let server = Server {
            pipe_dir,
            log_dir,
            state: ServerState::Active,
            clients: Vec::new(),
            faulted: Vec::new(),
            recover_at: None,
            stop: stop.clone(),
            thread_pct,
            mem_limit,
            hung: false,
            hang_for_good: false,
        };
        server.log(
            "control.log",
            &format!(
                "Control {}: simulated MPS control daemon for {domain} ({}) started",
                std::process::id(),
                gpu_uuid(domain.gpu)
            ),
        );
        g.servers.insert(domain.slot, server);
        drop(g);
        let me = self.clone();
        std::thread::Builder::new()
            .name(format!("sim-{domain}"))
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((s, _)) => {
                            let me = me.clone();
                            let _ = s.set_nonblocking(false);
                            std::thread::spawn(move || me.serve_client(domain, s));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
            .map_err(io)?;
        Ok(())
    }

    fn stop_domain(&self, domain: DomainId) -> Result<(), SimError> {
        let mut g = lock(self.gpu(domain.gpu)?);
        let Some(s) = g.servers.get(&domain.slot) else {
            return Ok(()); // already stopped
        };
        if s.hung {
            return Err(SimError::Hung(domain));
        }
        if !s.clients.is_empty() {
            return Err(SimError::HasClients {
                domain,
                clients: s.clients.len(),
            });
        }
        s.stop.store(true, Ordering::Relaxed);
        let _ = std::fs::remove_file(s.pipe_dir.join(SOCKET_NAME));
        s.log("control.log", "Cmd:quit (simulated)");
        g.servers.remove(&domain.slot);
        Ok(())
    }

    fn emit(&self, ev: SimEvent) {
        let line = json(&SimReply::Event(ev));
        lock(&self.subscribers).retain(|s| writeln!(&*s, "{line}").is_ok());
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

    fn serve_client(&self, domain: DomainId, stream: UnixStream) {
        let pid = peer(&stream).map(|c| c.pid).unwrap_or(0);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut reader = BufReader::new(match stream.try_clone() {
            Ok(s) => s,
            Err(_) => return,
        });
        let mut hello = String::new();
        if reader.read_line(&mut hello).is_err() {
            return;
        }
        // `HELLO busy|idle [MEM_BYTES]`
        let mut words = hello.split_whitespace().skip(1);
        let busy = words.next() != Some("idle");
        let mem = words.next().and_then(|m| m.parse().ok()).unwrap_or(0);
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let Ok(m) = self.gpu(domain.gpu) else { return };
            let mut g = lock(m);
            let lost = g.lost;
            let Some(s) = g.servers.get_mut(&domain.slot) else {
                return;
            };
            s.tick();
            let mut w = &stream;
            if lost {
                let _ = writeln!(w, "ERR 999 simulated GPU is lost (needs reset)");
                return;
            }
            if s.hung {
                let _ = writeln!(w, "ERR 805 MPS control daemon not answering (simulated)");
                return;
            }
            if s.state == ServerState::Fault {
                let _ = writeln!(w, "ERR 807 MPS server is not ready (simulated)");
                return;
            }
            let Ok(c) = stream.try_clone() else { return };
            s.clients.push(Client {
                pid,
                busy,
                mem,
                stream: c,
                conn,
            });
            s.state = ServerState::Active;
            let _ = writeln!(w, "OK {} simulated-{domain}", std::process::id());
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
        let Ok(m) = self.gpu(domain.gpu) else { return };
        let mut g = lock(m);
        let Some(s) = g.servers.get_mut(&domain.slot) else {
            return;
        };
        s.clients.retain(|c| c.conn != conn);
        if s.faulted.contains(&conn) {
            s.faulted.retain(|c| *c != conn);
            if s.faulted.is_empty() && s.state == ServerState::Fault {
                s.recover_at = Some(Instant::now() + self.recovery);
            }
        }
    }

    /// `terminate_client`: a busy client is ended; an idle one only at its next GPU call, which
    /// a sleeping simulated client never makes (measured: the server stayed in FAULT 3 s longer).
    fn terminate(&self, domain: DomainId, pid: u32) -> Result<(), SimError> {
        self.with_server(domain, |s, _| {
            if s.hung {
                return Err(SimError::Hung(domain));
            }
            let Some(c) = s.clients.iter().find(|c| c.pid == pid) else {
                return Ok(()); // already gone: terminating is idempotent
            };
            s.log("control.log", &format!("Cmd:terminate_client {pid}"));
            if c.busy {
                let _ = writeln!(
                    &c.stream,
                    "TERMINATED the MPS client has been terminated by the server"
                );
                let _ = c.stream.shutdown(std::net::Shutdown::Write);
            }
            Ok(())
        })?
    }

    /// The server process is killed: every client loses it (told as a CUDA client would be, its
    /// connection closed), nothing poisoned remains, and the next client gets a fresh server.
    fn kill_server(&self, domain: DomainId) -> Result<Vec<u32>, SimError> {
        self.with_server(domain, |s, _| {
            let gone: Vec<u32> = s.clients.iter().map(|c| c.pid).collect();
            for c in s.clients.drain(..) {
                let _ = writeln!(&c.stream, "FAULT 999 MPS server exited [simulated]");
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
            }
            s.faulted.clear();
            s.recover_at = None;
            s.state = ServerState::Idle;
            s.log(
                "control.log",
                &format!("Server {} exited with status 9", std::process::id()),
            );
            gone
        })
    }

    /// The control daemon (hung or not) and its server are killed and the daemon started again.
    fn restart_daemon(&self, domain: DomainId) -> Result<(), SimError> {
        self.kill_server(domain)?;
        self.with_server(domain, |s, _| {
            s.hung = s.hang_for_good;
            s.state = ServerState::Active;
            s.log("control.log", "control daemon started again (simulated)");
        })
    }

    fn recover(&self, gpu: u32) -> Result<(), SimError> {
        let mut g = lock(self.gpu(gpu)?);
        if g.lost {
            g.lost = false;
            for s in g.servers.values_mut() {
                if s.faulted.is_empty() {
                    s.state = ServerState::Active;
                    s.recover_at = None;
                } else {
                    s.state = ServerState::Fault;
                }
            }
        }
        Ok(())
    }

    /// Faults one server (or all, by reach) and returns the pids of the clients killed at once.
    fn inject(
        self: &Arc<Self>,
        gpu: u32,
        xid: u32,
        culprit: Option<u32>,
        slot: Option<u32>,
    ) -> Result<Vec<u32>, SimError> {
        if self.contained_by_the_patch(gpu, xid, culprit) {
            // Mapped to a scratch page and replayed: no cancel, so no Xid, no NVML event, no
            // server fault; the culprit runs on until it is terminated.
            return Ok(Vec::new());
        }
        let (fault, killed) = self.fault_of(gpu, xid, culprit, slot)?;
        self.deliver(fault);
        Ok(killed)
    }

    /// An MMU fault whose VA space the patched nvidia-uvm knows (driver-patch/): its isolation
    /// line is printed (before the cancel that makes the firmware report the Xid). Whether the
    /// patch contained it.
    fn contained_by_the_patch(&self, gpu: u32, xid: u32, culprit: Option<u32>) -> bool {
        let pid = match culprit {
            Some(pid) if xid == 31 && self.driver_patch != DriverPatch::Off => pid,
            _ => return false,
        };
        let contained = self.driver_patch == DriverPatch::Containment;
        self.emit_kmsg(format!(
            "NVRM: mpsr-isolate (PCI:{}): xid=31 culprit_pid={pid} contained={} engine=GRAPHICS veid=1 addr=0x7f0000001000 access=WRITE type=INVALID_PDE comm=simclient (simulated)",
            gpu_pci(gpu),
            u8::from(contained)
        ));
        contained
    }

    /// Which servers the fault reaches (the one the faulting work ran in, or all) and the
    /// clients it kills at once: the busy ones (every client of a lost GPU).
    fn fault_of(
        &self,
        gpu: u32,
        xid: u32,
        culprit: Option<u32>,
        slot: Option<u32>,
    ) -> Result<(Fault, Vec<u32>), SimError> {
        let effect = physics::effect(xid);
        let g = lock(self.gpu(gpu)?);
        let origin = slot
            .or_else(|| {
                culprit.and_then(|p| {
                    g.servers
                        .iter()
                        .find(|(_, s)| s.clients.iter().any(|c| c.pid == p))
                        .map(|(k, _)| *k)
                })
            })
            .unwrap_or(0);
        if !g.servers.contains_key(&origin) && effect.reach == Reach::Server {
            return Err(SimError::NoDomain(DomainId { gpu, slot: origin }));
        }
        let first_client = g
            .servers
            .values()
            .flat_map(|s| s.clients.iter())
            .min_by_key(|c| c.conn)
            .map(|c| c.pid);
        let lost = effect.reach == Reach::Lost;
        let slots: Vec<u32> = g
            .servers
            .keys()
            .copied()
            .filter(|k| match effect.reach {
                Reach::Nobody => false,
                Reach::Server => *k == origin,
                Reach::Gpu | Reach::Lost => true,
            })
            .collect();
        let killed: Vec<u32> = slots
            .iter()
            .filter_map(|k| g.servers.get(k))
            .flat_map(|s| s.clients.iter())
            .filter(|c| c.busy || lost)
            .map(|c| c.pid)
            .collect();
        let fault = Fault {
            gpu,
            xid,
            slots,
            lost,
            first_client,
        };
        Ok((fault, killed))
    }

    /// The fault strikes and is reported: at once, or with the delays measured on an H200.
    fn deliver(self: &Arc<Self>, fault: Fault) {
        match self.timing {
            FaultTiming::Instant => {
                self.strike(&fault, true);
                self.report(&fault);
            }
            FaultTiming::Measured => {
                let t = physics::timing(fault.xid);
                let me = self.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(t.report_ms));
                    let victims = me.strike(&fault, false);
                    me.report(&fault);
                    std::thread::sleep(Duration::from_millis(
                        t.victims_ms.saturating_sub(t.report_ms),
                    ));
                    tell_victims(&victims, physics::effect(fault.xid).cuda);
                });
            }
        }
    }

    /// The fault hits its servers: each goes to FAULT with its clients poisoned (the server.log
    /// lines are written); the victims' streams are returned, or told at once with `now`.
    fn strike(&self, f: &Fault, now: bool) -> Vec<UnixStream> {
        let effect = physics::effect(f.xid);
        let Ok(m) = self.gpu(f.gpu) else {
            return Vec::new();
        };
        let mut g = lock(m);
        let mut victims = Vec::new();
        for k in &f.slots {
            let Some(s) = g.servers.get_mut(k) else {
                continue;
            };
            let mut poisoned = Vec::new();
            for c in &s.clients {
                poisoned.push(c.conn);
                if c.busy || f.lost {
                    victims.extend(c.stream.try_clone().ok());
                }
                s.log(
                    "server.log",
                    &format!(
                        "Server {}: Client {{PID: {}, Context: 1}} encountered a fatal GPU error.",
                        std::process::id(),
                        c.pid
                    ),
                );
            }
            s.log(
                "server.log",
                &format!(
                    "Server {}: Server is handling a fatal GPU error.",
                    std::process::id()
                ),
            );
            // A client poisoned by an earlier fault that it has not died of yet is one client.
            poisoned.retain(|c| !s.faulted.contains(c));
            s.faulted.extend(poisoned);
            s.state = ServerState::Fault;
            s.recover_at = if s.faulted.is_empty() {
                Some(Instant::now() + self.recovery)
            } else {
                None
            };
        }
        if f.lost {
            g.lost = true;
        }
        drop(g);
        if now {
            tell_victims(&victims, effect.cuda);
            return Vec::new();
        }
        victims
    }

    /// The driver's report of a fault: the NVML-like event and the kernel lines.
    fn report(&self, f: &Fault) {
        let effect = physics::effect(f.xid);
        let (gpu, xid) = (f.gpu, f.xid);
        let pci = gpu_pci(gpu);
        // The NVML-like event: an Xid and a device, never a pid. A misaligned store reports 43 there.
        let nvml_xid = if xid == 13 { 43 } else { xid };
        self.emit(SimEvent::Nvml { gpu, xid: nvml_xid });
        // Kernel lines with the attribution measured under MPS (never the faulting process).
        let server_pid = std::process::id();
        let unknown = "'<unknown>'".to_string();
        let (pid, name) = match xid {
            31 => (
                f.first_client.map(|p| p.to_string()).unwrap_or(unknown),
                "simclient",
            ),
            43 => (server_pid.to_string(), "nvidia-cuda-mps"),
            _ => (unknown, "<unknown>"),
        };
        let line = if xid == 13 {
            format!(
                "NVRM: Xid (PCI:{pci}): 13, {} (simulated)",
                effect.kernel_text
            )
        } else {
            format!(
                "NVRM: Xid (PCI:{pci}): {xid}, pid={pid}, name={name}, {} (simulated)",
                effect.kernel_text
            )
        };
        self.emit_kmsg(line);
        if xid == 13 {
            self.emit_kmsg(format!(
                "NVRM: Xid (PCI:{pci}): 43, pid={server_pid}, name=nvidia-cuda-mps, channel 0x0000000a (simulated)"
            ));
        }
    }

    fn shutdown(&self) {
        for m in &self.gpus {
            for s in lock(m).servers.values() {
                s.stop.store(true, Ordering::Relaxed);
                let _ = std::fs::remove_file(s.pipe_dir.join(SOCKET_NAME));
            }
        }
        let _ = std::fs::remove_file(control_socket(&self.run_dir));
    }
}
