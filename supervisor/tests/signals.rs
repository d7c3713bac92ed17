//! mpsr-run forwards termination signals to its child, which must be able to receive them (the
//! supervisor blocks them for itself), and does not restart a child that was told to stop.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn sigterm_reaches_the_child_and_stops_restarts() {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mpsr-run"))
        .args([
            "--",
            "sh",
            "-c",
            "trap 'echo got-term; exit 3' TERM; echo ready; while :; do sleep 0.05; done",
        ])
        .env("SLURM_JOB_ID", "1")
        .env("MPSR_SOCKET", "/nonexistent/agent.sock")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = c.stdout.take().unwrap();
    let mut buf = [0u8; 6];
    out.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ready\n");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    let end = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= end {
            let _ = c.kill(); // do not leave it (and its child) running after a failed test
            panic!("mpsr-run did not stop on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("got-term"),
        "child never saw SIGTERM: {rest:?}"
    );
    assert_eq!(status.code(), Some(3), "the child's status is passed on");
}

#[test]
fn a_failure_the_agent_knows_nothing_about_is_not_restarted() {
    let t = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_mpsr-run"))
        .args(["--settle-ms", "200", "--", "sh", "-c", "echo run; exit 7"])
        .env("SLURM_JOB_ID", "1")
        .env("MPSR_SOCKET", "/nonexistent/agent.sock")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&o.stdout).matches("run").count(), 1);
    assert!(t.elapsed() < Duration::from_secs(5));
}
