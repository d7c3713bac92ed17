//! Kept GPU state for applications. `attach("weights", bytes)` maps the job's allocation of that
//! name, held by the GPU's state keeper outside MPS: after a GPU fault kills this process, its
//! restarted self (mpsr-run, or a requeued job on the same node within the keep time) attaches the
//! same memory with its contents intact, instead of reloading it.
//!
//! The keeper is found through `MPSR_KEEPER_SOCKET` (set by the SPANK plugin). C ABI: see
//! include/mpsr_state.h; Python: python/mpsr_state.py.

mod steps;

use mpsr_proto::keeper::{KeeperRequest, KeeperResponse, MemKind, Origin};
use mpsr_proto::{fdpass, read_frame, write_frame};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

/// Error codes of the C ABI (negative).
pub const MPSR_OK: c_int = 0;
pub const MPSR_EINVAL: c_int = -1;
pub const MPSR_EUNAVAILABLE: c_int = -2;
pub const MPSR_EREFUSED: c_int = -3;
pub const MPSR_ECUDA: c_int = -4;
pub const MPSR_EPROTO: c_int = -5;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateError {
    BadArgument(String),
    /// No keeper (not in a protected job, or the keeper is down).
    Unavailable(String),
    /// The keeper said no (not your job, quota, size).
    Refused(String),
    Cuda(String),
    Protocol(String),
}

impl StateError {
    pub fn code(&self) -> c_int {
        match self {
            StateError::BadArgument(_) => MPSR_EINVAL,
            StateError::Unavailable(_) => MPSR_EUNAVAILABLE,
            StateError::Refused(_) => MPSR_EREFUSED,
            StateError::Cuda(_) => MPSR_ECUDA,
            StateError::Protocol(_) => MPSR_EPROTO,
        }
    }
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::BadArgument(m) => write!(f, "bad argument: {m}"),
            StateError::Unavailable(m) => write!(f, "state keeper unavailable: {m}"),
            StateError::Refused(m) => write!(f, "state keeper refused: {m}"),
            StateError::Cuda(m) => write!(f, "CUDA: {m}"),
            StateError::Protocol(m) => write!(f, "protocol: {m}"),
        }
    }
}

impl std::error::Error for StateError {}

enum Map {
    Cuda(mpsr_cuda::Mapping),
    Host { ptr: *mut c_void, len: usize },
}

// SAFETY: the pointers are process-wide mappings owned by this table; access is under a Mutex.
unsafe impl Send for Map {}

impl Map {
    fn ptr(&self) -> *mut c_void {
        match self {
            Map::Cuda(m) => m.ptr as *mut c_void,
            Map::Host { ptr, .. } => *ptr,
        }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        if let Map::Host { ptr, len } = self {
            // SAFETY: ptr/len came from our own successful mmap.
            unsafe { libc::munmap(*ptr, *len) };
        }
    }
}

struct Entry {
    map: Map,
    bytes: u64,
    origin: Origin,
    kind: MemKind,
}

static MAPS: Mutex<BTreeMap<String, Entry>> = Mutex::new(BTreeMap::new());

/// An attached allocation.
#[derive(Debug, Clone, Copy)]
pub struct Attached {
    /// Device pointer (or, with SIMULATED GPU memory, a host pointer).
    pub ptr: *mut c_void,
    pub bytes: u64,
    pub origin: Origin,
    pub kind: MemKind,
}

fn socket() -> Result<std::path::PathBuf, StateError> {
    std::env::var_os("MPSR_KEEPER_SOCKET")
        .map(Into::into)
        .ok_or_else(|| {
            StateError::Unavailable(
                "MPSR_KEEPER_SOCKET is not set (run inside a job with --mps-resilient)".into(),
            )
        })
}

