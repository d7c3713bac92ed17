//! Process facts from /proc, used for ownership checks, liveness and pid -> job mapping.

use std::fs;

/// A process's resident memory in bytes (0 when it is gone).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib << 10)
}

/// Start time in clock ticks (field 22 of /proc/PID/stat).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces and parens: split after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

pub fn parent(pid: u32) -> Option<u32> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Real uid of a process.
pub fn uid(pid: u32) -> Option<u32> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub fn alive(pid: u32, start: Option<u64>) -> bool {
    match (start_ticks(pid), start) {
        (Some(now), Some(then)) => now == then,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// The descendants of `pid` (children, theirs, ...), read from each thread's `children` list:
/// a few reads, not a scan of /proc. `None` where the kernel has no such list.
pub fn descendants(pid: u32) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let tasks = fs::read_dir(format!("/proc/{p}/task")).ok()?;
        for t in tasks.flatten() {
            let Ok(list) = fs::read_to_string(t.path().join("children")) else {
                // The process may have exited meanwhile; a missing list on a live one means the
                // kernel has none.
                if fs::metadata(format!("/proc/{p}")).is_ok() && p == pid {
                    return None;
                }
                continue;
            };
            for c in list
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !out.contains(&c) && out.len() < 4096 {
                    out.push(c);
                    todo.push(c);
                }
            }
        }
    }
    Some(out)
}

/// Every live process that is one of `roots` or has one among its ancestors (one scan of
/// /proc for all of them).
pub fn under(roots: &[u32]) -> Vec<u32> {
    if roots.is_empty() {
        return Vec::new();
    }
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| ancestry(*p).iter().any(|a| roots.contains(a)))
        .collect()
}

/// Live processes whose program (the name of /proc/PID/exe) is one of `programs` and whose
/// environment has `key=value`: the MPS daemons of one pipe directory, found without asking them
/// (a hung control daemon answers nothing).
pub fn by_program_and_env(programs: &[&str], key: &str, value: &std::ffi::OsStr) -> Vec<u32> {
    use std::os::unix::ffi::OsStrExt;
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut want = key.as_bytes().to_vec();
    want.push(b'=');
    want.extend_from_slice(value.as_bytes());
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|exe| {
                exe.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| programs.contains(&n))
            })
        })
        .filter(|p| {
            fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_slice()))
        })
        .collect()
}

/// Whether the process holds an NVIDIA device open (it is a CUDA process: an MPS client).
pub fn uses_gpu(pid: u32) -> bool {
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    rd.flatten().any(|e| {
        fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/dev/nvidia"))
    })
}

/// `pid` and its ancestors, nearest first (bounded, so a loop in a bad /proc cannot hang us).
pub fn ancestry(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut cur = pid;
    for _ in 0..64 {
        match parent(cur) {
            Some(p) if p > 1 && p != cur => {
                out.push(p);
                cur = p;
            }
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_are_found_without_a_scan() {
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let pid = sh.id();
        let mut found = Vec::new();
        // Up to 10 s for the shell to start both (a loaded 2-CPU CI machine is slow to fork).
        for _ in 0..1000 {
            found = descendants(pid).expect("children lists");
            if found.len() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(found.len(), 2, "{found:?}");
        let mut scanned = under(&[pid]);
        scanned.retain(|p| *p != pid);
        scanned.sort_unstable();
        found.sort_unstable();
        assert_eq!(found, scanned);
        for p in found {
            // SAFETY: kill(2) on this test's own grandchildren.
            unsafe { libc::kill(p as i32, libc::SIGKILL) };
        }
        let _ = sh.kill();
        let _ = sh.wait();
    }

    #[test]
    fn procfs_self() {
        let me = std::process::id();
        let st = start_ticks(me);
        assert!(st.is_some());
        assert!(alive(me, st));
        assert!(!alive(me, st.map(|s| s + 1)));
        // SAFETY: getuid has no preconditions.
        assert_eq!(uid(me), Some(unsafe { libc::getuid() }));
        assert!(ancestry(me).len() >= 2);
    }
}
