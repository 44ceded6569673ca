//! Which algorithm and how many blocks, per architecture, group width and message size:
//! data, measured in `docs/dispatch.md`; unmeasured pairs take the generic rows.

/// An all-reduce algorithm, or `Auto` to let the dispatch table choose.
///
/// Every algorithm sums in the same order (group rank 0, 1, ... in f32), so results are
/// bitwise identical whatever the algorithm, length or API; an exact-zero sum is +0.0
/// (Lamport cannot carry -0.0, its "not yet arrived" mark), and a group of one returns
/// its input bit for bit. `Lamport` runs only over the whole world (forced over a group
/// of one it runs `OneStage`, over a subgroup it is [`crate::Error::Unsupported`]). The
/// fused all-reduce + RMSNorm takes `OneStage` or `Lamport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// Choose by the dispatch table.
    #[default]
    Auto,
    /// Every rank reads all peers' inputs and reduces the whole message.
    OneStage,
    /// Reduce-scatter, barrier, all-gather.
    TwoStage,
    /// Barrier-free push into the peers' Lamport regions (small messages; whole world
    /// only).
    Lamport,
    /// The whole call ran in the external library (NCCL, RCCL, or the host stand-in):
    /// where peer memory cannot serve or routing by size chose it.
    Nccl,
    /// Ranks span hosts: a sum over peer memory inside each host, the external library
    /// across hosts (one slice per local rank), a gather inside each host (a second
    /// all-reduce where the other slices are -0.0). Returned, never forced.
    Hierarchical,
}

impl Algorithm {
    /// Name for reports.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::OneStage => "one_stage",
            Algorithm::TwoStage => "two_stage",
            Algorithm::Lamport => "lamport",
            Algorithm::Nccl => "nccl",
            Algorithm::Hierarchical => "hierarchical",
        }
    }
    /// The three peer-memory algorithms.
    pub const ALL: [Algorithm; 3] = [Algorithm::OneStage, Algorithm::TwoStage, Algorithm::Lamport];
}

/// One row: up to `max_bytes` (inclusive), use `algorithm`.
#[derive(Clone, Copy, Debug)]
pub struct DispatchRow {
    /// Largest message (bytes per rank) this row covers.
    pub max_bytes: usize,
    /// Algorithm for it.
    pub algorithm: Algorithm,
}

/// Rows for an (architecture, group width); rows are in increasing `max_bytes` and
/// the last one covers everything.
pub fn table(arch: &str, width: usize) -> &'static [DispatchRow] {
    const fn row(max_bytes: usize, algorithm: Algorithm) -> DispatchRow {
        DispatchRow {
            max_bytes,
            algorithm,
        }
    }
    use Algorithm::{Lamport, OneStage, TwoStage};
    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    // Two GPUs: measured on sm_90 over NV18 (2x H200, docs/dispatch.md), and the generic
    // rows elsewhere: Lamport up to 256 KiB, one-stage above (two-stage never wins at two
    // ranks: same traffic, one more barrier). Wider unmeasured groups: two-stage once its
    // extra barrier costs less than the traffic it saves.
    static TWO: [DispatchRow; 2] = [row(256 * KIB, Lamport), row(usize::MAX, OneStage)];
    static GENERIC_N: [DispatchRow; 3] = [
        row(256 * KIB, Lamport),
        row(MIB, OneStage),
        row(usize::MAX, TwoStage),
    ];
    // sm_90 at 4 and 8 GPUs: predicted by the model calibrated on the 2-GPU runs (a rank
    // takes in (W-1)N bytes with one-stage or Lamport, 2(W-1)N/W with two-stage).
    static SM90_4: [DispatchRow; 3] = [
        row(440 * KIB, Lamport),
        row(810 * KIB, OneStage),
        row(usize::MAX, TwoStage),
    ];
    static SM90_8: [DispatchRow; 2] = [row(210 * KIB, Lamport), row(usize::MAX, TwoStage)];
    static SINGLE: [DispatchRow; 1] = [row(usize::MAX, OneStage)];
    match (arch, width) {
        (_, 1) => &SINGLE,
        ("sm_90", 4) => &SM90_4,
        ("sm_90", 8) => &SM90_8,
        (_, 2) => &TWO,
        _ => &GENERIC_N,
    }
}

