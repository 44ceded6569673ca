//! The collectives beside the all-reduce (all-gather, reduce-scatter, broadcast,
//! scatter, fused all-reduce + residual + RMSNorm): options, the reduce-scatter split,
//! and planning. Where the peers cannot read user buffers, what they read is staged into
//! the own payload, in chunks where it does not fit whole ([`super::staging`]); only a
//! payload without room for two chunks refuses it ([`crate::Error::MessageTooLarge`]).

use crate::backend::{Kernel, KernelKind};
use crate::dispatch::{self, Algorithm};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::LAMPORT_HEADER_BYTES;

use super::staging::message_bytes;
use super::staging::{self, padded};
use crate::comm::core::planning::{CollectiveArgs, PeerReads, Plan};
use crate::comm::core::settings::Settings;

/// Options of one all-gather, reduce-scatter, broadcast, scatter or fused call, built
/// with [`CollectiveOptions::new`] and its setters.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct CollectiveOptions {
    /// Width of the groups that take part together: 0 means the whole world; otherwise
    /// it must divide the world size, and ranks `[k*w, (k+1)*w)` form group `k`.
    pub group_size: usize,
    /// Blocks per launch; `None` lets peercomm choose.
    pub blocks: Option<u32>,
    /// The fused all-reduce + RMSNorm's algorithm: [`Algorithm::Auto`] runs
    /// [`Algorithm::Lamport`] over the whole world of two or more ranks where the message
    /// and a 64-byte header fit [`crate::CommConfig::lamport_slot_bytes`], else
    /// [`Algorithm::OneStage`] (same bits either way). Forced `Lamport` over a subgroup
    /// is [`crate::Error::Unsupported`], past the slot [`crate::Error::MessageTooLarge`];
    /// a group of one runs `OneStage`. The other collectives take `Auto` or `OneStage`;
    /// any other algorithm is `Unsupported`.
    pub algorithm: Algorithm,
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
    /// With an algorithm (see the field: it chooses between the fused kernels).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
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

impl Settings {
    /// Checks a collective call's group, root and shape and plans its launch (staging,
    /// scratch, grid); `elements == 0` plans nothing to launch.
    pub(crate) fn collective_plan(
        &self,
        which: Collective,
        dtype: DType,
        elements: usize,
        options: &CollectiveOptions,
        reads: PeerReads,
    ) -> Result<Plan> {
        let width = self.group_width(options.group_size)?;
        // Every size below stays within usize once the padded message does.
        message_bytes(dtype, elements, &|| format!("a {}", which.kind().name()))?;
        let lanes = dtype.lanes();
        let mut extra = CollectiveArgs::default();
        if let Collective::Broadcast { root } | Collective::Scatter { root } = which {
            if root >= width {
                return Err(Error::InvalidRoot { root, width });
            }
            extra.root = root as u32;
        }
        let algorithm = self.collective_algorithm(which, dtype, elements, width, options)?;
        let kind = match (which, algorithm) {
            (Collective::AllReduceRmsNorm { .. }, Algorithm::Lamport) => KernelKind::LamportRmsNorm,
            _ => which.kind(),
        };
        // Lamport pushes into the peers' signals: nothing to stage.
        let staged = reads == PeerReads::Payloads && width > 1 && algorithm == Algorithm::OneStage;
        let work_packs = match which {
            Collective::AllGather | Collective::Broadcast { .. } | Collective::Scatter { .. } => {
                elements.div_ceil(lanes)
            }
            Collective::ReduceScatter => elements.div_ceil(width).div_ceil(lanes),
            Collective::AllReduceRmsNorm { hidden, epsilon } => {
                // The shape rules were checked with the algorithm.
                extra.hidden = hidden as u32;
                extra.epsilon = epsilon;
                0
            }
        };
        if staged {
            let payload = self.layout.payload_bytes;
            let hidden = extra.hidden as usize;
            staging::collective(kind, dtype, elements, width, hidden, payload)
                .map_err(|needed| self.payload_too_large(kind, needed))?;
        }
        // One row per block for the fused kernel.
        let blocks = self.blocks(options.blocks, || match which {
            Collective::AllReduceRmsNorm { hidden, .. } => {
                (elements / hidden).clamp(1, self.max_blocks as usize) as u32
            }
            _ => dispatch::blocks_for(work_packs, self.config.threads_per_block, self.max_blocks),
        })?;
        let dims = self.dims(blocks);
        Ok(Plan {
            stage_input: staged,
            collective: extra,
            ..Plan::new(Kernel { kind, dtype }, algorithm, width, elements, dims)
        })
    }

