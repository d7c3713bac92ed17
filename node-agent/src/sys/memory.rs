//! How the agent's heap gives memory back. The agent lives for months, starts short-lived
//! threads all the time (each domain's MPS log tails, connections) and builds large short-lived
//! buffers (the state file's JSON, megabytes on a busy node). glibc's malloc gives each thread an
//! arena, up to eight per core, and keeps freed pages in them: in the soak (issue 24) the agent's
//! anonymous memory rose by ~1 MiB a minute, one or two MiB in each of a dozen arenas, and on a
//! 128-core node there could be a thousand arenas. So: few arenas, and free pages returned after
//! the large buffers are gone.

use std::time::{Duration, Instant};

/// Arenas shared by all threads: the agent's threads seldom allocate at the same moment.
const ARENAS: i32 = 2;

/// Blocks from this size on are mapped on their own and unmapped when freed. Setting it also
/// stops glibc from raising it after each large free (up to 32 MiB), which is what kept the freed
/// state buffers in the arenas.
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// How often at most free pages are handed back (each time walks every arena, ~a millisecond).
pub const RELEASE_EVERY: Duration = Duration::from_secs(10);

/// Caps malloc's arenas and fixes its mmap threshold; call before any thread is started.
pub fn configure() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets malloc parameters; no pointer is passed, and no other thread
    // runs yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, ARENAS);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Hands free heap pages in every arena back to the kernel (the live data stays).
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes each arena's own lock while it works; no pointer is passed.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Releases free memory at most once per [`RELEASE_EVERY`].
#[derive(Debug)]
pub struct Releaser {
    last: Instant,
}

impl Default for Releaser {
    fn default() -> Self {
        Releaser {
            last: Instant::now(),
        }
    }
}

impl Releaser {
    pub fn tick(&mut self) {
        if self.last.elapsed() >= RELEASE_EVERY {
            self.last = Instant::now();
            release_free_memory();
        }
    }
}
