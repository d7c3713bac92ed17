//! The keeper's allocations: per job and name, with a per-job byte quota and, once the job has
//! ended, a time after which they are freed.

use crate::memory::{Device, MemError, Memory};
use crate::snapshot::Snapshots;
use mpsr_proto::keeper::{KeptAlloc, Origin};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub struct Alloc {
    pub uid: u32,
    pub mem: Box<dyn Memory>,
    /// Set once the job ended: freed then.
    pub release_at: Option<Instant>,
}

#[derive(Debug)]
pub enum StoreError {
    Quota {
        job: u32,
        want: u64,
        used: u64,
        limit: u64,
    },
    SizeMismatch {
        name: String,
        have: u64,
        want: u64,
    },
    NotFound(String),
    /// The allocation exists, created by another uid: never handed out, freed or copied for this one.
    OtherOwner {
        name: String,
        owner: u32,
    },
    Mem(MemError),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Quota {
                job,
                want,
                used,
                limit,
            } => write!(
                f,
                "job {job}: {want} more bytes would exceed its quota ({used} of {limit} bytes used)"
            ),
            StoreError::SizeMismatch { name, have, want } => write!(
                f,
                "'{name}' exists with {have} bytes; {want} asked (detach and release it to resize)"
            ),
            StoreError::NotFound(n) => write!(f, "no allocation '{n}' for this job"),
            StoreError::OtherOwner { name, owner } => write!(
                f,
                "allocation '{name}' of this job id belongs to uid {owner}, not to the caller"
            ),
            StoreError::Mem(e) => write!(f, "GPU memory: {e}"),
        }
    }
}

impl From<MemError> for StoreError {
    fn from(e: MemError) -> Self {
        StoreError::Mem(e)
    }
}

pub struct Store {
    allocs: BTreeMap<(u32, String), Alloc>,
    quota: u64,
}

impl Store {
    pub fn new(quota: u64) -> Store {
        Store {
            allocs: BTreeMap::new(),
            quota,
        }
    }

    pub fn job_bytes(&self, job: u32) -> u64 {
        self.allocs
            .iter()
            .filter(|((j, _), _)| *j == job)
            .map(|(_, a)| a.mem.bytes())
            .sum()
    }

    /// The job's allocation `name`: kept, restored from a snapshot, or new.
    pub fn attach(
        &mut self,
        dev: &dyn Device,
        snaps: &Snapshots,
        job: u32,
        uid: u32,
        name: &str,
        bytes: u64,
    ) -> Result<(&Alloc, Origin), StoreError> {
        let key = (job, name.to_string());
        let want = dev.round_up(bytes.max(1))?;
        if let Some(a) = self.allocs.get(&key) {
            if a.uid != uid {
                return Err(StoreError::OtherOwner {
                    name: name.into(),
                    owner: a.uid,
                });
            }
            if want > a.mem.bytes() {
                return Err(StoreError::SizeMismatch {
                    name: name.into(),
                    have: a.mem.bytes(),
                    want: bytes,
                });
            }
            let a = self.allocs.get_mut(&key).expect("present");
            a.release_at = None; // the job is back (requeued, or a resumed task)
            return Ok((a, Origin::Kept));
        }
        let used = self.job_bytes(job);
        if used + want > self.quota {
            return Err(StoreError::Quota {
                job,
                want,
                used,
                limit: self.quota,
            });
        }
        let mem = dev.create(want)?;
        let origin = match snaps.size(job, name) {
            Some(n) if n == want => match snaps.restore(job, name, uid, mem.as_ref()) {
                Ok(()) => Origin::Snapshot,
                Err(e) => {
                    eprintln!("mpsr-keeper: job {job} '{name}': {e}; starting from zeroed memory");
                    Origin::New
                }
            },
            _ => Origin::New,
        };
        self.allocs.insert(
            key.clone(),
            Alloc {
                uid,
                mem,
                release_at: None,
            },
        );
        Ok((&self.allocs[&key], origin))
    }

    pub fn get(&self, job: u32, name: &str) -> Option<&Alloc> {
        self.allocs.get(&(job, name.to_string()))
    }

    /// The job's allocation `name` when `uid` created it.
    pub fn get_owned(&self, job: u32, name: &str, uid: u32) -> Result<&Alloc, StoreError> {
        match self.get(job, name) {
            None => Err(StoreError::NotFound(name.into())),
            Some(a) if a.uid != uid => Err(StoreError::OtherOwner {
                name: name.into(),
                owner: a.uid,
            }),
            Some(a) => Ok(a),
        }
    }

    pub fn names(&self, job: u32) -> Vec<String> {
        self.allocs
            .keys()
            .filter(|(j, _)| *j == job)
            .map(|(_, n)| n.clone())
            .collect()
    }

