//! Passing one file descriptor over a Unix stream socket (SCM_RIGHTS): how the state keeper hands a
//! job's GPU memory (an exported CUDA allocation, or a memfd in the simulation) to the job's process.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// A one-byte payload plus room for one fd's control message; `msg` points into `self`, so it is
/// built by the caller after the buffers are in place.
struct Buffers {
    byte: [u8; 1],
    iov: libc::iovec,
    cbuf: Vec<u8>,
}

impl Buffers {
    fn new(byte: u8) -> Box<Buffers> {
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        let mut b = Box::new(Buffers {
            byte: [byte],
            iov: libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 1,
            },
            cbuf: vec![0u8; space],
        });
        b.iov.iov_base = b.byte.as_mut_ptr() as *mut libc::c_void;
        b
    }

    fn msg(&mut self) -> libc::msghdr {
        // SAFETY: msghdr is plain data; zeroed is valid, and the fields set point into self, which
        // is boxed (does not move) and outlives the sendmsg/recvmsg call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut self.iov;
        msg.msg_iovlen = 1;
        msg.msg_control = self.cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = self.cbuf.len() as _;
        msg
    }
}

/// Sends `fd` with a one-byte payload.
pub fn send_fd(s: &UnixStream, fd: RawFd) -> io::Result<()> {
    let mut b = Buffers::new(b'F');
    let msg = b.msg();
    // SAFETY: msg_control points to CMSG_SPACE(one fd) bytes, enough for one header with one fd.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
    }
    // SAFETY: msg is fully initialized and its buffers outlive the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Receives one fd sent by [`send_fd`] (honours the socket's read timeout).
pub fn recv_fd(s: &UnixStream) -> io::Result<OwnedFd> {
    let mut b = Buffers::new(0);
    let mut msg = b.msg();
    // SAFETY: msg's buffers are live; MSG_CMSG_CLOEXEC marks the received fd close-on-exec.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed before the fd",
        ));
    }
    // SAFETY: walking the control messages the kernel wrote into b.cbuf.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if !c.is_null() && (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS
        {
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const RawFd);
            return Ok(OwnedFd::from_raw_fd(fd));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "no file descriptor in the message",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn an_fd_crosses_a_socket_and_still_refers_to_the_same_file() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut f = tempfile_in_tmp();
        f.write_all(b"kept").unwrap();
        send_fd(&a, f.as_raw_fd()).unwrap();
        let got = recv_fd(&b).unwrap();
        let mut g = std::fs::File::from(got);
        g.rewind().unwrap();
        let mut s = String::new();
        g.read_to_string(&mut s).unwrap();
        assert_eq!(s, "kept");
    }

    #[test]
    fn no_fd_is_an_error_not_a_crash() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"x").unwrap();
        assert!(recv_fd(&b).is_err());
        drop(a);
        assert!(recv_fd(&b).is_err());
    }

    fn tempfile_in_tmp() -> std::fs::File {
        let p = std::env::temp_dir().join(format!("mpsr-fdpass-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let _ = std::fs::remove_file(&p);
        f
    }
}
