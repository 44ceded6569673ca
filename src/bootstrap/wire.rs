//! The messages on the wire (format in the `bootstrap` module docs), and how a failing
//! rank tells its peers why.

use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use super::error::{BootstrapError, Result};
use super::frame::{deadline_after, frame, is_timeout, read_frame, write_full};
use super::host::{truncate_utf8, HostId};
use super::mac::{constant_time_eq, Keys, Label};
use super::{
    FAREWELL, HELLO_BYTES, KIND_DATA, KIND_ERROR, KIND_HELLO, KIND_PROOF, MAC_BYTES, MAGIC,
    MAX_ERROR_MESSAGE_BYTES, MIN_WAIT, NONCE_BYTES, PROOF_FIXED_BYTES, PROTOCOL_VERSION,
    SECRET_BYTES,
};

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
