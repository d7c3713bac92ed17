//! A domain's pipe and log directories, made fresh for every daemon start.
//!
//! The MPS control daemon runs as root and opens files in both directories by name, following
//! symlinks (measured on an H100: with `control.log` in a user-owned log directory replaced by a
//! symlink to a root-owned file, the daemon appended its log to that file). So:
//! - nothing a previous tenant left is reused: both directories are removed and made again before
//!   a daemon starts (an answering daemon is adopted instead and its directories left as they are,
//!   but its log directory is taken back from a user);
//! - the log directory is root's (0755): no user can put a name there. The server of an owned
//!   domain runs as its tenant and appends to `server.log`, so that one file is made here, empty,
//!   and given to the tenant; the tenant can write lines into it, never make it point elsewhere;
//! - the pipe directory of an owned domain is its tenant's (0700): the tenant's clients and server
//!   make their pipes there, and no other user can reach the server.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// How a domain's daemon came up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// Started now, in fresh directories (its log tails start anew).
    Fresh,
    /// One was already answering there (an agent restart): kept with its directories.
    Adopted,
}

/// The server's log in an owned domain's (root-owned) log directory, writable by its tenant.
pub const SERVER_LOG: &str = "server.log";

/// Removes whatever is at `p`: a directory tree (symlinks inside are removed, never followed), or
/// a file or symlink left where a directory belongs.
fn remove(p: &Path) -> io::Result<()> {
    match fs::symlink_metadata(p) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
    }
}

/// Makes `p` anew: removed, created with `mode` (the parents as root's, 0755).
fn make(p: &Path, mode: u32) -> io::Result<()> {
    remove(p)?;
    if let Some(parent) = p.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    fs::DirBuilder::new().mode(mode).create(p)?;
    // The umask may have taken bits away; the mode is what is meant.
    fs::set_permissions(p, fs::Permissions::from_mode(mode))
}

/// Fresh pipe and log directories for a daemon about to start (none answers there).
pub fn fresh(pipe_dir: &Path, log_dir: &Path, owner_uid: Option<u32>) -> io::Result<()> {
    make(log_dir, 0o755)?;
    match owner_uid {
        None => make(pipe_dir, 0o755),
        Some(uid) => {
            make(pipe_dir, 0o700)?;
            std::os::unix::fs::chown(pipe_dir, Some(uid), None)?;
            tenant_server_log(log_dir, uid)
        }
    }
}

/// The empty `server.log` of an owned domain, its tenant's. Made with O_EXCL in a directory
/// only root can write: there is nothing to follow.
fn tenant_server_log(log_dir: &Path, uid: u32) -> io::Result<()> {
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(log_dir.join(SERVER_LOG))?;
    std::os::unix::fs::fchown(&f, Some(uid), None)
}

/// For a daemon that is adopted (it answers): its log directory is made root's again, in case an
/// agent before this one gave it to the tenant. What is in it stays (the daemon has its files
/// open); a symlink planted there earlier is removed, except the files the daemon writes.
pub fn harden_adopted(log_dir: &Path) -> io::Result<()> {
    let m = fs::symlink_metadata(log_dir)?;
    if !m.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            log_dir.display()
        )));
    }
    std::os::unix::fs::chown(log_dir, Some(0), Some(0))?;
    fs::set_permissions(log_dir, fs::Permissions::from_mode(0o755))?;
    for e in fs::read_dir(log_dir)?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_symlink()) {
            let _ = fs::remove_file(e.path());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_planted_symlink_in_a_domains_log_directory_is_gone_before_its_daemon_starts() {
        let t = tempfile::tempdir().unwrap();
        let (pipe, log) = (t.path().join("d1/pipe"), t.path().join("d1/log"));
        let victim = t.path().join("root-owned-file");
        fs::write(&victim, "precious\n").unwrap();
        fs::create_dir_all(&log).unwrap();
        fs::create_dir_all(&pipe).unwrap();
        std::os::unix::fs::symlink(&victim, log.join("control.log")).unwrap();
        std::os::unix::fs::symlink(&victim, pipe.join("control_lock")).unwrap();
        fs::write(pipe.join("left-by-the-last-tenant"), "x").unwrap();
        let uid = 65534;
        fresh(&pipe, &log, Some(uid)).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious\n");
        assert_eq!(fs::read_dir(&pipe).unwrap().count(), 0, "pipe dir is empty");
        let names: Vec<_> = fs::read_dir(&log)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(SERVER_LOG)]);
        let lm = fs::metadata(&log).unwrap();
        assert_eq!(lm.mode() & 0o7777, 0o755);
        if crate::sys::is_root() {
            assert_eq!(lm.uid(), 0, "the log directory is root's");
            assert_eq!(fs::metadata(&pipe).unwrap().uid(), uid);
            assert_eq!(fs::metadata(log.join(SERVER_LOG)).unwrap().uid(), uid);
        }
        assert_eq!(fs::metadata(&pipe).unwrap().mode() & 0o7777, 0o700);
        // Writing the daemon's control.log now creates a plain file.
        fs::write(log.join("control.log"), "line\n").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious\n");
    }

    #[test]
    fn a_file_or_symlink_where_a_domain_directory_belongs_is_replaced() {
        let t = tempfile::tempdir().unwrap();
        let elsewhere = t.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        fs::write(elsewhere.join("keep"), "k").unwrap();
        let (pipe, log) = (t.path().join("pipe"), t.path().join("log"));
        std::os::unix::fs::symlink(&elsewhere, &log).unwrap();
        fs::write(&pipe, "not a dir").unwrap();
        fresh(&pipe, &log, None).unwrap();
        assert!(fs::symlink_metadata(&log).unwrap().is_dir());
        assert!(fs::symlink_metadata(&pipe).unwrap().is_dir());
        assert!(
            elsewhere.join("keep").exists(),
            "the symlink's target is untouched"
        );
    }

    #[test]
    fn an_adopted_daemons_log_directory_loses_planted_symlinks() {
        let t = tempfile::tempdir().unwrap();
        let log = t.path().join("log");
        fs::create_dir(&log).unwrap();
        fs::write(log.join("control.log"), "kept\n").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", log.join("server.log")).unwrap();
        if !crate::sys::is_root() {
            return; // chown to root needs root
        }
        harden_adopted(&log).unwrap();
        assert!(!log.join("server.log").exists());
        assert_eq!(
            fs::read_to_string(log.join("control.log")).unwrap(),
            "kept\n"
        );
        assert_eq!(fs::metadata(&log).unwrap().uid(), 0);
    }
}
