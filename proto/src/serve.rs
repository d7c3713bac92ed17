//! One accept loop for every socket server of the project (agent, state keeper): peer credentials
//! read at accept, connections bounded per uid and in all, a slot pool users cannot fill for the
//! trusted uids (root: slurmstepd, the prolog, the agent), a deadline for each whole frame, one
//! thread per accepted connection. What a connection says is the caller's.
//!
//! Why per uid: one local user holding every connection (slowly trickling bytes) would otherwise
//! lock every other user's jobs and slurmstepd itself out of the agent.

use crate::frame::{FrameError, MAX_FRAME};
use crate::peer::{peer_cred, PeerCred};
use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections of untrusted uids open at once, all of them together.
    pub max_connections: usize,
    /// Connections one untrusted uid may hold open at once.
    pub max_per_uid: usize,
    /// Connections of trusted uids open at once: a pool of their own that users cannot fill.
    pub max_trusted: usize,
    /// How long a connection may wait silent for its next request.
    pub idle_timeout: Duration,
    /// How long one frame may take from its first byte to its last (and a reply to be written):
    /// a peer trickling bytes cannot hold its slot longer.
    pub frame_deadline: Duration,
}

/// Who holds which slots (pure bookkeeping, so that the rules are testable without sockets).
#[derive(Debug, Default)]
struct Slots {
    trusted: usize,
    users: usize,
    per_uid: BTreeMap<u32, usize>,
}

/// Which pool had no slot left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Trusted,
    Users,
    Uid,
}

impl Slots {
    fn take(&mut self, uid: u32, trusted: bool, l: &Limits) -> Result<(), Refusal> {
        if trusted {
            if self.trusted >= l.max_trusted {
                return Err(Refusal::Trusted);
            }
            self.trusted += 1;
            return Ok(());
        }
        let mine = self.per_uid.get(&uid).copied().unwrap_or(0);
        if mine >= l.max_per_uid {
            return Err(Refusal::Uid);
        }
        if self.users >= l.max_connections {
            return Err(Refusal::Users);
        }
        self.users += 1;
        *self.per_uid.entry(uid).or_default() += 1;
        Ok(())
    }

    fn give_back(&mut self, uid: u32, trusted: bool) {
        if trusted {
            self.trusted = self.trusted.saturating_sub(1);
            return;
        }
        self.users = self.users.saturating_sub(1);
        if let Some(n) = self.per_uid.get_mut(&uid) {
            *n -= 1;
            if *n == 0 {
                self.per_uid.remove(&uid);
            }
        }
    }
}

