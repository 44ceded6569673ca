//! Host ports of kernels-common/peercomm_collectives.h: all-gather, reduce-scatter,
//! broadcast, scatter and the fused all-reduce + residual + RMSNorm (one-stage and
//! Lamport). A staged range gives pack k to block k % blocks for the staging copy and
//! the readers alike, so the per-block Publish barrier orders every read after its write.

use super::lamport::{
    lamport_check_headers, lamport_end, lamport_entry, lamport_pack_sums, lamport_pack_words,
    lamport_push, lamport_push_header,
};
use super::packs::{copy_packs, elem, lanes, pack_sums, reduce_packs, store};
use super::signals::{abort_word, barrier, first_barrier};
use super::wait::{Spinner, Stop};
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::{reduce_scatter_part, AllReduceArgs, MAX_GPUS, PACK_BYTES};

/// Bytes of `n` elements rounded up to whole packs.
fn padded<T>(n: usize) -> u64 {
    (n.div_ceil(lanes::<T>()) * PACK_BYTES) as u64
}

/// Where part q of a reduce-scatter input starts in a staged payload: every part at a
/// pack boundary.
fn staged_part_offset<T>(n: usize, width: usize, q: usize) -> u64 {
    (0..q)
        .map(|s| padded::<T>(reduce_scatter_part(n, width, s).len()))
        .sum()
}

pub(super) unsafe fn all_gather<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    if args.stage_input != 0 {
        copy_packs::<T>(args.local_input, args.payloads[me], n, block, blocks);
    }
    first_barrier(args, block, args.stage_input != 0)?;
    for i in 0..width {
        let q = (me + i) % width;
        copy_packs::<T>(
            args.inputs[q],
            elem::<T>(args.output, q * n),
            n,
            block,
            blocks,
        );
    }
    barrier(args, block, BarrierKind::End)
}

pub(super) unsafe fn reduce_scatter<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    let staged = args.stage_input != 0;
    if staged {
        for q in 0..width {
            let part = reduce_scatter_part(n, width, q);
            let dst = args.payloads[me] + staged_part_offset::<T>(n, width, q);
            copy_packs::<T>(
                elem::<T>(args.local_input, part.start),
                dst,
                part.len(),
                block,
                blocks,
            );
        }
    }
    first_barrier(args, block, args.stage_input != 0)?;
    let mine = reduce_scatter_part(n, width, me);
    let mut srcs = [0u64; MAX_GPUS];
    for (s, src) in srcs.iter_mut().enumerate().take(width) {
        *src = if staged {
            args.inputs[s] + staged_part_offset::<T>(n, width, me)
        } else {
            elem::<T>(args.inputs[s], mine.start)
        };
    }
    reduce_packs::<T>(&srcs[..width], args.output, mine.len(), block, blocks);
    barrier(args, block, BarrierKind::End)
}

pub(super) unsafe fn broadcast<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (me, root) = (args.group_rank as usize, args.root as usize);
    if args.stage_input != 0 && me == root {
        copy_packs::<T>(args.local_input, args.payloads[me], n, block, blocks);
    }
    first_barrier(args, block, args.stage_input != 0)?;
    if me != root {
        copy_packs::<T>(args.inputs[root], args.output, n, block, blocks);
    } else if args.output != args.local_input {
        copy_packs::<T>(args.local_input, args.output, n, block, blocks);
    }
    barrier(args, block, BarrierKind::End)
}

pub(super) unsafe fn scatter<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let (width, me, root) = (
        args.group_width as usize,
        args.group_rank as usize,
        args.root as usize,
    );
    let part_bytes = padded::<T>(n);
    let staged = args.stage_input != 0;
    if staged && me == root {
        for q in 0..width {
            let dst = args.payloads[me] + q as u64 * part_bytes;
            copy_packs::<T>(elem::<T>(args.local_input, q * n), dst, n, block, blocks);
        }
    }
    first_barrier(args, block, args.stage_input != 0)?;
    let src = if me == root {
        elem::<T>(args.local_input, me * n)
    } else if staged {
        args.inputs[root] + me as u64 * part_bytes
    } else {
        elem::<T>(args.inputs[root], me * n)
    };
    copy_packs::<T>(src, args.output, n, block, blocks);
    barrier(args, block, BarrierKind::End)
}

