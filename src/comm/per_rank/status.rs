//! [`Comm`]'s state: what it was built with, waiting for its stream, its error record,
//! and the recovery from an error.

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, ExchangeKind, HostId};
use crate::dispatch::Algorithm;
use crate::error::{Error, Result};
use crate::{CommConfig, SignalLayout};

use super::Comm;

impl<B: Backend> Comm<B> {
    /// How whole-world calls run: `Auto` (peer memory serves the world), `Nccl` (the
    /// external library) or `Hierarchical` (the ranks span hosts).
    pub fn world_path(&self) -> Algorithm {
        self.core.route.world_path()
    }
    /// The device (for CUDA: its context and the stream collectives run on).
    pub fn device(&self) -> &B::Device {
        self.core.device()
    }
    /// Each rank's host identity, as the bootstrap saw it.
    pub fn hosts(&self) -> &[HostId] {
        &self.hosts
    }
    /// The signal layout (Lamport slot and payload sizes).
    pub fn layout(&self) -> SignalLayout {
        self.core.settings.layout
    }
    /// The most blocks a peer-memory launch uses by default ([`crate::Rank::max_blocks`]).
    pub fn max_blocks(&self) -> u32 {
        self.core.max_blocks()
    }
    /// The configuration it was built with.
    pub fn config(&self) -> &CommConfig {
        &self.core.settings.config
    }
    /// Whether an earlier error has disabled collectives until [`Comm::reinitialize`].
    pub fn is_poisoned(&self) -> bool {
        self.core.is_poisoned()
    }

    /// Waits for this rank's queued work and nothing else: no error record is read
    /// (see [`Comm::synchronize`] and [`Comm::check_errors`]).
    pub fn wait(&self) -> Result<()> {
        B::synchronize(self.core.device())
    }

    /// Reads this rank's error record now, without waiting for its queued work; an
    /// error poisons the communicator, as from [`Comm::synchronize`].
    pub fn check_errors(&self) -> Result<()> {
        self.report(self.core.peek_error()?)
    }

    /// Poisons on an error and returns it.
    fn report(&self, error: Option<Error>) -> Result<()> {
        error.map_or(Ok(()), |e| {
            self.core.poison(&e);
            Err(e)
        })
    }

    /// Waits for this rank's queued work, then reads its error record (a small copy):
    /// [`Error::BarrierTimeout`] where a wait gave up, [`Error::PeerAborted`] where a peer
    /// did, and collectives are refused until [`Comm::reinitialize`].
    ///
    /// A call a peer never makes is reported within 2 x [`CommConfig::barrier_timeout`]
    /// of its start: the wait gives up, then waits as long again for the peers to stop
    /// reading this rank's buffers. With `barrier_timeout: None` it waits as long as
    /// the peer stays away.
    pub fn synchronize(&self) -> Result<()> {
        self.wait()?;
        self.report(self.core.take_external_error().err())?;
        self.report(self.core.read_error()?)?;
        // Every end barrier of this rank's calls completed: no peer reads its
        // registered buffers any more.
        self.registry.settle();
        Ok(())
    }

    /// Brings every rank back to the state of a new communicator after an error: a
    /// collective call (every rank calls it), through the bootstrap. Fails with a
    /// bootstrap error when a rank is gone; then the communicator must be rebuilt.
    pub fn reinitialize(&self) -> Result<()> {
        B::synchronize(self.core.device())?;
        // Nobody may still touch a signal while it is being reset, nor launch before
        // every signal is reset.
        let bootstrap = self.exchanges.of(ExchangeKind::Reinitialize);
        bootstrap.barrier()?;
        self.core.reset_signal(0)?;
        bootstrap.barrier()?;
        self.core.unpoison();
        // Every rank's queued work was done before the first barrier.
        self.registry.settle();
        Ok(())
    }

    /// The device memory this rank allocated.
    pub fn memory_footprint(&self) -> crate::MemoryFootprint {
        self.core.memory_footprint()
    }

    /// As [`crate::SingleController::algorithm_for`], for this rank's calls (inputs
    /// staged: one-stage in chunks where the payload is short, no two-stage).
    pub fn algorithm_for(
        &self,
        dtype: crate::DType,
        elements: usize,
        options: &crate::AllReduceOptions,
        in_place: bool,
    ) -> Result<Algorithm> {
        let reads = crate::comm::core::planning::PeerReads::Payloads;
        (self.core).algorithm_for(dtype, elements, options, in_place, reads)
    }
}