    pub fn release(&mut self, job: u32, name: &str, uid: u32) -> Result<(), StoreError> {
        self.get_owned(job, name, uid)?;
        self.allocs
            .remove(&(job, name.to_string()))
            .map(|_| ())
            .ok_or_else(|| StoreError::NotFound(name.into()))
    }

    /// The job ended: free its allocations after `keep_for` (now if zero).
    pub fn job_end(&mut self, job: u32, keep_for: Duration) -> usize {
        if keep_for.is_zero() {
            let before = self.allocs.len();
            self.allocs.retain(|(j, _), _| *j != job);
            return before - self.allocs.len();
        }
        let at = Instant::now() + keep_for;
        let mut n = 0;
        for ((j, _), a) in self.allocs.iter_mut() {
            if *j == job {
                a.release_at = Some(at);
                n += 1;
            }
        }
        n
    }

    /// Frees what is due; returns the (job, name) freed.
    pub fn sweep(&mut self, now: Instant) -> Vec<(u32, String)> {
        let due: Vec<(u32, String)> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.release_at.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &due {
            self.allocs.remove(k);
        }
        due
    }

    pub fn list(&self) -> Vec<KeptAlloc> {
        let now = Instant::now();
        self.allocs
            .iter()
            .map(|((job, name), a)| KeptAlloc {
                job_id: *job,
                name: name.clone(),
                bytes: a.mem.bytes(),
                uid: a.uid,
                release_in_s: a
                    .release_at
                    .map(|t| t.saturating_duration_since(now).as_secs()),
            })
            .collect()
    }

    pub fn total_bytes(&self) -> u64 {
        self.allocs.values().map(|a| a.mem.bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostSimDevice;

    #[test]
    fn kept_quota_ttl_and_snapshot_restore() {
        let d = tempfile::tempdir().unwrap();
        let snaps = Snapshots::new(d.path());
        let dev = HostSimDevice;
        let mut s = Store::new(8 << 20);
        let (a, o) = s.attach(&dev, &snaps, 1, 1000, "w", 3 << 20).unwrap();
        assert_eq!((a.mem.bytes(), o), (4 << 20, Origin::New));
        a.mem.write(0, b"hello").unwrap();
        // Same name again: the same memory, kept.
        let (a, o) = s.attach(&dev, &snaps, 1, 1000, "w", 1).unwrap();
        assert_eq!(o, Origin::Kept);
        let mut b = [0u8; 5];
        a.mem.read(0, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        // Larger than what exists: refused, not silently shrunk.
        assert!(matches!(
            s.attach(&dev, &snaps, 1, 1000, "w", 5 << 20),
            Err(StoreError::SizeMismatch { .. })
        ));
        // Quota is per job.
        assert!(matches!(
            s.attach(&dev, &snaps, 1, 1000, "x", 6 << 20),
            Err(StoreError::Quota { .. })
        ));
        s.attach(&dev, &snaps, 2, 1001, "x", 6 << 20).unwrap();
        // Another uid under the same job id (a squatter) gets none of it: not the memory, not
        // its release.
        assert!(matches!(
            s.attach(&dev, &snaps, 2, 1000, "x", 1),
            Err(StoreError::OtherOwner { owner: 1001, .. })
        ));
        assert!(matches!(
            s.release(2, "x", 1000),
            Err(StoreError::OtherOwner { .. })
        ));
        assert!(s.get_owned(2, "x", 1001).is_ok());
        // Job 1 ends with a keep time: still there, freed when due; attaching again cancels it.
        assert_eq!(s.job_end(1, Duration::from_secs(60)), 1);
        assert!(s.sweep(Instant::now()).is_empty());
        s.attach(&dev, &snaps, 1, 1000, "w", 1).unwrap();
        assert!(s.list().iter().all(|k| k.release_in_s.is_none()));
        s.job_end(1, Duration::from_secs(60));
        let freed = s.sweep(Instant::now() + Duration::from_secs(61));
        assert_eq!(freed, vec![(1, "w".to_string())]);
        // Job 2 ends without a keep time: freed now.
        assert_eq!(s.job_end(2, Duration::ZERO), 1);
        assert_eq!(s.total_bytes(), 0);

        // A snapshot taken before the memory was lost comes back on the next attach.
        let (a, _) = s.attach(&dev, &snaps, 3, 1000, "kv", 2 << 20).unwrap();
        a.mem.write(100, b"state").unwrap();
        snaps.save(3, "kv", 1000, a.mem.as_ref()).unwrap();
        s.release(3, "kv", 1000).unwrap();
        let (a, o) = s.attach(&dev, &snaps, 3, 1000, "kv", 2 << 20).unwrap();
        assert_eq!(o, Origin::Snapshot);
        let mut b = [0u8; 5];
        a.mem.read(100, &mut b).unwrap();
        assert_eq!(&b, b"state");
    }
}
