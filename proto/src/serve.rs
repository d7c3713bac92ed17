//! One accept loop for every socket server of the project (agent, state keeper): peer credentials
//! read at accept, bounded concurrent connections (one past the cap is closed at once), read and
//! write timeouts, one thread per accepted connection. What a connection says is the caller's.

use crate::peer::{peer_cred, PeerCred};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    /// A silent or slow peer cannot hold its thread longer than this per read or write.
    pub io_timeout: Duration,
}

/// Serves `listener` forever; `handle` runs on its own thread per connection.
pub fn serve_connections<F>(listener: UnixListener, name: &str, limits: Limits, handle: F)
where
    F: Fn(PeerCred, UnixStream) + Send + Sync + 'static,
{
    let handle = Arc::new(handle);
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        if active.load(Ordering::SeqCst) >= limits.max_connections {
            eprintln!(
                "{name}: {} connections open; refusing one",
                limits.max_connections
            );
            continue; // dropping closes it
        }
        let Ok(peer) = peer_cred(&stream) else {
            continue;
        };
        let _ = stream.set_read_timeout(Some(limits.io_timeout));
        let _ = stream.set_write_timeout(Some(limits.io_timeout));
        active.fetch_add(1, Ordering::SeqCst);
        let (h, act) = (handle.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-conn"))
            .spawn(move || {
                h(peer, stream);
                act.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_connection_past_the_cap_is_closed_at_once() {
        let dir = std::env::temp_dir().join(format!("mpsr-serve-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let l = UnixListener::bind(&path).unwrap();
        let limits = Limits {
            max_connections: 2,
            io_timeout: Duration::from_secs(5),
        };
        // Each handler holds its connection until the peer closes it.
        std::thread::spawn(move || {
            serve_connections(l, "test", limits, |_peer, mut s| {
                let mut b = [0u8; 1];
                let _ = s.read(&mut b);
            })
        });
        let held: Vec<UnixStream> = (0..2)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mut third = UnixStream::connect(&path).unwrap();
        third
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(third.read(&mut b).unwrap(), 0, "closed by the server");
        drop(held);
        std::thread::sleep(Duration::from_millis(200));
        let mut fourth = UnixStream::connect(&path).unwrap();
        fourth
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert!(
            fourth.read(&mut b).is_err(),
            "served again (held open, times out)"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
