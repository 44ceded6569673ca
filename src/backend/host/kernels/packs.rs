//! Packs and elements in the host kernels: lanes per 16-byte pack, a pack's elements,
//! a block's packs (the device's grid stride, one thread per block), loads and stores
//! through f32, and the sum over the group in group-rank order every reducing kernel
//! shares.

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

/// Where a sum over `width` ranks starts: +0.0 + x0 when `width > 1`, so an exact-zero
/// sum is +0.0 on every algorithm (Lamport cannot carry -0.0, its sentinel); a group of
/// one stays an exact copy. The device's `sum_start`.
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

/// Address of element `e` of the `T` array at `base`.
pub(super) fn elem<T>(base: u64, e: usize) -> u64 {
    base + (e * std::mem::size_of::<T>()) as u64
}

/// Copies this block's packs of an `n`-element message from `src` to `dst`.
pub(super) unsafe fn copy_packs<T: Element>(src: u64, dst: u64, n: usize, block: u32, blocks: u32) {
    for p in block_packs(0, n.div_ceil(lanes::<T>()), block, blocks) {
        for e in pack_range::<T>(p, n) {
            (dst as *mut T)
                .add(e)
                .write_unaligned((src as *const T).add(e).read_unaligned());
        }
    }
}

/// Sums this block's packs of an `n`-element message over `srcs` into `dst`.
pub(super) unsafe fn reduce_packs<T: Element>(
    srcs: &[u64],
    dst: u64,
    n: usize,
    block: u32,
    blocks: u32,
) {
    for p in block_packs(0, n.div_ceil(lanes::<T>()), block, blocks) {
        for e in pack_range::<T>(p, n) {
            store::<T>(dst, e, reduce_element::<T>(srcs, e));
        }
    }
}

/// The f32 sums over `srcs` of the lanes of the whole pack `p` (the fused kernels' rows).
pub(super) unsafe fn pack_sums<T: Element>(srcs: &[u64], p: usize) -> [f32; 8] {
    let l = lanes::<T>();
    let mut acc = [0f32; 8];
    for (j, a) in acc.iter_mut().enumerate().take(l) {
        *a = reduce_element::<T>(srcs, p * l + j);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// `values` written little-endian from byte `offset` of a fresh 8-aligned buffer.
    fn bytes_at<T: Element>(values: &[T], offset: usize) -> Vec<u64> {
        let size = std::mem::size_of::<T>();
        let mut words = vec![0u64; (offset + std::mem::size_of_val(values)).div_ceil(8) + 1];
        // SAFETY: the words hold at least offset + len * size bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8)
        };
        for (i, v) in values.iter().enumerate() {
            let b = v.to_bits_u32().to_le_bytes();
            bytes[offset + i * size..offset + (i + 1) * size].copy_from_slice(&b[..size]);
        }
        words
    }

    /// The `n` values of type `T` stored little-endian from byte `offset` of `words`.
    fn values_at<T: Element>(words: &[u64], offset: usize, n: usize) -> Vec<T> {
        let size = std::mem::size_of::<T>();
        // SAFETY: reads bytes of the words only.
        let bytes =
            unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 8) };
        (0..n)
            .map(|i| {
                let mut b = [0u8; 4];
                b[..size].copy_from_slice(&bytes[offset + i * size..offset + (i + 1) * size]);
                T::from_bits_u32(u32::from_le_bytes(b))
            })
            .collect()
    }

    /// Sums over three sources, each at byte `offset` of its buffer, stored at byte
    /// `offset` of the output: the f64 sum of the inputs, exactly (small integers).
    fn sums_at<T: Element>(offset: usize) {
        let n = 19;
        let inputs: Vec<Vec<T>> = (0..3)
            .map(|s| {
                (0..n)
                    .map(|i| T::from_f32(((i * 7 + s * 3) % 23) as f32 - 11.0))
                    .collect()
            })
            .collect();
        let srcs_mem: Vec<Vec<u64>> = inputs.iter().map(|v| bytes_at(v, offset)).collect();
        let srcs: Vec<u64> = srcs_mem
            .iter()
            .map(|w| w.as_ptr() as u64 + offset as u64)
            .collect();
        let mut out = bytes_at(&vec![T::from_f32(0.0); n], offset);
        let dst = out.as_mut_ptr() as u64 + offset as u64;
        for e in 0..n {
            // SAFETY: every source and the output hold n elements of T from its address.
            unsafe { store::<T>(dst, e, reduce_element::<T>(&srcs, e)) };
        }
        let got = values_at::<T>(&out, offset, n);
        for (e, g) in got.iter().enumerate() {
            let want: f64 = inputs.iter().map(|v| f64::from(v[e].to_f32())).sum();
            assert_eq!(
                f64::from(g.to_f32()),
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
        }
    }
}
