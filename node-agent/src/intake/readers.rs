//! Fault intake threads for real nodes: `/dev/kmsg` (NVRM Xid lines, resuming after the last sequence
//! number seen in this boot) and tailing each fault domain's MPS logs. Each turns lines into [`Signal`]s.

use crate::intake::control_log::{parse_control_log, ControlLogEvent};
use crate::intake::kernel_line;
pub use crate::signal::{Cursor, Cursors, KmsgCursor, LogCursor};
use crate::signal::{GpuRef, Signal, Source};
use mpsr_proto::DomainId;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

/// Where the kernel-log reader finds, at its start, the record to resume after (in the state dir).
pub const KMSG_CURSOR_FILE: &str = "kmsg-cursor.json";

/// The monotonic clock in microseconds, as /dev/kmsg stamps its records.
fn monotonic_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Reads `/dev/kmsg` forever. With a saved cursor of this boot (the agent writes the one kept with
/// its decisions there before starting this reader), replays records after it (faults that
/// happened while the agent was down: marked replayed); otherwise starts at the end (old Xids are
/// history, not news). Each signal carries its record's cursor; the reader itself writes none.
pub fn spawn_kmsg_reader(
    path: PathBuf,
    cursor_file: PathBuf,
    tx: Sender<Signal>,
) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)?;
    let boot = boot_id();
    let saved: Option<KmsgCursor> = crate::sys::atomic_file::read(&cursor_file).ok().flatten();
    let resume_after = match saved {
        Some(c) if c.boot_id == boot => Some(c.seq),
        _ => {
            let _ = f.seek(SeekFrom::End(0));
            None
        }
    };
    std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || kmsg_loop(f, boot, resume_after, tx))?;
    let _ = cursor_file;
    Ok(())
}

fn kmsg_loop(mut f: File, boot: String, resume_after: Option<u64>, tx: Sender<Signal>) {
    let started_us = monotonic_us();
    let mut buf = vec![0u8; 8192];
    loop {
        // Each read returns exactly one record.
        let n = match f.read(&mut buf) {
            Ok(0) => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            Ok(n) => n,
            // EPIPE: records were overwritten before we read them; carry on with the next.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(error = %e, "kmsg read failed; kernel-log intake stopped");
                return;
            }
        };
        let rec = String::from_utf8_lossy(&buf[..n]);
        let Some(r) = kernel_line::parse_kmsg_record(&rec) else {
            continue;
        };
        if resume_after.is_some_and(|s| r.seq <= s) {
            continue;
        }
        let parsed = kernel_line::parse_line(r.message);
        if parsed.is_some() && !r.from_kernel() {
            // Root wrote an Xid or isolation line into /dev/kmsg: not the driver's word.
            tracing::warn!(
                seq = r.seq,
                facility = r.facility,
                line = r.message,
                "NVRM-like record not from the kernel; ignored"
            );
            continue;
        }
        if let Some(line) = parsed {
            if let Some(mut s) = signal_from_kernel(&line, Source::Kmsg) {
                s.replayed = resume_after.is_some() && r.ts_usec < started_us;
                s.cursor = Some(Cursor::Kmsg(KmsgCursor {
                    boot_id: boot.clone(),
                    seq: r.seq,
                }));
                if tx.send(s).is_err() {
                    return;
                }
            }
        }
    }
}

/// Tails one of a domain's MPS logs (server.log, control.log) from `from` (a position kept with
/// the decisions: lines written while the agent was down are read, marked replayed), else from
/// its current end, until `stop`. A fatal-error line is the domain's own evidence that *its*
/// server faulted: it becomes a signal for that domain (without an Xid: it joins the fault, or
/// opens one the Xid then joins), carrying the position just past it.
pub fn spawn_log_tail(
    domain: DomainId,
    path: PathBuf,
    from: Option<LogCursor>,
    tx: Sender<Signal>,
    stop: Arc<AtomicBool>,
) {
    let _ = std::thread::Builder::new()
        .name(format!("mpslog{}.{}", domain.gpu, domain.slot))
        .spawn(move || tail_loop(domain, &path, from, tx, &stop));
}

