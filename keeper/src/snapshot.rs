//! Host snapshots of kept allocations, for faults that lose GPU memory (device lost, uncontained
//! ECC, GPU reset): `<dir>/gpu<N>/job-<id>/<name>.snap` = 24-byte header (magic, size, CRC32) + contents.
//! Written to a temp file, fsynced and renamed, so a crash never leaves a half snapshot; the CRC is
//! checked before a restore writes anything to the GPU.

use crate::memory::{MemError, Memory};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"MPSRSNP2";
/// The first format: bytes 20..24 of the header unused.
const MAGIC_V1: &[u8; 8] = b"MPSRSNP1";
const HEADER: usize = 24;
/// Copy unit between GPU and host.
const CHUNK: usize = 64 << 20;

#[derive(Debug)]
pub enum SnapError {
    Io(std::io::Error),
    Mem(MemError),
    /// Wrong magic, size or checksum: the file is not used.
    Corrupt(String),
    /// Written for another user's allocation: never restored for this one.
    OtherOwner {
        owner: u32,
    },
}

impl std::fmt::Display for SnapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SnapError::Io(e) => write!(f, "snapshot i/o: {e}"),
            SnapError::Mem(e) => write!(f, "snapshot copy: {e}"),
            SnapError::Corrupt(m) => write!(f, "snapshot unusable: {m}"),
            SnapError::OtherOwner { owner } => write!(f, "snapshot belongs to uid {owner}"),
        }
    }
}

impl From<std::io::Error> for SnapError {
    fn from(e: std::io::Error) -> Self {
        SnapError::Io(e)
    }
}

impl From<MemError> for SnapError {
    fn from(e: MemError) -> Self {
        SnapError::Mem(e)
    }
}

pub struct Snapshots {
    dir: PathBuf,
}

impl Snapshots {
    pub fn new(dir: &Path) -> Snapshots {
        Snapshots {
            dir: dir.to_path_buf(),
        }
    }

    fn job_dir(&self, job: u32) -> PathBuf {
        self.dir.join(format!("job-{job}"))
    }

    pub fn path(&self, job: u32, name: &str) -> PathBuf {
        self.job_dir(job).join(format!("{name}.snap"))
    }

    /// Size of a snapshot's contents, if there is a readable header.
    pub fn size(&self, job: u32, name: &str) -> Option<u64> {
        let mut f = std::fs::File::open(self.path(job, name)).ok()?;
        let mut h = [0u8; HEADER];
        f.read_exact(&mut h).ok()?;
        (&h[..8] == MAGIC || &h[..8] == MAGIC_V1)
            .then(|| u64::from_le_bytes(h[8..16].try_into().unwrap_or_default()))
    }

