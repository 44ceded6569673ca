//! Error records and leaving in the host kernels: the record a stopped wait writes, the
//! call each rank publishes in its `current_call`, and [`abandon`] (the `quit`
//! handshake with the peers' same-index blocks).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use super::signals::{atomic, detail_word, error_word, quit_cell, signal};
use super::wait::deadline;
use crate::signal::{
    AllReduceArgs, CALL_WORDS, DETAIL_AWAITED, DETAIL_MINE, DETAIL_THEIRS, DETAIL_THEIRS_VALID,
    ERROR_BARRIER_TIMEOUT, ERROR_BLOCK, ERROR_CALL_MISMATCH, ERROR_CODE, ERROR_DOMAIN,
    ERROR_PEER_ABORTED, ERROR_RANK, ERROR_WRITING, MAX_NUM_BLOCKS_UPPER_BOUND,
};

/// What a record says beside its code (the device's `ErrorDetail`): the rank it names,
/// the rank awaited, and the two sides' call descriptors (`mine`, `theirs`).
#[derive(Clone, Copy)]
struct Detail(u32, u32, [u32; CALL_WORDS], [u32; CALL_WORDS]);

/// Writes an error record into group rank `q`'s signal unless it already holds one:
/// claim the code word, fill in the fields, then release the code.
unsafe fn write_record(args: &AllReduceArgs, q: usize, code: u32, block: u32, d: &Detail) {
    let addr = args.signals[q];
    let claim = error_word(addr, ERROR_CODE).compare_exchange(
        0,
        ERROR_WRITING,
        Ordering::AcqRel,
        Ordering::Relaxed,
    );
    if claim.is_ok() {
        let Detail(rank, awaited, mine, theirs) = *d;
        error_word(addr, ERROR_RANK).store(rank, Ordering::Relaxed);
        error_word(addr, ERROR_BLOCK).store(block, Ordering::Relaxed);
        error_word(addr, ERROR_DOMAIN).store(args.domain, Ordering::Relaxed);
        for i in 0..CALL_WORDS {
            detail_word(addr, DETAIL_MINE + i).store(mine[i], Ordering::Relaxed);
            detail_word(addr, DETAIL_THEIRS + i).store(theirs[i], Ordering::Relaxed);
        }
        detail_word(addr, DETAIL_AWAITED).store(awaited + 1, Ordering::Relaxed);
        detail_word(addr, DETAIL_THEIRS_VALID).store(1, Ordering::Relaxed);
        error_word(addr, ERROR_CODE).store(code, Ordering::Release);
    }
}

/// World rank of group rank `q` of this rank's group (groups are consecutive ranks).
fn world_rank_of(args: &AllReduceArgs, q: usize) -> u32 {
    args.world_rank - args.group_rank + q as u32
}

/// The descriptor words a `current_call` summary holds (the device's `call_summary`).
const SUMMARY: [usize; 3] = [0, 2, 3];

/// Word `i` of the `current_call` of the signal at `addr`.
unsafe fn call_word<'a>(addr: u64, i: usize) -> &'a AtomicU32 {
    atomic((std::ptr::addr_of_mut!((*signal(addr)).current_call) as *mut u32).add(i))
}

/// The call the signal at `addr` says its rank runs now, if it runs one: its summary
/// merged into this rank's own descriptor `mine` (the device's `summary_call`).
unsafe fn current_call(addr: u64, mine: [u32; CALL_WORDS]) -> Option<[u32; CALL_WORDS]> {
    let running = call_word(addr, 3).load(Ordering::Acquire) != 0;
    running.then(|| {
        let mut call = mine;
        for (i, &w) in SUMMARY.iter().enumerate() {
            call[w] = call_word(addr, i).load(Ordering::Relaxed);
        }
        call
    })
}

/// Publishes this rank's call summary in its own `current_call` (block 0: at entry
/// `running`, at the end not).
pub(super) unsafe fn publish_current_call(args: &AllReduceArgs, running: bool) {
    let own = args.signals[args.group_rank as usize];
    if running {
        for (i, &w) in SUMMARY.iter().enumerate() {
            call_word(own, i).store(args.call[w], Ordering::Relaxed);
        }
    }
    call_word(own, 3).store(u32::from(running), Ordering::Release);
}

