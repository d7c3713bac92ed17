//! The CUDA driver API calls the state keeper and its client library need, loaded at run time with
//! `dlopen("libcuda.so.1")`: no link-time dependency, so everything builds and its tests run on
//! machines without a GPU, and a missing driver is a clean error, not a loader failure.
//!
//! Memory is shared the way KNOWLEDGE.md measured on an H200: the owner (the keeper, outside MPS)
//! `cuMemCreate`s with a POSIX-fd handle type and exports it; an MPS client imports the fd, reserves
//! an address range, maps and enables access. The memory lives as long as the owner holds it, so it
//! survives the client's death.
//!
//! The owner needs a CUDA context only while it creates, reads or writes memory ([`PrimaryContext`]
//! is retained for that and released after): an allocation handle and its exported fd outlive the
//! context. That matters because every context on the GPU delays the driver's report of an SM
//! exception by ~10 ms (measured on H100/H200, tests/gpu/report_time_probe.py).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

pub type CuResult = c_int;
pub type CuDevice = c_int;
pub type CuContext = *mut c_void;
pub type CuDevicePtr = u64;
pub type CuMemHandle = u64;

const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 1;
const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 1;
const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;
const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 3;
const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_uint = 0;

#[repr(C)]
#[derive(Clone, Copy)]
struct MemLocation {
    kind: c_uint,
    id: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AllocFlags {
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAllocationProp` (cuda.h, CUDA >= 10.2; 32 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct AllocationProp {
    kind: c_uint,
    requested_handle_types: c_uint,
    location: MemLocation,
    win32_handle_meta_data: *mut c_void,
    alloc_flags: AllocFlags,
}

#[repr(C)]
struct AccessDesc {
    location: MemLocation,
    flags: c_uint,
}

// Compile-time layout checks against cuda.h.
const _: () = assert!(std::mem::size_of::<AllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<AccessDesc>() == 12);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// libcuda.so.1 missing or lacking a symbol.
    NoDriver(String),
    /// A driver call failed: (call, CUresult, its name).
    Call(&'static str, c_int, String),
}

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaError::NoDriver(m) => write!(f, "CUDA driver not available: {m}"),
            CudaError::Call(c, code, name) => write!(f, "{c} failed: CUDA error {code} ({name})"),
        }
    }
}

impl std::error::Error for CudaError {}

impl CudaError {
    /// CUresult codes after which the context is unusable ("sticky" errors: every later call in
    /// the process fails the same way): illegal address, ECC uncorrectable, launch failure,
    /// hardware stack error, illegal instruction, misaligned address, invalid address space,
    /// invalid PC, device unavailable, unknown.
    const CONTEXT_LOST: [c_int; 10] = [700, 214, 719, 714, 715, 716, 717, 718, 46, 999];

    pub fn context_lost(&self) -> bool {
        matches!(self, CudaError::Call(_, code, _) if Self::CONTEXT_LOST.contains(code))
    }
}

macro_rules! api {
    ($($field:ident: $sym:literal => fn($($arg:ty),*);)*) => {
        /// Function pointers resolved from libcuda.so.1.
        #[allow(non_snake_case)]
        struct Api {
            $($field: unsafe extern "C" fn($($arg),*) -> CuResult,)*
            get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
        }

        fn load() -> Result<Api, CudaError> {
            // SAFETY: dlopen with a constant, NUL-terminated name; the handle is never closed, so
            // the resolved pointers stay valid for the life of the process.
            let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if h.is_null() {
                return Err(CudaError::NoDriver("cannot dlopen libcuda.so.1".into()));
            }
            let sym = |name: &CStr| -> Result<*mut c_void, CudaError> {
                // SAFETY: h is a live handle; name is NUL-terminated.
                let p = unsafe { libc::dlsym(h, name.as_ptr()) };
                if p.is_null() {
                    Err(CudaError::NoDriver(format!("libcuda.so.1 lacks {}", name.to_string_lossy())))
                } else {
                    Ok(p)
                }
            };
            Ok(Api {
                // SAFETY: each symbol is the driver entry point with the C signature declared
                // here (cuda.h), so transmuting the data pointer to it is sound.
                $($field: unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CuResult>(sym($sym)?) },)*
                // SAFETY: as above; cuGetErrorName(CUresult, const char **).
                get_error_name: unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult>(sym(c"cuGetErrorName")?) },
            })
        }
    };
}

api! {
    init: c"cuInit" => fn(c_uint);
    device_get: c"cuDeviceGet" => fn(*mut CuDevice, c_int);
    primary_ctx_retain: c"cuDevicePrimaryCtxRetain" => fn(*mut CuContext, CuDevice);
    primary_ctx_release: c"cuDevicePrimaryCtxRelease_v2" => fn(CuDevice);
    ctx_get_current: c"cuCtxGetCurrent" => fn(*mut CuContext);
    ctx_set_current: c"cuCtxSetCurrent" => fn(CuContext);
    ctx_synchronize: c"cuCtxSynchronize" => fn();
    granularity: c"cuMemGetAllocationGranularity" => fn(*mut usize, *const AllocationProp, c_uint);
    mem_create: c"cuMemCreate" => fn(*mut CuMemHandle, usize, *const AllocationProp, u64);
    mem_release: c"cuMemRelease" => fn(CuMemHandle);
    export: c"cuMemExportToShareableHandle" => fn(*mut c_void, CuMemHandle, c_uint, u64);
    import: c"cuMemImportFromShareableHandle" => fn(*mut CuMemHandle, *mut c_void, c_uint);
    address_reserve: c"cuMemAddressReserve" => fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, u64);
    address_free: c"cuMemAddressFree" => fn(CuDevicePtr, usize);
    map: c"cuMemMap" => fn(CuDevicePtr, usize, usize, CuMemHandle, u64);
    unmap: c"cuMemUnmap" => fn(CuDevicePtr, usize);
    set_access: c"cuMemSetAccess" => fn(CuDevicePtr, usize, *const AccessDesc, usize);
    memcpy_dtoh: c"cuMemcpyDtoH_v2" => fn(*mut c_void, CuDevicePtr, usize);
    memcpy_htod: c"cuMemcpyHtoD_v2" => fn(CuDevicePtr, *const c_void, usize);
    memset_d8: c"cuMemsetD8_v2" => fn(CuDevicePtr, u8, usize);
}

static API: OnceLock<Result<Api, CudaError>> = OnceLock::new();

fn api() -> Result<&'static Api, CudaError> {
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn check(call: &'static str, rc: CuResult) -> Result<(), CudaError> {
    if rc == 0 {
        return Ok(());
    }
    let mut name: *const c_char = std::ptr::null();
    let text = match api() {
        // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it NULL.
        Ok(a) if unsafe { (a.get_error_name)(rc, &mut name) } == 0 && !name.is_null() => {
            // SAFETY: non-NULL, static, NUL-terminated string from the driver.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        }
        _ => "unknown".into(),
    };
    Err(CudaError::Call(call, rc, text))
}

/// Makes device `ordinal`'s primary context current on this thread, unless a context already is
/// (an application that used the runtime API has one).
pub fn ensure_context(ordinal: c_int) -> Result<(), CudaError> {
    let a = api()?;
    let mut cur: CuContext = std::ptr::null_mut();
    // SAFETY: plain driver calls with a valid out-pointer.
    unsafe {
        check("cuInit", (a.init)(0))?;
        check("cuCtxGetCurrent", (a.ctx_get_current)(&mut cur))?;
    }
    if cur.is_null() {
        // Retained and current for the rest of the process: the application computes in it.
        std::mem::forget(PrimaryContext::retain(ordinal)?);
    }
    Ok(())
}

/// Device `ordinal`'s primary context, retained and current on this thread for as long as this
/// value lives. Dropping it makes the thread's previous context current again and releases the
/// retain: when no one else holds the primary context, the driver destroys it, so a process that
/// holds memory but no `PrimaryContext` has no context on the GPU.
pub struct PrimaryContext {
    dev: CuDevice,
    prev: CuContext,
}

impl PrimaryContext {
    pub fn retain(ordinal: c_int) -> Result<PrimaryContext, CudaError> {
        let a = api()?;
        // SAFETY: plain driver calls with valid out-pointers; a failed step undoes the retain.
        unsafe {
            check("cuInit", (a.init)(0))?;
            let mut dev: CuDevice = 0;
            check("cuDeviceGet", (a.device_get)(&mut dev, ordinal))?;
            let mut prev: CuContext = std::ptr::null_mut();
            check("cuCtxGetCurrent", (a.ctx_get_current)(&mut prev))?;
            let mut ctx: CuContext = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                (a.primary_ctx_retain)(&mut ctx, dev),
            )?;
            if let Err(e) = check("cuCtxSetCurrent", (a.ctx_set_current)(ctx)) {
                (a.primary_ctx_release)(dev);
                return Err(e);
            }
            Ok(PrimaryContext { dev, prev })
        }
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: prev was current on this thread before the retain (or NULL); dev was
            // retained once by this value and is released once.
            unsafe {
                (a.ctx_set_current)(self.prev);
                (a.primary_ctx_release)(self.dev);
            }
        }
    }
}

fn prop(device: c_int) -> AllocationProp {
    AllocationProp {
        kind: CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: MemLocation {
            kind: CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: AllocFlags {
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The device's allocation granularity in bytes (sizes are rounded up to a multiple of it). Call
/// it with a context current; the answer does not change, so callers read it once.
pub fn granularity(device: c_int) -> Result<u64, CudaError> {
    let a = api()?;
    let p = prop(device);
    let mut g: usize = 0;
    // SAFETY: p is a valid property struct; g a valid out-pointer.
    check("cuMemGetAllocationGranularity", unsafe {
        (a.granularity)(&mut g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    })?;
    Ok(g.max(1) as u64)
}

/// Exports `handle` as a new POSIX fd (to pass to a client over SCM_RIGHTS).
fn export(handle: CuMemHandle) -> Result<OwnedFd, CudaError> {
    let a = api()?;
    let mut fd: c_int = -1;
    // SAFETY: for POSIX fds the out-parameter is an int.
    check("cuMemExportToShareableHandle", unsafe {
        (a.export)(
            &mut fd as *mut c_int as *mut c_void,
            handle,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    // SAFETY: the driver returned a new fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Physical device memory this process owns, with its exported fd; no address range, so holding it
/// needs no context. Map it (with a context current) to read or write it.
pub struct Allocation {
    handle: CuMemHandle,
    bytes: u64,
    device: c_int,
    fd: OwnedFd,
}

// SAFETY: the handle is a plain integer owned by this value; the driver calls made through it are
// thread-safe.
unsafe impl Send for Allocation {}
// SAFETY: as above; &self methods only map the handle or duplicate the fd.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// Creates `bytes` (a multiple of [`granularity`]) of device memory exportable as a POSIX fd.
    /// Needs a context current ([`PrimaryContext`]).
    pub fn create(device: c_int, bytes: u64) -> Result<Allocation, CudaError> {
        let a = api()?;
        let p = prop(device);
        let mut handle: CuMemHandle = 0;
        // SAFETY: valid property struct and out-pointer.
        check("cuMemCreate", unsafe {
            (a.mem_create)(&mut handle, bytes as usize, &p, 0)
        })?;
        match export(handle) {
            Ok(fd) => Ok(Allocation {
                handle,
                bytes,
                device,
                fd,
            }),
            Err(e) => {
                // SAFETY: handle was created above and is not mapped.
                unsafe { (a.mem_release)(handle) };
                Err(e)
            }
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// A new fd for this memory (a duplicate of the one exported at creation: no driver call, no
    /// context).
    pub fn export_fd(&self) -> std::io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Maps the memory into this process; the mapping does not own the memory. Needs a context
    /// current, and the mapping must be dropped while it still is.
    pub fn map(&self) -> Result<Mapping, CudaError> {
        Mapping::map_handle(self.handle, self.bytes, self.device, false)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // cuMemRelease wants a context; when none can be had (the driver is gone) the memory goes
        // with the process anyway.
        let _ctx = PrimaryContext::retain(self.device);
        if let Ok(a) = api() {
            // SAFETY: handle came from cuMemCreate, is not mapped by this value, released once.
            unsafe { (a.mem_release)(self.handle) };
        }
    }
}

/// This process's mapping of device memory: imported (it owns the handle) or of an
/// [`Allocation`] (it does not).
pub struct Mapping {
    pub handle: CuMemHandle,
    pub ptr: CuDevicePtr,
    pub bytes: u64,
    device: c_int,
    owns_handle: bool,
}

// SAFETY: the handle and address are plain integers owned by this value; the driver calls made
// through them are thread-safe.
unsafe impl Send for Mapping {}

impl Mapping {
    fn map_handle(
        handle: CuMemHandle,
        bytes: u64,
        device: c_int,
        owns_handle: bool,
    ) -> Result<Mapping, CudaError> {
        let a = api()?;
        let size = bytes as usize;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: driver calls with valid out-pointers; on failure what was done is undone.
        unsafe {
            check(
                "cuMemAddressReserve",
                (a.address_reserve)(&mut ptr, size, 0, 0, 0),
            )?;
            if let Err(e) = check("cuMemMap", (a.map)(ptr, size, 0, handle, 0)) {
                (a.address_free)(ptr, size);
                return Err(e);
            }
            let desc = AccessDesc {
                location: MemLocation {
                    kind: CU_MEM_LOCATION_TYPE_DEVICE,
                    id: device,
                },
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            if let Err(e) = check("cuMemSetAccess", (a.set_access)(ptr, size, &desc, 1)) {
                (a.unmap)(ptr, size);
                (a.address_free)(ptr, size);
                return Err(e);
            }
        }
        Ok(Mapping {
            handle,
            ptr,
            bytes,
            device,
            owns_handle,
        })
    }

    /// Maps memory another process exported. The caller still owns (and closes) the fd.
    pub fn import(device: c_int, fd: &OwnedFd, bytes: u64) -> Result<Mapping, CudaError> {
        use std::os::fd::AsRawFd;
        let a = api()?;
        let mut h: CuMemHandle = 0;
        // SAFETY: for POSIX fds the driver takes the fd value itself as the "handle" pointer.
        check("cuMemImportFromShareableHandle", unsafe {
            (a.import)(
                &mut h,
                fd.as_raw_fd() as isize as *mut c_void,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Mapping::map_handle(h, bytes, device, true).inspect_err(|_| {
            // SAFETY: h was imported above and is not mapped.
            unsafe { (a.mem_release)(h) };
        })
    }

    pub fn zero(&self) -> Result<(), CudaError> {
        let a = api()?;
        // SAFETY: ptr..ptr+bytes is mapped read-write in this context.
        check("cuMemsetD8", unsafe {
            (a.memset_d8)(self.ptr, 0, self.bytes as usize)
        })?;
        // SAFETY: plain synchronization call.
        check("cuCtxSynchronize", unsafe { (a.ctx_synchronize)() })
    }

    /// Copies `buf.len()` bytes at `offset` to the host.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), CudaError> {
        assert!(
            offset + buf.len() as u64 <= self.bytes,
            "read past the mapping"
        );
        let a = api()?;
        // SAFETY: the source range is inside the mapping (asserted); buf is writable for its length.
        check("cuMemcpyDtoH", unsafe {
            (a.memcpy_dtoh)(
                buf.as_mut_ptr() as *mut c_void,
                self.ptr + offset,
                buf.len(),
            )
        })
    }

    /// Copies `buf` to `offset`.
    pub fn write(&self, offset: u64, buf: &[u8]) -> Result<(), CudaError> {
        assert!(
            offset + buf.len() as u64 <= self.bytes,
            "write past the mapping"
        );
        let a = api()?;
        // SAFETY: the destination range is inside the mapping (asserted); buf is readable.
        check("cuMemcpyHtoD", unsafe {
            (a.memcpy_htod)(self.ptr + offset, buf.as_ptr() as *const c_void, buf.len())
        })
    }

    pub fn device(&self) -> c_int {
        self.device
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: ptr/handle came from a successful map of `bytes`; each is released once,
            // the handle only by the mapping that owns it.
            unsafe {
                (a.unmap)(self.ptr, self.bytes as usize);
                (a.address_free)(self.ptr, self.bytes as usize);
                if self.owns_handle {
                    (a.mem_release)(self.handle);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpsr_test_support::skip;

    #[test]
    fn sticky_errors_are_told_apart_by_code_not_text() {
        assert!(
            CudaError::Call("cuMemcpy", 700, "CUDA_ERROR_ILLEGAL_ADDRESS".into()).context_lost()
        );
        // The code decides, whatever the name says.
        assert!(!CudaError::Call("cuMemAlloc", 2, "ILLEGAL_ADDRESS?".into()).context_lost());
        assert!(!CudaError::NoDriver("no libcuda".into()).context_lost());
    }

    #[test]
    fn without_a_driver_every_call_is_a_clean_error() {
        if std::path::Path::new("/dev/nvidiactl").exists() {
            skip("a GPU driver is present; this test is for GPU-less machines");
            return;
        }
        let e = Allocation::create(0, 1 << 21)
            .err()
            .expect("no driver here");
        assert!(matches!(e, CudaError::NoDriver(_)), "{e}");
        assert!(ensure_context(0).is_err());
        assert!(PrimaryContext::retain(0).is_err());
        assert!(granularity(0).is_err());
    }
}
