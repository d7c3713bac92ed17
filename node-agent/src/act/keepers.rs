//! Starts and watches one state keeper (`mpsr-keeper`) per GPU. Keepers run outside MPS and
//! outlive agent restarts (like the MPS daemons); the agent reconnects to a running one, tells it
//! when jobs end, and starts a fresh one when one is gone.

use crate::config::Config;
use mpsr_proto::keeper::{KeeperRequest, KeeperResponse};
use mpsr_proto::{read_frame, write_frame, FrameError};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Keepers {
    enabled: bool,
    binary: PathBuf,
    /// (index, uuid) per GPU.
    gpus: Vec<(u32, String)>,
    run_dir: PathBuf,
    agent_socket: PathBuf,
    snapshot_dir: PathBuf,
    quota: String,
    interval_s: u64,
    host_sim: bool,
    pub keep_after_requeue: Duration,
}

/// Why a keeper could not be asked or started.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("keeper socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("keeper exchange: {0}")]
    Frame(#[from] FrameError),
    #[error("no GPU {0}")]
    NoGpu(u32),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("state keeper for gpu{gpu} did not come up (see {log})")]
    NotUp { gpu: u32, log: PathBuf },
}

pub fn call(
    path: &Path,
    req: &KeeperRequest,
    timeout: Duration,
) -> Result<KeeperResponse, KeeperError> {
    let mut s = UnixStream::connect(path).map_err(|source| KeeperError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    write_frame(&mut s, req)?;
    Ok(read_frame(&mut s)?)
}

impl Keepers {
    pub fn new(cfg: &Config, gpus: Vec<(u32, String)>, host_sim: bool) -> Keepers {
        let binary = if cfg.keeper.binary.as_os_str().is_empty() {
            std::env::current_exe()
                .map(|e| e.with_file_name("mpsr-keeper"))
                .unwrap_or_else(|_| "mpsr-keeper".into())
        } else {
            cfg.keeper.binary.clone()
        };
        Keepers {
            enabled: cfg.keeper.enabled,
            binary,
            gpus,
            run_dir: cfg.run_dir.clone(),
            agent_socket: cfg.socket.clone(),
            snapshot_dir: cfg.keeper.snapshot_dir.clone(),
            quota: cfg.keeper.max_bytes_per_job.clone(),
            interval_s: cfg.keeper.snapshot_interval_s,
            host_sim,
            keep_after_requeue: Duration::from_secs(cfg.keeper.keep_after_requeue_s),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn socket(&self, gpu: u32) -> PathBuf {
        self.run_dir.join(format!("gpu{gpu}")).join("keeper.sock")
    }

    fn ping(&self, gpu: u32) -> Option<u32> {
        match call(
            &self.socket(gpu),
            &KeeperRequest::Ping,
            Duration::from_secs(2),
        ) {
            Ok(KeeperResponse::Pong { pid, .. }) => Some(pid),
            _ => None,
        }
    }

    /// Makes sure a keeper serves `gpu`; starts one if none answers.
    pub fn ensure(&self, gpu: u32) -> Result<(), KeeperError> {
        if !self.enabled || self.ping(gpu).is_some() {
            return Ok(());
        }
        let uuid = self
            .gpus
            .iter()
            .find(|(i, _)| *i == gpu)
            .map(|(_, u)| u.clone())
            .ok_or(KeeperError::NoGpu(gpu))?;
        let dir = self.run_dir.join(format!("gpu{gpu}"));
        let no_mps = self.run_dir.join("keeper-no-mps");
        for d in [&dir, &no_mps, &self.snapshot_dir] {
            std::fs::create_dir_all(d).map_err(|source| KeeperError::Io {
                path: d.clone(),
                source,
            })?;
        }
        let log_path = dir.join("keeper.log");
        let io = |source| KeeperError::Io {
            path: log_path.clone(),
            source,
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io)?;
        let mut c = Command::new(&self.binary);
        c.arg("--gpu")
            .arg(gpu.to_string())
            .arg("--socket")
            .arg(self.socket(gpu))
            .arg("--agent-socket")
            .arg(&self.agent_socket)
            .arg("--snapshot-dir")
            .arg(&self.snapshot_dir)
            .arg("--max-bytes-per-job")
            .arg(&self.quota)
            .arg("--snapshot-interval-s")
            .arg(self.interval_s.to_string())
            .arg("--backend")
            .arg(if self.host_sim { "host-sim" } else { "cuda" })
            // Only this GPU, and never an MPS client: a pipe directory with no daemon in it means
            // CUDA runs without MPS (the keeper must stay outside the server's fault domain).
            .env("CUDA_VISIBLE_DEVICES", &uuid)
            .env("CUDA_MPS_PIPE_DIRECTORY", &no_mps)
            .env("CUDA_MPS_LOG_DIRECTORY", &no_mps);
        // Its own session: the keeper outlives agent restarts.
        crate::sys::process::prepare(&mut c, true);
        let mut child = c
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io)?)
            .stderr(log)
            .spawn()
            .map_err(|source| KeeperError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        // Reaped when it exits (after a GPU reset's restart, say): no zombie keepers.
        let _ = std::thread::Builder::new()
            .name(format!("keeper{gpu}-reaper"))
            .spawn(move || child.wait());
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if self.ping(gpu).is_some() {
                tracing::info!(gpu, "state keeper started");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(KeeperError::NotUp { gpu, log: log_path })
    }

    pub fn ensure_all(&self) {
        for (gpu, _) in &self.gpus {
            if let Err(e) = self.ensure(*gpu) {
                tracing::warn!(gpu, error = %e, "state keeper not available");
            }
        }
    }

    /// After a GPU reset its memory is gone: replace the keeper (snapshots bring state back).
    pub fn restart(&self, gpu: u32) {
        if let Some(pid) = self.ping(gpu) {
            // SAFETY: kill(2) on the pid our keeper reported for itself.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            // The new keeper binds the same socket: wait until the old one is gone.
            let end = Instant::now() + Duration::from_secs(5);
            while Instant::now() < end && self.ping(gpu) == Some(pid) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.ping(gpu) == Some(pid) {
                tracing::warn!(gpu, pid, "state keeper ignored SIGTERM for 5 s; SIGKILL");
                // SAFETY: as above.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        if let Err(e) = self.ensure(gpu) {
            tracing::warn!(gpu, error = %e, "state keeper restart failed");
        }
    }

    /// The job ended: each keeper frees its allocations after `keep_for`.
    pub fn job_end(&self, job_id: u32, keep_for: Duration) {
        if !self.enabled {
            return;
        }
        for (gpu, _) in &self.gpus {
            let r = call(
                &self.socket(*gpu),
                &KeeperRequest::JobEnd {
                    job_id,
                    keep_for_s: keep_for.as_secs(),
                },
                Duration::from_secs(5),
            );
            if let Err(e) = r {
                tracing::debug!(gpu, job = job_id, error = %e, "keeper job end not delivered");
            }
        }
    }
}

/// What to do with state kept for a requeued job, from what Slurm says of it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptVerdict {
    /// It may still run again (pending, or Slurm did not answer): keep.
    Keep,
    /// It will not run again (cancelled or ended while pending, or gone): free now.
    Free,
    /// The keep time is over: the keeper frees it by itself; forget it.
    Expired,
}

pub fn kept_verdict(
    until_ms: u64,
    now_ms: u64,
    facts: &Result<Option<crate::act::slurm::listing::JobFacts>, crate::sys::process::RunError>,
) -> KeptVerdict {
    if now_ms >= until_ms {
        return KeptVerdict::Expired;
    }
    match facts {
        Ok(None) => KeptVerdict::Free,
        Ok(Some(f)) if f.finished() => KeptVerdict::Free,
        _ => KeptVerdict::Keep,
    }
}

#[cfg(test)]
mod kept_tests {
    use super::*;
    use crate::act::slurm::listing::JobFacts;

    #[test]
    fn state_kept_for_a_requeued_job_is_freed_once_slurm_says_it_will_not_run_again() {
        let f = |s: &str| Ok(Some(JobFacts::parse(s, 7).unwrap()));
        assert_eq!(
            kept_verdict(100, 1, &f("7|PENDING|N/A|1|1|1|")),
            KeptVerdict::Keep
        );
        assert_eq!(
            kept_verdict(100, 1, &f("7|CANCELLED|2026-12-06T10:00:00|1|1|1|")),
            KeptVerdict::Free
        );
        assert_eq!(kept_verdict(100, 1, &Ok(None)), KeptVerdict::Free, "gone");
        let down = Err(crate::sys::process::RunError::Timeout {
            command: "scontrol".into(),
            ms: 1,
        });
        assert_eq!(
            kept_verdict(100, 1, &down),
            KeptVerdict::Keep,
            "Slurm did not answer"
        );
        assert_eq!(
            kept_verdict(100, 100, &f("7|PENDING|N/A|1|1|1|")),
            KeptVerdict::Expired
        );
    }
}
