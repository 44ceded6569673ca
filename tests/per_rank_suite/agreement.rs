//! Ranks agree on the per-rank path: on the grid despite different multiprocessor
//! counts; on calls (`CallMismatch` naming peer and field, nothing written); on who
//! never arrived; and on the sign of zero.

use std::time::Duration;

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::Simulation;
use peercomm::{
    Algorithm, AllReduceOptions, CallField, CollectiveOptions, Comm, CommConfig, DType, Element,
    Error, ReduceOp,
};

use super::{common, in_step, nan, world_threads, Placement};

/// A configuration with short waits, for the cases that end in a timeout.
pub fn short_waits(place: &Placement, world: usize) -> CommConfig {
    place
        .config(world)
        .with_barrier_timeout(Some(Duration::from_millis(1500)))
        .with_bootstrap_timeout(Duration::from_secs(30))
}

/// Ranks reporting different multiprocessor counts leave the grid to peercomm: one-stage
/// over 65,536 f32 is right on every rank (own grids would get half of it wrong).
pub fn unequal_multiprocessors_agree_on_the_grid<B: Backend>(place: &Placement, counts: &[usize]) {
    let world = counts.len();
    let config = place
        .config(world)
        .with_max_blocks(None)
        .with_simulate(Simulation::default().with_multiprocessors(counts.to_vec()));
    check_one_stage_sums::<B>(place, world, &config, &|_| {}, "unequal_multiprocessors");
}

/// One-stage over 65,536 f32 with fresh inputs, checked against the f64 reference on
/// every rank, every rank's `synchronize()` `Ok`; each thread first calls
/// `before(rank)` (before its communicator exists).
pub fn check_one_stage_sums<B: Backend>(
    place: &Placement,
    world: usize,
    config: &CommConfig,
    before: &(dyn Fn(usize) + Sync),
    test: &str,
) {
    let n = 65_536;
    let mut rng = common::rng(test);
    let ins = common::random_inputs::<f32>(&mut rng, world, n);
    let outs = world_threads::<B, _>(place, world, config, before, |rank, comm, _| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &ins[rank]).unwrap();
        let mut recv = B::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        for _ in 0..3 {
            comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts)
                .unwrap();
        }
        comm.synchronize().unwrap();
        recv.to_host(dev).unwrap()
    });
    common::check_sums(&ins, &outs, world, test);
}

/// What one rank does in a mismatch case: its call, enqueued and waited for.
pub type Call<B> = Box<dyn Fn(&Comm<B>) -> peercomm::Result<()> + Sync>;

/// A mismatch case: what it is, the field every rank must name, every rank's call but
/// the last rank's, and the last rank's.
pub type Case<'a, B> = (&'a str, CallField, Call<B>, Call<B>);

/// Each case in step: every rank gets `CallMismatch` on its field (naming the last
/// rank, which names another); after `reinitialize`, `again(comm, usual)` works.
pub fn every_rank_mismatched<B: Backend>(
    place: &Placement,
    world: usize,
    config: &CommConfig,
    cases: &[Case<B>],
    again: impl Fn(&Comm<B>, &Call<B>) + Sync,
) {
    let odd = world - 1;
    for (what, field, usual, other) in cases {
        let errors = in_step::<B, _>(place, world, config, |rank, comm, meet| {
            let got = if rank == odd {
                other(comm)
            } else {
                usual(comm)
            };
            meet.wait();
            comm.reinitialize().unwrap();
            again(comm, usual);
            got
        });
        common::assert_every_rank_mismatched(&errors, *field, odd, what);
    }
}

fn all_reduce<B: Backend>(dtype: DType, n: usize, opts: AllReduceOptions) -> Call<B> {
    fn typed<B: Backend, T: Element>(
        comm: &Comm<B>,
        n: usize,
        opts: &AllReduceOptions,
    ) -> peercomm::Result<()> {
        let dev = comm.device();
        let send = B::alloc_from(dev, &vec![T::from_f32(1.0); n])?;
        let mut recv = B::alloc_from(dev, &nan::<T>(n))?;
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, opts)?;
        // Waits: a mismatch is found at the first barrier, before any output is written.
        let result = comm.synchronize();
        let host = recv.to_host(comm.device())?;
        if result.is_err() {
            let poison = nan::<T>(1)[0].to_bits_u32();
            let written = host.iter().filter(|x| x.to_bits_u32() != poison).count();
            let note = format!("a mismatched call wrote {written} output elements");
            assert_eq!(written, 0, "{note}");
        }
        result
    }
    Box::new(move |comm: &Comm<B>| by_dtype!(dtype, typed::<B>(comm, n, &opts)))
}

