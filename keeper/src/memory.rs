//! Where kept allocations live: real GPU memory (CUDA, exported as POSIX fds) or, for CI and the
//! demo, SIMULATED GPU memory (memfds the client mmaps). The rest of the keeper sees only this.

use mpsr_proto::keeper::MemKind;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error(transparent)]
    Cuda(#[from] mpsr_cuda::CudaError),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl MemError {
    /// A sticky CUDA error: the primary context is unusable for as long as anyone retains it.
    pub fn context_lost(&self) -> bool {
        matches!(self, MemError::Cuda(e) if e.context_lost())
    }
}

/// One allocation.
pub trait Memory: Send {
    fn bytes(&self) -> u64;
    /// A new fd the client can import/map.
    fn export_fd(&self) -> Result<OwnedFd, MemError>;
    /// Reads and writes for as long as the answer lives. On a GPU it holds a CUDA context and a
    /// mapping, which cost time to set up: open it once for a run of copies (a snapshot).
    fn access(&self) -> Result<Box<dyn Access + '_>, MemError>;
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.access()?.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<(), MemError> {
        self.access()?.write(offset, buf)
    }
}

/// Copies in and out of one allocation.
pub trait Access {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError>;
    fn write(&self, offset: u64, buf: &[u8]) -> Result<(), MemError>;
}

pub trait Device: Send + Sync {
    fn kind(&self) -> MemKind;
    /// Allocation size for a request (the device's granularity).
    fn round_up(&self, bytes: u64) -> Result<u64, MemError>;
    /// New zeroed memory of exactly `bytes` (already rounded).
    fn create(&self, bytes: u64) -> Result<Box<dyn Memory>, MemError>;
}

/// The GPU this keeper was started for (device 0 of its CUDA_VISIBLE_DEVICES). The keeper holds
/// no CUDA context between requests: one is retained only while memory is created, read or written
/// (each context on the GPU delays the driver's report of an SM exception by ~10 ms, which a hot
/// standby waits for). Handing out an allocation's fd needs none.
pub struct CudaDevice {
    granularity: u64,
}

impl CudaDevice {
    pub fn open() -> Result<CudaDevice, MemError> {
        let _ctx = mpsr_cuda::PrimaryContext::retain(0)?;
        // Read once: retaining a context for each rounding would cost ~150 ms per attach.
        let granularity = mpsr_cuda::granularity(0)?;
        Ok(CudaDevice { granularity })
    }
}

struct CudaMemory(mpsr_cuda::Allocation);

/// A mapping of a kept allocation with the primary context current; fields drop in order, so the
/// memory is unmapped while the context still is current.
struct CudaAccess {
    m: mpsr_cuda::Mapping,
    _ctx: mpsr_cuda::PrimaryContext,
}

impl Memory for CudaMemory {
    fn bytes(&self) -> u64 {
        self.0.bytes()
    }
    fn export_fd(&self) -> Result<OwnedFd, MemError> {
        Ok(self.0.export_fd()?)
    }
    fn access(&self) -> Result<Box<dyn Access + '_>, MemError> {
        let _ctx = mpsr_cuda::PrimaryContext::retain(0)?;
        let m = self.0.map()?;
        Ok(Box::new(CudaAccess { m, _ctx }))
    }
}

impl Access for CudaAccess {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        Ok(self.m.read(offset, buf)?)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<(), MemError> {
        Ok(self.m.write(offset, buf)?)
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> MemKind {
        MemKind::Cuda
    }
    fn round_up(&self, bytes: u64) -> Result<u64, MemError> {
        Ok(bytes.div_ceil(self.granularity) * self.granularity)
    }
    fn create(&self, bytes: u64) -> Result<Box<dyn Memory>, MemError> {
        let _ctx = mpsr_cuda::PrimaryContext::retain(0)?;
        let a = mpsr_cuda::Allocation::create(0, bytes)?;
        // New memory is zeroed: a job never sees what an earlier user left on the GPU.
        a.map()?.zero()?;
        Ok(Box::new(CudaMemory(a)))
    }
}

/// SIMULATED GPU memory: a sealed-size memfd per allocation.
pub struct HostSimDevice;

struct HostSimMemory {
    fd: OwnedFd,
    bytes: u64,
}

/// Simulated allocations are rounded like an H200's (2 MiB granularity).
const SIM_GRANULARITY: u64 = 2 << 20;

impl Device for HostSimDevice {
    fn kind(&self) -> MemKind {
        MemKind::HostSim
    }
    fn round_up(&self, bytes: u64) -> Result<u64, MemError> {
        Ok(bytes.div_ceil(SIM_GRANULARITY) * SIM_GRANULARITY)
    }
    fn create(&self, bytes: u64) -> Result<Box<dyn Memory>, MemError> {
        // SAFETY: memfd_create with a constant name; the returned fd is owned below.
        let fd =
            unsafe { libc::memfd_create(c"mpsr-simulated-gpu-memory".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own memfd; new pages read as zero.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        Ok(Box::new(HostSimMemory { fd, bytes }))
    }
}

impl Memory for HostSimMemory {
    fn bytes(&self) -> u64 {
        self.bytes
    }
    fn export_fd(&self) -> Result<OwnedFd, MemError> {
        Ok(self.fd.try_clone()?)
    }
    fn access(&self) -> Result<Box<dyn Access + '_>, MemError> {
        Ok(Box::new(HostSimAccess(std::fs::File::from(
            self.fd.try_clone()?,
        ))))
    }
}

struct HostSimAccess(std::fs::File);

impl Access for HostSimAccess {
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, offset)?;
        Ok(())
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<(), MemError> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, buf, offset)?;
        Ok(())
    }
}
