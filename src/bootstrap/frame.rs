//! Whole frames on blocking sockets under deadlines, and the typed errors for I/O that
//! timed out, closed or ran out of resources.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::error::{io_error, BootstrapError, Result};
use super::{HEADER_BYTES, MAX_FRAME_BYTES, MIN_WAIT};

pub(super) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

pub(super) fn is_timeout(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(e.kind(), TimedOut | WouldBlock)
}

/// Errors that say the process or the system is out of descriptors, buffers or memory
/// for now (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`): worth waiting out, not fatal.
pub(super) fn is_resource_exhausted(e: &io::Error) -> bool {
    if e.kind() == io::ErrorKind::OutOfMemory {
        return true;
    }
    let Some(code) = e.raw_os_error() else {
        return false;
    };
    #[cfg(target_os = "linux")]
    let codes = [
        rustix::io::Errno::MFILE,
        rustix::io::Errno::NFILE,
        rustix::io::Errno::NOBUFS,
        rustix::io::Errno::NOMEM,
    ]
    .map(|e| e.raw_os_error());
    // EMFILE, ENFILE, ENOBUFS and ENOMEM of the BSDs and macOS.
    #[cfg(all(unix, not(target_os = "linux")))]
    let codes = [24, 23, 55, 12];
    // WSAEMFILE, WSAENOBUFS.
    #[cfg(windows)]
    let codes = [10024, 10055];
    #[cfg(not(any(unix, windows)))]
    let codes: [i32; 0] = [];
    codes.contains(&code)
}

pub(super) fn is_closed(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
    )
}

/// Fills `buf` from a blocking stream by `deadline` (`TimedOut` after it,
/// `UnexpectedEof` if the peer closes first).
fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left.max(MIN_WAIT)))?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a blocking stream by `deadline`.
pub(super) fn write_full(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_write_timeout(Some(left.max(MIN_WAIT)))?;
        match s.write(&buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn header(kind: u8, len: usize) -> [u8; HEADER_BYTES] {
    let len = u32::try_from(len)
        .expect("frame length checked")
        .to_le_bytes();
    [kind, len[0], len[1], len[2], len[3]]
}

pub(super) fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    [&header(kind, body.len())[..], body].concat()
}

pub(super) fn write_frame(
    s: &mut TcpStream,
    kind: u8,
    body: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    if body.len() <= 64 << 10 {
        write_full(s, &frame(kind, body), deadline)
    } else {
        write_full(s, &header(kind, body.len()), deadline)?;
        write_full(s, body, deadline)
    }
}

pub(super) enum RecvError {
    Io(io::Error),
    TooLarge(usize),
}

pub(super) fn read_frame(s: &mut TcpStream, deadline: Instant) -> Result<(u8, Vec<u8>), RecvError> {
    let mut h = [0u8; HEADER_BYTES];
    read_full(s, &mut h, deadline).map_err(RecvError::Io)?;
    let len = u32::from_le_bytes(h[1..].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(RecvError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    read_full(s, &mut body, deadline).map_err(RecvError::Io)?;
    Ok((h[0], body))
}

pub(super) fn check_frame_len(len: usize) -> Result<()> {
    match len > MAX_FRAME_BYTES {
        true => Err(too_large(len)),
        false => Ok(()),
    }
}

fn too_large(len: usize) -> BootstrapError {
    let max = MAX_FRAME_BYTES;
    BootstrapError::FrameTooLarge { len, max }
}

/// How a timeout's hint says to raise the timeout, naming the setting of either front
/// door.
pub(super) const RAISE_TIMEOUT: &str = "raise CommConfig::bootstrap_timeout (with \
                                        TcpBootstrap: its timeout argument, or \
                                        TcpBootstrap::set_timeout)";

/// Maps a failure to hear from (or talk to) rank `peer` to a typed error.
pub(super) fn recv_error(
    peer: usize,
    step: &str,
    e: RecvError,
    timeout: Duration,
    timeout_hint: &str,
    closed_hint: &str,
) -> BootstrapError {
    match e {
        RecvError::TooLarge(len) => too_large(len),
        RecvError::Io(e) if is_timeout(&e) => BootstrapError::Timeout {
            step: step.into(),
            waiting_for: vec![peer],
            after: timeout,
            hint: timeout_hint.into(),
        },
        RecvError::Io(e) if is_closed(&e) => BootstrapError::ConnectionClosed {
            rank: peer,
            step: step.into(),
            hint: closed_hint.into(),
        },
        RecvError::Io(e) => io_error(format!("{step} (rank {peer})"), e),
    }
}
