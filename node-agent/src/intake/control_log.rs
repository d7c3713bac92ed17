//! An MPS control.log or server.log line, parsed: a server handling a fatal GPU error, a server
//! ready or exited, a client terminated.

/// What a control.log line says about the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlLogEvent {
    /// The server is handling a fatal GPU error (server.log, measured on an H200 with driver 580:
    /// `Server is handling a fatal GPU error.`), or an older driver's `fatal exception` line. Not
    /// "Server is not ready": that is also logged when the first client starts a server.
    Fault,
    /// `NEW SERVER <pid>: Ready`.
    Ready(u32),
    ServerExited {
        pid: u32,
        status: i32,
    },
    Terminated {
        server: u32,
        client: u32,
    },
}

pub fn parse_control_log(line: &str) -> Option<ControlLogEvent> {
    let msg = line.split_once(']').map(|(_, m)| m.trim()).unwrap_or(line);
    if msg.contains("fatal exception") || msg.contains("handling a fatal GPU error") {
        return Some(ControlLogEvent::Fault);
    }
    if let Some(r) = msg.strip_prefix("NEW SERVER ") {
        let (pid, rest) = r.split_once(':')?;
        if rest.trim() == "Ready" {
            return Some(ControlLogEvent::Ready(pid.trim().parse().ok()?));
        }
    }
    if let Some(r) = msg.strip_prefix("Server ") {
        let (pid, rest) = r.split_once(" exited with status ")?;
        return Some(ControlLogEvent::ServerExited {
            pid: pid.trim().parse().ok()?,
            status: rest.trim().parse().ok()?,
        });
    }
    if let Some(r) = msg.strip_prefix("Cmd:terminate_client ") {
        let p: Vec<u32> = r
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        if let [s, c] = p.as_slice() {
            return Some(ControlLogEvent::Terminated {
                server: *s,
                client: *c,
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_log_samples_from_knowledge() {
        assert_eq!(
            parse_control_log("[2026-11-30 10:00:00.000 Control 12] NEW SERVER 497: Ready"),
            Some(ControlLogEvent::Ready(497))
        );
        // Logged when the first client starts a server too: not a fault.
        assert_eq!(
            parse_control_log("[2026-11-30 10:00:00.000 Control 12] NEW CLIENT 494 from user 0: Server is not ready, push client to pending list"),
            None
        );
        // server.log lines measured on the H200 (driver 580.159.04).
        assert_eq!(
            parse_control_log(
                "[2026-12-03 07:29:30.578 Server   558] Server is handling a fatal GPU error."
            ),
            Some(ControlLogEvent::Fault)
        );
        assert_eq!(
            parse_control_log("[2026-12-03 07:29:30.578 Server   558] Client {PID: 555, Context: 1} encountered a fatal GPU error."),
            None
        );
        assert_eq!(
            parse_control_log(
                "[... Control 73] Server encountered a fatal exception. Shutting down"
            ),
            Some(ControlLogEvent::Fault)
        );
        assert_eq!(
            parse_control_log("[... Control 73] Server 95 exited with status 1"),
            Some(ControlLogEvent::ServerExited { pid: 95, status: 1 })
        );
        assert_eq!(
            parse_control_log("[2026-11-30 10:00:00.000 Control 12] Cmd:terminate_client 769 765"),
            Some(ControlLogEvent::Terminated {
                server: 769,
                client: 765
            })
        );
        assert_eq!(
            parse_control_log("[x] Starting new server 497 for user 0"),
            None
        );
        assert_eq!(parse_control_log(""), None);
    }
}
