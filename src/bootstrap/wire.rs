//! The messages on the wire (format in the `bootstrap` module docs), and how a failing
//! rank tells its peers why.

use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use super::error::{BootstrapError, Result};
use super::frame::{deadline_after, frame, is_timeout, read_frame, write_full};
use super::host::{truncate_utf8, HostId};
use super::mac::{constant_time_eq, sign, verify, Label, Nonces};
use super::{
    FAREWELL, HELLO_BYTES, KIND_DATA, KIND_ERROR, KIND_HELLO, KIND_PROOF, KIND_WELCOME, MAC_BYTES,
    MAGIC, MAX_ERROR_MESSAGE_BYTES, MIN_WAIT, NONCE_BYTES, PROOF_FIXED_BYTES, PROTOCOL_VERSION,
    SECRET_BYTES,
};

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
    fn text_u16(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
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

/// What rank r announces once rank 0 has proven itself.
pub(super) struct Hello {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) host: HostId,
}

/// Rank r's proof: its MAC over both nonces and its announcement, then the announcement.
pub(super) fn encode_proof(
    secret: &[u8; SECRET_BYTES],
    n: &Nonces,
    rank: usize,
    world: usize,
    host: &HostId,
) -> Vec<u8> {
    let mut a = Vec::with_capacity(PROOF_FIXED_BYTES - MAC_BYTES + host.0.len());
    a.extend_from_slice(&(rank as u32).to_le_bytes());
    a.extend_from_slice(&(world as u32).to_le_bytes());
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
        let host = HostId(f.text_u16()?);
        f.0.is_empty().then_some(Hello { rank, world, host })
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
