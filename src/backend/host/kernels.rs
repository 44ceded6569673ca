//! Rust ports of the device kernels, one OS thread per block. Each block does the work
//! a whole GPU block does (its "threads" run one after another), with the orderings
//! the protocol documents: counters and Lamport packs are atomics, plain data is read
//! only after an acquire that pairs with the writer's release.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::backend::{Kernel, KernelKind};
use crate::dtype::{DType, Element};
use crate::protocol::{self, Backoff, BarrierKind, BarrierSignals, BarrierSite, BarrierStop};
use crate::signal::{
    AllReduceArgs, GroupArgs, Signal, SignalLayout, DETAIL_AWAITED, DETAIL_MINE, DETAIL_THEIRS,
    DETAIL_THEIRS_VALID, ERROR_BARRIER_TIMEOUT, ERROR_BLOCK, ERROR_CALL_MISMATCH, ERROR_CODE,
    ERROR_DOMAIN, ERROR_PEER_ABORTED, ERROR_RANK, ERROR_WRITING, LAMPORT_ARRIVALS, LAMPORT_FLAG,
    LAMPORT_GENERATIONS, LAMPORT_PREV_PACKS, LAMPORT_PREV_WIDTH, MAX_NUM_BLOCKS_UPPER_BOUND,
    PACK_BYTES,
};

use crate::backend::LAMPORT_SENTINEL;

mod chunked;
mod collectives;
mod group;

/// Why a wait stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// This block waited longer than the timeout for group rank `awaited`.
    TimedOut { awaited: usize },
    /// The rank's abort word is set (a peer gave up, or another block of this rank).
    Aborted,
    /// Group rank `peer` runs another call: the record shows `mine` for this rank and
    /// `theirs` for the peer (the two descriptors, or for a batch whose entry tables
    /// differ the descriptors with the differing lengths).
    Mismatch {
        peer: usize,
        mine: [u32; 3],
        theirs: [u32; 3],
    },
}

/// Why a spin stopped: what [`Stop`] becomes once the awaited rank is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spun {
    TimedOut,
    Aborted,
}

impl Spun {
    fn waiting_for(self, awaited: usize) -> Stop {
        match self {
            Spun::TimedOut => Stop::TimedOut { awaited },
            Spun::Aborted => Stop::Aborted,
        }
    }
}

/// A spin that yields (CI has 2 cores and many block threads), polls the rank's abort
/// word and gives up after the configured time.
struct Spinner<'a> {
    deadline: Option<Instant>,
    spins: u32,
    abort_word: &'a AtomicU32,
}

impl<'a> Spinner<'a> {
    fn new(timeout_ns: u64, abort_word: &'a AtomicU32) -> Self {
        Spinner {
            deadline: deadline(timeout_ns),
            spins: 0,
            abort_word,
        }
    }
    fn wait(&mut self) -> Result<(), Spun> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        if self.spins.is_multiple_of(64) {
            if self.abort_word.load(Ordering::Relaxed) != 0 {
                return Err(Spun::Aborted);
            }
            if matches!(self.deadline, Some(d) if Instant::now() > d) {
                return Err(Spun::TimedOut);
            }
        }
        Ok(())
    }
}

/// `now + timeout_ns`, or `None` (never) for 0 or a time past what `Instant` holds.
fn deadline(timeout_ns: u64) -> Option<Instant> {
    if timeout_ns == 0 {
        return None;
    }
    Instant::now().checked_add(Duration::from_nanos(timeout_ns))
}

fn atomic<'a>(p: *mut u32) -> &'a AtomicU32 {
    // SAFETY: callers pass 4-byte aligned addresses inside live signal allocations,
    // which are only ever accessed atomically while kernels run.
    unsafe { AtomicU32::from_ptr(p) }
}

fn signal(addr: u64) -> *mut Signal {
    addr as *mut Signal
}

/// Word `i` of the error record of the signal at `addr`.
unsafe fn error_word<'a>(addr: u64, i: usize) -> &'a AtomicU32 {
    let s = signal(addr);
    atomic((std::ptr::addr_of_mut!((*s).error_state) as *mut u32).add(i))
}

/// The rank's abort word: its own error code (non-zero = stop).
unsafe fn abort_word<'a>(args: &AllReduceArgs) -> &'a AtomicU32 {
    error_word(args.signals[args.group_rank as usize], ERROR_CODE)
}

