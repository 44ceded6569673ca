//! Host ports of kernels-common/peercomm_kernels.h and peercomm_collectives.h. Data is
//! read from `inputs` or, where a staged message holds more than `stage_input` units, in
//! chunks ([`run_chunks`]): chunk k in half k % 2 of every payload, overwritten by chunk
//! k + 2 only after the Publish barrier that follows the peers' last read of chunk k.
//! Block `i % blocks` stages and reads position `i`, so the per-block barrier orders it.
//! Chunked or not, the bits are the same.

use super::packs::{copy_packs, elem, lanes, op_of, pack_sums, reduce_packs, store, Grid};
use super::signals::{barrier, first_barrier};
use super::wait::{Flow, Stop};
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::{reduce_scatter_part, AllReduceArgs, KIND_REDUCE, MAX_GPUS, PACK_BYTES};

/// Where a launch's data lives: one chunk read from `inputs` (the device's unchunked
/// path), or `count` chunks of `cap` units in the payloads' halves (its `Chunks`).
struct Chunks {
    count: usize,
    cap: usize,
    half_bytes: usize,
    staged: bool,
}

impl Chunks {
    /// A message of `units` units (packs or rows), each `unit_bytes` of a half: in
    /// chunks of `stage_input` units where staged and larger, else one chunk of all.
    fn new(args: &AllReduceArgs, units: usize, unit_bytes: usize) -> Self {
        let (staged, cap) = (args.stage_input != 0, args.stage_input as usize);
        let (count, cap, half_bytes) = match staged && units > cap {
            true => (units.div_ceil(cap), cap, cap * unit_bytes),
            false => (1, units, 0),
        };
        Chunks {
            count,
            cap,
            half_bytes,
            staged,
        }
    }
    fn chunked(&self) -> bool {
        self.count > 1
    }
    /// Where this rank stages chunk `k`.
    fn own(&self, args: &AllReduceArgs, k: usize) -> u64 {
        args.payloads[args.group_rank as usize] + ((k % 2) * self.half_bytes) as u64
    }
    /// Member `q`'s chunk `k`.
    fn src(&self, args: &AllReduceArgs, q: usize, k: usize) -> u64 {
        if self.chunked() {
            args.payloads[q] + ((k % 2) * self.half_bytes) as u64
        } else {
            args.inputs[q]
        }
    }
    /// Every member's chunk `k`, `at(q)` bytes in.
    fn srcs(&self, args: &AllReduceArgs, k: usize, at: u64) -> [u64; MAX_GPUS] {
        let width = args.group_width as usize;
        std::array::from_fn(|q| {
            if q < width {
                self.src(args, q, k) + at
            } else {
                0
            }
        })
    }
    /// Stages this block's share of chunk `k` of the own input (a whole message).
    unsafe fn stage_own<T: Element>(&self, args: &AllReduceArgs, k: usize, g: Grid) {
        let r = self.elems::<T>(args.num_elements as usize, k);
        let src = elem::<T>(args.local_input, r.start);
        copy_packs::<T>(src, self.own(args, k), r.len(), g);
    }
    /// Elements of chunk `k` of an `n`-element range (the device's `chunk_range`).
    fn elems<T>(&self, n: usize, k: usize) -> std::ops::Range<usize> {
        let l = lanes::<T>();
        (k * self.cap * l).min(n)..((k + 1) * self.cap * l).min(n)
    }
}

/// The pipeline (the device's `run_chunks`): `stage(k)` writes this block's share of
/// chunk k where [`Chunks::own`] says, `use_(k)` reads chunk k. Unchunked: stage, the
/// first barrier, use, End.
unsafe fn run_chunks(
    args: &AllReduceArgs,
    g: Grid,
    chunks: &Chunks,
    mut stage: impl FnMut(usize),
    mut use_: impl FnMut(usize) -> Flow,
) -> Flow {
    use BarrierKind::{End, Publish};
    if chunks.staged {
        stage(0);
    }
    first_barrier(args, g, chunks.staged)?;
    for k in 0..chunks.count {
        let last = k + 1 == chunks.count;
        if !last {
            stage(k + 1);
        }
        use_(k)?;
        // Publishes chunk k + 1, and tells the peers this block is done with chunk k.
        barrier(args, g, if last { End } else { Publish })?;
    }
    Ok(())
}

