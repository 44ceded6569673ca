//! The wire: whole frames on blocking sockets under deadlines, the typed errors for I/O
//! that timed out, closed or ran out of resources, the messages (format in the
//! `bootstrap` module docs), and how a failing rank tells its peers why.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use super::error::{io_error, BootstrapError, Result};
use super::host::{truncate_utf8, HostId};
use super::mac::{constant_time_eq, Keys, Label};
use super::{
    FAREWELL, HEADER_BYTES, HELLO_BYTES, KIND_DATA, KIND_ERROR, KIND_HELLO, KIND_PROOF, MAC_BYTES,
    MAGIC, MAX_ERROR_MESSAGE_BYTES, MAX_FRAME_BYTES, MIN_WAIT, NONCE_BYTES, PROOF_FIXED_BYTES,
    PROTOCOL_VERSION, SECRET_BYTES,
};

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
    (len <= MAX_FRAME_BYTES)
        .then_some(())
        .ok_or_else(|| too_large(len))
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

/// Reads little-endian fields off a frame body, front to back.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn text_u16(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

/// Rank r's hello: the magic, the protocol version and its nonce; no secret.
pub(super) fn encode_hello(leaf_nonce: &[u8; NONCE_BYTES]) -> Vec<u8> {
    let b = [&MAGIC[..], &PROTOCOL_VERSION.to_le_bytes(), leaf_nonce].concat();
    debug_assert_eq!(b.len(), HELLO_BYTES);
    frame(KIND_HELLO, &b)
}

/// What rank 0 makes of a hello.
pub(super) enum HelloVerdict {
    /// Not a peercomm hello: drop quietly.
    Stray,
    /// A hello of this version: challenge it.
    Challenge([u8; NONCE_BYTES]),
    /// A peercomm hello of another version that cannot be checked: drop quietly, count.
    OtherVersion,
    /// A version-1 hello carrying this id's secret: a rank of an older peercomm.
    OlderRank(u16),
}

/// Reads a hello body. The magic and version sit at the front in every protocol version;
/// a version-1 hello carried the secret itself next, so a rank of that version with the
/// right secret is still told apart from a stranger.
pub(super) fn decode_hello(body: &[u8], secret: &[u8; SECRET_BYTES]) -> HelloVerdict {
    let mut f = Fields(body);
    let Some(version) = f.take(4).filter(|m| *m == MAGIC).and_then(|_| f.u16()) else {
        return HelloVerdict::Stray;
    };
    if version == PROTOCOL_VERSION {
        return match <[u8; NONCE_BYTES]>::try_from(f.0) {
            Ok(n) => HelloVerdict::Challenge(n),
            Err(_) => HelloVerdict::Stray,
        };
    }
    let theirs = f.take(SECRET_BYTES).filter(|_| version == 1);
    match theirs.is_some_and(|s| constant_time_eq(s, secret)) {
        true => HelloVerdict::OlderRank(version),
        false => HelloVerdict::OtherVersion,
    }
}

/// What rank r announces once rank 0 has proven itself.
pub(super) struct Hello {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) host: HostId,
}

/// Rank r's proof: its MAC over both nonces and its announcement, then the announcement.
pub(super) fn encode_proof(keys: &Keys, rank: usize, world: usize, host: &HostId) -> Vec<u8> {
    let mut a = Vec::with_capacity(PROOF_FIXED_BYTES - MAC_BYTES + host.0.len());
    a.extend_from_slice(&(rank as u32).to_le_bytes());
    a.extend_from_slice(&(world as u32).to_le_bytes());
    put_text(&mut a, host);
    keys.signed(Label::Rank, KIND_PROOF, &a)
}

/// What rank 0 makes of a proof.
pub(super) enum ProofVerdict {
    /// Not made with this id's secret (or not a proof): drop quietly, count it.
    Unproven,
    /// Proven, but the announcement cannot be read.
    Malformed(String),
    Ok(Hello),
}

pub(super) fn decode_proof(body: &[u8], keys: &Keys) -> ProofVerdict {
    let proven = keys.open(Label::Rank, body);
    let Some(mut f) = proven
        .filter(|_| body.len() >= PROOF_FIXED_BYTES)
        .map(Fields)
    else {
        return ProofVerdict::Unproven;
    };
    let hello = (|| {
        let (rank, world) = (f.u32()? as usize, f.u32()? as usize);
        let host = HostId(f.text_u16()?);
        f.0.is_empty().then_some(Hello { rank, world, host })
    })();
    match hello {
        Some(h) => ProofVerdict::Ok(h),
        None => ProofVerdict::Malformed("its announcement is truncated or too long".into()),
    }
}