/// A wait for group rank `awaited` timed out. If that rank runs another call now,
/// record the mismatch; else record the timeout on the own rank, naming the rank waited
/// for, and tell every group peer to stop, so none proceeds past the abandoned barrier.
pub(super) unsafe fn record_timeout(args: &AllReduceArgs, block: u32, awaited: usize) {
    let (me, rank) = (args.group_rank as usize, args.world_rank);
    let peers = (0..args.group_width as usize).filter(|&q| q != me);
    let running = current_call(args.signals[awaited], args.call);
    let theirs = running.unwrap_or([0; CALL_WORDS]);
    if running.is_some_and(|c| c != args.call) {
        record_mismatch(args, block, awaited, args.call, theirs);
        // The same from their side, for every peer whose call differs: it may have
        // completed its call with a subgroup; its next synchronize reports it.
        for q in peers {
            if let Some(mine) = current_call(args.signals[q], args.call).filter(|c| *c != args.call)
            {
                let d = Detail(rank, rank, mine, args.call);
                write_record(args, q, ERROR_CALL_MISMATCH, block, &d);
            }
        }
        return;
    }
    let awaited = world_rank_of(args, awaited);
    let d = Detail(rank, awaited, args.call, theirs);
    write_record(args, me, ERROR_BARRIER_TIMEOUT, block, &d);
    for q in peers {
        write_record(args, q, ERROR_PEER_ABORTED, block, &d);
    }
}

/// Group rank `peer` makes another call: record the mismatch on this rank, naming the
/// peer, with `mine` and `theirs` as the two sides.
pub(super) unsafe fn record_mismatch(
    args: &AllReduceArgs,
    block: u32,
    peer: usize,
    mine: [u32; CALL_WORDS],
    theirs: [u32; CALL_WORDS],
) {
    let (me, who) = (args.group_rank as usize, world_rank_of(args, peer));
    let d = Detail(who, who, mine, theirs);
    write_record(args, me, ERROR_CALL_MISMATCH, block, &d);
}

/// Tells group rank `q` to stop (`PEER_ABORTED`, naming this rank; `awaited`: the rank
/// the failure names), unless it holds a record already: an exchange peer that passed
/// its barrier with this rank would wait for it until the timeout.
pub(super) unsafe fn tell_aborted(
    args: &AllReduceArgs,
    block: u32,
    q: usize,
    awaited: usize,
    call: [u32; CALL_WORDS],
) {
    let d = Detail(args.world_rank, world_rank_of(args, awaited), call, call);
    write_record(args, q, ERROR_PEER_ABORTED, block, &d);
}

/// This block leaves the collective: it tells every peer it will not touch their
/// memory again (`quit`), then waits up to `timeout_ns` until each peer that `wait_for`
/// names (those that read this rank's user buffers) has said the same from its
/// same-index block, so that the user may free its buffers only after a late peer's
/// reads.
pub(super) unsafe fn abandon(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
    wait_for: &dyn Fn(usize) -> bool,
) {
    let me = args.group_rank as usize;
    let width = args.group_width as usize;
    for q in (0..width).filter(|&q| q != me) {
        quit_cell(args.signals[q], block, me).store(1, Ordering::Release);
        // Block 0 also speaks for the blocks this launch lacks: a peer with a larger
        // grid must not wait for partners that never exist.
        if block == 0 {
            for x in blocks..MAX_NUM_BLOCKS_UPPER_BOUND as u32 {
                quit_cell(args.signals[q], x, me).store(1, Ordering::Release);
            }
        }
    }
    if args.timeout_ns == 0 {
        return;
    }
    let until = deadline(args.timeout_ns);
    for q in (0..width).filter(|&q| q != me && wait_for(q)) {
        let cell = quit_cell(args.signals[me], block, q);
        while cell.load(Ordering::Acquire) == 0 {
            if matches!(until, Some(d) if Instant::now() > d) {
                return;
            }
            std::thread::yield_now();
        }
    }
}
