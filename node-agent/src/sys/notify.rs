//! systemd readiness (the sd_notify protocol): one datagram to `$NOTIFY_SOCKET`. Without it (not
//! started by systemd with `Type=notify`) nothing is sent.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`); `Ok(false)` when there is no notify socket.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let sock = UnixDatagram::unbound()?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    if let Some(name) = bytes.strip_prefix(b"@") {
        // An abstract socket (systemd's own).
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), &path)?;
    }
    Ok(true)
}
