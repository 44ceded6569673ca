//! Teardown and timeout bounds of the per-rank `Comm`: drops beside a peer's work, the
//! timeouts `CommConfig` refuses, and how long a timed-out `synchronize()` takes.

use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::{Bootstrap, BootstrapError, UniqueId};
use peercomm::{Algorithm, AllReduceOptions, Comm, Error, ReduceOp};

use super::{world_threads, Placement};

/// Rank 0's all-reduce, queued behind 1.5 s, times out and writes into rank 1's signal
/// at about 2.5 s, after rank 1 began dropping: rank 0 gets its typed error, rank 1's
/// drop returns in bound, no crash (64 MiB payload: a freed signal would fault).
pub fn drop_while_peer_collective_queued<B: Backend>(place: &Placement, rounds: usize) {
    let config = place
        .config(2)
        .with_barrier_timeout(Some(Duration::from_secs(1)))
        .with_bootstrap_timeout(Duration::from_secs(2))
        .with_payload_bytes(64 << 20);
    for round in 0..rounds {
        let took = world_threads::<B, _>(place, 2, &config, &|_| {}, |rank, comm, queued| {
            if rank == 0 {
                let dev = comm.device();
                let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
                comm.delay(Duration::from_millis(1500)).unwrap();
                let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
                    .unwrap();
                queued.wait();
                let err = comm.synchronize().unwrap_err();
                assert!(
                    matches!(
                        err,
                        Error::BarrierTimeout { rank: 0, .. } | Error::PeerAborted { rank: 0, .. }
                    ),
                    "round {round}: rank 0 got {err:?}"
                );
                assert_eq!(B::download(dev, &buf).unwrap(), vec![1.0f32; 1000]);
                return Duration::ZERO;
            }
            queued.wait();
            let started = Instant::now();
            // The stream wait apart from the rest of the teardown, to tell where time
            // goes if the bound is missed.
            let waited = comm.wait();
            let wait_took = started.elapsed();
            let closed = comm.close();
            eprintln!(
                "round {round}: rank 1's wait: {waited:?} after {wait_took:?}, close {closed:?}"
            );
            started.elapsed()
        });
        let dropped = took[1];
        eprintln!("round {round}: rank 1's drop took {dropped:?}");
        let bound = Duration::from_secs(3);
        let holds = dropped < bound;
        assert!(holds, "round {round}: rank 1's drop took {dropped:?}");
    }
}

/// A rank drops while its peer holds on: both drops return within about a second, not
/// the bootstrap timeout, in both orders.
pub fn drop_returns_while_peer_holds_on<B: Backend>(place: &Placement) {
    let config = place
        .config(2)
        .with_barrier_timeout(Some(Duration::from_secs(1)))
        .with_bootstrap_timeout(Duration::from_secs(30));
    for first in 0..2 {
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let done = (Mutex::new(done_tx), Mutex::new(done_rx));
        let took = world_threads::<B, _>(place, 2, &config, &|_| {}, |rank, comm, built| {
            built.wait();
            if rank != first {
                // Holds on until the first rank's drop has returned (or 10 s).
                let _ = done.1.lock().unwrap().recv_timeout(Duration::from_secs(10));
            }
            let started = Instant::now();
            drop(comm);
            let took = started.elapsed();
            if rank == first {
                done.0.lock().unwrap().send(()).unwrap();
            }
            took
        });
        eprintln!("rank {first} dropped first: drops took {took:?}");
        for (rank, t) in took.iter().enumerate() {
            let what = format!("rank {first} dropped first: rank {rank}'s drop took {t:?}");
            assert!(*t < Duration::from_secs(3), "{what}");
        }
    }
}

/// A bootstrap over one rank, for `Comm::from_bootstrap`.
struct Alone;

impl Bootstrap for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        Ok(vec![mine.to_vec()])
    }
}

