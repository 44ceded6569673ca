//! The per-call descriptor: what every rank of a group must agree on for one
//! collective, packed into the twelve words (`PEERCOMM_CALL_WORDS`) that each barrier
//! arrival and each Lamport header carries, compared exactly by the peers, and decoded
//! again into a [`Error::CallMismatch`] that names the first field that differs.
//!
//! Caught, on every path through the core's launch (both APIs): a different
//! collective, element type, group width, root, element count, block count,
//! algorithm, input place (staged, or which registration and which byte offset in
//! it), row length or epsilon of the fused collective, and a call made out of order
//! within a group (the sequence number counts the launches of each barrier domain, so
//! sibling groups, which share a domain but never a barrier, may make different
//! numbers of calls). Every field is held whole (62 bits where a count or an offset
//! needs it), so two different values never compare equal. Ranks in the same barrier
//! domain find the difference when the arrival lands; ranks that the difference puts
//! in different domains or kinds of wait (another group width, Lamport against a
//! barrier) find it when their wait gives up, by reading the awaited peer's
//! `current_call` summary: it runs another call.
//!
//! What stays the caller's contract: calls that agree in every field but pass buffers
//! whose contents the caller did not mean to pair, and a group of one's own calls,
//! which have no peer to compare with. The case a per-domain count cannot see: rank A
//! makes a group-of-one call where its peer B makes a world call, then a world call of
//! its own; that one pairs with B's pending one (the same place in the world domain),
//! and B's next world call has no partner. It is caught late: B's wait for A gives up,
//! B reports `BarrierTimeout` naming A, and A gets `PeerAborted`, so both
//! communicators are poisoned; the pairing itself returned `Ok`.
//!
//! A batch of all-reduces (`AllReduceGroup`) carries only its first entry's length
//! here; its kernel compares every entry's exactly, and records a difference with the
//! descriptors shown as [`crate::signal::group_shown_call`] makes them (see
//! `launch::group`). Between two batches a block-count difference is named
//! [`CallField::Length`]: a batch's grid follows its lengths alone.

use crate::backend::KernelKind;
use crate::dtype::DType;
use crate::error::{CallField, Error};
use crate::signal::CALL_WORDS;

use crate::comm::core::planning::{InputPlace, Plan};

/// Bits of every word (bit 31 stays clear, so no word is the Lamport sentinel).
const LOW31: u64 = 0x7fff_ffff;

/// The fields of a descriptor, each whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fields {
    /// 1 + the rank's launches in the call's barrier domain before this one.
    seq: u64,
    kind: u32,
    dtype: u32,
    width: u32,
    root: u32,
    blocks: u32,
    /// 0: staged (or not read in place); else 1 + the registration number.
    registration: u64,
    /// The input's byte offset in that registration.
    offset: u64,
    elements: u64,
    hidden: u32,
    epsilon: u32,
}

/// Splits `x` (at most 62 bits) into two 31-bit words.
fn split(x: u64) -> [u32; 2] {
    [(x & LOW31) as u32, ((x >> 31) & LOW31) as u32]
}

fn join(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | u64::from(hi) << 31
}

fn encode_fields(f: &Fields) -> [u32; CALL_WORDS] {
    let [s0, s1] = split(f.seq);
    let [e0, e1] = split(f.elements);
    let [r0, r1] = split(f.registration);
    let [o0, o1] = split(f.offset);
    let kind = f.kind & 0x1f
        | (f.dtype & 0xf) << 5
        | (f.width.saturating_sub(1) & 7) << 9
        | (f.root & 7) << 12
        | (f.blocks.saturating_sub(1) & 0x3ff) << 15;
    [
        s0,
        s1,
        kind,
        e0,
        e1,
        r0,
        o0,
        o1,
        f.hidden & LOW31 as u32,
        f.epsilon & LOW31 as u32,
        f.epsilon >> 31,
        r1,
    ]
}

fn decode(w: [u32; CALL_WORDS]) -> Fields {
    Fields {
        seq: join(w[0], w[1]),
        kind: w[2] & 0x1f,
        dtype: (w[2] >> 5) & 0xf,
        width: ((w[2] >> 9) & 7) + 1,
        root: (w[2] >> 12) & 7,
        blocks: ((w[2] >> 15) & 0x3ff) + 1,
        elements: join(w[3], w[4]),
        registration: join(w[5], w[11]),
        offset: join(w[6], w[7]),
        hidden: w[8],
        epsilon: w[9] | (w[10] & 1) << 31,
    }
}

/// The descriptor of a rank's call of `plan`, `launched` launches after the signal was
/// last initialised in the call's barrier domain (see the header).
pub(crate) fn encode(plan: &Plan, launched: u64) -> [u32; CALL_WORDS] {
    let (registration, offset) = match plan.input_place {
        InputPlace::Staged => (0, 0),
        InputPlace::Registered {
            registration,
            offset,
        } => (registration.wrapping_add(1), offset),
    };
    encode_fields(&Fields {
        seq: launched.wrapping_add(1),
        kind: plan.kernel.kind as u32,
        dtype: plan.kernel.dtype.raw() as u32,
        width: plan.width as u32,
        root: plan.collective.root,
        blocks: plan.dims.blocks,
        registration,
        offset,
        elements: plan.elements as u64,
        hidden: plan.collective.hidden,
        epsilon: plan.collective.epsilon.to_bits(),
    })
}

fn kind_of(code: u32) -> Option<KernelKind> {
    KernelKind::ALL.get(code as usize).copied()
}

/// Whether a descriptor is a batch of all-reduces' (see `launch::group`).
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
        // The root field holds the number of calls less one (see `launch::group`).
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