/// The list of hosts a welcome carries (the same for every rank), signed for each rank
/// with [`Keys::signed`].
pub(super) fn encode_welcome(hosts: &[HostId]) -> Vec<u8> {
    let mut b = (hosts.len() as u32).to_le_bytes().to_vec();
    hosts.iter().for_each(|h| put_text(&mut b, h));
    b
}

fn put_text(b: &mut Vec<u8>, host: &HostId) {
    b.extend_from_slice(&(host.0.len() as u16).to_le_bytes());
    b.extend_from_slice(host.0.as_bytes());
}

pub(super) fn decode_welcome(body: &[u8], world: usize, keys: &Keys) -> Result<Vec<HostId>> {
    let Some(list) = keys.open(Label::Welcome, body) else {
        return Err(BootstrapError::Protocol {
            detail: "rank 0's welcome does not carry a valid MAC (it was altered in transit)"
                .into(),
        });
    };
    let mut f = Fields(list);
    let hosts = (|| {
        let n = f.u32().filter(|&n| n as usize == world)?;
        let hosts = (0..n).map(|_| f.text_u16().map(HostId));
        let hosts = hosts.collect::<Option<Vec<_>>>()?;
        f.0.is_empty().then_some(hosts)
    })();
    hosts.ok_or_else(|| BootstrapError::Protocol {
        detail: format!("rank 0's welcome does not list {world} host ids"),
    })
}

fn encode_error(origin: usize, message: &str) -> Vec<u8> {
    let mut m = message.to_string();
    truncate_utf8(&mut m, MAX_ERROR_MESSAGE_BYTES);
    frame(
        KIND_ERROR,
        &[&(origin as u32).to_le_bytes()[..], m.as_bytes()].concat(),
    )
}

pub(super) fn decode_error(from: usize, body: &[u8]) -> BootstrapError {
    let mut f = Fields(body);
    let (rank, message) = match f.u32() {
        Some(origin) => (origin as usize, String::from_utf8_lossy(f.0).into_owned()),
        None => (from, "(an unreadable error frame)".into()),
    };
    BootstrapError::PeerFailed { rank, message }
}

/// A data frame's body, or the error the frame carries instead.
pub(super) fn expect_data(from: usize, (kind, body): (u8, Vec<u8>)) -> Result<Vec<u8>> {
    match kind {
        KIND_DATA => Ok(body),
        KIND_ERROR => Err(decode_error(from, &body)),
        k => Err(BootstrapError::Protocol {
            detail: format!("rank {from} sent a frame of kind {k} where a data frame belongs"),
        }),
    }
}

/// When writing to rank 0 failed because it closed the connection, rank 0 may have said
/// why first: returns the error frame waiting to be read, if any, else `err`.
pub(super) fn explain_closed(s: &mut TcpStream, err: BootstrapError) -> BootstrapError {
    if !matches!(err, BootstrapError::ConnectionClosed { .. }) {
        return err;
    }
    match read_frame(s, deadline_after(Duration::from_millis(50))) {
        Ok((KIND_ERROR, body)) => decode_error(0, &body),
        _ => err,
    }
}

/// Tells each peer why this rank fails (an error frame), then half-closes and reads until
/// the peer closes or [`FAREWELL`] passes (unread bytes would turn the close into a reset
/// that can destroy the error frame).
pub(super) fn farewell(mut streams: Vec<TcpStream>, me: usize, err: &BootstrapError) {
    let (origin, message) = match err {
        BootstrapError::PeerFailed { rank, message } => (*rank, message.clone()),
        e => (me, e.to_string()),
    };
    let f = encode_error(origin, &message);
    let deadline = deadline_after(FAREWELL);
    for s in &mut streams {
        let _ = s.set_nonblocking(false);
        let _ = write_full(s, &f, deadline);
        let _ = s.shutdown(Shutdown::Write);
        let _ = s.set_nonblocking(true);
    }
    let mut scratch = vec![0u8; 64 << 10];
    while !streams.is_empty() && Instant::now() < deadline {
        streams.retain_mut(|s| match s.read(&mut scratch) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted,
        });
        if !streams.is_empty() {
            std::thread::sleep(MIN_WAIT);
        }
    }
}
