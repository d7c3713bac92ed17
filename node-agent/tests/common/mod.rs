//! What the agent's integration tests share: `Env` (the agent as a real process with the sim
//! backend, scontrol/squeue/sinfo replaced by recording scripts), client processes that really
//! die, and helpers. Each topic file uses a part of it.
// Each topic file uses a part of these helpers and of the names re-exported here.
#![allow(dead_code, unused_imports)]

pub use mpsr_proto::{
    Client, CulpritEvidence, DomainId, EscalationRung, FaultAction, FaultClass, FaultOutcome, Mode,
    Registration, Request, Response, ServerState, SignalSource,
};
pub use mpsr_test_support::skip;
pub use std::collections::BTreeSet;
pub use std::io::Write;
pub use std::os::unix::process::CommandExt;
pub use std::path::{Path, PathBuf};
pub use std::process::{Child, Command, Stdio};
pub use std::time::{Duration, Instant};

pub struct Env {
    pub dir: tempfile::TempDir,
    pub agent: Option<Child>,
    /// Extra environment of the agent process (e.g. a faked wall clock).
    pub agent_env: Vec<(String, String)>,
}

impl Env {
    pub fn new(extra: &str) -> Env {
        Env::with("", "", extra)
    }

    /// `top`: top-level keys; `mps`: keys of [mps]; `extra`: further tables.
    pub fn with(top: &str, mps: &str, extra: &str) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let shim = d.join("scontrol");
        std::fs::write(
            &shim,
            // `hold-before`: a requeue waits, then fails having done nothing; `hold-after`: it is
            // done, then the call waits (an agent killed meanwhile never hears of it).
            format!("#!/bin/sh\nD={}\nL=$D/scontrol.log\ncase \"$1 $2\" in\n  'show job') echo \"JobId=$3 JobState=RUNNING Restarts=$(grep -c \"^requeue $3\\$\" $L)\";;\n  'show node') echo 'NodeName=n1 State=IDLE ThreadsPerCore=1';;\n  'requeue '*)\n    if [ -e $D/hold-before ]; then touch $D/holding; while [ -e $D/hold-before ]; do sleep 0.05; done; exit 1; fi\n    echo \"$@\" >> $L\n    if [ -e $D/hold-after ]; then touch $D/holding; while [ -e $D/hold-after ]; do sleep 0.05; done; fi;;\n  *) echo \"$@\" >> $L;;\nesac\nexit 0\n", d.display()),
        )
        .unwrap();
        std::fs::set_permissions(&shim, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // squeue --json: every job listed, with no AdminComment yet; squeue -O: running, with
        // as many restarts as requeues were logged. sinfo: the node idle.
        let squeue = d.join("squeue");
        std::fs::write(
            &squeue,
            format!("#!/bin/sh\nL={}/scontrol.log\n[ \"$1\" = --json ] && echo \"{{\\\"jobs\\\":[{{\\\"job_id\\\":$4,\\\"admin_comment\\\":\\\"\\\"}}]}}\"\n[ \"$1\" = -h ] && echo \"$4|RUNNING|N/A|1|1|$(grep -c \"^requeue $4\\$\" $L 2>/dev/null)|\"\nexit 0\n", d.display()),
        )
        .unwrap();
        std::fs::set_permissions(&squeue, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let sinfo = d.join("sinfo");
        std::fs::write(&sinfo, "#!/bin/sh\necho 'idle|none|'\n").unwrap();
        std::fs::set_permissions(&sinfo, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        std::fs::write(
            d.join("agent.toml"),
            format!(
                "backend = \"sim\"\nsocket = \"{0}/run/agent.sock\"\nstate_dir = \"{0}/state\"\nrun_dir = \"{0}/run\"\nnode_name = \"n1\"\n{top}[log]\ntarget = \"stderr\"\n[slurm]\nscontrol = \"{0}/scontrol\"\nsqueue = \"{0}/squeue\"\nsinfo = \"{0}/sinfo\"\nretry_backoff_ms = 50\n[mps]\nfault_grace_ms = 300\nquit_on_shutdown = true\n{mps}[faults]\nkmsg = false\n{extra}",
                d.display()
            ),
        )
        .unwrap();
        let mut e = Env {
            dir,
            agent: None,
            agent_env: Vec::new(),
        };
        e.start_agent();
        e
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn start_agent(&mut self) {
        let log = std::fs::File::create(
            self.path()
                .join(format!("agent-{}.log", Instant::now().elapsed().as_nanos())),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_mpsr-agent"))
            .arg("--config")
            .arg(self.path().join("agent.toml"))
            .envs(self.agent_env.iter().map(|(k, v)| (k, v)))
            .stderr(log)
            .spawn()
            .unwrap();
        self.agent = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(
                self.call(&Request::Hello {
                    version: mpsr_proto::PROTOCOL_VERSION,
                }),
                Ok(Response::Hello { .. })
            ) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("agent did not come up");
    }

    pub fn kill_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn sock(&self) -> PathBuf {
        self.path().join("run/agent.sock")
    }

    pub fn call(&self, r: &Request) -> Result<Response, mpsr_proto::ClientError> {
        Client::new(self.sock(), Duration::from_secs(5)).call(r)
    }

    #[allow(clippy::zombie_processes)] // reaped by Proc's Drop
    pub fn client(&self, gpu: u32, secs: f64, idle: bool) -> Proc {
        let mut c = Command::new(simclient());
        c.arg("--seconds").arg(secs.to_string());
        if idle {
            c.arg("--idle");
        }
        let child = c
            .env(
                "CUDA_MPS_PIPE_DIRECTORY",
                self.path().join(format!("run/gpu{gpu}/pipe")),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the simulated server lists it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Response::Status(s)) = self.call(&Request::Status) {
                if s.gpus[gpu as usize].clients.contains(&child.id()) {
                    return Proc(child);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("client did not attach");
    }

    pub fn register(&self, job: u32, pid: u32, gpus: &[u32], mode: Mode, batch: bool) {
        let r = self
            .call(&Request::Register(reg(job, pid, gpus, mode, batch)))
            .unwrap();
        assert!(
            matches!(r, Response::Registered { .. }),
            "register job {job}: {r:?}"
        );
    }

    /// Injects a simulated fault (`slot`: the domain whose server faults); the clients it killed.
    pub fn inject(&self, gpu: u32, xid: u32, culprit: Option<u32>, slot: Option<u32>) -> Vec<u32> {
        match self
            .call(&Request::SimInject {
                gpu,
                xid,
                culprit,
                slot,
            })
            .unwrap()
        {
            Response::Injected { killed, .. } => killed,
            r => panic!("inject: {r:?}"),
        }
    }

    /// Waits until everything signalled before now has been decided and acted on: an
    /// informational Xid 63 on `gpu` (not one an earlier fault's window would take in) goes
    /// through the same reader after every earlier line; once it is decided and no Slurm action is
    /// pending, whatever an earlier line would lead to has happened. A condition, not a sleep, for
    /// the "nothing twice" assertions.
    pub fn barrier(&self, gpu: u32) {
        let markers = |e: &Env| e.events().iter().filter(|r| r.xids == [63]).count();
        let before = markers(self);
        self.inject(gpu, 63, None, None);
        self.wait_for("the barrier decided and no action pending", |e| {
            markers(e) > before && status(e).pending_actions == 0
        });
    }

    /// The decisions but the barriers' (see `barrier`).
    pub fn faults(&self) -> Vec<mpsr_proto::DecisionRecord> {
        let mut v = self.events();
        v.retain(|r| r.xids != [63]);
        v
    }

    pub fn events(&self) -> Vec<mpsr_proto::DecisionRecord> {
        match self.call(&Request::Events { limit: 100 }).unwrap() {
            Response::Events { events, .. } => events,
            r => panic!("{r:?}"),
        }
    }

    pub fn wait_for(&self, what: &str, f: impl Fn(&Env) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if f(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let events: Vec<String> = self
            .call(&Request::Events { limit: 5 })
            .map(|r| match r {
                Response::Events { events, .. } => events.iter().map(|e| e.to_string()).collect(),
                _ => Vec::new(),
            })
            .unwrap_or_default();
        // The last agent's log, for the reader of a failure.
        let mut logs: Vec<PathBuf> = std::fs::read_dir(self.path())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        logs.retain(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("agent-"))
        });
        logs.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        let log = logs
            .last()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        let tail: String = log
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        panic!(
            "timed out waiting for {what}; scontrol log: {:?}; events: {events:#?}\nagent log (last lines):\n{tail}",
            self.scontrol_log()
        );
    }

    pub fn scontrol_log(&self) -> String {
        std::fs::read_to_string(self.path().join("scontrol.log")).unwrap_or_default()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // A clean stop also stops the simulated GPU daemon (quit_on_shutdown = true).
        if let Some(mut c) = self.agent.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A child process that is killed and reaped when the test lets go of it (also on panic).
pub struct Proc(pub Child);

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn reg(job: u32, pid: u32, gpus: &[u32], mode: Mode, batch: bool) -> Registration {
    Registration {
        job_id: job,
        step_id: if batch { mpsr_proto::BATCH_STEP } else { 0 },
        pid,
        uid: None,
        gpus: gpus.to_vec(),
        mode,
        batch,
        threads_pct: None,
        mem_limit: None,
        restart_count: 0,
        isolation: None,
    }
}

/// The simulated MPS client, built next to the agent (crate mpsr-simgpu).
pub fn simclient() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_mpsr-agent")).with_file_name("mpsr-simclient")
}

pub fn exit_code(c: &mut Child, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(s) = c.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

impl Env {
    pub fn client_raw(&self, gpu: u32) -> Proc {
        Proc(
            Command::new(simclient())
                .args(["--seconds", "0.1"])
                .env(
                    "CUDA_MPS_PIPE_DIRECTORY",
                    self.path().join(format!("run/gpu{gpu}/pipe")),
                )
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }
}

/// A task as slurmstepd starts one: registered first (the agent places it in a fault domain), then
/// it becomes the MPS client of that domain's server (same pid: `exec`).
pub struct Gated {
    pub proc: Proc,
    pub domain: mpsr_proto::DomainId,
}

impl Env {
    pub fn placed_client(
        &self,
        job: u32,
        isolation: Option<mpsr_proto::Isolation>,
        secs: u32,
    ) -> Gated {
        self.placed_client_as(job, isolation, secs, None)
    }

    /// As slurmstepd registers a task of a job owned by `uid` (None: the caller's).
    pub fn placed_client_as(
        &self,
        job: u32,
        isolation: Option<mpsr_proto::Isolation>,
        secs: u32,
        uid: Option<u32>,
    ) -> Gated {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "read d; CUDA_MPS_PIPE_DIRECTORY=\"$d\" exec {} --seconds {secs}",
                simclient().display()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut r = reg(job, child.id(), &[0], Mode::Requeue, true);
        r.isolation = isolation;
        r.uid = uid;
        let ctx = match self.call(&Request::Register(r)).unwrap() {
            Response::Registered { contexts } => contexts.into_iter().next().unwrap(),
            other => panic!("register job {job}: {other:?}"),
        };
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{}", ctx.pipe_dir).unwrap();
        let (pid, domain) = (child.id(), ctx.domain);
        self.wait_for("client attached to its domain", |e| {
            e.domain(domain).is_some_and(|d| d.clients.contains(&pid))
        });
        Gated {
            proc: Proc(child),
            domain,
        }
    }

    pub fn domain(&self, id: mpsr_proto::DomainId) -> Option<mpsr_proto::DomainStatus> {
        let Ok(Response::Status(s)) = self.call(&Request::Status) else {
            return None;
        };
        s.gpus
            .get(id.gpu as usize)?
            .domains
            .iter()
            .find(|d| d.domain == id)
            .cloned()
    }
}

pub fn uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

/// Decision records as a user may see them: job 91 alone, no actions, outcomes or pids.
pub fn names_only_job_91(records: &serde_json::Value) {
    let records = records.as_array().expect("a list of decisions");
    assert!(!records.is_empty());
    for r in records {
        assert_eq!(r["hit_jobs"], serde_json::json!([91]), "{r}");
        assert_eq!(r["spared_jobs"], serde_json::json!([]), "{r}");
        assert_eq!(r["actions"], serde_json::json!([]), "{r}");
        assert_eq!(r["outcome"], serde_json::json!([]), "{r}");
        assert_eq!(r["outcomes"], serde_json::json!([]), "{r}");
        assert!(r["reported_pid"].is_null() && r["culprit"].is_null(), "{r}");
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn http_get(port: u16, path: &str) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(out)
}

impl Env {
    pub fn telemetry(&self) -> mpsr_proto::TelemetryReply {
        match self.call(&Request::Telemetry).unwrap() {
            Response::Telemetry(t) => *t,
            r => panic!("{r:?}"),
        }
    }
    pub fn pathologies(&self) -> Vec<mpsr_proto::PathologyRecord> {
        match self.call(&Request::Events { limit: 100 }).unwrap() {
            Response::Events { pathologies, .. } => pathologies,
            r => panic!("{r:?}"),
        }
    }
    pub fn health(&self) -> mpsr_proto::HealthReply {
        match self.call(&Request::Health).unwrap() {
            Response::Health(h) => h,
            r => panic!("{r:?}"),
        }
    }
    pub fn pathology(&self, gpu: u32, what: &str, pid: Option<u32>, secs: u32) {
        let r = self
            .call(&Request::SimPathology {
                gpu,
                what: serde_json::from_value(serde_json::json!(what)).unwrap(),
                pid,
                secs,
            })
            .unwrap();
        assert_eq!(r, Response::Ok);
    }
}

pub fn status(e: &Env) -> mpsr_proto::StatusReply {
    match e.call(&Request::Status).unwrap() {
        Response::Status(s) => s,
        r => panic!("{r:?}"),
    }
}

/// Unmounts a test's tmpfs even when the test fails.
pub struct Mount(pub PathBuf);

impl Mount {
    pub fn tmpfs(at: &Path, size: &str) -> Option<Mount> {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Mount(at.to_path_buf()))
    }

    pub fn remount(&self, opt: &str) {
        let s = Command::new("mount")
            .args(["-o", &format!("remount,{opt}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(s.success(), "remount {opt}");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// One entry of journald's native protocol: `NAME=value\n`, or `NAME\n` + little-endian u64
/// length + value + `\n` for values that may hold newlines.
pub fn journal_fields(mut b: &[u8]) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    while let Some(nl) = b.iter().position(|c| *c == b'\n') {
        let line = &b[..nl];
        if let Some(eq) = line.iter().position(|c| *c == b'=') {
            out.insert(
                String::from_utf8_lossy(&line[..eq]).into_owned(),
                String::from_utf8_lossy(&line[eq + 1..]).into_owned(),
            );
            b = &b[nl + 1..];
        } else {
            let rest = &b[nl + 1..];
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            out.insert(
                String::from_utf8_lossy(line).into_owned(),
                String::from_utf8_lossy(&rest[8..8 + len]).into_owned(),
            );
            b = &rest[(8 + len + 1).min(rest.len())..];
        }
    }
    out
}

/// A resume-mode task under mpsr-run with a hot standby (`MPSR_STANDBY=1`, as `--mps-standby`
/// sets it): the standby waits as an idle client of the GPU's standby domain; a fault in the
/// shared server ends the primary and releases the standby at the decision, mpsr-run adopts it
/// (no restart); the job's other neighbour is requeued as usual. Returns the env, mpsr-run and
/// its stderr file.
pub fn standby_task(e: &Env, job: u32) -> (Proc, PathBuf) {
    standby_task_of(e, job, "1")
}

/// As `standby_task`, with `MPSR_STANDBY` set to `kind` (`1`/`hot` or `warm`).
pub fn standby_task_of(e: &Env, job: u32, kind: &str) -> (Proc, PathBuf) {
    supervised_task(e, job, Some(kind))
}

/// A resume-mode task under mpsr-run in the GPU's shared domain, with a standby of `kind` (the
/// value of `MPSR_STANDBY`) or none; mpsr-run and its stderr file.
pub fn supervised_task(e: &Env, job: u32, kind: Option<&str>) -> (Proc, PathBuf) {
    let run = Path::new(env!("CARGO_BIN_EXE_mpsr-agent")).with_file_name("mpsr-run");
    let err = e.path().join(format!("mpsr-run-{job}.err"));
    // Registered (as slurmstepd does before the task execs) before mpsr-run asks for a standby.
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "sleep 0.5; exec {} --backoff-ms 0 -- {} --seconds 60",
            run.display(),
            simclient().display()
        ))
        .env("SLURM_JOB_ID", job.to_string())
        .env("SLURM_STEP_ID", "0")
        .env("MPSR_SOCKET", e.sock())
        .env("CUDA_MPS_PIPE_DIRECTORY", e.path().join("run/gpu0/pipe"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap());
    if let Some(kind) = kind {
        c.env("MPSR_STANDBY", kind);
    }
    let sup = Proc(c.spawn().unwrap());
    e.register(job, sup.id(), &[0], Mode::Resume, false);
    (sup, err)
}

/// The armed standby of a job's task, as status shows it.
pub fn armed_standby(e: &Env, job: u32) -> Option<u32> {
    match e.call(&Request::Status).ok()? {
        Response::Status(s) => s
            .tasks
            .iter()
            .find(|t| t.job_id == job)
            .and_then(|t| t.standby.map(|(pid, _)| pid)),
        _ => None,
    }
}

/// The clients of GPU 0's shared domain.
pub fn shared_clients(e: &Env) -> Vec<u32> {
    status(e).gpus[0]
        .domains
        .iter()
        .filter(|d| d.domain.is_shared())
        .flat_map(|d| d.clients.clone())
        .collect()
}

pub fn standby_clients(e: &Env) -> Vec<u32> {
    match e.call(&Request::Status).unwrap() {
        Response::Status(s) => s.gpus[0]
            .domains
            .iter()
            .filter(|d| !d.domain.is_shared())
            .flat_map(|d| d.clients.clone())
            .collect(),
        r => panic!("{r:?}"),
    }
}

/// A raw `GET` with optional headers; the status code and body.
pub fn http_get_status(port: u16, path: &str, headers: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n{headers}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (
        code,
        out.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or(out),
    )
}

pub fn wait_http(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "HTTP endpoint did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One sample of a Prometheus text exposition: name, labels, value.
pub type Sample = (String, Vec<(String, String)>, f64);

/// The samples of `/metrics` (comment lines skipped; label values without escapes, as ours are).
pub fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|kv| !kv.is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((k.to_string(), v.trim_end_matches('"').to_string()))
                })
                .collect();
            Some((name.to_string(), labels, value))
        })
        .collect()
}

pub fn series(name: &str, labels: &[(String, String)]) -> String {
    let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{name}{{{}}}", l.join(","))
}

pub fn with(labels: &[(String, String)], extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .cloned()
        .collect();
    l.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    l.sort();
    l
}

pub fn e_steps_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("mpsr-steps-sim-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The annotations the shipped rules give an alert with these labels (etc/prometheus).
pub fn annotations(alert: &str, labels: &[(String, String)]) -> Vec<(&'static str, String)> {
    let l = |k: &str| {
        labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    match alert {
        "MpsrGpuFaultHitJobs" => vec![
            ("summary", format!("GPU {} of {}: a GPU fault hit jobs in the last 10 minutes", l("gpu"), l("instance"))),
            ("description", "`mpsrctl events` on the node names the fault, its class and what was done; each hit job's AdminComment has its line.".into()),
        ],
        "MpsrGpuUnhealthy" => vec![
            ("summary", format!("GPU {} of {} has a hardware fault ({}): the node is drained", l("gpu"), l("instance"), l("class"))),
            ("description", format!("After repairing it: mpsrctl clear-gpu {} (the health check then resumes the node).", l("gpu"))),
        ],
        "MpsrPathology" => vec![(
            "summary",
            format!("{}: telemetry finding {} ({})", l("instance"), l("rule"), l("severity")),
        )],
        "MpsrJobStraggler" => vec![(
            "summary",
            format!("Job {}: its rank on {} GPU {} runs at 0.75x of its peers or less", l("hpc_job"), l("instance"), l("gpu")),
        )],
        "MpsrAgentNotScraped" => vec![(
            "summary",
            format!("The mps-resilient agent of {} cannot be scraped: GPU faults there are not watched", l("instance")),
        )],
        "MpsrSlurmActionsStuck" => vec![(
            "summary",
            format!("{}: Slurm actions pending for 15 minutes (is slurmctld reachable?)", l("instance")),
        )],
        other => panic!("no annotations known for {other}"),
    }
}

/// Sends a test-control request to the SIMULATED GPU daemon of `e` (a control daemon that hangs).
pub fn sim_control(e: &Env, req: &mpsr_simgpu::SimRequest) {
    let r = mpsr_simgpu::call(&e.path().join("run"), req, Duration::from_secs(3)).unwrap();
    assert_eq!(r, mpsr_simgpu::SimReply::Ok, "{req:?}");
}

pub fn has_outcome(e: &Env, f: impl Fn(&FaultOutcome) -> bool) -> bool {
    e.events()
        .first()
        .is_some_and(|r| r.outcomes.iter().any(&f))
}

pub const LADDER: &str = "fault_stuck_ms = 1000\nescalation_step_ms = 600\n";
