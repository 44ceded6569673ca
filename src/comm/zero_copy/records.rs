//! The records ranks gather for a registration or a symmetric allocation: their first
//! word says which, so that a rank that registers where a peer allocates is refused on
//! both; a rank that refuses locally still sends its record, so every rank refuses
//! together.

use crate::error::{Error, Result};

/// The first word of a gathered registration record, and of a symmetric allocation's
/// ([`crate::SymmetricBuffer`]): a rank that registers where a peer allocates (or the
/// reverse) is refused on both at the first gather, and both stay in step.
pub(crate) const REGISTER_RECORD: u64 = u64::from_le_bytes(*b"pcreg\0\0\x01");
/// See [`REGISTER_RECORD`].
pub(crate) const SYMMETRIC_RECORD: u64 = u64::from_le_bytes(*b"pcsym\0\0\x01");

/// One rank's part of a registration, as gathered: where its range is, and why it
/// cannot register it (empty: it can). A rank that refuses locally (its buffer on
/// another device, a poisoned communicator, an allocation that failed) still sends its
/// record, so that every rank refuses together and no rank's next collective record
/// pairs with a peer's registration.
pub(crate) struct Offer {
    pub(crate) process: u64,
    /// The rank's device ordinal (in its process), so that a peer in the same process
    /// checks that this device may read its range.
    pub(crate) ordinal: u64,
    pub(crate) id: u64,
    pub(crate) ptr: u64,
    pub(crate) bytes: u64,
    pub(crate) refusal: String,
}

impl Offer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut record: Vec<u8> = [
            REGISTER_RECORD,
            self.process,
            self.ordinal,
            self.id,
            self.ptr,
            self.bytes,
        ]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
        record.extend_from_slice(self.refusal.as_bytes());
        record
    }
    pub(crate) fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        let word = |i: usize| record_word(b, i);
        match word(0) {
            Some(REGISTER_RECORD) if b.len() >= 48 => Ok(Offer {
                process: word(1).expect("48 bytes"),
                ordinal: word(2).expect("48 bytes"),
                id: word(3).expect("48 bytes"),
                ptr: word(4).expect("48 bytes"),
                bytes: word(5).expect("48 bytes"),
                refusal: String::from_utf8_lossy(&b[48..]).into_owned(),
            }),
            Some(SYMMETRIC_RECORD) => Err(refused(
                rank,
                "it allocates a symmetric buffer where this rank registers one: every rank \
                 registers and allocates symmetric buffers in the same order"
                    .into(),
            )),
            _ => Err(refused(
                rank,
                format!("a malformed registration record ({} bytes)", b.len()),
            )),
        }
    }
}

/// Word `i` (little-endian u64) of a gathered record, if it has one: how every record
/// kind here (registrations, symmetric allocations, captures, trims) is read.
pub(crate) fn record_word(b: &[u8], i: usize) -> Option<u64> {
    b.get(8 * i..8 * i + 8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
}

/// What a rank's gathered record says of its own refusal (never empty).
pub(crate) fn refusal_text(e: &Error) -> String {
    match e.to_string() {
        t if t.is_empty() => "it refused".into(),
        t => t,
    }
}

pub(crate) fn refused(rank: usize, reason: String) -> Error {
    Error::CannotRegister { rank, reason }
}

/// Checks that rank `rank`'s gathered record `b` is of `kind` (`name`: "capture",
/// "trim"): a registration's or symmetric allocation's is out of order (this rank
/// `doing` something else), anything else malformed.
pub(crate) fn expect_kind(rank: usize, b: &[u8], kind: u64, name: &str, doing: &str) -> Result<()> {
    match record_word(b, 0) {
        Some(k) if k == kind => Ok(()),
        Some(REGISTER_RECORD | SYMMETRIC_RECORD) => Err(refused(
            rank,
            format!(
                "it registers or allocates a symmetric buffer where this rank {doing}: every \
                 rank makes them in the same order"
            ),
        )),
        _ => Err(malformed(rank, name, b)),
    }
}

/// A record of kind `name` that does not parse.
pub(crate) fn malformed(rank: usize, name: &str, b: &[u8]) -> Error {
    refused(
        rank,
        format!("a malformed {name} record ({} bytes)", b.len()),
    )
}

/// A gathered status: empty = ok, else the reason.
pub(crate) fn first_refusal(statuses: &[Vec<u8>]) -> Option<Error> {
    statuses
        .iter()
        .enumerate()
        .find(|(_, s)| !s.is_empty())
        .map(|(r, s)| refused(r, String::from_utf8_lossy(s).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A symmetric allocation's record where a registration's is expected is refused
    /// (so a rank that registers where its peer allocates refuses at the first
    /// gather), and a local refusal travels in the record.
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
        let back = Offer::decode(1, &offer.encode()).unwrap();
        assert_eq!(
            (back.process, back.ordinal, back.id, back.ptr, back.bytes),
            (7, 2, 3, 0x1000, 256)
        );
        assert_eq!(back.refusal, "on another device");
        let mut other: Vec<u8> = [SYMMETRIC_RECORD, 0, 0, 256, 64 << 20]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        match Offer::decode(1, &other) {
            Err(Error::CannotRegister { rank: 1, reason }) => {
                assert!(reason.contains("symmetric"), "{reason}")
            }
            _ => panic!("a symmetric record decoded as a registration"),
        }
        other.truncate(40);
        other[..8].copy_from_slice(&REGISTER_RECORD.to_le_bytes());
        assert!(matches!(
            Offer::decode(0, &other),
            Err(Error::CannotRegister { rank: 0, .. })
        ));
    }
}