/// `quit[block][writer]` of the signal at `addr`.
unsafe fn quit_cell<'a>(addr: u64, block: u32, writer: usize) -> &'a AtomicU32 {
    let s = signal(addr);
    atomic(std::ptr::addr_of_mut!((*s).quit[block as usize][writer]))
}

/// Word `i` of the error detail of the signal at `addr`.
unsafe fn detail_word<'a>(addr: u64, i: usize) -> &'a AtomicU32 {
    let s = signal(addr);
    atomic((std::ptr::addr_of_mut!((*s).error_detail) as *mut u32).add(i))
}

/// What a record says beside its code (the device's `ErrorDetail`).
struct Detail {
    rank: u32,
    awaited: u32,
    mine: [u32; 3],
    theirs: [u32; 3],
}

/// Writes an error record into the signal at `addr` unless it already holds one:
/// claim the code word, fill in the fields, then release the code.
unsafe fn write_record(addr: u64, code: u32, block: u32, domain: u32, d: &Detail) {
    let claim = error_word(addr, ERROR_CODE).compare_exchange(
        0,
        ERROR_WRITING,
        Ordering::AcqRel,
        Ordering::Relaxed,
    );
    if claim.is_ok() {
        error_word(addr, ERROR_RANK).store(d.rank, Ordering::Relaxed);
        error_word(addr, ERROR_BLOCK).store(block, Ordering::Relaxed);
        error_word(addr, ERROR_DOMAIN).store(domain, Ordering::Relaxed);
        for i in 0..3 {
            detail_word(addr, DETAIL_MINE + i).store(d.mine[i], Ordering::Relaxed);
            detail_word(addr, DETAIL_THEIRS + i).store(d.theirs[i], Ordering::Relaxed);
        }
        detail_word(addr, DETAIL_AWAITED).store(d.awaited + 1, Ordering::Relaxed);
        detail_word(addr, DETAIL_THEIRS_VALID).store(1, Ordering::Relaxed);
        error_word(addr, ERROR_CODE).store(code, Ordering::Release);
    }
}

/// World rank of group rank `q` of this rank's group (groups are consecutive ranks).
fn world_rank_of(args: &AllReduceArgs, q: usize) -> u32 {
    args.world_rank - args.group_rank + q as u32
}

/// The call the signal at `addr` says its rank runs now, if it runs one.
unsafe fn current_call(addr: u64) -> Option<[u32; 3]> {
    let s = signal(addr);
    let words = std::ptr::addr_of_mut!((*s).current_call) as *mut u32;
    let running = atomic(words.add(3)).load(Ordering::Acquire) != 0;
    running.then(|| std::array::from_fn(|i| atomic(words.add(i)).load(Ordering::Relaxed)))
}

/// Publishes this rank's call in its own `current_call` (block 0: at entry `running`,
/// at the end not).
unsafe fn publish_current_call(args: &AllReduceArgs, running: bool) {
    let s = signal(args.signals[args.group_rank as usize]);
    let words = std::ptr::addr_of_mut!((*s).current_call) as *mut u32;
    if running {
        for (i, &w) in args.call.iter().enumerate() {
            atomic(words.add(i)).store(w, Ordering::Relaxed);
        }
    }
    atomic(words.add(3)).store(u32::from(running), Ordering::Release);
}

/// A wait of this block for group rank `awaited` timed out. If that rank runs another
/// call now (another width, algorithm or sequence number), record the mismatch; else record the timeout on the own rank, naming the rank waited for,
/// and tell every group peer to stop (their abort word), so that none proceeds past the
/// abandoned barrier. The device's `record_timeout`.
unsafe fn record_timeout(args: &AllReduceArgs, block: u32, awaited: usize) {
    let me = args.group_rank as usize;
    let running = current_call(args.signals[awaited]);
    let theirs = running.unwrap_or_default();
    let who = world_rank_of(args, awaited);
    if running.is_some_and(|c| c != args.call) {
        record_mismatch(args, block, awaited, args.call, theirs);
        // The same, from their side, into the record of every group peer whose call
        // differs so: it may have completed the call with a subgroup of its own; its
        // next synchronize reports it.
        for q in (0..args.group_width as usize).filter(|&q| q != me) {
            if let Some(call) = current_call(args.signals[q]).filter(|c| *c != args.call) {
                let their_side = Detail {
                    rank: args.world_rank,
                    awaited: args.world_rank,
                    mine: call,
                    theirs: args.call,
                };
                write_record(
                    args.signals[q],
                    ERROR_CALL_MISMATCH,
                    block,
                    args.domain,
                    &their_side,
                );
            }
        }
        return;
    }
    let d = Detail {
        rank: args.world_rank,
        awaited: who,
        mine: args.call,
        theirs,
    };
    write_record(
        args.signals[me],
        ERROR_BARRIER_TIMEOUT,
        block,
        args.domain,
        &d,
    );
    for q in (0..args.group_width as usize).filter(|&q| q != me) {
        write_record(args.signals[q], ERROR_PEER_ABORTED, block, args.domain, &d);
    }
}

