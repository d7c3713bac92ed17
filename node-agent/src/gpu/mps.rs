//! One real MPS control daemon per fault domain, driven through `nvidia-cuda-mps-control` with
//! bounded waits.

use crate::sys::process::{run_bounded, RunError};
use mpsr_proto::{DomainId, ServerState};
use std::path::{Path, PathBuf};

pub use crate::gpu::dirs::Started;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct MpsDaemon {
    pub domain: DomainId,
    pub uuid: String,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    pub binary: PathBuf,
    pub multiuser: bool,
    pub timeout: Duration,
}

impl MpsDaemon {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.binary);
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            // The daemon and its server see only this GPU.
            .env("CUDA_VISIBLE_DEVICES", &self.uuid);
        c
    }

    /// Starts the daemon (`-d`) in fresh directories (`gpu::dirs`), unless one already answers
    /// on this pipe dir: that one is adopted (`Started::Adopted`). A daemon that does not answer in
    /// time may still be there (hung): its directories are left alone and that is an error.
    pub fn start(&self, owner_uid: Option<u32>) -> Result<Started, RunError> {
        let dir_err = |d: &Path| {
            let binary = d.display().to_string();
            move |source| RunError::Spawn { binary, source }
        };
        match self.server_list() {
            Ok(_) => {
                crate::gpu::dirs::harden_adopted(&self.log_dir).map_err(dir_err(&self.log_dir))?;
                return Ok(Started::Adopted);
            }
            Err(e @ RunError::Timeout { .. }) => return Err(e),
            Err(_) => {}
        }
        crate::gpu::dirs::fresh(&self.pipe_dir, &self.log_dir, owner_uid)
            .map_err(dir_err(&self.pipe_dir))?;
        let mut c = self.command();
        c.arg("-d");
        if self.multiuser {
            c.arg("-multiuser-server");
        }
        let out = run_bounded(c, None, self.timeout, "nvidia-cuda-mps-control -d")?;
        if !out.0 {
            return Err(RunError::Failed {
                command: "nvidia-cuda-mps-control -d".into(),
                output: out.1,
            });
        }
        // The daemon forks; wait until it answers.
        let deadline = Instant::now() + self.timeout;
        while Instant::now() < deadline {
            if self.server_list().is_ok() {
                return Ok(Started::Fresh);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(RunError::Timeout {
            command: "control daemon start".into(),
            ms: self.timeout.as_millis(),
        })
    }

    /// Sends one command on stdin and returns stdout.
    pub fn send(&self, cmd: &str) -> Result<String, RunError> {
        let (ok, out) = run_bounded(self.command(), Some(cmd), self.timeout, cmd)?;
        if !ok {
            return Err(RunError::Failed {
                command: cmd.into(),
                output: out,
            });
        }
        Ok(out)
    }

    pub fn server_list(&self) -> Result<Vec<u32>, RunError> {
        Ok(parse_pids(&self.send("get_server_list")?))
    }

    pub fn client_list(&self, server: u32) -> Result<Vec<u32>, RunError> {
        Ok(parse_pids(
            &self.send(&format!("get_client_list {server}"))?,
        ))
    }

    pub fn terminate_client(&self, server: u32, client: u32) -> Result<(), RunError> {
        self.send(&format!("terminate_client {server} {client}"))
            .map(|_| ())
    }

    /// Limits for every client of this domain's server (a client can only lower them).
    pub fn set_defaults(
        &self,
        thread_pct: Option<u8>,
        mem_limit: Option<u64>,
    ) -> Result<(), RunError> {
        if let Some(p) = thread_pct.filter(|p| *p < 100) {
            self.send(&format!("set_default_active_thread_percentage {p}"))?;
        }
        if let Some(bytes) = mem_limit {
            // Device 0: inside the daemon's CUDA_VISIBLE_DEVICES the one GPU is ordinal 0.
            self.send(&format!(
                "set_default_device_pinned_mem_limit 0 {}",
                mem_limit_arg(bytes)
            ))?;
        }
        Ok(())
    }

    /// The server's state: FAULT and recovery show in `get_server_status` where the driver has it,
    /// otherwise in control.log lines.
    pub fn state(&self) -> ServerState {
        match self.server_list() {
            Err(_) => ServerState::Down,
            Ok(servers) if servers.is_empty() => ServerState::Idle,
            Ok(servers) => status_of(&self.send(&format!("get_server_status {}", servers[0]))),
        }
    }

    /// This domain's control daemon and server processes, found in /proc by program and pipe
    /// directory (the daemon may not answer): (control daemons, servers).
    pub fn processes(&self) -> (Vec<u32>, Vec<u32>) {
        let find = |program: &str| {
            crate::sys::procfs::by_program_and_env(
                &[program],
                "CUDA_MPS_PIPE_DIRECTORY",
                self.pipe_dir.as_os_str(),
            )
        };
        (
            find("nvidia-cuda-mps-control"),
            find("nvidia-cuda-mps-server"),
        )
    }

    pub fn quit(&self) -> Result<(), RunError> {
        self.send("quit").map(|_| ())
    }

    pub fn control_log(&self) -> PathBuf {
        self.log_dir.join("control.log")
    }

    pub fn server_log(&self) -> PathBuf {
        self.log_dir.join("server.log")
    }
}

pub fn parse_pids(out: &str) -> Vec<u32> {
    out.split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// A running server's state from what `get_server_status` gave: an answer without a state (an
/// MPS before the command) or a refusal counts as ACTIVE; no answer at all (the daemon stopped
/// or hung after it listed the server) is a daemon not answering, never ACTIVE: measured on an
/// H100, a daemon SIGSTOPped between the two commands was otherwise reported ACTIVE 3 s later,
/// and the ladder never climbed for a server nobody could reach.
fn status_of(answer: &Result<String, RunError>) -> ServerState {
    match answer {
        Ok(s) => parse_status(s).unwrap_or(ServerState::Active),
        Err(RunError::Failed { .. }) => ServerState::Active,
        Err(RunError::Timeout { .. } | RunError::Spawn { .. }) => ServerState::Down,
    }
}

pub fn parse_status(out: &str) -> Option<ServerState> {
    let u = out.to_ascii_uppercase();
    if u.contains("FAULT") {
        Some(ServerState::Fault)
    } else if u.contains("ACTIVE") {
        Some(ServerState::Active)
    } else if u.contains("INIT") {
        Some(ServerState::Idle)
    } else {
        None
    }
}

/// A byte count as MPS limit syntax: whole GiB as `NG`, else MiB rounded up (`NM`).
pub fn mem_limit_arg(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    if bytes.is_multiple_of(GIB) {
        format!("{}G", bytes / GIB)
    } else {
        format!("{}M", bytes.div_ceil(MIB))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon that listed its server and then did not answer the status is not ACTIVE.
    #[test]
    fn a_status_never_answered_is_not_active() {
        let said = |s: &str| Ok(s.to_string());
        assert_eq!(status_of(&said("ACTIVE\n")), ServerState::Active);
        assert_eq!(status_of(&said("FAULT\n")), ServerState::Fault);
        assert_eq!(
            status_of(&said("")),
            ServerState::Active,
            "an MPS without the command"
        );
        let refused = Err(RunError::Failed {
            command: "get_server_status 7".into(),
            output: String::new(),
        });
        assert_eq!(status_of(&refused), ServerState::Active);
        let hung = Err(RunError::Timeout {
            command: "get_server_status 7".into(),
            ms: 3000,
        });
        assert_eq!(status_of(&hung), ServerState::Down);
    }

    #[test]
    fn bounded_run_kills_hung_command() {
        let mut c = Command::new("sleep");
        c.arg("5");
        let t = Instant::now();
        let e = run_bounded(c, None, Duration::from_millis(200), "sleep").unwrap_err();
        assert!(matches!(e, RunError::Timeout { .. }));
        assert!(t.elapsed() < Duration::from_secs(2));
        let (ok, out) = run_bounded(
            Command::new("cat"),
            Some("get_server_list"),
            Duration::from_secs(5),
            "cat",
        )
        .unwrap();
        assert!(ok);
        assert_eq!(out, "get_server_list");
    }

    #[test]
    fn mem_limits_in_mps_syntax() {
        assert_eq!(mem_limit_arg(16 << 30), "16G");
        assert_eq!(mem_limit_arg(512 << 20), "512M");
        assert_eq!(mem_limit_arg((1 << 20) + 1), "2M");
    }

    #[test]
    fn pids_and_status() {
        assert_eq!(parse_pids("123\n456\n"), vec![123, 456]);
        assert_eq!(parse_status("ACTIVE"), Some(ServerState::Active));
        assert_eq!(parse_status("FAULT"), Some(ServerState::Fault));
        assert_eq!(parse_status("???"), None);
    }
}
