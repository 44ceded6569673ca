//! The counter barrier of the signal protocol, generic over how a counter cell is
//! reached: the host backend runs it over `std` atomics, the loom model
//! (`tests/loom_barrier.rs`) over loom's, and the device kernels implement the same steps.
//!
//! One barrier of block `b` of group rank `me`, in barrier domain `d`:
//! 1. for every peer `t` (itself included): `v = ++self_counter[d][b][t]` (wrapping),
//!    then store `v` into peer `t`'s `peer_counter[d][v % 2][b][me]`;
//! 2. for every peer `t`: spin until the own `peer_counter[d][v % 2][b][t] == v`.
//!
//! An arrival also carries the writer's call descriptor ([`CALL_WORDS`] words); a reader
//! compares it with its own and stops with [`BarrierStop::Mismatch`], so ranks making
//! different calls get a typed error instead of each other's stale data. The banks are
//! double by parity: a fast peer already at the next barrier writes `v + 1` into the
//! other bank, never over the `v` a slow block still waits for.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::signal::{CALL_WORDS, MAX_GPUS};

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

/// The signals of one group as the barrier sees them, indexed by group rank: member
/// `m`'s counters as this rank reaches them (its own directly, the peers' over P2P).
pub trait BarrierSignals {
    /// The counter cell type.
    type Cell: CounterCell + ?Sized;
    /// `self_counter[domain][block][peer]` of member `member`'s signal.
    fn self_counter(&self, member: usize, domain: usize, block: usize, peer: usize) -> &Self::Cell;
    /// `peer_counter[domain][parity][block][writer]` of member `member`'s signal: the
    /// counter word of the arrival.
    fn peer_counter(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> &Self::Cell;
    /// The call-descriptor words of the same arrival, in descriptor order, or `None`
    /// where the signals carry none (the loom model checks the counters alone).
    fn arrival_call(
        &self,
        _member: usize,
        _domain: usize,
        _parity: usize,
        _block: usize,
        _writer: usize,
    ) -> Option<[&Self::Cell; CALL_WORDS]> {
        None
    }
}

/// Why a barrier with call descriptors stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierStop<T> {
    /// The backoff gave up while waiting for group rank `awaited`.
    Gave {
        /// The group rank whose arrival did not come.
        awaited: usize,
        /// The backoff's reason.
        why: T,
    },
    /// Group rank `peer` arrived with another call descriptor (`theirs`).
    Mismatch {
        /// The group rank whose call differs.
        peer: usize,
        /// Its descriptor words.
        theirs: [u32; CALL_WORDS],
    },
}

/// What the barrier does between two loads of a counter that has not arrived yet.
pub trait Backoff {
    /// Why waiting stopped (a timeout or the rank's abort word on the host;
    /// uninhabited where waits are unbounded).
    type Timeout;
    /// Called after each load that did not see the expected value: spins or yields,
    /// and returns `Err` to abandon the barrier.
    fn wait(&mut self) -> Result<(), Self::Timeout>;
}

/// What a barrier orders, named at every call site (as in the device source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierKind {
    /// Orders arrival only: no data is published, so relaxed stores and loads.
    Start,
    /// Publishes data: what any group member's same-index block wrote before it is
    /// visible to this block after it (release stores, acquire loads).
    Publish,
    /// Ends a collective: keeps the peers from overwriting what this block read before
    /// it. Relaxed on the devices (no load value speculation on the GPUs targeted,
    /// though PTX and HIP formally ask for a release); the host strengthens it.
    End,
}

impl BarrierKind {
    /// Orderings of the arrival store and of the spin's loads on the devices (the
    /// crate's own models; not part of the device API).
    #[doc(hidden)]
    #[cfg_attr(not(feature = "unstable"), allow(dead_code))]
    pub const fn device_orderings(self) -> (Ordering, Ordering) {
        match self {
            BarrierKind::Publish => (Ordering::Release, Ordering::Acquire),
            BarrierKind::Start | BarrierKind::End => (Ordering::Relaxed, Ordering::Relaxed),
        }
    }
    /// Orderings on the host: always release/acquire, since its kernels read peer data
    /// with plain loads.
    #[doc(hidden)]
    pub const fn host_orderings(self) -> (Ordering, Ordering) {
        (Ordering::Release, Ordering::Acquire)
    }
}

