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
    /// After this error the keeper's CUDA context is unusable (a sticky error).
    pub fn context_lost(&self) -> bool {
        matches!(self, MemError::Cuda(e) if e.context_lost())
    }
}

/// One allocation.
pub trait Memory: Send {
    fn bytes(&self) -> u64;
    /// A new fd the client can import/map.
    fn export_fd(&self) -> Result<OwnedFd, MemError>;
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

/// The GPU this keeper was started for (device 0 of its CUDA_VISIBLE_DEVICES).
pub struct CudaDevice {
    ctx: mpsr_cuda::Context,
}

impl CudaDevice {
    pub fn open() -> Result<CudaDevice, MemError> {
        let ctx = mpsr_cuda::ensure_context(0)?;
        Ok(CudaDevice { ctx })
    }

    /// Each keeper thread works in the same (primary) context.
    fn bind(&self) -> Result<(), MemError> {
        mpsr_cuda::make_current(self.ctx)?;
        Ok(())
    }
}

struct CudaMemory {
    m: mpsr_cuda::Mapping,
    ctx: mpsr_cuda::Context,
}

impl CudaMemory {
    fn bind(&self) -> Result<(), MemError> {
        mpsr_cuda::make_current(self.ctx)?;
        Ok(())
    }
}

impl Memory for CudaMemory {
    fn bytes(&self) -> u64 {
        self.m.bytes
    }
    fn export_fd(&self) -> Result<OwnedFd, MemError> {
        self.bind()?;
        Ok(self.m.export_fd()?)
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.bind()?;
        Ok(self.m.read(offset, buf)?)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<(), MemError> {
        self.bind()?;
        Ok(self.m.write(offset, buf)?)
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> MemKind {
        MemKind::Cuda
    }
    fn round_up(&self, bytes: u64) -> Result<u64, MemError> {
        self.bind()?;
        Ok(mpsr_cuda::round_up(0, bytes)?)
    }
    fn create(&self, bytes: u64) -> Result<Box<dyn Memory>, MemError> {
        self.bind()?;
        let m = mpsr_cuda::Mapping::create(0, bytes)?;
        // New memory is zeroed: a job never sees what an earlier user left on the GPU.
        m.zero()?;
        Ok(Box::new(CudaMemory { m, ctx: self.ctx }))
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
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let f = std::fs::File::from(self.fd.try_clone()?);
        std::os::unix::fs::FileExt::read_exact_at(&f, buf, offset)?;
        Ok(())
    }
    fn write(&self, offset: u64, buf: &[u8]) -> Result<(), MemError> {
        let f = std::fs::File::from(self.fd.try_clone()?);
        std::os::unix::fs::FileExt::write_all_at(&f, buf, offset)?;
        Ok(())
    }
}
