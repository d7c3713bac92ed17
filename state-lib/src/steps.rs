//! `mpsr_step()`: the application marks the end of each step (a training iteration, a decode
//! step, a served batch). The time between marks goes into a small shared file the agent's
//! telemetry reads each round (format: mpsr_telemetry::steps), giving per-rank step-time skew and
//! latency spikes. A mark costs a clock read and a few stores: no system call after the first.

use crate::StateError;
use mpsr_telemetry::steps::{self, MAGIC, OFF_COUNT, OFF_LAST, OFF_RING, OFF_SEQ, RING, SIZE};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

struct Writer {
    /// The process that made it: a forked child makes its own.
    pid: u32,
    map: *mut u8,
    count: u64,
    last_ns: u64,
    path: PathBuf,
}

// SAFETY: the mapping is used only under WRITER's lock.
unsafe impl Send for Writer {}

static WRITER: Mutex<Option<Writer>> = Mutex::new(None);

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn dir() -> PathBuf {
    std::env::var_os("MPSR_STEP_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(steps::DEFAULT_DIR))
}

impl Writer {
    fn create(pid: u32) -> Result<Writer, StateError> {
        let path = steps::path(&dir(), pid);
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| StateError::BadArgument("step directory has a NUL".into()))?;
        // A file of an earlier process with this pid: ours now (unlinking never follows a link).
        // SAFETY: `c` is a valid C string.
        unsafe { libc::unlink(c.as_ptr()) };
        // SAFETY: as above; O_EXCL|O_NOFOLLOW: never opens what someone planted.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o644,
            )
        };
        if fd < 0 {
            return Err(StateError::Unavailable(format!(
                "step file {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fd` is ours; the mapping is SIZE bytes of a file truncated to SIZE.
        let map = unsafe {
            if libc::ftruncate(fd, SIZE as libc::off_t) != 0 {
                libc::close(fd);
                return Err(StateError::Unavailable(
                    "step file: ftruncate failed".into(),
                ));
            }
            let m = libc::mmap(
                std::ptr::null_mut(),
                SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            m
        };
        if map == libc::MAP_FAILED {
            return Err(StateError::Unavailable("step file: mmap failed".into()));
        }
        let map = map as *mut u8;
        // SAFETY: the mapping is SIZE >= 8 bytes, writable.
        unsafe { std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), map, MAGIC.len()) };
        Ok(Writer {
            pid,
            map,
            count: 0,
            last_ns: 0,
            path,
        })
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the layout's 8-aligned offsets inside the page-aligned mapping,
        // which lives as long as the writer.
        unsafe { &*(self.map.add(off) as *const AtomicU64) }
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as above, 4-aligned.
        unsafe { &*(self.map.add(off) as *const AtomicU32) }
    }

    fn mark(&mut self, now: u64) {
        if self.last_ns != 0 {
            let us = (now.saturating_sub(self.last_ns) / 1000).min(u32::MAX as u64) as u32;
            self.u64(OFF_SEQ).fetch_add(1, Ordering::AcqRel); // odd: in a step
            let slot = OFF_RING + (self.count % RING as u64) as usize * 4;
            self.u32(slot).store(us, Ordering::Relaxed);
            self.count += 1;
            self.u64(OFF_COUNT).store(self.count, Ordering::Relaxed);
            self.u64(OFF_LAST).store(now, Ordering::Relaxed);
            self.u64(OFF_SEQ).fetch_add(1, Ordering::Release);
        } else {
            self.u64(OFF_LAST).store(now, Ordering::Release);
        }
        self.last_ns = now;
    }
}

/// Marks the end of one step of this process (the first call starts the clock).
pub fn step() -> Result<(), StateError> {
    let now = now_ns();
    let pid = std::process::id();
    let mut w = WRITER.lock().unwrap_or_else(|p| p.into_inner());
    if w.as_ref().is_none_or(|w| w.pid != pid) {
        *w = Some(Writer::create(pid)?);
    }
    if let Some(w) = w.as_mut() {
        w.mark(now);
    }
    Ok(())
}

/// Says this process is idle (waiting for requests, writing a checkpoint, evaluating): no step
/// is under way, so the wait is neither a long step nor a stall; the next `step()` starts the
/// clock again without counting it.
pub fn idle() -> Result<(), StateError> {
    let pid = std::process::id();
    let mut w = WRITER.lock().unwrap_or_else(|p| p.into_inner());
    if w.as_ref().is_none_or(|w| w.pid != pid) {
        *w = Some(Writer::create(pid)?);
    }
    if let Some(w) = w.as_mut() {
        w.last_ns = 0;
        w.u64(OFF_LAST).store(0, Ordering::Release);
    }
    Ok(())
}

/// Removes this process's step file (at a clean exit; the agent removes those of processes that
/// died).
pub fn finish() {
    let mut w = WRITER.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = w.take() {
        if w.pid == std::process::id() {
            let _ = std::fs::remove_file(&w.path);
        }
        // SAFETY: the mapping was made with this size and is not used after.
        unsafe { libc::munmap(w.map as *mut libc::c_void, SIZE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpsr_telemetry::steps::StepRecord;

    #[test]
    fn marks_are_read_back_as_step_times() {
        let d = std::env::temp_dir().join(format!("mpsr-steps-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::env::set_var("MPSR_STEP_DIR", &d);
        for _ in 0..4 {
            step().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let b = std::fs::read(steps::path(&d, std::process::id())).unwrap();
        let r = StepRecord::parse(&b).unwrap();
        assert_eq!(r.count, 3, "4 marks are 3 steps");
        for s in r.since(0) {
            assert!((0.019..0.5).contains(&s), "{s}");
        }
        // Idle: no step under way; the wait is not counted, the next mark restarts the clock.
        idle().unwrap();
        let b = std::fs::read(steps::path(&d, std::process::id())).unwrap();
        assert_eq!(StepRecord::parse(&b).unwrap().last_ns, 0);
        std::thread::sleep(std::time::Duration::from_millis(100));
        step().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        step().unwrap();
        let b = std::fs::read(steps::path(&d, std::process::id())).unwrap();
        let r = StepRecord::parse(&b).unwrap();
        assert_eq!(r.count, 4, "the idle time is no step");
        assert!(r.since(3)[0] < 0.09, "{:?}", r.since(3));
        finish();
        assert!(!steps::path(&d, std::process::id()).exists());
        let _ = std::fs::remove_dir_all(&d);
    }
}