/// Group rank `peer` makes another call: record the mismatch on this rank, naming the
/// peer (which finds the same difference on its side), with `mine` and `theirs` as the
/// two sides (the descriptors, unless a batch's entry tables differ).
unsafe fn record_mismatch(
    args: &AllReduceArgs,
    block: u32,
    peer: usize,
    mine: [u32; 3],
    theirs: [u32; 3],
) {
    let who = world_rank_of(args, peer);
    let d = Detail {
        rank: who,
        awaited: who,
        mine,
        theirs,
    };
    let me = args.group_rank as usize;
    write_record(
        args.signals[me],
        ERROR_CALL_MISMATCH,
        block,
        args.domain,
        &d,
    );
}

/// This block leaves the collective: it tells every group peer that it will not touch
/// their memory again (`quit`), then, when `wait_for_peers` (the peers read this rank's
/// user buffers), waits until each peer's same-index block has said the same, at most
/// `timeout_ns`. Only then may the kernel end and the user free its buffers: a late
/// peer that passed the start barrier before the abort reached it finishes its reads
/// and quits at its next wait.
unsafe fn abandon(args: &AllReduceArgs, block: u32, blocks: u32, wait_for_peers: bool) {
    let me = args.group_rank as usize;
    let width = args.group_width as usize;
    for q in (0..width).filter(|&q| q != me) {
        quit_cell(args.signals[q], block, me).store(1, Ordering::Release);
        // Block 0 also speaks for the blocks this launch does not have: a peer launched
        // with a larger grid (a block-count mismatch) must not wait for partners that
        // never exist.
        if block == 0 {
            for x in blocks..MAX_NUM_BLOCKS_UPPER_BOUND as u32 {
                quit_cell(args.signals[q], x, me).store(1, Ordering::Release);
            }
        }
    }
    if !wait_for_peers || args.timeout_ns == 0 {
        return;
    }
    let until = deadline(args.timeout_ns);
    for q in (0..width).filter(|&q| q != me) {
        let cell = quit_cell(args.signals[me], block, q);
        while cell.load(Ordering::Acquire) == 0 {
            if matches!(until, Some(d) if Instant::now() > d) {
                return;
            }
            std::thread::yield_now();
        }
    }
}

/// The signals of one launch's group, reached through the addresses in its arguments.
struct HostSignals<'a> {
    args: &'a AllReduceArgs,
}

impl<'a> HostSignals<'a> {
    /// # Safety
    /// `args.signals[..group_width]` must be live signal allocations laid out as
    /// `include/peercomm_signal.h` says, accessed only atomically while kernels run.
    unsafe fn new(args: &'a AllReduceArgs) -> Self {
        HostSignals { args }
    }
    fn signal(&self, member: usize) -> *mut Signal {
        signal(self.args.signals[member])
    }
}

impl BarrierSignals for HostSignals<'_> {
    type Cell = AtomicU32;
    fn self_counter(&self, member: usize, domain: usize, block: usize, peer: usize) -> &AtomicU32 {
        let s = self.signal(member);
        // SAFETY: `new`'s contract: `s` is a live signal allocation; the place
        // projection is bounds-checked.
        atomic(unsafe { std::ptr::addr_of_mut!((*s).self_counter[domain][block][peer]) })
    }
    fn peer_counter(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> &AtomicU32 {
        let s = self.signal(member);
        // SAFETY: as in `self_counter`.
        atomic(unsafe {
            std::ptr::addr_of_mut!((*s).peer_counter[domain][parity][block][writer][0])
        })
    }
    fn arrival_call(
        &self,
        member: usize,
        domain: usize,
        parity: usize,
        block: usize,
        writer: usize,
    ) -> Option<[&AtomicU32; 3]> {
        let s = self.signal(member);
        Some(std::array::from_fn(|i| {
            // SAFETY: as in `self_counter`.
            atomic(unsafe {
                std::ptr::addr_of_mut!((*s).peer_counter[domain][parity][block][writer][i + 1])
            })
        }))
    }
}

