//! The Lamport primitives on the host (packs as four words, -0.0 sent as +0.0 so no
//! word is the sentinel; pushing packs and headers into the peers' regions; waiting,
//! the header check, the sums in source order; the end, which clears the previous
//! generation and advances the flag) and the Lamport all-reduce built from them.

use std::sync::atomic::Ordering;

use super::packs::{block_packs, lanes, pack_range, store, sum_start};
use super::signals::{abort_word, atomic, signal};
use super::wait::{Spinner, Stop};
use crate::backend::LAMPORT_SENTINEL;
use crate::dtype::Element;
use crate::signal::{
    AllReduceArgs, SignalLayout, CALL_WORDS, LAMPORT_ARRIVALS, LAMPORT_FLAG, LAMPORT_GENERATIONS,
    LAMPORT_HEADER_PACKS, LAMPORT_PREV_PACKS, LAMPORT_PREV_WIDTH, PACK_BYTES,
};

/// Address of pack `p` of slot `src` of generation `gen` in the Lamport region of the
/// signal at `signal_addr`, of `slots` slots per generation (the world width).
fn lamport_pack(
    signal_addr: u64,
    slot_bytes: usize,
    slots: usize,
    gen: usize,
    src: usize,
    p: usize,
) -> *mut u32 {
    let layout = SignalLayout {
        lamport_slot_bytes: slot_bytes,
        lamport_slots: slots,
        payload_bytes: 0,
    };
    let off = layout.lamport_offset() + (gen * slots + src) * slot_bytes + p * PACK_BYTES;
    (signal_addr as usize + off) as *mut u32
}

/// Reads pack `p` of the own input as four words, -0.0 lanes turned into +0.0 and
/// lanes past the end zero.
pub(super) unsafe fn lamport_pack_words<T: Element>(input: u64, p: usize, n: usize) -> [u32; 4] {
    let bits = 8 * std::mem::size_of::<T>();
    let neg_zero: u32 = 1 << (bits - 1);
    let mut words = [0u32; 4];
    for (j, e) in pack_range::<T>(p, n).enumerate() {
        let x = (input as *const T).add(e).read_unaligned().to_bits_u32();
        let at = j * bits;
        let x = if x == neg_zero { 0 } else { x };
        words[at / 32] |= x << (at % 32);
    }
    words
}

/// Lane `j` of a pack of four little-endian words, as f32.
fn lane_from_words<T: Element>(words: &[u32; 4], j: usize) -> f32 {
    let at = j * 8 * std::mem::size_of::<T>();
    T::from_bits_u32(words[at / 32] >> (at % 32)).to_f32()
}

/// What a Lamport kernel reads of the own `lamport_state` at entry.
#[derive(Clone, Copy)]
pub(super) struct LamportEntry {
    /// The generation this call pushes into and reads.
    pub(super) gen: usize,
    /// Packs per slot and slots the previous Lamport call wrote (cleared by this one).
    prev_packs: usize,
    prev_width: usize,
}

/// Reads this rank's Lamport state (the device's `enter`).
pub(super) unsafe fn lamport_entry(args: &AllReduceArgs) -> LamportEntry {
    let own = signal(args.signals[args.group_rank as usize]);
    let state = std::ptr::addr_of_mut!((*own).lamport_state) as *mut u32;
    LamportEntry {
        gen: atomic(state.add(LAMPORT_FLAG)).load(Ordering::Acquire) as usize,
        prev_packs: atomic(state.add(LAMPORT_PREV_PACKS)).load(Ordering::Relaxed) as usize,
        prev_width: atomic(state.add(LAMPORT_PREV_WIDTH)).load(Ordering::Relaxed) as usize,
    }
}

/// Indexes of the header packs of a slot: its last [`LAMPORT_HEADER_PACKS`] packs.
fn lamport_header_packs(args: &AllReduceArgs) -> std::ops::Range<usize> {
    let end = args.lamport_slot_bytes as usize / PACK_BYTES;
    end - LAMPORT_HEADER_PACKS..end
}

/// Stores `words` as pack `p` of slot `group_rank` of generation `gen` in every other
/// member's region (the own slot is never written).
pub(super) unsafe fn lamport_push(args: &AllReduceArgs, gen: usize, p: usize, words: [u32; 4]) {
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    let slot = args.lamport_slot_bytes as usize;
    for q in (0..width).filter(|&q| q != me) {
        let dst = lamport_pack(args.signals[q], slot, width, gen, me, p);
        for (w, &word) in words.iter().enumerate() {
            atomic(dst.add(w)).store(word, Ordering::Release);
        }
    }
}

/// Pushes this call's header, which every block does first: a block that starts after
/// another found a mismatch returns at entry, so the header waits for no one block.
pub(super) unsafe fn lamport_push_header(args: &AllReduceArgs, gen: usize) {
    for (k, p) in lamport_header_packs(args).enumerate() {
        let c = &args.call[3 * k..3 * k + 3];
        lamport_push(args, gen, p, [c[0], c[1], c[2], 0]);
    }
}

