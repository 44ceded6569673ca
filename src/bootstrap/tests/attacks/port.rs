//! A leaf on rank 0's port without rank 0: a squatter after `release()`, and a port that
//! drops the leaf before its welcome.

use super::*;
use crate::bootstrap::wire::{encode_welcome, frame};
use std::net::TcpListener;

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A program that bound the id's port after `release()` and answers a leaf's first words
/// with a forged welcome, a random challenge then a forged welcome, an error frame or
/// garbage: the leaf refuses it with the typed error, and the squatter never sees the secret.
#[test]
fn a_squatter_on_a_released_port_is_refused_and_learns_nothing() {
    let id = loopback_id();
    assert!(id.release());
    let squatter = TcpListener::bind(id.addr).expect("the released port is free");
    let welcome = frame(
        KIND_WELCOME,
        &encode_welcome(&[HostId::new("forged-0"), HostId::new("forged-1")]),
    );
    let challenge = frame(KIND_CHALLENGE, &[0x5a; CHALLENGE_BYTES]);
    let plays = [
        ("welcome", welcome.clone()),
        ("challenge", [challenge, welcome].concat()),
        ("error", frame(KIND_ERROR, b"\0\0\0\0you are rank 0 now")),
        ("garbage", b"HTTP/1.1 200 OK\r\n\r\nhello".to_vec()),
    ];
    thread::scope(|s| {
        let heard = s.spawn(|| {
            let mut heard = Vec::new();
            for (play, reply) in &plays {
                let Some(mut c) = accept_within(&squatter, SLACK) else {
                    break;
                };
                let mut got = read_all_until(&mut c, Duration::from_millis(300));
                let _ = c.write_all(reply);
                got.extend(read_all_until(&mut c, Duration::from_secs(2)));
                heard.push((play, got));
            }
            heard
        });
        let outcomes = plays.each_ref().map(|(play, _)| {
            let start = Instant::now();
            let got = connect(&id, 1, 2, Duration::from_secs(4));
            (play, got, start.elapsed())
        });
        for (play, got) in heard.join().unwrap() {
            assert!(
                !contains(&got, &id.secret),
                "{play:?}: the squatter read the secret in the {} bytes the leaf sent",
                got.len()
            );
        }
        for (play, got, took) in outcomes {
            // Never accepted as rank 0; the message names the likely impostor.
            let says = |t: String| t.contains("impostor") && t.contains("prove");
            assert_is!((play, got), (_, Err(e @ BootstrapError::UnverifiedRankZero { .. }))
                if says(e.to_string()));
            assert!(took < SLACK, "{play:?}: refused promptly");
        }
    });
}

/// Rank 0's port answers the first connections by dropping them (rank 0 evicted the
/// leaf, or restarted): the leaf connects again within its own deadline and joins.
#[test]
fn a_leaf_dropped_before_the_welcome_reconnects() {
    let made = loopback_id();
    assert!(made.release());
    // An id this process never registered: rank 0 binds the port itself.
    let id = UniqueId {
        addr: made.addr,
        secret: [0x42; SECRET_BYTES],
    };
    let flaky = TcpListener::bind(id.addr).unwrap();
    let timeout = Duration::from_secs(8);
    thread::scope(|s| {
        let leaf = s.spawn(|| {
            let start = Instant::now();
            let b = connect(&id, 1, 2, timeout);
            (b.and_then(|b| b.all_gather(b"1")), start.elapsed())
        });
        // First connection: read what it says, then close without a word.
        let mut c = accept_within(&flaky, SLACK).expect("the leaf connects");
        let _ = read_all_until(&mut c, Duration::from_millis(100));
        drop(c);
        // Second: close at once with its bytes unread (a reset).
        if let Some(c) = accept_within(&flaky, SLACK) {
            thread::sleep(Duration::from_millis(50));
            drop(c);
        }
        drop(flaky);
        // The real rank 0 comes on the same port.
        let root = connect(&id, 0, 2, timeout).and_then(|b| b.all_gather(b"0"));
        let (leaf, took) = leaf.join().unwrap();
        let want = vec![b"0".to_vec(), b"1".to_vec()];
        assert_eq!(leaf.expect("rank 1 joined after being dropped"), want);
        assert_eq!(root.expect("rank 0"), want);
        assert!(took < timeout, "{took:?}");
    });
}
