//! Successful all-gathers and barriers.

use super::*;
use std::sync::{Arc, Barrier, Mutex};

#[test]
fn worlds_gather_in_rank_order() {
    for world in [1, 2, 3, 8] {
        let id = loopback_id();
        let host = |r: usize| HostId::new(format!("host-{}", r / 2));
        let bytes = |r: usize| format!("rank {r} of {world}").into_bytes();
        let got = run(&(0..world).collect::<Vec<_>>(), |r| {
            let b = TcpBootstrap::connect_with_host(&id, r, world, LONG, host(r)).unwrap();
            assert_eq!((b.rank(), b.world_size()), (r, world));
            (b.all_gather(&bytes(r)).unwrap(), b.host_ids().to_vec())
        });
        let want = (
            (0..world).map(bytes).collect(),
            (0..world).map(host).collect(),
        );
        assert_eq!(got, vec![want; world]);
    }
}

#[test]
fn consecutive_all_gathers_of_different_lengths() {
    let id = loopback_id();
    let world = 4;
    let payload = |r: usize, round: usize| -> Vec<u8> {
        let len = match (r + round) % 4 {
            0 => 0,
            1 => 1,
            2 => 1000 + r,
            _ => (1 << 20) + 3 * r, // over the 64 KiB single-write path
        };
        (0..len).map(|i| (i * 31 + r * 7 + round) as u8).collect()
    };
    let rounds = 6;
    let got = run(&(0..world).collect::<Vec<_>>(), |r| {
        let b = connect(&id, r, world, LONG).unwrap();
        let mut seen = Vec::new();
        for round in 0..rounds {
            seen.push(b.all_gather(&payload(r, round)).unwrap());
            b.barrier().unwrap();
        }
        seen
    });
    for seen in got {
        for (round, all) in seen.into_iter().enumerate() {
            let want: Vec<_> = (0..world).map(|r| payload(r, round)).collect();
            assert_eq!(all, want, "round {round}");
        }
    }
}

#[test]
fn world_of_one_needs_no_network() {
    // An id made elsewhere, naming a port nobody listens on.
    let id = UniqueId {
        addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 1)),
        secret: [7; SECRET_BYTES],
    };
    let b = connect(&id, 0, 1, SHORT).unwrap();
    assert_eq!(b.all_gather(b"alone").unwrap(), vec![b"alone".to_vec()]);
    b.barrier().unwrap();
    assert_eq!(b.host_ids(), &[host_identity()]);
    // An id made here: rank 0 takes (and closes) its listener.
    let id = loopback_id();
    let b: Box<dyn Bootstrap> = Box::new(connect(&id, 0, 1, SHORT).unwrap());
    b.barrier().unwrap();
    assert_is!(connect(&id, 0, 1, SHORT), Err(BootstrapError::StaleId));
}

#[test]
fn bootstrap_is_shareable_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TcpBootstrap>();
    send_sync::<Box<dyn Bootstrap>>();
    // An Arc'd bootstrap serves wherever a Bootstrap is asked for.
    fn gather_all(b: impl Bootstrap) -> Vec<Vec<u8>> {
        b.all_gather(&[b.rank() as u8]).unwrap()
    }
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        let b: Arc<dyn Bootstrap> = Arc::new(connect(&id, r, 2, LONG).unwrap());
        let by_ref = gather_all(&*b);
        assert_eq!(gather_all(b.clone()), by_ref);
        by_ref
    });
    assert_eq!(got, vec![vec![vec![0], vec![1]]; 2]);
}

/// An engine's own store: the trait needs only `all_gather`; `barrier` and
/// `barrier_within` come free.
#[test]
fn a_custom_store_gets_a_barrier() {
    struct Store(Mutex<usize>);
    impl Bootstrap for Store {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
            *self.0.lock().unwrap() += 1;
            let message = "store unreachable".into();
            match mine {
                b"fail" => Err(BootstrapError::Store { message }),
                _ => Ok(vec![mine.to_vec()]),
            }
        }
    }
    let store = Store(Mutex::new(0));
    store.barrier().unwrap();
    assert_eq!(*store.0.lock().unwrap(), 1);
    // The default barrier_within is that barrier.
    store.barrier_within(Duration::from_millis(1)).unwrap();
    assert_eq!(*store.0.lock().unwrap(), 2);
    let e = store.all_gather(b"fail").unwrap_err();
    assert!(e.to_string().contains("store unreachable"));
}

/// `barrier_within` and `all_gather_within` (for teardown): give up by their own timeout
/// when a peer never comes, at once when a peer is gone, and leave the configured
/// timeout as it was.
#[test]
fn barrier_within_is_bounded_and_leaves_the_timeout_alone() {
    let t = Duration::from_secs(1);
    // Both ranks come: it succeeds, and later calls keep the configured timeout (a rank
    // late by more than the barrier's timeout is still waited for).
    let id = loopback_id();
    run(&[0, 1], |r| {
        let b = connect(&id, r, 2, LONG).unwrap();
        b.barrier_within(SHORT).unwrap();
        assert_eq!(b.timeout(), LONG);
        // The bounded all-gather under it carries bytes.
        let within = b.all_gather_within(&[r as u8, 7], SHORT).unwrap();
        assert_eq!(within, vec![vec![0, 7], vec![1, 7]]);
        assert_eq!(b.timeout(), LONG);
        if r == 1 {
            thread::sleep(SHORT * 2);
        }
        assert_eq!(b.all_gather(&[r as u8]).unwrap(), vec![vec![0], vec![1]]);
    });
    // A peer alive that never calls it: the waiter gives up by the timeout (through a
    // trait object, which must reach the bounded version, not the default). A peer gone:
    // it fails at once, not after its (long) timeout.
    use BootstrapError::{ConnectionClosed, PeerFailed, Timeout};
    for (waiter, gone) in [(0, false), (1, false), (0, true), (1, true)] {
        let id = loopback_id();
        let gate = Barrier::new(2);
        let got = run(&[0, 1], |r| {
            let b: Box<dyn Bootstrap> = Box::new(connect(&id, r, 2, LONG).unwrap());
            if r != waiter {
                if gone {
                    drop(b);
                }
                gate.wait(); // gone before the waiter starts; else alive until it gave up
                return None;
            }
            if gone {
                gate.wait();
            }
            let start = Instant::now();
            let e = b.barrier_within(if gone { LONG } else { t }).unwrap_err();
            if !gone {
                gate.wait();
            }
            Some((e, start.elapsed()))
        });
        let (e, took) = got[waiter].clone().unwrap();
        if gone {
            assert_is!(e, ConnectionClosed { .. } | PeerFailed { .. });
            assert!(took < SLACK, "rank {waiter}, peer gone: took {took:?}");
        } else {
            assert_is!(e, Timeout { waiting_for, after, .. }
                if waiting_for == &[1 - waiter] && *after == t);
            let bounded = took >= t && took <= t.mul_f64(1.5);
            assert!(bounded, "rank {waiter}, peer absent: took {took:?}");
        }
    }
    // A world of one has nobody to wait for.
    let alone = connect(&loopback_id(), 0, 1, SHORT).unwrap();
    alone.barrier_within(Duration::ZERO).unwrap();
}
