//! [`Comm`]'s state and lifecycle: what it was built with, waiting for its stream, its
//! error record, the recovery from an error, and the drop: the teardown barrier, then
//! freeing this rank's signal and mappings, or parking them where a peer may still write
//! (see `Drop for Comm`).

use crate::error::lock;
use std::time::Duration;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, ExchangeKind, HostId};
use crate::dispatch::Algorithm;
use crate::error::{Error, Result};
use crate::{CommConfig, SignalLayout};

use super::super::core::{Endpoint, Rank};
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

/// How long a drop waits for the other ranks' teardown, whatever
/// `CommConfig::bootstrap_timeout` says: a drop whose peer is gone returns at once, as
/// cudarc's does, and parks its memory instead of freeing it.
const TEARDOWN_BARRIER_TIMEOUT: Duration = Duration::from_secs(1);

/// Margin past 2 x `barrier_timeout` that parked memory is kept: for a peer kernel
/// queued behind earlier work, and host threads scheduled late.
const PARK_MARGIN: Duration = Duration::from_secs(10);

/// Until when memory parked at `now` is kept; `None` (until exit) when the kernels'
/// waits never end or the sum overflows.
fn park_deadline(
    now: std::time::Instant,
    barrier_timeout: Option<Duration>,
) -> Option<std::time::Instant> {
    let kernel = barrier_timeout?.checked_mul(2)?;
    now.checked_add(kernel.checked_add(PARK_MARGIN)?)
}

impl<B: Backend> Drop for Comm<B> {
    /// Tears this rank down without freeing memory a peer's kernel may still write;
    /// never panics, returns within about a second after this rank's queued work. It
    /// waits for the stream, then meets the other ranks through the bootstrap (bounded
    /// by `TEARDOWN_BARRIER_TIMEOUT`). If all came (or no peer shares its memory),
    /// every stream is drained and the signal, mappings and kept registered buffers are
    /// freed. Otherwise a peer's kernels may still store here: that memory is parked
    /// process-wide for 2 x `barrier_timeout` + `PARK_MARGIN` (until exit without a
    /// timeout) and freed by a later drop; nothing runs in the background.
    ///
    /// Guaranteed: a peer's kernel running at the drop, or starting within
    /// `PARK_MARGIN` of the park, never writes freed memory (its first wait on this rank
    /// gives up within `barrier_timeout`, in a group of more than two after at most one
    /// other late wait). Not guaranteed: a peer starting collectives after a rank of its
    /// group dropped gets `BarrierTimeout` or `PeerAborted` and must drop too; its
    /// stores here are safe only while the signal is parked.
    fn drop(&mut self) {
        let _ = self.tear_down();
    }
}

impl<B: Backend> Comm<B> {
    /// Tears this rank down now, as dropping it does, and says how it went: `Ok(())`
    /// when this rank's stream drained and every rank met the teardown (memory freed);
    /// otherwise the first failure (this rank's queued work, or a peer gone, late or in
    /// another call), with the memory a peer may still write parked instead. Every rank
    /// calls it or drops its `Comm`, like any collective call.
    pub fn close(mut self) -> Result<()> {
        self.tear_down().unwrap_or(Ok(()))
    }

    /// The teardown of `Drop for Comm`; `None` when it was done already.
    fn tear_down(&mut self) -> Option<Result<()>> {
        if std::mem::replace(&mut self.torn_down, true) {
            return None;
        }
        // SAFETY: taken here, once; nothing reads `self.core` after this (the other
        // fields' drops do not use it).
        let core = unsafe { std::mem::ManuallyDrop::take(&mut self.core) };
        let barrier_timeout = core.settings.config.barrier_timeout;
        let (world, peers) = (core.route.world, core.settings.world);
        let Rank {
            endpoint: rank,
            mappings,
            route,
            ..
        } = core;
        // The external handle (if any) is dropped last, when this function ends.
        let _external = route;
        let bootstrap = self.exchanges.of(ExchangeKind::Teardown);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let idle = B::synchronize(&rank.device);
            // Always met, even after a failed wait: the peers are waiting for it.
            let met = (world > 1).then(|| bootstrap.barrier_within(TEARDOWN_BARRIER_TIMEOUT));
            idle.and(met.unwrap_or(Ok(())).map_err(Error::from))
        }))
        .unwrap_or_else(|_| {
            Err(Error::Backend {
                backend: B::NAME,
                call: "teardown",
                detail: "a panic while waiting for the stream or the peers".into(),
            })
        });
        if outcome.is_ok() || peers == 1 {
            // No peer reads the retired registered buffers any more either.
            let retired = self.registry.close(None);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                drop(retired);
                drop(mappings);
                drop(rank);
            }));
            super::parking::free_expired_teardowns();
        } else {
            let Endpoint { device, signal, .. } = rank;
            let until = park_deadline(std::time::Instant::now(), barrier_timeout);
            // Registered buffers that a peer may still read are parked alike, those
            // dropped later included.
            let retired = self.registry.close(Some(Box::new(move |buffer| {
                super::parking::park(buffer, until)
            })));
            // So are the symmetric pool's segments, which the peers read in place too.
            let segments = std::mem::take(&mut *lock(&self.pool));
            // The device goes with its memory (freed first, in tuple order): releasing
            // its stream and context measured up to the peer kernel's end (2.3 s) where
            // ranks share a GPU, past this drop's bound.
            let memory = (retired, segments, signal, mappings, device);
            super::parking::park(Box::new(memory), until);
        }
        Some(outcome)
    }
}

/// Fault injection (feature `fault-injection`), so that users can test their own
/// timeout and error handling.
#[cfg(feature = "fault-injection")]
impl<B: Backend> Comm<B> {
    /// Fault injection: this rank's next collective returns as if launched and launches
    /// nothing. Its peers time out ([`crate::CommConfig::barrier_timeout`]) and this rank
    /// gets their [`crate::Error::PeerAborted`]; every rank then calls
    /// [`Comm::reinitialize`].
    pub fn miss_next(&self) {
        self.core.endpoint.miss_next_launch();
    }

    /// Fault injection: this rank's next collective publishes a descriptor one ahead in
    /// the sequence; its group gets [`crate::Error::CallMismatch`].
    pub fn mismatch_next(&self) {
        self.core.endpoint.skew_next_call();
    }

    /// Fault injection: this rank's next collective starts `delay` late (a kernel that
    /// spins, touching no memory).
    pub fn delay(&self, delay: Duration) -> Result<()> {
        self.core.check_usable()?;
        self.core.endpoint.launch_delay(delay)
    }
}

#[cfg(test)]
mod teardown_tests {
    use super::*;

    #[test]
    fn park_deadline_is_twice_the_barrier_timeout_plus_the_margin() {
        let now = std::time::Instant::now();
        let t = Duration::from_secs(3);
        assert_eq!(park_deadline(now, Some(t)), Some(now + 2 * t + PARK_MARGIN));
        assert_eq!(park_deadline(now, None), None);
        assert_eq!(park_deadline(now, Some(Duration::MAX)), None);
        assert_eq!(park_deadline(now, Some(Duration::MAX / 2)), None);
    }
}
