//! A communicator's state as the host sees it: waiting for the ranks' streams, and the
//! ranks' error records (a barrier timeout or an abort a peer sent), read after the
//! queued work or polled while it runs.

use std::sync::atomic::Ordering;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::signal::{
    Signal, DETAIL_AWAITED, DETAIL_MINE, DETAIL_THEIRS, ERROR_BLOCK, ERROR_CALL_MISMATCH,
    ERROR_CODE, ERROR_DOMAIN, ERROR_PEER_ABORTED, ERROR_RANK, ERROR_WRITING,
};

use super::{call, Comm, Communicator, Rank};

/// Words of an error record: `error_state`, then `error_detail` (adjacent in the
/// signal).
const RECORD_WORDS: usize = 12;
/// Where `error_detail` starts in a record.
const DETAIL: usize = 4;
const _: () = assert!(
    std::mem::offset_of!(Signal, error_detail) == std::mem::offset_of!(Signal, error_state) + 16
);

/// Reads `rank`'s error record after its stream's earlier work: `None` when clean.
pub(crate) fn read_error_record<B: Backend>(rank: &Rank<B>) -> Result<Option<Error>> {
    let mut raw = [0u8; RECORD_WORDS * 4];
    B::read(&rank.device, record_ptr(rank), &mut raw)?;
    let mut words = [0u32; RECORD_WORDS];
    for (w, b) in words.iter_mut().zip(raw.chunks_exact(4)) {
        *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(decode(rank.index, &words))
}

/// Reads `rank`'s error record now, without waiting for its stream: a record still
/// being written reads as clean (the next poll sees it).
pub(crate) fn peek_error_record<B: Backend>(rank: &Rank<B>) -> Result<Option<Error>> {
    let mut words = [0u32; RECORD_WORDS];
    B::read_words_now(&rank.device, record_ptr(rank), &mut words)?;
    Ok(decode(rank.index, &words))
}

fn record_ptr<B: Backend>(rank: &Rank<B>) -> u64 {
    B::memory_ptr(&rank.signal) + std::mem::offset_of!(Signal, error_state) as u64
}

fn decode(rank: usize, words: &[u32; RECORD_WORDS]) -> Option<Error> {
    let word = |i: usize| words[i] as usize;
    let detail = &words[DETAIL..];
    let waiting_for = detail[DETAIL_AWAITED].checked_sub(1).map(|r| r as usize);
    let descriptor = |at: usize| [detail[at], detail[at + 1], detail[at + 2]];
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

impl<B: Backend> Communicator<B> {
    /// Waits for every rank's queued work and nothing else: no error record is read,
    /// so a barrier that gave up goes unnoticed until [`Communicator::synchronize`] or
    /// [`Communicator::check_errors`]. Errors are the backend's own (a failed stream
    /// synchronisation).
    pub fn wait(&self) -> Result<()> {
        for r in &self.ranks {
            B::synchronize(&r.device)?;
        }
        Ok(())
    }

    /// Waits for every rank's queued work, then reads every rank's error record: what
    /// each rank recorded, in rank order (`None`: clean). As
    /// [`Communicator::synchronize`], an error poisons the communicator; this shows
    /// every rank's view where `synchronize` returns the root cause.
    pub fn rank_errors(&self) -> Result<Vec<Option<Error>>> {
        self.wait()?;
        let errors = self
            .ranks
            .iter()
            .map(|r| read_error_record::<B>(r))
            .collect::<Result<Vec<_>>>()?;
        if errors.iter().any(Option::is_some) {
            self.poisoned.store(true, Ordering::Release);
        }
        Ok(errors)
    }

    /// Reads every rank's error record now, without waiting for queued work (a
    /// watchdog can call it while collectives run, like NCCL's `ncclCommGetAsyncError`).
    /// `Ok(())` means no rank has recorded an error yet; otherwise the root cause is
    /// returned and the communicator is poisoned, as by
    /// [`Communicator::synchronize`]. On CUDA and HIP each read is a small synchronous
    /// copy on the legacy default stream, which does not wait for the ranks'
    /// non-blocking streams (a rank built on the legacy default stream itself would
    /// wait); a record still being written reads as clean until the next poll.
    pub fn check_errors(&self) -> Result<()> {
        self.report_records(|r| peek_error_record::<B>(r))
    }
}

impl<B: Backend> Comm<B> {
    /// Waits for this rank's queued work and nothing else: no error record is read
    /// (see [`Comm::synchronize`] and [`Comm::check_errors`]).
    pub fn wait(&self) -> Result<()> {
        B::synchronize(&self.rank.device)
    }

    /// Reads this rank's error record now, without waiting for its queued work.
    /// `Ok(())` means no error is recorded yet; otherwise the error is returned and
    /// the communicator is poisoned, as by [`Comm::synchronize`].
    pub fn check_errors(&self) -> Result<()> {
        self.report(peek_error_record::<B>(&self.rank)?)
    }

    /// Poisons on an error record and returns it.
    pub(super) fn report(&self, record: Option<Error>) -> Result<()> {
        match record {
            Some(e) => {
                self.poisoned.store(true, Ordering::Release);
                Err(e)
            }
            None => Ok(()),
        }
    }
}