/// Where the rows of a table come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub enum Provenance {
    /// Measured with `peercomm-bench` on this architecture and width (docs/dispatch.md).
    Measured,
    /// Predicted by the performance model calibrated on measured widths; to be
    /// replaced by measurements.
    Predicted,
    /// Neither: the generic rows, from the published behaviour of the same algorithms.
    Generic,
}

/// Whether the rows [`table`] returns for (`arch`, `width`) were measured, predicted
/// or are the generic ones.
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub fn provenance(arch: &str, width: usize) -> Provenance {
    match (arch, width) {
        (_, 1) | ("sm_90", 2) => Provenance::Measured,
        ("sm_90", 4) | ("sm_90", 8) => Provenance::Predicted,
        _ => Provenance::Generic,
    }
}

/// The table's algorithm for a message of `bytes` over groups of `width` on `arch`.
pub fn choose(arch: &str, width: usize, bytes: usize) -> Algorithm {
    table(arch, width)
        .iter()
        .find(|r| bytes <= r.max_bytes)
        .map_or(Algorithm::OneStage, |r| r.algorithm)
}

/// Opt-in routing by size ([`crate::external::SizeRouting::Table`]): the bytes per rank
/// from which the external library beats peer memory over `width` ranks on `arch`:
/// never on `sm_90` x2 (peercomm beat NCCL 2.28 from 1 KiB to 1 GiB) nor where
/// unmeasured; 1 MiB on `host`, so that routing by the table runs in CI.
pub fn external_from(arch: &str, width: usize) -> Option<usize> {
    (arch == "host" && width > 1).then_some(1 << 20)
}

/// Blocks for a launch that covers `packs` 16-byte packs with `threads` threads per
/// block: enough to give each thread a few packs, at most `max_blocks`.
pub fn blocks_for(packs: usize, threads: u32, max_blocks: u32) -> u32 {
    let wanted = packs.div_ceil(threads as usize).max(1);
    (wanted.min(max_blocks as usize) as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_covers_every_size_in_order() {
        for width in 1..=8 {
            let t = table("sm_90", width);
            assert!(t.windows(2).all(|w| w[0].max_bytes < w[1].max_bytes));
            assert_eq!(t.last().unwrap().max_bytes, usize::MAX);
            assert!(t.iter().all(|r| r.algorithm != Algorithm::Auto));
        }
        assert_eq!(choose("sm_90", 1, 1 << 30), Algorithm::OneStage);
        assert_eq!(choose("sm_90", 2, 1024), Algorithm::Lamport);
        assert_eq!(choose("sm_90", 2, 256 << 10), Algorithm::Lamport);
        assert_eq!(choose("sm_90", 2, (256 << 10) + 2), Algorithm::OneStage);
        assert_eq!(choose("gfx942", 8, 64 << 20), Algorithm::TwoStage);
    }

    #[test]
    fn wider_hopper_groups_follow_the_model_and_say_so() {
        assert_eq!(choose("sm_90", 4, 256 << 10), Algorithm::Lamport);
        assert_eq!(choose("sm_90", 4, 512 << 10), Algorithm::OneStage);
        assert_eq!(choose("sm_90", 4, 1 << 20), Algorithm::TwoStage);
        assert_eq!(choose("sm_90", 8, 128 << 10), Algorithm::Lamport);
        assert_eq!(choose("sm_90", 8, 256 << 10), Algorithm::TwoStage);
        assert_eq!(provenance("sm_90", 2), Provenance::Measured);
        assert_eq!(provenance("sm_90", 8), Provenance::Predicted);
        assert_eq!(provenance("gfx942", 8), Provenance::Generic);
    }

    #[test]
    fn blocks_stay_in_bounds() {
        for (packs, blocks) in [(0, 1), (1, 1), (513, 2), (1 << 30, 64)] {
            assert_eq!(blocks_for(packs, 512, 64), blocks, "{packs} packs");
        }
    }
}
