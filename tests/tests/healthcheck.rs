//! The health check script (scripts/slurm/mpsr-healthcheck) against stand-ins for `mpsrctl` and
//! `scontrol`/`sinfo` (no Slurm, no agent): it acts on mpsrctl's exit status only, drains with the agent's
//! reason, resumes only its own drains, and never drains on an error reply or a missing agent.
//! (The same script against real slurmctld and agents: tests/slurm.rs.)

use std::path::{Path, PathBuf};
use std::process::Command;

struct Stand {
    dir: PathBuf,
}

impl Stand {
    /// `mpsrctl` exits `rc` printing `out` (stdout) and `err` (stderr); `sinfo -O` reports
    /// `state` and `reason` as Slurm does (lower case, padded, once per partition); every
    /// scontrol call is logged.
    fn new(name: &str, rc: i32, out: &str, err: &str, state: &str, reason: &str) -> Stand {
        let dir =
            std::env::temp_dir().join(format!("mpsr-healthcheck-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.display();
        let script = |p: &Path, body: String| {
            std::fs::write(p, body).unwrap();
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        };
        script(
            &dir.join("mpsrctl"),
            format!(
                "#!/bin/bash\necho \"$*\" >> {d}/mpsrctl.args\nprintf '%s' '{out}'\nprintf '%s' '{err}' >&2\nexit {rc}\n"
            ),
        );
        script(
            &dir.join("scontrol"),
            format!("#!/bin/bash\necho \"$*\" >> {d}/scontrol.log\n"),
        );
        let state = state.to_ascii_lowercase();
        script(
            &dir.join("sinfo"),
            format!(
                "#!/bin/bash\n[ \"$*\" = '-h -N -n n1 -O StateComplete:|,Reason:|' ] || exit 1\nprintf '%s|%s  |\\n%s|%s  |\\n' '{state}' '{reason}' '{state}' '{reason}'\n"
            ),
        );
        std::fs::write(
            dir.join("scripts.conf"),
            format!("MPSRCTL={d}/mpsrctl\nSCONTROL={d}/scontrol\nSINFO={d}/sinfo\nMPSR_SOCKET={d}/agent.sock\n"),
        )
        .unwrap();
        Stand { dir }
    }

    fn run(&self) -> String {
        let script = mpsr_e2e::script("mpsr-healthcheck");
        let out = Command::new("bash")
            .arg(script)
            .env("MPSR_SCRIPTS_CONF", self.dir.join("scripts.conf"))
            .env("SLURMD_NODENAME", "n1")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The scontrol updates the script made.
    fn updates(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("scontrol.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("update"))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Stand {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const REASON: &str = "mpsr: xid 79 (device_lost) on gpu0 of n1";

#[test]
fn unhealthy_drains_with_the_agents_reason() {
    let s = Stand::new("unhealthy", 5, REASON, "", "IDLE", "none");
    s.run();
    assert_eq!(
        s.updates(),
        vec![format!("update NodeName=n1 State=DRAIN Reason={REASON}")]
    );
    let args = std::fs::read_to_string(s.dir.join("mpsrctl.args")).unwrap();
    assert!(args.contains("health --reason"), "{args}");
}

#[test]
fn an_error_reply_or_no_agent_drains_nothing() {
    // 1: the agent answered with an error (e.g. refused); 3: no agent; 124: timed out; 2: usage.
    for rc in [1, 2, 3, 124] {
        let s = Stand::new(
            &format!("rc{rc}"),
            rc,
            "node n1 UNHEALTHY: looks bad",
            "mpsrctl: agent said no",
            "IDLE",
            "none",
        );
        let out = s.run();
        assert!(s.updates().is_empty(), "rc {rc}: {:?}", s.updates());
        assert!(out.contains("no verdict"), "rc {rc}: {out}");
    }
}

#[test]
fn healthy_resumes_only_its_own_drain() {
    let ours = Stand::new("ours", 0, "", "", "IDLE+DRAIN", REASON);
    ours.run();
    assert_eq!(ours.updates(), vec!["update NodeName=n1 State=RESUME"]);
    let theirs = Stand::new(
        "theirs",
        0,
        "",
        "",
        "IDLE+DRAIN",
        "admin: maintenance | mpsr: x",
    );
    theirs.run();
    assert!(theirs.updates().is_empty(), "{:?}", theirs.updates());
    // Unhealthy, but drained by someone else already: left alone.
    let other = Stand::new("other", 5, REASON, "", "IDLE+DRAIN", "admin: maintenance");
    other.run();
    assert!(other.updates().is_empty(), "{:?}", other.updates());
}

/// The NHC check (etc/nhc/mpsr.nhc), sourced as NHC does with NHC's `die` and `log` stand-ins:
/// it fails the node with the agent's reason on exit 5 only; healthy and no-verdict exits pass.
#[test]
fn the_nhc_check_fails_the_node_only_on_the_agents_unhealthy_verdict() {
    let check = mpsr_e2e::repo_root().join("etc/nhc/mpsr.nhc");
    for (rc, expect_rc, expect) in [
        (5, 1, format!("DIE 1 {REASON}")),
        (0, 0, String::new()),
        (
            3,
            0,
            "LOG check_mpsr: no verdict from the agent (mpsrctl exit 3".to_string(),
        ),
        (1, 0, "LOG check_mpsr: no verdict".to_string()),
    ] {
        let s = Stand::new(
            &format!("nhc{rc}"),
            rc,
            &format!("{REASON}\nmore"),
            "",
            "IDLE",
            "none",
        );
        let d = s.dir.display();
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "die() {{ echo \"DIE $*\"; }}; log() {{ echo \"LOG $*\"; }}; . {}; check_mpsr; echo \"rc=$?\"",
                check.display()
            ))
            .env("MPSR_NHC_MPSRCTL", format!("{d}/mpsrctl"))
            .env("MPSR_NHC_SOCKET", format!("{d}/%n.sock"))
            .env("HOSTNAME_S", "n1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!("rc={expect_rc}")),
            "exit {rc}: {text}"
        );
        assert!(text.contains(&expect), "exit {rc}: {text}");
        if rc != 5 {
            assert!(!text.contains("DIE"), "exit {rc}: {text}");
        }
        let args = std::fs::read_to_string(s.dir.join("mpsrctl.args")).unwrap();
        assert!(args.contains(&format!("--socket {d}/n1.sock")), "{args}");
    }
}