/// Row `t` of both fused kernels: `sums(p)` gives pack p's f32 sums over the group in
/// group-rank order (or why the block stopped). The unfused sequence's roundings (sum,
/// then residual, to T); the mean square in element order (the GPUs use a tree, so host
/// and GPU bits may differ in the output, while ranks and kernels of one backend
/// agree). Only the row's own data, the hidden size and epsilon enter.
pub(super) unsafe fn rmsnorm_row<T: Element>(
    args: &AllReduceArgs,
    t: usize,
    mut sums: impl FnMut(usize) -> Result<[f32; 8], Stop>,
) -> Result<(), Stop> {
    let hidden = args.hidden as usize;
    let l = lanes::<T>();
    let row = t * hidden;
    let mut sq = 0f32;
    // `hidden` is whole packs: every pack of the row is full.
    for p in row / l..(row + hidden) / l {
        let acc = sums(p)?;
        for (j, e) in (p * l..(p + 1) * l).enumerate() {
            let sum = T::from_f32(acc[j]).to_f32();
            let res = (args.residual as *mut T).add(e);
            let r = T::from_f32(sum + res.read_unaligned().to_f32());
            res.write_unaligned(r);
            sq += r.to_f32() * r.to_f32();
        }
    }
    let inv = 1.0 / (sq / hidden as f32 + args.epsilon).sqrt();
    for (k, e) in (row..row + hidden).enumerate() {
        let r = (args.residual as *const T).add(e).read_unaligned().to_f32();
        let w = (args.weight as *const T).add(k).read_unaligned().to_f32();
        store::<T>(args.output, e, r * inv * w);
    }
    Ok(())
}

/// The one-stage fused kernel: row t by block t % blocks, every member's elements read
/// from `inputs` (the user buffers, or the payloads they were staged into).
pub(super) unsafe fn allreduce_rmsnorm<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let hidden = args.hidden as usize;
    let rows = args.num_elements as usize / hidden;
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    let my_rows = || (block as usize..rows).step_by(blocks as usize);
    if args.stage_input != 0 {
        for t in my_rows() {
            let at = elem::<T>(0, t * hidden);
            copy_packs::<T>(args.local_input + at, args.payloads[me] + at, hidden, 0, 1);
        }
    }
    first_barrier(args, block, args.stage_input != 0)?;
    let srcs = &args.inputs[..width];
    for t in my_rows() {
        rmsnorm_row::<T>(args, t, |p| Ok(pack_sums::<T>(srcs, p)))?;
    }
    barrier(args, block, BarrierKind::End)
}

/// The Lamport fused kernel (no barrier): block b pushes its rows t = b, b + blocks, ...
/// into every peer's Lamport slot, header first, checks every source's header, then
/// computes its rows with [`rmsnorm_row`] as the packs arrive. -0.0 sent as +0.0 leaves
/// every sum unchanged (sums start at +0.0 + x0), so the bits are the one-stage
/// kernel's. The device's `lamport_rmsnorm`.
pub(super) unsafe fn lamport_rmsnorm<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let hidden = args.hidden as usize;
    let l = lanes::<T>();
    let (rows, row_packs) = (n / hidden, hidden / l);
    let my_rows = || (block as usize..rows).step_by(blocks as usize);
    let entry = lamport_entry(args);
    lamport_push_header(args, entry.gen);
    for t in my_rows() {
        for p in t * row_packs..(t + 1) * row_packs {
            lamport_push(
                args,
                entry.gen,
                p,
                lamport_pack_words::<T>(args.local_input, p, n),
            );
        }
    }
    let mut spin = Spinner::new(args.timeout_ns, abort_word(args));
    lamport_check_headers(args, entry.gen, &mut spin)?;
    for t in my_rows() {
        rmsnorm_row::<T>(args, t, |p| {
            lamport_pack_sums::<T>(args, entry.gen, p, n, &mut spin)
        })?;
    }
    lamport_end(args, block, blocks, entry, n / l);
    Ok(())
}
