//! Successful all-gathers and barriers.

use super::*;
use std::sync::{Barrier, Mutex};

#[test]
fn worlds_gather_in_rank_order() {
    for world in [1, 2, 3, 8] {
        let id = loopback_id();
        let got = run(&(0..world).collect::<Vec<_>>(), |r| {
            let host = HostId::new(format!("host-{}", r / 2));
            let b = TcpBootstrap::connect_with_host(&id, r, world, LONG, host).unwrap();
            assert_eq!((b.rank(), b.world_size()), (r, world));
            let all = b
                .all_gather(format!("rank {r} of {world}").as_bytes())
                .unwrap();
            (all, b.host_ids().to_vec())
        });
        let want: Vec<Vec<u8>> = (0..world)
            .map(|r| format!("rank {r} of {world}").into_bytes())
            .collect();
        let hosts: Vec<HostId> = (0..world)
            .map(|r| HostId::new(format!("host-{}", r / 2)))
            .collect();
        for (all, h) in got {
            assert_eq!(all, want);
            assert_eq!(h, hosts);
        }
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
    assert_eq!(
        connect(&id, 0, 1, SHORT).unwrap_err(),
        BootstrapError::StaleId
    );
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
        let b: std::sync::Arc<dyn Bootstrap> =
            std::sync::Arc::new(connect(&id, r, 2, LONG).unwrap());
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
            if mine == b"fail" {
                return Err(BootstrapError::Store {
                    message: "store unreachable".into(),
                });
            }
            Ok(vec![mine.to_vec()])
        }
    }
    let store = Store(Mutex::new(0));
    store.barrier().unwrap();
    assert_eq!(*store.0.lock().unwrap(), 1);
    // The default barrier_within is that barrier.
    store.barrier_within(Duration::from_millis(1)).unwrap();
    assert_eq!(*store.0.lock().unwrap(), 2);
    assert!(store
        .all_gather(b"fail")
        .unwrap_err()
        .to_string()
        .contains("store unreachable"));
}

/// `barrier_within` and `all_gather_within` (for teardown): give up by their own timeout
/// when a peer never comes, at once when a peer is gone, and leave the configured
/// timeout as it was.
#[test]
fn barrier_within_is_bounded_and_leaves_the_timeout_alone() {
    let t = Duration::from_secs(1);
    let within = |what: &str, took: Duration, t: Duration| {
        assert!(
            took <= t.mul_f64(1.5),
            "{what}: took {took:?} for a {t:?} barrier"
        );
    };
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
    // A peer that is alive but never calls it: each side gives up by the timeout (through
    // a trait object, which must reach the bounded version, not the default).
    for waiter in [0, 1] {
        let id = loopback_id();
        let gate = Barrier::new(2);
        let got = run(&[0, 1], |r| {
            let b: Box<dyn Bootstrap> = Box::new(connect(&id, r, 2, LONG).unwrap());
            let out = if r == waiter {
                let start = Instant::now();
                let e = b.barrier_within(t).unwrap_err();
                Some((e, start.elapsed()))
            } else {
                None
            };
            gate.wait(); // the other rank stays until the waiter has given up
            out
        });
        let (e, took) = got[waiter].clone().unwrap();
        assert!(
            matches!(&e, BootstrapError::Timeout { waiting_for, after, .. }
                if waiting_for == &[1 - waiter] && *after == t),
            "rank {waiter}: {e}"
        );
        assert!(took >= t, "rank {waiter} gave up early: {took:?}");
        within(&format!("rank {waiter}, peer absent"), took, t);
    }
    // A peer that is gone: it fails at once, not after its (long) timeout.
    for waiter in [0, 1] {
        let id = loopback_id();
        let gate = Barrier::new(2);
        let got = run(&[0, 1], |r| {
            let b = connect(&id, r, 2, LONG).unwrap();
            if r != waiter {
                drop(b);
                gate.wait();
                return None;
            }
            gate.wait();
            let start = Instant::now();
            let e = b.barrier_within(LONG).unwrap_err();
            Some((e, start.elapsed()))
        });
        let (e, took) = got[waiter].clone().unwrap();
        assert!(
            matches!(
                e,
                BootstrapError::ConnectionClosed { .. } | BootstrapError::PeerFailed { .. }
            ),
            "rank {waiter}: {e}"
        );
        assert!(took < SLACK, "rank {waiter}, peer gone: took {took:?}");
    }
    // A world of one has nobody to wait for.
    let id = loopback_id();
    connect(&id, 0, 1, SHORT)
        .unwrap()
        .barrier_within(Duration::ZERO)
        .unwrap();
}