/// Whether this rank stores the one-stage kernel's result: every rank of an all-reduce,
/// the root alone of a reduce.
fn stores_result(args: &AllReduceArgs) -> bool {
    args.call[2] & 0x1f != KIND_REDUCE || args.group_rank == args.root
}

/// Each rank reduces every element of the group's data in group-rank order (a reduce:
/// the root alone; the others publish their inputs).
pub(super) unsafe fn one_stage<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let width = args.group_width as usize;
    let c = Chunks::new(args, n.div_ceil(lanes::<T>()), PACK_BYTES);
    let stage = |k| c.stage_own::<T>(args, k, g);
    let use_ = |k| {
        let r = c.elems::<T>(n, k);
        let srcs = c.srcs(args, k, 0);
        let dst = elem::<T>(args.output, r.start);
        if stores_result(args) {
            reduce_packs::<T>(op_of(args), &srcs[..width], dst, r.len(), g);
        }
        Ok(())
    };
    run_chunks(args, g, &c, stage, use_)
}

/// The two-stage all-reduce: rank r sums partition r (`ceil(packs / width)` packs) into
/// its own payload, then gathers every partition from its owner's payload, starting
/// with its own so readers spread over owners. Block b reads what block b of the owner
/// wrote, so the per-block barrier suffices.
pub(super) unsafe fn two_stage<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let (n, l) = (args.num_elements as usize, lanes::<T>());
    let (me, width) = (args.group_rank as usize, args.group_width as usize);
    let part = n.div_ceil(l).div_ceil(width) * l;
    let range = |q: usize| (q * part).min(n)..((q + 1) * part).min(n);
    barrier(args, g, BarrierKind::Start)?;
    let r = range(me);
    let srcs: [u64; MAX_GPUS] = std::array::from_fn(|q| elem::<T>(args.inputs[q], r.start));
    reduce_packs::<T>(op_of(args), &srcs[..width], args.payloads[me], r.len(), g);
    barrier(args, g, BarrierKind::Publish)?;
    for q in (0..width).map(|i| (me + i) % width) {
        let r = range(q);
        let dst = elem::<T>(args.output, r.start);
        copy_packs::<T>(args.payloads[q], dst, r.len(), g);
    }
    barrier(args, g, BarrierKind::End)
}

/// Every member's input lands at `[q * n, (q + 1) * n)` of the output; members read the
/// sources starting with their own group rank, so the peers' links share the load.
pub(super) unsafe fn all_gather<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let (me, width) = (args.group_rank as usize, args.group_width as usize);
    let c = Chunks::new(args, n.div_ceil(lanes::<T>()), PACK_BYTES);
    let stage = |k| c.stage_own::<T>(args, k, g);
    let use_ = |k| {
        let r = c.elems::<T>(n, k);
        for q in (0..width).map(|i| (me + i) % width) {
            let dst = elem::<T>(args.output, q * n + r.start);
            copy_packs::<T>(c.src(args, q, k), dst, r.len(), g);
        }
        Ok(())
    };
    run_chunks(args, g, &c, stage, use_)
}

/// Group rank r sums part r of every member's input. Staged, part q sits at a pack
/// boundary: whole, after the parts before it; chunked, at pack `q * cap` of a half.
pub(super) unsafe fn reduce_scatter<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let l = lanes::<T>();
    let (me, width) = (args.group_rank as usize, args.group_width as usize);
    let part = |q| reduce_scatter_part(n, width, q);
    let c = Chunks::new(args, part(0).len().div_ceil(l), width * PACK_BYTES);
    let at = |q: usize| -> u64 {
        if c.chunked() {
            (q * c.cap * PACK_BYTES) as u64
        } else if c.staged {
            (0..q)
                .map(|s| (part(s).len().div_ceil(l) * PACK_BYTES) as u64)
                .sum()
        } else {
            elem::<T>(0, part(q).start)
        }
    };
    let stage = |k| {
        for q in 0..width {
            let (p, dst) = (part(q), c.own(args, k) + at(q));
            let r = c.elems::<T>(p.len(), k);
            let src = elem::<T>(args.local_input, p.start + r.start);
            copy_packs::<T>(src, dst, r.len(), g);
        }
    };
    let use_ = |k| {
        let r = c.elems::<T>(part(me).len(), k);
        let srcs = c.srcs(args, k, at(me));
        let dst = elem::<T>(args.output, r.start);
        reduce_packs::<T>(op_of(args), &srcs[..width], dst, r.len(), g);
        Ok(())
    };
    run_chunks(args, g, &c, stage, use_)
}

