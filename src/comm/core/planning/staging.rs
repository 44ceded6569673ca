//! How a staged collective (all-gather, reduce-scatter, broadcast, scatter, the fused
//! all-reduce + RMSNorm) goes through a rank's payload: whole where it fits, else in
//! chunks of half the payload, as the kernels' `stage_input` word says
//! (kernels-common/peercomm_collectives.h; the all-reduce's rule is
//! [`super::plan::staging`]). The planner checks it, and the launch builds the word
//! from it.

use crate::backend::KernelKind;
use crate::dtype::DType;
use crate::signal::{reduce_scatter_part, PACK_BYTES, STAGE_WHOLE};

/// Bytes of `n` elements rounded up to whole packs (saturating: the planner refuses a
/// message whose bytes overflow before it sizes anything).
pub(crate) fn padded(dtype: DType, n: usize) -> usize {
    n.div_ceil(dtype.lanes()).saturating_mul(PACK_BYTES)
}

/// How a staged collective of `elements` (as its plan counts them) goes through a
/// payload of `payload` bytes, as the kernels' `stage_input` word: [`STAGE_WHOLE`] where
/// the payload holds what the kernel stages whole (as [`super::plan::staging`] for the
/// all-reduce); else the capacity of one chunk, half the payload: in packs of the
/// message (all-gather, broadcast), in packs of each part (reduce-scatter, scatter: a
/// half holds `width` parts' chunks), in rows (the fused kernel), at most
/// `STAGE_WHOLE - 1`; the kernel chunks a message of more units than that
/// (kernels-common/peercomm_collectives.h). `Err` with the bytes two chunks of one unit
/// need where a half holds not one; 1 (a flag) for kinds that never chunk.
pub(crate) fn collective_staging(
    kind: KernelKind,
    dtype: DType,
    elements: usize,
    width: usize,
    hidden: usize,
    payload: usize,
) -> std::result::Result<u32, usize> {
    let packs = elements.div_ceil(dtype.lanes());
    let half_packs = payload / (2 * PACK_BYTES);
    // What the kernel stages whole, the units it compares stage_input with, one
    // unit's packs in a half.
    let (scratch, units, unit_packs) = match kind {
        KernelKind::AllGather | KernelKind::Broadcast => (padded(dtype, elements), packs, 1),
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

    /// Every staged collective: whole exactly where the payload holds what the kernel
    /// stages whole; else chunks whose two halves fit the payload, and a message of
    /// more units than a chunk holds (so the kernel chunks it); refused only where a
    /// half holds no unit, with the bytes two would need.
    #[test]
    fn collective_staging_chunks_what_the_payload_cannot_hold() {
        let kinds = [
            KernelKind::AllGather,
            KernelKind::Broadcast,
            KernelKind::Scatter,
            KernelKind::ReduceScatter,
            KernelKind::AllReduceRmsNorm,
        ];
        for kind in kinds {
            for dtype in DType::ALL {
                let lanes = dtype.lanes();
                for width in [2, 3, 4, 8] {
                    for payload in [0, 16, 32, 100, 4144, 1 << 16] {
                        for elements in (1..600).step_by(7).map(|e| e * lanes) {
                            let hidden = 4 * lanes;
                            let part = |q| reduce_scatter_part(elements, width, q).len();
                            let (scratch, units, unit_packs) = match kind {
                                KernelKind::Scatter => {
                                    (width * padded(dtype, elements), elements / lanes, width)
                                }
                                KernelKind::ReduceScatter => (
                                    (0..width).map(|q| padded(dtype, part(q))).sum(),
                                    part(0).div_ceil(lanes),
                                    width,
                                ),
                                KernelKind::AllReduceRmsNorm => {
                                    (padded(dtype, elements), elements / hidden, 4)
                                }
                                _ => (padded(dtype, elements), elements / lanes, 1),
                            };
                            let got =
                                collective_staging(kind, dtype, elements, width, hidden, payload);
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
