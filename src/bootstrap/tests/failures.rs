//! Failures that must end in a typed error, quickly.

use super::*;
use crate::bootstrap::wire::{decode_error, header};
use std::sync::Barrier;
use BootstrapError::{ConnectionClosed, PeerFailed, Poisoned, StaleId, Timeout};

/// Rank 2 never comes. A rank 0 with the short timeout names it and tells rank 1; a rank 1
/// with the short timeout gives up, which fails rank 0 at once.
#[test]
fn a_rank_that_never_comes_fails_both_sides_by_the_shorter_timeout() {
    for short in [0, 1] {
        let id = loopback_id();
        let got = run(&[0, 1], |r| {
            let start = Instant::now();
            let e = connect(&id, r, 3, if r == short { SHORT } else { LONG }).unwrap_err();
            (e, start)
        });
        let ((root, root_start), (leaf, leaf_start)) = (&got[0], &got[1]);
        bounded(*root_start, SHORT);
        bounded(*leaf_start, SHORT);
        if short == 0 {
            assert_is!(root, Timeout { waiting_for, after, .. } if *waiting_for == [2] && *after == SHORT);
            assert!(root_start.elapsed() >= SHORT);
            assert_is!(leaf, PeerFailed { rank: 0, message } if message.contains("[2]"));
        } else {
            assert_is!(root, ConnectionClosed { rank: 1, hint, .. } if hint.contains("[2]"));
            assert_is!(leaf, Timeout { .. });
        }
    }
}

#[test]
fn rank_zero_that_never_comes_times_out_elsewhere() {
    let id = loopback_id(); // listening, but rank 0 never calls connect
    let start = Instant::now();
    let e = connect(&id, 1, 2, SHORT).unwrap_err();
    assert_is!(e, Timeout { waiting_for, .. } if *waiting_for == [0]);
    bounded(start, SHORT);
    id.release();
}

#[test]
fn a_stale_id_fails_instead_of_hanging() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        connect(&id, r, 2, LONG).unwrap().all_gather(b"x").unwrap()
    });
    assert_eq!(got[0], got[1]);
    // The communicator is gone; a rank reusing its id finds nobody listening. A released
    // id is as stale.
    let released = loopback_id();
    assert!(released.release());
    for (id, hint_names_it) in [(id, true), (released, false)] {
        let start = Instant::now();
        let e = connect(&id, 1, 2, SHORT).unwrap_err();
        let says = |h: &str| !hint_names_it || h.contains("refused") && h.contains("stale");
        assert_is!(e, Timeout { waiting_for, hint, .. } if *waiting_for == [0] && says(hint));
        bounded(start, SHORT);
        assert_eq!(connect(&id, 0, 2, SHORT).unwrap_err(), StaleId);
    }
}

/// A frame over the cap, refused on send by its sender (the others hear why) or, when a
/// raw rank announces it, on receive by rank 0.
#[test]
fn an_oversized_frame_is_refused_on_send_and_on_receive() {
    let too_large = BootstrapError::FrameTooLarge {
        len: MAX_FRAME_BYTES + 1,
        max: MAX_FRAME_BYTES,
    };
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        let b = connect(&id, r, 2, LONG).unwrap();
        let e = match r {
            1 => b.all_gather(&vec![0u8; MAX_FRAME_BYTES + 1]).unwrap_err(),
            _ => b.all_gather(b"fine").unwrap_err(),
        };
        let again = b.barrier().unwrap_err();
        assert_is!(again, Poisoned { first } if **first == e);
        e
    });
    assert_eq!(got[1], too_large);
    assert_is!(got[0], PeerFailed { rank: 1, message } if message.contains("exceeds"));

    let id = loopback_id();
    let got = run(&[0, 1, 2], |r| {
        if r == 1 {
            // A rank (right secret) that announces a frame over the cap.
            let mut fake = raw_rank(&id, &id.secret, 1, 3);
            assert_eq!(raw_read(&mut fake).0, KIND_WELCOME);
            fake.write_all(&header(KIND_DATA, MAX_FRAME_BYTES + 1))
                .unwrap();
            let (kind, body) = raw_read(&mut fake);
            assert_eq!(kind, KIND_ERROR);
            return decode_error(0, &body);
        }
        connect(&id, r, 3, LONG)
            .unwrap()
            .all_gather(b"ok")
            .unwrap_err()
    });
    assert_eq!(got[0], too_large);
    for e in &got[1..] {
        assert_is!(e, PeerFailed { rank: 0, message } if *message == too_large.to_string());
    }
}

#[test]
fn a_rank_missing_from_an_all_gather_is_named() {
    let id = loopback_id();
    let gate = Barrier::new(3);
    let got = run(&[0, 1, 2], |r| {
        let b = connect(&id, r, 3, LONG).unwrap();
        let start = Instant::now();
        let e = match r {
            0 => {
                b.set_timeout(SHORT);
                assert_eq!(b.timeout(), SHORT);
                let e = b.all_gather(b"zero").unwrap_err();
                bounded(start, SHORT);
                assert_is!(b.all_gather(b""), Err(Poisoned { .. }));
                e
            }
            1 => b.all_gather(b"one").unwrap_err(),
            _ => {
                gate.wait(); // until rank 0 has given up
                b.all_gather(b"two").unwrap_err()
            }
        };
        if r < 2 {
            gate.wait();
        }
        e
    });
    assert_is!(got[0], Timeout { waiting_for, .. } if *waiting_for == [2]);
    assert_is!(got[1], PeerFailed { rank: 0, message } if message.contains("[2]"));
    // Rank 2 comes late and learns why at once.
    assert_is!(got[2] => PeerFailed { rank: 0, .. } | ConnectionClosed { rank: 0, .. });
}

#[test]
fn a_dropped_rank_fails_the_others_fast() {
    let id = loopback_id();
    let start = Instant::now();
    let got = run(&[0, 1, 2], |r| {
        let b = connect(&id, r, 3, LONG).unwrap();
        (r < 2).then(|| b.all_gather(b"still here").unwrap_err())
    });
    assert!(start.elapsed() < SLACK, "no one waited out the timeout");
    assert_is!(got[0], Some(ConnectionClosed { rank: 2, .. }));
    assert_is!(got[1], Some(PeerFailed { rank: 0, message }) if message.contains("rank 2"));
}
