//! A real Slurm cluster on localhost for tests and the demo: a private munged, slurmctld and one
//! slurmd per emulated node (`slurmd -N`), the mps-resilient SPANK plugin in plugstack.conf, the
//! prolog/epilog/health-check scripts, and one node agent per node with SIMULATED GPUs.
//!
//! Everything lives in one temporary directory with private ports and sockets, so it cannot touch
//! a real cluster on the same host. `Drop` stops every daemon and job (also when a test panics; the
//! directory is kept then for the logs). Needs root (slurmd starts jobs as other users).

use mpsr_proto::{Client, Request, Response, StatusReply};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T> = std::result::Result<T, Error>;

fn err(msg: impl Into<String>) -> Error {
    msg.into().into()
}

/// Files copied from the build into the cluster dir (readable by job users, unlike ~/target).
const BINARIES: &[&str] = &[
    "mpsr-agent",
    "mpsrctl",
    "mpsr-simclient",
    "mpsr-simgpu",
    "mpsr-run",
    "mpsr-keeper",
    "mpsr-statetool",
];
const PLUGIN_SO: &str = "libmpsr_spank.so";
const SCRIPTS: &[&str] = &["mpsr-prolog", "mpsr-epilog", "mpsr-healthcheck"];

#[derive(Debug, Clone)]
pub struct Options {
    pub nodes: Vec<String>,
    pub gpus_per_node: u32,
    /// Shards (GPU slices a job asks for with --gres=shard:N) per GPU.
    pub shards_per_gpu: u32,
    /// Share GPUs through Slurm's gres/mps (`--gres=mps:N`, 100 per GPU) instead of shards.
    pub gres_mps: bool,
    /// Shards on the first node, gres/mps on the others (`GresTypes=gpu,shard,mps`): Slurm then
    /// gives a shard step fewer GPU variables.
    pub gres_mixed: bool,
    /// Track and confine jobs with cgroups as production sites do: proctrack/cgroup,
    /// task/cgroup + task/affinity, ConstrainDevices=yes (cgroup v1 here).
    pub cgroup: bool,
    /// Install the previous release's binaries and plugin first (`MPSR_PREV_BUILD_DIR`, made by
    /// scripts/prev-release.sh); `Cluster::install` upgrades or downgrades later.
    pub previous_release: bool,
    /// Log every scontrol call the agent makes, with its exit status, to `<node>/scontrol.log`.
    pub log_scontrol: bool,
    /// Extra plugstack.conf arguments.
    pub plugin_args: Vec<String>,
    /// Seconds between slurmd health checks (0 = off).
    pub health_interval_s: u32,
    /// Seconds a requeued job waits before it may start again (Slurm's cred_expire).
    pub cred_expire_s: u32,
    /// Appended to every node's agent.toml (further tables, e.g. `[telemetry]`).
    pub agent_extra: String,
    /// Further keys of every node's `[mps]` table (e.g. `max_domains_per_gpu = 2`).
    pub agent_mps: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nodes: vec!["n1".into(), "n2".into()],
            gpus_per_node: 2,
            shards_per_gpu: 4,
            gres_mps: false,
            gres_mixed: false,
            cgroup: false,
            previous_release: false,
            log_scontrol: false,
            plugin_args: vec![],
            health_interval_s: 0,
            cred_expire_s: 5,
            agent_extra: String::new(),
            agent_mps: String::new(),
        }
    }
}

pub struct Cluster {
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub conf: PathBuf,
    pub opts: Options,
    daemons: Vec<(String, Child)>,
    agents: BTreeMap<String, Child>,
    keep: bool,
}

/// Where the packages install the prolog, epilog and health check.
const INSTALLED_SCRIPTS: &str = "usr/libexec/mps-resilient";

/// A product script (scripts/slurm/NAME) as a test runs it: the installed one under
/// `MPSR_INSTALLED_ROOT`, else the repository's.
pub fn script(name: &str) -> PathBuf {
    match std::env::var_os("MPSR_INSTALLED_ROOT") {
        Some(r) => PathBuf::from(r).join(INSTALLED_SCRIPTS).join(name),
        None => repo_root().join("scripts/slurm").join(name),
    }
}

/// The build output directory holding the workspace's binaries (target/debug or target/release).
/// Where a test cluster takes the product's files from: the build, or (`MPSR_INSTALLED_ROOT`, set
/// by the test command) a root the Debian packages were installed into, so that the e2e tests run
/// what a site installs.
struct Sources {
    bin: PathBuf,
    plugin: PathBuf,
    scripts: PathBuf,
    job_submit: PathBuf,
}

