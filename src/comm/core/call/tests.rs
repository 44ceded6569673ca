//! The descriptor's encoding and the field each difference is named by.

use super::*;
use crate::backend::{Kernel, LaunchDims};
use crate::dispatch::Algorithm;
use crate::signal::group_shown_call;
use DType::{BF16, F32};
use KernelKind as K;

fn plan(kind: KernelKind, dtype: DType, width: usize, elements: usize, blocks: u32) -> Plan {
    let (kernel, threads) = (Kernel { kind, dtype }, 512);
    let dims = LaunchDims { blocks, threads };
    Plan::new(kernel, Algorithm::Auto, width, elements, dims)
}

/// `p` changed by `f`.
fn with(p: &Plan, f: impl FnOnce(&mut Plan)) -> Plan {
    let mut p = *p;
    f(&mut p);
    p
}

/// The first difference between `a` at sequence `sa` and `b` at `sb`, as text.
fn diff(a: &Plan, sa: u64, b: &Plan, sb: u64) -> Option<(CallField, String, String)> {
    first_difference(encode(a, sa), encode(b, sb))
}

/// `field` named, with both sides as shown.
fn shown(field: CallField, mine: &str, theirs: &str) -> Option<(CallField, String, String)> {
    Some((field, mine.into(), theirs.into()))
}

#[test]
fn kinds_table_follows_the_discriminants() {
    for (i, k) in KernelKind::ALL.iter().enumerate() {
        assert_eq!(*k as usize, i, "{k:?}");
    }
}

/// No word sets bit 31 (the Lamport sentinel's), every field at its widest.
#[test]
fn every_word_keeps_bit_31_clear() {
    let mut p = plan(K::AllReduceRmsNorm, BF16, 8, usize::MAX >> 1, 1024);
    let (registration, offset) = (u64::MAX >> 2, u64::MAX >> 2);
    p.input_place = InputPlace::Registered {
        registration,
        offset,
    };
    (p.collective.epsilon, p.collective.hidden) = (-f32::MAX, u32::MAX);
    p.collective.op = ReduceOp::Avg;
    for w in encode(&p, u64::MAX) {
        assert_eq!(w & 0x8000_0000, 0);
    }
}

#[test]
fn each_field_is_named_first_in_order() {
    let base = plan(K::OneStage, F32, 2, 1000, 16);
    assert_eq!(diff(&base, 7, &base, 7), None);
    let fused = plan(K::AllReduceRmsNorm, BF16, 2, 4096, 1);
    let lamport = with(&fused, |p| p.kernel.kind = K::LamportRmsNorm);
    // Plan `p` at call 7 against `p` changed at call `seq`: the field named, both sides.
    macro_rules! named {
        ($p:expr, $seq:expr, |$x:ident| $change:expr => $field:ident, $mine:literal, $theirs:literal) => {
            let got = diff(&$p, 7, &with(&$p, |$x| $change), $seq);
            assert_eq!(got, shown(CallField::$field, $mine, $theirs));
        };
    }
    named!(base, 7, |p| p.elements = 500 => Length, "1000 elements", "500 elements");
    named!(base, 7, |p| p.kernel.dtype = BF16 => DType, "f32", "bf16");
    named!(base, 7, |p| p.width = 4 => GroupWidth, "groups of 2", "groups of 4");
    named!(base, 7, |p| p.dims.blocks = 8 => Blocks, "16 blocks", "8 blocks");
    named!(base, 7, |p| p.kernel.kind = K::Lamport => Algorithm, "one-stage", "Lamport");
    named!(base, 7, |p| p.kernel.kind = K::Broadcast => Collective, "all-reduce", "broadcast");
    named!(base, 8, |p| p.elements = 1000 => Sequence, "call 8", "call 9");
    named!(base, 7, |p| p.collective.op = ReduceOp::Max => Op, "sum", "max");
    // Another width with another barrier domain's count: the width is named.
    named!(base, 2, |p| p.width = 4 => GroupWidth, "groups of 2", "groups of 4");
    // The fused collective's two algorithms are one collective.
    named!(fused, 7, |p| p.kernel.kind = K::LamportRmsNorm => Algorithm, "one-stage", "Lamport");
    use CallField as F;
    let longer = with(&lamport, |p| p.elements = 8 * 4096);
    assert_eq!(diff(&lamport, 3, &longer, 3).map(|d| d.0), Some(F::Length));
    // Element counts past 2^31 keep their high bits.
    let big = with(&base, |p| p.elements = (1 << 33) + 5);
    let small = with(&base, |p| p.elements = 5);
    assert_eq!(diff(&big, 1, &small, 1).map(|g| g.0), Some(F::Length));
}

