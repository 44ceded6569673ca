//! Host port of kernels-common/peercomm_group.h: the batched all-reduce. The entries'
//! packs are one concatenated range (entry s's pack p is pack `offset_s / 16 + p`), pack
//! g to block g % blocks for the staging copy and the reduce alike, so the per-block
//! Publish barrier orders every read after the peer's write. Each element is summed as
//! one-stage sums it: every entry's bits are those of a one-stage all-reduce of it alone.

use std::sync::atomic::Ordering;

use super::packs::{copy_packs_of, lanes, op_of, reduce_packs_of, Grid, Packs};
use super::signals::{atomic, barrier, first_barrier};
use super::wait::{Flow, Stop};
use crate::dtype::Element;
use crate::protocol::BarrierKind;
use crate::signal::{
    group_header_words, group_shown_call, GroupArgs, GroupEntry, GROUP_HEADER_BYTES, MAX_GPUS,
    MAX_GROUP_CALLS, PACK_BYTES,
};

/// This block's packs of entry `e` (local pack numbers): those whose batch-wide number
/// `offset / 16 + p` is `block` modulo `blocks`.
fn entry_packs<T>(e: &GroupEntry, block: u32, blocks: u32) -> Packs {
    let packs = (e.elements as usize).div_ceil(lanes::<T>());
    let base = e.offset as usize / PACK_BYTES;
    let blocks = blocks as usize;
    let first = (block as usize + blocks - base % blocks) % blocks;
    (first..packs).step_by(blocks)
}

/// The entries in use (a count past the maximum is clipped, as on the devices).
fn entries(args: &GroupArgs) -> &[GroupEntry] {
    &args.entries[..(args.count as usize).min(MAX_GROUP_CALLS)]
}

/// Words of the entry table.
const HEADER_WORDS: usize = GROUP_HEADER_BYTES / 4;

/// This rank's entry table (see [`GROUP_HEADER_BYTES`]), from the entries in use.
fn own_table(args: &GroupArgs) -> [u32; HEADER_WORDS] {
    let entries = entries(args);
    group_header_words(entries.len() as u32, |s| entries[s].elements)
}

/// Word `i` of the entry table at the start of the payload at `payload`. Atomic: every
/// block of the rank writes the same table at once.
unsafe fn table_word<'a>(payload: u64, i: usize) -> &'a std::sync::atomic::AtomicU32 {
    atomic((payload as *mut u32).add(i))
}

/// The element count of entry `s` in a table.
fn table_elements(table: &[u32; HEADER_WORDS], s: usize) -> u64 {
    u64::from(table[5 + 2 * s]) << 32 | u64::from(table[4 + 2 * s])
}

/// After the Publish barrier: every peer's entry table against this rank's, in
/// group-rank order. The first that differs is a mismatch showing, on each side, the
/// batch's descriptor with that side's count and first differing element count.
unsafe fn same_entry_tables(args: &GroupArgs) -> Flow {
    let a = &args.all;
    let mine = own_table(args);
    for q in (0..a.group_width as usize).filter(|&q| q != a.group_rank as usize) {
        let theirs: [u32; HEADER_WORDS] =
            std::array::from_fn(|i| table_word(a.payloads[q], i).load(Ordering::Relaxed));
        let first =
            (0..MAX_GROUP_CALLS).find(|&s| table_elements(&theirs, s) != table_elements(&mine, s));
        if theirs[0] != mine[0] || first.is_some() {
            let first = first.unwrap_or(0);
            return Err(Stop::Mismatch {
                peer: q,
                mine: group_shown_call(a.call, mine[0], table_elements(&mine, first)),
                theirs: group_shown_call(a.call, theirs[0], table_elements(&theirs, first)),
            });
        }
    }
    Ok(())
}

pub(super) unsafe fn all_reduce_group<T: Element>(args: &GroupArgs, g: Grid) -> Flow {
    let a = &args.all;
    let (width, me) = (a.group_width as usize, a.group_rank as usize);
    // Staged where the peers can read only the payloads; else (one process) every
    // member's input in place (`peer_inputs`).
    let staged = width > 1 && a.stage_input != 0;
    if staged {
        // The entry table (every block writes the same words), then this block's share
        // of every entry's input into the own payload.
        for (i, &w) in own_table(args).iter().enumerate() {
            table_word(a.payloads[me], i).store(w, Ordering::Relaxed);
        }
        for e in entries(args) {
            let packs = entry_packs::<T>(e, g.block, g.blocks);
            copy_packs_of::<T>(
                e.input,
                a.payloads[me] + e.offset,
                e.elements as usize,
                packs,
            );
        }
    }
    first_barrier(a, g, staged)?;
    // Nothing is stored before every peer's entry table matches this rank's.
    if staged {
        same_entry_tables(args)?;
    }
    // This block's share of every entry, summed in group-rank order (a group of one
    // copies its input).
    for (s, e) in entries(args).iter().enumerate() {
        let n = e.elements as usize;
        let mut srcs = [0u64; MAX_GPUS];
        for (k, src) in srcs.iter_mut().enumerate().take(width) {
            *src = if staged {
                a.payloads[k] + e.offset
            } else if width > 1 {
                args.peer_inputs[s][k]
            } else {
                e.input
            };
        }
        let packs = entry_packs::<T>(e, g.block, g.blocks);
        reduce_packs_of::<T>(op_of(a), &srcs[..width], e.output, n, packs);
    }
    // No peer overwrites a payload this block still reads.
    barrier(a, g, BarrierKind::End)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pack of every entry goes to exactly one block, and block b gets the packs
    /// g with g % blocks == b of the concatenated range.
    #[test]
    fn entry_packs_follow_the_concatenated_range() {
        for blocks in 1..=7u32 {
            // `base`: the entry's first pack in the concatenated range.
            let mut base = 0;
            for n in [5usize, 0, 1, 8, 17, 4, 3, 1000] {
                let e = GroupEntry {
                    input: 0,
                    output: 0,
                    elements: n as u64,
                    offset: (base * PACK_BYTES) as u64,
                };
                let mut seen = vec![0; n.div_ceil(4)];
                for block in 0..blocks {
                    for p in entry_packs::<f32>(&e, block, blocks) {
                        assert_eq!((base + p) % blocks as usize, block as usize);
                        seen[p] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "blocks {blocks}: {seen:?}");
                base += seen.len();
            }
        }
    }
}
