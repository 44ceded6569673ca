//! The collectives beside the all-reduce (all-gather, reduce-scatter, broadcast, scatter,
//! fused all-reduce + residual + RMSNorm): options and planning. What peers cannot read
//! in place is staged through the payload, in chunks where it does not fit whole.

use crate::backend::{Kernel, KernelKind};
use crate::dispatch::{self, Algorithm};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::external::setters;
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
    /// The reducing collectives' operator, which their methods take as an argument.
    pub(crate) op: ReduceOp,
}

impl CollectiveOptions {
    /// Whole world, blocks chosen by peercomm.
    pub fn new() -> Self {
        Self::default()
    }
    setters! {
        /// With a group size.
        fn group_size(group_size: usize) => group_size = group_size;
        /// With a block count.
        fn blocks(blocks: u32) => blocks = Some(blocks);
        /// With an algorithm (see the field: it chooses between the fused kernels).
        fn algorithm(algorithm: Algorithm) => algorithm = algorithm;
    }
    /// These options with the operator of the call.
    pub(crate) fn with_op(self, op: ReduceOp) -> Self {
        CollectiveOptions { op, ..self }
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
    /// `elements`: each member's whole input; the root stores the result.
    Reduce { root: usize },
}

impl Collective {
    fn kind(self) -> KernelKind {
        match self {
            Collective::AllGather => KernelKind::AllGather,
            Collective::ReduceScatter => KernelKind::ReduceScatter,
            Collective::Broadcast { .. } => KernelKind::Broadcast,
            Collective::Scatter { .. } => KernelKind::Scatter,
            Collective::AllReduceRmsNorm { .. } => KernelKind::AllReduceRmsNorm,
            Collective::Reduce { .. } => KernelKind::Reduce,
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
        if matches!(which, Collective::ReduceScatter | Collective::Reduce { .. }) {
            super::check_op(dtype, options.op)?;
        }
        let width = self.group_width(options.group_size)?;
        // Every size below stays within usize once the padded message does.
        message_bytes(dtype, elements, &|| format!("a {}", which.kind().name()))?;
        let lanes = dtype.lanes();
        let mut extra = CollectiveArgs::default();
        if let Collective::Broadcast { root }
        | Collective::Scatter { root }
        | Collective::Reduce { root } = which
        {
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
            Collective::ReduceScatter => {
                extra.op = options.op;
                elements.div_ceil(width).div_ceil(lanes)
            }
            // As the one-stage all-reduce: each pack from width - 1 peers.
            Collective::Reduce { .. } => {
                extra.op = options.op;
                elements.div_ceil(lanes).saturating_mul((width - 1).max(1))
            }
            Collective::AllReduceRmsNorm { hidden, epsilon } => {
                // The shape rules were checked with the algorithm.
                extra.hidden = hidden as u32;
                extra.epsilon = epsilon;
                0
            }
        };
        let (hidden, payload) = (extra.hidden as usize, self.layout.payload_bytes);
        let stage_input = match staged {
            true => staging::collective(kind, dtype, elements, width, hidden, payload)
                .map_err(|needed| self.payload_too_large(kind, needed))?,
            false => 0,
        };
        // One row per block for the fused kernel.
        let blocks = self.blocks(options.blocks, || match which {
            Collective::AllReduceRmsNorm { hidden, .. } => {
                (elements / hidden).clamp(1, self.max_blocks as usize) as u32
            }
            _ => dispatch::blocks_for(work_packs, self.config.threads_per_block, self.max_blocks),
        })?;
        let dims = self.dims(blocks);
        Ok(Plan {
            stage_input,
            collective: extra,
            ..Plan::new(Kernel { kind, dtype }, algorithm, width, elements, dims)
        })
    }

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
        if !dtype.every_kernel() {
            return Err(Error::Unsupported(format!(
                "the fused all-reduce + RMSNorm takes f32, f16 and bf16, not {}",
                dtype.name()
            )));
        }
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
    use Algorithm::{Auto, Hierarchical, Lamport, Nccl, OneStage, TwoStage};
    use KernelKind::{AllReduceRmsNorm, LamportRmsNorm};

    fn settings(world: usize) -> Settings {
        let config = CommConfig::default().with_lamport_slot_bytes(1 << 20);
        Settings::new(config, "sm_90".into(), 132, world).unwrap()
    }

    fn opts(algorithm: Algorithm, group_size: usize) -> CollectiveOptions {
        CollectiveOptions::new()
            .algorithm(algorithm)
            .group_size(group_size)
    }

    /// The plan of a fused call of `tokens` rows of `hidden` bf16 elements.
    fn fused(
        s: &Settings,
        tokens: usize,
        hidden: usize,
        o: CollectiveOptions,
        reads: PeerReads,
    ) -> Result<Plan> {
        let which = Collective::AllReduceRmsNorm {
            hidden,
            epsilon: 1e-5,
        };
        s.collective_plan(which, DType::BF16, tokens * hidden, &o, reads)
    }

    /// Auto runs the Lamport fused kernel over the whole world where the slot holds the
    /// message and its header, else one-stage; forced algorithms are honoured or
    /// refused with a typed error; the grid and the scratch are the one-stage ones.
    #[test]
    fn the_fused_call_chooses_lamport_where_it_fits() {
        let s = settings(4);
        for reads in [PeerReads::UserBuffers, PeerReads::Payloads] {
            // 1 MiB slots: 63 tokens of 8192 bf16 and the header fit, 64 do not.
            for tokens in [1, 8, 32, 63] {
                let p = fused(&s, tokens, 8192, opts(Auto, 0), reads).unwrap();
                assert_eq!((p.kernel.kind, p.algorithm), (LamportRmsNorm, Lamport));
                assert_eq!(p.stage_input, 0, "Lamport stages nothing");
                let one = fused(&s, tokens, 8192, opts(OneStage, 0), reads).unwrap();
                assert_eq!(
                    (one.kernel.kind, one.algorithm),
                    (AllReduceRmsNorm, OneStage)
                );
                assert_eq!(one.stage_input != 0, reads == PeerReads::Payloads);
                assert_eq!(p.dims, one.dims, "one row per block either way");
            }
            let kind =
                |tokens, hidden, o| fused(&s, tokens, hidden, o, reads).map(|p| p.kernel.kind);
            // Past the slot, in a subgroup (2 of 4), and in a group of one: one-stage.
            for (tokens, hidden, o) in [
                (64, 8192, opts(Auto, 0)),
                (8, 4096, opts(Auto, 2)),
                (8, 4096, opts(Auto, 1)),
                (8, 4096, opts(Lamport, 1)),
            ] {
                assert_eq!(kind(tokens, hidden, o), Ok(AllReduceRmsNorm), "{o:?}");
            }
            match kind(64, 8192, opts(Lamport, 0)) {
                Err(Error::MessageTooLarge {
                    needed,
                    available,
                    setting: "lamport_slot_bytes",
                    ..
                }) => assert_eq!((needed, available), ((1 << 20) + 64, 1 << 20)),
                other => panic!("forced Lamport past the slot: {other:?}"),
            }
            // Forced Lamport in a subgroup, and the algorithms the fused call lacks.
            for o in [
                opts(Lamport, 2),
                opts(TwoStage, 0),
                opts(Nccl, 0),
                opts(Hierarchical, 0),
            ] {
                let e = kind(8, 4096, o);
                assert!(matches!(e, Err(Error::Unsupported(_))), "{o:?}: {e:?}");
            }
            // A bad shape is named as such whatever the algorithm.
            let e = kind(1, 12, opts(Lamport, 0));
            assert!(
                matches!(&e, Err(Error::Unsupported(m)) if m.contains("hidden size")),
                "{e:?}"
            );
        }
        // A world of one: one-stage.
        let p = fused(&settings(1), 8, 4096, opts(Auto, 0), PeerReads::Payloads);
        assert_eq!(p.unwrap().kernel.kind, AllReduceRmsNorm);
        // The other collectives: Auto or OneStage.
        let other = |which, a| {
            let reads = PeerReads::UserBuffers;
            s.collective_plan(which, DType::F32, 100, &opts(a, 0), reads)
                .map(|p| p.kernel.kind)
        };
        for a in [Auto, OneStage] {
            assert_eq!(other(Collective::AllGather, a), Ok(KernelKind::AllGather));
        }
        let e = other(Collective::Broadcast { root: 0 }, Lamport);
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
