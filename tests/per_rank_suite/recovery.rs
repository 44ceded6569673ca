//! After an error: a poisoned communicator names what poisoned it, bootstrap hints,
//! skipped calls, the `check_errors` poll, and each error's `recovery()`.

use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::{BootstrapError, UniqueId};
use peercomm::{Algorithm, AllReduceOptions, Comm, Error, Recovery, ReduceOp, Result};

use super::agreement::short_waits;
use super::{in_step, Placement};

/// A one-stage all-reduce of `n` ones, then `synchronize`.
fn sum_ones<B: Backend>(comm: &Comm<B>, n: usize) -> Result<()> {
    let dev = comm.device();
    let send = B::alloc_from(dev, &vec![1.0f32; n])?;
    let mut recv = B::alloc_from(dev, &vec![0.0f32; n])?;
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &one)?;
    comm.synchronize()
}

/// Lengths 500 against 1000: `CallMismatch` on both; the next call's error names that
/// mismatch; `reinitialize` recovers.
pub fn poisoned_names_its_cause<B: Backend>(place: &Placement) {
    let world = 2;
    let config = short_waits(place, world);
    let got = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let first = sum_ones(comm, if rank == 0 { 1000 } else { 500 });
        let next = sum_ones(comm, 300);
        meet.wait();
        comm.reinitialize().unwrap();
        sum_ones(comm, 300).unwrap();
        (first, next)
    });
    for (rank, (first, next)) in got.into_iter().enumerate() {
        let first = first.expect_err("a mismatched call");
        let holds = matches!(first, Error::CallMismatch { .. });
        assert!(holds, "rank {rank}: {first}");
        let next = next.expect_err("a call on a poisoned communicator");
        let text = next.to_string();
        eprintln!("rank {rank}: {text}");
        assert!(
            text.contains(&first.to_string()),
            "rank {rank}: the poisoned error does not name its cause ({first}): {text}"
        );
        assert!(!text.contains("barrier timeout"), "rank {rank}: {text}");
        assert_eq!(first.recovery(), Recovery::Reinitialize, "rank {rank}");
        assert_eq!(next.recovery(), Recovery::Reinitialize, "rank {rank}");
        let Error::Poisoned { first: cause } = next else {
            panic!("rank {rank}: expected Poisoned, got {next:?}");
        };
        assert_eq!(*cause, first, "rank {rank}");
    }
}

/// Rank 0 never joins while the id's maker holds its listener: `Comm::from_rank` fails
/// within `bootstrap_timeout` naming rank 0, hinting `UniqueId::release`, not `connect`.
pub fn a_leaf_without_rank_zero_names_real_functions<B: Backend>(place: &Placement) {
    let id = UniqueId::new().unwrap();
    let timeout = Duration::from_secs(2);
    let config = short_waits(place, 2).with_bootstrap_timeout(timeout);
    let start = Instant::now();
    let got = Comm::<B>::from_rank(B::open(place.ordinal(1)).unwrap(), 1, 2, &id, config);
    let took = start.elapsed();
    id.release();
    let e = got.expect_err("no rank 0");
    eprintln!("after {took:?}: {e}");
    let Error::Bootstrap(BootstrapError::Timeout { waiting_for, .. }) = &e else {
        panic!("expected a bootstrap timeout, got {e:?}");
    };
    assert_eq!(waiting_for, &[0]);
    assert!(
        took < timeout + Duration::from_secs(1),
        "waited {took:?} with a bootstrap_timeout of {timeout:?}"
    );
    let text = e.to_string();
    for name in "Comm::from_rank UniqueId::release CommConfig::bootstrap_timeout".split(' ') {
        assert!(text.contains(name), "the hint does not name {name}: {text}");
    }
    assert!(!text.contains("called connect"), "{text}");
    assert_eq!(e.recovery(), Recovery::Rebuild);
}

