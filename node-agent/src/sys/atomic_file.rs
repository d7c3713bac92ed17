//! Durable JSON files: write to a temporary file, fsync, rename over the target, fsync the directory.
//! A crash leaves either the old or the new file, never a torn one.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("encoding {what}: {source}")]
    Encode {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("appending to the registry journal: {0}")]
    Journal(std::io::Error),
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is corrupt: {source}")]
    Corrupt {
        path: String,
        source: serde_json::Error,
    },
}

impl PersistError {
    /// The OS error behind it (ENOSPC, EROFS, EIO, ...), when there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            PersistError::Write { source, .. }
            | PersistError::Read { source, .. }
            | PersistError::Journal(source) => source.raw_os_error(),
            PersistError::Encode { .. } | PersistError::Corrupt { .. } => None,
        }
    }
}

pub fn write_atomic<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), PersistError> {
    let body = serde_json::to_vec(value).map_err(|e| PersistError::Write {
        path: path.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    write_atomic_bytes(path, &body)
}

pub fn write_atomic_bytes(path: &Path, body: &[u8]) -> Result<(), PersistError> {
    let err = |source| PersistError::Write {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(body)?;
            f.sync_all()
        });
    if let Err(e) = written {
        // A half-written temporary file would hold the space a full disk needs for the next try.
        let _ = fs::remove_file(&tmp);
        return Err(err(e));
    }
    fs::rename(&tmp, path).map_err(err)?;
    if let Some(dir) = path.parent() {
        File::open(dir).and_then(|d| d.sync_all()).map_err(err)?;
    }
    Ok(())
}

/// `Ok(None)` when the file does not exist; an error (never a silent reset) when it is corrupt.
pub fn read<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, PersistError> {
    match fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|source| PersistError::Corrupt {
                path: path.display().to_string(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(PersistError::Read {
            path: path.display().to_string(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corrupt_detected() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.json");
        assert_eq!(read::<Vec<u32>>(&p).unwrap(), None);
        write_atomic(&p, &vec![1u32, 2]).unwrap();
        assert_eq!(read::<Vec<u32>>(&p).unwrap(), Some(vec![1, 2]));
        assert!(!p.with_extension("tmp").exists());
        fs::write(&p, b"{not json").unwrap();
        assert!(matches!(
            read::<Vec<u32>>(&p),
            Err(PersistError::Corrupt { .. })
        ));
    }
}