/// `bootstrap_timeout` below `barrier_timeout` is `InvalidConfig` from both entry
/// points before any contact; equal and `None` are accepted.
pub fn refuses_bootstrap_timeout_below_barrier_timeout<B: Backend>(place: &Placement) {
    let bad = place
        .config(2)
        .with_barrier_timeout(Some(Duration::from_secs(3)))
        .with_bootstrap_timeout(Duration::from_secs(1));
    let check = |result: peercomm::Result<Comm<B>>, how: &str| match result {
        Err(Error::InvalidConfig(msg)) => {
            for field in [
                "CommConfig::bootstrap_timeout",
                "CommConfig::barrier_timeout",
            ] {
                assert!(msg.contains(field), "{how}: {msg:?} does not name {field}");
            }
            eprintln!("{how}: {msg}");
        }
        Err(e) => panic!("{how}: expected InvalidConfig, got {e:?}"),
        Ok(_) => panic!("{how}: a 1 s bootstrap timeout under a 3 s barrier timeout was accepted"),
    };
    let id = UniqueId::new().unwrap();
    let started = Instant::now();
    // A world of 2 whose peer never comes: refused before waiting for it.
    let dev = || B::open(0).unwrap();
    let made = Comm::<B>::from_rank(dev(), 0, 2, &id, bad.clone());
    check(made, "from_rank");
    assert!(started.elapsed() < Duration::from_millis(500));
    let _ = id.release();
    let alone = Comm::<B>::from_bootstrap(dev(), Box::new(Alone), bad.clone());
    check(alone, "from_bootstrap");

    for (what, barrier_timeout) in [
        ("equal timeouts", Some(bad.bootstrap_timeout)),
        ("no barrier timeout", None),
    ] {
        let ok = bad.clone().with_barrier_timeout(barrier_timeout);
        Comm::<B>::from_bootstrap(B::open(0).unwrap(), Box::new(Alone), ok)
            .unwrap_or_else(|e| panic!("{what}: refused: {e}"));
    }
}

/// After `miss_next`, rank 0's `synchronize()` reports `BarrierTimeout` within
/// [timeout, 2 x timeout] (plus 1.5 s slack), the bound the docs state.
pub fn synchronize_reports_within_twice_barrier_timeout<B: Backend>(place: &Placement) {
    let timeout = Duration::from_secs(1);
    let config = place
        .config(2)
        .with_barrier_timeout(Some(timeout))
        .with_bootstrap_timeout(Duration::from_secs(30));
    let took = world_threads::<B, _>(place, 2, &config, &|_| {}, |rank, comm, seen| {
        let dev = comm.device();
        let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        if rank == 1 {
            comm.miss_next();
        }
        let started = Instant::now();
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
            .unwrap();
        let result = comm.synchronize();
        let took = started.elapsed();
        seen.wait();
        if rank == 0 {
            let timed_out = matches!(result, Err(Error::BarrierTimeout { rank: 0, .. }));
            assert!(timed_out, "rank 0: {result:?}");
        }
        took
    })[0];
    eprintln!("rank 0's synchronize: the timeout after {took:?} (barrier_timeout {timeout:?})");

    let holds = took >= timeout;
    assert!(holds, "reported after {took:?}, before the timeout");
    let bound = 2 * timeout + Duration::from_millis(1500);
    assert!(took <= bound, "{took:?}: past 2 x barrier_timeout + 1.5 s");
}

/// A collective host-side exchange of the per-rank `Comm`: what a live rank makes
/// while its peer drops, or while its peers make another one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// `Comm::register` of a small buffer.
    Register,
    /// `Comm::alloc_symmetric` of a small buffer.
    AllocSymmetric,
    /// `Comm::trim_symmetric`.
    TrimSymmetric,
    /// `Comm::register_inputs_of` of a pass that makes no call.
    RegisterInputsOf,
    /// `Comm::reinitialize`.
    Reinitialize,
}

impl Exchange {
    /// Makes this exchange on `comm` (what it made is dropped at once).
    fn make<B: Backend>(self, comm: &Comm<B>) -> peercomm::Result<()> {
        match self {
            Exchange::Register => {
                let buf = B::alloc_buffer::<f32>(comm.device(), 256)?;
                comm.register(buf).map(drop).map_err(|e| e.error)
            }
            Exchange::AllocSymmetric => comm.alloc_symmetric::<f32>(256).map(drop),
            Exchange::TrimSymmetric => comm.trim_symmetric().map(drop),
            Exchange::RegisterInputsOf => comm.register_inputs_of(|| Ok(())).map(drop),
            Exchange::Reinitialize => comm.reinitialize(),
        }
    }
}

/// Whether `e` is the bootstrap's typed exchange mismatch naming `rank`.
fn is_mismatch_naming(e: &Error, rank: usize) -> bool {
    matches!(e, Error::Bootstrap(BootstrapError::ExchangeMismatch { rank: r, .. }) if *r == rank)
}