impl Backoff for Spinner<'_> {
    type Timeout = Spun;
    fn wait(&mut self) -> Result<(), Spun> {
        Spinner::wait(self)
    }
}

/// The counter barrier of one block across its group ([`protocol::barrier`], the code
/// the loom model checks), with the host's orderings for `kind`.
unsafe fn barrier(args: &AllReduceArgs, block: u32, kind: BarrierKind) -> Result<(), Stop> {
    let signals = HostSignals::new(args);
    let site = BarrierSite {
        me: args.group_rank as usize,
        width: args.group_width as usize,
        domain: args.domain as usize,
        block: block as usize,
    };
    let mut spin = Spinner::new(args.timeout_ns, abort_word(args));
    let call = Some(args.call);
    protocol::barrier_with_call(&signals, site, kind.host_orderings(), call, &mut spin).map_err(
        |stop| match stop {
            BarrierStop::Gave { awaited, why } => why.waiting_for(awaited),
            BarrierStop::Mismatch { peer, theirs } => Stop::Mismatch {
                peer,
                mine: args.call,
                theirs,
            },
        },
    )
}

/// Runs block `block` of `kernel`.
///
/// # Safety
/// `args` must describe live allocations laid out as `include/peercomm_signal.h` says.
pub(crate) unsafe fn run_block(kernel: Kernel, args: &AllReduceArgs, block: u32, blocks: u32) {
    if matches!(kernel.kind, KernelKind::Delay | KernelKind::PingPong) {
        let _ = run_typed::<f32>(kernel.kind, args, block, blocks);
        return;
    }
    run_collective_block(
        args,
        block,
        blocks,
        peers_read_user_buffers(kernel.kind),
        || match kernel.dtype {
            DType::F32 => run_typed::<f32>(kernel.kind, args, block, blocks),
            DType::F16 => run_typed::<half::f16>(kernel.kind, args, block, blocks),
            DType::BF16 => run_typed::<half::bf16>(kernel.kind, args, block, blocks),
        },
    );
}

/// Runs block `block` of the batched all-reduce `kernel` ([`KernelKind::AllReduceGroup`]):
/// the same entry, error and abandon machinery as every collective, over `args.all`.
///
/// # Safety
/// As [`run_block`]; every entry's input and output must be live buffers of
/// `entries[s].elements` elements of the kernel's dtype.
pub(crate) unsafe fn run_group_block(kernel: Kernel, args: &GroupArgs, block: u32, blocks: u32) {
    run_collective_block(&args.all, block, blocks, true, || match kernel.dtype {
        DType::F32 => group::all_reduce_group::<f32>(args, block, blocks),
        DType::F16 => group::all_reduce_group::<half::f16>(args, block, blocks),
        DType::BF16 => group::all_reduce_group::<half::bf16>(args, block, blocks),
    });
}

/// What every collective's block does around its algorithm `body`: block 0 publishes
/// the call, a poisoned rank abandons at entry, a wait that stops is recorded and the
/// block abandons (waiting for its peers when `wait_for_peers`), and block 0 marks the
/// call done. The device's enter / abandon / finish.
unsafe fn run_collective_block(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
    wait_for_peers: bool,
    body: impl FnOnce() -> Result<(), Stop>,
) {
    // A group of one waits for nobody and nobody waits for it: it publishes nothing.
    let publishes = block == 0 && args.group_width > 1;
    if publishes {
        publish_current_call(args, true);
    }
    if abort_word(args).load(Ordering::Acquire) != 0 {
        // Poisoned (an earlier wait gave up, or a peer told this rank to stop): do
        // nothing until re-initialisation but tell the peers' same-index blocks, which
        // may be waiting for this one. The call stays this rank's pending one in its
        // current_call.
        abandon(args, block, blocks, false);
        return;
    }
    if let Err(stop) = body() {
        match stop {
            Stop::TimedOut { awaited } => record_timeout(args, block, awaited),
            Stop::Mismatch { peer, mine, theirs } => {
                record_mismatch(args, block, peer, mine, theirs)
            }
            Stop::Aborted => {}
        }
        abandon(args, block, blocks, wait_for_peers);
    }
    // Block 0 marks the call done, unless the rank has an error record: an abandoned
    // call stays the rank's pending one, for a peer whose wait gives up later.
    if publishes && abort_word(args).load(Ordering::Acquire) == 0 {
        publish_current_call(args, false);
    }
}

