//! Dropping a [`Comm`]: the teardown barrier, then freeing this rank's signal and
//! mappings, or parking them where a peer may still write (see `Drop for Comm`).

use std::time::Duration;

use crate::backend::Backend;
use crate::bootstrap::{Bootstrap, ExchangeKind};
use crate::error::{Error, Result};

use super::super::core::{Endpoint, Rank};
use super::Comm;

/// How long dropping a [`Comm`] waits for the other ranks' teardown: about a second,
/// whatever `CommConfig::bootstrap_timeout` says, so that a drop whose peer is gone
/// (or never drops) returns at once, as cudarc's does. A drop that does not hear from
/// every rank in time parks its memory instead of freeing it (see `Drop for Comm`).
const TEARDOWN_BARRIER_TIMEOUT: Duration = Duration::from_secs(1);

/// Margin past 2 x `barrier_timeout` that parked memory is kept: room for a peer's
/// kernel that was queued (behind up to this much earlier work on its stream) when
/// this rank dropped, and for host threads that a loaded machine schedules late.
const PARK_MARGIN: Duration = Duration::from_secs(10);

/// Until when memory parked at `now` is kept: 2 x `barrier_timeout` + [`PARK_MARGIN`]
/// later; `None` (until the process exits) when the kernels' waits never end or the
/// sum does not fit in an `Instant`.
fn park_deadline(
    now: std::time::Instant,
    barrier_timeout: Option<Duration>,
) -> Option<std::time::Instant> {
    let kernel = barrier_timeout?.checked_mul(2)?;
    now.checked_add(kernel.checked_add(PARK_MARGIN)?)
}

impl<B: Backend> Drop for Comm<B> {
    /// Tears this rank down without freeing memory that a peer's kernel may still write
    /// into. Never panics, and returns within about a second (`TEARDOWN_BARRIER_TIMEOUT`)
    /// after this rank's own queued work, whatever the peers do:
    ///
    /// 1. Waits for this rank's stream.
    /// 2. Meets the other ranks in a teardown barrier through the bootstrap
    ///    ([`crate::bootstrap::Bootstrap::all_gather_within`] of a record tagged as a
    ///    teardown), bounded by `TEARDOWN_BARRIER_TIMEOUT` (1 s), not by
    ///    `CommConfig::bootstrap_timeout`.
    /// 3. If every rank sent its teardown record, every rank has drained its stream
    ///    too, so no kernel of the group runs or is queued: the signal allocation, the
    ///    peer mappings and the buffers of dropped registrations kept while a peer might
    ///    read them (see [`crate::Registered`]) are freed at once (in stream order), and
    ///    registered buffers dropped later are freed at once. Likewise when no peer
    ///    shares this rank's peer memory (a world of one, or calls served by the
    ///    external library).
    /// 4. Otherwise a peer is gone, late, or in another collective call (its record is
    ///    a registration's, say: `BootstrapError::ExchangeMismatch` on both sides), and
    ///    its kernels may still store into this rank's signal (barrier arrivals, Lamport
    ///    data, the error record and abort word, the abandon protocol's confirmation).
    ///    The signal, the mappings, the symmetric pool's segments and the kept
    ///    registered buffers (and those dropped later) are parked in a process-wide lot
    ///    for 2 x `CommConfig::barrier_timeout` + `PARK_MARGIN` (10 s) from the end of
    ///    the barrier, and freed by a later `Comm` drop once that has passed; with
    ///    `barrier_timeout: None` (waits that never end) they stay until the process
    ///    exits. Nothing runs in the background, and the drop never waits for the
    ///    deadline.
    ///
    /// Guaranteed: a peer's kernel that is running when this rank drops, or that
    /// starts within `PARK_MARGIN` of the park (it was queued behind less than that
    /// much work), never writes memory this rank freed. Once this rank has stopped,
    /// the first wait of that kernel that needs this rank gives up within
    /// `barrier_timeout` (in a group of more than two, after at most one wait that
    /// another peer satisfies late), and the block's last store into this rank's
    /// signal is the abandon confirmation at that point: at most 2 x `barrier_timeout`
    /// after the kernel started or this rank dropped, whichever is later. A peer that
    /// also drops meets this rank in the barrier or finds it gone, and parks or frees
    /// the same way.
    ///
    /// Not guaranteed: a peer must not start new collectives after a rank of its group
    /// has dropped. Such a collective cannot complete: its waits for this rank give up
    /// after `barrier_timeout`, [`Comm::synchronize`] on that peer returns
    /// [`crate::Error::BarrierTimeout`] (or [`crate::Error::PeerAborted`]) within 2 x
    /// `barrier_timeout`, its communicator is poisoned, and [`Comm::reinitialize`]
    /// fails with a bootstrap error, so it must be dropped too. Its kernel stores into
    /// this rank's signal; that is safe while the signal is parked (it starts within
    /// `PARK_MARGIN` of the park), and afterwards, for ranks that share a process,
    /// writes memory this rank freed. With `barrier_timeout: None` such a kernel never
    /// ends.
    fn drop(&mut self) {
        let _ = self.tear_down();
    }
}

impl<B: Backend> Comm<B> {
    /// Tears this rank down now, as dropping it does (see `Drop for Comm`), and says
    /// how it went: `Ok(())` when this rank's stream drained and every rank met the
    /// teardown, so that its memory was freed; otherwise the first thing that failed
    /// (this rank's queued work, or the teardown exchange: a peer gone, late, or making
    /// another collective call), and the memory a peer may still write into was parked
    /// (where a peer shares it) instead of freed. Every rank calls it or drops its
    /// `Comm`, like any collective call.
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
            let met = if world == 1 {
                Ok(())
            } else {
                bootstrap
                    .barrier_within(TEARDOWN_BARRIER_TIMEOUT)
                    .map_err(Error::from)
            };
            idle.and(met)
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
            super::parking::free_expired();
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
