//! The step-time record an application writes (`mpsr_step()` in the state library, once per
//! training iteration or decode step) and the agent's telemetry reads: one small file per process,
//! `<dir>/mpsr-steps.<pid>` (dir `/dev/shm` unless `MPSR_STEP_DIR` says otherwise), written
//! through a shared mapping by its one writer, read by the agent with a sequence lock.
//!
//! Layout, little-endian: magic (8 bytes), seq (u64: odd while the writer is in the middle of a
//! step), count (u64: steps completed), last_ns (u64: CLOCK_MONOTONIC of the last mark; 0 while
//! the process says it is idle, `mpsr_step_idle()`), then a
//! ring of [`RING`] step durations in microseconds (u32, saturating): step `k` (1-based) is at
//! `(k - 1) % RING`.

use std::path::{Path, PathBuf};

pub const MAGIC: [u8; 8] = *b"MPSRSTP1";
pub const RING: usize = 256;
pub const OFF_SEQ: usize = 8;
pub const OFF_COUNT: usize = 16;
pub const OFF_LAST: usize = 24;
pub const OFF_RING: usize = 32;
pub const SIZE: usize = OFF_RING + RING * 4;
/// Where the files are unless `MPSR_STEP_DIR` (library) or `telemetry.step_dir` (agent) say.
pub const DEFAULT_DIR: &str = "/dev/shm";

pub fn path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("mpsr-steps.{pid}"))
}

/// One consistent reading of a record.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    pub count: u64,
    pub last_ns: u64,
    ring: Vec<u32>,
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

impl StepRecord {
    /// Parses a record read while its writer was not in a step (`seq` even); `None` for anything
    /// else (wrong magic, short, torn): the reader tries again next round.
    pub fn parse(b: &[u8]) -> Option<StepRecord> {
        if b.len() < SIZE || b[..8] != MAGIC || u64_at(b, OFF_SEQ) % 2 == 1 {
            return None;
        }
        let ring = b[OFF_RING..SIZE]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some(StepRecord {
            count: u64_at(b, OFF_COUNT),
            last_ns: u64_at(b, OFF_LAST),
            ring,
        })
    }

    pub fn seq(b: &[u8]) -> Option<u64> {
        (b.len() >= OFF_SEQ + 8).then(|| u64_at(b, OFF_SEQ))
    }

    /// Durations in seconds of the steps completed after step `after` (at most the ring's worth).
    pub fn since(&self, after: u64) -> Vec<f64> {
        let from = after.max(self.count.saturating_sub(RING as u64));
        (from..self.count)
            .map(|k| self.ring[(k % RING as u64) as usize] as f64 / 1e6)
            .collect()
    }
}

/// A record as bytes (tests, and what a file holds): `count` steps completed, the last mark at
/// `last_ns`, the last `steps_us.len()` of them taking those microseconds.
pub fn encode(count: u64, last_ns: u64, steps_us: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; SIZE];
    b[..8].copy_from_slice(&MAGIC);
    b[OFF_COUNT..OFF_COUNT + 8].copy_from_slice(&count.to_le_bytes());
    b[OFF_LAST..OFF_LAST + 8].copy_from_slice(&last_ns.to_le_bytes());
    // The last `steps_us.len()` steps end at `count`.
    let first = count.saturating_sub(steps_us.len() as u64);
    for (i, us) in steps_us.iter().enumerate() {
        let k = (first + i as u64) % RING as u64;
        let o = OFF_RING + k as usize * 4;
        b[o..o + 4].copy_from_slice(&us.to_le_bytes());
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_a_torn_one_is_refused() {
        let b = encode(300, 77, &[1000, 2000, 3000]);
        let r = StepRecord::parse(&b).unwrap();
        assert_eq!(r.count, 300);
        assert_eq!(r.last_ns, 77);
        assert_eq!(r.since(297), vec![0.001, 0.002, 0.003]);
        assert_eq!(r.since(299), vec![0.003]);
        assert!(r.since(300).is_empty());
        assert_eq!(r.since(0).len(), RING, "at most the ring");
        let mut torn = b.clone();
        torn[OFF_SEQ] = 1;
        assert_eq!(StepRecord::parse(&torn), None);
        assert_eq!(StepRecord::parse(&b[..100]), None);
        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(StepRecord::parse(&bad), None);
    }
}

/// What a round read of one process's step times.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepSample {
    /// Steps completed.
    pub steps: u64,
    /// Its step time: the median of the steps completed since the last round, else the last one
    /// known; `None` before its first step.
    pub step_s: Option<f64>,
    /// The longest of the steps completed since the last round; `None` when none did.
    #[serde(default)]
    pub max_s: Option<f64>,
    /// Seconds since its last mark: how long the step under way has run (a stall shows here
    /// before it ends); `None` while the process says it is idle (`mpsr_step_idle()`).
    pub age_s: Option<f64>,
}

/// Reads processes' step files each round (the agent, as root: a file counts only when it is a
/// regular file owned by the uid the process's job runs as, never through a link).
#[derive(Debug)]
pub struct StepReader {
    dir: PathBuf,
    seen: std::collections::BTreeMap<u32, (u64, Option<f64>)>,
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl StepReader {
    pub fn new(dir: &Path) -> StepReader {
        StepReader {
            dir: dir.to_path_buf(),
            seen: Default::default(),
        }
    }

    fn load(&self, pid: u32, uid: u32) -> Option<StepRecord> {
        use std::io::Read;
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path(&self.dir, pid))
            .ok()?;
        let m = f.metadata().ok()?;
        if !m.is_file() || m.uid() != uid {
            return None;
        }
        use std::os::unix::fs::FileExt;
        for _ in 0..3 {
            let mut b = vec![0u8; SIZE];
            f.read_exact(&mut b).ok()?;
            let mut again = [0u8; 8];
            f.read_exact_at(&mut again, OFF_SEQ as u64).ok()?;
            // Unchanged and even: the writer was not in the middle of a step while we read.
            if StepRecord::seq(&b) == Some(u64::from_le_bytes(again)) {
                if let Some(r) = StepRecord::parse(&b) {
                    return Some(r);
                }
            }
            use std::io::Seek;
            f.rewind().ok()?;
        }
        None
    }

    /// The process's step times this round, where it marks steps.
    pub fn read(&mut self, pid: u32, uid: u32) -> Option<StepSample> {
        let r = self.load(pid, uid)?;
        let (prev, last) = self.seen.get(&pid).copied().unwrap_or((0, None));
        // A count that went down: another process with this pid now.
        let prev = if r.count < prev { 0 } else { prev };
        let mut new = r.since(prev);
        new.sort_by(f64::total_cmp);
        let step_s = new.get(new.len() / 2).copied().or(last);
        self.seen.insert(pid, (r.count, step_s));
        // 0: idle (no step under way).
        let age_s = (r.last_ns != 0).then(|| monotonic_ns().saturating_sub(r.last_ns) as f64 / 1e9);
        Some(StepSample {
            steps: r.count,
            step_s,
            max_s: new.last().copied(),
            age_s,
        })
    }

    /// Forgets the processes not in `live`, removing their files (one a fault killed leaves it).
    pub fn retain(&mut self, live: &std::collections::BTreeSet<u32>) {
        let gone: Vec<u32> = self
            .seen
            .keys()
            .filter(|p| !live.contains(p))
            .copied()
            .collect();
        for pid in gone {
            self.seen.remove(&pid);
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_file(path(&self.dir, pid));
            }
        }
    }
}
