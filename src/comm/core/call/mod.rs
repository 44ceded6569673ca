//! The per-call descriptor: what every rank of a group must agree on for one
//! collective, packed into the [`CALL_WORDS`] words that each barrier arrival and
//! Lamport header carries, compared exactly by the peers, and decoded into an
//! [`Error::CallMismatch`] naming the first field that differs.
//!
//! Caught on both APIs: another collective, dtype, group width, root, length, block
//! count, algorithm, input place (staged, or which registration and offset), fused row
//! length or epsilon, and a call out of order (the sequence number counts the launches
//! of each barrier domain, so sibling groups may make different numbers of calls).
//! Every field is held whole, so different values never compare equal. Ranks that a
//! difference puts in different domains or kinds of wait find it when their wait gives
//! up, by reading the awaited peer's `current_call`.
//!
//! Left to the caller: calls that agree in every field but pair unintended buffers, and
//! a group of one's calls. A rank's group-of-one call where its peer makes a world call
//! pairs its next world call with the peer's pending one; it is caught late, as a
//! `BarrierTimeout` on the peer and `PeerAborted` here.
//!
//! A batch of all-reduces carries only entry 0's length here; its kernel compares every
//! entry (see `launch::group`). Between two batches another block count is named
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
mod tests;
