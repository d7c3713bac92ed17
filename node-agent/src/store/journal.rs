//! Registry journal. Registrations are the hot path (every task launch waits for one to be durable),
//! so they are appended to `registry.journal` (one fdatasync for a whole batch of concurrent ones)
//! instead of rewriting the full state file each time; the full state is written when anything
//! else changes or the journal grows, and the journal then starts over. On start the agent loads
//! the state file and replays the journal entries newer than it (a torn last line is ignored).

use crate::store::registry::{Registry, Task};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    Register { task: Task },
    Remove { job: u32, step: u32, pid: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    #[serde(flatten)]
    pub op: Op,
}

pub fn apply(reg: &mut Registry, op: &Op) {
    match op {
        // Checked when it was accepted; replay only restores it.
        Op::Register { task } => reg.put(task.clone()),
        Op::Remove { job, step, pid } => {
            reg.remove((*job, *step, *pid));
        }
    }
}

pub struct Journal {
    path: PathBuf,
    file: Option<File>,
    /// Entries in the file since the last reset.
    pub len: usize,
}

impl Journal {
    pub fn new(path: &Path) -> Journal {
        Journal {
            path: path.to_path_buf(),
            file: None,
            len: 0,
        }
    }

    fn file(&mut self) -> std::io::Result<&mut File> {
        if self.file.is_none() {
            self.file = Some(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .mode(0o600)
                    .open(&self.path)?,
            );
        }
        Ok(self.file.as_mut().expect("opened above"))
    }

    /// Appends entries and makes them durable (one write, one fdatasync).
    pub fn append(&mut self, entries: &[Entry]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(entries.len() * 256);
        for e in entries {
            serde_json::to_writer(&mut buf, e).map_err(std::io::Error::other)?;
            buf.push(b'\n');
        }
        let f = self.file()?;
        f.write_all(&buf)?;
        f.sync_data()?;
        self.len += entries.len();
        Ok(())
    }

    /// Empties the journal (after a full state write that contains everything in it).
    pub fn reset(&mut self) -> std::io::Result<()> {
        self.file = None;
        let f = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(&self.path)?;
        f.sync_all()?;
        self.len = 0;
        Ok(())
    }

    /// Applies the entries newer than `after_seq`; returns (applied, highest seq seen).
    pub fn replay(path: &Path, after_seq: u64, reg: &mut Registry) -> (usize, u64) {
        let Ok(f) = File::open(path) else {
            return (0, after_seq);
        };
        let (mut n, mut last) = (0, after_seq);
        for line in BufReader::new(f).lines() {
            let Ok(line) = line else { break };
            // A crash mid-append leaves a torn last line: everything before it counts.
            let Ok(e) = serde_json::from_str::<Entry>(&line) else {
                tracing::warn!(path = %path.display(), "ignoring a torn journal line");
                break;
            };
            if e.seq > after_seq {
                apply(reg, &e.op);
                n += 1;
            }
            last = last.max(e.seq);
        }
        (n, last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(job: u32, pid: u32) -> Task {
        Task {
            trusted: true,
            ..crate::store::registry::tests::task(job, pid, 1000, &[0])
        }
    }

    #[test]
    fn replay_applies_only_newer_entries_and_stops_at_a_torn_line() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("registry.journal");
        let mut j = Journal::new(&p);
        j.append(&[
            Entry {
                seq: 1,
                op: Op::Register { task: task(1, 10) },
            },
            Entry {
                seq: 2,
                op: Op::Register { task: task(2, 20) },
            },
            Entry {
                seq: 3,
                op: Op::Remove {
                    job: 1,
                    step: 0,
                    pid: 10,
                },
            },
        ])
        .unwrap();
        let mut reg = Registry::default();
        assert_eq!(Journal::replay(&p, 0, &mut reg), (3, 3));
        assert_eq!(reg.jobs(), [2].into());
        // A snapshot already holding seq <= 2: only the removal is replayed.
        let mut reg = Registry::default();
        reg.put(task(1, 10));
        assert_eq!(Journal::replay(&p, 2, &mut reg), (1, 3));
        assert!(reg.is_empty());
        // Torn tail.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"{\"seq\":4,\"op\":\"reg")
            .unwrap();
        let mut reg = Registry::default();
        assert_eq!(Journal::replay(&p, 0, &mut reg).0, 3);
        j.reset().unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 0);
    }
}