fn call(req: &KeeperRequest) -> Result<(KeeperResponse, UnixStream), StateError> {
    let path = socket()?;
    // The keeper may be restarting (after a GPU reset the agent starts a fresh one): retry briefly.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut s = loop {
        match UnixStream::connect(&path) {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                ) && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(StateError::Unavailable(format!("{}: {e}", path.display()))),
        }
    };
    // Restoring a large snapshot can take a while; a dead keeper must not hang us forever.
    let _ = s.set_read_timeout(Some(Duration::from_secs(600)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    write_frame(&mut s, req).map_err(|e| StateError::Protocol(e.to_string()))?;
    let r: KeeperResponse = read_frame(&mut s).map_err(|e| StateError::Protocol(e.to_string()))?;
    if let KeeperResponse::Error { message, code } = &r {
        return Err(StateError::Refused(format!("{message} ({code:?})")));
    }
    Ok((r, s))
}

/// Maps the job's allocation `name` (created zeroed on first use, at least `bytes`).
pub fn attach(name: &str, bytes: u64) -> Result<Attached, StateError> {
    if bytes == 0 {
        return Err(StateError::BadArgument("bytes must be > 0".into()));
    }
    let mut maps = MAPS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = maps.get(name) {
        if bytes > e.bytes {
            return Err(StateError::BadArgument(format!(
                "'{name}' is attached with {} bytes; {bytes} asked",
                e.bytes
            )));
        }
        return Ok(Attached {
            ptr: e.map.ptr(),
            bytes: e.bytes,
            origin: e.origin,
            kind: e.kind,
        });
    }
    let (r, s) = call(&KeeperRequest::Attach {
        name: name.into(),
        bytes,
    })?;
    let KeeperResponse::Attached {
        bytes,
        origin,
        kind,
        ..
    } = r
    else {
        return Err(StateError::Protocol(format!("unexpected reply {r:?}")));
    };
    let fd =
        fdpass::recv_fd(&s).map_err(|e| StateError::Protocol(format!("receiving the fd: {e}")))?;
    let map = match kind {
        MemKind::Cuda => {
            mpsr_cuda::ensure_context(0).map_err(|e| StateError::Cuda(e.to_string()))?;
            Map::Cuda(
                mpsr_cuda::Mapping::import(0, &fd, bytes)
                    .map_err(|e| StateError::Cuda(e.to_string()))?,
            )
        }
        MemKind::HostSim => {
            // SAFETY: mapping a memfd of `bytes` bytes shared read-write; checked for failure.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(StateError::Cuda(format!(
                    "mmap of simulated GPU memory: {}",
                    std::io::Error::last_os_error()
                )));
            }
            Map::Host {
                ptr: p,
                len: bytes as usize,
            }
        }
    };
    let a = Attached {
        ptr: map.ptr(),
        bytes,
        origin,
        kind,
    };
    maps.insert(
        name.into(),
        Entry {
            map,
            bytes,
            origin,
            kind,
        },
    );
    Ok(a)
}

/// Unmaps `name` here; the keeper keeps it for the job.
pub fn detach(name: &str) -> Result<(), StateError> {
    let removed = MAPS.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
    if removed.is_none() {
        return Err(StateError::BadArgument(format!("'{name}' is not attached")));
    }
    call(&KeeperRequest::Detach { name: name.into() }).map(|_| ())
}

/// Writes `name` (or all of the job's allocations) to host snapshot files on the node; returns
/// the bytes written and the milliseconds it took.
pub fn checkpoint(name: Option<&str>) -> Result<(u64, u64), StateError> {
    match call(&KeeperRequest::Checkpoint {
        name: name.map(String::from),
    })? {
        (KeeperResponse::Checkpointed { bytes, ms, .. }, _) => Ok((bytes, ms)),
        (r, _) => Err(StateError::Protocol(format!("unexpected reply {r:?}"))),
    }
}

/// Frees `name` for good (this process's mapping, the keeper's memory and its snapshot).
pub fn release(name: &str) -> Result<(), StateError> {
    MAPS.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
    call(&KeeperRequest::Release { name: name.into() }).map(|_| ())
}