/// The root's input to every member's output (the root copies its own, unless in place).
pub(super) unsafe fn broadcast<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let (me, root) = (args.group_rank as usize, args.root as usize);
    let c = Chunks::new(args, n.div_ceil(lanes::<T>()), PACK_BYTES);
    let stage = |k| {
        if me == root {
            c.stage_own::<T>(args, k, g);
        }
    };
    let use_ = |k| {
        let r = c.elems::<T>(n, k);
        let dst = elem::<T>(args.output, r.start);
        if me != root {
            copy_packs::<T>(c.src(args, root, k), dst, r.len(), g);
        } else if args.output != args.local_input {
            let src = elem::<T>(args.local_input, r.start);
            copy_packs::<T>(src, dst, r.len(), g);
        }
        Ok(())
    };
    run_chunks(args, g, &c, stage, use_)
}

/// Member q gets `[q * n, (q + 1) * n)` of the root's input (the root from its input);
/// staged, the root puts part q at pack `q * cap` of its payload or half.
pub(super) unsafe fn scatter<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let (me, root) = (args.group_rank as usize, args.root as usize);
    let width = args.group_width as usize;
    let c = Chunks::new(args, n.div_ceil(lanes::<T>()), width * PACK_BYTES);
    let at = |q: usize| {
        if c.staged {
            (q * c.cap * PACK_BYTES) as u64
        } else {
            elem::<T>(0, q * n)
        }
    };
    let stage = |k| {
        let r = c.elems::<T>(n, k);
        for q in (0..width).filter(|_| me == root) {
            let src = elem::<T>(args.local_input, q * n + r.start);
            copy_packs::<T>(src, c.own(args, k) + at(q), r.len(), g);
        }
    };
    let use_ = |k| {
        let r = c.elems::<T>(n, k);
        let src = if me == root {
            elem::<T>(args.local_input, me * n + r.start)
        } else {
            c.src(args, root, k) + at(me)
        };
        copy_packs::<T>(src, elem::<T>(args.output, r.start), r.len(), g);
        Ok(())
    };
    run_chunks(args, g, &c, stage, use_)
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
) -> Flow {
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

/// The fused kernel: row i of a chunk by block `i % blocks`, through [`rmsnorm_row`] on
/// the chunk seen as a batch of its own (a row's bits depend only on its own data).
pub(super) unsafe fn allreduce_rmsnorm<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let hidden = args.hidden as usize;
    let rows = args.num_elements as usize / hidden;
    let width = args.group_width as usize;
    let row_bytes = elem::<T>(0, hidden) as usize;
    let c = Chunks::new(args, rows, row_bytes);
    let chunk_rows = |k: usize| c.cap.min(rows - k * c.cap);
    let my_rows = move |k| (g.block as usize..chunk_rows(k)).step_by(g.blocks as usize);
    let stage = |k| {
        for i in my_rows(k) {
            let src = elem::<T>(args.local_input, (k * c.cap + i) * hidden);
            let dst = elem::<T>(c.own(args, k), i * hidden);
            // Bytes (views need not be aligned); the input and the own payload are disjoint.
            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, row_bytes);
        }
    };
    let use_ = |k| {
        let first = k * c.cap * hidden;
        let view = AllReduceArgs {
            num_elements: (chunk_rows(k) * hidden) as u64,
            residual: elem::<T>(args.residual, first),
            output: elem::<T>(args.output, first),
            ..*args
        };
        let srcs = c.srcs(args, k, 0);
        for i in my_rows(k) {
            rmsnorm_row::<T>(&view, i, |p| Ok(pack_sums::<T>(&srcs[..width], p)))?;
        }
        Ok(())
    };
    run_chunks(args, g, &c, stage, use_)
}