/// A skipped call: rank 1 makes two of rank 0's three calls and gets `Ok`; rank 0's
/// third times out naming rank 1, and rank 1's next call is never `Ok`.
pub fn a_skipped_call_is_caught_where_it_is_awaited<B: Backend>(place: &Placement) {
    let world = 2;
    let config = short_waits(place, world);
    let got = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let calls = if rank == 0 { 3 } else { 2 };
        let made: Vec<Result<()>> = (0..calls).map(|_| sum_ones(comm, 256)).collect();
        meet.wait();
        // After rank 0's wait gave up: rank 1's next call.
        let next = (rank == 1).then(|| sum_ones(comm, 256));
        meet.wait();
        comm.reinitialize().unwrap();
        sum_ones(comm, 256).unwrap();
        (made, next)
    });
    let (zero, _) = &got[0];
    assert!(zero[..2].iter().all(Result::is_ok), "rank 0: {zero:?}");
    match &zero[2] {
        Err(Error::BarrierTimeout {
            rank: 0,
            waiting_for: Some(1),
            ..
        }) => {}
        other => panic!("rank 0's third call: expected a timeout naming rank 1, got {other:?}"),
    }
    let recovery = zero[2].as_ref().unwrap_err().recovery();
    assert_eq!(recovery, Recovery::Reinitialize);
    let (one, next) = &got[1];
    assert!(one.iter().all(Result::is_ok), "rank 1: {one:?}");
    let next = next.as_ref().unwrap();
    eprintln!("rank 1's next call: {next:?}");
    let recovery = next.as_ref().map_err(Error::recovery);
    assert_eq!(recovery, Err(Recovery::Reinitialize), "rank 1's next call");
}

/// The per-step pattern: `check_errors()` returns at once behind a 500 ms kernel, and
/// reports a `CallMismatch` within a few steps without `synchronize`; its recovery is
/// `Reinitialize`, after which the ranks go on.
pub fn check_errors_is_a_per_step_poll<B: Backend>(place: &Placement) {
    let world = 2;
    let config = short_waits(place, world);
    let got = in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        // Not waiting: a queued 500 ms kernel does not delay it.
        comm.delay(Duration::from_millis(500)).unwrap();
        let start = Instant::now();
        assert_eq!(comm.check_errors(), Ok(()), "rank {rank}");
        let polled = start.elapsed();
        let holds = polled < Duration::from_millis(200);
        assert!(holds, "check_errors took {polled:?}");
        comm.synchronize().unwrap();
        meet.wait();

        let dev = comm.device();
        let long = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
        let short = B::alloc_from(dev, &[1.0f32; 500]).unwrap();
        let mut out = B::alloc_from(dev, &[0.0f32; 1000]).unwrap();
        let mut out_short = B::alloc_from(dev, &[0.0f32; 500]).unwrap();
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = None;
        for step in 0..2000 {
            let enqueued = if rank == 1 && step == 2 {
                comm.all_reduce_with(&short, &mut out_short, &ReduceOp::Sum, &one)
            } else {
                comm.all_reduce_with(&long, &mut out, &ReduceOp::Sum, &one)
            };
            let polled = enqueued.and_then(|_| comm.check_errors());
            if let Err(e) = polled {
                seen = Some((step, e));
                break;
            }
            let holds = Instant::now() < deadline;
            assert!(holds, "rank {rank}: no error by step {step}");
            // The engine's own work between steps.
            std::thread::sleep(Duration::from_millis(2));
        }
        meet.wait();
        comm.reinitialize().unwrap();
        sum_ones(comm, 300).unwrap();
        seen
    });
    for (rank, seen) in got.into_iter().enumerate() {
        let (step, e) = seen.unwrap_or_else(|| panic!("rank {rank} saw no error"));
        eprintln!("rank {rank}: step {step}: {e}");
        assert!(step >= 2, "rank {rank}: an error at step {step}: {e}");
        let holds = matches!(e, Error::CallMismatch { .. });
        assert!(holds, "rank {rank}: {e:?}");
        assert_eq!(e.recovery(), Recovery::Reinitialize, "rank {rank}");
    }
}
