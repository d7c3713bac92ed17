//! systemd's watchdog (`WatchdogSec=` in the unit): `WATCHDOG=1` is sent only while the agent
//! answers on its own socket (the API thread runs and the state lock is free), so a hung agent is
//! restarted by systemd instead of leaving jobs unprotected. Without `WATCHDOG_USEC` (not under
//! systemd, or no watchdog configured) nothing runs.

use mpsr_proto::{Client, Request, Response};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The watchdog interval systemd asks for, when it asks this process.
pub fn interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// Whether the agent answers a status request on `socket` within `within`.
pub fn answers(socket: &Path, within: Duration) -> bool {
    matches!(
        Client::new(socket, within).call(&Request::Status),
        Ok(Response::Status(_))
    )
}

/// Pings systemd every half interval while the agent answers; a missed answer is logged and
/// not pinged (systemd restarts the agent once the interval passes without one).
pub fn spawn(socket: PathBuf, every: Duration) {
    std::thread::spawn(move || loop {
        std::thread::sleep(every / 2);
        if answers(&socket, every / 4) {
            let _ = super::notify::notify("WATCHDOG=1");
        } else {
            tracing::warn!(
                socket = %socket.display(),
                "the agent did not answer its own socket; systemd's watchdog not pinged"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_watchdog_without_systemd_asking_this_process() {
        // Environment of this test process only; no other test reads these variables.
        std::env::remove_var("WATCHDOG_USEC");
        assert_eq!(interval(), None);
        std::env::set_var("WATCHDOG_USEC", "20000000");
        std::env::set_var("WATCHDOG_PID", "1");
        assert_eq!(interval(), None, "another process's watchdog");
        std::env::set_var("WATCHDOG_PID", std::process::id().to_string());
        assert_eq!(interval(), Some(Duration::from_secs(20)));
        std::env::remove_var("WATCHDOG_USEC");
        std::env::remove_var("WATCHDOG_PID");
    }

    #[test]
    fn a_socket_nobody_answers_is_not_alive() {
        let p = std::env::temp_dir().join(format!("mpsr-wd-{}.sock", std::process::id()));
        assert!(!answers(&p, Duration::from_millis(200)));
    }
}
