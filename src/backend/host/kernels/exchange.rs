//! Host port of kernels-common/peercomm_exchange.h: one rank's sends and receives in one
//! launch, each pair of ranks synchronised alone with the pair's descriptor, what is sent
//! staged in region `to` of the sender's payload (see `peercomm_exchange_args`).

use super::packs::Grid;
use super::records::{record_mismatch, tell_aborted};
use super::signals::pair_barrier;
use super::wait::{Flow, Stop};
use crate::protocol::BarrierKind;
use crate::signal::{AllReduceArgs, ExchangeArgs, PACK_BYTES};

/// Where rank `owner` stages what it sends to rank `to`.
fn region(a: &AllReduceArgs, owner: usize, to: usize) -> u64 {
    a.payloads[owner] + to as u64 * u64::from(a.stage_input)
}

/// Copies this block's 16-byte packs of the `n` bytes at `src` to `dst` (pack k by block
/// k % blocks, as the device's threads).
unsafe fn copy_bytes(src: u64, dst: u64, n: u64, g: Grid) {
    let packs = n.div_ceil(PACK_BYTES as u64);
    for p in (u64::from(g.block)..packs).step_by(g.blocks as usize) {
        let first = p * PACK_BYTES as u64;
        let len = (n - first).min(PACK_BYTES as u64) as usize;
        std::ptr::copy_nonoverlapping((src + first) as *const u8, (dst + first) as *mut u8, len);
    }
}

/// Block `g.block` of the exchange `x`.
pub(super) unsafe fn exchange(x: &ExchangeArgs, g: Grid) -> Flow {
    let a = &x.all;
    let (me, width) = (a.group_rank as usize, a.group_width as usize);
    // The blocks of a pair: the first `blocks` of the launch.
    let pair = |blocks: u32| Grid {
        block: g.block,
        blocks,
    };
    for (q, p) in x.peers.iter().enumerate().take(width) {
        if g.block >= p.blocks || p.send_bytes == 0 {
            continue;
        }
        // The own part goes straight to the output; a peer's into the own payload.
        let to = if q == me { p.recv } else { region(a, me, q) };
        copy_bytes(p.send, to, p.send_bytes, pair(p.blocks));
    }
    pair_barrier(x, g, BarrierKind::Publish).inspect_err(|stop| tell_other_peers(x, g, stop))?;
    for (q, p) in x.peers.iter().enumerate().take(width) {
        if q == me || g.block >= p.blocks || p.recv_bytes == 0 {
            continue;
        }
        copy_bytes(region(a, q, me), p.recv, p.recv_bytes, pair(p.blocks));
    }
    pair_barrier(x, g, BarrierKind::End).inspect_err(|stop| tell_other_peers(x, g, stop))
}

/// After a barrier that found a pair's descriptors differ: the block's other exchange
/// peers passed theirs with this rank and would wait for it until the timeout; each is
/// told to stop (`PEER_ABORTED`, naming this rank), after the own record (so that a told
/// peer telling back cannot come first). Not the peer that differs (it finds the same),
/// and not after a timeout (whose record tells every rank) or an abort (the rank that
/// found the cause tells its own peers: no echo).
fn tell_other_peers(x: &ExchangeArgs, g: Grid, stop: &Stop) {
    let Stop::Mismatch { peer, mine, theirs } = *stop else {
        return;
    };
    let a = &x.all;
    let me = a.group_rank as usize;
    // SAFETY: `exchange`'s caller passes live signals (see `run_exchange_block`).
    unsafe { record_mismatch(a, g.block, peer, mine, theirs) };
    for (t, p) in x.peers.iter().enumerate().take(a.group_width as usize) {
        if t != me && t != peer && g.block < p.blocks {
            // SAFETY: as above.
            unsafe { tell_aborted(a, g.block, t, peer, p.call) };
        }
    }
}
