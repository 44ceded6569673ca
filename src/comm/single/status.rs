//! [`SingleController`]'s view of its ranks: waiting for their streams, their error
//! records, and sizing answered without launching anything.

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::super::core::Rank;
use super::super::{AllReduceOptions, MemoryFootprint};
use super::SingleController;
use crate::comm::core::planning::PeerReads;

impl<B: Backend> SingleController<B> {
    /// Waits for every rank's queued work and nothing else: no error record is read
    /// (see [`SingleController::synchronize`] and [`SingleController::check_errors`]).
    pub fn wait(&self) -> Result<()> {
        for r in &self.ranks {
            B::synchronize(r.device())?;
        }
        Ok(())
    }

    /// As [`SingleController::synchronize`] (an error poisons), but every rank's record
    /// in rank order (`None`: clean) where `synchronize` returns the root cause.
    pub fn rank_errors(&self) -> Result<Vec<Option<Error>>> {
        self.wait()?;
        let errors = self
            .ranks
            .iter()
            .map(Rank::read_error)
            .collect::<Result<Vec<_>>>()?;
        // The root cause: a rank's own error before an abort a peer sent it.
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
    /// `ncclCommGetAsyncError`): the root cause, poisoning as
    /// [`SingleController::synchronize`], or `Ok(())`. A record still being written
    /// reads clean until the next poll.
    pub fn check_errors(&self) -> Result<()> {
        self.report_records(Rank::peek_error)
    }

    /// The device memory each rank allocated (the same on every rank).
    pub fn memory_footprint(&self) -> MemoryFootprint {
        self.ranks[0].memory_footprint()
    }

    /// What [`SingleController::all_reduce`] (`in_place`: `_in_place`) would do with
    /// `elements` of `dtype` per rank, launching nothing: the algorithm, or the call's
    /// typed error (e.g. [`crate::Error::MessageTooLarge`] naming the field to raise).
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
