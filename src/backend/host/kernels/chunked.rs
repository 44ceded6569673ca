//! Host ports of the chunked staging of kernels-common (`run_chunks`,
//! `one_stage_chunked`, the collectives' chunked paths): a staged message larger than
//! the payload runs through it in chunks of `stage_input` units (packs of the message,
//! packs of each part, or rows), chunk k in half k % 2 of every member's payload:
//!
//! stage 0, Publish, {stage k+1 into the other half, use k, Publish} for every k but
//! the last, use the last chunk, End.
//!
//! Position `i` of a chunk is staged and read by block `i % blocks`, so a block reads
//! from each member's half exactly what that member's same-index block staged and
//! published. Chunk k+2 overwrites half k % 2 only after the Publish barrier that
//! follows every peer block's last read of chunk k. Sums go through `reduce_element`
//! and rows through `rmsnorm_row`, as unchunked: the same bits.

use super::collectives::rmsnorm_row;
use super::packs::{copy_packs, elem, lanes, pack_sums, reduce_packs};
use super::signals::barrier;
use super::wait::Stop;
use crate::backend::KernelKind;
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::{reduce_scatter_part, AllReduceArgs, MAX_GPUS, PACK_BYTES};

/// Units of a staged message that `stage_input` counts for `kind`: packs of the
/// message, packs of the largest part (reduce-scatter), rows (fused); `None` for kinds
/// that never chunk.
fn units<T>(kind: KernelKind, args: &AllReduceArgs) -> Option<usize> {
    let n = args.num_elements as usize;
    let l = lanes::<T>();
    match kind {
        KernelKind::OneStage
        | KernelKind::AllGather
        | KernelKind::Broadcast
        | KernelKind::Scatter => Some(n.div_ceil(l)),
        KernelKind::ReduceScatter => {
            let width = args.group_width as usize;
            Some(reduce_scatter_part(n, width, 0).len().div_ceil(l))
        }
        KernelKind::AllReduceRmsNorm => Some(n / (args.hidden as usize).max(1)),
        _ => None,
    }
}

/// Whether a launch of `kind` runs in chunks: staged, and more units than one chunk
/// holds (a message of at most `stage_input` units is staged whole).
pub(super) fn is_chunked<T>(kind: KernelKind, args: &AllReduceArgs) -> bool {
    args.stage_input != 0 && units::<T>(kind, args).is_some_and(|u| u > args.stage_input as usize)
}

/// Runs block `block` of a chunked `kind` ([`is_chunked`]).
///
/// # Safety
/// As `run_block`; `stage_input` is a chunk capacity the planner computed for this
/// launch (`staging`, `collective_staging`): two chunks fit the payload.
pub(super) unsafe fn run<T: Element>(
    kind: KernelKind,
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    match kind {
        KernelKind::OneStage => one_stage::<T>(args, block, blocks),
        KernelKind::AllGather => all_gather::<T>(args, block, blocks),
        KernelKind::ReduceScatter => reduce_scatter::<T>(args, block, blocks),
        KernelKind::Broadcast => broadcast::<T>(args, block, blocks),
        KernelKind::Scatter => scatter::<T>(args, block, blocks),
        KernelKind::AllReduceRmsNorm => allreduce_rmsnorm::<T>(args, block, blocks),
        _ => unreachable!("{} does not chunk", kind.name()),
    }
}

/// The halves of the staged chunks (the device's `Chunks`): chunk k in half k % 2 of
/// every member's payload, the second half `half_bytes` in.
struct Chunks {
    count: usize,
    half_bytes: usize,
}

impl Chunks {
    fn half(&self, args: &AllReduceArgs, q: usize, k: usize) -> u64 {
        args.payloads[q] + ((k % 2) * self.half_bytes) as u64
    }
}

