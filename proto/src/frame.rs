//! Length-prefixed JSON frames.

use std::io::{self, Read, Write};

/// Largest frame body accepted, in bytes. Larger frames are refused before reading the body.
pub const MAX_FRAME: usize = 64 * 1024;

#[derive(Debug)]
pub enum FrameError {
    Io(io::Error),
    /// Peer closed the connection before a full frame.
    Closed,
    TooLarge(usize),
    Json(serde_json::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "i/o error: {e}"),
            FrameError::Closed => f.write_str("connection closed mid-frame"),
            FrameError::TooLarge(n) => write!(f, "frame of {n} bytes exceeds limit of {MAX_FRAME}"),
            FrameError::Json(e) => write!(f, "malformed message: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(e)
        }
    }
}

/// Reads one frame's raw body.
pub fn read_body(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Ok(body)
}

pub fn read_frame<T: serde::de::DeserializeOwned>(r: &mut impl Read) -> Result<T, FrameError> {
    let body = read_body(r)?;
    serde_json::from_slice(&body).map_err(FrameError::Json)
}

pub fn write_frame<T: serde::Serialize>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    let body = serde_json::to_vec(msg).map_err(FrameError::Json)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut buf = Vec::with_capacity(body.len() + 4);
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_length_refused_without_reading() {
        let mut data = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
        data.extend_from_slice(b"{}");
        let err = read_body(&mut data.as_slice()).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge(_)));
    }

    #[test]
    fn truncated_frame_is_closed() {
        let mut data = 10u32.to_be_bytes().to_vec();
        data.extend_from_slice(b"{\"a\"");
        assert!(matches!(
            read_body(&mut data.as_slice()).unwrap_err(),
            FrameError::Closed
        ));
    }

    #[test]
    fn roundtrip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &vec![1u32, 2, 3]).unwrap();
        let v: Vec<u32> = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(v, vec![1, 2, 3]);
    }
}
