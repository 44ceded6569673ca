//! [`SingleController`]'s view of its ranks' state: waiting for their streams, their error
//! records, and the sizing questions answered without launching anything.

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::super::core::Rank;
use super::super::{AllReduceOptions, MemoryFootprint};
use super::SingleController;
use crate::comm::core::planning::PeerReads;

impl<B: Backend> SingleController<B> {
    /// Waits for every rank's queued work and nothing else: no error record is read,
    /// so a barrier that gave up goes unnoticed until [`SingleController::synchronize`] or
    /// [`SingleController::check_errors`]. Errors are the backend's own (a failed stream
    /// synchronisation).
    pub fn wait(&self) -> Result<()> {
        for r in &self.ranks {
            B::synchronize(r.device())?;
        }
        Ok(())
    }

    /// Waits for every rank's queued work, then reads every rank's error record: what
    /// each rank recorded, in rank order (`None`: clean). As
    /// [`SingleController::synchronize`], an error poisons the communicator; this shows
    /// every rank's view where `synchronize` returns the root cause.
    pub fn rank_errors(&self) -> Result<Vec<Option<Error>>> {
        self.wait()?;
        let errors = self
            .ranks
            .iter()
            .map(Rank::read_error)
            .collect::<Result<Vec<_>>>()?;
        // The root cause, as `synchronize` reports it: a rank's own error before an
        // abort a peer sent it.
        let recorded = || errors.iter().flatten();
        let cause = recorded()
            .find(|e| !matches!(e, Error::PeerAborted { .. }))
            .or_else(|| recorded().next());
        if let Some(cause) = cause {
            self.poison(cause);
        }
        Ok(errors)
    }

    /// Reads every rank's error record now, without waiting (a watchdog's poll, like
    /// `ncclCommGetAsyncError`): `Ok(())` if none has recorded an error yet, else the
    /// root cause, poisoning as [`SingleController::synchronize`]. On GPUs each read is
    /// a small copy on the legacy default stream, which does not wait for the ranks'
    /// non-blocking streams; a record still being written reads clean until the next.
    pub fn check_errors(&self) -> Result<()> {
        self.report_records(Rank::peek_error)
    }
}

impl<B: Backend> SingleController<B> {
    /// The device memory each rank allocated (the same on every rank).
    pub fn memory_footprint(&self) -> MemoryFootprint {
        self.ranks[0].memory_footprint()
    }

    /// Answers, launching nothing, what [`SingleController::all_reduce_sum`] (or, with
    /// `in_place`, [`SingleController::all_reduce_sum_in_place`]) would do with
    /// `elements` of `dtype` per rank: the algorithm, or the call's typed error (e.g.
    /// [`crate::Error::MessageTooLarge`] naming the `CommConfig` field to raise).
    pub fn algorithm_for(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
        in_place: bool,
    ) -> Result<Algorithm> {
        self.ranks[0].algorithm_for(dtype, elements, options, in_place, PeerReads::UserBuffers)
    }
}