/// Whether the peers of a kernel read this rank's user buffers (then a rank that gives
/// up must wait for them to quit before its kernel may end).
fn peers_read_user_buffers(kind: KernelKind) -> bool {
    !matches!(
        kind,
        KernelKind::Lamport
            | KernelKind::LamportRmsNorm
            | KernelKind::Barrier
            | KernelKind::PingPong
            | KernelKind::Delay
    )
}

unsafe fn run_typed<T: Element>(
    kind: KernelKind,
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
) -> Result<(), Stop> {
    match kind {
        // A staged message larger than the payload holds whole.
        kind if chunked::is_chunked::<T>(kind, args) => {
            chunked::run::<T>(kind, args, block, blocks)
        }
        KernelKind::OneStage => one_stage::<T>(args, block, blocks),
        KernelKind::TwoStage => two_stage::<T>(args, block, blocks),
        KernelKind::Lamport => lamport::<T>(args, block, blocks),
        KernelKind::PingPong => ping_pong(args),
        KernelKind::Delay => {
            if block == 0 {
                std::thread::sleep(Duration::from_nanos(args.timeout_ns));
            }
            Ok(())
        }
        KernelKind::Barrier => {
            barrier(args, block, BarrierKind::Start)?;
            barrier(args, block, BarrierKind::Publish)
        }
        KernelKind::AllGather => collectives::all_gather::<T>(args, block, blocks),
        KernelKind::ReduceScatter => collectives::reduce_scatter::<T>(args, block, blocks),
        KernelKind::Broadcast => collectives::broadcast::<T>(args, block, blocks),
        KernelKind::Scatter => collectives::scatter::<T>(args, block, blocks),
        KernelKind::AllReduceRmsNorm => collectives::allreduce_rmsnorm::<T>(args, block, blocks),
        KernelKind::LamportRmsNorm => collectives::lamport_rmsnorm::<T>(args, block, blocks),
        // Its arguments are a GroupArgs: `Host::launch` refuses it, `run_group_block`
        // runs it.
        KernelKind::AllReduceGroup => unreachable!("the batched all-reduce has its own entry"),
    }
}

fn lanes<T>() -> usize {
    PACK_BYTES / std::mem::size_of::<T>()
}

/// Element range of pack `p`.
fn pack_range<T>(p: usize, n: usize) -> std::ops::Range<usize> {
    let l = lanes::<T>();
    p * l..((p + 1) * l).min(n)
}

/// Packs handled by `block`: the same grid-stride pattern as the device code, with one
/// thread per block.
fn block_packs(first: usize, end: usize, block: u32, blocks: u32) -> impl Iterator<Item = usize> {
    (first + block as usize..end).step_by(blocks as usize)
}

unsafe fn load<T: Element>(base: u64, i: usize) -> f32 {
    (base as *const T).add(i).read().to_f32()
}

unsafe fn store<T: Element>(base: u64, i: usize, x: f32) {
    (base as *mut T).add(i).write(T::from_f32(x))
}

/// Where a sum over `width` ranks starts: the first addend, after +0.0 when `width > 1`
/// (acc = +0.0 + x0), so an exact-zero sum is +0.0 on every algorithm (Lamport cannot
/// carry -0.0, its sentinel) and every other sum is unchanged; a group of one stays an
/// exact copy. The device's `sum_start`.
pub(super) fn sum_start(x0: f32, width: usize) -> f32 {
    if width > 1 {
        0.0 + x0
    } else {
        x0
    }
}

/// Sum over the group of element `e` of `srcs`, in group-rank order (the same order on
/// every rank, so every rank gets the same bits).
unsafe fn reduce_element<T: Element>(srcs: &[u64], e: usize) -> f32 {
    let mut acc = sum_start(load::<T>(srcs[0], e), srcs.len());
    for &s in &srcs[1..] {
        acc += load::<T>(s, e);
    }
    acc
}

