//! Fault injection through the per-rank API (feature `fault-injection`, on in tests):
//! one rank's `miss_next()` makes it skip a collective its peer makes.

use std::time::{Duration, Instant};

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, Error, ReduceOp};

use super::{common, Placement};

/// Rank 1 misses one all-reduce: rank 0 sees the timeout by `check_errors()`, rank 1
/// holds rank 0's abort, nothing written; after `reinitialize()` the next call is right.
pub fn miss_next_times_out_and_recovers<B: Backend>(place: &Placement) {
    let timeout = Duration::from_millis(400);
    let cfg = place.config(2).with_barrier_timeout(Some(timeout));
    let mut rng = common::rng("miss_next_times_out_and_recovers");
    let first = common::random_inputs::<f32>(&mut rng, 2, 1000);
    let second = common::random_inputs::<f32>(&mut rng, 2, 1000);
    super::in_step::<B, _>(place, 2, &cfg, |rank, comm, seen| {
        let dev = comm.device();
        let mut buf = B::alloc_from(dev, &first[rank]).unwrap();
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        if rank == 1 {
            comm.miss_next();
        }
        let started = Instant::now();
        let ran = comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts);
        assert_eq!(ran, Ok(Algorithm::OneStage));
        if rank == 0 {
            let err = super::first_error(comm, started + 10 * timeout);
            let holds = matches!(err, Error::BarrierTimeout { rank: 0, .. });
            assert!(holds, "{err:?}");
            assert!(started.elapsed() >= timeout);
            assert!(comm.is_poisoned());
            comm.wait().unwrap();
        } else {
            comm.wait().unwrap();
        }
        seen.wait();
        if rank == 1 {
            match comm.synchronize() {
                Err(Error::PeerAborted { rank: 1, by: 0, .. }) => {}
                other => panic!("rank 1: expected PeerAborted, got {other:?}"),
            }
        }
        let note = format!("rank {rank} was written");
        assert_eq!(buf.to_host(dev).unwrap(), first[rank], "{note}");
        comm.reinitialize().unwrap();
        buf.copy_from_host(dev, &second[rank]).unwrap();
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
        let (got, what) = (buf.to_host(dev).unwrap(), format!("rank {rank} recovered"));

        common::check_sums(&second, &[got.clone(), got], 2, &what);
    });
}
