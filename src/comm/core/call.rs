//! The per-call descriptor: what every rank of a group must agree on for one
//! collective, packed into the three words (`PEERCOMM_CALL_WORDS`) that each barrier
//! arrival and each Lamport header carries, and decoded again into a
//! [`Error::CallMismatch`] that names the first field that differs.
//!
//! Caught, on every path through [`super::Rank::launch_fused`] (both APIs): a different
//! collective, element type, group width, root, element count (exact below 2^39
//! elements), block count, algorithm or input place (staged, or where in which
//! registered buffer), and a call made out of order within a group (the
//! sequence number counts the launches of each barrier domain, so sibling groups, which
//! share a domain but never a barrier, may make different numbers of calls). Ranks in
//! the same barrier domain find the difference when the arrival lands; ranks that the
//! difference puts in different domains or kinds of wait (another group width, Lamport
//! against a barrier) find it when their wait gives up, by reading the awaited peer's
//! `current_call`: it runs another call. What stays the caller's contract: calls that
//! agree in every field but pass buffers whose contents the caller did not mean to
//! pair, calls whose element counts differ by a multiple of 2^39 (or whose call numbers
//! differ by a multiple of 2^20 - 1, or whose registered input places hash alike: see
//! `registry.rs`), and a group of one's
//! own calls, which have no peer to compare with. The case a per-domain count cannot
//! see: rank A makes a group-of-one call where its peer B makes a world call, then a
//! world call of its own; that one pairs with B's pending one (the same place in the
//! world domain), and B's next world call has no partner. It is caught late: B's wait
//! for A gives up, B reports `BarrierTimeout` naming A, and A gets `PeerAborted`, so
//! both communicators are poisoned; the pairing itself returned `Ok`.
//!
//! A batch of all-reduces (`AllReduceGroup`) carries only its first entry's length
//! here; its kernel compares every entry's exactly, and records a difference with the
//! descriptors shown as [`crate::signal::group_shown_call`] makes them (see
//! `core/group.rs`). Between two batches a block-count difference is named
//! [`CallField::Length`]: a batch's grid follows its lengths alone.

use crate::backend::KernelKind;
use crate::dtype::DType;
use crate::error::{CallField, Error};
use crate::signal::CALL_WORDS;

use super::plan::Plan;

/// Bits of the sequence number, the element count's low word and every other word
/// (bit 31 stays clear, so no word is the Lamport sentinel).
const LOW31: u32 = 0x7fff_ffff;

/// Every kernel kind, in the order of its discriminant (the descriptor's kind field).
const KINDS: [KernelKind; 13] = [
    KernelKind::OneStage,
    KernelKind::TwoStage,
    KernelKind::Lamport,
    KernelKind::Barrier,
    KernelKind::PingPong,
    KernelKind::Delay,
    KernelKind::AllGather,
    KernelKind::ReduceScatter,
    KernelKind::Broadcast,
    KernelKind::Scatter,
    KernelKind::AllReduceRmsNorm,
    KernelKind::AllReduceGroup,
    KernelKind::LamportRmsNorm,
];

/// The descriptor of call number `seq` of a rank for `plan` (see the header).
pub(crate) fn encode(plan: &Plan, seq: u32) -> [u32; CALL_WORDS] {
    let n = plan.elements as u64;
    let kind = plan.kernel.kind as u32;
    let dtype = plan.kernel.dtype.raw() as u32;
    let width = (plan.width as u32).saturating_sub(1) & 7;
    let root = plan.collective.root & 7;
    let blocks = plan.dims.blocks.saturating_sub(1) & 0x3ff;
    let high = ((n >> 31) & 0xff) as u32;
    let w1 = kind | dtype << 5 | width << 7 | root << 10 | blocks << 13 | high << 23;
    // Bits 0-19: the sequence number, 1 ..= 2^20 - 1 (a zero sequence word is what an
    // initialised signal's current_call holds before its rank has run any call);
    // bits 20-30: where the peers read the input (0 staged, else a registered place).
    let w0 = (seq % SEQ_MASK + 1) | (plan.input_tag & INPUT_TAG_MASK) << 20;
    [w0 & LOW31, w1 & LOW31, (n as u32) & LOW31]
}