/// Rank 0 closes 300 ms into rank 1's exchange `what` (after a call rank 0 never
/// makes): both get the typed mismatch, rank 0's memory is parked, not freed, so rank
/// 1's late kernel writes into mapped memory; rank 1 sees a timeout or abort.
pub fn drop_beside_a_peer_exchange<B: Backend>(place: &Placement, what: Exchange) {
    let config = place
        .config(2)
        .with_barrier_timeout(Some(Duration::from_secs(1)))
        .with_bootstrap_timeout(Duration::from_secs(3))
        .with_payload_bytes(64 << 20);
    let (calling_tx, calling_rx) = mpsc::channel::<()>();
    let calling = (Mutex::new(calling_tx), Mutex::new(calling_rx));
    // Rank 0: its close and how long it took; rank 1: its exchange and synchronize.
    let got = world_threads::<B, _>(place, 2, &config, &|_| {}, |rank, comm, built| {
        if rank == 0 {
            built.wait();
            let began = calling
                .1
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10));
            began.expect("rank 1 began its exchange");
            std::thread::sleep(Duration::from_millis(300));
            let started = Instant::now();
            let closed = comm.close();
            eprintln!("{what:?}: rank 0's close returned {closed:?}");
            return (closed, Ok(started.elapsed()));
        }
        let dev = comm.device();
        let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
        built.wait();
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &opts)
            .unwrap();
        let missing = (what == Exchange::Reinitialize).then(|| comm.synchronize());
        calling.0.lock().unwrap().send(()).unwrap();
        let made = what.make(&comm);
        eprintln!("{what:?}: rank 1's exchange returned {made:?}");
        let missing = missing.unwrap_or_else(|| comm.synchronize());
        assert_eq!(B::download(dev, &buf).unwrap(), vec![1.0f32; 1000]);
        (made, missing.map(|()| Duration::ZERO))
    });
    let [(closed, took), (made, missing)] = [&got[0], &got[1]];
    let took = took.as_ref().unwrap();
    eprintln!(
        "{what:?}: rank 1's exchange: {made:?}\n  rank 1's synchronize: {missing:?}\n  \
         rank 0's close (took {took:?}): {closed:?}"
    );
    let mismatch =
        |r: &peercomm::Result<()>, rank| r.as_ref().is_err_and(|e| is_mismatch_naming(e, rank));
    let holds = mismatch(made, 0);
    assert!(holds, "{what:?}: rank 1's exchange returned {made:?}");
    let holds = mismatch(closed, 1);
    assert!(holds, "{what:?}: rank 0's close: {closed:?} (not parked)");

    let holds = matches!(
        missing,
        Err(Error::BarrierTimeout { rank: 1, .. } | Error::PeerAborted { rank: 1, .. })
    );
    assert!(holds, "{what:?}: rank 1's synchronize returned {missing:?}");
    let holds = *took < Duration::from_secs(3);
    assert!(holds, "{what:?}: close took {took:?}");
}

/// Different exchanges at once (`kinds[r]`): each rank gets the mismatch naming the
/// first rank that differs; all stay in step for the next exchange, call and teardown.
pub fn different_exchanges_are_typed_errors<B: Backend>(place: &Placement, kinds: &[Exchange]) {
    let world = kinds.len();
    let config = place
        .config(world)
        .with_barrier_timeout(Some(Duration::from_secs(1)))
        .with_bootstrap_timeout(Duration::from_secs(3));
    let outcomes = super::with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let made = kinds[rank].make(&comm);
        eprintln!("rank {rank}: {:?} returned {made:?}", kinds[rank]);
        let trimmed = comm.trim_symmetric();
        eprintln!("rank {rank}: then trim_symmetric returned {trimmed:?}");
        let dev = comm.device();
        let mut buf = B::alloc_from(dev, &[rank as f32 + 1.0; 64]).unwrap();
        let summed = comm
            .all_reduce_in_place(&mut buf, &ReduceOp::Sum)
            .and_then(|_| comm.synchronize())
            .and_then(|_| B::download(dev, &buf));
        (made, trimmed, summed, comm.close())
    });
    let sum = (1..=world).sum::<usize>() as f32;
    for (rank, (made, trimmed, summed, closed)) in outcomes.iter().enumerate() {
        eprintln!(
            "{kinds:?}: rank {rank}: {made:?}; then trim {trimmed:?}, all-reduce ok: {}, \
             close {closed:?}",
            summed.is_ok()
        );
        let other = (0..world)
            .find(|&r| kinds[r] != kinds[rank])
            .expect("the kinds differ");
        let named = made.as_ref().is_err_and(|e| is_mismatch_naming(e, other));
        let what = format!("{kinds:?}: rank {rank}: not the mismatch naming {other}");
        assert!(named, "{what}: {made:?}");

        // Nothing was allocated: the pool has no segment to free.
        assert_eq!(trimmed, &Ok(0), "{kinds:?}: rank {rank}");
        let note = format!("{kinds:?}: rank {rank}");
        assert_eq!(summed.as_ref().ok(), Some(&vec![sum; 64]), "{note}");
        assert!(closed.is_ok(), "{kinds:?}: rank {rank}: {closed:?}");
    }
}
