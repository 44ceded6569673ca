//! Whom rank 0 admits: wrong secrets, strays, duplicate or mismatched ranks, old versions.

use super::*;
use crate::bootstrap::wire::{decode_error, frame};
use std::io::Read;
use std::sync::Barrier;

/// A rank of protocol version 1, which sent `secret` itself in its hello (then rank 1,
/// world 2, a config checksum and an empty host id).
fn v1_rank(id: &UniqueId, secret: &[u8; SECRET_BYTES]) -> TcpStream {
    let mut v1 = [&b"PCBS\x01\x00"[..], secret, &[1, 0, 0, 0, 2, 0, 0, 0]].concat();
    v1.extend_from_slice(&0xABCDu64.to_le_bytes());
    v1.extend_from_slice(&[0, 0]);
    let mut s = TcpStream::connect(id.addr).unwrap();
    s.write_all(&frame(KIND_HELLO, &v1)).unwrap();
    s
}

#[test]
fn wrong_secret_and_strays_are_refused_while_real_ranks_complete() {
    let id = loopback_id();
    // Strangers arrive first: garbage, a version-1 hello with a wrong secret, a silent
    // connection.
    let mut garbage = TcpStream::connect(id.addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let old = v1_rank(&id, &forged(&id).secret);
    let silent = TcpStream::connect(id.addr).unwrap();
    let fake_id = forged(&id);
    let impostor_done = Barrier::new(3);
    let got = run(&[0, 1, 8, 9], |r| {
        if r == 8 {
            // A hand-made rank that answers the challenge with a wrong secret.
            let mut impostor = raw_rank(&id, &fake_id.secret, 1, 2);
            impostor.set_read_timeout(Some(LONG)).unwrap();
            let mut buf = [0u8; 16];
            let read = impostor.read(&mut buf);
            impostor_done.wait();
            // It learnt nothing more: its connection was closed without a word.
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
            return None;
        }
        if r == 9 {
            // A whole TcpBootstrap with the wrong secret refuses the real rank 0 (which
            // cannot prove a secret it does not share) and is not admitted.
            let start = Instant::now();
            let e = connect(&fake_id, 1, 2, LONG).unwrap_err();
            impostor_done.wait();
            assert_is!(e, BootstrapError::UnverifiedRankZero { .. });
            assert!(start.elapsed() < SLACK, "refused promptly");
            return None;
        }
        if r == 1 {
            impostor_done.wait(); // the real rank 1 comes after the impostors were refused
        }
        let b = connect(&id, r, 2, LONG).unwrap();
        Some(b.all_gather(&[r as u8]).unwrap())
    });
    assert_eq!(got[0], Some(vec![vec![0], vec![1]]));
    assert_eq!(got[1], got[0]);
    let mut buf = [0u8; 16];
    for mut c in [garbage, old] {
        c.set_read_timeout(Some(LONG)).unwrap();
        assert!(matches!(c.read(&mut buf), Ok(0) | Err(_)));
    }
    drop(silent);
}

#[test]
fn wrong_secrets_are_counted_in_the_timeout() {
    let id = loopback_id();
    let fake_id = forged(&id);
    let got = run(&[0, 1], |r| {
        let start = Instant::now();
        let e = if r == 0 {
            connect(&id, 0, 2, SHORT).unwrap_err()
        } else {
            connect(&fake_id, 1, 2, LONG).unwrap_err()
        };
        (e, start.elapsed())
    });
    let counted = |h: &str| h.contains("1 connection(s) with a wrong secret");
    assert_is!(got[0].0, BootstrapError::Timeout { waiting_for, hint, .. }
        if *waiting_for == [1] && counted(hint));
    let took = got[0].1;
    assert!(took >= SHORT && took < SHORT + SLACK, "{took:?}");
    assert_is!(got[1].0, BootstrapError::UnverifiedRankZero { .. });
}

#[test]
fn duplicate_rank_fails_everyone() {
    let id = loopback_id();
    let start = Instant::now();
    // Rank 2 never comes, so rank 0 cannot finish before it sees both rank 1s.
    let got = run(&[0, 1, 1], |r| connect(&id, r, 3, LONG).unwrap_err());
    assert_eq!(got[0], BootstrapError::DuplicateRank { rank: 1 });
    for e in &got[1..] {
        let says = |m: &str| m.contains("two processes claim rank 1");
        assert_is!(e, BootstrapError::PeerFailed { rank: 0, message } if says(message));
    }
    assert!(start.elapsed() < SLACK, "fails at once, not at the timeout");
    // A second rank 0 in the process that made the id.
    assert_is!(connect(&id, 0, 3, SHORT), Err(BootstrapError::StaleId));
}

#[test]
fn a_connection_claiming_rank_zero_is_a_duplicate() {
    let id = loopback_id();
    let (e, mut fake) = thread::scope(|s| {
        let fake = s.spawn(|| raw_rank(&id, &id.secret, 0, 2));
        let e = connect(&id, 0, 2, LONG).unwrap_err();
        (e, fake.join().unwrap())
    });
    assert_eq!(e, BootstrapError::DuplicateRank { rank: 0 });
    let (kind, body) = raw_read(&mut fake);
    assert_eq!(kind, KIND_ERROR);
    assert_is!(decode_error(0, &body) => BootstrapError::PeerFailed { rank: 0, .. });
}

#[test]
fn world_size_mismatch_fails_both_sides() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| connect(&id, r, 3 + r, LONG).unwrap_err());
    assert_is!(got[0] => BootstrapError::WorldSizeMismatch { expected: 3, got: 4, rank: 1 });
    let says = |m: &str| m.contains("world size 4");
    assert_is!(got[1], BootstrapError::PeerFailed { rank: 0, message } if says(message));
}

/// A rank of protocol version 1 (which sent the secret itself) with the right secret is
/// told apart from a stranger: both sides learn that the versions differ.
#[test]
fn a_rank_of_the_older_protocol_is_named() {
    let id = loopback_id();
    let mut old = v1_rank(&id, &id.secret);
    let e = connect(&id, 0, 2, LONG).unwrap_err();
    assert_is!(e, BootstrapError::Protocol { detail } if detail.contains("version 1"));
    let (kind, body) = raw_read(&mut old);
    assert_eq!(kind, KIND_ERROR);
    assert!(decode_error(0, &body).to_string().contains("version 1"));
}
