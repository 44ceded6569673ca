//! How a message occupies scratch (whole packs) and how a staged call goes through a
//! payload, whole or in chunks of half, as the `stage_input` word says.

use crate::backend::KernelKind;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{reduce_scatter_part, PACK_BYTES, STAGE_WHOLE};

/// The most bytes any buffer spans (Rust's allocation limit): within it, every size a
/// call derives (a header pack, a partition, rounded parts) stays within `usize`.
pub(crate) const MAX_BUFFER_BYTES: usize = isize::MAX as usize;

/// The bytes of `elements` x `dtype` in whole packs, or [`Error::SizeOverflow`] naming
/// `what` past [`MAX_BUFFER_BYTES`].
pub(crate) fn message_bytes(
    dtype: DType,
    elements: usize,
    what: &dyn Fn() -> String,
) -> Result<usize> {
    padded_bytes(dtype, elements)
        .filter(|&b| b <= MAX_BUFFER_BYTES)
        .ok_or_else(|| Error::SizeOverflow {
            what: format!("{} of {elements} x {}", what(), dtype.name()),
        })
}

/// Bytes a message of `elements` x `dtype` occupies in scratch: whole 16-byte packs.
pub(crate) fn padded_bytes(dtype: DType, elements: usize) -> Option<usize> {
    elements.div_ceil(dtype.lanes()).checked_mul(PACK_BYTES)
}

/// The `stage_input` word of a staged one-stage all-reduce of `packs` through `payload`
/// bytes: [`STAGE_WHOLE`] where it holds the message, else chunks of half the payload
/// (at most `STAGE_WHOLE - 1` packs), one half staged while the other is read; `None`
/// where a half holds no pack. Every rank computes the same (agreed payload, the length
/// in the descriptor).
pub(crate) fn all_reduce(packs: usize, payload: usize) -> Option<u32> {
    let whole = packs
        .checked_mul(PACK_BYTES)
        .is_some_and(|bytes| bytes <= payload);
    if whole && packs <= STAGE_WHOLE as usize {
        return Some(STAGE_WHOLE);
    }
    let half = payload / (2 * PACK_BYTES);
    (half > 0).then(|| half.min(STAGE_WHOLE as usize - 1) as u32)
}

/// Bytes of `n` elements in whole packs (saturating: the planner refuses overflow first).
pub(crate) fn padded(dtype: DType, n: usize) -> usize {
    n.div_ceil(dtype.lanes()).saturating_mul(PACK_BYTES)
}