/// Which barrier of a group this is.
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

/// [`barrier_with_call`] without a call descriptor. Returns the backoff's error if it
/// gives up (the signal must then be re-initialised).
#[inline]
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub fn barrier<S, W>(
    signals: &S,
    site: BarrierSite,
    orderings: (Ordering, Ordering),
    backoff: &mut W,
) -> Result<(), W::Timeout>
where
    S: BarrierSignals + ?Sized,
    W: Backoff + ?Sized,
{
    barrier_with_call(signals, site, orderings, None, backoff).map_err(|stop| match stop {
        BarrierStop::Gave { why, .. } => why,
        BarrierStop::Mismatch { .. } => unreachable!("no descriptor, no mismatch"),
    })
}

/// The counter barrier with this rank's call descriptor `call` published beside every
/// arrival (where the signals have room for it) and compared with every peer's.
#[inline]
pub fn barrier_with_call<S, W>(
    signals: &S,
    site: BarrierSite,
    orderings: (Ordering, Ordering),
    call: Option<[u32; CALL_WORDS]>,
    backoff: &mut W,
) -> Result<(), BarrierStop<W::Timeout>>
where
    S: BarrierSignals + ?Sized,
    W: Backoff + ?Sized,
{
    barrier_of(signals, site, orderings, &EveryMember(call), backoff)
}

/// Which group ranks a barrier waits for, and the descriptor it publishes to and expects
/// from each.
pub trait Members {
    /// Whether group rank `t` takes part.
    fn takes_part(&self, t: usize) -> bool;
    /// The descriptor of the arrivals exchanged with group rank `t`, if any.
    fn call(&self, t: usize) -> Option<[u32; CALL_WORDS]>;
}

/// Every member of the group, with one descriptor (the collectives).
#[derive(Clone, Copy, Debug)]
pub struct EveryMember(pub Option<[u32; CALL_WORDS]>);

impl Members for EveryMember {
    fn takes_part(&self, _t: usize) -> bool {
        true
    }
    fn call(&self, _t: usize) -> Option<[u32; CALL_WORDS]> {
        self.0
    }
}

/// The counter barrier over the group ranks `members` names (this rank's own counter
/// included where it does), each with its own counter value: a barrier of a subset of
/// the group advances only the counters of the ranks in it.
#[inline]
pub fn barrier_of<S, W, M>(
    signals: &S,
    site: BarrierSite,
    (store_order, load_order): (Ordering, Ordering),
    members: &M,
    backoff: &mut W,
) -> Result<(), BarrierStop<W::Timeout>>
where
    S: BarrierSignals + ?Sized,
    W: Backoff + ?Sized,
    M: Members + ?Sized,
{
    let (me, width, d, b) = (site.me, site.width, site.domain, site.block);
    let mut values = [0u32; MAX_GPUS];
    for t in (0..width).filter(|&t| members.takes_part(t)) {
        let counter = signals.self_counter(me, d, b, t);
        let v = counter.load(Ordering::Relaxed).wrapping_add(1);
        counter.store(v, Ordering::Relaxed);
        values[t] = v;
        let parity = (v % 2) as usize;
        if let (Some(words), Some(cells)) =
            (members.call(t), signals.arrival_call(t, d, parity, b, me))
        {
            for (cell, word) in cells.into_iter().zip(words) {
                cell.store(word, Ordering::Relaxed);
            }
        }
        signals
            .peer_counter(t, d, parity, b, me)
            .store(v, store_order);
    }
    for t in (0..width).filter(|&t| members.takes_part(t)) {
        let v = values[t];
        let parity = (v % 2) as usize;
        let flag = signals.peer_counter(me, d, parity, b, t);
        while flag.load(load_order) != v {
            backoff
                .wait()
                .map_err(|why| BarrierStop::Gave { awaited: t, why })?;
        }
        if let (Some(mine), Some(cells)) =
            (members.call(t), signals.arrival_call(me, d, parity, b, t))
        {
            let theirs = cells.map(|c| c.load(Ordering::Relaxed));
            if theirs != mine {
                return Err(BarrierStop::Mismatch { peer: t, theirs });
            }
        }
    }
    Ok(())
}
