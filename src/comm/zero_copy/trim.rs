//! [`Comm::trim_symmetric`]: frees, collectively, the symmetric pool's segments that no
//! rank holds a buffer in (kept mapped otherwise, so that the next allocation costs no
//! export or import), as `torch.cuda.empty_cache` gives back cached blocks.

use super::lock;
use std::sync::Arc;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, ExchangeKind};
use crate::error::Result;

use super::pool::reclaim;
use super::records::{decode as decode_record, encode as encode_record, malformed, refused};
use super::records::{decode_all, refusal_of, take, TRIM_RECORD};
use crate::comm::per_rank::Comm;

/// One rank's record: which of its segments are empty, or why it refuses.
fn encode(empty: &[bool], refusal: &str) -> Vec<u8> {
    let text: Vec<u8> = empty
        .iter()
        .map(|&e| e as u8)
        .chain(refusal.bytes())
        .collect();
    encode_record(TRIM_RECORD, &[empty.len() as u64], &text)
}

/// Rank `rank`'s empty segments, from its record.
fn decode(rank: usize, b: &[u8], segments: usize) -> Result<Vec<bool>> {
    let ([count], rest) = decode_record(rank, b, TRIM_RECORD)?;
    let (flags, refusal) = take(rest, count).ok_or_else(|| malformed(rank, b))?;
    if !refusal.is_empty() {
        return Err(refused(rank, String::from_utf8_lossy(refusal).into_owned()));
    }
    if count != segments as u64 {
        return Err(refused(
            rank,
            format!(
                "its symmetric pool has {count} segments where this rank's has {segments}: \
                 every rank allocates and drops symmetric buffers in the same order"
            ),
        ));
    }
    Ok(flags.iter().map(|&f| f == 1).collect())
}

impl<B: Backend> Comm<B> {
    /// Frees the symmetric pool's segments that hold no buffer on any rank (collective:
    /// in the same order as the symmetric allocations and registrations) and returns
    /// the bytes this rank freed. Every rank closes its mappings of the freed segments
    /// before any rank frees the memory. [`crate::Error::CannotRegister`] on every rank where a
    /// peer allocates or registers meanwhile, or its pool differs; a poisoned
    /// communicator is [`crate::Error::Poisoned`] here and `CannotRegister` on the peers.
    pub fn trim_symmetric(&self) -> Result<u64> {
        let core = &*self.core;
        let mut segments = lock(&self.pool.segments);
        // Dropped ranges count as free once this rank's work before the drop is done.
        let local = core
            .check_usable()
            .and_then(|_| reclaim(&segments, core.device()));
        // Empty: no buffer holds it (the pool's handle is the only one) and all of it
        // is free.
        let empty: Vec<bool> = segments
            .iter()
            .map(|s| local.is_ok() && Arc::strong_count(s) == 1 && s.is_whole())
            .collect();
        let bootstrap = self.exchanges.of(ExchangeKind::Trim);
        let gathered = bootstrap.all_gather(&encode(&empty, &refusal_of(&local)));
        let lists = decode_all(gathered, local, |r, b| decode(r, b, segments.len()))?;
        let free_everywhere = |i: usize| lists.iter().all(|l| l[i]);
        if !(0..segments.len()).any(free_everywhere) {
            return Ok(0);
        }
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut *segments)
            .into_iter()
            .enumerate()
            .partition(|(i, _)| free_everywhere(*i));
        *segments = kept.into_iter().map(|(_, s)| s).collect();
        // First every rank closes its mappings of the peers' segments, then the memory
        // goes: no rank frees what a peer still has mapped.
        for (_, s) in &gone {
            self.registry.remove(s.registration);
        }
        let closed = bootstrap.barrier();
        let bytes = gone.iter().map(|(_, s)| s.bytes).sum();
        drop(gone);
        closed?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::zero_copy::records::{refused_by, SYMMETRIC_RECORD};

    #[test]
    fn records_round_trip_and_refuse_other_kinds() {
        let flags = decode(1, &encode(&[true, false], ""), 2).unwrap();
        assert_eq!(flags, vec![true, false]);
        for (record, what) in [
            (encode(&[true], "poisoned"), "poisoned"),
            (encode(&[true, true], ""), "2 segments"),
            (encode_record(SYMMETRIC_RECORD, &[0, 0], b""), "symmetric"),
        ] {
            let reason = refused_by(decode(3, &record, 1), 3);
            assert!(reason.contains(what), "{reason}");
        }
    }
}