/// Fills an attached allocation with `byte` (test and demo helper, used by mpsr-statetool).
pub fn fill(name: &str, byte: u8) -> Result<(), StateError> {
    with_entry(name, |e| match &e.map {
        Map::Host { ptr, len } => {
            // SAFETY: ptr..ptr+len is our live shared mapping.
            unsafe { std::ptr::write_bytes(*ptr as *mut u8, byte, *len) };
            Ok(())
        }
        Map::Cuda(m) => {
            let chunk = vec![byte; (64 << 20).min(m.bytes as usize)];
            let mut off = 0;
            while off < m.bytes {
                let n = ((m.bytes - off) as usize).min(chunk.len());
                m.write(off, &chunk[..n])
                    .map_err(|e| StateError::Cuda(e.to_string()))?;
                off += n as u64;
            }
            Ok(())
        }
    })
}

/// Whether every byte of an attached allocation is `byte` (test and demo helper).
pub fn verify(name: &str, byte: u8) -> Result<bool, StateError> {
    with_entry(name, |e| match &e.map {
        Map::Host { ptr, len } => {
            // SAFETY: ptr..ptr+len is our live shared mapping.
            let s = unsafe { std::slice::from_raw_parts(*ptr as *const u8, *len) };
            Ok(s.iter().all(|b| *b == byte))
        }
        Map::Cuda(m) => {
            let mut buf = vec![0u8; (64 << 20).min(m.bytes as usize)];
            let mut off = 0;
            while off < m.bytes {
                let n = ((m.bytes - off) as usize).min(buf.len());
                m.read(off, &mut buf[..n])
                    .map_err(|e| StateError::Cuda(e.to_string()))?;
                if buf[..n].iter().any(|b| *b != byte) {
                    return Ok(false);
                }
                off += n as u64;
            }
            Ok(true)
        }
    })
}

fn with_entry<T>(
    name: &str,
    f: impl FnOnce(&Entry) -> Result<T, StateError>,
) -> Result<T, StateError> {
    let maps = MAPS.lock().unwrap_or_else(|p| p.into_inner());
    let e = maps
        .get(name)
        .ok_or_else(|| StateError::BadArgument(format!("'{name}' is not attached")))?;
    f(e)
}

// ---- C ABI ----------------------------------------------------------------------------------

thread_local! {
    static LAST: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
}

fn fail(e: StateError) -> c_int {
    let msg = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = msg);
    e.code()
}

fn guarded(f: impl FnOnce() -> Result<(), StateError>) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => MPSR_OK,
        Ok(Err(e)) => fail(e),
        Err(_) => fail(StateError::Protocol("internal error (a bug)".into())),
    }
}

/// # Safety
/// `name` must be a NUL-terminated string or NULL.
unsafe fn name_arg(name: *const c_char) -> Result<String, StateError> {
    if name.is_null() {
        return Err(StateError::BadArgument("name is NULL".into()));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    Ok(unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned())
}

/// See mpsr_state.h.
///
/// # Safety
/// `name` is a C string; `devptr` and `was_restored` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mpsr_state_attach(
    name: *const c_char,
    bytes: usize,
    devptr: *mut *mut c_void,
    was_restored: *mut c_int,
) -> c_int {
    guarded(|| {
        // SAFETY: forwarded caller contract.
        let n = unsafe { name_arg(name) }?;
        if devptr.is_null() {
            return Err(StateError::BadArgument("devptr is NULL".into()));
        }
        let a = attach(&n, bytes as u64)?;
        // SAFETY: devptr is non-NULL and writable per the contract; was_restored may be NULL.
        unsafe {
            *devptr = a.ptr;
            if !was_restored.is_null() {
                *was_restored = match a.origin {
                    Origin::New => 0,
                    Origin::Kept => 1,
                    Origin::Snapshot => 2,
                };
            }
        }
        Ok(())
    })
}

/// # Safety
/// `name` is a C string.
#[no_mangle]
pub unsafe extern "C" fn mpsr_state_detach(name: *const c_char) -> c_int {
    // SAFETY: forwarded caller contract.
    guarded(|| detach(&unsafe { name_arg(name) }?))
}

