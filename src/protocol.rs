//! The counter barrier of the signal protocol, written once and generic over how a
//! counter cell is reached.
//!
//! The host backend runs [`barrier`] over `std` atomics in the signal memory of
//! `include/peercomm_signal.h`; the loom model (`tests/loom_barrier.rs`) runs the very
//! same function over loom's atomics, so the model checks the algorithm the host
//! backend executes rather than a copy that could drift. The CUDA and HIP kernels
//! implement the same steps in device code.
//!
//! One barrier of block `b` of group rank `me` in a group of `width` ranks, in barrier
//! domain `d`:
//! 1. for every peer `t` (itself included): `v = ++self_counter[d][b][t]` (wrapping),
//!    then store `v` into peer `t`'s `peer_counter[d][v % 2][b][me]`;
//! 2. for every peer `t`: spin until the own `peer_counter[d][v % 2][b][t] == v`.
//!
//! The banks are double by generation parity: a fast peer that already reached the
//! next barrier writes `v + 1` into the other bank, so it cannot overwrite the `v` a
//! slow block is still waiting for. A barrier that publishes data stores with
//! `Release`; the wait always loads with `Acquire` (Rust's memory model needs it for
//! the pairing, and it is free on the host).

use std::sync::atomic::{AtomicU32, Ordering};

/// One 32-bit counter of the signal memory: what the barrier needs of it.
pub trait CounterCell {
    /// Loads the counter.
    fn load(&self, order: Ordering) -> u32;
    /// Stores `value` into the counter.
    fn store(&self, value: u32, order: Ordering);
}

impl CounterCell for AtomicU32 {
    #[inline]
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }
    #[inline]
    fn store(&self, value: u32, order: Ordering) {
        AtomicU32::store(self, value, order)
    }
}

/// The signals of one group as the barrier sees them, indexed by group rank
/// (`0 .. width`): member `m`'s counters as this rank reaches them (its own directly,
/// the peers' over P2P).
pub trait BarrierSignals {
    /// The counter cell type.
    type Cell: CounterCell + ?Sized;
    /// `self_counter[domain][block][peer]` of member `member`'s signal.
    fn self_counter(&self, member: usize, domain: usize, block: usize, peer: usize) -> &Self::Cell;
    /// `peer_counter[domain][parity][block][writer]` of member `member`'s signal.
    fn peer_counter(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> &Self::Cell;
}

/// What the barrier does between two loads of a counter that has not arrived yet.
pub trait Backoff {
    /// Why waiting stopped (a timeout on the host; uninhabited where waits are unbounded).
    type Timeout;
    /// Called after each load that did not see the expected value: spins or yields,
    /// and returns `Err` to abandon the barrier.
    fn wait(&mut self) -> Result<(), Self::Timeout>;
}

/// Which barrier of a group this is: the group rank of the caller, the group width,
/// the barrier domain (counter bank) and the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarrierSite {
    /// The caller's rank within its group.
    pub me: usize,
    /// Ranks in the group.
    pub width: usize,
    /// Barrier domain: `barrier_domain(width, world)`.
    pub domain: usize,
    /// Block index.
    pub block: usize,
}

/// The counter barrier (see the module docs). `publish`: data written before the
/// barrier by any group member's block `block` is visible after it to this block
/// (release stores); otherwise the stores are relaxed and the barrier only orders
/// arrival. Returns the backoff's error if it gives up; the counters are then left
/// mid-barrier and the signal must be re-initialised.
#[inline]
pub fn barrier<S, W>(
    signals: &S,
    site: BarrierSite,
    publish: bool,
    backoff: &mut W,
) -> Result<(), W::Timeout>
where
    S: BarrierSignals + ?Sized,
    W: Backoff + ?Sized,
{
    let BarrierSite {
        me,
        width,
        domain: d,
        block: b,
    } = site;
    let store_order = if publish {
        Ordering::Release
    } else {
        Ordering::Relaxed
    };
    let mut v = 0u32;
    for t in 0..width {
        let counter = signals.self_counter(me, d, b, t);
        v = counter.load(Ordering::Relaxed).wrapping_add(1);
        counter.store(v, Ordering::Relaxed);
        signals
            .peer_counter(t, d, (v % 2) as usize, b, me)
            .store(v, store_order);
    }
    for t in 0..width {
        let flag = signals.peer_counter(me, d, (v % 2) as usize, b, t);
        while flag.load(Ordering::Acquire) != v {
            backoff.wait()?;
        }
    }
    Ok(())
}
