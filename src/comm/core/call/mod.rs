//! The per-call descriptor: what a group's ranks must agree on for one collective, every
//! field whole in the [`CALL_WORDS`] words of each barrier arrival and Lamport header,
//! compared exactly by the peers; a difference is an [`Error::CallMismatch`] naming the
//! first differing field. The sequence number counts launches per barrier domain, so
//! sibling groups may make different numbers of calls.
//!
//! Not caught: calls agreeing in every field but pairing unintended buffers, and a group
//! of one's calls. A batch carries entry 0's length (`launch::group` compares the rest);
//! its grid follows its lengths, so another grid between batches is a `Length`.

use crate::backend::KernelKind;
use crate::dtype::DType;
use crate::dtype::ReduceOp;
use crate::error::{CallField, Error};
use crate::signal::{CALL_OP_SHIFT, CALL_WORDS};

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
    op: u32,
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
        | (f.blocks.saturating_sub(1) & 0x3ff) << 15
        | (f.op & 7) << CALL_OP_SHIFT;
    let (hidden, eps0, eps1) = (
        f.hidden & LOW31 as u32,
        f.epsilon & LOW31 as u32,
        f.epsilon >> 31,
    );
    [s0, s1, kind, e0, e1, r0, o0, o1, hidden, eps0, eps1, r1]
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
        op: (w[2] >> CALL_OP_SHIFT) & 7,
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
        op: plan.collective.op.raw(),
    })
}

/// The exchange's summary descriptor (its `current_call`): the kind and the world, the
/// same on every rank, since each pair has its own descriptor.
pub(crate) fn encode_exchange_summary(world: usize) -> [u32; CALL_WORDS] {
    encode_fields(&Fields {
        seq: 0,
        kind: KernelKind::Exchange as u32,
        dtype: 0,
        width: world as u32,
        root: 0,
        blocks: 1,
        registration: 0,
        offset: 0,
        elements: 0,
        hidden: 0,
        epsilon: 0,
        op: 0,
    })
}

/// The descriptor of user kernels' barriers on a [`crate::device::DeviceComm`]: kind
/// user, the group width, the buffer's registration, offset and bytes (the same on every
/// rank that works on the same buffer).
pub(crate) fn encode_user(
    width: usize,
    registration: u64,
    offset: u64,
    bytes: u64,
) -> [u32; CALL_WORDS] {
    encode_fields(&Fields {
        seq: 0,
        kind: crate::signal::KIND_USER,
        dtype: 0,
        width: width as u32,
        root: 0,
        blocks: 1,
        registration: registration + 1,
        offset,
        elements: bytes,
        hidden: 0,
        epsilon: 0,
        op: 0,
    })
}

/// What a pair of ranks moves in one exchange launch, as both compute it.
pub(crate) struct Pair {
    /// 1 + the launches of exchanges between the two before this one.
    pub(crate) seq: u64,
    /// The lower and the higher world rank.
    pub(crate) ranks: (usize, usize),
    /// What the lower rank sends the higher (type, elements), if anything.
    pub(crate) low_sends: Option<(DType, usize)>,
    /// What the higher rank sends the lower.
    pub(crate) high_sends: Option<(DType, usize)>,
    pub(crate) blocks: u32,
    pub(crate) world: usize,
}

/// A direction's dtype field: 0 for none, else the code + 1.
fn dtype_field(d: Option<(DType, usize)>) -> u32 {
    d.map_or(0, |(t, _)| t.raw() as u32 + 1)
}

/// The pair's descriptor: the lower rank's send in the dtype and element fields, the
/// higher rank's in words 6-7 (elements) and word 8 (dtype, bits 0-3), with the two
/// ranks in word 8 (bits 4-6 and 7-9).
pub(crate) fn encode_pair(p: Pair) -> [u32; CALL_WORDS] {
    let elements = |d: Option<(DType, usize)>| d.map_or(0, |(_, n)| n as u64);
    let (low, high) = p.ranks;
    encode_fields(&Fields {
        seq: p.seq,
        kind: KernelKind::Exchange as u32,
        dtype: dtype_field(p.low_sends),
        width: p.world as u32,
        root: 0,
        blocks: p.blocks,
        registration: 0,
        offset: elements(p.high_sends),
        elements: elements(p.low_sends),
        hidden: dtype_field(p.high_sends) | (low as u32 & 7) << 4 | (high as u32 & 7) << 7,
        epsilon: 0,
        op: 0,
    })
}