/// Which release's files a cluster runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// This build (or the installed packages).
    Current,
    /// The previous release (`MPSR_PREV_BUILD_DIR`).
    Previous,
}

impl Sources {
    fn of(release: Release) -> Result<Sources> {
        match release {
            Release::Current => Sources::find(),
            Release::Previous => {
                let bin = std::env::var_os("MPSR_PREV_BUILD_DIR")
                    .filter(|d| !d.is_empty())
                    .map(PathBuf::from)
                    .ok_or_else(
                    || err("MPSR_PREV_BUILD_DIR is not set (bash scripts/prev-release.sh builds it)"),
                )?;
                Ok(Sources {
                    plugin: bin.join(PLUGIN_SO),
                    bin,
                    scripts: repo_root().join("scripts/slurm"),
                    job_submit: repo_root().join("etc/job_submit.lua"),
                })
            }
        }
    }

    fn find() -> Result<Sources> {
        if let Some(r) = std::env::var_os("MPSR_INSTALLED_ROOT") {
            let r = PathBuf::from(r);
            let plugin = std::fs::read_dir(r.join("usr/lib"))?
                .flatten()
                .map(|d| d.path().join("slurm-wlm/mps_resilient.so"))
                .find(|p| p.exists())
                .ok_or_else(|| err(format!("no mps_resilient.so under {}/usr/lib", r.display())))?;
            return Ok(Sources {
                bin: r.join("usr/bin"),
                plugin,
                scripts: r.join(INSTALLED_SCRIPTS),
                job_submit: r.join("usr/share/mps-resilient/job_submit.lua"),
            });
        }
        let build = build_dir()?;
        Ok(Sources {
            // A plugin built against another Slurm release's spank.h (for MPSR_SLURM_ROOT).
            plugin: std::env::var_os("MPSR_PLUGIN_SO")
                .map(PathBuf::from)
                .unwrap_or_else(|| build.join(PLUGIN_SO)),
            bin: build,
            scripts: repo_root().join("scripts/slurm"),
            job_submit: repo_root().join("etc/job_submit.lua"),
        })
    }
}

pub fn build_dir() -> Result<PathBuf> {
    if let Ok(d) = std::env::var("MPSR_BUILD_DIR") {
        return Ok(d.into());
    }
    // A test binary lives in target/<profile>/deps, a binary in target/<profile>.
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        if dir.join("mpsr-agent").exists() && dir.join(PLUGIN_SO).exists() {
            return Ok(dir.to_path_buf());
        }
    }
    Err(err(format!(
        "mpsr-agent and {PLUGIN_SO} not found near {}; run `cargo build --workspace` first",
        exe.display()
    )))
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// What the cluster needs from the host; an empty list means it can start.
pub fn missing_prerequisites() -> Vec<String> {
    let mut out = Vec::new();
    if !is_root() {
        out.push("root (slurmd runs jobs as other users)".into());
    }
    for b in [
        "slurmctld",
        "slurmd",
        "scontrol",
        "sbatch",
        "srun",
        "munged",
    ] {
        if which(b).is_none() {
            out.push(format!(
                "{b} (apt install slurmctld slurmd slurm-client munge)"
            ));
        }
    }
    out
}

/// A root directory holding another Slurm release (`MPSR_SLURM_ROOT`, e.g. Debian trixie's 24.11
/// made by scripts/slurm-root.sh): munged, slurmctld, slurmd and every Slurm command then run in it
/// (chroot, with /proc, /sys, /dev and /tmp bound in); the agents stay on the host.
pub fn slurm_root() -> Option<PathBuf> {
    std::env::var_os("MPSR_SLURM_ROOT").map(PathBuf::from)
}

/// A command for a Slurm-side program: run in the Slurm root when there is one.
fn slurm_side(prog: impl AsRef<std::ffi::OsStr>) -> Command {
    match slurm_root() {
        Some(r) => {
            let mut c = Command::new("chroot");
            c.arg(r).arg(prog);
            c
        }
        None => Command::new(prog),
    }
}

