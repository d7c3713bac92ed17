//! The hot standby's side of a takeover: a standby incarnation of a task, prepared in another
//! fault domain, waits here until the node agent releases it (a fault hit its task). The agent
//! opens the standby's FIFO and writes one byte; nothing else is said on it.

use std::io::Read;
use std::path::Path;

/// `primary` or `standby`: which incarnation of the task this process is (set by `mpsr-run`).
pub const ROLE_ENV: &str = "MPSR_ROLE";
/// The FIFO a standby waits on (set by `mpsr-run` for the standby only).
pub const FIFO_ENV: &str = "MPSR_STANDBY_FIFO";
/// Set by the plugin (`--mps-standby`): `mpsr-run` keeps a hot standby of its task.
pub const WANTED_ENV: &str = "MPSR_STANDBY";

/// What `ready` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// This process is the task's primary (or runs without a standby): go on at once.
    Primary,
    /// This process was a standby and has just been released: the task is its own now.
    TookOver,
}

/// Returns at once in a primary; in a standby (`MPSR_ROLE=standby`), blocks until the agent
/// releases it. An error means the standby cannot wait (no FIFO): it should exit.
pub fn ready() -> std::io::Result<Ready> {
    if std::env::var(ROLE_ENV).as_deref() != Ok("standby") {
        return Ok(Ready::Primary);
    }
    let fifo = std::env::var_os(FIFO_ENV).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{ROLE_ENV}=standby without {FIFO_ENV}"),
        )
    })?;
    wait_release(Path::new(&fifo))?;
    Ok(Ready::TookOver)
}

/// Blocks until one byte is written to the FIFO. Opening it for reading registers this process
/// as its reader at once (the agent's non-blocking open for writing then succeeds); a FIFO
/// closed without a byte (its writer gone) is an error, not a release.
pub fn wait_release(fifo: &Path) -> std::io::Result<()> {
    let mut f = std::fs::File::open(fifo)?;
    let mut b = [0u8; 1];
    loop {
        match f.read(&mut b) {
            Ok(1) => return Ok(()),
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "standby FIFO closed without a release",
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_waits_until_one_byte_is_written() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("release");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let f2 = fifo.clone();
        let waiter = std::thread::spawn(move || {
            let t = std::time::Instant::now();
            wait_release(&f2).map(|_| t.elapsed())
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        // As the agent releases it: a non-blocking open succeeds only with a reader there.
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        std::io::Write::write_all(&mut w, b"g").unwrap();
        let waited = waiter.join().unwrap().unwrap();
        assert!(
            waited >= std::time::Duration::from_millis(150),
            "{waited:?}"
        );
        // No reader: the release fails at once (ENXIO), so the agent falls back to a restart.
        let e = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENXIO));
    }

    use std::os::unix::fs::OpenOptionsExt;
}
