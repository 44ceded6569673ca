//! Failures that must end in a typed error, quickly.

use super::*;
use crate::bootstrap::frame::header;
use crate::bootstrap::wire::decode_error;
use std::sync::Barrier;

#[test]
fn a_rank_that_never_comes_times_out_on_rank_zero() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        let start = Instant::now();
        // Rank 1 waits longer so that it hears rank 0's verdict.
        let e = connect(&id, r, 3, if r == 0 { SHORT } else { LONG }).unwrap_err();
        (e, start)
    });
    match &got[0].0 {
        BootstrapError::Timeout {
            waiting_for, after, ..
        } => assert_eq!((waiting_for.as_slice(), *after), (&[2][..], SHORT)),
        e => panic!("{e}"),
    }
    assert!(got[0].1.elapsed() >= SHORT);
    bounded(got[0].1, SHORT);
    match &got[1].0 {
        BootstrapError::PeerFailed { rank: 0, message } => {
            assert!(message.contains("[2]"), "{message}")
        }
        e => panic!("{e}"),
    }
    bounded(got[1].1, SHORT);
}

#[test]
fn rank_zero_that_never_comes_times_out_elsewhere() {
    let id = loopback_id(); // listening, but rank 0 never calls connect
    let start = Instant::now();
    match connect(&id, 1, 2, SHORT).unwrap_err() {
        BootstrapError::Timeout { waiting_for, .. } => assert_eq!(waiting_for, [0]),
        e => panic!("{e}"),
    }
    bounded(start, SHORT);
    id.release();
}

#[test]
fn a_leaf_that_gives_up_fails_rank_zero_at_once() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        let start = Instant::now();
        let e = connect(&id, r, 3, if r == 0 { LONG } else { SHORT }).unwrap_err();
        (e, start.elapsed())
    });
    assert!(
        matches!(&got[0].0, BootstrapError::ConnectionClosed { rank: 1, hint, .. } if hint.contains("[2]")),
        "{}",
        got[0].0
    );
    assert!(
        got[0].1 < SHORT + SLACK,
        "rank 0 did not wait out its own timeout"
    );
    assert!(
        matches!(got[1].0, BootstrapError::Timeout { .. }),
        "{}",
        got[1].0
    );
}

#[test]
fn a_stale_id_fails_instead_of_hanging() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        connect(&id, r, 2, LONG).unwrap().all_gather(b"x").unwrap()
    });
    assert_eq!(got[0], got[1]);
    // The communicator is gone; a rank reusing its id finds nobody listening.
    let start = Instant::now();
    match connect(&id, 1, 2, SHORT).unwrap_err() {
        BootstrapError::Timeout {
            waiting_for, hint, ..
        } => {
            assert_eq!(waiting_for, [0]);
            assert!(hint.contains("refused") && hint.contains("stale"), "{hint}");
        }
        e => panic!("{e}"),
    }
    bounded(start, SHORT);
    assert_eq!(
        connect(&id, 0, 2, SHORT).unwrap_err(),
        BootstrapError::StaleId
    );
    // A released id is as stale.
    let id = loopback_id();
    assert!(id.release());
    let start = Instant::now();
    assert!(matches!(
        connect(&id, 1, 2, SHORT),
        Err(BootstrapError::Timeout { .. })
    ));
    bounded(start, SHORT);
    assert_eq!(
        connect(&id, 0, 2, SHORT).unwrap_err(),
        BootstrapError::StaleId
    );
}

#[test]
fn an_oversized_frame_is_refused_on_send() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        let b = connect(&id, r, 2, LONG).unwrap();
        let e = if r == 1 {
            b.all_gather(&vec![0u8; MAX_FRAME_BYTES + 1]).unwrap_err()
        } else {
            b.all_gather(b"fine").unwrap_err()
        };
        let again = b.barrier().unwrap_err();
        assert!(matches!(&again, BootstrapError::Poisoned { first } if **first == e));
        e
    });
    assert_eq!(
        got[1],
        BootstrapError::FrameTooLarge {
            len: MAX_FRAME_BYTES + 1,
            max: MAX_FRAME_BYTES
        }
    );
    assert!(
        matches!(&got[0], BootstrapError::PeerFailed { rank: 1, message } if message.contains("exceeds"))
    );
}

#[test]
fn an_oversized_frame_is_refused_on_receive() {
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
        let b = connect(&id, r, 3, LONG).unwrap();
        b.all_gather(b"ok").unwrap_err()
    });
    let too_large = BootstrapError::FrameTooLarge {
        len: MAX_FRAME_BYTES + 1,
        max: MAX_FRAME_BYTES,
    };
    assert_eq!(got[0], too_large);
    for e in &got[1..] {
        assert!(
            matches!(e, BootstrapError::PeerFailed { rank: 0, message } if *message == too_large.to_string()),
            "{e}"
        );
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
                assert!(matches!(
                    b.all_gather(b""),
                    Err(BootstrapError::Poisoned { .. })
                ));
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
    match &got[0] {
        BootstrapError::Timeout { waiting_for, .. } => assert_eq!(waiting_for, &[2]),
        e => panic!("{e}"),
    }
    assert!(
        matches!(&got[1], BootstrapError::PeerFailed { rank: 0, message } if message.contains("[2]"))
    );
    // Rank 2 comes late and learns why at once.
    assert!(
        matches!(
            got[2],
            BootstrapError::PeerFailed { rank: 0, .. }
                | BootstrapError::ConnectionClosed { rank: 0, .. }
        ),
        "{}",
        got[2]
    );
}

#[test]
fn a_dropped_rank_fails_the_others_fast() {
    let id = loopback_id();
    let start = Instant::now();
    let got = run(&[0, 1, 2], |r| {
        let b = connect(&id, r, 3, LONG).unwrap();
        if r == 2 {
            return None;
        }
        Some(b.all_gather(b"still here").unwrap_err())
    });
    assert!(start.elapsed() < SLACK, "no one waited out the timeout");
    assert!(
        matches!(
            got[0],
            Some(BootstrapError::ConnectionClosed { rank: 2, .. })
        ),
        "{:?}",
        got[0]
    );
    assert!(
        matches!(&got[1], Some(BootstrapError::PeerFailed { rank: 0, message }) if message.contains("rank 2")),
        "{:?}",
        got[1]
    );
}