/// The sequence number's bits in word 0 (its values are 1 ..= this).
const SEQ_MASK: u32 = (1 << 20) - 1;
/// The input place tag's bits (after shifting down by 20).
const INPUT_TAG_MASK: u32 = 0x7ff;

/// The fields of a descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fields {
    seq: u32,
    input_tag: u32,
    kind: u32,
    dtype: u32,
    width: u32,
    root: u32,
    blocks: u32,
    elements: u64,
}

fn decode(w: [u32; CALL_WORDS]) -> Fields {
    Fields {
        seq: w[0] & SEQ_MASK,
        input_tag: (w[0] >> 20) & INPUT_TAG_MASK,
        kind: w[1] & 0x1f,
        dtype: (w[1] >> 5) & 3,
        width: ((w[1] >> 7) & 7) + 1,
        root: (w[1] >> 10) & 7,
        blocks: ((w[1] >> 13) & 0x3ff) + 1,
        elements: u64::from((w[1] >> 23) & 0xff) << 31 | u64::from(w[2]),
    }
}

fn kind_of(code: u32) -> Option<KernelKind> {
    KINDS.get(code as usize).copied()
}

/// Whether a descriptor is a batch of all-reduces' (see core/group.rs).
fn is_batch(f: &Fields) -> bool {
    kind_of(f.kind) == Some(KernelKind::AllReduceGroup)
}

/// What a batch's grid says of its entries.
fn sized_for(blocks: u32) -> String {
    if blocks == 1 {
        "entries sized for 1 block".into()
    } else {
        format!("entries sized for {blocks} blocks")
    }
}

/// The collective a kernel kind runs.
fn collective_name(code: u32) -> String {
    match kind_of(code) {
        Some(KernelKind::OneStage | KernelKind::TwoStage | KernelKind::Lamport) => {
            "all-reduce".into()
        }
        // One collective, two algorithms: a one-stage rank against a Lamport one is an
        // algorithm mismatch.
        Some(KernelKind::AllReduceRmsNorm | KernelKind::LamportRmsNorm) => {
            "fused all-reduce + RMSNorm".into()
        }
        // The root field holds the number of calls less one (see core/group.rs).
        Some(KernelKind::AllReduceGroup) => "group of all-reduces".into(),
        Some(k) => k.name().replace('_', "-"),
        None => format!("unknown kernel {code}"),
    }
}

/// The algorithm a kernel kind runs.
fn algorithm_name(code: u32) -> String {
    match kind_of(code) {
        Some(KernelKind::TwoStage) => "two-stage".into(),
        Some(KernelKind::Lamport | KernelKind::LamportRmsNorm) => "Lamport".into(),
        Some(_) => "one-stage".into(),
        None => format!("unknown kernel {code}"),
    }
}

fn dtype_name(code: u32) -> String {
    DType::ALL
        .iter()
        .find(|d| d.raw() as u32 == code)
        .map_or_else(|| format!("dtype {code}"), |d| d.name().to_string())
}

/// `call k`, or, for a zero sequence word, that the rank has run no call.
fn call_number(seq: u32) -> String {
    if seq == 0 {
        "no call yet".into()
    } else {
        format!("call {seq}")
    }
}

/// The first field in which `theirs` differs from `mine`, with both values as text;
/// `None` when they agree.
pub(crate) fn first_difference(
    mine: [u32; CALL_WORDS],
    theirs: [u32; CALL_WORDS],
) -> Option<(CallField, String, String)> {
    let (a, b) = (decode(mine), decode(theirs));
    let collective = |f: &Fields| collective_name(f.kind);
    let number = |x: u64| x.to_string();
    let field = if collective(&a) != collective(&b) {
        (CallField::Collective, collective(&a), collective(&b))
    } else if a.dtype != b.dtype {
        (CallField::DType, dtype_name(a.dtype), dtype_name(b.dtype))
    } else if a.width != b.width {
        (
            CallField::GroupWidth,
            format!("groups of {}", a.width),
            format!("groups of {}", b.width),
        )
    } else if a.root != b.root {
        (
            CallField::Root,
            format!("root {}", a.root),
            format!("root {}", b.root),
        )
    } else if a.elements != b.elements {
        (
            CallField::Length,
            format!("{} elements", number(a.elements)),
            format!("{} elements", number(b.elements)),
        )
    } else if a.blocks != b.blocks && is_batch(&a) && is_batch(&b) {
        // A batch's grid follows its entries' packs (the settings it also depends on
        // are agreed at setup, the count is the root field): another grid is another
        // length in a later entry, which the descriptor does not hold.
        (CallField::Length, sized_for(a.blocks), sized_for(b.blocks))
    } else if a.blocks != b.blocks {
        (
            CallField::Blocks,
            format!("{} blocks", a.blocks),
            format!("{} blocks", b.blocks),
        )
    } else if a.kind != b.kind {
        (
            CallField::Algorithm,
            algorithm_name(a.kind),
            algorithm_name(b.kind),
        )
    } else if a.input_tag != b.input_tag {
        let place = |t: u32| {
            if t == 0 {
                "the input staged (not registered)".to_string()
            } else {
                format!("a registered input (place tag {t})")
            }
        };
        (CallField::Inputs, place(a.input_tag), place(b.input_tag))
    } else if a.seq != b.seq {
        (
            CallField::Sequence,
            format!("call {}", a.seq),
            call_number(b.seq),
        )
    } else {
        return None;
    };
    Some(field)
}