pub fn which(bin: &str) -> Option<PathBuf> {
    if let Some(r) = slurm_root() {
        return ["usr/sbin", "usr/bin", "sbin", "bin"]
            .iter()
            .map(|d| Path::new("/").join(d).join(bin))
            .find(|p| r.join(p.strip_prefix("/").unwrap()).is_file());
    }
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.is_file());
    found
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn write_file(path: &Path, text: &str, mode: u32) -> Result<()> {
    std::fs::write(path, text).map_err(|e| err(format!("{}: {e}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

fn mkdir(path: &Path, mode: u32) -> Result<()> {
    std::fs::create_dir_all(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Polls `f` every 100 ms until it returns `Some`, or fails after `timeout` naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() >= end {
            return Err(err(format!(
                "timed out after {timeout:?} waiting for {what}"
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `Key=Value Key=Value ...` (scontrol -o); values may contain spaces.
pub fn parse_kv(line: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut last: Option<String> = None;
    for tok in line.split_whitespace() {
        match tok.split_once('=') {
            Some((k, v))
                if !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '/') =>
            {
                out.insert(k.to_string(), v.to_string());
                last = Some(k.to_string());
            }
            _ => {
                if let Some(k) = &last {
                    if let Some(v) = out.get_mut(k) {
                        v.push(' ');
                        v.push_str(tok);
                    }
                }
            }
        }
    }
    out
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child we own.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

fn stop_child(name: &str, c: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = c.try_wait() {
        return;
    }
    signal(c, libc::SIGTERM);
    let end = Instant::now() + grace;
    while Instant::now() < end {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("cluster: {name} ignored SIGTERM; killing it");
    let _ = c.kill();
    let _ = c.wait();
}

impl Cluster {
    pub fn start(opts: Options) -> Result<Cluster> {
        let missing = missing_prerequisites();
        if !missing.is_empty() {
            return Err(err(format!(
                "cannot start a local Slurm cluster; missing: {}",
                missing.join(", ")
            )));
        }
        let src = Sources::of(if opts.previous_release {
            Release::Previous
        } else {
            Release::Current
        })?;
        let base = std::env::var("MPSR_CLUSTER_BASE").unwrap_or_else(|_| "/tmp".into());
        let dir = PathBuf::from(base).join(format!(
            "mpsr-cluster.{}.{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos()
                ^ (std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.subsec_nanos() as u128)
                    .unwrap_or(0))
        ));
        // Job users (nobody) need to reach binaries and write job output.
        mkdir(&dir, 0o755)?;
        let mut c = Cluster {
            bin: dir.join("bin"),
            conf: dir.join("etc/slurm.conf"),
            dir,
            opts,
            daemons: Vec::new(),
            agents: BTreeMap::new(),
            keep: std::env::var_os("MPSR_KEEP").is_some(),
        };
        c.prepare(&src)?;
        c.start_daemons()?;
        Ok(c)
    }

    fn prepare(&mut self, src: &Sources) -> Result<()> {
        let d = &self.dir;
        for sub in ["bin", "etc", "spool", "log", "munge", "dev"] {
            mkdir(&d.join(sub), 0o755)?;
        }
        mkdir(&d.join("jobs"), 0o1777)?;
        self.copy_release(src)?;
        std::fs::copy(&src.job_submit, self.dir.join("etc/job_submit.lua"))?;
        // Fake GPU device nodes: Slurm's gres/gpu wants character devices to number them.
        // Each its own number (NVIDIA's major, 195): with ConstrainDevices, Slurm denies a job
        // the GPUs it was not given by these numbers, so they must not be any device a job uses.
        for (ni, n) in self.opts.nodes.iter().enumerate() {
            mkdir(&d.join(n), 0o755)?;
            for g in 0..self.opts.gpus_per_node {
                let p = d.join("dev").join(format!("{n}-gpu{g}"));
                let cp = std::ffi::CString::new(p.display().to_string())?;
                let minor = 64 + ni as u32 * 16 + g;
                // SAFETY: mknod with a valid path; a character device no driver answers here.
                let rc = unsafe {
                    libc::mknod(
                        cp.as_ptr(),
                        libc::S_IFCHR | 0o666,
                        libc::makedev(195, minor),
                    )
                };
                if rc != 0 {
                    return Err(err(format!(
                        "mknod {}: {}",
                        p.display(),
                        std::io::Error::last_os_error()
                    )));
                }
            }
        }
        let key: Vec<u8> = (0..1024)
            .map(|i| (i as u8) ^ (std::process::id() as u8))
            .collect();
        let key_path = d.join("munge/munge.key");
        std::fs::write(&key_path, key)?;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")?
            .trim()
            .to_string();
        let (ctld_port, slurmd_port) = (free_port()?, free_port()?);
        let o = &self.opts;
        let gpus = o.gpus_per_node;
        let mut nodes = String::new();
        let mut gres = String::new();
        for (i, n) in o.nodes.iter().enumerate() {
            let port = free_port()?;
            let mps_here = o.gres_mps || (o.gres_mixed && i > 0);
            let (sharing, per_gpu) = if mps_here {
                ("mps", 100)
            } else {
                ("shard", o.shards_per_gpu)
            };
            nodes.push_str(&format!(
                "NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=1000 Gres=gpu:{gpus},{sharing}:{} State=UNKNOWN\n",
                gpus * per_gpu
            ));
            for g in 0..gpus {
                let dev = d.join("dev").join(format!("{n}-gpu{g}"));
                gres.push_str(&format!(
                    "NodeName={n} Name=gpu File={}\nNodeName={n} Name={sharing} Count={per_gpu} File={}\n",
                    dev.display(),
                    dev.display()
                ));
            }
        }
        let t = d.display();
        let health = if o.health_interval_s > 0 {
            format!(
                "HealthCheckProgram={t}/etc/healthcheck.sh\nHealthCheckInterval={}\nHealthCheckNodeState=ANY\n",
                o.health_interval_s
            )
        } else {
            String::new()
        };
        let conf = format!(
            "# mps-resilient test cluster (generated)
ClusterName=mpsrtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={t}/munge/munge.sock,cred_expire={cred}
StateSaveLocation={t}/spool/ctld
SlurmdSpoolDir={t}/spool/d.%n
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd.%n.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd.%n.log
SlurmdDebug=debug
{tracking}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=1
MpiDefault=none
ReturnToService=2
KillWait=2
MinJobAge=600
GresTypes=gpu,{sharing}
PlugStackConfig={t}/etc/plugstack.conf
JobSubmitPlugins=lua
Prolog={t}/etc/prolog.sh
Epilog={t}/etc/epilog.sh
{health}{nodes}PartitionName=debug Nodes={list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
",
            cred = o.cred_expire_s,
            list = o.nodes.join(","),
            sharing = if o.gres_mixed {
                "shard,mps"
            } else if o.gres_mps {
                "mps"
            } else {
                "shard"
            },
            tracking = if o.cgroup {
                "ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup,task/affinity"
            } else {
                "ProctrackType=proctrack/pgid\nTaskPlugin=task/none"
            }
        );
        write_file(&self.conf, &conf, 0o644)?;
        write_file(&d.join("etc/gres.conf"), &gres, 0o644)?;
        if o.cgroup {
            write_file(
                &d.join("etc/cgroup.conf"),
                "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainDevices=yes\nConstrainCores=no\nConstrainRAMSpace=no\n",
                0o644,
            )?;
        }
        self.write_plugstack(&self.opts.plugin_args.clone())?;
        let scripts_conf = format!(
            "MPSRCTL={t}/bin/mpsrctl\nMPSR_SOCKET={t}/%n/agent.sock\nMPSR_REPORT_DIR={t}/%n/reports\nexport SLURM_CONF={t}/etc/slurm.conf\n"
        );
        write_file(&d.join("etc/scripts.conf"), &scripts_conf, 0o644)?;
        for (name, script) in [
            ("prolog.sh", "mpsr-prolog"),
            ("epilog.sh", "mpsr-epilog"),
            ("healthcheck.sh", "mpsr-healthcheck"),
        ] {
            write_file(
                &d.join("etc").join(name),
                &format!(
                    "#!/bin/sh\nexport MPSR_SCRIPTS_CONF={t}/etc/scripts.conf\nexec {t}/bin/{script} \"$@\"\n"
                ),
                0o755,
            )?;
        }
        for n in self.opts.nodes.clone() {
            self.write_agent_config(&n)?;
        }
        Ok(())
    }

    /// Rewrites plugstack.conf (srun and slurmstepd read it anew for every job).
    pub fn write_plugstack(&self, extra: &[String]) -> Result<()> {
        let t = self.dir.display();
        let mut line = format!(
            "required {t}/bin/mps_resilient.so agent_socket={t}/%n/agent.sock timeout_ms=2000"
        );
        for a in extra {
            line.push(' ');
            line.push_str(a);
        }
        write_file(
            &self.dir.join("etc/plugstack.conf"),
            &format!("{line}\n"),
            0o644,
        )
    }

    fn write_agent_config(&self, node: &str) -> Result<()> {
        let t = self.dir.display();
        // The agent (on the host) runs the Slurm root's scontrol when there is one.
        // And its squeue and sinfo; the host's by default, so a config an earlier agent reads
        // names no key it does not know.
        let mut squeue = String::new();
        let scontrol = match slurm_root() {
            Some(r) => {
                let w = self.bin.join("scontrol-in-root");
                write_file(
                    &w,
                    &format!("#!/bin/sh\nexec chroot {} scontrol \"$@\"\n", r.display()),
                    0o755,
                )?;
                // And its squeue and sinfo (a job's and a node's fields are read with them).
                for tool in ["squeue", "sinfo"] {
                    let q = self.bin.join(format!("{tool}-in-root"));
                    write_file(
                        &q,
                        &format!("#!/bin/sh\nexec chroot {} {tool} \"$@\"\n", r.display()),
                        0o755,
                    )?;
                    squeue.push_str(&format!("{tool} = \"{}\"\n", q.display()));
                }
                w.display().to_string()
            }
            None => "scontrol".into(),
        };
        let scontrol = if self.opts.log_scontrol {
            let w = self.bin.join(format!("scontrol-logged-{node}"));
            let log = self.dir.join(node).join("scontrol.log");
            write_file(
                &w,
                &format!(
                    "#!/bin/sh\n{scontrol} \"$@\"\nrc=$?\necho \"$rc $*\" >> {}\nexit $rc\n",
                    log.display()
                ),
                0o755,
            )?;
            w.display().to_string()
        } else {
            scontrol
        };
        let cfg = format!(
            "backend = \"sim\"
socket = \"{t}/{node}/agent.sock\"
state_dir = \"{t}/{node}/state\"
run_dir = \"{t}/{node}/run\"
node_name = \"{node}\"
[log]
target = \"stderr\"
level = \"info\"
[slurm]
scontrol = \"{scontrol}\"
{squeue}slurm_conf = \"{t}/etc/slurm.conf\"
timeout_ms = 5000
[mps]
fault_grace_ms = 1000
{}
[faults]
kmsg = false
[keeper]
snapshot_dir = \"{t}/{node}/snapshots\"
[sim]
gpus = {}
{}",
            self.opts.agent_mps, self.opts.gpus_per_node, self.opts.agent_extra
        );
        write_file(&self.dir.join(node).join("agent.toml"), &cfg, 0o644)
    }

    fn spawn(&self, name: &str, cmd: &mut Command) -> Result<Child> {
        let log = std::fs::File::create(self.dir.join("log").join(format!("{name}.out")))?;
        cmd.env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| err(format!("starting {name}: {e}")))
    }

    fn start_daemons(&mut self) -> Result<()> {
        let d = self.dir.clone();
        let munged = which("munged").ok_or_else(|| err("munged not found"))?;
        let m = self.spawn(
            "munged",
            slurm_side(munged).args([
                "-F",
                "--force",
                &format!("--socket={}/munge/munge.sock", d.display()),
                &format!("--key-file={}/munge/munge.key", d.display()),
                &format!("--pid-file={}/munge/munged.pid", d.display()),
                &format!("--log-file={}/munge/munged.log", d.display()),
                &format!("--seed-file={}/munge/munged.seed", d.display()),
            ]),
        )?;
        self.daemons.push(("munged".into(), m));
        wait_for("munged socket", Duration::from_secs(10), || {
            d.join("munge/munge.sock").exists().then_some(())
        })?;
        for n in self.opts.nodes.clone() {
            self.start_agent(&n)?;
        }
        self.start_slurmctld()?;
        for n in self.opts.nodes.clone() {
            let sd = self.spawn(
                &format!("slurmd.{n}"),
                slurm_side(which("slurmd").ok_or_else(|| err("slurmd not found"))?)
                    .args(["-D", "-N", &n, "-f"])
                    .arg(&self.conf),
            )?;
            self.daemons.push((format!("slurmd.{n}"), sd));
        }
        let nodes = self.opts.nodes.clone();
        wait_for("all nodes idle in sinfo", Duration::from_secs(60), || {
            let out = self.cmd("sinfo -h -N -o '%N %t'").ok()?;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let idle = nodes
                .iter()
                .all(|n| text.lines().any(|l| l.trim() == format!("{n} idle")));
            idle.then_some(())
        })
        .map_err(|e| err(format!("{e} (logs in {})", self.dir.join("log").display())))?;
        Ok(())
    }

    /// Starts slurmctld (again: it keeps its state in the cluster's state directory).
    pub fn start_slurmctld(&mut self) -> Result<()> {
        let ctld = self.spawn(
            "slurmctld",
            slurm_side(which("slurmctld").ok_or_else(|| err("slurmctld not found"))?)
                .args(["-D", "-i", "-f"])
                .arg(&self.conf),
        )?;
        self.daemons.push(("slurmctld".into(), ctld));
        Ok(())
    }

    /// Stops slurmctld (SIGTERM, it saves its state); jobs on the nodes run on.
    pub fn stop_slurmctld(&mut self) {
        if let Some(i) = self.daemons.iter().position(|(n, _)| n == "slurmctld") {
            let (_, mut c) = self.daemons.remove(i);
            stop_child("slurmctld", &mut c, Duration::from_secs(10));
        }
    }

    pub fn agent_socket(&self, node: &str) -> PathBuf {
        self.dir.join(node).join("agent.sock")
    }

    /// The release's binaries, plugin and scripts into the cluster's bin directory, each written
    /// beside and renamed over the old (as dpkg does: running programs keep their old file).
    fn copy_release(&self, src: &Sources) -> Result<()> {
        let put = |from: &Path, name: &str| -> Result<()> {
            let tmp = self.bin.join(format!(".{name}.new"));
            std::fs::copy(from, &tmp).map_err(|e| err(format!("copying {name}: {e}")))?;
            std::fs::rename(&tmp, self.bin.join(name))?;
            Ok(())
        };
        for b in BINARIES {
            put(&src.bin.join(b), b)?;
        }
        put(&src.plugin, "mps_resilient.so")?;
        for s in SCRIPTS {
            put(&src.scripts.join(s), s)?;
        }
        Ok(())
    }

    /// Installs a release over the running one (a package upgrade or downgrade) and restarts
    /// every node's agent as its unit would (SIGTERM, start): running jobs keep their processes
    /// and the plugin their slurmstepd loaded.
    pub fn install(&mut self, release: Release) -> Result<()> {
        self.copy_release(&Sources::of(release)?)?;
        for n in self.opts.nodes.clone() {
            self.stop_agent(&n, false);
            self.start_agent(&n)?;
        }
        Ok(())
    }

    pub fn start_agent(&mut self, node: &str) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(node).join("agent.log"))?;
        let child = Command::new(self.bin.join("mpsr-agent"))
            .arg("--config")
            .arg(self.dir.join(node).join("agent.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.agents.insert(node.to_string(), child);
        wait_for(
            &format!("agent of {node} answering"),
            Duration::from_secs(10),
            || self.agent_status(node).ok(),
        )?;
        Ok(())
    }

    /// Stops a node's agent: `kill9` = crash, else a clean SIGTERM.
    pub fn stop_agent(&mut self, node: &str, kill9: bool) {
        if let Some(mut c) = self.agents.remove(node) {
            if kill9 {
                let _ = c.kill();
                let _ = c.wait();
            } else {
                stop_child(&format!("agent {node}"), &mut c, Duration::from_secs(5));
            }
        }
    }

    pub fn agent_call(&self, node: &str, req: &Request) -> Result<Response> {
        Ok(Client::new(self.agent_socket(node), Duration::from_secs(5)).call(req)?)
    }

    pub fn agent_status(&self, node: &str) -> Result<StatusReply> {
        match self.agent_call(node, &Request::Status)? {
            Response::Status(s) => Ok(s),
            other => Err(err(format!("unexpected status reply {other:?}"))),
        }
    }

    /// Injects a simulated Xid on a node's GPU (its shared domain); returns the clients it killed.
    pub fn inject(&self, node: &str, gpu: u32, xid: u32) -> Result<Vec<u32>> {
        self.inject_in(node, gpu, xid, None)
    }

    /// Injects a simulated Xid into one fault domain's server (`slot`, 0 = shared).
    pub fn inject_in(&self, node: &str, gpu: u32, xid: u32, slot: Option<u32>) -> Result<Vec<u32>> {
        self.sim_inject(node, gpu, xid, None, slot)
    }

    /// Injects a simulated Xid caused by the client `pid` (what the simulated driver patch,
    /// `[sim] driver_patch`, names and contains).
    pub fn inject_culprit(&self, node: &str, gpu: u32, xid: u32, pid: u32) -> Result<Vec<u32>> {
        self.sim_inject(node, gpu, xid, Some(pid), None)
    }

    fn sim_inject(
        &self,
        node: &str,
        gpu: u32,
        xid: u32,
        culprit: Option<u32>,
        slot: Option<u32>,
    ) -> Result<Vec<u32>> {
        match self.agent_call(
            node,
            &Request::SimInject {
                gpu,
                xid,
                culprit,
                slot,
            },
        )? {
            Response::Injected { killed, .. } => Ok(killed),
            other => Err(err(format!("inject: {other:?}"))),
        }
    }

    /// A shell command with this cluster's SLURM_CONF and binaries on PATH, as root.
    pub fn cmd(&self, script: &str) -> Result<Output> {
        Ok(slurm_side("/bin/sh")
            .arg("-c")
            .arg(script)
            .env("SLURM_CONF", &self.conf)
            .env("PATH", self.path())
            .stdin(Stdio::null())
            .output()?)
    }

    fn path(&self) -> String {
        format!(
            "{}:{}",
            self.bin.display(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
        )
    }

    /// A shell command as another user (`su`), in the cluster's job dir.
    pub fn cmd_as(&self, user: &str, script: &str) -> Result<Output> {
        if user == "root" {
            return self.cmd(&format!("cd {} && {script}", self.jobs().display()));
        }
        let full = format!(
            "export SLURM_CONF={} PATH={}; cd {} && {script}",
            self.conf.display(),
            self.path(),
            self.jobs().display()
        );
        Ok(slurm_side("su")
            .args(["-s", "/bin/sh", user, "-c", &full])
            .stdin(Stdio::null())
            .output()?)
    }

    /// A shell command as another user, running in the background with output to a file.
    pub fn spawn_as(&self, user: &str, script: &str, out: &Path) -> Result<Child> {
        let f = std::fs::File::create(out)?;
        std::fs::set_permissions(out, std::fs::Permissions::from_mode(0o666))?;
        let full = format!(
            "export SLURM_CONF={} PATH={}; cd {} && exec {script}",
            self.conf.display(),
            self.path(),
            self.jobs().display()
        );
        let mut c = if user == "root" {
            let mut c = slurm_side("/bin/sh");
            c.arg("-c").arg(&full);
            c
        } else {
            let mut c = slurm_side("su");
            c.args(["-s", "/bin/sh", user, "-c", &full]);
            c
        };
        Ok(c.stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()?)
    }

    pub fn jobs(&self) -> PathBuf {
        self.dir.join("jobs")
    }

    /// Submits a batch script as `user`; returns the job id.
    pub fn sbatch(&self, user: &str, args: &str, script: &str) -> Result<u32> {
        self.sbatch_env(user, "", args, script)
    }

    /// `sbatch` with `env` (`VAR=value ...`) in the submitting environment (exported to the job,
    /// as `--export=ALL` does: Slurm 26.05 makes `--export=...,VAR=value` fetch the user's login
    /// environment, which a user without a shell does not have).
    pub fn sbatch_env(&self, user: &str, env: &str, args: &str, script: &str) -> Result<u32> {
        let n = std::fs::read_dir(self.jobs())?.count();
        let path = self.jobs().join(format!("script{n}.sh"));
        let mut f = std::fs::File::create(&path)?;
        writeln!(f, "#!/bin/sh\n{script}")?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        let out = self.cmd_as(
            user,
            &format!(
                "{env} sbatch --parsable -o %j.out -e %j.out {args} {}",
                path.display()
            ),
        )?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim()
            .split(';')
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                err(format!(
                    "sbatch {args} failed: {} {}",
                    text,
                    String::from_utf8_lossy(&out.stderr)
                ))
            })
    }

    /// The job's fields from `scontrol show job`, with its state and restart count (`JobState`,
    /// `Restarts`) from `squeue -O` with those fields alone: scontrol's line repeats the job's
    /// name among its fields (Slurm 26.05 twice), so a name such as `x JobState=COMPLETED` read
    /// there stands in for them. (`ExitCode` stays scontrol's: 22.05's squeue prints no signal.)
    pub fn job(&self, id: u32) -> BTreeMap<String, String> {
        let mut fields = self
            .cmd(&format!("scontrol -o show job {id}"))
            .map(|o| parse_kv(&String::from_utf8_lossy(&o.stdout)))
            .unwrap_or_default();
        fields.remove("JobState");
        fields.remove("Restarts");
        let Ok(o) = self.cmd(&format!(
            "squeue -h --states=all -j {id} -O 'JobID:|,State:|,RestartCnt:|'"
        )) else {
            return fields;
        };
        let text = String::from_utf8_lossy(&o.stdout);
        if let Some(f) = text
            .lines()
            .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>())
            .find(|f| f.len() >= 3 && f[0] == id.to_string())
        {
            fields.insert("JobState".into(), f[1].to_string());
            fields.insert("Restarts".into(), f[2].to_string());
        }
        fields
    }

    /// The job's AdminComment, from `squeue --json` (the multi-line `scontrol show job` can be
    /// forged by a newline in the job's name).
    pub fn admin_comment(&self, id: u32) -> String {
        let Ok(o) = self.cmd(&format!("squeue --json --states=all -j {id}")) else {
            return String::new();
        };
        serde_json::from_slice::<serde_json::Value>(&o.stdout)
            .ok()
            .and_then(|v| {
                v.get("jobs")?
                    .as_array()?
                    .iter()
                    .find(|j| j.get("job_id").and_then(|i| i.as_u64()) == Some(id.into()))?
                    .get("admin_comment")?
                    .as_str()
                    .map(str::to_string)
            })
            .unwrap_or_default()
    }

    pub fn job_field(&self, id: u32, key: &str) -> String {
        self.job(id).get(key).cloned().unwrap_or_default()
    }

    pub fn node(&self, node: &str) -> BTreeMap<String, String> {
        self.cmd(&format!("scontrol -o show node {node}"))
            .map(|o| parse_kv(&String::from_utf8_lossy(&o.stdout)))
            .unwrap_or_default()
    }

    pub fn job_output(&self, id: u32) -> String {
        std::fs::read_to_string(self.jobs().join(format!("{id}.out"))).unwrap_or_default()
    }

    /// Waits until a job is in one of `states` (e.g. RUNNING).
    pub fn wait_job_state(&self, id: u32, states: &[&str], timeout: Duration) -> Result<()> {
        wait_for(&format!("job {id} in {states:?}"), timeout, || {
            let s = self.job_field(id, "JobState");
            states.contains(&s.as_str()).then_some(())
        })
        .map_err(|e| {
            err(format!(
                "{e}; job is {:?}; output: {}",
                self.job(id).get("JobState"),
                self.job_output(id)
            ))
        })
    }

    /// Waits until the node's agent has `n` tasks of job `id` registered; returns their GPUs.
    pub fn wait_registered(&self, node: &str, id: u32, n: usize) -> Result<Vec<u32>> {
        wait_for(
            &format!("{n} task(s) of job {id} registered on {node}"),
            Duration::from_secs(30),
            || {
                let s = self.agent_status(node).ok()?;
                let t: Vec<_> = s.tasks.iter().filter(|t| t.job_id == id).collect();
                (t.len() == n).then(|| t.iter().flat_map(|t| t.gpus.clone()).collect())
            },
        )
    }

    /// Simulated MPS clients attached to a node's GPU.
    pub fn clients(&self, node: &str, gpu: u32) -> Vec<u32> {
        self.agent_status(node)
            .ok()
            .and_then(|s| s.gpus.into_iter().find(|g| g.gpu == gpu))
            .map(|g| g.clients)
            .unwrap_or_default()
    }

    /// Keeps the cluster's directory (logs, agent state) when it is dropped.
    pub fn keep_on_drop(&mut self) {
        self.keep = true;
    }

    /// The simulated MPS clients on a node's GPU that belong to Slurm job `job` (by the
    /// SLURM_JOB_ID in their environment): a job's client, never a neighbour's or a left-over one.
    pub fn job_clients(&self, node: &str, gpu: u32, job: u32) -> Vec<u32> {
        let want = format!("SLURM_JOB_ID={job}");
        self.clients(node, gpu)
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()))
                    .unwrap_or(false)
            })
            .collect()
    }

    fn cancel_all_jobs(&self) {
        let _ = self.cmd("scancel --full --quiet $(squeue -h -o %i) 2>/dev/null");
        let _ = wait_for("no jobs left", Duration::from_secs(15), || {
            let out = self.cmd("squeue -h -t all -o %T").ok()?;
            let t = String::from_utf8_lossy(&out.stdout).to_string();
            (!t.lines().any(|l| l == "RUNNING" || l == "COMPLETING")).then_some(())
        });
    }

    /// Kills processes started from this cluster's bin dir (left-over job processes).
    fn kill_leftovers(&self) {
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return;
        };
        for e in rd.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
            if exe.starts_with(&self.bin) && !self.agents.values().any(|c| c.id() as i32 == pid) {
                // SAFETY: kill(2) on a process started from our private bin dir.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    /// Keep the directory (logs) after the cluster stops.
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.cancel_all_jobs();
        for (name, mut c) in std::mem::take(&mut self.daemons).into_iter().rev() {
            stop_child(&name, &mut c, Duration::from_secs(10));
        }
        for n in self.agents.keys().cloned().collect::<Vec<_>>() {
            self.stop_agent(&n, false);
        }
        // slurmstepd processes of this cluster outlive slurmd -D; their jobs were cancelled above.
        self.kill_leftovers();
        if std::thread::panicking() || self.keep {
            eprintln!(
                "cluster: kept {} (logs in log/, agents in n*/)",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_parsing_keeps_spaces_in_values() {
        let m = parse_kv(
            "NodeName=n1 Arch=x86_64 State=IDLE+DRAIN Reason=mpsr: xid 79 (device_lost) on gpu0 [root@2026-12-03T07:00:00]",
        );
        assert_eq!(m["State"], "IDLE+DRAIN");
        assert_eq!(
            m["Reason"],
            "mpsr: xid 79 (device_lost) on gpu0 [root@2026-12-03T07:00:00]"
        );
        let j = parse_kv("JobId=5 JobName=x JobState=PENDING Reason=BeginTime Restarts=1");
        assert_eq!(j["Restarts"], "1");
    }
}
