//! The per-rank all-reduce: a checked schedule of every algorithm and group size, a
//! refused two-stage, sibling groups kept apart, and a missing call's timeout.

use std::sync::Barrier;
use std::time::Duration;

use peercomm::backend::Backend;
use peercomm::{Algorithm, AllReduceOptions, Error, ReduceOp};

use super::{common, processes, seed, with_world, with_world_config, Placement};

/// Calls of every algorithm the per-rank mode offers, every group size, odd lengths,
/// in and out of place, enqueued back to back; each rank checks each of its outputs
/// against the f64 reference, and every group's ranks agree bit for bit.
pub fn checked_calls<B: Backend>(place: &Placement, world: usize) {
    let seed = seed("per_rank_threads");
    let digests = with_world::<B, _>(place, world, |_, comm| processes::run_checked(&comm, seed));
    let calls = processes::compare_ranks(world, &digests);
    eprintln!("per_rank_threads world {world}: {calls} calls per rank checked");
}

/// Forced two-stage is refused per rank (it reads the peers' user buffers), with
/// nothing written; Auto still works.
pub fn refuses_two_stage<B: Backend>(place: &Placement) {
    with_world::<B, _>(place, 2, |_rank, comm| {
        let dev = comm.device();
        let send = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
        let mut recv = B::alloc_from(dev, &[f32::NAN; 64]).unwrap();
        let two = AllReduceOptions::new().algorithm(Algorithm::TwoStage);
        let err = comm
            .all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &two)
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        assert!(B::download(dev, &recv).unwrap().iter().all(|x| x.is_nan()));
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &AllReduceOptions::new())
            .unwrap();
        comm.synchronize().unwrap();
        assert_eq!(B::download(dev, &recv).unwrap(), vec![2.0; 64]);
    });
}

/// Sibling groups make unequal numbers of subgroup calls, then the whole world
/// all-reduces (Lamport and one-stage): the per-domain counters and the world-only
/// Lamport state keep them consistent.
pub fn independent_sibling_groups<B: Backend>(place: &Placement) {
    let world = 4;
    let seed = seed("per_rank_independent_sibling_groups");
    let start = Barrier::new(world);
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let extra = if rank < 2 { 7 } else { 2 };
        start.wait();
        for call in 0..extra {
            let len = 333 + call;
            let mut buf = B::alloc_buffer::<f32>(dev, len).unwrap();
            B::upload(dev, &[1.0 + rank as f32; 1][..].repeat(len), &mut buf).unwrap();
            comm.all_reduce_in_place_with(
                &mut buf,
                &ReduceOp::Sum,
                &AllReduceOptions::new().group_size(2),
            )
            .unwrap();
            comm.synchronize().unwrap();
            let pair = (rank / 2 * 2) as f32;
            let expect = (1.0 + pair) + (2.0 + pair);
            assert!(B::download(dev, &buf).unwrap().iter().all(|&x| x == expect));
        }
        for (call, algorithm) in [Algorithm::Lamport, Algorithm::OneStage, Algorithm::Lamport]
            .into_iter()
            .enumerate()
        {
            let len = 4099;
            let mine = processes::input(seed, call, rank, len);
            let mut buf = B::alloc_buffer::<f32>(dev, len).unwrap();
            B::upload(dev, &mine, &mut buf).unwrap();
            let opts = AllReduceOptions::new().algorithm(algorithm);
            comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            let ins: Vec<Vec<f32>> = (0..world)
                .map(|r| processes::input(seed, call, r, len))
                .collect();
            let got = B::download(dev, &buf).unwrap();
            let what = format!("rank {rank} world call {call}");

            common::check_sums(&ins, &vec![got; world], world, &what);
        }
    });
}

/// A rank that never makes the call: the others time out with a typed error, refuse
/// further calls, and work again after a collective reinitialize.
pub fn missing_call_times_out_and_recovers<B: Backend>(place: &Placement) {
    let cfg = place
        .config(2)
        .with_barrier_timeout(Some(Duration::from_millis(300)));
    with_world_config::<B, _>(place, 2, &cfg, |rank, comm| {
        let dev = comm.device();
        let mut buf = B::alloc_buffer::<f32>(dev, 100).unwrap();
        B::upload(dev, &[1.0; 100], &mut buf).unwrap();
        if rank == 0 {
            let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
            comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
                .unwrap();
            match comm.synchronize() {
                Err(Error::BarrierTimeout { rank: 0, .. }) => {}
                other => panic!("rank 0: expected a timeout, got {other:?}"),
            }
            match comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts) {
                Err(Error::Poisoned { first })
                    if matches!(*first, Error::BarrierTimeout { rank: 0, .. }) => {}
                other => panic!("rank 0: expected Poisoned by the timeout, got {other:?}"),
            }
        } else {
            // Rank 1 skips the call; rank 0's abort reaches its record.
            std::thread::sleep(Duration::from_millis(900));
            match comm.synchronize() {
                Err(Error::PeerAborted { rank: 1, by: 0, .. }) => {}
                other => panic!("rank 1: expected PeerAborted, got {other:?}"),
            }
        }
        comm.reinitialize().unwrap();
        B::upload(dev, &[1.0; 100], &mut buf).unwrap();
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &AllReduceOptions::new())
            .unwrap();
        comm.synchronize().unwrap();
        assert_eq!(B::download(dev, &buf).unwrap(), vec![2.0; 100]);
    });
}
