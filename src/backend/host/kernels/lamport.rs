//! The Lamport kernels on the host: packs travel as four words, none the sentinel (a
//! Sum's or Avg's -0.0 sent as +0.0; under Prod, Max and Min a word of all ones sent as
//! canonical NaNs and a word of the sentinel's bits as its stand-in, all ones); headers
//! are checked, the operator runs in source order, and the end clears the previous
//! generation and advances the flag.

use std::sync::atomic::{AtomicU32, Ordering};

use super::collectives::rmsnorm_row;
use super::packs::{block_packs, lanes, op_of, pack_range, store, Grid};
use super::signals::{abort_word, atomic, signal};
use super::wait::{Flow, Spinner, Stop};
use crate::backend::LAMPORT_SENTINEL;
use crate::dtype::{Element, ReduceOp};
use crate::signal::{
    AllReduceArgs, SignalLayout, CALL_WORDS, LAMPORT_ARRIVALS, LAMPORT_FLAG, LAMPORT_GENERATIONS,
    LAMPORT_HEADER_PACKS, LAMPORT_PREV_PACKS, LAMPORT_PREV_WIDTH, LAMPORT_SENTINEL_STANDIN,
    PACK_BYTES,
};

/// Pack `p` of slot `src` of generation `gen` in the Lamport region of the signal at
/// `addr` (one slot per group member and generation).
fn lamport_pack(args: &AllReduceArgs, addr: u64, gen: usize, src: usize, p: usize) -> *mut u32 {
    let (slot, slots) = (args.lamport_slot_bytes as usize, args.group_width as usize);
    let layout = SignalLayout {
        lamport_slot_bytes: slot,
        lamport_slots: slots,
        payload_bytes: 0,
    };
    let off = layout.lamport_offset() + (gen * slots + src) * slot + p * PACK_BYTES;
    (addr as usize + off) as *mut u32
}

/// Whether `op` keeps the sign of a zero (a Sum's or an Avg's starts at +0.0).
fn keeps_sign(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Prod | ReduceOp::Max | ReduceOp::Min)
}

/// Reads pack `p` of the own input as four words as they are sent under `op` (the
/// device's `lamport_encode`), lanes past the end zero: a Sum's or Avg's -0.0 lanes as
/// +0.0; under Prod, Max and Min a word of all ones (NaN lanes only) as the canonical NaN
/// in each lane, then a word with the sentinel's bits as its stand-in (all ones).
unsafe fn lamport_pack_words<T: Element>(op: ReduceOp, input: u64, p: usize, n: usize) -> [u32; 4] {
    let bits = 8 * std::mem::size_of::<T>();
    let neg_zero: u32 = 1 << (bits - 1);
    let mut words = [0u32; 4];
    for (j, e) in pack_range::<T>(p, n).enumerate() {
        let x = (input as *const T).add(e).read_unaligned();
        let at = j * bits;
        let x = match x.to_bits_u32() {
            b if b == neg_zero && !keeps_sign(op) => 0,
            b => b,
        };
        words[at / 32] |= x << (at % 32);
    }
    if keeps_sign(op) {
        let nan = T::from_f32(f32::NAN).to_bits_u32();
        let nans = if bits == 16 { nan | nan << 16 } else { nan };
        for w in words.iter_mut() {
            *w = match *w {
                LAMPORT_SENTINEL_STANDIN => nans,
                LAMPORT_SENTINEL => LAMPORT_SENTINEL_STANDIN,
                other => other,
            };
        }
    }
    words
}

/// A pack's words as `lamport_pack_words` sent them, back to the bits they stand for.
fn lamport_decode(op: ReduceOp, mut words: [u32; 4]) -> [u32; 4] {
    if keeps_sign(op) {
        for w in words.iter_mut().filter(|w| **w == LAMPORT_SENTINEL_STANDIN) {
            *w = LAMPORT_SENTINEL;
        }
    }
    words
}

/// Lane `j` of a pack of four little-endian words, as f32.
fn lane_from_words<T: Element>(words: &[u32; 4], j: usize) -> f32 {
    let at = j * 8 * std::mem::size_of::<T>();
    T::from_bits_u32(words[at / 32] >> (at % 32)).to_f32()
}

/// Word `i` of this rank's `lamport_state`.
unsafe fn state<'a>(args: &AllReduceArgs, i: usize) -> &'a AtomicU32 {
    let own = signal(args.signals[args.group_rank as usize]);
    atomic((std::ptr::addr_of_mut!((*own).lamport_state) as *mut u32).add(i))
}

