//! Teardown and timeout bounds of the per-rank `Comm`: drops beside a peer's work, the
//! timeouts `CommConfig` refuses, and how long a timed-out `synchronize()` takes.

use std::sync::{mpsc, Barrier};
use std::time::{Duration, Instant};

use peercomm::backend::Backend;
use peercomm::bootstrap::{Bootstrap, BootstrapError, UniqueId};
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, Error};

use super::Placement;

/// Builds rank `rank` of a world of 2 with `config`.
fn open<B: Backend>(place: &Placement, rank: usize, id: &UniqueId, config: CommConfig) -> Comm<B> {
    let dev = B::open(place.ordinal(rank)).unwrap();
    Comm::<B>::from_rank(dev, rank, 2, id, config).unwrap()
}

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
        let id = UniqueId::new().unwrap();
        let queued = Barrier::new(2);
        std::thread::scope(|s| {
            let (id, queued, config) = (&id, &queued, &config);
            let zero = s.spawn(move || {
                let comm = open::<B>(place, 0, id, config.clone());
                let dev = comm.device();
                let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
                comm.delay(Duration::from_millis(1500)).unwrap();
                let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                comm.all_reduce_sum_in_place_with(&mut buf, &opts).unwrap();
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
            });
            let one = s.spawn(move || {
                let comm = open::<B>(place, 1, id, config.clone());
                queued.wait();
                let started = Instant::now();
                // The stream wait apart from the rest of the teardown, to tell where
                // time goes if the bound is missed.
                let waited = comm.wait();
                let wait_took = started.elapsed();
                let closed = comm.close();
                let took = started.elapsed();
                eprintln!(
                    "round {round}: rank 1's wait returned {waited:?} after {wait_took:?}, \
                     its close {closed:?}"
                );
                took
            });
            zero.join().unwrap();
            let dropped = one.join().unwrap();
            eprintln!("round {round}: rank 1's drop took {dropped:?}");
            assert!(
                dropped < Duration::from_secs(3),
                "round {round}: rank 1's drop took {dropped:?}"
            );
        });
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
        let id = UniqueId::new().unwrap();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let done_rx = std::sync::Mutex::new(done_rx);
        let built = Barrier::new(2);
        let took: Vec<Duration> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..2)
                .map(|rank| {
                    let (id, config, built) = (&id, &config, &built);
                    let (done_tx, done_rx) = (done_tx.clone(), &done_rx);
                    s.spawn(move || {
                        let comm = open::<B>(place, rank, id, config.clone());
                        built.wait();
                        if rank != first {
                            // Holds on until the first rank's drop has returned (or 10 s).
                            let _ = done_rx
                                .lock()
                                .unwrap()
                                .recv_timeout(Duration::from_secs(10));
                        }
                        let started = Instant::now();
                        drop(comm);
                        let took = started.elapsed();
                        if rank == first {
                            done_tx.send(()).unwrap();
                        }
                        took
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        eprintln!("rank {first} dropped first: drops took {took:?}");
        for (rank, t) in took.iter().enumerate() {
            assert!(
                *t < Duration::from_secs(3),
                "rank {first} dropped first: rank {rank}'s drop took {t:?}"
            );
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
    check(
        Comm::<B>::from_rank(B::open(0).unwrap(), 0, 2, &id, bad.clone()),
        "from_rank",
    );
    assert!(started.elapsed() < Duration::from_millis(500));
    let _ = id.release();
    check(
        Comm::<B>::from_bootstrap(B::open(0).unwrap(), Box::new(Alone), bad.clone()),
        "from_bootstrap",
    );
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
    let id = UniqueId::new().unwrap();
    let seen = Barrier::new(2);
    let took = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|rank| {
                let (id, config, seen) = (&id, &config, &seen);
                s.spawn(move || {
                    let comm = open::<B>(place, rank, id, config.clone());
                    let dev = comm.device();
                    let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
                    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                    if rank == 1 {
                        comm.miss_next();
                    }
                    let started = Instant::now();
                    comm.all_reduce_sum_in_place_with(&mut buf, &opts).unwrap();
                    let result = comm.synchronize();
                    let took = started.elapsed();
                    seen.wait();
                    if rank == 0 {
                        assert!(
                            matches!(result, Err(Error::BarrierTimeout { rank: 0, .. })),
                            "rank 0: {result:?}"
                        );
                        Some(took)
                    } else {
                        None
                    }
                })
            })
            .collect();
        let took: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        took[0].unwrap()
    });
    eprintln!(
        "rank 0's synchronize reported the timeout after {took:?} (barrier_timeout {timeout:?})"
    );
    assert!(
        took >= timeout,
        "reported after {took:?}, before the timeout"
    );
    let bound = 2 * timeout + Duration::from_millis(1500);
    assert!(
        took <= bound,
        "reported after {took:?}, past 2 x barrier_timeout + 1.5 s"
    );
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
    /// Every kind.
    pub const ALL: [Exchange; 5] = [
        Exchange::Register,
        Exchange::AllocSymmetric,
        Exchange::TrimSymmetric,
        Exchange::RegisterInputsOf,
        Exchange::Reinitialize,
    ];

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
    matches!(
        e,
        Error::Bootstrap(BootstrapError::ExchangeMismatch { rank: r, .. }) if *r == rank
    )
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
    let id = UniqueId::new().unwrap();
    let built = Barrier::new(2);
    let (calling_tx, calling_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let (id, config, built) = (&id, &config, &built);
        let zero = s.spawn(move || {
            let comm = open::<B>(place, 0, id, config.clone());
            built.wait();
            calling_rx
                .recv_timeout(Duration::from_secs(10))
                .expect("rank 1 began its exchange");
            std::thread::sleep(Duration::from_millis(300));
            let started = Instant::now();
            let closed = comm.close();
            eprintln!("{what:?}: rank 0's close returned {closed:?}");
            (closed, started.elapsed())
        });
        let one = s.spawn(move || {
            let comm = open::<B>(place, 1, id, config.clone());
            let dev = comm.device();
            let mut buf = B::alloc_from(dev, &[1.0f32; 1000]).unwrap();
            built.wait();
            let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
            comm.all_reduce_sum_in_place_with(&mut buf, &opts).unwrap();
            let missing = if what == Exchange::Reinitialize {
                Some(comm.synchronize())
            } else {
                None
            };
            calling_tx.send(()).unwrap();
            let made = what.make(&comm);
            eprintln!("{what:?}: rank 1's exchange returned {made:?}");
            let missing = missing.unwrap_or_else(|| comm.synchronize());
            assert_eq!(B::download(dev, &buf).unwrap(), vec![1.0f32; 1000]);
            (made, missing)
        });
        let (closed, took) = zero.join().unwrap();
        let (made, missing) = one.join().unwrap();
        eprintln!(
            "{what:?}: rank 1's exchange: {made:?}\n  rank 1's synchronize: {missing:?}\n  \
             rank 0's close (took {took:?}): {closed:?}"
        );
        match &made {
            Err(e) if is_mismatch_naming(e, 0) => {}
            other => panic!("{what:?}: rank 1's exchange returned {other:?}"),
        }
        match &closed {
            Err(e) if is_mismatch_naming(e, 1) => {}
            other => panic!("{what:?}: rank 0's teardown returned {other:?} (not parked)"),
        }
        assert!(
            matches!(
                missing,
                Err(Error::BarrierTimeout { rank: 1, .. } | Error::PeerAborted { rank: 1, .. })
            ),
            "{what:?}: rank 1's synchronize returned {missing:?}"
        );
        assert!(
            took < Duration::from_secs(3),
            "{what:?}: close took {took:?}"
        );
    });
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
            .all_reduce_sum_in_place(&mut buf)
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
        match made {
            Err(e) if is_mismatch_naming(e, other) => {}
            other_result => panic!(
                "{kinds:?}: rank {rank} expected the mismatch naming rank {other}, got \
                 {other_result:?}"
            ),
        }
        // Nothing was allocated: the pool has no segment to free.
        assert_eq!(trimmed, &Ok(0), "{kinds:?}: rank {rank}");
        assert_eq!(
            summed.as_ref().ok(),
            Some(&vec![sum; 64]),
            "{kinds:?}: rank {rank}"
        );
        assert!(closed.is_ok(), "{kinds:?}: rank {rank}: {closed:?}");
    }
}
