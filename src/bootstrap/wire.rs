//! The wire: deadlines on blocking sockets, frames, the encoding of hellos, challenges,
//! proofs, welcomes and error frames, and the MACs of the challenge-response (see the
//! module docs of `bootstrap` for the format).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::error::{io_error, BootstrapError, Result};
use super::host::{truncate_utf8, HostId};
use super::{
    CHALLENGE_BYTES, FAREWELL, HEADER_BYTES, HELLO_BYTES, KIND_CHALLENGE, KIND_DATA, KIND_ERROR,
    KIND_HELLO, KIND_PROOF, KIND_WELCOME, MAC_BYTES, MAGIC, MAX_ERROR_MESSAGE_BYTES,
    MAX_FRAME_BYTES, MIN_WAIT, NONCE_BYTES, PROOF_FIXED_BYTES, PROTOCOL_VERSION, SECRET_BYTES,
};

pub(super) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
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
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
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
    let mut h = [0u8; HEADER_BYTES];
    h[0] = kind;
    h[1..].copy_from_slice(
        &u32::try_from(len)
            .expect("frame length checked")
            .to_le_bytes(),
    );
    h
}

pub(super) fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_BYTES + body.len());
    f.extend_from_slice(&header(kind, body.len()));
    f.extend_from_slice(body);
    f
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
    if len > MAX_FRAME_BYTES {
        return Err(BootstrapError::FrameTooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    Ok(())
}

/// Reads little-endian fields off a frame body, front to back.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn text_u16(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

/// A fresh random nonce from the OS.
pub(super) fn nonce() -> Result<[u8; NONCE_BYTES]> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| BootstrapError::Io {
        step: "drawing a handshake nonce from the OS".into(),
        kind: io::ErrorKind::Other,
        detail: e.to_string(),
    })?;
    Ok(n)
}

/// Both sides' nonces of one handshake: every MAC covers both.
#[derive(Clone, Copy)]
pub(super) struct Nonces {
    /// Drawn by rank r > 0, sent in its hello.
    pub(super) leaf: [u8; NONCE_BYTES],
    /// Drawn by rank 0, sent in its challenge.
    pub(super) root: [u8; NONCE_BYTES],
}

/// What each MAC proves; distinct labels, so that no MAC serves as another.
#[derive(Clone, Copy)]
enum Label {
    /// Rank 0's answer to a hello (in the challenge).
    Root,
    /// Rank r's answer to the challenge (in the proof), over its announcement.
    Rank,
    /// Rank 0's welcome, over its list of hosts.
    Welcome,
}

impl Label {
    fn bytes(self) -> &'static [u8] {
        match self {
            Label::Root => b"peercomm bootstrap v2: rank 0 knows the secret",
            Label::Rank => b"peercomm bootstrap v2: a rank knows the secret",
            Label::Welcome => b"peercomm bootstrap v2: rank 0 welcomes",
        }
    }
}

/// HMAC-SHA-256 keyed by the id's secret over the label, both nonces, then `tail`.
fn mac(secret: &[u8; SECRET_BYTES], label: Label, n: &Nonces, tail: &[u8]) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
    m.update(label.bytes());
    m.update(&n.leaf);
    m.update(&n.root);
    m.update(tail);
    m
}

fn sign(secret: &[u8; SECRET_BYTES], label: Label, n: &Nonces, tail: &[u8]) -> [u8; MAC_BYTES] {
    mac(secret, label, n, tail).finalize().into_bytes().into()
}

/// Checks `tag` in constant time.
fn verify(secret: &[u8; SECRET_BYTES], label: Label, n: &Nonces, tail: &[u8], tag: &[u8]) -> bool {
    mac(secret, label, n, tail).verify_slice(tag).is_ok()
}