fn broadcast<B: Backend>(n: usize, root: usize) -> Call<B> {
    Box::new(move |comm: &Comm<B>| {
        let dev = comm.device();
        let mut buf = B::alloc_from(dev, &vec![comm.rank() as f32; n])?;
        comm.broadcast_in_place_with(&mut buf, root, &CollectiveOptions::new())?;
        comm.synchronize()
    })
}

fn all_gather<B: Backend>(n: usize) -> Call<B> {
    Box::new(move |comm: &Comm<B>| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &vec![1.0f32; n])?;
        let mut recv = B::alloc_from(dev, &vec![0.0f32; n * comm.world_size()])?;
        comm.all_gather_with(&send, &mut recv, &CollectiveOptions::new())?;
        comm.synchronize()
    })
}

/// Rank `odd` makes another call: every rank gets `CallMismatch` naming the field (and
/// `odd`, or `odd` one of the others); after `reinitialize` a matching call works.
pub fn mismatched_calls_are_typed_errors<B: Backend>(place: &Placement, world: usize) {
    let config = short_waits(place, world);
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let lamport = AllReduceOptions::new().algorithm(Algorithm::Lamport);
    let (f32s, lamport) = (|n, o| all_reduce::<B>(DType::F32, n, o), lamport.blocks(1));
    let cases: Vec<Case<B>> = cases![
        "1000 against 500 elements", Length: f32s(1000, one), f32s(500, one);
        "f32 against bf16", DType: f32s(256, one), all_reduce::<B>(DType::BF16, 256, one);
        "all-gather against broadcast", Collective: all_gather::<B>(64), broadcast::<B>(64, 0);
        "broadcast roots", Root: broadcast::<B>(64, 0), broadcast::<B>(64, 1);
        "block counts", Blocks: f32s(4096, one.blocks(2)), f32s(4096, one.blocks(1));
        "Lamport against one-stage (another kind of wait)", Algorithm:
            f32s(256, lamport), f32s(256, one.blocks(1));
        "Lamport lengths", Length: f32s(256, lamport), f32s(200, lamport);
    ];

    // A matching call works again.
    let again = |comm: &Comm<B>, _: &Call<B>| all_reduce::<B>(DType::F32, 300, one)(comm).unwrap();
    every_rank_mismatched(place, world, &config, &cases, again);
}

/// Caught late, as documented: rank 1's group-of-one call then world call pair with
/// rank 0's world call (both `Ok`); rank 0's next world call times out naming rank 1,
/// and rank 1's record holds rank 0's `PeerAborted`: both poisoned.
pub fn a_group_of_one_against_a_world_call_is_caught_late<B: Backend>(place: &Placement) {
    let world = 2;
    let config = short_waits(place, world);
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let got = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let first = if rank == 1 {
            all_reduce::<B>(DType::F32, 128, one.group_size(1))(comm)
        } else {
            all_reduce::<B>(DType::F32, 128, one)(comm)
        };
        let second = all_reduce::<B>(DType::F32, 128, one)(comm);
        meet.wait();
        let late = comm.synchronize();
        meet.wait();
        comm.reinitialize().unwrap();
        (first, second, late)
    });
    let ((zero, zero_next, _), (one, one_next, late)) = (&got[0], &got[1]);
    assert_eq!(*one, Ok(()), "a group of one runs alone");
    let note = "rank 0's world call paired with rank 1's second";
    assert_eq!(*zero, Ok(()), "{note}");
    let note = "rank 1's world call paired with rank 0's first";
    assert_eq!(*one_next, Ok(()), "{note}");
    let timeout =
        |e: &Error| matches!(e, Error::BarrierTimeout { waiting_for: w, .. } if *w == Some(1));
    let holds = zero_next.as_ref().is_err_and(timeout);
    assert!(holds, "rank 0's second world call: {zero_next:?}");
    let aborted =
        |e: &Error| matches!(e, Error::PeerAborted { by: 0, waiting_for: w, .. } if *w == Some(1));
    let holds = late.as_ref().is_err_and(aborted);
    assert!(holds, "rank 1 afterwards: {late:?}");
}