/// What a Lamport kernel reads of the own `lamport_state` at entry (the device's
/// `enter`): the generation this call pushes into and reads, and the packs per slot
/// and slots the previous Lamport call wrote (cleared by this one).
#[derive(Clone, Copy)]
struct LamportEntry {
    gen: usize,
    prev_packs: usize,
    prev_width: usize,
}

/// Indexes of the header packs of a slot: its last [`LAMPORT_HEADER_PACKS`] packs.
fn lamport_header_packs(args: &AllReduceArgs) -> std::ops::Range<usize> {
    let end = args.lamport_slot_bytes as usize / PACK_BYTES;
    end - LAMPORT_HEADER_PACKS..end
}

/// Stores `words` as pack `p` of slot `group_rank` of generation `gen` in every other
/// member's region (the own slot is never written).
unsafe fn lamport_push(args: &AllReduceArgs, gen: usize, p: usize, words: [u32; 4]) {
    let me = args.group_rank as usize;
    for q in (0..args.group_width as usize).filter(|&q| q != me) {
        let dst = lamport_pack(args, args.signals[q], gen, me, p);
        for (w, &word) in words.iter().enumerate() {
            atomic(dst.add(w)).store(word, Ordering::Release);
        }
    }
}

/// Waits until pack `p` of source `src` has arrived in the own region of generation
/// `gen` (no word is the sentinel) and returns its words.
unsafe fn lamport_wait(
    args: &AllReduceArgs,
    (gen, src, p): (usize, usize, usize),
    spin: &mut Spinner<'_>,
) -> Result<[u32; 4], Stop> {
    let at = lamport_pack(args, args.signals[args.group_rank as usize], gen, src, p);
    loop {
        let w: [u32; 4] = std::array::from_fn(|i| atomic(at.add(i)).load(Ordering::Acquire));
        if w.iter().all(|&x| x != LAMPORT_SENTINEL) {
            return Ok(w);
        }
        spin.wait().map_err(|why| why.waiting_for(src))?;
    }
}

/// Every source's header, before anything is stored (the device checks them while the
/// first packs arrive): a source that runs another call is a mismatch, and the state is
/// not advanced.
unsafe fn lamport_check_headers(args: &AllReduceArgs, gen: usize, spin: &mut Spinner<'_>) -> Flow {
    let me = args.group_rank as usize;
    for src in (0..args.group_width as usize).filter(|&s| s != me) {
        let mut theirs = [0u32; CALL_WORDS];
        for (k, p) in lamport_header_packs(args).enumerate() {
            let pack = lamport_wait(args, (gen, src, p), spin)?;
            theirs[3 * k..3 * k + 3].copy_from_slice(&pack[..3]);
        }
        if theirs != args.call {
            return Err(Stop::Mismatch {
                peer: src,
                mine: args.call,
                theirs,
            });
        }
    }
    Ok(())
}

/// Pack `p` reduced by `op` in source order, in f32 before the rounding to the type
/// (lanes past `n` zero): the peers' packs from the own region once arrived, the own
/// pack from the input, each as it was sent, decoded.
unsafe fn lamport_pack_reduce<T: Element>(
    args: &AllReduceArgs,
    op: ReduceOp,
    (gen, p, n): (usize, usize, usize),
    spin: &mut Spinner<'_>,
) -> Result<[f32; 8], Stop> {
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    let mut acc = [0f32; 8];
    for src in 0..width {
        let words = lamport_decode(
            op,
            if src == me {
                lamport_pack_words::<T>(op, args.local_input, p, n)
            } else {
                lamport_wait(args, (gen, src, p), spin)?
            },
        );
        for (j, a) in acc.iter_mut().enumerate().take(pack_range::<T>(p, n).len()) {
            let x = lane_from_words::<T>(&words, j);
            *a = if src == 0 {
                op.start(x, width)
            } else {
                op.combine(*a, x)
            };
        }
    }
    Ok(acc.map(|a| op.finish(a, width)))
}

