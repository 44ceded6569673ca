//! Packs and elements in the host kernels: lanes per 16-byte pack, a pack's element
//! range, the packs a block handles (the device's grid stride, one thread per block),
//! element loads and stores through f32, and the sum over the group in group-rank order
//! ([`sum_start`], [`reduce_element`]) that every reducing kernel shares.

use crate::dtype::Element;
use crate::signal::PACK_BYTES;

pub(super) fn lanes<T>() -> usize {
    PACK_BYTES / std::mem::size_of::<T>()
}

/// Element range of pack `p`.
pub(super) fn pack_range<T>(p: usize, n: usize) -> std::ops::Range<usize> {
    let l = lanes::<T>();
    p * l..((p + 1) * l).min(n)
}

/// Packs handled by `block`: the same grid-stride pattern as the device code, with one
/// thread per block.
pub(super) fn block_packs(
    first: usize,
    end: usize,
    block: u32,
    blocks: u32,
) -> impl Iterator<Item = usize> {
    (first + block as usize..end).step_by(blocks as usize)
}

unsafe fn load<T: Element>(base: u64, i: usize) -> f32 {
    (base as *const T).add(i).read().to_f32()
}

pub(super) unsafe fn store<T: Element>(base: u64, i: usize, x: f32) {
    (base as *mut T).add(i).write(T::from_f32(x))
}

/// Where a sum over `width` ranks starts: the first addend, after +0.0 when `width > 1`
/// (acc = +0.0 + x0), so an exact-zero sum is +0.0 on every algorithm (Lamport cannot
/// carry -0.0, its sentinel) and every other sum is unchanged; a group of one stays an
/// exact copy. The device's `sum_start`.
pub(super) fn sum_start(x0: f32, width: usize) -> f32 {
    if width > 1 {
        0.0 + x0
    } else {
        x0
    }
}

/// Sum over the group of element `e` of `srcs`, in group-rank order (the same order on
/// every rank, so every rank gets the same bits).
pub(super) unsafe fn reduce_element<T: Element>(srcs: &[u64], e: usize) -> f32 {
    let mut acc = sum_start(load::<T>(srcs[0], e), srcs.len());
    for &s in &srcs[1..] {
        acc += load::<T>(s, e);
    }
    acc
}
