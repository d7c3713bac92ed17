//! The servers' side of the sockets: binding one anyone may connect to, and who is on the other
//! end of a connection, as the kernel says (SO_PEERCRED), not as a message says.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

pub fn peer_cred(s: &UnixStream) -> std::io::Result<PeerCred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: c and len are valid, correctly sized out-parameters for SO_PEERCRED on a live fd.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut c as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: c.pid as u32,
        uid: c.uid,
        gid: c.gid,
    })
}

/// How long a socket that still takes connections is given to let go before another server is
/// assumed to be there. A server just killed may leave its listening socket with a child it was
/// forking (the child holds every descriptor until its exec closes them), and a listening socket
/// takes connections into its backlog without anyone accepting: so an immediate restart (systemd,
/// a test) would otherwise refuse to start.
const LET_GO: Duration = Duration::from_secs(3);

/// Binds a socket every local user may connect to (each request is then authorized from
/// SO_PEERCRED). Refuses when another server keeps taking connections there (for [`LET_GO`]);
/// replaces a stale file.
pub fn bind_world_socket(path: &Path, what: &str) -> std::io::Result<UnixListener> {
    bind_world_socket_within(path, what, LET_GO)
}

fn bind_world_socket_within(
    path: &Path,
    what: &str,
    let_go: Duration,
) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    let deadline = Instant::now() + let_go;
    while UnixStream::connect(path).is_ok() {
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("another {what} is serving {}", path.display()),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_that_keeps_taking_connections_is_another_server() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _other = UnixListener::bind(&path).unwrap();
        let t = Instant::now();
        let e = bind_world_socket_within(&path, "agent", Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert!(t.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn a_socket_let_go_within_the_grace_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let held = UnixListener::bind(&path).unwrap();
        // Like a half-forked child of a killed server: lets go a moment later.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        let l = bind_world_socket_within(&path, "agent", Duration::from_secs(5)).unwrap();
        t.join().unwrap();
        assert!(UnixStream::connect(&path).is_ok());
        drop(l);
        // A stale file with nobody behind it: taken over at once.
        let t = Instant::now();
        let _l = bind_world_socket_within(&path, "agent", Duration::from_secs(5)).unwrap();
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
