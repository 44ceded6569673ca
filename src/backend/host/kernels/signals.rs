//! Signal access in the host kernels: signal words as atomics (error record, detail,
//! `quit`, the abort word), and the counter barrier of one block over the group's
//! counters ([`barrier`], through the protocol's [`BarrierSignals`]).

use std::sync::atomic::AtomicU32;

use super::packs::Grid;
use super::wait::{Flow, Spinner, Stop};
use crate::protocol::{
    self, BarrierKind, BarrierSignals, BarrierSite, BarrierStop, EveryMember, Members,
};
use crate::signal::{AllReduceArgs, ExchangeArgs, Signal, CALL_WORDS, ERROR_CODE};

pub(super) fn atomic<'a>(p: *mut u32) -> &'a AtomicU32 {
    // SAFETY: callers pass 4-byte aligned addresses inside live signal allocations,
    // which are only ever accessed atomically while kernels run.
    unsafe { AtomicU32::from_ptr(p) }
}

pub(super) fn signal(addr: u64) -> *mut Signal {
    addr as *mut Signal
}

/// Word `i` of the error record of the signal at `addr`.
pub(super) unsafe fn error_word<'a>(addr: u64, i: usize) -> &'a AtomicU32 {
    let s = signal(addr);
    atomic((std::ptr::addr_of_mut!((*s).error_state) as *mut u32).add(i))
}

/// The rank's abort word: its own error code (non-zero = stop).
pub(super) unsafe fn abort_word<'a>(args: &AllReduceArgs) -> &'a AtomicU32 {
    error_word(args.signals[args.group_rank as usize], ERROR_CODE)
}

/// `quit[block][writer]` of the signal at `addr`.
pub(super) unsafe fn quit_cell<'a>(addr: u64, block: u32, writer: usize) -> &'a AtomicU32 {
    let s = signal(addr);
    atomic(std::ptr::addr_of_mut!((*s).quit[block as usize][writer]))
}

/// `user_grid` (arrivals, barriers passed) of the signal at `addr`.
pub(super) unsafe fn user_grid<'a>(addr: u64) -> (&'a AtomicU32, &'a AtomicU32) {
    let s = signal(addr);
    let words = std::ptr::addr_of_mut!((*s).user_grid) as *mut u32;
    (atomic(words), atomic(words.add(1)))
}

/// Word `i` of the error detail of the signal at `addr`.
pub(super) unsafe fn detail_word<'a>(addr: u64, i: usize) -> &'a AtomicU32 {
    let s = signal(addr);
    atomic((std::ptr::addr_of_mut!((*s).error_detail) as *mut u32).add(i))
}

/// The signals of one launch's group, built only by [`barrier`], whose caller guarantees
/// that `args.signals[..group_width]` are live signals, accessed only atomically.
struct HostSignals<'a>(&'a AllReduceArgs);

impl HostSignals<'_> {
    fn signal(&self, member: usize) -> *mut Signal {
        signal(self.0.signals[member])
    }
}

impl BarrierSignals for HostSignals<'_> {
    type Cell = AtomicU32;
    fn self_counter(&self, member: usize, domain: usize, block: usize, peer: usize) -> &AtomicU32 {
        let s = self.signal(member);
        // SAFETY: `s` is a live signal allocation (see `HostSignals`); the place
        // projection is bounds-checked.
        atomic(unsafe { std::ptr::addr_of_mut!((*s).self_counter[domain][block][peer]) })
    }
    fn peer_counter(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> &AtomicU32 {
        let s = self.signal(member);
        // SAFETY: as in `self_counter`.
        atomic(unsafe {
            std::ptr::addr_of_mut!((*s).peer_counter[domain][parity][block][writer][0])
        })
    }
    fn arrival_call(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> Option<[&AtomicU32; CALL_WORDS]> {
        let s = self.signal(member);
        // Word i of the descriptor is lane 1 + i % 3 of pack i / 3 (lane 0 of each pack
        // is the devices' copy of the counter; the host orders by the counter word of
        // pack 0 alone).
        Some(std::array::from_fn(|i| {
            // SAFETY: as in `self_counter`.
            atomic(unsafe {
                std::ptr::addr_of_mut!(
                    (*s).peer_counter[domain][parity][block][writer][4 * (i / 3) + 1 + i % 3]
                )
            })
        }))
    }
}

/// The counter barrier of one block across its group ([`protocol::barrier`], the code
/// the loom model checks), with the host's orderings for `kind`.
pub(super) unsafe fn barrier(args: &AllReduceArgs, g: Grid, kind: BarrierKind) -> Flow {
    barrier_among(args, g, kind, &EveryMember(Some(args.call)))
}

/// The barrier members of block `block` of an exchange: the peers it moves data with,
/// each pair with its own descriptor.
struct ExchangeMembers<'a> {
    x: &'a ExchangeArgs,
    block: u32,
}

impl Members for ExchangeMembers<'_> {
    fn takes_part(&self, t: usize) -> bool {
        t != self.x.all.group_rank as usize && self.block < self.x.peers[t].blocks
    }
    fn call(&self, t: usize) -> Option<[u32; CALL_WORDS]> {
        Some(self.x.peers[t].call)
    }
}

/// The exchange's barrier: each pair of ranks alone.
pub(super) unsafe fn pair_barrier(x: &ExchangeArgs, g: Grid, kind: BarrierKind) -> Flow {
    barrier_among(&x.all, g, kind, &ExchangeMembers { x, block: g.block })
}

/// The barrier of `members` ([`protocol::barrier_of`]); a mismatch names the
/// descriptor this rank published to that peer.
unsafe fn barrier_among(
    args: &AllReduceArgs,
    g: Grid,
    kind: BarrierKind,
    members: &impl Members,
) -> Flow {
    let signals = HostSignals(args);
    let site = BarrierSite {
        me: args.group_rank as usize,
        width: args.group_width as usize,
        domain: args.domain as usize,
        block: g.block as usize,
    };
    let mut spin = Spinner::new(args.timeout_ns, abort_word(args));
    protocol::barrier_of(&signals, site, kind.host_orderings(), members, &mut spin).map_err(
        |stop| match stop {
            BarrierStop::Gave { awaited, why } => why.waiting_for(awaited),
            BarrierStop::Mismatch { peer, theirs } => Stop::Mismatch {
                peer,
                mine: members.call(peer).unwrap_or(args.call),
                theirs,
            },
        },
    )
}

/// A kernel's first barrier: Publish when it staged data for the peers, else Start.
pub(super) unsafe fn first_barrier(args: &AllReduceArgs, g: Grid, staged: bool) -> Flow {
    use BarrierKind::{Publish, Start};
    barrier(args, g, if staged { Publish } else { Start })
}