unsafe fn one_stage<T: Element>(args: &AllReduceArgs, block: u32, blocks: u32) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let packs = n.div_ceil(lanes::<T>());
    let me = args.group_rank as usize;
    let staged = args.stage_input != 0;
    if staged {
        // Copy this block's share of the own input into the own payload, which the
        // peers read after the (then publishing) start barrier.
        for p in block_packs(0, packs, block, blocks) {
            for e in pack_range::<T>(p, n) {
                (args.payloads[me] as *mut T)
                    .add(e)
                    .write((args.local_input as *const T).add(e).read());
            }
        }
    }
    let first = if staged {
        BarrierKind::Publish
    } else {
        BarrierKind::Start
    };
    barrier(args, block, first)?;
    let srcs = &args.inputs[..args.group_width as usize];
    for p in block_packs(0, packs, block, blocks) {
        for e in pack_range::<T>(p, n) {
            store::<T>(args.output, e, reduce_element::<T>(srcs, e));
        }
    }
    barrier(args, block, BarrierKind::End)
}

/// Packs per partition of the two-stage kernel.
pub(crate) fn two_stage_partition(packs: usize, width: usize) -> usize {
    packs.div_ceil(width)
}

unsafe fn two_stage<T: Element>(args: &AllReduceArgs, block: u32, blocks: u32) -> Result<(), Stop> {
    let n = args.num_elements as usize;
    let l = lanes::<T>();
    let packs = n.div_ceil(l);
    let width = args.group_width as usize;
    let me = args.group_rank as usize;
    let part = two_stage_partition(packs, width);
    barrier(args, block, BarrierKind::Start)?;
    // Reduce-scatter: this rank reduces partition `me` into its own payload.
    let srcs = &args.inputs[..width];
    let first = me * part;
    for p in block_packs(first, (first + part).min(packs), block, blocks) {
        for e in pack_range::<T>(p, n) {
            store::<T>(
                args.payloads[me],
                e - first * l,
                reduce_element::<T>(srcs, e),
            );
        }
    }
    barrier(args, block, BarrierKind::Publish)?;
    // All-gather: partition q comes from rank q's payload; block b reads what block b
    // of rank q wrote, so the per-block barrier suffices. Each rank starts at its own
    // partition and rotates (as the device kernel), so readers spread over the owners.
    for i in 0..width {
        let q = (me + i) % width;
        let first = q * part;
        for p in block_packs(first, (first + part).min(packs), block, blocks) {
            for e in pack_range::<T>(p, n) {
                let x = (args.payloads[q] as *const T).add(e - first * l).read();
                (args.output as *mut T).add(e).write(x);
            }
        }
    }
    barrier(args, block, BarrierKind::End)
}

/// Address of pack `p` of slot `src` of generation `gen` in the Lamport region of the
/// signal at `signal_addr`, whose generations hold `slots` slots (the world width:
/// Lamport runs only over the whole world).
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
unsafe fn lamport_pack_words<T: Element>(input: u64, p: usize, n: usize) -> [u32; 4] {
    let mut bytes = [0u8; PACK_BYTES];
    let size = std::mem::size_of::<T>();
    let neg_zero: u32 = if size == 4 { 0x8000_0000 } else { 0x8000 };
    for (j, e) in pack_range::<T>(p, n).enumerate() {
        let mut bits = (input as *const T).add(e).read().to_bits_u32();
        if bits == neg_zero {
            bits = 0;
        }
        bytes[j * size..(j + 1) * size].copy_from_slice(&bits.to_le_bytes()[..size]);
    }
    std::array::from_fn(|w| u32::from_le_bytes(bytes[w * 4..w * 4 + 4].try_into().unwrap()))
}

fn lane_from_words<T: Element>(words: &[u32; 4], j: usize) -> f32 {
    let size = std::mem::size_of::<T>();
    let mut bytes = [0u8; PACK_BYTES];
    for (w, word) in words.iter().enumerate() {
        bytes[w * 4..w * 4 + 4].copy_from_slice(&word.to_le_bytes());
    }
    let mut raw = [0u8; 4];
    raw[..size].copy_from_slice(&bytes[j * size..(j + 1) * size]);
    let bits = u32::from_le_bytes(raw);
    match size {
        4 => f32::from_bits(bits),
        _ => {
            // Rebuild T from its 16 bits through a read of the raw bytes.
            let b16 = bits as u16;
            // SAFETY: T is a 16-bit float here; any bit pattern is a valid value.
            let t: T = unsafe { std::mem::transmute_copy(&b16) };
            t.to_f32()
        }
    }
}

