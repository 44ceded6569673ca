//! The handshake ends by its timeout on either side, whatever the other side does.

use super::*;
use std::net::TcpListener;

/// The whole handshake, on either side, ends by its one timeout whatever the other side
/// does (or does not do).
#[test]
fn the_handshake_is_bounded_by_its_timeout() {
    let t = Duration::from_secs(2);
    // Each case runs one side on a fresh id and returns its error.
    type Case = fn(&UniqueId, Duration) -> BootstrapError;
    let cases: [(&str, Case); 6] = [
        ("leaf, nothing listening", |id, t| {
            id.release();
            connect(id, 1, 2, t).unwrap_err()
        }),
        // The id's listener holds the leaf in its backlog.
        ("leaf, rank 0 never calls connect", |id, t| {
            connect(id, 1, 2, t).unwrap_err()
        }),
        ("leaf, a mute listener", |id, t| {
            id.release();
            let mute = TcpListener::bind(id.addr).unwrap();
            thread::scope(|s| {
                s.spawn(|| read_all_until(&mut mute.accept().unwrap().0, t + SLACK));
                connect(id, 1, 2, t).unwrap_err()
            })
        }),
        ("leaf, a listener that drops everyone", |id, t| {
            id.release();
            let dropper = TcpListener::bind(id.addr).unwrap();
            dropper.set_nonblocking(true).unwrap();
            let start = Instant::now();
            thread::scope(|s| {
                s.spawn(|| {
                    while start.elapsed() < t + Duration::from_millis(200) {
                        match dropper.accept() {
                            Ok((c, _)) => drop(c),
                            Err(_) => thread::sleep(Duration::from_millis(1)),
                        }
                    }
                });
                connect(id, 1, 2, t).unwrap_err()
            })
        }),
        ("rank 0, nobody connects", |id, t| {
            connect(id, 0, 2, t).unwrap_err()
        }),
        (
            "rank 0, a connection that never finishes its hello",
            |id, t| {
                let mut c = TcpStream::connect(id.addr).unwrap();
                c.write_all(&[KIND_HELLO]).unwrap();
                connect(id, 0, 2, t).unwrap_err()
            },
        ),
    ];
    thread::scope(|s| {
        let runs = cases.map(|(what, case)| {
            s.spawn(move || {
                let id = loopback_id();
                let start = Instant::now();
                let e = case(&id, t);
                id.release();
                (what, e, start.elapsed())
            })
        });
        // Each fails at its deadline: after at least the timeout, at most 1.5 times it.
        for run in runs {
            let (what, e, took) = run.join().unwrap();
            assert!(matches!(e, BootstrapError::Timeout { .. }), "{what}: {e:?}");
            let bounded = took >= t.mul_f64(0.95) && took <= t.mul_f64(1.5);
            assert!(bounded, "{what}: took {took:?} for a {t:?} timeout");
        }
    });
}
