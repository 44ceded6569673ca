//! Packs and elements in the host kernels: a block's packs (the device's grid stride),
//! loads and stores through the element's accumulator (f32 for `f32`, `f16`, `bf16`; f64
//! for `f64`; the integer itself) or through f32 (the fused kernels), and the
//! group-rank-order reduction every kernel shares.

use crate::dtype::{Element, ReduceOp};
use crate::signal::{AllReduceArgs, PACK_BYTES};

pub(super) fn lanes<T>() -> usize {
    PACK_BYTES / std::mem::size_of::<T>()
}

/// Element range of pack `p`.
pub(super) fn pack_range<T>(p: usize, n: usize) -> std::ops::Range<usize> {
    let l = lanes::<T>();
    p * l..((p + 1) * l).min(n)
}

/// Block `block` of a launch of `blocks` (one OS thread each).
#[derive(Clone, Copy)]
pub(super) struct Grid {
    pub(super) block: u32,
    pub(super) blocks: u32,
}

/// Packs handled by a block: the device code's grid stride, one thread per block.
pub(super) fn block_packs(first: usize, end: usize, g: Grid) -> Packs {
    (first + g.block as usize..end).step_by(g.blocks as usize)
}

// Loads and stores take any address: the devices serve views that are not 16-byte
// aligned (lane by lane), and a view misaligned even for its element type must stay
// defined behaviour here. The unaligned forms cost nothing on the hosts.

/// Element `i` of the `T`s at `base`, as f32 (`base` need not be aligned).
unsafe fn load<T: Element>(base: u64, i: usize) -> f32 {
    (base as *const T).add(i).read_unaligned().to_f32()
}

/// Stores `x` as element `i` of the `T`s at `base` (`base` need not be aligned).
pub(super) unsafe fn store<T: Element>(base: u64, i: usize, x: f32) {
    (base as *mut T).add(i).write_unaligned(T::from_f32(x))
}

/// Element `i` of the `T`s at `base`, in its accumulator (exact).
unsafe fn load_acc<T: Element>(base: u64, i: usize) -> T::Acc {
    (base as *const T).add(i).read_unaligned().to_acc()
}

/// The operator of the call whose arguments these are (its descriptor's).
pub(super) fn op_of(args: &AllReduceArgs) -> ReduceOp {
    ReduceOp::of_call(&args.call)
}

/// `op` over the group of element `e` of `srcs`, in group-rank order (the same order on
/// every rank, so every rank gets the same bits), in the element's accumulator.
pub(super) unsafe fn reduce_element<T: Element>(op: ReduceOp, srcs: &[u64], e: usize) -> T::Acc {
    let mut acc = op.start(load_acc::<T>(srcs[0], e), srcs.len());
    for &s in &srcs[1..] {
        acc = op.combine(acc, load_acc::<T>(s, e));
    }
    op.finish(acc, srcs.len())
}

/// Address of element `e` of the `T` array at `base`.
pub(super) fn elem<T>(base: u64, e: usize) -> u64 {
    base + (e * std::mem::size_of::<T>()) as u64
}

/// The packs of an `n`-element message a block handles (`Item = usize`).
pub(super) type Packs = std::iter::StepBy<std::ops::Range<usize>>;

/// Copies `packs` of an `n`-element message from `src` to `dst`, pack by pack.
pub(super) unsafe fn copy_packs_of<T: Element>(src: u64, dst: u64, n: usize, packs: Packs) {
    for e in packs.flat_map(|p| pack_range::<T>(p, n)) {
        let x = (src as *const T).add(e).read_unaligned();
        (dst as *mut T).add(e).write_unaligned(x);
    }
}