/// What a Lamport kernel reads of the own `lamport_state` at entry.
#[derive(Clone, Copy)]
struct LamportEntry {
    /// The generation this call pushes into and reads.
    gen: usize,
    /// Packs per slot and slots the previous Lamport call wrote (cleared by this one).
    prev_packs: usize,
    prev_width: usize,
}

/// Reads this rank's Lamport state (the device's `enter`).
unsafe fn lamport_entry(args: &AllReduceArgs) -> LamportEntry {
    let own = signal(args.signals[args.group_rank as usize]);
    let state = std::ptr::addr_of_mut!((*own).lamport_state) as *mut u32;
    LamportEntry {
        gen: atomic(state.add(LAMPORT_FLAG)).load(Ordering::Acquire) as usize,
        prev_packs: atomic(state.add(LAMPORT_PREV_PACKS)).load(Ordering::Relaxed) as usize,
        prev_width: atomic(state.add(LAMPORT_PREV_WIDTH)).load(Ordering::Relaxed) as usize,
    }
}

/// Index of the header pack of a slot: its last pack.
fn lamport_header_pack(args: &AllReduceArgs) -> usize {
    args.lamport_slot_bytes as usize / PACK_BYTES - 1
}

/// Stores `words` as pack `p` of slot `group_rank` of generation `gen` in every other
/// member's region (the own-slot rule of include/peercomm_signal.h: the own slot is
/// never written).
unsafe fn lamport_push(args: &AllReduceArgs, gen: usize, p: usize, words: [u32; 4]) {
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
/// another block of this rank found a mismatch returns at entry, so the header must not
/// wait for any one block (a peer would wait for it until its timeout).
unsafe fn lamport_push_header(args: &AllReduceArgs, gen: usize) {
    let header = [args.call[0], args.call[1], args.call[2], 0];
    lamport_push(args, gen, lamport_header_pack(args), header);
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
unsafe fn lamport_check_headers(
    args: &AllReduceArgs,
    gen: usize,
    spin: &mut Spinner<'_>,
) -> Result<(), Stop> {
    let me = args.group_rank as usize;
    for src in (0..args.group_width as usize).filter(|&s| s != me) {
        let header = lamport_wait(args, gen, src, lamport_header_pack(args), spin)?;
        let theirs = [header[0], header[1], header[2]];
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

/// The f32 sums of pack `p` in source order (lanes past the message's `n` elements
/// zero): the peers' packs from the own region of generation `gen` once they have
/// arrived, the own pack straight from the input (sent the same way: -0.0 lanes as
/// +0.0). The device's `lamport_wait_pack` + `sum_packs` before the rounding.
unsafe fn lamport_pack_sums<T: Element>(
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

/// The end of every Lamport kernel that did not stop: clears the previous call's
/// generation of the own region for the call after next (every slot but the own one,
/// never written; headers by block 0), then the last block to finish records this
/// call's `packs` and width and advances the flag. The device's `lamport_end`.
unsafe fn lamport_end(
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
    let header_pack = lamport_header_pack(args);
    for src in (0..entry.prev_width).filter(|&s| s != me) {
        let header = (block == 0).then_some(header_pack);
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

unsafe fn lamport<T: Element>(args: &AllReduceArgs, block: u32, blocks: u32) -> Result<(), Stop> {
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

/// Ranks 0 and 1 bounce a flag through the first word of their payloads.
unsafe fn ping_pong(args: &AllReduceArgs) -> Result<(), Stop> {
    let me = args.group_rank as usize;
    if me > 1 || args.group_width < 2 {
        return Ok(());
    }
    let mine = atomic(args.payloads[me] as *mut u32);
    let theirs = atomic(args.payloads[1 - me] as *mut u32);
    let never = AtomicU32::new(0);
    let mut spin = Spinner::new(args.timeout_ns, &never);
    for i in 1..=args.num_elements as u32 {
        if me == 0 {
            theirs.store(i, Ordering::Release);
        }
        while mine.load(Ordering::Acquire) != i {
            spin.wait().map_err(|why| why.waiting_for(1 - me))?;
        }
        if me == 1 {
            theirs.store(i, Ordering::Release);
        }
    }
    Ok(())
}