/// The `stage_input` word of a staged collective of `elements` through `payload` bytes:
/// [`STAGE_WHOLE`] where it holds what the kernel stages, else a chunk's units in half
/// the payload (packs of the message for all-gather and broadcast, of each part for
/// reduce-scatter and scatter, rows for the fused kernel), at most `STAGE_WHOLE - 1`.
/// `Err` with the bytes two one-unit chunks need where a half holds none; 1 for kinds
/// that never chunk.
pub(crate) fn collective(
    kind: KernelKind,
    dtype: DType,
    elements: usize,
    width: usize,
    hidden: usize,
    payload: usize,
) -> std::result::Result<u32, usize> {
    let packs = elements.div_ceil(dtype.lanes());
    let half_packs = payload / (2 * PACK_BYTES);
    // What the kernel stages whole, the units it compares stage_input with, a unit's packs.
    let (scratch, units, unit_packs) = match kind {
        KernelKind::AllGather | KernelKind::Broadcast | KernelKind::Reduce => {
            (padded(dtype, elements), packs, 1)
        }
        KernelKind::Scatter => (width.saturating_mul(padded(dtype, elements)), packs, width),
        KernelKind::ReduceScatter => (
            (0..width)
                .map(|q| padded(dtype, reduce_scatter_part(elements, width, q).len()))
                .sum(),
            reduce_scatter_part(elements, width, 0)
                .len()
                .div_ceil(dtype.lanes()),
            width,
        ),
        KernelKind::AllReduceRmsNorm => {
            let row_packs = hidden / dtype.lanes();
            (padded(dtype, elements), elements / hidden.max(1), row_packs)
        }
        _ => return Ok(1),
    };
    if scratch <= payload && units <= STAGE_WHOLE as usize {
        return Ok(STAGE_WHOLE);
    }
    match half_packs / unit_packs.max(1) {
        0 => Err(scratch.min(2 * unit_packs * PACK_BYTES)),
        cap => Ok(cap.min(STAGE_WHOLE as usize - 1) as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The staging rule: whole where the payload holds the message, else chunks of half
    /// the payload; none where a half holds no pack.
    #[test]
    fn staging_is_whole_where_it_fits_else_half_the_payload() {
        let whole = Some(STAGE_WHOLE);
        for (packs, payload, word) in [
            (0, 0, whole),
            (1, 16, whole),
            (259, 4144, whole),
            // 4144 bytes: halves of 129 packs; a message of 260 packs takes 3 chunks.
            (260, 4144, Some(129)),
            (1 << 30, 64 << 20, Some(1 << 21)),
            // A payload without a pack per half.
            (1, 0, None),
            (2, 16, None),
            (3, 31, None),
            (3, 32, Some(1)),
            (3, 47, Some(1)),
            // No pack count the word cannot say: 2^32 packs or more go in chunks of at
            // most STAGE_WHOLE - 1.
            (u32::MAX as usize, usize::MAX, whole),
            (1 << 33, usize::MAX, Some(STAGE_WHOLE - 1)),
        ] {
            assert_eq!(all_reduce(packs, payload), word, "{packs} {payload}");
        }
        for payload in [32, 47, 4096, 4144, 65_584] {
            for packs in 1..3 * payload / 16 {
                let c = all_reduce(packs, payload).unwrap();
                // The kernel chunks a message of more than c packs: exactly those that
                // do not fit, each chunk within half the payload.
                assert_eq!(packs as u64 > u64::from(c), packs * 16 > payload);
                if packs * 16 > payload {
                    assert!(2 * c as usize * 16 <= payload);
                }
            }
        }
    }

    /// Messages whose bytes in whole packs pass isize::MAX are refused for every dtype;
    /// the largest that fits is allowed.
    #[test]
    fn message_bytes_stop_at_the_largest_buffer() {
        for dtype in DType::ALL {
            let lanes = dtype.lanes();
            let largest = MAX_BUFFER_BYTES / 16 * lanes;
            let bytes = |n| message_bytes(dtype, n, &String::new);
            assert_eq!(bytes(largest), Ok(largest / lanes * 16));
            for n in [
                largest + 1,
                usize::MAX / dtype.size(),
                usize::MAX / 2,
                usize::MAX,
            ] {
                let got = bytes(n);
                assert!(
                    matches!(got, Err(Error::SizeOverflow { .. })),
                    "{n} x {dtype:?}"
                );
            }
        }
    }

    /// Every staged collective: whole exactly where the payload holds what the kernel
    /// stages whole, else chunks whose two halves fit; refused only where a half holds
    /// no unit, with the bytes two would need.
    #[test]
    fn collective_staging_chunks_what_the_payload_cannot_hold() {
        use KernelKind::{AllGather, AllReduceRmsNorm, Broadcast, ReduceScatter, Scatter};
        for kind in [
            AllGather,
            Broadcast,
            Scatter,
            ReduceScatter,
            AllReduceRmsNorm,
        ] {
            for dtype in DType::ALL {
                let lanes = dtype.lanes();
                for width in [2, 3, 4, 8] {
                    for payload in [0, 16, 32, 100, 4144, 1 << 16] {
                        for elements in (1..600).step_by(7).map(|e| e * lanes) {
                            let hidden = 4 * lanes;
                            let part = |q| reduce_scatter_part(elements, width, q).len();
                            let (scratch, units, unit_packs) = match kind {
                                Scatter => {
                                    (width * padded(dtype, elements), elements / lanes, width)
                                }
                                ReduceScatter => (
                                    (0..width).map(|q| padded(dtype, part(q))).sum(),
                                    part(0).div_ceil(lanes),
                                    width,
                                ),
                                AllReduceRmsNorm => (padded(dtype, elements), elements / hidden, 4),
                                _ => (padded(dtype, elements), elements / lanes, 1),
                            };
                            let got = collective(kind, dtype, elements, width, hidden, payload);
                            let what = format!("{kind:?} {dtype:?} w{width} {elements} {payload}");
                            match got {
                                Ok(STAGE_WHOLE) => assert!(scratch <= payload, "{what}"),
                                Ok(c) => {
                                    assert!(scratch > payload, "{what}");
                                    assert!(units > c as usize, "{what}: not chunked");
                                    let half = c as usize * unit_packs * PACK_BYTES;
                                    assert!(2 * half <= payload, "{what}: halves overflow");
                                }
                                Err(needed) => {
                                    assert!(scratch > payload, "{what}");
                                    assert!(unit_packs * PACK_BYTES > payload / 2, "{what}");
                                    assert!(needed > payload, "{what}: needs {needed}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