/// Waits until pack `p` of source `src` has arrived in the own region of generation
/// `gen` (no word is the sentinel) and returns its words.
unsafe fn lamport_wait(
    args: &AllReduceArgs,
    gen: usize,
    src: usize,
    p: usize,
    spin: &mut Spinner<'_>,
) -> Result<[u32; 4], Stop> {
    let width = args.group_width as usize;
    let slot = args.lamport_slot_bytes as usize;
    let at = lamport_pack(
        args.signals[args.group_rank as usize],
        slot,
        width,
        gen,
        src,
        p,
    );
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
pub(super) unsafe fn lamport_check_headers(
    args: &AllReduceArgs,
    gen: usize,
    spin: &mut Spinner<'_>,
) -> Result<(), Stop> {
    let me = args.group_rank as usize;
    for src in (0..args.group_width as usize).filter(|&s| s != me) {
        let mut theirs = [0u32; CALL_WORDS];
        for (k, p) in lamport_header_packs(args).enumerate() {
            let pack = lamport_wait(args, gen, src, p, spin)?;
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

/// The f32 sums of pack `p` in source order (lanes past `n` zero): the peers' packs
/// from the own region once arrived, the own pack from the input (-0.0 lanes as +0.0).
pub(super) unsafe fn lamport_pack_sums<T: Element>(
    args: &AllReduceArgs,
    gen: usize,
    p: usize,
    n: usize,
    spin: &mut Spinner<'_>,
) -> Result<[f32; 8], Stop> {
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    let valid = pack_range::<T>(p, n).len();
    let mut acc = [0f32; 8];
    for src in 0..width {
        let words = if src == me {
            lamport_pack_words::<T>(args.local_input, p, n)
        } else {
            lamport_wait(args, gen, src, p, spin)?
        };
        for (j, a) in acc.iter_mut().enumerate().take(valid) {
            let x = lane_from_words::<T>(&words, j);
            *a = if src == 0 {
                sum_start(x, width)
            } else {
                *a + x
            };
        }
    }
    Ok(acc)
}

/// The end of every Lamport kernel that did not stop: clears the previous generation
/// of the own region (every slot but the own; headers by block 0), then the last block
/// records this call's `packs` and width and advances the flag.
pub(super) unsafe fn lamport_end(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
    entry: LamportEntry,
    packs: usize,
) {
    let (width, me) = (args.group_width as usize, args.group_rank as usize);
    let slot = args.lamport_slot_bytes as usize;
    let own_addr = args.signals[me];
    let clear_gen = (entry.gen + LAMPORT_GENERATIONS - 1) % LAMPORT_GENERATIONS;
    for src in (0..entry.prev_width).filter(|&s| s != me) {
        let header = lamport_header_packs(args).filter(|_| block == 0);
        for p in block_packs(0, entry.prev_packs, block, blocks).chain(header) {
            let at = lamport_pack(own_addr, slot, width, clear_gen, src, p);
            for w in 0..4 {
                atomic(at.add(w)).store(LAMPORT_SENTINEL, Ordering::Relaxed);
            }
        }
    }
    let own = signal(own_addr);
    let state = std::ptr::addr_of_mut!((*own).lamport_state) as *mut u32;
    if atomic(state.add(LAMPORT_ARRIVALS)).fetch_add(1, Ordering::AcqRel) == blocks - 1 {
        atomic(state.add(LAMPORT_PREV_PACKS)).store(packs as u32, Ordering::Relaxed);
        atomic(state.add(LAMPORT_PREV_WIDTH)).store(width as u32, Ordering::Relaxed);
        atomic(state.add(LAMPORT_ARRIVALS)).store(0, Ordering::Relaxed);
        atomic(state.add(LAMPORT_FLAG)).store(
            ((entry.gen + 1) % LAMPORT_GENERATIONS) as u32,
            Ordering::Release,
        );
    }
}

pub(super) unsafe fn lamport<T: Element>(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let packs = n.div_ceil(lanes::<T>());
    let entry = lamport_entry(args);
    // Push: this rank's header, then its packs.
    lamport_push_header(args, entry.gen);
    for p in block_packs(0, packs, block, blocks) {
        lamport_push(
            args,
            entry.gen,
            p,
            lamport_pack_words::<T>(args.local_input, p, n),
        );
    }
    let mut spin = Spinner::new(args.timeout_ns, abort_word(args));
    lamport_check_headers(args, entry.gen, &mut spin)?;
    // Reduce in source order as the packs arrive.
    for p in block_packs(0, packs, block, blocks) {
        let acc = lamport_pack_sums::<T>(args, entry.gen, p, n, &mut spin)?;
        for (j, e) in pack_range::<T>(p, n).enumerate() {
            store::<T>(args.output, e, acc[j]);
        }
    }
    lamport_end(args, block, blocks, entry, packs);
    Ok(())
}
