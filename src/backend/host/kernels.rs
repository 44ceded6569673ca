//! Rust ports of the device kernels, one OS thread per block doing a GPU block's work
//! with the protocol's orderings: counters and Lamport packs are atomics, plain data is
//! read only after an acquire that pairs with the writer's release. Here: the entry,
//! error and abandon steps every collective shares, and the test kernels.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::backend::{Kernel, KernelKind};
use crate::dtype::{DType, Element};
use crate::protocol::BarrierKind;
use crate::signal::{AllReduceArgs, ExchangeArgs, GroupArgs};

mod collectives;
mod exchange;
mod group;
mod lamport;
mod packs;
mod records;
mod signals;
mod wait;

pub(crate) use wait::{Flow as BlockFlow, Stop};

use packs::Grid;
use records::{abandon, publish_current_call, record_mismatch, record_timeout};
use signals::{abort_word, atomic, barrier};
use wait::{Flow, Spinner};

/// Runs block `block` of `kernel`.
///
/// # Safety
/// `args` must describe live allocations laid out as `include/peercomm_signal.h` says.
pub(crate) unsafe fn run_block(kernel: Kernel, args: &AllReduceArgs, block: u32, blocks: u32) {
    let (kind, g) = (kernel.kind, Grid { block, blocks });
    if matches!(kind, KernelKind::Delay | KernelKind::PingPong) {
        let _ = run_typed::<f32>(kind, args, g);
        return;
    }
    run_collective_block(
        args,
        g,
        &|_| peers_read_user_buffers(kind),
        || match kernel.dtype {
            DType::F32 => run_typed::<f32>(kind, args, g),
            DType::F16 => run_typed::<half::f16>(kind, args, g),
            DType::BF16 => run_typed::<half::bf16>(kind, args, g),
            DType::F64 => run_typed::<f64>(kind, args, g),
            DType::I8 => run_typed::<i8>(kind, args, g),
            DType::U8 => run_typed::<u8>(kind, args, g),
            DType::I32 => run_typed::<i32>(kind, args, g),
            DType::U32 => run_typed::<u32>(kind, args, g),
            DType::I64 => run_typed::<i64>(kind, args, g),
            DType::U64 => run_typed::<u64>(kind, args, g),
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
    let g = Grid { block, blocks };
    run_collective_block(&args.all, g, &|_| true, || match kernel.dtype {
        DType::F32 => group::all_reduce_group::<f32>(args, g),
        DType::F16 => group::all_reduce_group::<half::f16>(args, g),
        DType::BF16 => group::all_reduce_group::<half::bf16>(args, g),
        // `check_kernel` refuses the other dtypes (`KernelKind::takes`).
        other => unreachable!("no batched all-reduce of {}", other.name()),
    });
}

/// Runs block `block` of the exchange ([`KernelKind::Exchange`]): the same entry, error
/// and abandon machinery as every collective, over `args.all`. The peers read only this
/// rank's payload, so a block that gives up does not wait for them.
///
/// # Safety
/// As [`run_block`]; every peer entry's send and receive must be live buffers of its
/// byte counts.
pub(crate) unsafe fn run_exchange_block(args: &ExchangeArgs, block: u32, blocks: u32) {
    let g = Grid { block, blocks };
    // A peer that reads this rank's buffer in place is waited for.
    let reads_in_place = |q: usize| block < args.peers[q].blocks && args.peers[q].send_remote != 0;
    run_collective_block(&args.all, g, &reads_in_place, || {
        exchange::exchange(args, g)
    });
}

/// Runs block `g.block` of a kernel of the engine's own (the device API's host
/// contract) over `args` (a `DeviceComm`'s fields): the collectives' entry, error and
/// abandon steps around `body`, whose barriers go through [`user_barrier`]. A block that
/// stops waits for its peers (they may read its buffer).
///
/// # Safety
/// `args` must describe live signals laid out as `include/peercomm_signal.h` says.
pub(crate) unsafe fn run_user_block(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
    body: impl FnOnce() -> Flow,
) {
    run_collective_block(args, Grid { block, blocks }, &|_| true, body);
}

/// A barrier of a user kernel's block (see [`run_user_block`]).
///
/// # Safety
/// As [`run_user_block`].
pub(crate) unsafe fn user_barrier(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
    kind: BarrierKind,
) -> Flow {
    barrier(args, Grid { block, blocks }, kind)
}

/// The grid barrier of a user kernel's block (the device header's `grid_barrier`):
/// every block arrives on this rank's grid counter; block 0 waits for all of them,
/// passes the counter barrier with the peers' blocks 0 and releases this rank's blocks.
///
/// # Safety
/// As [`run_user_block`].
pub(crate) unsafe fn user_grid_barrier(
    args: &AllReduceArgs,
    block: u32,
    blocks: u32,
    kind: BarrierKind,
) -> Flow {
    let own = args.signals[args.group_rank as usize];
    let (arrivals, passed) = signals::user_grid(own);
    let me = args.group_rank as usize;
    let gen = passed.load(Ordering::Acquire);
    arrivals.fetch_add(1, Ordering::AcqRel);
    if block == 0 {
        let mut spin = Spinner::new(args.timeout_ns, abort_word(args));
        while arrivals.load(Ordering::Acquire) != blocks {
            spin.wait().map_err(|why| why.waiting_for(me))?;
        }
        arrivals.store(0, Ordering::Relaxed);
        barrier(args, Grid { block, blocks }, kind)?;
        passed.store(gen.wrapping_add(1), Ordering::Release);
    } else {
        // Twice the timeout: block 0's record names a missing peer first.
        let mut spin = Spinner::new(args.timeout_ns.saturating_mul(2), abort_word(args));
        while passed.load(Ordering::Acquire) == gen {
            spin.wait().map_err(|why| why.waiting_for(me))?;
        }
    }
    Ok(())
}

/// What every collective's block does around its `body`: block 0 publishes the call, a
/// poisoned rank abandons at entry, a stopped wait is recorded and the block abandons
/// (waiting for the peers `wait_for` names: those that read its user buffers), block 0
/// marks the call done.
unsafe fn run_collective_block(
    args: &AllReduceArgs,
    g: Grid,
    wait_for: &dyn Fn(usize) -> bool,
    body: impl FnOnce() -> Flow,
) {
    let Grid { block, blocks } = g;
    // A group of one waits for nobody and nobody waits for it: it publishes nothing.
    let publishes = block == 0 && args.group_width > 1;
    if publishes {
        publish_current_call(args, true);
    }
    if abort_word(args).load(Ordering::Acquire) != 0 {
        // Poisoned: do nothing until re-initialisation but tell the peers' same-index
        // blocks, which may wait for this one. The call stays this rank's pending one.
        abandon(args, block, blocks, &|_| false);
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
        abandon(args, block, blocks, wait_for);
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
    use KernelKind as K;
    !matches!(
        kind,
        K::Lamport | K::LamportRmsNorm | K::Barrier | K::PingPong | K::Delay
    )
}

unsafe fn run_typed<T: Element>(kind: KernelKind, args: &AllReduceArgs, g: Grid) -> Flow {
    match kind {
        KernelKind::OneStage | KernelKind::Reduce => collectives::one_stage::<T>(args, g),
        KernelKind::TwoStage => collectives::two_stage::<T>(args, g),
        KernelKind::Lamport => lamport::lamport::<T>(args, g),
        KernelKind::PingPong => ping_pong(args),
        KernelKind::Delay => {
            if g.block == 0 {
                std::thread::sleep(Duration::from_nanos(args.timeout_ns));
            }
            Ok(())
        }
        KernelKind::Barrier => {
            barrier(args, g, BarrierKind::Start)?;
            barrier(args, g, BarrierKind::Publish)
        }
        KernelKind::AllGather => collectives::all_gather::<T>(args, g),
        KernelKind::ReduceScatter => collectives::reduce_scatter::<T>(args, g),
        KernelKind::Broadcast => collectives::broadcast::<T>(args, g),
        KernelKind::Scatter => collectives::scatter::<T>(args, g),
        KernelKind::AllReduceRmsNorm => collectives::allreduce_rmsnorm::<T>(args, g),
        KernelKind::LamportRmsNorm => lamport::lamport_rmsnorm::<T>(args, g),
        // Its arguments are a GroupArgs: `Host::launch` refuses it, `run_group_block`
        // runs it.
        KernelKind::AllReduceGroup | KernelKind::Exchange => {
            unreachable!("{} has its own entry", kind.name())
        }
    }
}

/// Ranks 0 and 1 bounce a flag through the first word of their payloads.
unsafe fn ping_pong(args: &AllReduceArgs) -> Flow {
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