/// `call k`, or, for a zero sequence number, that the rank has run no call.
fn call_number(seq: u64) -> String {
    if seq == 0 {
        "no call yet".into()
    } else {
        format!("call {seq}")
    }
}

/// Where a descriptor says the peers read the input.
fn place_name(f: &Fields) -> String {
    match f.registration {
        0 => "the input staged (not registered)".to_string(),
        r => format!(
            "a registered input (registration {}, byte offset {})",
            r - 1,
            f.offset
        ),
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
            format!("{} elements", a.elements),
            format!("{} elements", b.elements),
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
    } else if (a.registration, a.offset) != (b.registration, b.offset) {
        (CallField::Inputs, place_name(&a), place_name(&b))
    } else if a.hidden != b.hidden {
        (
            CallField::Hidden,
            format!("rows of {} elements", a.hidden),
            format!("rows of {} elements", b.hidden),
        )
    } else if a.epsilon != b.epsilon {
        let eps = |bits: u32| format!("epsilon {:e}", f32::from_bits(bits));
        (CallField::Epsilon, eps(a.epsilon), eps(b.epsilon))
    } else if a.seq != b.seq {
        (CallField::Sequence, call_number(a.seq), call_number(b.seq))
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
    use super::*;
    use crate::backend::{Kernel, LaunchDims};
    use crate::comm::core::planning::CollectiveArgs;
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
            input_place: InputPlace::Staged,
            collective: CollectiveArgs::default(),
        }
    }

    #[test]
    fn kinds_table_follows_the_discriminants() {
        for (i, k) in KernelKind::ALL.iter().enumerate() {
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
        let mut p = p;
        p.input_place = InputPlace::Registered {
            registration: u64::MAX >> 2,
            offset: u64::MAX >> 2,
        };
        p.collective.epsilon = -f32::MAX;
        p.collective.hidden = u32::MAX;
        for w in encode(&p, u64::MAX) {
            assert_eq!(w & 0x8000_0000, 0);
        }
    }

    #[test]
    fn each_field_is_named_first_in_order() {
        let base = plan(KernelKind::OneStage, DType::F32, 2, 1000, 16);
        let m = encode(&base, 7);
        assert_eq!(first_difference(m, m), None);
        let cases: [(Plan, u64, CallField, &str, &str); 8] = [
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

    /// Every field is compared whole: values that a narrower field (or a digest) would
    /// confuse are told apart, and decoding gives back what was encoded.
    #[test]
    fn fields_are_compared_exactly() {
        let base = plan(KernelKind::OneStage, DType::BF16, 2, 256, 4);
        let at = |registration: u64, offset: u64| {
            base.clone_with(|p| {
                p.input_place = InputPlace::Registered {
                    registration,
                    offset,
                }
            })
        };
        let differs = |a: &Plan, sa: u64, b: &Plan, sb: u64| {
            first_difference(encode(a, sa), encode(b, sb)).map(|d| d.0)
        };
        // Offsets 0 and 39,328 of registration 0 shared an 11-bit tag.
        assert_eq!(
            differs(&at(0, 0), 3, &at(0, 39_328), 3),
            Some(CallField::Inputs)
        );
        for (r0, o0, r1, o1) in [
            (0, 0, 1, 0),
            (0, 1 << 31, 0, 0),
            (5, (1 << 40) + 16, 5, 16),
            ((1 << 31) + 2, 0, 2, 0),
        ] {
            assert_eq!(
                differs(&at(r0, o0), 3, &at(r1, o1), 3),
                Some(CallField::Inputs),
                "{r0}/{o0} against {r1}/{o1}"
            );
        }
        assert_eq!(differs(&at(0, 0), 3, &base, 3), Some(CallField::Inputs));
        assert_eq!(differs(&at(7, 4096), 3, &at(7, 4096), 3), None);
        // Sequence numbers that differ by 2^20 - 1, 2^31 - 1 or 2^32 paired before.
        for gap in [(1u64 << 20) - 1, (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 40] {
            assert_eq!(
                differs(&base, 9, &base, 9 + gap),
                Some(CallField::Sequence),
                "{gap}"
            );
        }
        // The fused collective's row length and epsilon.
        let fused = |hidden: u32, epsilon: f32| {
            let mut p = plan(KernelKind::AllReduceRmsNorm, DType::BF16, 2, 1920, 4);
            p.collective.hidden = hidden;
            p.collective.epsilon = epsilon;
            p
        };
        assert_eq!(
            first_difference(encode(&fused(64, 1e-5), 1), encode(&fused(96, 1e-5), 1)),
            Some((
                CallField::Hidden,
                "rows of 64 elements".into(),
                "rows of 96 elements".into()
            ))
        );
        for (e0, e1) in [
            (1e-5, 1e-6),
            (0.0, -0.0),
            (1e-5, f32::from_bits(1e-5f32.to_bits() + 1)),
        ] {
            assert_eq!(
                differs(&fused(64, e0), 1, &fused(64, e1), 1),
                Some(CallField::Epsilon),
                "{e0} against {e1}"
            );
        }
        // Round trip of every field at its widest.
        let f = Fields {
            seq: (1 << 62) - 1,
            kind: 12,
            dtype: 2,
            width: 8,
            root: 7,
            blocks: 1024,
            registration: (1 << 62) - 1,
            offset: (1 << 62) - 3,
            elements: (1 << 62) - 5,
            hidden: (1 << 31) - 1,
            epsilon: (-1e-5f32).to_bits(),
        };
        assert_eq!(decode(encode_fields(&f)), f);
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
            ((1 << 62) - 1, 1 << 61),
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
