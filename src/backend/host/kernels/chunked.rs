//! Host port of `one_stage_chunked` (kernels-common/peercomm_kernels.h): the staged
//! one-stage all-reduce of a message longer than one chunk, through the payload in
//! chunks of C = `stage_input` packs, chunk k in half k % 2 of every member's payload.
//! The same steps and barriers as the device, per block:
//!
//! stage 0, Publish, {stage k+1 into the other half, reduce k, Publish} for every k
//! but the last, reduce the last chunk, End.
//!
//! Pack `k*C + i` is staged and read by block `i % blocks` (the host's one thread per
//! block: the device's thread `i % stride`, counted from the chunk's first pack), so a
//! block reads from each member's half exactly what that member's same-index block
//! staged and published, and writes the same positions of a half for every chunk that
//! uses it. Chunk k+2 overwrites half k % 2 only after the Publish barrier that follows
//! this block's reduce of chunk k, at which every peer's same-index block arrives after
//! its last read of chunk k there. Each element is summed by `reduce_element`, in
//! group-rank order from `sum_start`, as the unchunked kernel does: the same bits.

use super::{barrier, block_packs, lanes, pack_range, reduce_element, store, Stop};
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::{AllReduceArgs, MAX_GPUS, PACK_BYTES};

/// Whether a one-stage launch runs in chunks: staged, and longer than one chunk (a
/// message of at most `stage_input` packs is staged whole).
pub(super) fn is_chunked<T>(args: &AllReduceArgs) -> bool {
    let packs = (args.num_elements as usize).div_ceil(lanes::<T>());
    args.stage_input != 0 && packs > args.stage_input as usize
}

/// Chunk `k` of a message of `n` elements in chunks of `cap` packs: its packs.
fn chunk(k: usize, cap: usize, n: usize, lanes: usize) -> std::ops::Range<usize> {
    let packs = n.div_ceil(lanes);
    k * cap..((k + 1) * cap).min(packs)
}

/// Where member `q`'s half of chunk `k` starts: half k % 2 of its payload.
fn half(args: &AllReduceArgs, q: usize, k: usize) -> u64 {
    args.payloads[q] + ((k % 2) * args.stage_input as usize * PACK_BYTES) as u64
}

/// Copies this block's packs of chunk `k` of the own input into the own half.
unsafe fn stage<T: Element>(args: &AllReduceArgs, k: usize, block: u32, blocks: u32) {
    let n = args.num_elements as usize;
    let l = lanes::<T>();
    let packs = chunk(k, args.stage_input as usize, n, l);
    let dst = half(args, args.group_rank as usize, k) as *mut T;
    let src = args.local_input as *const T;
    for p in block_packs(packs.start, packs.end, block, blocks) {
        for e in pack_range::<T>(p, n) {
            dst.add(e - packs.start * l).write(src.add(e).read());
        }
    }
}

/// Sums this block's packs of chunk `k` from every member's half into the output.
unsafe fn reduce<T: Element>(args: &AllReduceArgs, k: usize, block: u32, blocks: u32) {
    let n = args.num_elements as usize;
    let l = lanes::<T>();
    let width = args.group_width as usize;
    let packs = chunk(k, args.stage_input as usize, n, l);
    let mut halves = [0u64; MAX_GPUS];
    for (q, h) in halves.iter_mut().enumerate().take(width) {
        *h = half(args, q, k);
    }
    let srcs = &halves[..width];
    for p in block_packs(packs.start, packs.end, block, blocks) {
        for e in pack_range::<T>(p, n) {
            store::<T>(
                args.output,
                e,
                reduce_element::<T>(srcs, e - packs.start * l),
            );
        }
    }
}

/// The chunked staged one-stage all-reduce, block `block` of `blocks`.
///
/// # Safety
/// As `run_block`; `stage_input` is at most half the payload in packs (the planner's
/// `staging`), and the message has more packs than it.
pub(super) unsafe fn one_stage_chunked<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let chunks = n.div_ceil(lanes::<T>()).div_ceil(args.stage_input as usize);
    stage::<T>(args, 0, block, blocks);
    barrier(args, block, BarrierKind::Publish)?;
    for k in 0..chunks {
        let last = k + 1 == chunks;
        if !last {
            stage::<T>(args, k + 1, block, blocks);
        }
        reduce::<T>(args, k, block, blocks);
        // Publishes chunk k + 1, and tells the peers this block is done with chunk k.
        let kind = if last {
            BarrierKind::End
        } else {
            BarrierKind::Publish
        };
        barrier(args, block, kind)?;
    }
    Ok(())
}