    /// The algorithm a collective call runsimpl Settings {
    /// The algorithm a collective call runs: the fused call chooses between one-stage
    /// and Lamport (its shape checked first), the others run one-stage.
    fn collective_algorithm(
        &self,
        which: Collective,
        dtype: DType,
        elements: usize,
        width: usize,
        options: &CollectiveOptions,
    ) -> Result<Algorithm> {
        let asked = options.algorithm;
        let Collective::AllReduceRmsNorm { hidden, epsilon } = which else {
            return match asked {
                Algorithm::Auto | Algorithm::OneStage => Ok(Algorithm::OneStage),
                a => Err(Error::Unsupported(format!(
                    "{} has one algorithm (one-stage), not {}; use Auto or OneStage",
                    which.kind().name(),
                    a.name()
                ))),
            };
        };
        check_rms_norm(dtype, elements, hidden, epsilon)?;
        // As the Lamport all-reduce: the whole world of at least two ranks, and a slot
        // holding the packs and the header.
        let allowed = self.lamport_allowed(width);
        let need = padded(dtype, elements) + LAMPORT_HEADER_BYTES;
        let slot = self.layout.lamport_slot_bytes;
        match asked {
            Algorithm::Auto if allowed && need <= slot => Ok(Algorithm::Lamport),
            Algorithm::Auto | Algorithm::OneStage => Ok(Algorithm::OneStage),
            // A group of one copies (one-stage), keeping the sign of zero.
            Algorithm::Lamport if width == 1 => Ok(Algorithm::OneStage),
            Algorithm::Lamport if !allowed => Err(Error::Unsupported(format!(
                "the Lamport fused all-reduce + RMSNorm runs only over the whole world \
                 (group_size 0 or {}), not over groups of {width}; use Auto or OneStage",
                self.world
            ))),
            Algorithm::Lamport if need > slot => Err(Error::MessageTooLarge {
                algorithm: KernelKind::LamportRmsNorm.name(),
                needed: need,
                available: slot,
                setting: "lamport_slot_bytes",
            }),
            Algorithm::Lamport => Ok(Algorithm::Lamport),
            a => Err(Error::Unsupported(format!(
                "the fused all-reduce + RMSNorm runs one-stage or Lamport, not {}; use Auto, \
                 OneStage or Lamport",
                a.name()
            ))),
        }
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
    use super::*;
    use crate::CommConfig;

    fn settings(world: usize, slot: usize) -> Settings {
        let config = CommConfig {
            lamport_slot_bytes: slot,
            ..CommConfig::default()
        };
        Settings::new(config, "sm_90".into(), 132, world).unwrap()
    }

    fn fused(
        s: &Settings,
        tokens: usize,
        hidden: usize,
        options: CollectiveOptions,
        reads: PeerReads,
    ) -> Result<Plan> {
        let which = Collective::AllReduceRmsNorm {
            hidden,
            epsilon: 1e-5,
        };
        s.collective_plan(which, DType::BF16, tokens * hidden, &options, reads)
    }

    /// Auto runs the Lamport fused kernel over the whole world where the slot holds the
    /// message and its header, else one-stage; forced algorithms are honoured or
    /// refused with a typed error; the grid and the scratch are the one-stage ones.
    #[test]
    fn the_fused_call_chooses_lamport_where_it_fits() {
        let auto = CollectiveOptions::new();
        let forced = |a| CollectiveOptions::new().algorithm(a);
        // 1 MiB slots: 63 tokens of 8192 bf16 and the header fit, 64 do not.
        let s = settings(4, 1 << 20);
        for reads in [PeerReads::UserBuffers, PeerReads::Payloads] {
            for tokens in [1, 8, 32, 63] {
                let p = fused(&s, tokens, 8192, auto, reads).unwrap();
                assert_eq!(p.kernel.kind, KernelKind::LamportRmsNorm, "{tokens}");
                assert_eq!(p.algorithm, Algorithm::Lamport);
                assert!(!p.stage_input, "Lamport stages nothing");
                let one = fused(&s, tokens, 8192, forced(Algorithm::OneStage), reads).unwrap();
                assert_eq!(one.kernel.kind, KernelKind::AllReduceRmsNorm);
                assert_eq!(one.algorithm, Algorithm::OneStage);
                assert_eq!(one.stage_input, reads == PeerReads::Payloads);
                assert_eq!(p.dims, one.dims, "one row per block either way");
            }
            let p = fused(&s, 64, 8192, auto, reads).unwrap();
            assert_eq!(p.kernel.kind, KernelKind::AllReduceRmsNorm, "past the slot");
            match fused(&s, 64, 8192, forced(Algorithm::Lamport), reads).map(|p| p.kernel) {
                Err(Error::MessageTooLarge {
                    needed,
                    available,
                    setting: "lamport_slot_bytes",
                    ..
                }) => assert_eq!((needed, available), ((1 << 20) + 64, 1 << 20)),
                other => panic!("forced Lamport past the slot: {other:?}"),
            }
            // Subgroups: Auto runs one-stage, forced Lamport is refused.
            let sub = CollectiveOptions::new().group_size(2);
            let p = fused(&s, 8, 4096, sub, reads).unwrap();
            assert_eq!(p.kernel.kind, KernelKind::AllReduceRmsNorm);
            let e = fused(&s, 8, 4096, sub.algorithm(Algorithm::Lamport), reads).map(|p| p.kernel);
            assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
            // A group of one copies.
            for a in [Algorithm::Auto, Algorithm::Lamport] {
                let p = fused(&s, 8, 4096, forced(a).group_size(1), reads).unwrap();
                assert_eq!(p.kernel.kind, KernelKind::AllReduceRmsNorm, "{a:?}");
                assert_eq!(p.algorithm, Algorithm::OneStage);
            }
            for a in [
                Algorithm::TwoStage,
                Algorithm::Nccl,
                Algorithm::Hierarchical,
            ] {
                let e = fused(&s, 8, 4096, forced(a), reads).map(|p| p.kernel);
                assert!(matches!(e, Err(Error::Unsupported(_))), "{a:?}: {e:?}");
            }
            // A bad shape is named as such whatever the algorithm.
            let e = fused(&s, 1, 12, forced(Algorithm::Lamport), reads).map(|p| p.kernel);
            assert!(
                matches!(&e, Err(Error::Unsupported(m)) if m.contains("hidden size")),
                "{e:?}"
            );
        }
        // A world of one: one-stage.
        let p = fused(&settings(1, 1 << 20), 8, 4096, auto, PeerReads::Payloads).unwrap();
        assert_eq!(p.kernel.kind, KernelKind::AllReduceRmsNorm);
        // The other collectives: Auto or OneStage.
        for a in [Algorithm::Auto, Algorithm::OneStage] {
            let p = s
                .collective_plan(
                    Collective::AllGather,
                    DType::F32,
                    100,
                    &forced(a),
                    PeerReads::UserBuffers,
                )
                .unwrap();
            assert_eq!(p.kernel.kind, KernelKind::AllGather);
        }
        let e = s
            .collective_plan(
                Collective::Broadcast { root: 0 },
                DType::F32,
                100,
                &forced(Algorithm::Lamport),
                PeerReads::UserBuffers,
            )
            .map(|p| p.kernel);
        assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
    }

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