/// Rank r's hello: the magic, the protocol version and its nonce; no secret.
pub(super) fn encode_hello(leaf_nonce: &[u8; NONCE_BYTES]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HELLO_BYTES);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b.extend_from_slice(leaf_nonce);
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

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads a hello body. The magic and version sit at the front in every protocol version;
/// a version-1 hello carried the secret itself next, so a rank of that version with the
/// right secret is still told apart from a stranger.
pub(super) fn decode_hello(body: &[u8], secret: &[u8; SECRET_BYTES]) -> HelloVerdict {
    let mut f = Fields(body);
    if f.take(4) != Some(&MAGIC[..]) {
        return HelloVerdict::Stray;
    }
    let Some(version) = f.u16() else {
        return HelloVerdict::Stray;
    };
    if version == PROTOCOL_VERSION {
        return match <[u8; NONCE_BYTES]>::try_from(f.0) {
            Ok(n) => HelloVerdict::Challenge(n),
            Err(_) => HelloVerdict::Stray,
        };
    }
    if version == 1
        && f.take(SECRET_BYTES)
            .is_some_and(|s| constant_time_eq(s, secret))
    {
        return HelloVerdict::OlderRank(version);
    }
    HelloVerdict::OtherVersion
}

/// Rank 0's challenge: its nonce and its proof of the secret over both nonces.
pub(super) fn encode_challenge(secret: &[u8; SECRET_BYTES], n: &Nonces) -> Vec<u8> {
    let mut b = Vec::with_capacity(CHALLENGE_BYTES);
    b.extend_from_slice(&n.root);
    b.extend_from_slice(&sign(secret, Label::Root, n, &[]));
    frame(KIND_CHALLENGE, &b)
}

/// On rank r: rank 0's nonce from a challenge body, if rank 0's proof in it holds.
pub(super) fn check_challenge(
    body: &[u8],
    secret: &[u8; SECRET_BYTES],
    leaf_nonce: &[u8; NONCE_BYTES],
) -> std::result::Result<Nonces, &'static str> {
    if body.len() != CHALLENGE_BYTES {
        return Err("its challenge has the wrong length");
    }
    let (root, tag) = body.split_at(NONCE_BYTES);
    let n = Nonces {
        leaf: *leaf_nonce,
        root: root.try_into().expect("nonce length"),
    };
    if verify(secret, Label::Root, &n, &[], tag) {
        Ok(n)
    } else {
        Err("its answer to this rank's nonce is not made with this id's secret")
    }
}

/// What rank r announces once rank 0 has proven itself.
pub(super) struct Hello {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) checksum: u64,
    pub(super) host: HostId,
}

/// Rank r's proof: its MAC over both nonces and its announcement, then the announcement.
pub(super) fn encode_proof(
    secret: &[u8; SECRET_BYTES],
    n: &Nonces,
    rank: usize,
    world: usize,
    checksum: u64,
    host: &HostId,
) -> Vec<u8> {
    let mut a = Vec::with_capacity(PROOF_FIXED_BYTES - MAC_BYTES + host.0.len());
    a.extend_from_slice(&(rank as u32).to_le_bytes());
    a.extend_from_slice(&(world as u32).to_le_bytes());
    a.extend_from_slice(&checksum.to_le_bytes());
    a.extend_from_slice(&(host.0.len() as u16).to_le_bytes());
    a.extend_from_slice(host.0.as_bytes());
    let mut b = Vec::with_capacity(MAC_BYTES + a.len());
    b.extend_from_slice(&sign(secret, Label::Rank, n, &a));
    b.extend_from_slice(&a);
    frame(KIND_PROOF, &b)
}

/// What rank 0 makes of a proof.
pub(super) enum ProofVerdict {
    /// Not made with this id's secret (or not a proof): drop quietly, count it.
    Unproven,
    /// Proven, but the announcement cannot be read.
    Malformed(String),
    Ok(Hello),
}