    /// Copies `owner`'s allocation to its snapshot file; returns the file and the bytes written.
    pub fn save(
        &self,
        job: u32,
        name: &str,
        owner: u32,
        mem: &dyn Memory,
    ) -> Result<(PathBuf, u64), SnapError> {
        let dir = self.job_dir(job);
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let path = self.path(job, name);
        let tmp = dir.join(format!(".{name}.snap.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&[0u8; HEADER])?;
        let mut crc = crc32fast::Hasher::new();
        let mut buf = vec![0u8; CHUNK.min(mem.bytes() as usize).max(1)];
        let gpu = mem.access()?;
        let mut off = 0u64;
        while off < mem.bytes() {
            let n = ((mem.bytes() - off) as usize).min(buf.len());
            gpu.read(off, &mut buf[..n])?;
            crc.update(&buf[..n]);
            f.write_all(&buf[..n])?;
            off += n as u64;
        }
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(MAGIC);
        h[8..16].copy_from_slice(&mem.bytes().to_le_bytes());
        h[16..20].copy_from_slice(&crc.finalize().to_le_bytes());
        h[20..24].copy_from_slice(&owner.to_le_bytes());
        std::os::unix::fs::FileExt::write_all_at(&f, &h, 0)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(&dir)?.sync_all()?;
        Ok((path, mem.bytes()))
    }

    /// Restores `uid`'s snapshot into `mem` (same size). The owner and the checksum are verified
    /// before any byte is written to the GPU.
    pub fn restore(
        &self,
        job: u32,
        name: &str,
        uid: u32,
        mem: &dyn Memory,
    ) -> Result<(), SnapError> {
        let path = self.path(job, name);
        let mut f = std::fs::File::open(&path)?;
        let mut h = [0u8; HEADER];
        f.read_exact(&mut h)?;
        if &h[..8] == MAGIC {
            let owner = u32::from_le_bytes(h[20..24].try_into().unwrap_or_default());
            if owner != uid {
                return Err(SnapError::OtherOwner { owner });
            }
        } else if &h[..8] != MAGIC_V1 {
            return Err(SnapError::Corrupt(format!("{}: bad magic", path.display())));
        }
        let size = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let want = u32::from_le_bytes(h[16..20].try_into().unwrap_or_default());
        if size != mem.bytes() {
            return Err(SnapError::Corrupt(format!(
                "{}: holds {size} bytes, allocation has {}",
                path.display(),
                mem.bytes()
            )));
        }
        let mut crc = crc32fast::Hasher::new();
        let mut buf = vec![0u8; CHUNK.min(size as usize).max(1)];
        let mut left = size;
        while left > 0 {
            let n = (left as usize).min(buf.len());
            f.read_exact(&mut buf[..n])?;
            crc.update(&buf[..n]);
            left -= n as u64;
        }
        if crc.finalize() != want {
            return Err(SnapError::Corrupt(format!(
                "{}: checksum mismatch",
                path.display()
            )));
        }
        // Second pass: the file is known good; copy it in.
        let mut f = std::fs::File::open(&path)?;
        f.read_exact(&mut h)?;
        let gpu = mem.access()?;
        let mut off = 0u64;
        while off < size {
            let n = ((size - off) as usize).min(buf.len());
            f.read_exact(&mut buf[..n])?;
            gpu.write(off, &buf[..n])?;
            off += n as u64;
        }
        Ok(())
    }

    pub fn remove(&self, job: u32, name: &str) {
        let _ = std::fs::remove_file(self.path(job, name));
    }

    pub fn remove_job(&self, job: u32) {
        let _ = std::fs::remove_dir_all(self.job_dir(job));
    }

    /// Removes job snapshot dirs not modified for `max_age` (left by jobs that never came back).
    pub fn clean_stale(&self, max_age: std::time::Duration) -> usize {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut n = 0;
        for e in rd.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > max_age);
            if old && e.file_name().to_string_lossy().starts_with("job-") {
                let _ = std::fs::remove_dir_all(e.path());
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Device, HostSimDevice};

    #[test]
    fn save_restore_roundtrip_and_corruption_refused() {
        let d = tempfile::tempdir().unwrap();
        let s = Snapshots::new(d.path());
        let dev = HostSimDevice;
        let m = dev.create(4 << 20).unwrap();
        let data: Vec<u8> = (0..(4 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        m.write(0, &data).unwrap();
        let (p, n) = s.save(3, "weights", 1000, m.as_ref()).unwrap();
        assert_eq!(n, 4 << 20);
        assert_eq!(s.size(3, "weights"), Some(4 << 20));
        let m2 = dev.create(4 << 20).unwrap();
        s.restore(3, "weights", 1000, m2.as_ref()).unwrap();
        let mut back = vec![0u8; 4 << 20];
        m2.read(0, &mut back).unwrap();
        assert!(back == data);
        // Flip one byte: the restore refuses and leaves the target untouched.
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0xFF], 1000).unwrap();
        let m3 = dev.create(4 << 20).unwrap();
        assert!(matches!(
            s.restore(3, "weights", 1000, m3.as_ref()),
            Err(SnapError::Corrupt(_))
        ));
        let mut z = vec![1u8; 16];
        m3.read(0, &mut z).unwrap();
        assert_eq!(z, vec![0u8; 16]);
        // Wrong size refused.
        let small = dev.create(2 << 20).unwrap();
        assert!(s.restore(3, "weights", 1000, small.as_ref()).is_err());
        s.remove_job(3);
        assert_eq!(s.size(3, "weights"), None);
    }

    #[test]
    fn a_snapshot_is_restored_for_its_owner_only() {
        let d = tempfile::tempdir().unwrap();
        let s = Snapshots::new(d.path());
        let dev = HostSimDevice;
        let m = dev.create(2 << 20).unwrap();
        m.write(0, b"alice's").unwrap();
        s.save(7, "kv", 1000, m.as_ref()).unwrap();
        let other = dev.create(2 << 20).unwrap();
        assert!(matches!(
            s.restore(7, "kv", 1001, other.as_ref()),
            Err(SnapError::OtherOwner { owner: 1000 })
        ));
        let mut b = [1u8; 7];
        other.read(0, &mut b).unwrap();
        assert_eq!(b, [0u8; 7], "nothing copied for another uid");
        s.restore(7, "kv", 1000, other.as_ref()).unwrap();
        other.read(0, &mut b).unwrap();
        assert_eq!(&b, b"alice's");
    }
}