/// The end of every Lamport kernel that did not stop: clears the previous generation
/// of the own region (every slot but the own; headers by block 0), then the last block
/// records this call's `packs` and width and advances the flag.
unsafe fn lamport_end(args: &AllReduceArgs, g: Grid, entry: LamportEntry, packs: usize) {
    let me = args.group_rank as usize;
    let clear_gen = (entry.gen + LAMPORT_GENERATIONS - 1) % LAMPORT_GENERATIONS;
    for src in (0..entry.prev_width).filter(|&s| s != me) {
        let header = lamport_header_packs(args).filter(|_| g.block == 0);
        for p in block_packs(0, entry.prev_packs, g).chain(header) {
            let at = lamport_pack(args, args.signals[me], clear_gen, src, p);
            for w in 0..4 {
                atomic(at.add(w)).store(LAMPORT_SENTINEL, Ordering::Relaxed);
            }
        }
    }
    if state(args, LAMPORT_ARRIVALS).fetch_add(1, Ordering::AcqRel) == g.blocks - 1 {
        state(args, LAMPORT_PREV_PACKS).store(packs as u32, Ordering::Relaxed);
        state(args, LAMPORT_PREV_WIDTH).store(args.group_width, Ordering::Relaxed);
        state(args, LAMPORT_ARRIVALS).store(0, Ordering::Relaxed);
        let next = ((entry.gen + 1) % LAMPORT_GENERATIONS) as u32;
        state(args, LAMPORT_FLAG).store(next, Ordering::Release);
    }
}

/// A Lamport kernel: push the header, then this block's packs `mine` of the own input;
/// check every source's header; `reduce` with `sums(p)`, pack p reduced by the call's
/// operator once arrived;
/// the end, recording `packs`. No barrier: data carries its own readiness.
unsafe fn lamport_run<T: Element>(
    args: &AllReduceArgs,
    g: Grid,
    (mine, packs): (impl Iterator<Item = usize>, usize),
    reduce: impl FnOnce(&mut dyn FnMut(usize) -> Result<[f32; 8], Stop>) -> Flow,
) -> Flow {
    let (n, op) = (args.num_elements as usize, op_of(args));
    let load = |i, o| state(args, i).load(o) as usize;
    let entry = LamportEntry {
        gen: load(LAMPORT_FLAG, Ordering::Acquire),
        prev_packs: load(LAMPORT_PREV_PACKS, Ordering::Relaxed),
        prev_width: load(LAMPORT_PREV_WIDTH, Ordering::Relaxed),
    };
    // Every block pushes the header first: a block that starts after another found a
    // mismatch returns at entry, so the header waits for no one block.
    for (k, p) in lamport_header_packs(args).enumerate() {
        let c = &args.call[3 * k..3 * k + 3];
        lamport_push(args, entry.gen, p, [c[0], c[1], c[2], 0]);
    }
    for p in mine {
        let words = lamport_pack_words::<T>(op, args.local_input, p, n);
        lamport_push(args, entry.gen, p, words);
    }
    let mut spin = Spinner::new(args.timeout_ns, abort_word(args));
    lamport_check_headers(args, entry.gen, &mut spin)?;
    reduce(&mut |p| lamport_pack_reduce::<T>(args, op, (entry.gen, p, n), &mut spin))?;
    lamport_end(args, g, entry, packs);
    Ok(())
}

/// The Lamport all-reduce: reduces in source order as the packs arrive.
pub(super) unsafe fn lamport<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let packs = n.div_ceil(lanes::<T>());
    let mine = || block_packs(0, packs, g);
    lamport_run::<T>(args, g, (mine(), packs), |sums| {
        for p in mine() {
            let acc = sums(p)?;
            for (j, e) in pack_range::<T>(p, n).enumerate() {
                store::<T>(args.output, e, acc[j]);
            }
        }
        Ok(())
    })
}

/// The fused kernel through the Lamport slots (the device's `lamport_rmsnorm`): block
/// b pushes and computes its rows t = b, b + blocks, ... with [`rmsnorm_row`]. -0.0
/// sent as +0.0 leaves every sum unchanged (sums start at +0.0 + x0), so the bits are
/// the one-stage kernel's.
pub(super) unsafe fn lamport_rmsnorm<T: Element>(args: &AllReduceArgs, g: Grid) -> Flow {
    let n = args.num_elements as usize;
    let (hidden, l) = (args.hidden as usize, lanes::<T>());
    let rows = || (g.block as usize..n / hidden).step_by(g.blocks as usize);
    let mine = rows().flat_map(|t| t * hidden / l..(t + 1) * hidden / l);
    lamport_run::<T>(args, g, (mine, n / l), |sums| {
        rows().try_for_each(|t| rmsnorm_row::<T>(args, t, &mut *sums))
    })
}
