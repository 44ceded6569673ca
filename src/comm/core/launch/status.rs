//! A rank's error record as the host sees it, read after the queued work or polled.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::{
    Signal, CALL_WORDS, DETAIL_AWAITED, DETAIL_MINE, DETAIL_THEIRS, DETAIL_WORDS, ERROR_BLOCK,
    ERROR_CALL_MISMATCH, ERROR_CODE, ERROR_DOMAIN, ERROR_PEER_ABORTED, ERROR_RANK, ERROR_WRITING,
};

use crate::comm::core::call;
use crate::comm::core::launch::Endpoint;

/// Words of an error record: `error_state`, then `error_detail` (adjacent).
const RECORD_WORDS: usize = DETAIL + DETAIL_WORDS;
/// Where `error_detail` starts in a record.
const DETAIL: usize = 4;
const _: () = assert!(
    std::mem::offset_of!(Signal, error_detail) == std::mem::offset_of!(Signal, error_state) + 16
);

impl<B: Backend> Endpoint<B> {
    /// This rank's error record after its stream's earlier work: `None` when clean.
    pub(crate) fn read_error(&self) -> Result<Option<Error>> {
        let mut raw = [0u8; RECORD_WORDS * 4];
        B::read(&self.device, self.record_ptr(), &mut raw)?;
        let words =
            std::array::from_fn(|i| u32::from_le_bytes(raw[4 * i..][..4].try_into().unwrap()));
        Ok(decode(self.index, &words))
    }

    /// This rank's error record now, without waiting for its stream; one still being
    /// written reads as clean (the next poll sees it).
    pub(crate) fn peek_error(&self) -> Result<Option<Error>> {
        let mut words = [0u32; RECORD_WORDS];
        B::read_words_now(&self.device, self.record_ptr(), &mut words)?;
        Ok(decode(self.index, &words))
    }

    fn record_ptr(&self) -> u64 {
        B::memory_ptr(&self.signal) + std::mem::offset_of!(Signal, error_state) as u64
    }
}

fn decode(rank: usize, words: &[u32; RECORD_WORDS]) -> Option<Error> {
    let word = |i: usize| words[i] as usize;
    let detail = &words[DETAIL..];
    let waiting_for = detail[DETAIL_AWAITED].checked_sub(1).map(|r| r as usize);
    let descriptor = |at: usize| -> [u32; CALL_WORDS] { std::array::from_fn(|i| detail[at + i]) };
    match words[ERROR_CODE] {
        0 | ERROR_WRITING => None,
        ERROR_PEER_ABORTED => Some(Error::PeerAborted {
            rank,
            by: word(ERROR_RANK),
            block: word(ERROR_BLOCK),
            domain: word(ERROR_DOMAIN),
            waiting_for,
        }),
        ERROR_CALL_MISMATCH => Some(call::mismatch_error(
            rank,
            word(ERROR_RANK),
            descriptor(DETAIL_MINE),
            descriptor(DETAIL_THEIRS),
        )),
        _ => Some(Error::BarrierTimeout {
            rank: word(ERROR_RANK),
            block: word(ERROR_BLOCK),
            domain: word(ERROR_DOMAIN),
            waiting_for,
        }),
    }
}

impl<B: Backend> crate::comm::core::Rank<B> {
    /// [`Endpoint::read_error`] of this rank.
    pub(crate) fn read_error(&self) -> Result<Option<Error>> {
        self.endpoint.read_error()
    }
    /// [`Endpoint::peek_error`] of this rank.
    pub(crate) fn peek_error(&self) -> Result<Option<Error>> {
        self.endpoint.peek_error()
    }
}