/// Different group widths wait in different domains; when the waits give up each rank
/// finds the peer's call at the same sequence with another width: `CallMismatch {
/// field: GroupWidth }`, not a bare timeout (rank 0 in pairs, the rest whole-world).
pub fn different_group_widths_are_caught<B: Backend>(place: &Placement) {
    let world = 4;
    let config = short_waits(place, world);
    let got = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let group = if rank == 0 { 2 } else { 4 };
        let opts = AllReduceOptions::new()
            .algorithm(Algorithm::OneStage)
            .group_size(group);
        let r = all_reduce::<B>(DType::F32, 512, opts)(comm);
        meet.wait();
        comm.reinitialize().unwrap();
        r
    });
    for (rank, r) in got.iter().enumerate() {
        let holds =
            matches!(r, Err(Error::CallMismatch { field, .. }) if *field == CallField::GroupWidth);
        assert!(holds, "rank {rank}: {r:?}");
    }
}

/// World 3, rank 1 never launches its all-reduce: every rank's error names rank 1
/// (`waiting_for`), and the messages have no stray spaces.
pub fn the_rank_that_never_came_is_named<B: Backend>(place: &Placement) {
    let world = 3;
    let config = short_waits(place, world);
    let got = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let dev = comm.device();
        let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
        if rank == 1 {
            comm.miss_next();
        }
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
            .unwrap();
        let mut r = comm.synchronize();
        meet.wait();
        if rank == 1 {
            // Its peers wrote their abort into its record when they gave up.
            r = comm.synchronize();
        }
        meet.wait();
        comm.reinitialize().unwrap();
        r
    });
    for (rank, r) in got.iter().enumerate() {
        let named = match r {
            Err(Error::BarrierTimeout { waiting_for, .. }) => *waiting_for,
            Err(Error::PeerAborted { waiting_for, .. }) => *waiting_for,
            other => panic!("rank {rank}: {other:?}"),
        };
        assert_eq!(named, Some(1), "rank {rank}: {r:?}");
        let text = r.as_ref().unwrap_err().to_string();
        assert!(text.contains("rank 1"), "rank {rank}: {text}");
        assert!(!text.contains("  "), "stray spaces: {text}");
    }
}

/// All--0.0 inputs sum to +0.0 under every per-rank algorithm, size and dtype; a group
/// of one copies (-0.0 stays).
pub fn one_sign_of_zero<B: Backend>(place: &Placement, world: usize) {
    fn case<B: Backend, T: Element>(comm: &Comm<B>, n: usize, opts: AllReduceOptions) -> Vec<u32> {
        let dev = comm.device();
        let zero = common::negative_zero::<T>();
        let send = B::alloc_from(dev, &vec![zero; n]).unwrap();
        let mut recv = B::alloc_from(dev, &vec![T::from_f32(7.0); n]).unwrap();
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
        common::bits(&recv.to_host(dev).unwrap())
    }
    let config = place.config(world);
    in_step::<B, _>(place, world, &config, |_rank, comm, _| {
        for n in [1usize, 7, 1000, 70_000] {
            for algorithm in [Algorithm::Auto, Algorithm::OneStage, Algorithm::Lamport] {
                let opts = AllReduceOptions::new().algorithm(algorithm);
                if comm.algorithm_for(DType::F32, n, &opts, false).is_err() {
                    continue;
                }
                for dtype in [DType::F32, DType::F16, DType::BF16] {
                    let bits = by_dtype!(dtype, case::<B>(comm, n, opts));
                    let what = format!("{dtype:?} {algorithm:?} n {n}: not +0.0");
                    assert!(bits.iter().all(|&b| b == 0), "{what}");
                }
            }
            // A group of one copies exactly.
            let alone = AllReduceOptions::new().group_size(1);
            let f = case::<B, f32>(comm, n, alone);
            let holds = f.iter().all(|&b| b == 0x8000_0000);
            assert!(holds, "group of one must keep -0.0");
        }
    });
}