/// The inode and length of a file, where it exists.
pub fn log_position(path: &Path) -> Option<LogCursor> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| LogCursor {
        ino: m.ino(),
        offset: m.len(),
    })
}

fn tail_loop(
    domain: DomainId,
    path: &Path,
    from: Option<LogCursor>,
    tx: Sender<Signal>,
    stop: &AtomicBool,
) {
    let now = log_position(path);
    // What is in the file now was written before this tail: replayed news, if read at all.
    let backlog_end = now.map_or(0, |c| c.offset);
    let mut ino = now.map_or(0, |c| c.ino);
    let mut pos = match (from, now) {
        (Some(f), Some(n)) if f.ino == n.ino && f.offset <= n.offset => f.offset,
        (_, Some(n)) => n.offset,
        _ => 0,
    };
    // Woken by writes to the log's directory; the bound is how long a stopped tail may linger.
    let watch = crate::intake::file_watch::FileWatch::new(path);
    if !watch.notified() {
        tracing::debug!(%domain, path = %path.display(), "no inotify: polling the log every 50 ms");
    }
    while !stop.load(Ordering::SeqCst) {
        watch.wait(Duration::from_millis(500));
        // One stat per wake-up while nothing was written: open and read only when the length
        // moved.
        let Ok(meta) = std::fs::metadata(path) else {
            continue;
        };
        if meta.len() == pos {
            continue;
        }
        let Ok(mut f) = File::open(path) else {
            continue;
        };
        let (len, file_ino) = f.metadata().map_or((0, 0), |m| {
            use std::os::unix::fs::MetadataExt;
            (m.len(), m.ino())
        });
        if len < pos || file_ino != ino {
            pos = 0; // rotated, truncated or made anew
            ino = file_ino;
        }
        if f.seek(SeekFrom::Start(pos)).is_err() {
            continue;
        }
        let mut r = BufReader::new(f);
        let mut line = String::new();
        while let Ok(n) = r.read_line(&mut line) {
            if n == 0 || !line.ends_with('\n') {
                break;
            }
            pos += n as u64;
            // A stopped tail may still be waking up beside its successor: it sends nothing more.
            if stop.load(Ordering::SeqCst) {
                return;
            }
            if let Some(ControlLogEvent::Fault) = parse_control_log(line.trim_end()) {
                let mut s = Signal::new(Source::MpsLog, GpuRef::Index(domain.gpu), None);
                s.domain = Some(domain.slot);
                s.detail = format!("{domain}: {}", line.trim());
                s.replayed = pos <= backlog_end && from.is_some();
                s.cursor = Some(Cursor::Log {
                    path: path.to_path_buf(),
                    at: LogCursor { ino, offset: pos },
                });
                if tx.send(s).is_err() {
                    return;
                }
            }
            line.clear();
        }
    }
}

/// A parsed kernel line as a fault signal.
pub fn signal_from_kernel(line: &kernel_line::KernelLine, source: Source) -> Option<Signal> {
    match line {
        kernel_line::KernelLine::Xid(x) => {
            let mut s = Signal::new(source, GpuRef::Pci(x.pci), Some(x.xid));
            s.reported_pid = x.pid;
            s.secondary = x.secondary;
            s.recovery = x
                .recovery_code
                .and_then(mpsr_proto::fault::RecoveryAction::from_code);
            s.detail = x.detail.clone();
            Some(s)
        }
        kernel_line::KernelLine::Isolation {
            pci,
            xid,
            culprit_pid,
            contained,
        } => {
            let mut s = Signal::new(Source::Isolation, GpuRef::Pci(*pci), Some(*xid));
            s.culprit = Some((*culprit_pid, *contained));
            Some(s)
        }
    }
}
