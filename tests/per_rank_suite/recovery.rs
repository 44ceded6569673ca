//! What a rank does after an error, generic over the backend: the error a poisoned
//! communicator returns names the error that poisoned it.

use peercomm::backend::Backend;
use peercomm::{Algorithm, AllReduceOptions, Comm, Error, Result};

use super::trust::{run, short_waits};
use super::Placement;

/// A one-stage all-reduce of `n` ones, then `synchronize`.
fn sum_ones<B: Backend>(comm: &Comm<B>, n: usize) -> Result<()> {
    let dev = comm.device();
    let send = B::alloc_from(dev, &vec![1.0f32; n])?;
    let mut recv = B::alloc_from(dev, &vec![0.0f32; n])?;
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    comm.all_reduce_sum_with(&send, &mut recv, &one)?;
    comm.synchronize()
}

/// Rank 1 sums 500 elements where rank 0 sums 1000: both get `CallMismatch` from
/// `synchronize`; the next call on each is refused with an error that names that
/// mismatch (not a barrier timeout); after `reinitialize` a matching call works.
pub fn poisoned_names_its_cause<B: Backend>(place: &Placement) {
    let world = 2;
    let config = short_waits(place, world);
    let got = run::<B, _>(place, world, &config, |rank, comm, meet| {
        let first = sum_ones(comm, if rank == 0 { 1000 } else { 500 });
        let next = sum_ones(comm, 300);
        meet.wait();
        comm.reinitialize().unwrap();
        sum_ones(comm, 300).unwrap();
        (first, next)
    });
    for (rank, (first, next)) in got.into_iter().enumerate() {
        let first = first.expect_err("a mismatched call");
        assert!(
            matches!(first, Error::CallMismatch { .. }),
            "rank {rank}: {first}"
        );
        let next = next.expect_err("a call on a poisoned communicator");
        let text = next.to_string();
        eprintln!("rank {rank}: {text}");
        assert!(
            text.contains(&first.to_string()),
            "rank {rank}: the poisoned error does not name its cause ({first}): {text}"
        );
        assert!(!text.contains("barrier timeout"), "rank {rank}: {text}");
        match next {
            Error::Poisoned { first: cause } => assert_eq!(*cause, first, "rank {rank}"),
            other => panic!("rank {rank}: expected Poisoned, got {other:?}"),
        }
    }
}