/// Serves `listener` forever; `handle` runs on its own thread per connection. `trusted` says
/// which uids draw on the trusted pool.
pub fn serve_connections<F, T>(
    listener: UnixListener,
    name: &str,
    limits: Limits,
    trusted: T,
    handle: F,
) where
    F: Fn(PeerCred, UnixStream) + Send + Sync + 'static,
    T: Fn(u32) -> bool,
{
    let handle = Arc::new(handle);
    let slots = Arc::new(Mutex::new(Slots::default()));
    // The uids told about their cap: said once until they are under it again (no log flood).
    let mut told: BTreeMap<u32, Refusal> = BTreeMap::new();
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let Ok(peer) = peer_cred(&stream) else {
            continue;
        };
        let is_trusted = trusted(peer.uid);
        let taken = lock(&slots).take(peer.uid, is_trusted, &limits);
        if let Err(why) = taken {
            if told.insert(peer.uid, why) != Some(why) {
                eprintln!(
                    "{name}: connection of uid {} refused ({})",
                    peer.uid,
                    match why {
                        Refusal::Trusted => "trusted pool full",
                        Refusal::Users => "all user connections in use",
                        Refusal::Uid => "this uid's connections all in use",
                    }
                );
            }
            continue; // dropping closes it
        }
        told.remove(&peer.uid);
        let _ = stream.set_write_timeout(Some(limits.frame_deadline));
        let (h, s) = (handle.clone(), slots.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-conn"))
            .spawn(move || {
                h(peer, stream);
                lock(&s).give_back(peer.uid, is_trusted);
            });
        if spawned.is_err() {
            lock(&slots).give_back(peer.uid, is_trusted);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads the next request's body: waits up to `idle_timeout` for it to begin, then the whole
/// frame must arrive within `frame_deadline`. `Closed` when the peer hung up between frames.
pub fn next_frame(s: &mut UnixStream, l: &Limits) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    s.set_read_timeout(Some(l.idle_timeout))?;
    let first = loop {
        match s.read(&mut len[..1]) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if first == 0 {
        return Err(FrameError::Closed);
    }
    let deadline = Instant::now() + l.frame_deadline;
    read_exact_by(s, &mut len[1..], deadline)?;
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    let mut body = vec![0u8; n];
    read_exact_by(s, &mut body, deadline)?;
    Ok(body)
}

fn read_exact_by(
    s: &mut UnixStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> Result<(), FrameError> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(FrameError::Io(std::io::ErrorKind::TimedOut.into()));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(buf) {
            Ok(0) => return Err(FrameError::Closed),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn limits() -> Limits {
        Limits {
            max_connections: 3,
            max_per_uid: 2,
            max_trusted: 2,
            idle_timeout: Duration::from_secs(5),
            frame_deadline: Duration::from_millis(300),
        }
    }

    #[test]
    fn a_uid_cannot_take_more_than_its_share_nor_the_trusted_pool() {
        let l = limits();
        let mut s = Slots::default();
        assert_eq!(s.take(1000, false, &l), Ok(()));
        assert_eq!(s.take(1000, false, &l), Ok(()));
        // The user's third: its own cap.
        assert_eq!(s.take(1000, false, &l), Err(Refusal::Uid));
        // Another user still gets in, until all user slots are taken.
        assert_eq!(s.take(1001, false, &l), Ok(()));
        assert_eq!(s.take(1002, false, &l), Err(Refusal::Users));
        // Root is not affected by any of it.
        assert_eq!(s.take(0, true, &l), Ok(()));
        assert_eq!(s.take(0, true, &l), Ok(()));
        assert_eq!(s.take(0, true, &l), Err(Refusal::Trusted));
        s.give_back(1000, false);
        assert_eq!(s.take(1002, false, &l), Ok(()));
        s.give_back(0, true);
        assert_eq!(s.take(0, true, &l), Ok(()));
        for (u, t) in [
            (1000, false),
            (1001, false),
            (1002, false),
            (0, true),
            (0, true),
        ] {
            s.give_back(u, t);
        }
        assert!(
            s.per_uid.is_empty() && s.users == 0 && s.trusted == 0,
            "{s:?}"
        );
    }

    fn server(l: Limits, trusted_uid: u32) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        // Echoes each frame's length back as one byte, holding the connection between frames.
        std::thread::spawn(move || {
            serve_connections(
                listener,
                "test",
                l,
                move |u| u == trusted_uid,
                move |_peer, mut s| {
                    while let Ok(b) = next_frame(&mut s, &l) {
                        let _ = s.write_all(&[b.len() as u8]);
                    }
                },
            )
        });
        (dir, path)
    }

    fn closed_at_once(s: &mut UnixStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        matches!(s.read(&mut [0u8; 1]), Ok(0))
    }

    #[test]
    fn past_its_cap_a_uid_is_closed_at_once_while_trusted_ones_are_served() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        // This process is the untrusted user here (the trusted uid is one nobody has).
        let (_d, path) = server(limits(), u32::MAX);
        let held: Vec<UnixStream> = (0..2)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mut third = UnixStream::connect(&path).unwrap();
        assert!(closed_at_once(&mut third), "uid {me} over its cap");
        drop(held);
        std::thread::sleep(Duration::from_millis(200));
        // Below the cap again: served (answers a frame).
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(&[0, 0, 0, 2, b'{', b'}']).unwrap();
        let mut b = [0u8; 1];
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.read_exact(&mut b).unwrap();
        assert_eq!(b[0], 2);

        // The same connections from a trusted uid draw on the trusted pool: users holding all of
        // theirs do not keep it out.
        let (_d2, path2) = server(limits(), me);
        let held: Vec<UnixStream> = (0..2)
            .map(|_| UnixStream::connect(&path2).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mut third = UnixStream::connect(&path2).unwrap();
        assert!(closed_at_once(&mut third), "the trusted pool has 2");
        drop(held);
    }

    #[test]
    fn a_trickled_frame_is_cut_at_its_deadline() {
        let (_d, path) = server(limits(), u32::MAX);
        let mut s = UnixStream::connect(&path).unwrap();
        let t = Instant::now();
        // One byte every 100 ms: each read is quick, the frame never completes in time.
        for b in [0u8, 0, 0, 4, b'{', b'}'] {
            if s.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(closed_at_once(&mut s), "cut off");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}