pub(super) fn decode_proof(body: &[u8], secret: &[u8; SECRET_BYTES], n: &Nonces) -> ProofVerdict {
    if body.len() < PROOF_FIXED_BYTES {
        return ProofVerdict::Unproven;
    }
    let (tag, announcement) = body.split_at(MAC_BYTES);
    if !verify(secret, Label::Rank, n, announcement, tag) {
        return ProofVerdict::Unproven;
    }
    let mut f = Fields(announcement);
    let hello = (|| {
        let rank = f.u32()? as usize;
        let world = f.u32()? as usize;
        let checksum = f.u64()?;
        let host = HostId(f.text_u16()?);
        f.0.is_empty().then_some(Hello {
            rank,
            world,
            checksum,
            host,
        })
    })();
    match hello {
        Some(h) => ProofVerdict::Ok(h),
        None => ProofVerdict::Malformed("its announcement is truncated or too long".into()),
    }
}

/// The list of hosts a welcome carries (the same for every rank).
pub(super) fn encode_welcome(hosts: &[HostId]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(hosts.len() as u32).to_le_bytes());
    for h in hosts {
        b.extend_from_slice(&(h.0.len() as u16).to_le_bytes());
        b.extend_from_slice(h.0.as_bytes());
    }
    b
}

/// One rank's welcome frame: a MAC over that rank's nonces and the list, then the list.
pub(super) fn welcome_frame(secret: &[u8; SECRET_BYTES], n: &Nonces, hosts: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(MAC_BYTES + hosts.len());
    b.extend_from_slice(&sign(secret, Label::Welcome, n, hosts));
    b.extend_from_slice(hosts);
    frame(KIND_WELCOME, &b)
}

pub(super) fn decode_welcome(
    body: &[u8],
    world: usize,
    secret: &[u8; SECRET_BYTES],
    n: &Nonces,
) -> Result<Vec<HostId>> {
    if body.len() < MAC_BYTES
        || !verify(
            secret,
            Label::Welcome,
            n,
            &body[MAC_BYTES..],
            &body[..MAC_BYTES],
        )
    {
        return Err(BootstrapError::Protocol {
            detail: "rank 0's welcome does not carry a valid MAC (it was altered in transit)"
                .into(),
        });
    }
    let mut f = Fields(&body[MAC_BYTES..]);
    let hosts = (|| {
        let n = f.u32()? as usize;
        if n != world {
            return None;
        }
        let hosts = (0..n)
            .map(|_| f.text_u16().map(HostId))
            .collect::<Option<Vec<_>>>()?;
        f.0.is_empty().then_some(hosts)
    })();
    hosts.ok_or_else(|| BootstrapError::Protocol {
        detail: format!("rank 0's welcome does not list {world} host ids"),
    })
}

fn encode_error(origin: usize, message: &str) -> Vec<u8> {
    let mut m = message.to_string();
    truncate_utf8(&mut m, MAX_ERROR_MESSAGE_BYTES);
    let mut b = Vec::with_capacity(4 + m.len());
    b.extend_from_slice(&(origin as u32).to_le_bytes());
    b.extend_from_slice(m.as_bytes());
    frame(KIND_ERROR, &b)
}

pub(super) fn decode_error(from: usize, body: &[u8]) -> BootstrapError {
    let mut f = Fields(body);
    match f.u32() {
        Some(origin) => BootstrapError::PeerFailed {
            rank: origin as usize,
            message: String::from_utf8_lossy(f.0).into_owned(),
        },
        None => BootstrapError::PeerFailed {
            rank: from,
            message: "(an unreadable error frame)".into(),
        },
    }
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
        RecvError::TooLarge(len) => BootstrapError::FrameTooLarge {
            len,
            max: MAX_FRAME_BYTES,
        },
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

/// Tells each peer why this rank fails (an error frame), then closes the connections
/// gracefully: half-close, and read until the peer closes or [`FAREWELL`] passes, so
/// that unread bytes do not turn the close into a reset that could destroy the error
/// frame before the peer reads it.
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
