//! The handshake ends by its timeout on either side, whatever the other side does.

use super::*;
use std::net::TcpListener;

/// The whole handshake, on either side, ends by its one timeout whatever the other side
/// does (or does not do).
#[test]
fn the_handshake_is_bounded_by_its_timeout() {
    let t = Duration::from_secs(2);
    thread::scope(|s| {
        let mut cases = Vec::new();
        // A leaf whose rank 0 never comes: nothing listens (refused), ...
        cases.push(s.spawn(move || {
            let id = loopback_id();
            id.release();
            let start = Instant::now();
            let e = connect(&id, 1, 2, t).unwrap_err();
            ("leaf, nothing listening", e, start.elapsed())
        }));
        // ... the id's listener holds it in the backlog, ...
        cases.push(s.spawn(move || {
            let id = loopback_id();
            let start = Instant::now();
            let e = connect(&id, 1, 2, t).unwrap_err();
            id.release();
            ("leaf, rank 0 never calls connect", e, start.elapsed())
        }));
        // ... something accepts, reads and never answers, ...
        cases.push(s.spawn(move || {
            let id = loopback_id();
            id.release();
            let mute = TcpListener::bind(id.addr).unwrap();
            let start = Instant::now();
            let e = thread::scope(|s2| {
                s2.spawn(|| {
                    let (mut c, _) = mute.accept().unwrap();
                    read_all_until(&mut c, t + SLACK)
                });
                connect(&id, 1, 2, t).unwrap_err()
            });
            ("leaf, a mute listener", e, start.elapsed())
        }));
        // ... or something drops every connection at once.
        cases.push(s.spawn(move || {
            let id = loopback_id();
            id.release();
            let dropper = TcpListener::bind(id.addr).unwrap();
            dropper.set_nonblocking(true).unwrap();
            let start = Instant::now();
            let e = thread::scope(|s2| {
                s2.spawn(|| {
                    while start.elapsed() < t + Duration::from_millis(200) {
                        match dropper.accept() {
                            Ok((c, _)) => drop(c),
                            Err(_) => thread::sleep(Duration::from_millis(1)),
                        }
                    }
                });
                connect(&id, 1, 2, t).unwrap_err()
            });
            ("leaf, a listener that drops everyone", e, start.elapsed())
        }));
        // A rank 0 whose leaf never comes: nobody connects, ...
        cases.push(s.spawn(move || {
            let id = loopback_id();
            let start = Instant::now();
            let e = connect(&id, 0, 2, t).unwrap_err();
            ("rank 0, nobody connects", e, start.elapsed())
        }));
        // ... or a connection that never finishes its hello.
        cases.push(s.spawn(move || {
            let id = loopback_id();
            let mut c = TcpStream::connect(id.addr).unwrap();
            c.write_all(&[KIND_HELLO]).unwrap();
            let start = Instant::now();
            let e = connect(&id, 0, 2, t).unwrap_err();
            drop(c);
            ("rank 0, a silent connection", e, start.elapsed())
        }));
        // Each fails at its deadline: after at least the timeout, at most 1.5 times it.
        for case in cases {
            let (what, e, took) = case.join().unwrap();
            assert!(matches!(e, BootstrapError::Timeout { .. }), "{what}: {e:?}");
            let bounded = took >= t.mul_f64(0.95) && took <= t.mul_f64(1.5);
            assert!(bounded, "{what}: took {took:?} for a {t:?} timeout");
        }
    });
}
