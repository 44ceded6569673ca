//! The records ranks gather for a registration, a symmetric allocation, a registered
//! capture or a trim: `[kind, words..., text]`, little-endian. The kind word makes ranks
//! that make different calls refuse together; a rank that refuses locally still sends
//! its record (the refusal as its text), so every rank stays in step.

use crate::error::{Error, Result};

// The kind words: a registration's, a symmetric allocation's, a registered capture's, a
// trim's.
pub(crate) const REGISTER_RECORD: u64 = u64::from_le_bytes(*b"pcreg\0\0\x01");
pub(crate) const SYMMETRIC_RECORD: u64 = u64::from_le_bytes(*b"pcsym\0\0\x01");
pub(crate) const CAPTURE_RECORD: u64 = u64::from_le_bytes(*b"pccap\0\0\x01");
pub(crate) const TRIM_RECORD: u64 = u64::from_le_bytes(*b"pctrim\0\x01");
pub(crate) const DEVICE_COMM_RECORD: u64 = u64::from_le_bytes(*b"pcdev\0\0\x01");

/// What the rank that sent a record of each kind is doing.
const DOINGS: [(u64, &str); 5] = [
    (REGISTER_RECORD, "registers a buffer"),
    (SYMMETRIC_RECORD, "allocates a symmetric buffer"),
    (CAPTURE_RECORD, "makes a registered capture"),
    (TRIM_RECORD, "trims the symmetric pool"),
    (DEVICE_COMM_RECORD, "makes a device communicator"),
];

/// One rank's part of a registration: where its range is (`ordinal`: its device, so
/// that a peer in the same process checks that it may read the range), and why it
/// cannot register it (empty: it can).
pub(crate) struct Offer {
    pub(crate) process: u64,
    pub(crate) ordinal: u64,
    pub(crate) id: u64,
    pub(crate) ptr: u64,
    pub(crate) bytes: u64,
    pub(crate) refusal: String,
}

impl Offer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let words = [self.process, self.ordinal, self.id, self.ptr, self.bytes];
        encode(REGISTER_RECORD, &words, self.refusal.as_bytes())
    }
    pub(crate) fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        let ([process, ordinal, id, ptr, bytes], rest) = decode(rank, b, REGISTER_RECORD)?;
        let refusal = String::from_utf8_lossy(rest).into_owned();
        Ok(Offer {
            process,
            ordinal,
            id,
            ptr,
            bytes,
            refusal,
        })
    }
}

/// A record: `kind`, then `words`, then `text`.
pub(crate) fn encode(kind: u64, words: &[u64], text: &[u8]) -> Vec<u8> {
    let mut b: Vec<u8> = std::iter::once(kind)
        .chain(words.iter().copied())
        .flat_map(u64::to_le_bytes)
        .collect();
    b.extend_from_slice(text);
    b
}

/// Rank `rank`'s record `b` of `kind`: its `N` words and the bytes after them. A record
/// of another kind is out of order (the peer makes another call), one too short
/// malformed.
pub(crate) fn decode<const N: usize>(
    rank: usize,
    b: &[u8],
    kind: u64,
) -> Result<([u64; N], &[u8])> {
    let doing = |k: u64| DOINGS.iter().find(|d| d.0 == k).map(|d| d.1);
    let first = record_word(b, 0);
    if first != Some(kind) {
        return Err(match (first.and_then(doing), doing(kind)) {
            (Some(theirs), Some(mine)) => refused(
                rank,
                format!(
                    "it {theirs} where this rank {mine}: every rank registers, allocates \
                     symmetric buffers, captures, trims and makes device communicators \
                     in the same order"
                ),
            ),
            _ => malformed(rank, b),
        });
    }
    let mut words = [0u64; N];
    for (i, w) in words.iter_mut().enumerate() {
        *w = record_word(b, 1 + i).ok_or_else(|| malformed(rank, b))?;
    }
    Ok((words, &b[8 * (N + 1)..]))
}

/// Every rank's gathered record, decoded, after this rank's own refusal `local` (which
/// its peers learn from its record).
pub(crate) fn decode_all<T, E: Into<Error>>(
    gathered: std::result::Result<Vec<Vec<u8>>, E>,
    local: Result<()>,
    decode: impl Fn(usize, &[u8]) -> Result<T>,
) -> Result<Vec<T>> {
    local?;
    let gathered = gathered.map_err(Into::into)?;
    gathered
        .iter()
        .enumerate()
        .map(|(r, b)| decode(r, b))
        .collect()
}

/// The first `n` bytes of `b` and the rest, if it has them.
pub(crate) fn take(b: &[u8], n: u64) -> Option<(&[u8], &[u8])> {
    b.split_at_checked(usize::try_from(n).ok()?)
}

/// Word `i` (little-endian u64) of `b`, if it has one.
pub(crate) fn record_word(b: &[u8], i: usize) -> Option<u64> {
    b.get(8 * i..8 * i + 8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
}

/// What a rank's record says of its own verdict: empty for `Ok`, else the error
/// (never empty).
pub(crate) fn refusal_of<T>(verdict: &Result<T>) -> String {
    match verdict.as_ref().map_err(Error::to_string) {
        Ok(_) => String::new(),
        Err(t) if t.is_empty() => "it refused".into(),
        Err(t) => t,
    }
}

pub(crate) fn refused(rank: usize, reason: String) -> Error {
    Error::CannotRegister { rank, reason }
}

/// Rank `rank`'s record `b` does not parse.
pub(crate) fn malformed(rank: usize, b: &[u8]) -> Error {
    refused(rank, format!("a malformed record ({} bytes)", b.len()))
}

/// The first rank's refusal among gathered statuses (empty: ok, else the reason).
pub(crate) fn first_refusal<S: AsRef<[u8]>>(
    statuses: impl IntoIterator<Item = S>,
) -> Option<Error> {
    let (r, s) = statuses
        .into_iter()
        .enumerate()
        .find(|(_, s)| !s.as_ref().is_empty())?;
    Some(refused(r, String::from_utf8_lossy(s.as_ref()).into_owned()))
}

/// The reason of `result`, which must be [`Error::CannotRegister`] naming `rank`.
#[cfg(test)]
pub(crate) fn refused_by<T>(result: Result<T>, rank: usize) -> String {
    match result {
        Err(Error::CannotRegister { rank: r, reason }) if r == rank => reason,
        Err(e) => panic!("not rank {rank}'s refusal: {e}"),
        Ok(_) => panic!("accepted, not refused by rank {rank}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of another kind is refused naming both calls, a short one is
    /// malformed, and a local refusal travels in the record.
    #[test]
    fn records_tell_their_kind_and_refusal() {
        let offer = Offer {
            process: 7,
            ordinal: 2,
            id: 3,
            ptr: 0x1000,
            bytes: 256,
            refusal: "on another device".into(),
        };
        // Every field is in the encoding, so equal encodings mean equal offers.
        let back = Offer::decode(1, &offer.encode()).unwrap();
        assert_eq!(back.encode(), offer.encode());
        let mut other = encode(SYMMETRIC_RECORD, &[0, 0, 256, 64 << 20], b"");
        let reason = refused_by(Offer::decode(1, &other), 1);
        assert!(reason.contains("symmetric"), "{reason}");
        other.truncate(40);
        other[..8].copy_from_slice(&REGISTER_RECORD.to_le_bytes());
        refused_by(Offer::decode(0, &other), 0);
    }
}
