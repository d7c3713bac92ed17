//! Waiting for a file to change without polling it: inotify on its directory (so a log that is
//! recreated is seen too), with a bound on each wait. Where inotify is not available (no more
//! watches, an odd filesystem) it falls back to a short sleep, as the tails did before.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

/// The wait where inotify cannot be used.
const FALLBACK: Duration = Duration::from_millis(50);

pub struct FileWatch {
    fd: Option<OwnedFd>,
}

impl FileWatch {
    /// Watches the directory of `file` for writes, creations and renames.
    pub fn new(file: &Path) -> FileWatch {
        let dir = file.parent().unwrap_or(Path::new("."));
        FileWatch { fd: watch(dir) }
    }

    /// Whether changes wake it (false: it sleeps FALLBACK each time).
    pub fn notified(&self) -> bool {
        self.fd.is_some()
    }

    /// Returns when something in the directory changed, or after `max`.
    pub fn wait(&self, max: Duration) {
        let Some(fd) = &self.fd else {
            std::thread::sleep(FALLBACK.min(max));
            return;
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = max.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `p` is one valid pollfd and the count says one.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            // Drain the events; which file changed does not matter (the caller stats its own).
            let mut buf = [0u8; 4096];
            // SAFETY: `buf` is writable for its length; the fd is non-blocking.
            while unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        } else if n < 0 {
            std::thread::sleep(FALLBACK.min(max));
        }
    }
}

fn watch(dir: &Path) -> Option<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: no arguments besides flags; the result is checked.
    let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` is a fresh fd we own from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mask = libc::IN_MODIFY | libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_CLOSE_WRITE;
    // SAFETY: `fd` is an inotify fd and `c` a NUL-terminated path.
    let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), c.as_ptr(), mask) };
    (wd >= 0).then_some(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_write_wakes_it_and_silence_lets_it_sleep() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("server.log");
        std::fs::write(&f, "").unwrap();
        let w = FileWatch::new(&f);
        assert!(w.notified(), "inotify available here");
        let t = Instant::now();
        w.wait(Duration::from_millis(300));
        assert!(
            t.elapsed() >= Duration::from_millis(250),
            "nothing changed: it waited"
        );
        let f2 = f.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            std::fs::write(&f2, "line\n").unwrap();
        });
        let t = Instant::now();
        w.wait(Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(2), "the write woke it");
        writer.join().unwrap();
    }

    #[test]
    fn a_missing_directory_falls_back_to_sleeping() {
        let w = FileWatch::new(Path::new("/nonexistent/mpsr/server.log"));
        assert!(!w.notified());
        let t = Instant::now();
        w.wait(Duration::from_secs(1));
        assert!(t.elapsed() < Duration::from_millis(500));
    }
}