/// Reduces `packs` of an `n`-element message over `srcs` into `dst`, pack by pack.
pub(super) unsafe fn reduce_packs_of<T: Element>(
    op: ReduceOp,
    srcs: &[u64],
    dst: u64,
    n: usize,
    packs: Packs,
) {
    for e in packs.flat_map(|p| pack_range::<T>(p, n)) {
        let x = T::from_acc(reduce_element::<T>(op, srcs, e));
        (dst as *mut T).add(e).write_unaligned(x);
    }
}

/// Copies this block's packs of an `n`-element message from `src` to `dst`.
pub(super) unsafe fn copy_packs<T: Element>(src: u64, dst: u64, n: usize, g: Grid) {
    copy_packs_of::<T>(src, dst, n, block_packs(0, n.div_ceil(lanes::<T>()), g))
}

/// Reduces this block's packs of an `n`-element message over `srcs` into `dst`.
pub(super) unsafe fn reduce_packs<T: Element>(
    op: ReduceOp,
    srcs: &[u64],
    dst: u64,
    n: usize,
    g: Grid,
) {
    reduce_packs_of::<T>(
        op,
        srcs,
        dst,
        n,
        block_packs(0, n.div_ceil(lanes::<T>()), g),
    )
}

/// The f32 sums over `srcs` of the lanes of the whole pack `p` (the fused kernels' rows,
/// over `f32`, `f16`, `bf16` alone: the same steps as [`reduce_element`] for them).
pub(super) unsafe fn pack_sums<T: Element>(srcs: &[u64], p: usize) -> [f32; 8] {
    let l = lanes::<T>();
    let mut acc = [0f32; 8];
    for (j, a) in acc.iter_mut().enumerate().take(l) {
        let e = p * l + j;
        let op = ReduceOp::Sum;
        let start = op.start(load::<T>(srcs[0], e), srcs.len());
        let sum = (srcs[1..].iter()).fold(start, |acc, &s| op.combine(acc, load::<T>(s, e)));
        *a = op.finish(sum, srcs.len());
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// Sums over three sources, each at byte `offset` of an 8-aligned buffer, stored at
    /// byte `offset` of the output: the f64 sum of the inputs, exactly (small integers).
    fn sums_at<T: Element>(offset: usize) {
        let n = 19;
        let value = |s: usize, i: usize| T::from_f32(((i * 7 + s * 3) % 23) as f32 - 11.0);
        let words = (offset + n * std::mem::size_of::<T>()).div_ceil(8) + 1;
        let mut mem = vec![vec![0u64; words]; 4];
        let at: Vec<u64> = mem
            .iter_mut()
            .map(|w| w.as_mut_ptr() as u64 + offset as u64)
            .collect();
        for (s, &base) in at[..3].iter().enumerate() {
            for i in 0..n {
                // SAFETY: each buffer holds n elements of T from `base`.
                unsafe { (base as *mut T).add(i).write_unaligned(value(s, i)) };
            }
        }
        for e in 0..n {
            // SAFETY: every source and the output hold n elements of T from its address.
            let got = unsafe {
                let x = T::from_acc(reduce_element::<T>(ReduceOp::Sum, &at[..3], e));
                (at[3] as *mut T).add(e).write_unaligned(x);
                (at[3] as *const T).add(e).read_unaligned()
            };
            let want: f64 = (0..3).map(|s| f64::from(value(s, e).to_f32())).sum();
            assert_eq!(
                f64::from(got.to_f32()),
                want,
                "{:?} at byte offset {offset}, element {e}",
                T::DTYPE
            );
        }
    }

    /// Element loads and stores take any address: views at odd byte offsets (misaligned
    /// for the element type itself) and at element offsets that are not 16-byte aligned
    /// (an f16 view from element 1 or 3). Run under Miri to check the accesses.
    #[test]
    fn loads_and_stores_take_misaligned_views() {
        for offset in [1, 2, 3, 6] {
            sums_at::<f16>(offset);
            sums_at::<f32>(offset);
            sums_at::<f64>(offset);
            sums_at::<i8>(offset);
            sums_at::<u64>(offset);
        }
    }
}
