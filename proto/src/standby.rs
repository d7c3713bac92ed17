//! The standby's side of a takeover: a standby incarnation of a task, prepared in another fault
//! domain, waits here until the node agent releases it (a fault hit its task). The agent opens the
//! standby's FIFO and writes one byte; nothing else is said on it.
//!
//! Two kinds. A **hot** standby (`MPSR_ROLE=standby`) prepares everything, its CUDA context and
//! warm-up included, and waits in `ready()`: it computes ~20 ms after a fault, and holds a CUDA
//! context (GPU memory, and a later driver report of every SM fault on that GPU) while it waits.
//! A **warm** standby (`MPSR_ROLE=warm`) waits in `before_cuda()`, before the application's first
//! CUDA call (its imports and host set-up done): no CUDA context, no GPU memory; released, it
//! creates its context and attaches its kept state.
//!
//! A **cold** standby is no process of the application at all: the task's supervisor (`mpsr-run`,
//! for a resume task that keeps no hot or warm standby) waits on the FIFO itself and starts the
//! task's next incarnation in the standby's domain the moment the agent releases it, while the
//! hit server still recovers: the restart overlaps the fault's handling. It costs nothing on the
//! GPU; the agent makes one only where the GPU already runs another domain to restart in.

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// `primary`, `standby` (hot) or `warm`: which incarnation of the task this process is (set by
/// `mpsr-run`).
pub const ROLE_ENV: &str = "MPSR_ROLE";
/// The FIFO a standby waits on (set by `mpsr-run` for the standby only).
pub const FIFO_ENV: &str = "MPSR_STANDBY_FIFO";
/// Set by the plugin (`--mps-standby[=KIND]`): `mpsr-run` keeps a standby of its task; `1` or
/// `hot` a hot one, `warm` a warm one.
pub const WANTED_ENV: &str = "MPSR_STANDBY";

/// Which standby a task keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Prepared up to its first computation, CUDA context included.
    #[default]
    Hot,
    /// Prepared up to its first CUDA call: no CUDA context while it waits.
    Warm,
    /// Not prepared at all: its supervisor starts the next incarnation when released. Never
    /// asked for by users (`MPSR_STANDBY`); `mpsr-run` keeps one where it keeps no other.
    Cold,
}

impl Kind {
    /// `MPSR_STANDBY`'s value (`1` is what releases before 0.3 set for a hot one).
    pub fn from_env_value(v: &str) -> Option<Kind> {
        match v {
            "1" | "hot" => Some(Kind::Hot),
            "warm" => Some(Kind::Warm),
            _ => None,
        }
    }

    /// `MPSR_ROLE` of a standby of this kind.
    pub fn role(self) -> &'static str {
        match self {
            Kind::Hot => "standby",
            Kind::Warm => "warm",
            // No process of the application waits as a cold standby.
            Kind::Cold => "cold",
        }
    }

    pub fn is_hot(&self) -> bool {
        *self == Kind::Hot
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Hot => "hot",
            Kind::Warm => "warm",
            Kind::Cold => "cold",
        }
    }
}

/// Set once this process, a standby, was released: it is the task's process now.
static TOOK_OVER: AtomicBool = AtomicBool::new(false);

/// What `ready` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// This process is the task's primary (or runs without a standby): go on at once.
    Primary,
    /// This process was a standby and has just been released: the task is its own now.
    TookOver,
}

/// Where a standby stops: `ready` (after the warm-up) or `before_cuda`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    BeforeCuda,
    Ready,
}

/// Whether a process of `role` waits for its release at `point`: a hot standby at `ready` only
/// (it makes its context first); a warm one at the first of the two it reaches — a program that
/// never calls `before_cuda` still must not run on as a second incarnation of its task.
fn waits_at(role: Option<&str>, point: Point, took_over: bool) -> bool {
    if took_over {
        return false;
    }
    matches!(
        (role, point),
        (Some("standby"), Point::Ready) | (Some("warm"), _)
    )
}

/// Returns at once in a primary; in a hot standby (`MPSR_ROLE=standby`), or a warm one that has
/// not waited yet, blocks until the agent releases it. `TookOver` in a standby that was released
/// (here or in `before_cuda`). An error means the standby cannot wait (no FIFO): it should exit.
pub fn ready() -> std::io::Result<Ready> {
    wait_at(Point::Ready)
}

/// Call before the first CUDA call. Returns at once in a primary or a hot standby; in a warm
/// standby (`MPSR_ROLE=warm`), blocks until the agent releases it. As `ready`.
pub fn before_cuda() -> std::io::Result<Ready> {
    wait_at(Point::BeforeCuda)
}

fn wait_at(point: Point) -> std::io::Result<Ready> {
    let role = std::env::var(ROLE_ENV).ok();
    if waits_at(role.as_deref(), point, TOOK_OVER.load(Ordering::SeqCst)) {
        let fifo = std::env::var_os(FIFO_ENV).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "{ROLE_ENV}={} without {FIFO_ENV}",
                    role.as_deref().unwrap_or("")
                ),
            )
        })?;
        wait_release(Path::new(&fifo))?;
        TOOK_OVER.store(true, Ordering::SeqCst);
    }
    Ok(if TOOK_OVER.load(Ordering::SeqCst) {
        Ready::TookOver
    } else {
        Ready::Primary
    })
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

    /// A hot standby waits after its warm-up, a warm one before CUDA (or at `ready` when the
    /// program has no `before_cuda`), a primary never, nobody after a takeover.
    #[test]
    fn each_standby_waits_at_its_point_and_only_once() {
        use Point::*;
        for (role, point, want) in [
            (None, BeforeCuda, false),
            (None, Ready, false),
            (Some("primary"), Ready, false),
            (Some("standby"), BeforeCuda, false),
            (Some("standby"), Ready, true),
            (Some("warm"), BeforeCuda, true),
            (Some("warm"), Ready, true),
        ] {
            assert_eq!(waits_at(role, point, false), want, "{role:?} at {point:?}");
            assert!(
                !waits_at(role, point, true),
                "{role:?} at {point:?} after a takeover"
            );
        }
    }

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
