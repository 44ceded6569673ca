//! Dropping a [`Comm`]: the teardown barrier, then freeing this rank's signal and
//! mappings, or parking them where a peer may still write (see `Drop for Comm`).

use std::time::Duration;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, ExchangeKind};
use crate::error::{Error, Result};

use super::super::core::{Endpoint, Rank};
use super::Comm;

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
            let segments =
                std::mem::take(&mut *self.pool.segments.lock().unwrap_or_else(|e| e.into_inner()));
            // The device goes with its memory (freed first, in tuple order): releasing
            // its stream and context measured up to the peer kernel's end (2.3 s) where
            // ranks share a GPU, past this drop's bound.
            let memory = (retired, segments, signal, mappings, device);
            super::parking::park(Box::new(memory), until);
        }
        Some(outcome)
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
