//! The descriptor's encoding and the field each difference is named by.

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
    use CallField as F;
    type Case = (fn(&mut Plan), u64, CallField, &'static str, &'static str);
    let cases: [Case; 8] = [
        (
            |p| p.elements = 500,
            7,
            F::Length,
            "1000 elements",
            "500 elements",
        ),
        (|p| p.kernel.dtype = DType::BF16, 7, F::DType, "f32", "bf16"),
        (
            |p| p.width = 4,
            7,
            F::GroupWidth,
            "groups of 2",
            "groups of 4",
        ),
        (|p| p.dims.blocks = 8, 7, F::Blocks, "16 blocks", "8 blocks"),
        (
            |p| p.kernel.kind = KernelKind::Lamport,
            7,
            F::Algorithm,
            "one-stage",
            "Lamport",
        ),
        (
            |p| p.kernel.kind = KernelKind::Broadcast,
            7,
            F::Collective,
            "all-reduce",
            "broadcast",
        ),
        (|_| (), 8, F::Sequence, "call 8", "call 9"),
        // Another width with another barrier domain's count: the width is named.
        (
            |p| p.width = 4,
            2,
            F::GroupWidth,
            "groups of 2",
            "groups of 4",
        ),
    ];
    for (change, seq, field, mine, theirs) in cases {
        let other = base.clone_with(change);
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
