//! [`Comm`]'s view of its rank's state: waiting for its stream, and its error record.

use crate::backend::Backend;
use crate::error::{Error, Result};

use super::Comm;

impl<B: Backend> Comm<B> {
    /// Waits for this rank's queued work and nothing else: no error record is read
    /// (see [`Comm::synchronize`] and [`Comm::check_errors`]).
    pub fn wait(&self) -> Result<()> {
        B::synchronize(self.core.device())
    }

    /// Reads this rank's error record now, without waiting for its queued work.
    /// `Ok(())` means no error is recorded yet; otherwise the error is returned and
    /// the communicator is poisoned, as by [`Comm::synchronize`].
    pub fn check_errors(&self) -> Result<()> {
        self.report(self.core.peek_error()?)
    }

    /// Poisons on an error record and returns it.
    pub(super) fn report(&self, record: Option<Error>) -> Result<()> {
        match record {
            Some(e) => {
                self.core.poison(&e);
                Err(e)
            }
            None => Ok(()),
        }
    }
}

impl<B: Backend> Comm<B> {
    /// The device memory this rank allocated.
    pub fn memory_footprint(&self) -> crate::MemoryFootprint {
        self.core.memory_footprint()
    }

    /// As [`crate::Communicator::algorithm_for`], for this rank's calls (where peers
    /// never read user buffers: inputs are staged, so one-stage runs through the
    /// payload in chunks where it cannot hold the whole message, and two-stage is not
    /// offered).
    pub fn algorithm_for(
        &self,
        dtype: crate::DType,
        elements: usize,
        options: &crate::AllReduceOptions,
        in_place: bool,
    ) -> Result<crate::Algorithm> {
        self.core.algorithm_for(
            dtype,
            elements,
            options,
            in_place,
            crate::comm::core::planning::PeerReads::Payloads,
        )
    }
}