/// The pipeline (the device's `run_chunks`): `stage(k)` writes this block's share of
/// chunk k into the own half, `use_(k)` reads chunk k from the members' halves.
unsafe fn run_chunks(
    args: &AllReduceArgs,
    block: u32,
    chunks: &Chunks,
    mut stage: impl FnMut(usize),
    mut use_: impl FnMut(usize) -> Result<(), Stop>,
) -> Result<(), Stop> {
    stage(0);
    barrier(args, block, BarrierKind::Publish)?;
    for k in 0..chunks.count {
        let last = k + 1 == chunks.count;
        if !last {
            stage(k + 1);
        }
        use_(k)?;
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

/// Chunk `k` of a message of `n` elements in chunks of `cap` packs (the device's
/// `chunk_range`): its elements, empty past the message.
fn chunk_elems(n: usize, cap: usize, lanes: usize, k: usize) -> std::ops::Range<usize> {
    let first = (k * cap * lanes).min(n);
    first..((k + 1) * cap * lanes).min(n)
}

/// The chunks of a whole `n`-element message of `l` lanes per pack, `cap` packs each.
fn message_chunks(n: usize, l: usize, cap: usize) -> Chunks {
    Chunks {
        count: n.div_ceil(l).div_ceil(cap),
        half_bytes: cap * PACK_BYTES,
    }
}

/// Stages this block's share of chunk `k` of the own input (a whole message of
/// `num_elements`) into the own half of chunk `k`.
unsafe fn stage_own<T: Element>(
    args: &AllReduceArgs,
    chunks: &Chunks,
    cap: usize,
    k: usize,
    block: u32,
    blocks: u32,
) {
    let r = chunk_elems(args.num_elements as usize, cap, lanes::<T>(), k);
    let dst = chunks.half(args, args.group_rank as usize, k);
    copy_packs::<T>(
        elem::<T>(args.local_input, r.start),
        dst,
        r.len(),
        block,
        blocks,
    );
}

/// Member `q`'s halves of chunk `k`, each `at` bytes in, for `width` members.
fn halves(chunks: &Chunks, args: &AllReduceArgs, k: usize, at: u64) -> [u64; MAX_GPUS] {
    let mut srcs = [0u64; MAX_GPUS];
    for (q, s) in srcs.iter_mut().enumerate().take(args.group_width as usize) {
        *s = chunks.half(args, q, k) + at;
    }
    srcs
}

unsafe fn one_stage<T: Element>(args: &AllReduceArgs, block: u32, blocks: u32) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (l, cap) = (lanes::<T>(), args.stage_input as usize);
    let width = args.group_width as usize;
    let chunks = message_chunks(n, l, cap);
    let stage = |k| stage_own::<T>(args, &chunks, cap, k, block, blocks);
    let use_ = |k| {
        let r = chunk_elems(n, cap, l, k);
        let srcs = halves(&chunks, args, k, 0);
        let dst = elem::<T>(args.output, r.start);
        reduce_packs::<T>(&srcs[..width], dst, r.len(), block, blocks);
        Ok(())
    };
    run_chunks(args, block, &chunks, stage, use_)
}

unsafe fn all_gather<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (l, cap) = (lanes::<T>(), args.stage_input as usize);
    let (me, width) = (args.group_rank as usize, args.group_width as usize);
    let chunks = message_chunks(n, l, cap);
    let stage = |k| stage_own::<T>(args, &chunks, cap, k, block, blocks);
    let use_ = |k| {
        let r = chunk_elems(n, cap, l, k);
        for i in 0..width {
            let q = (me + i) % width;
            let dst = elem::<T>(args.output, q * n + r.start);
            copy_packs::<T>(chunks.half(args, q, k), dst, r.len(), block, blocks);
        }
        Ok(())
    };
    run_chunks(args, block, &chunks, stage, use_)
}

unsafe fn reduce_scatter<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (l, cap) = (lanes::<T>(), args.stage_input as usize);
    let (me, width) = (args.group_rank as usize, args.group_width as usize);
    let part = |q| reduce_scatter_part(n, width, q);
    // Chunk k of part q at pack q * cap of the half.
    let at = |q: usize| (q * cap * PACK_BYTES) as u64;
    let chunks = Chunks {
        count: part(0).len().div_ceil(l).div_ceil(cap),
        half_bytes: width * cap * PACK_BYTES,
    };
    let stage = |k| {
        for q in 0..width {
            let (p, dst) = (part(q), chunks.half(args, me, k) + at(q));
            let r = chunk_elems(p.len(), cap, l, k);
            let src = elem::<T>(args.local_input, p.start + r.start);
            copy_packs::<T>(src, dst, r.len(), block, blocks);
        }
    };
    let use_ = |k| {
        let r = chunk_elems(part(me).len(), cap, l, k);
        let srcs = halves(&chunks, args, k, at(me));
        let dst = elem::<T>(args.output, r.start);
        reduce_packs::<T>(&srcs[..width], dst, r.len(), block, blocks);
        Ok(())
    };
    run_chunks(args, block, &chunks, stage, use_)
}

