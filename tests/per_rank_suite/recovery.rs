//! What a rank does after an error, generic over the backend: the error a poisoned
//! communicator returns names the error that poisoned it; a bootstrap timeout's hint
//! names functions the caller has.

use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::{BootstrapError, UniqueId};
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, Error, Result};

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

/// A leaf whose rank 0 never joins, the id's maker (this process, standing for a
/// launcher) holding the id's listener because it never called `UniqueId::release`:
/// `Comm::from_rank` fails within `bootstrap_timeout` (+1 s), naming rank 0, and the
/// hint names functions the caller has (`Comm::from_rank`, `UniqueId::release`), not
/// a `connect` they never call.
pub fn a_leaf_without_rank_zero_names_real_functions<B: Backend>(place: &Placement) {
    let id = UniqueId::new().unwrap();
    let timeout = Duration::from_secs(2);
    let config = CommConfig {
        bootstrap_timeout: timeout,
        ..short_waits(place, 2)
    };
    let start = Instant::now();
    let got = Comm::<B>::from_rank(B::open(place.ordinal(1)).unwrap(), 1, 2, &id, config);
    let took = start.elapsed();
    id.release();
    let e = got.err().expect("no rank 0");
    eprintln!("after {took:?}: {e}");
    match &e {
        Error::Bootstrap(BootstrapError::Timeout { waiting_for, .. }) => {
            assert_eq!(waiting_for, &[0])
        }
        other => panic!("expected a bootstrap timeout, got {other:?}"),
    }
    assert!(
        took < timeout + Duration::from_secs(1),
        "waited {took:?} with a bootstrap_timeout of {timeout:?}"
    );
    let text = e.to_string();
    for name in [
        "Comm::from_rank",
        "UniqueId::release",
        "CommConfig::bootstrap_timeout",
    ] {
        assert!(text.contains(name), "the hint does not name {name}: {text}");
    }
    assert!(!text.contains("called connect"), "{text}");
}
