//! The collectives beside the all-reduce: all-gather, reduce-scatter (sum), broadcast,
//! scatter, and the fused all-reduce + residual add + RMSNorm. Their options, the
//! reduce-scatter split, and their planning (kernel, grid, scratch). The algorithms are
//! in kernels-common/peercomm_collectives.h (GPUs) and src/backend/host/collectives.rs
//! (host); the calls in `per_rank/collectives.rs` (per-rank `Comm`) and
//! `single_collectives.rs` (`Communicator`).
//!
//! Where the peers cannot read user buffers (a rank per process or thread, the per-rank
//! `Comm`), each rank first copies what its peers read into its own payload, so the
//! payload bounds the message ([`crate::Error::MessageTooLarge`]); in one process the
//! peers read the user buffers directly and no scratch is needed.

use crate::backend::{Kernel, KernelKind, LaunchDims};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{MAX_NUM_BLOCKS_UPPER_BOUND, PACK_BYTES};

use super::plan::{CollectiveArgs, PeerReads, Plan};
use super::settings::Settings;

/// Options of one all-gather, reduce-scatter, broadcast, scatter or fused call.
#[derive(Clone, Copy, Debug, Default)]
pub struct CollectiveOptions {
    /// Width of the groups that take part together: 0 means the whole world; otherwise
    /// it must divide the world size, and ranks `[k*w, (k+1)*w)` form group `k`.
    pub group_size: usize,
    /// Blocks per launch; `None` lets peercomm choose.
    pub blocks: Option<u32>,
}

impl CollectiveOptions {
    /// Whole world, blocks chosen by peercomm.
    pub fn new() -> Self {
        Self::default()
    }
    /// With a group size.
    pub fn group_size(mut self, group_size: usize) -> Self {
        self.group_size = group_size;
        self
    }
    /// With a block count.
    pub fn blocks(mut self, blocks: u32) -> Self {
        self.blocks = Some(blocks);
        self
    }
}

pub use crate::signal::reduce_scatter_part;

/// Which collective a call runs, with what only it needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Collective {
    /// `elements`: each member's contribution.
    AllGather,
    /// `elements`: each member's whole input.
    ReduceScatter,
    /// `elements`: the message.
    Broadcast { root: usize },
    /// `elements`: each member's part.
    Scatter { root: usize },
    /// `elements`: tokens x hidden.
    AllReduceRmsNorm { hidden: usize, epsilon: f32 },
}

impl Collective {
    fn kind(self) -> KernelKind {
        match self {
            Collective::AllGather => KernelKind::AllGather,
            Collective::ReduceScatter => KernelKind::ReduceScatter,
            Collective::Broadcast { .. } => KernelKind::Broadcast,
            Collective::Scatter { .. } => KernelKind::Scatter,
            Collective::AllReduceRmsNorm { .. } => KernelKind::AllReduceRmsNorm,
        }
    }
}

/// Bytes of `n` elements rounded up to whole packs.
fn padded(dtype: DType, n: usize) -> usize {
    n.div_ceil(dtype.lanes()) * PACK_BYTES
}

impl Settings {
    /// Checks a collective call's group, root and shape rules and plans its launch:
    /// staging where the peers cannot read user buffers, the scratch that needs, and
    /// the grid. `elements == 0` gives a plan that launches nothing.
    pub(crate) fn collective_plan(
        &self,
        which: Collective,
        dtype: DType,
        elements: usize,
        options: &CollectiveOptions,
        reads: PeerReads,
    ) -> Result<Plan> {
        let width = self.group_width(options.group_size)?;
        let lanes = dtype.lanes();
        let mut extra = CollectiveArgs::default();
        if let Collective::Broadcast { root } | Collective::Scatter { root } = which {
            if root >= width {
                return Err(Error::InvalidRoot { root, width });
            }
            extra.root = root as u32;
        }
        let staged = reads == PeerReads::Payloads && width > 1;
        let (scratch, work_packs) = match which {
            Collective::AllGather | Collective::Broadcast { .. } => {
                (padded(dtype, elements), elements.div_ceil(lanes))
            }
            Collective::Scatter { .. } => (
                width.saturating_mul(padded(dtype, elements)),
                elements.div_ceil(lanes),
            ),
            Collective::ReduceScatter => (
                (0..width)
                    .map(|q| padded(dtype, reduce_scatter_part(elements, width, q).len()))
                    .sum(),
                elements.div_ceil(width).div_ceil(lanes),
            ),
            Collective::AllReduceRmsNorm { hidden, epsilon } => {
                check_rms_norm(dtype, elements, hidden, epsilon)?;
                extra.hidden = hidden as u32;
                extra.epsilon = epsilon;
                (padded(dtype, elements), 0)
            }
        };
        if staged && scratch > self.layout.payload_bytes {
            return Err(Error::MessageTooLarge {
                algorithm: which.kind().name(),
                needed: scratch,
                available: self.layout.payload_bytes,
                setting: "payload_bytes",
            });
        }
        let blocks = match options.blocks {
            Some(b) if b == 0 || b as usize > MAX_NUM_BLOCKS_UPPER_BOUND => {
                return Err(Error::Unsupported(format!(
                    "blocks must be in 1..={MAX_NUM_BLOCKS_UPPER_BOUND}, not {b}"
                )))
            }
            Some(b) => b,
            None => match which {
                // One row per block.
                Collective::AllReduceRmsNorm { hidden, .. } => {
                    (elements / hidden).clamp(1, self.max_blocks as usize) as u32
                }
                _ => {
                    dispatch::blocks_for(work_packs, self.config.threads_per_block, self.max_blocks)
                }
            },
        };
        Ok(Plan {
            kernel: Kernel {
                kind: which.kind(),
                dtype,
            },
            algorithm: Algorithm::OneStage,
            width,
            elements,
            stage_input: staged,
            dims: LaunchDims {
                blocks,
                threads: self.config.threads_per_block,
            },
            overlap_previous: false,
            collective: extra,
        })
    }
}

/// The fused kernel's shape rules: rows of `hidden` elements, a multiple of the pack
/// width (whole 16-byte packs per row), at most `u32::MAX`; a finite, non-negative
/// epsilon.
fn check_rms_norm(dtype: DType, elements: usize, hidden: usize, epsilon: f32) -> Result<()> {
    let lanes = dtype.lanes();
    if hidden == 0 || !hidden.is_multiple_of(lanes) || u32::try_from(hidden).is_err() {
        return Err(Error::Unsupported(format!(
            "the fused all-reduce + RMSNorm needs a hidden size that is a positive multiple \
             of {lanes} ({} elements per 16-byte pack), not {hidden}",
            dtype.name()
        )));
    }
    if !elements.is_multiple_of(hidden) {
        return Err(Error::Unsupported(format!(
            "{elements} elements are not whole rows of hidden size {hidden}"
        )));
    }
    if !(epsilon.is_finite() && epsilon >= 0.0) {
        return Err(Error::Unsupported(format!(
            "epsilon must be finite and non-negative, not {epsilon}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::reduce_scatter_part;

    #[test]
    fn reduce_scatter_parts_tile_the_input() {
        for width in 1..=8 {
            for n in 0..100 {
                let mut next = 0;
                for r in 0..width {
                    let part = reduce_scatter_part(n, width, r);
                    assert_eq!(part.start, next, "n {n} width {width} rank {r}");
                    assert!(part.len() == n / width || part.len() == n / width + 1);
                    next = part.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