/// The typed error of rank `rank` whose peer `peer` published `theirs` against its own
/// `mine`.
pub(crate) fn mismatch_error(
    rank: usize,
    peer: usize,
    mine: [u32; CALL_WORDS],
    theirs: [u32; CALL_WORDS],
) -> Error {
    let (field, mine, theirs) = first_difference(mine, theirs).unwrap_or((
        CallField::Sequence,
        "this call".into(),
        "another call".into(),
    ));
    Error::CallMismatch {
        rank,
        peer,
        field,
        mine,
        theirs,
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::CollectiveArgs;
    use super::*;
    use crate::backend::{Kernel, LaunchDims};
    use crate::dispatch::Algorithm;

    fn plan(kind: KernelKind, dtype: DType, width: usize, elements: usize, blocks: u32) -> Plan {
        Plan {
            kernel: Kernel { kind, dtype },
            algorithm: Algorithm::Auto,
            width,
            elements,
            stage_input: false,
            dims: LaunchDims {
                blocks,
                threads: 512,
            },
            overlap_previous: false,
            input_tag: 0,
            collective: CollectiveArgs::default(),
        }
    }

    #[test]
    fn kinds_table_follows_the_discriminants() {
        for (i, k) in KINDS.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
    }

    #[test]
    fn every_word_keeps_bit_31_clear() {
        let p = plan(
            KernelKind::AllReduceRmsNorm,
            DType::BF16,
            8,
            usize::MAX >> 1,
            1024,
        );
        for w in encode(&p, u32::MAX) {
            assert_eq!(w & 0x8000_0000, 0);
        }
    }

    #[test]
    fn each_field_is_named_first_in_order() {
        let base = plan(KernelKind::OneStage, DType::F32, 2, 1000, 16);
        let m = encode(&base, 7);
        assert_eq!(first_difference(m, m), None);
        let cases: [(Plan, u32, CallField, &str, &str); 8] = [
            (
                base.clone_with(|p| p.elements = 500),
                7,
                CallField::Length,
                "1000 elements",
                "500 elements",
            ),
            (
                base.clone_with(|p| p.kernel.dtype = DType::BF16),
                7,
                CallField::DType,
                "f32",
                "bf16",
            ),
            (
                base.clone_with(|p| p.width = 4),
                7,
                CallField::GroupWidth,
                "groups of 2",
                "groups of 4",
            ),
            (
                base.clone_with(|p| p.dims.blocks = 8),
                7,
                CallField::Blocks,
                "16 blocks",
                "8 blocks",
            ),
            (
                base.clone_with(|p| p.kernel.kind = KernelKind::Lamport),
                7,
                CallField::Algorithm,
                "one-stage",
                "Lamport",
            ),
            (
                base.clone_with(|p| p.kernel.kind = KernelKind::Broadcast),
                7,
                CallField::Collective,
                "all-reduce",
                "broadcast",
            ),
            (
                base.clone_with(|_| ()),
                8,
                CallField::Sequence,
                "call 8",
                "call 9",
            ),
            // Another width with another sequence number (another barrier domain's
            // count): the width is named, not the count.
            (
                base.clone_with(|p| p.width = 4),
                2,
                CallField::GroupWidth,
                "groups of 2",
                "groups of 4",
            ),
        ];
        for (other, seq, field, mine, theirs) in cases {
            let got = first_difference(m, encode(&other, seq)).expect("differs");
            assert_eq!(got, (field, mine.to_string(), theirs.to_string()));
        }
        // The fused collective's two algorithms are one collective: a one-stage rank
        // against a Lamport one differs in the algorithm.
        let fused = plan(KernelKind::AllReduceRmsNorm, DType::BF16, 2, 4096, 1);
        let lamport = fused.clone_with(|p| p.kernel.kind = KernelKind::LamportRmsNorm);
        assert_eq!(
            first_difference(encode(&fused, 3), encode(&lamport, 3)),
            Some((CallField::Algorithm, "one-stage".into(), "Lamport".into()))
        );
        let longer = lamport.clone_with(|p| p.elements = 8 * 4096);
        assert_eq!(
            first_difference(encode(&lamport, 3), encode(&longer, 3)).map(|d| d.0),
            Some(CallField::Length)
        );
        // Element counts past 2^31 keep their high bits.
        let big = base.clone_with(|p| p.elements = (1 << 33) + 5);
        let got = first_difference(
            encode(&big, 1),
            encode(&base.clone_with(|p| p.elements = 5), 1),
        );
        assert_eq!(got.map(|g| g.0), Some(CallField::Length));
    }

    /// What a batch's kernel shows when entry tables differ (signal::group_shown_call):
    /// the batch's descriptor with the count and one entry's length of each side, so the
    /// host names the length (or the count) and shows exactly those.
    #[test]
    fn a_batch_shows_the_differing_entry() {
        let mut batch = plan(KernelKind::AllReduceGroup, DType::BF16, 4, 300, 7);
        batch.collective.root = 4;
        let call = encode(&batch, 41);
        for (mine, theirs) in [
            (999u64, 1000u64),
            (0, 1),
            ((1 << 31) + 3, 3),
            ((1 << 39) - 1, (1 << 38) + 17),
        ] {
            let (m, t) = (
                crate::signal::group_shown_call(call, 5, mine),
                crate::signal::group_shown_call(call, 5, theirs),
            );
            for w in m.iter().chain(&t) {
                assert_eq!(w & 0x8000_0000, 0);
            }
            let (dm, dc) = (decode(m), decode(call));
            assert_eq!(dm.elements, mine);
            assert_eq!(
                Fields {
                    elements: dc.elements,
                    ..dm
                },
                dc,
                "only the element count is replaced"
            );
            assert_eq!(
                first_difference(m, t),
                Some((
                    CallField::Length,
                    format!("{mine} elements"),
                    format!("{theirs} elements")
                ))
            );
        }
        // Were the counts to differ, the root names them.
        let got = first_difference(
            crate::signal::group_shown_call(call, 5, 7),
            crate::signal::group_shown_call(call, 2, 7),
        );
        assert_eq!(
            got,
            Some((CallField::Root, "root 4".into(), "root 1".into()))
        );
    }

    /// Between two batches another grid is another length; between other calls it is
    /// the block count.
    #[test]
    fn a_batch_grid_difference_is_a_length() {
        let batch = |blocks| {
            let mut p = plan(KernelKind::AllReduceGroup, DType::F32, 2, 300, blocks);
            p.collective.root = 4;
            encode(&p, 3)
        };
        assert_eq!(
            first_difference(batch(1), batch(2)),
            Some((
                CallField::Length,
                "entries sized for 1 block".into(),
                "entries sized for 2 blocks".into()
            ))
        );
        let single = |blocks| encode(&plan(KernelKind::OneStage, DType::F32, 2, 300, blocks), 3);
        assert_eq!(
            first_difference(single(1), single(2)).map(|d| d.0),
            Some(CallField::Blocks)
        );
    }

    trait CloneWith {
        fn clone_with(&self, f: impl FnOnce(&mut Plan)) -> Plan;
    }
    impl CloneWith for Plan {
        fn clone_with(&self, f: impl FnOnce(&mut Plan)) -> Plan {
            let mut p = plan(
                self.kernel.kind,
                self.kernel.dtype,
                self.width,
                self.elements,
                self.dims.blocks,
            );
            f(&mut p);
            p
        }
    }
}
