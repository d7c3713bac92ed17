//! Blocking client with a bounded time for every step (connect, send, receive).

use crate::frame::{read_frame, write_frame, FrameError};
use crate::{Request, Response};
use std::io;
use std::os::unix::io::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug)]
pub enum ClientError {
    /// Socket missing, refused, or connect timed out: the agent is down.
    Unavailable(PathBuf, io::Error),
    /// Connected, but the agent did not answer in time or the frame was bad.
    Protocol(FrameError),
    /// The agent speaks another protocol revision (a rolling upgrade half done).
    Version { client: u32, agent: u32 },
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Unavailable(p, e) => {
                write!(f, "node agent not reachable at {}: {e}", p.display())
            }
            ClientError::Protocol(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                f.write_str("node agent did not answer in time")
            }
            ClientError::Protocol(e) => write!(f, "node agent protocol error: {e}"),
            ClientError::Version { client, agent } => write!(
                f,
                "node agent speaks protocol {agent}, this client {client}: upgrade the agent and the plugin/mpsrctl together"
            ),
        }
    }
}

impl std::error::Error for ClientError {}

pub struct Client {
    path: PathBuf,
    timeout: Duration,
}

impl Client {
    pub fn new(path: impl AsRef<Path>, timeout: Duration) -> Self {
        Client {
            path: path.as_ref().to_path_buf(),
            timeout,
        }
    }

    /// One request, one response, all within `timeout` per step. The connection starts with
    /// `Hello`: a request is sent only to an agent of the same protocol revision.
    pub fn call(&self, req: &Request) -> Result<Response, ClientError> {
        let mut s = connect_timeout(&self.path, self.timeout)
            .map_err(|e| ClientError::Unavailable(self.path.clone(), e))?;
        s.set_read_timeout(Some(self.timeout))
            .and_then(|_| s.set_write_timeout(Some(self.timeout)))
            .map_err(|e| ClientError::Unavailable(self.path.clone(), e))?;
        if !matches!(req, Request::Hello { .. }) {
            let hello = Request::Hello {
                version: crate::PROTOCOL_VERSION,
            };
            write_frame(&mut s, &hello).map_err(ClientError::Protocol)?;
            match read_frame(&mut s).map_err(ClientError::Protocol)? {
                Response::Hello { version, .. } if version == crate::PROTOCOL_VERSION => {}
                Response::Hello { version, .. } => {
                    return Err(ClientError::Version {
                        client: crate::PROTOCOL_VERSION,
                        agent: version,
                    })
                }
                other => return Ok(other),
            }
        }
        write_frame(&mut s, req).map_err(ClientError::Protocol)?;
        read_frame(&mut s).map_err(ClientError::Protocol)
    }
}

/// `UnixStream::connect` can block when the listener's backlog is full (agent stalled), so connect
/// non-blocking and poll with a deadline.
fn connect_timeout(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain old data; zeroed is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2) call; the fd is owned by the UnixStream below or closed on error.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own; from here the stream closes it on drop.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: addr is a valid sockaddr_un and len does not exceed its size.
    let rc = unsafe {
        libc::connect(
            fd,
            &addr as *const libc::sockaddr_un as *const libc::sockaddr,
            len as libc::socklen_t,
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        let code = err.raw_os_error();
        if code != Some(libc::EINPROGRESS) && code != Some(libc::EAGAIN) {
            return Err(err);
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: pfd is a valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"));
        }
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut so_err: libc::c_int = 0;
        let mut sl = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: so_err/sl are valid out-parameters of the right size.
        unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                &mut so_err as *mut _ as *mut libc::c_void,
                &mut sl,
            )
        };
        if so_err != 0 {
            return Err(io::Error::from_raw_os_error(so_err));
        }
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_socket_is_unavailable_quickly() {
        let c = Client::new("/nonexistent/mpsr.sock", Duration::from_millis(200));
        let t = std::time::Instant::now();
        let e = c
            .call(&Request::Hello {
                version: crate::PROTOCOL_VERSION,
            })
            .unwrap_err();
        assert!(matches!(e, ClientError::Unavailable(..)));
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn silent_agent_times_out() {
        let dir = std::env::temp_dir().join(format!("mpsr-proto-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("s.sock");
        let _ = std::fs::remove_file(&p);
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap(); // never accepts or answers
        let c = Client::new(&p, Duration::from_millis(200));
        let e = c
            .call(&Request::Hello {
                version: crate::PROTOCOL_VERSION,
            })
            .unwrap_err();
        assert!(e.to_string().contains("did not answer in time"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod version_tests {
    use super::*;

    /// An agent that answers Hello with `version` and echoes `Ok` to anything else.
    fn fake_agent(version: u32) -> (tempfile_dir::Dir, PathBuf) {
        let dir = tempfile_dir::Dir::new();
        let path = dir.0.join("a.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                while let Ok(req) = read_frame::<Request>(&mut c) {
                    let resp = match req {
                        Request::Hello { .. } => Response::Hello {
                            version,
                            node: "n".into(),
                            simulated: true,
                        },
                        _ => Response::Ok,
                    };
                    if write_frame(&mut c, &resp).is_err() {
                        break;
                    }
                }
            }
        });
        (dir, path)
    }

    mod tempfile_dir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p = std::env::temp_dir().join(format!(
                    "mpsr-proto-test-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                let _ = std::fs::remove_dir_all(&p);
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn another_protocol_revision_is_refused_naming_both() {
        let (_d, path) = fake_agent(crate::PROTOCOL_VERSION + 1);
        let c = Client::new(&path, Duration::from_secs(2));
        let e = c.call(&Request::Status).unwrap_err();
        assert!(
            matches!(e, ClientError::Version { client, agent } if client == crate::PROTOCOL_VERSION && agent == client + 1),
            "{e:?}"
        );
        assert!(e
            .to_string()
            .contains(&format!("protocol {}", crate::PROTOCOL_VERSION + 1)));
        // Hello itself always goes through (it is how versions are learnt).
        assert!(matches!(
            c.call(&Request::Hello {
                version: crate::PROTOCOL_VERSION,
            })
            .unwrap(),
            Response::Hello { .. }
        ));
    }

    #[test]
    fn the_same_revision_gets_its_answer() {
        let (_d, path) = fake_agent(crate::PROTOCOL_VERSION);
        let c = Client::new(&path, Duration::from_secs(2));
        assert_eq!(c.call(&Request::Status).unwrap(), Response::Ok);
    }
}
