//! The state keeper with SIMULATED GPU memory (memfds), driven through the agent like on a node:
//! the agent starts the keeper, registers a job, the job's processes attach named state, die, and
//! their successors find it intact; quotas, names, other users, snapshots after the memory is lost,
//! and the job's end are checked. (The same keeper with real CUDA memory: tests/gpu/.)

use mpsr_proto::keeper::{KeeperRequest, KeeperResponse};
use mpsr_proto::{Client, Mode, Registration, Request, Response};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

struct Node {
    dir: PathBuf,
    agent: Child,
}

impl Node {
    fn start() -> Node {
        let dir = std::env::temp_dir().join(format!("mpsr-keeper-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Job users must reach the binaries and the socket.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let d = dir.display();
        std::fs::write(
            dir.join("agent.toml"),
            format!(
                "backend = \"sim\"\nsocket = \"{d}/run/agent.sock\"\nstate_dir = \"{d}/state\"\nrun_dir = \"{d}/run\"\nnode_name = \"n1\"\n[log]\ntarget = \"stderr\"\n[slurm]\nscontrol = \"/bin/true\"\n[mps]\nquit_on_shutdown = true\n[faults]\nkmsg = false\n[keeper]\nmax_bytes_per_job = \"64M\"\nsnapshot_dir = \"{d}/snapshots\"\n[sim]\ngpus = 2\n"
            ),
        )
        .unwrap();
        let bin = mpsr_e2e::build_dir().unwrap();
        let log = std::fs::File::create(dir.join("agent.log")).unwrap();
        let agent = Command::new(bin.join("mpsr-agent"))
            .arg("--config")
            .arg(dir.join("agent.toml"))
            .stderr(log)
            .spawn()
            .unwrap();
        let n = Node { dir, agent };
        n.wait("keeper of gpu0", || {
            matches!(
                n.keeper(&KeeperRequest::Ping),
                Ok(KeeperResponse::Pong { .. })
            )
        });
        n
    }

    fn wait(&self, what: &str, f: impl Fn() -> bool) {
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if f() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "timed out waiting for {what}; logs in {}",
            self.dir.display()
        );
    }

    fn agent_call(&self, r: &Request) -> Response {
        Client::new(self.dir.join("run/agent.sock"), Duration::from_secs(5))
            .call(r)
            .unwrap()
    }

    fn keeper_socket(&self) -> PathBuf {
        self.dir.join("run/gpu0/keeper.sock")
    }

    fn keeper(&self, r: &KeeperRequest) -> Result<KeeperResponse, String> {
        mpsr_agent_call_keeper(&self.keeper_socket(), r)
    }

    /// mpsr-statetool as a child of this (registered) test process, or as another user.
    fn tool(&self, user: Option<&str>, args: &str) -> Output {
        let bin = mpsr_e2e::build_dir().unwrap().join("mpsr-statetool");
        let sock = self.keeper_socket();
        match user {
            None => Command::new("/bin/sh")
                .arg("-c")
                .arg(format!("exec {} {args}", bin.display()))
                .env("MPSR_KEEPER_SOCKET", &sock)
                .output()
                .unwrap(),
            Some(u) => {
                // The tool must be reachable by that user: copy it next to the socket dir.
                let copy = self.dir.join("mpsr-statetool");
                if !copy.exists() {
                    std::fs::copy(&bin, &copy).unwrap();
                }
                Command::new("su")
                    .args([
                        "-s",
                        "/bin/sh",
                        u,
                        "-c",
                        &format!(
                            "MPSR_KEEPER_SOCKET={} {} {args}",
                            sock.display(),
                            copy.display()
                        ),
                    ])
                    .output()
                    .unwrap()
            }
        }
    }
}

fn mpsr_agent_call_keeper(path: &Path, r: &KeeperRequest) -> Result<KeeperResponse, String> {
    use std::os::unix::net::UnixStream;
    let mut s = UnixStream::connect(path).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    mpsr_proto::write_frame(&mut s, r).map_err(|e| e.to_string())?;
    mpsr_proto::read_frame(&mut s).map_err(|e| e.to_string())
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.agent.id() as i32, libc::SIGTERM) };
        let _ = self.agent.wait();
        // Keepers outlive the agent by design; this test's keepers go now (and would exit on
        // their own once the directory is gone).
        for gpu in 0..2 {
            let sock = self.dir.join(format!("run/gpu{gpu}/keeper.sock"));
            if let Ok(KeeperResponse::Pong { pid, .. }) =
                mpsr_agent_call_keeper(&sock, &KeeperRequest::Ping)
            {
                // SAFETY: kill(2) on a keeper this test's agent started.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn kept_state_survives_its_process_and_is_only_its_jobs() {
    if !mpsr_e2e::is_root() {
        panic!(
            "this test needs root (it runs a process as another user); scripts/test.sh uses sudo"
        );
    }
    let n = Node::start();
    // This test process stands for job 7's task; the tool processes are its children.
    let me = std::process::id();
    let r = n.agent_call(&Request::Register(Registration {
        job_id: 7,
        step_id: 0,
        pid: me,
        uid: None,
        gpus: vec![0],
        mode: Mode::Resume,
        batch: false,
        threads_pct: None,
        mem_limit: None,
        restart_count: 0,
        isolation: None,
    }));
    assert!(matches!(r, Response::Registered { .. }), "{r:?}");
    match n.agent_call(&Request::GpuContexts { gpus: vec![0] }) {
        Response::GpuContexts { contexts } => assert_eq!(
            contexts[0].keeper_socket.as_deref(),
            Some(n.keeper_socket().to_str().unwrap())
        ),
        r => panic!("{r:?}"),
    }

    // A process attaches 3 MiB (rounded to 4), fills it, and dies.
    let o = n.tool(None, "weights 3M --fill 42");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("4194304 bytes origin=New kind=HostSim"),
        "{}",
        text(&o)
    );
    // Its successor finds the same contents.
    let o = n.tool(None, "weights 3M --verify 42");
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("origin=Kept"), "{}", text(&o));

    // Over the job's quota, a bad name, a larger size than kept: refused with the reason.
    let o = n.tool(None, "big 100M");
    assert!(
        !o.status.success() && text(&o).contains("quota"),
        "{}",
        text(&o)
    );
    let o = n.tool(None, "../etc 1M");
    assert!(
        !o.status.success() && text(&o).contains("invalid name"),
        "{}",
        text(&o)
    );
    let o = n.tool(None, "weights 8M");
    assert!(
        !o.status.success() && text(&o).contains("exists with"),
        "{}",
        text(&o)
    );

    // Another user's process, even one running under this job's task, gets nothing.
    let o = n.tool(Some("nobody"), "weights 3M --verify 42");
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("not in a job of its user"),
        "{}",
        text(&o)
    );

    // A snapshot brings state back after the GPU memory is lost (keeper replaced, as after a
    // GPU reset).
    let o = n.tool(None, "kv 2M --fill 7 --checkpoint");
    assert!(
        o.status.success() && text(&o).contains("checkpointed kv"),
        "{}",
        text(&o)
    );
    let Ok(KeeperResponse::Pong { pid: old, .. }) = n.keeper(&KeeperRequest::Ping) else {
        panic!("keeper not answering")
    };
    // SAFETY: kill(2) on the keeper this test's agent started.
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    n.wait("a new keeper started by the agent", || {
        matches!(n.keeper(&KeeperRequest::Ping), Ok(KeeperResponse::Pong { pid, .. }) if pid != old)
    });
    let o = n.tool(None, "kv 2M --verify 7");
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("origin=Snapshot"), "{}", text(&o));

    // The Python module over the C ABI: the same kept memory, seen through ctypes (with simulated
    // GPU memory the pointer is a host pointer, so plain memset/string_at stand in for kernels).
    let py = |code: &str| {
        Command::new("python3")
            .arg("-c")
            .arg(code)
            .env("MPSR_KEEPER_SOCKET", n.keeper_socket())
            .env(
                "MPSR_STATE_LIB",
                mpsr_e2e::build_dir().unwrap().join("libmpsr_state.so"),
            )
            .env("PYTHONPATH", mpsr_e2e::repo_root().join("state-lib/python"))
            .output()
            .unwrap()
    };
    let o = py("import ctypes, mpsr_state\np, origin = mpsr_state.attach('py', 1 << 20)\nctypes.memset(p, 77, 1 << 20)\nprint(origin)");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "new");
    let o = py("import ctypes, mpsr_state\np, origin = mpsr_state.attach('py', 1 << 20)\nprint(origin, set(ctypes.string_at(p, 1 << 20)))\ntry:\n    mpsr_state.attach('../x', 1)\nexcept mpsr_state.MpsrStateError as e:\n    print('refused', e.code)");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "kept {77}\nrefused -3",
        "{}",
        text(&o)
    );

    // The job ends: its allocations and snapshots go.
    let r = n.agent_call(&Request::JobEnd { job_id: 7 });
    assert!(matches!(r, Response::JobReport(_)), "{r:?}");
    n.wait("job 7's state and snapshots freed", || {
        matches!(
            n.keeper(&KeeperRequest::Stats),
            Ok(KeeperResponse::Stats { total_bytes: 0, .. })
        ) && !n.dir.join("snapshots/gpu0/job-7").exists()
    });
    // Not registered any more: attaching is refused.
    let o = n.tool(None, "weights 3M");
    assert!(
        !o.status.success() && text(&o).contains("not part of a registered job"),
        "{}",
        text(&o)
    );
}
