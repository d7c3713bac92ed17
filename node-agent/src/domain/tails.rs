//! The tails of each domain's MPS logs (server.log, control.log): a fatal-error line there says
//! *which* server faulted. One pair per domain for as long as the domain exists: a daemon started
//! again writes on in the same files, so its tails go on from where they were. A new tail starts
//! at the end of the file, so replacing one would lose any line written in between.

use crate::intake::readers::LogCursor;
use crate::signal::Signal;
use mpsr_proto::DomainId;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// The logs of a domain that are tailed.
pub const LOGS: [&str; 2] = ["server.log", "control.log"];

#[derive(Default)]
pub struct LogTails {
    /// Stop flag of each domain's tails.
    tails: Mutex<BTreeMap<DomainId, Arc<AtomicBool>>>,
}

impl LogTails {
    /// Tails the logs in `log_dir` for `id` unless they are tailed already, each from the
    /// position `from` gives (else its end); whether it started.
    pub fn ensure(
        &self,
        id: DomainId,
        log_dir: &Path,
        from: impl Fn(&Path) -> Option<LogCursor>,
        tx: &Sender<Signal>,
    ) -> bool {
        let stop = Arc::new(AtomicBool::new(false));
        {
            let mut tails = crate::sys::lock(&self.tails);
            if tails.contains_key(&id) {
                return false;
            }
            tails.insert(id, stop.clone());
        }
        for name in LOGS {
            let path = log_dir.join(name);
            crate::intake::readers::spawn_log_tail(
                id,
                path.clone(),
                from(&path),
                tx.clone(),
                stop.clone(),
            );
        }
        true
    }

    /// Stops the tails of a domain (stopped, or taken over by a new tenant).
    pub fn stop(&self, id: DomainId) {
        if let Some(stop) = crate::sys::lock(&self.tails).remove(&id) {
            stop.store(true, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Duration;

    #[test]
    fn a_domain_started_again_keeps_its_tails_and_loses_no_line() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("server.log");
        std::fs::write(&log, "").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tails = LogTails::default();
        let d = DomainId { gpu: 0, slot: 2 };
        assert!(tails.ensure(d, dir.path(), |_| None, &tx));
        std::thread::sleep(Duration::from_millis(100));
        // A fatal line lands just as the watchdog starts the daemon again.
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        writeln!(
            f,
            "[2026-12-04 10:00:00.000 Server 9] Server is handling a fatal GPU error."
        )
        .unwrap();
        assert!(
            !tails.ensure(d, dir.path(), |_| None, &tx),
            "kept, not replaced"
        );
        let s = rx
            .recv_timeout(Duration::from_secs(3))
            .expect("the line is seen");
        assert_eq!(s.domain, Some(2));
        assert!(
            rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "seen once, not twice"
        );
        // Stopped, then started for a new tenant: tails again.
        tails.stop(d);
        assert!(tails.ensure(d, dir.path(), |_| None, &tx));
        tails.stop(d);
    }
}