/// # Safety
/// `name` is a C string or NULL (all of the job's allocations).
#[no_mangle]
pub unsafe extern "C" fn mpsr_state_checkpoint(name: *const c_char) -> c_int {
    guarded(|| {
        let n = if name.is_null() {
            None
        } else {
            // SAFETY: non-NULL C string per the contract.
            Some(unsafe { name_arg(name) }?)
        };
        checkpoint(n.as_deref()).map(|_| ())
    })
}

/// # Safety
/// `name` is a C string.
#[no_mangle]
pub unsafe extern "C" fn mpsr_state_release(name: *const c_char) -> c_int {
    // SAFETY: forwarded caller contract.
    guarded(|| release(&unsafe { name_arg(name) }?))
}

/// See mpsr_state.h: 0 in a primary (at once), 1 in a standby once it took over, or an error.
#[no_mangle]
pub extern "C" fn mpsr_state_ready() -> c_int {
    standby_wait(mpsr_proto::standby::ready)
}

/// See mpsr_state.h: 0 in a primary or a hot standby (at once), 1 in a warm standby once it took
/// over, or an error.
#[no_mangle]
pub extern "C" fn mpsr_state_before_cuda() -> c_int {
    standby_wait(mpsr_proto::standby::before_cuda)
}

fn standby_wait(wait: fn() -> std::io::Result<mpsr_proto::standby::Ready>) -> c_int {
    let r = std::panic::catch_unwind(wait);
    match r {
        Ok(Ok(mpsr_proto::standby::Ready::Primary)) => 0,
        Ok(Ok(mpsr_proto::standby::Ready::TookOver)) => 1,
        Ok(Err(e)) => fail(StateError::Unavailable(format!("standby release: {e}"))),
        Err(_) => fail(StateError::Protocol("internal error (a bug)".into())),
    }
}

/// See mpsr_state.h: marks the end of one step (iteration, decode step) of this process.
#[no_mangle]
pub extern "C" fn mpsr_step() -> c_int {
    guarded(steps::step)
}

/// See mpsr_state.h: this process is idle (no step under way) until its next mpsr_step().
#[no_mangle]
pub extern "C" fn mpsr_step_idle() -> c_int {
    guarded(steps::idle)
}

/// See mpsr_state.h: removes this process's step file (at a clean exit).
#[no_mangle]
pub extern "C" fn mpsr_step_finish() {
    let _ = std::panic::catch_unwind(steps::finish);
}

/// The message of this thread's last error ("" if none). Valid until the next call on the thread.
#[no_mangle]
pub extern "C" fn mpsr_state_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_keeper_errors_are_clear_and_nothing_crashes() {
        std::env::remove_var("MPSR_KEEPER_SOCKET");
        let e = attach("w", 10).unwrap_err();
        assert_eq!(e.code(), MPSR_EUNAVAILABLE);
        assert!(e.to_string().contains("MPSR_KEEPER_SOCKET"));
        assert!(attach("w", 0).is_err());
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid C string and out-pointers.
        let rc = unsafe { mpsr_state_attach(c"w".as_ptr(), 10, &mut p, std::ptr::null_mut()) };
        assert_eq!(rc, MPSR_EUNAVAILABLE);
        // SAFETY: the returned pointer is a valid C string for this thread.
        let msg = unsafe { CStr::from_ptr(mpsr_state_last_error()) }
            .to_string_lossy()
            .into_owned();
        assert!(msg.contains("unavailable"), "{msg}");
        // SAFETY: NULL arguments are refused, not dereferenced.
        let rc = unsafe { mpsr_state_attach(std::ptr::null(), 1, &mut p, std::ptr::null_mut()) };
        assert_eq!(rc, MPSR_EINVAL);
        // SAFETY: as above.
        let rc = unsafe {
            mpsr_state_attach(c"w".as_ptr(), 1, std::ptr::null_mut(), std::ptr::null_mut())
        };
        assert_eq!(rc, MPSR_EINVAL);
    }
}
