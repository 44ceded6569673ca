//! Which algorithm and how many blocks, per architecture, group width and message size.
//!
//! The table is data, not code paths: each row says up to how many bytes an algorithm
//! is the fastest for a (architecture, group width) pair. The numbers behind each
//! boundary are in `docs/dispatch.md` (measured with `peercomm-bench`); a pair that
//! was never measured falls back to the generic row. Which kernel runs an algorithm is
//! the backend's business (`Algorithm::kernel_kind`, defined in [`crate::backend`]).

/// An all-reduce algorithm, or `Auto` to let the dispatch table choose.
///
/// Every algorithm sums in the same order (group rank 0, 1, ... in f32), so they give
/// bitwise-identical results, and an element's result does not depend on the length
/// of the message it is in, the algorithm, or the API (single controller or per rank),
/// with no exception. The sign of zero follows one rule: in a group of two or more the
/// f32 sum starts at +0.0, so every exact-zero sum is +0.0 on every algorithm (Lamport
/// cannot carry -0.0, its "not yet arrived" mark, so the others give +0.0 too, even
/// where every input is -0.0), and a nonzero sum that rounds to zero keeps its sign; a
/// group of one (a world of one, or `group_size` 1) returns its input bit for bit,
/// -0.0 included. `Lamport` runs only over the whole world of two or more ranks:
/// forced over a group of one it runs `OneStage` (the copy, reported as `OneStage`),
/// and forced over a narrower subgroup it is refused with
/// [`crate::Error::Unsupported`]. `Auto` never picks it there.
///
/// The fused all-reduce + residual + RMSNorm takes `OneStage` or `Lamport` (or `Auto`)
/// through [`crate::CollectiveOptions::algorithm`], under the same rules; the two give
/// the same bits there too.
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
    /// The whole call ran in the external library (NCCL on CUDA, RCCL on AMD, the host
    /// stand-in on the host backend): see the `external` module. Returned when peer
    /// memory cannot serve the communicator (and its fallback is on), or when the user
    /// opted in to routing by size; forcing it needs the external library to be set up.
    Nccl,
    /// Ranks span hosts: a sum over peer memory inside each host, the external library
    /// across hosts (one slice per local rank), then a gather inside each host over
    /// peer memory. Returned, never forced. Today the host's sum is a whole peer
    /// all-reduce and the gather a second one in which every other slice is -0.0 (the
    /// additive identity, so each slice is copied bit for bit): twice the intra-host
    /// traffic of a reduce-scatter and an all-gather, which a measurement may justify
    /// switching to.
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
    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    // Hopper (sm_90), two GPUs over NV18, measured on 2x H200 (docs/dispatch.md, graph
    // mode): Lamport is fastest up to 256 KiB (256 KiB bf16: 5.03 us against one-stage
    // 5.15), the two are even at 512 KiB-1 MiB and one-stage wins above (2 MiB: 10.76
    // against 12.31); two-stage never wins at two ranks (same link traffic, one more
    // barrier: 1 MiB 10.29 against 7.31).
    static SM90_2: [DispatchRow; 2] = [
        row(256 * KIB, Algorithm::Lamport),
        row(usize::MAX, Algorithm::OneStage),
    ];
    // Unmeasured pairs: Lamport while one launch and one trip dominate, one-stage while
    // the extra barrier of two-stage costs more than the traffic it saves, then two-stage
    // (each rank then moves 2(n-1)/n of the message instead of n-1 times it).
    static GENERIC_2: [DispatchRow; 2] = [
        row(256 * KIB, Algorithm::Lamport),
        row(usize::MAX, Algorithm::OneStage),
    ];
    static GENERIC_N: [DispatchRow; 3] = [
        row(256 * KIB, Algorithm::Lamport),
        row(MIB, Algorithm::OneStage),
        row(usize::MAX, Algorithm::TwoStage),
    ];
    // Hopper at 4 and 8 GPUs (NVSwitch): PREDICTED, not measured. The crossovers of the
    // model calibrated on the 2-GPU runs (shared/perf-model, nominal assumptions, with
    // the rotated all-gather and the width-scaled grid): each rank takes in (W-1)N bytes
    // with one-stage or Lamport but 2(W-1)N/W with two-stage, so two-stage takes over
    // sooner the wider the group. Replace with measured rows (see `provenance`).
    static SM90_4: [DispatchRow; 3] = [
        row(440 * KIB, Algorithm::Lamport),
        row(810 * KIB, Algorithm::OneStage),
        row(usize::MAX, Algorithm::TwoStage),
    ];
    static SM90_8: [DispatchRow; 2] = [
        row(210 * KIB, Algorithm::Lamport),
        row(usize::MAX, Algorithm::TwoStage),
    ];
    static SINGLE: [DispatchRow; 1] = [row(usize::MAX, Algorithm::OneStage)];
    match (arch, width) {
        (_, 1) => &SINGLE,
        ("sm_90", 2) => &SM90_2,
        ("sm_90", 4) => &SM90_4,
        ("sm_90", 8) => &SM90_8,
        (_, 2) => &GENERIC_2,
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
        .map(|r| r.algorithm)
        .unwrap_or(Algorithm::OneStage)
}

/// Opt-in routing by size ([`crate::external::SizeRouting::Table`]): the message size
/// (bytes per rank) from which the external library beats peer memory over groups of
/// `width` on `arch`, or `None` where it never does.
///
/// - `sm_90`, two GPUs over NV18 (2x H200, `results/2026-12-01-h200x2/final/`):
///   peercomm is faster than NCCL 2.28 at every size measured, 1 KiB to 1 GiB (0.42x of
///   NCCL's time at 1 KiB, 1.01x its bus bandwidth at 1 GiB): never.
/// - `host`: the host backend has no speed to measure; its row (1 MiB) exists so that
///   routing by the table runs in CI against the host stand-in.
/// - Everything else is unmeasured: never (a row is added where a measurement shows
///   the library faster, e.g. PCIe machines at large sizes).
pub fn external_from(arch: &str, width: usize) -> Option<usize> {
    match (arch, width) {
        (_, 1) => None,
        ("host", _) => Some(1 << 20),
        _ => None,
    }
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
        assert_eq!(blocks_for(0, 512, 64), 1);
        assert_eq!(blocks_for(1, 512, 64), 1);
        assert_eq!(blocks_for(513, 512, 64), 2);
        assert_eq!(blocks_for(1 << 30, 512, 64), 64);
    }
}