unsafe fn broadcast<T: Element>(args: &AllReduceArgs, block: u32, blocks: u32) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (l, cap) = (lanes::<T>(), args.stage_input as usize);
    let (me, root) = (args.group_rank as usize, args.root as usize);
    let chunks = message_chunks(n, l, cap);
    let stage = |k| {
        if me == root {
            stage_own::<T>(args, &chunks, cap, k, block, blocks);
        }
    };
    let use_ = |k| {
        let r = chunk_elems(n, cap, l, k);
        let dst = elem::<T>(args.output, r.start);
        if me != root {
            copy_packs::<T>(chunks.half(args, root, k), dst, r.len(), block, blocks);
        } else if args.output != args.local_input {
            let src = elem::<T>(args.local_input, r.start);
            copy_packs::<T>(src, dst, r.len(), block, blocks);
        }
        Ok(())
    };
    run_chunks(args, block, &chunks, stage, use_)
}

unsafe fn scatter<T: Element>(args: &AllReduceArgs, block: u32, blocks: u32) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (l, cap) = (lanes::<T>(), args.stage_input as usize);
    let (me, width, root) = (
        args.group_rank as usize,
        args.group_width as usize,
        args.root as usize,
    );
    // Chunk k of part q at pack q * cap of the root's half.
    let at = |q: usize| (q * cap * PACK_BYTES) as u64;
    let chunks = Chunks {
        count: n.div_ceil(l).div_ceil(cap),
        half_bytes: width * cap * PACK_BYTES,
    };
    let stage = |k| {
        if me == root {
            let r = chunk_elems(n, cap, l, k);
            for q in 0..width {
                let src = elem::<T>(args.local_input, q * n + r.start);
                let dst = chunks.half(args, me, k) + at(q);
                copy_packs::<T>(src, dst, r.len(), block, blocks);
            }
        }
    };
    let use_ = |k| {
        let r = chunk_elems(n, cap, l, k);
        let src = if me == root {
            elem::<T>(args.local_input, me * n + r.start)
        } else {
            chunks.half(args, root, k) + at(me)
        };
        copy_packs::<T>(src, elem::<T>(args.output, r.start), r.len(), block, blocks);
        Ok(())
    };
    run_chunks(args, block, &chunks, stage, use_)
}

/// The fused kernel in runs of `stage_input` rows: row `k*R + i` at row i of the half,
/// staged and computed by block `i % blocks`, through [`rmsnorm_row`] on the chunk seen
/// as a batch of its own (a row's bits depend only on its own data).
unsafe fn allreduce_rmsnorm<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let hidden = args.hidden as usize;
    let (rows, cap) = (
        args.num_elements as usize / hidden,
        args.stage_input as usize,
    );
    let (l, me, width) = (
        lanes::<T>(),
        args.group_rank as usize,
        args.group_width as usize,
    );
    let chunks = Chunks {
        count: rows.div_ceil(cap),
        half_bytes: cap * hidden / l * PACK_BYTES,
    };
    let chunk_rows = |k: usize| cap.min(rows - k * cap);
    let stage = |k| {
        for i in (block as usize..chunk_rows(k)).step_by(blocks as usize) {
            let src = elem::<T>(args.local_input, (k * cap + i) * hidden);
            let dst = elem::<T>(chunks.half(args, me, k), i * hidden);
            copy_packs::<T>(src, dst, hidden, 0, 1);
        }
    };
    let use_ = |k| {
        let first = k * cap * hidden;
        let view = AllReduceArgs {
            num_elements: (chunk_rows(k) * hidden) as u64,
            residual: elem::<T>(args.residual, first),
            output: elem::<T>(args.output, first),
            ..*args
        };
        let srcs = halves(&chunks, args, k, 0);
        for i in (block as usize..chunk_rows(k)).step_by(blocks as usize) {
            rmsnorm_row::<T>(&view, i, |p| Ok(pack_sums::<T>(&srcs[..width], p)))?;
        }
        Ok(())
    };
    run_chunks(args, block, &chunks, stage, use_)
}