/// How two pair descriptors differ, in the order the fields are named.
fn pair_difference(a: &Fields, b: &Fields) -> Option<(CallField, String, String)> {
    let ranks = |f: &Fields| ((f.hidden >> 4) & 7, (f.hidden >> 7) & 7);
    let sends = |f: &Fields| [(f.dtype, f.elements), (f.hidden & 0xf, f.offset)];
    let shows = |f: &Fields, what: &dyn Fn(u32, u64) -> String| {
        let ((low, high), [l, h]) = (ranks(f), sends(f));
        format!(
            "rank {low} sends {}, rank {high} sends {}",
            what(l.0, l.1),
            what(h.0, h.1)
        )
    };
    let dtype = |code: u32, _| match code {
        0 => "nothing".to_string(),
        c => dtype_name(c - 1),
    };
    let length = |code: u32, n: u64| match code {
        0 => "nothing".to_string(),
        _ => format!("{n} elements"),
    };
    let types = |f: &Fields| sends(f).map(|(t, _)| t);
    // Both ranks of a barrier name the same pair: a send to a rank that receives from
    // another is a wait that times out, not a difference here.
    if types(a) != types(b) {
        return Some((CallField::DType, shows(a, &dtype), shows(b, &dtype)));
    }
    if sends(a) != sends(b) {
        return Some((CallField::Length, shows(a, &length), shows(b, &length)));
    }
    if a.blocks != b.blocks {
        let show = |f: &Fields| format!("{} blocks", f.blocks);
        return Some((CallField::Blocks, show(a), show(b)));
    }
    (a.seq != b.seq).then(|| {
        let show = |f: &Fields| format!("exchange {} between the two", f.seq);
        (CallField::Sequence, show(a), show(b))
    })
}

fn kind_of(code: u32) -> Option<KernelKind> {
    KernelKind::ALL.get(code as usize).copied()
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
        Some(KernelKind::Exchange) => "send / recv".into(),
        Some(k) => k.name().replace('_', "-"),
        None if code == crate::signal::KIND_USER => "a kernel of the engine's own".into(),
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

/// The first field in which `theirs` differs from `mine`, with both values as text;
/// `None` when they agree.
pub(crate) fn first_difference(
    mine: [u32; CALL_WORDS],
    theirs: [u32; CALL_WORDS],
) -> Option<(CallField, String, String)> {
    let (a, b) = (decode(mine), decode(theirs));
    let exchange = KernelKind::Exchange as u32;
    if a.kind == exchange && b.kind == exchange {
        return pair_difference(&a, &b);
    }
    let grid = a.blocks != b.blocks;
    // In the order they are named. A batch's grid follows its entries' packs (its count
    // is the root field): another grid between two batches is another later length.
    let batch = |f: &Fields| kind_of(f.kind) == Some(KernelKind::AllReduceGroup);
    let batch_grid = grid && batch(&a) && batch(&b);
    let name = |f: &Fields| collective_name(f.kind);
    let place = |f: &Fields| (f.registration, f.offset);
    let (field, _) = [
        (CallField::Collective, name(&a) != name(&b)),
        (CallField::DType, a.dtype != b.dtype),
        (CallField::GroupWidth, a.width != b.width),
        (CallField::Root, a.root != b.root),
        (CallField::Length, a.elements != b.elements || batch_grid),
        (CallField::Blocks, grid),
        (CallField::Algorithm, a.kind != b.kind),
        (CallField::Inputs, place(&a) != place(&b)),
        (CallField::Hidden, a.hidden != b.hidden),
        (CallField::Epsilon, a.epsilon != b.epsilon),
        (CallField::Op, a.op != b.op),
        (CallField::Sequence, a.seq != b.seq),
    ]
    .into_iter()
    .find(|d| d.1)?;
    let show = |f: &Fields| match field {
        CallField::Collective => collective_name(f.kind),
        CallField::DType => dtype_name(f.dtype),
        CallField::GroupWidth => format!("groups of {}", f.width),
        CallField::Root => format!("root {}", f.root),
        CallField::Length if a.elements == b.elements => match f.blocks {
            1 => "entries sized for 1 block".into(),
            n => format!("entries sized for {n} blocks"),
        },
        CallField::Length => format!("{} elements", f.elements),
        CallField::Blocks => format!("{} blocks", f.blocks),
        CallField::Algorithm => algorithm_name(f.kind),
        CallField::Inputs if f.registration == 0 => "the input staged (not registered)".into(),
        CallField::Inputs => format!(
            "a registered input (registration {}, byte offset {})",
            f.registration - 1,
            f.offset
        ),
        CallField::Hidden => format!("rows of {} elements", f.hidden),
        CallField::Epsilon => format!("epsilon {:e}", f32::from_bits(f.epsilon)),
        CallField::Op => ReduceOp::from_raw(f.op)
            .map_or_else(|| format!("operator {}", f.op), |o| o.name().to_string()),
        CallField::Sequence if f.seq == 0 => "no call yet".into(),
        CallField::Sequence => format!("call {}", f.seq),
    };
    Some((field, show(&a), show(&b)))
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