/// Every field is compared whole: values that a narrower field (or a digest) would
/// confuse are told apart, and decoding gives back what was encoded.
#[test]
fn fields_are_compared_exactly() {
    let base = plan(K::OneStage, BF16, 2, 256, 4);
    let at = |registration, offset| {
        with(&base, |p| {
            p.input_place = InputPlace::Registered {
                registration,
                offset,
            }
        })
    };
    let differs = |a: &Plan, sa: u64, b: &Plan, sb: u64| diff(a, sa, b, sb).map(|d| d.0);
    // Offsets 0 and 39,328 of registration 0 shared an 11-bit tag.
    for (a, b) in [
        (at(0, 0), at(0, 39_328)),
        (at(0, 0), at(1, 0)),
        (at(0, 1 << 31), at(0, 0)),
        (at(5, (1 << 40) + 16), at(5, 16)),
        (at((1 << 31) + 2, 0), at(2, 0)),
        (at(0, 0), base),
    ] {
        let got = differs(&a, 3, &b, 3);
        assert_eq!(got, Some(CallField::Inputs), "{:?}", a.input_place);
    }
    assert_eq!(differs(&at(7, 4096), 3, &at(7, 4096), 3), None);
    // Sequence numbers that differ by 2^20 - 1, 2^31 - 1 or 2^32 paired before.
    for gap in [(1u64 << 20) - 1, (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 40] {
        let got = differs(&base, 9, &base, 9 + gap);
        assert_eq!(got, Some(CallField::Sequence), "{gap}");
    }
    // The fused collective's row length and epsilon.
    let fused = |hidden: u32, epsilon: f32| {
        let mut p = plan(K::AllReduceRmsNorm, BF16, 2, 1920, 4);
        (p.collective.hidden, p.collective.epsilon) = (hidden, epsilon);
        p
    };
    let got = diff(&fused(64, 1e-5), 1, &fused(96, 1e-5), 1);
    let rows = ("rows of 64 elements", "rows of 96 elements");
    assert_eq!(got, shown(CallField::Hidden, rows.0, rows.1));
    let next_up = f32::from_bits(1e-5f32.to_bits() + 1);
    for (e0, e1) in [(1e-5, 1e-6), (0.0, -0.0), (1e-5, next_up)] {
        let got = differs(&fused(64, e0), 1, &fused(64, e1), 1);
        assert_eq!(got, Some(CallField::Epsilon), "{e0} against {e1}");
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
        op: 7,
    };
    assert_eq!(decode(encode_fields(&f)), f);
}

/// What a batch's kernel shows when entry tables differ (signal::group_shown_call):
/// the batch's descriptor with the count and one entry's length of each side, so the
/// host names the length (or the count) and shows exactly those. Between two batches
/// another grid is another length; between other calls it is the block count.
#[test]
fn a_batch_shows_the_differing_entry() {
    let batch = |blocks| {
        let p = plan(K::AllReduceGroup, BF16, 4, 300, blocks);
        encode(&with(&p, |p| p.collective.root = 4), 41)
    };
    let call = batch(7);
    for (mine, theirs) in [
        (999u64, 1000u64),
        (0, 1),
        ((1 << 31) + 3, 3),
        ((1 << 39) - 1, (1 << 38) + 17),
        ((1 << 62) - 1, 1 << 61),
    ] {
        let m = group_shown_call(call, 5, mine);
        let t = group_shown_call(call, 5, theirs);
        for w in m.iter().chain(&t) {
            assert_eq!(w & 0x8000_0000, 0);
        }
        let (dm, dc) = (decode(m), decode(call));
        assert_eq!(dm.elements, mine);
        let elements = dc.elements;
        assert_eq!(Fields { elements, ..dm }, dc, "only the length differs");
        let (mine, theirs) = (format!("{mine} elements"), format!("{theirs} elements"));
        assert_eq!(
            first_difference(m, t),
            shown(CallField::Length, &mine, &theirs)
        );
    }
    // Were the counts to differ, the root names them.
    let got = first_difference(group_shown_call(call, 5, 7), group_shown_call(call, 2, 7));
    assert_eq!(got, shown(CallField::Root, "root 4", "root 1"));
    let sized = |n: &str| format!("entries sized for {n}");
    let got = first_difference(batch(1), batch(2));
    assert_eq!(
        got,
        shown(CallField::Length, &sized("1 block"), &sized("2 blocks"))
    );
    let single = |blocks| encode(&plan(K::OneStage, F32, 2, 300, blocks), 3);
    let got = first_difference(single(1), single(2));
    assert_eq!(got.map(|d| d.0), Some(CallField::Blocks));
}
