//! Host port of kernels-common/peercomm_exchange.h: one rank's sends and receives in one
//! launch, each pair of ranks synchronised alone with the pair's descriptor, what is sent
//! staged in region `to` of the sender's payload, or read in place where the peer reaches
//! the sender's buffer (see `peercomm_exchange_args`).

use super::packs::Grid;
use super::records::{record_mismatch, tell_aborted};
use super::signals::{atomic, pair_barrier, signal};
use super::wait::{Flow, Stop};
use crate::protocol::BarrierKind;
use crate::signal::{AllReduceArgs, ExchangeArgs, PACK_BYTES};
use std::sync::atomic::{AtomicU32, Ordering};

/// `exchange_source[from]` of the signal at `addr`: where its rank reads what rank
/// `from` sends it (low and high words).
unsafe fn source_words<'a>(addr: u64, from: usize) -> [&'a AtomicU32; 2] {
    let s = signal(addr);
    let words = std::ptr::addr_of_mut!((*s).exchange_source[from]) as *mut u32;
    [atomic(words), atomic(words.add(1))]
}

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
        if q != me {
            // Where q reads this rank's data: the buffer itself, or (0) the region.
            let [low, high] = source_words(a.signals[q], me);
            low.store(p.send_remote as u32, Ordering::Relaxed);
            high.store((p.send_remote >> 32) as u32, Ordering::Relaxed);
            if p.send_remote != 0 {
                continue;
            }
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
        let [low, high] = source_words(a.signals[me], q);
        let remote =
            u64::from(low.load(Ordering::Relaxed)) | u64::from(high.load(Ordering::Relaxed)) << 32;
        let from = if remote != 0 {
            remote
        } else {
            region(a, q, me)
        };
        copy_bytes(from, p.recv, p.recv_bytes, pair(p.blocks));
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
