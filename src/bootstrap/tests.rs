//! Loopback tests of the bootstrap: threads stand in for processes, every listener binds
//! port 0, and the failure tests use short timeouts with bounded elapsed times.

use super::error::Result;
use super::frame::{deadline_after, frame, header, read_frame, RecvError};
use super::host::host_identity_from;
use super::id::{fnv1a32, parse_bootstrap_addr};
use super::mac::{check_challenge, nonce};
use super::wire::{decode_error, encode_hello, encode_proof};
use super::*;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod attacks;

const LONG: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(300);
/// Slack on top of a short timeout before a test calls the wait a hang (2-core CI).
const SLACK: Duration = Duration::from_millis(2500);

fn loopback_id() -> UniqueId {
    UniqueId::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap()
}

/// The same address with another secret: what a stale or mistyped id looks like.
fn forged(id: &UniqueId) -> UniqueId {
    let mut secret = id.secret;
    secret[0] ^= 0xff;
    UniqueId {
        addr: id.addr,
        secret,
    }
}

/// Runs `f(rank)` on one thread per entry of `ranks`; results in the same order.
fn run<T: Send>(ranks: &[usize], f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = ranks.iter().map(|&r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn connect(id: &UniqueId, rank: usize, world: usize, timeout: Duration) -> Result<TcpBootstrap> {
    TcpBootstrap::connect(id, rank, world, 0xABCD, timeout)
}

/// A hand-made rank speaking the wire format directly: a hello, rank 0's challenge
/// (checked with the id's real secret), then a proof made with `secret`. Blocks until
/// rank 0 answers, so it runs beside rank 0.
fn raw_rank(id: &UniqueId, secret: &[u8; SECRET_BYTES], rank: usize, world: usize) -> TcpStream {
    let mut s = TcpStream::connect(id.addr).unwrap();
    let leaf = nonce().unwrap();
    s.write_all(&encode_hello(&leaf)).unwrap();
    let (kind, body) = raw_read(&mut s);
    assert_eq!(kind, KIND_CHALLENGE);
    let n = check_challenge(&body, &id.secret, &leaf).expect("rank 0 proves the secret");
    let proof = encode_proof(secret, &n, rank, world, 0xABCD, &HostId::new("raw"));
    s.write_all(&proof).unwrap();
    s
}

/// What a rank with a wrong secret sees: rank 0 cannot prove *its* secret.
fn is_unverified(e: &BootstrapError) -> bool {
    matches!(e, BootstrapError::UnverifiedRankZero { .. })
}

fn raw_read(s: &mut TcpStream) -> (u8, Vec<u8>) {
    match read_frame(s, deadline_after(LONG)) {
        Ok(f) => f,
        Err(RecvError::Io(e)) => panic!("raw read: {e}"),
        Err(RecvError::TooLarge(n)) => panic!("raw read: {n}-byte frame"),
    }
}

fn bounded(start: Instant, timeout: Duration) {
    let took = start.elapsed();
    assert!(
        took < timeout + SLACK,
        "took {took:?} for a {timeout:?} timeout"
    );
}

#[test]
fn worlds_gather_in_rank_order() {
    for world in [1, 2, 3, 8] {
        let id = loopback_id();
        let got = run(&(0..world).collect::<Vec<_>>(), |r| {
            let host = HostId::new(format!("host-{}", r / 2));
            let b = TcpBootstrap::connect_with_host(&id, r, world, 9, LONG, host).unwrap();
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
fn id_round_trips_as_bytes_and_text() {
    let id = loopback_id();
    assert!(id.release());
    assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
    let text = id.to_string();
    assert_eq!(text.len(), 2 * UniqueId::BYTES);
    assert!(text
        .bytes()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    assert_eq!(text.parse::<UniqueId>().unwrap(), id);
    assert_eq!(
        format!(" {}\n", text.to_uppercase())
            .parse::<UniqueId>()
            .unwrap(),
        id
    );
    let v6 = UniqueId {
        addr: "[fd00::5]:29500".parse().unwrap(),
        secret: *b"0123456789abcdef",
    };
    assert_eq!(v6.to_string().parse::<UniqueId>().unwrap(), v6);
    // Debug shows the address, never the secret (in hex or raw).
    let debug = format!("{v6:?}");
    assert!(debug.contains("fd00::5"), "{debug}");
    let secret_hex: String = v6.secret.iter().map(|b| format!("{b:02x}")).collect();
    assert!(!debug.contains(&secret_hex) && !debug.contains("0123456789abcdef"));
}

#[test]
fn garbled_ids_are_typed_errors() {
    let id = loopback_id();
    id.release();
    let text = id.to_string();
    let invalid = |s: &str| match s.parse::<UniqueId>() {
        Err(BootstrapError::InvalidId { reason }) => reason,
        other => panic!("{s:?} parsed as {other:?}"),
    };
    assert!(invalid("").contains("0 characters"));
    assert!(invalid(&text[..79]).contains("79 characters"));
    assert!(invalid(&format!("{text}0")).contains("81 characters"));
    assert!(invalid(&format!("{}g{}", &text[..10], &text[11..])).contains("not hexadecimal"));
    // One digit changed anywhere past the version byte: the checksum catches it.
    for pos in [2, 10, 40, 60, 79] {
        let mut t = text.clone().into_bytes();
        t[pos] = if t[pos] == b'0' { b'1' } else { b'0' };
        let t = String::from_utf8(t).unwrap();
        assert!(invalid(&t).contains("checksum"), "position {pos}");
    }
    assert!(invalid(&format!("02{}", &text[2..])).contains("format version 2"));
    // Well-formed checksums over bad contents.
    let resum = |mut b: [u8; UniqueId::BYTES]| {
        let sum = fnv1a32(&b[..36]);
        b[36..].copy_from_slice(&sum.to_le_bytes());
        b
    };
    let reason = |b: &[u8]| match UniqueId::from_bytes(b) {
        Err(BootstrapError::InvalidId { reason }) => reason,
        other => panic!("parsed as {other:?}"),
    };
    let mut b = id.to_bytes();
    b[1] = 5;
    assert!(reason(&resum(b)).contains("family 5"));
    let mut b = id.to_bytes();
    b[18] = 0;
    b[19] = 0;
    assert!(reason(&resum(b)).contains("cannot be connected to"));
    assert!(reason(&id.to_bytes()[..39]).contains("39 bytes"));
}

#[test]
fn addresses_are_parsed_and_unspecified_ones_refused() {
    let p = |s: &str| parse_bootstrap_addr(s).unwrap();
    assert_eq!(p("10.0.0.5:29500"), "10.0.0.5:29500".parse().unwrap());
    assert_eq!(p(" 10.0.0.5 "), "10.0.0.5:0".parse().unwrap());
    assert_eq!(p("[fd00::5]:7"), "[fd00::5]:7".parse().unwrap());
    assert_eq!(p("fd00::5"), "[fd00::5]:0".parse().unwrap());
    assert_eq!(p("[fd00::5]"), "[fd00::5]:0".parse().unwrap());
    assert!(p("localhost:7").ip().is_loopback());
    for bad in [
        "0.0.0.0",
        "0.0.0.0:5",
        "[::]:5",
        "10.0.0.5:99999",
        "no such host!",
    ] {
        assert!(
            matches!(
                parse_bootstrap_addr(bad),
                Err(BootstrapError::InvalidAddress { .. })
            ),
            "{bad}"
        );
    }
    assert!(matches!(
        UniqueId::bind("0.0.0.0:0".parse().unwrap()),
        Err(BootstrapError::InvalidAddress { .. })
    ));
}

#[test]
fn new_id_listens_on_loopback_unless_told() {
    let id = UniqueId::new().unwrap();
    if std::env::var_os(BOOTSTRAP_ADDR_ENV).is_none() {
        assert!(id.addr().ip().is_loopback());
    }
    assert_ne!(id.addr().port(), 0);
    assert!(id.release());
    assert!(!id.release());
}

#[test]
fn local_argument_errors_need_no_network() {
    let id = loopback_id();
    id.release();
    assert_eq!(
        connect(&id, 2, 2, SHORT).unwrap_err(),
        BootstrapError::RankOutOfRange {
            rank: 2,
            world_size: 2
        }
    );
    assert!(matches!(
        connect(&id, 0, 0, SHORT),
        Err(BootstrapError::InvalidWorldSize { world_size: 0, .. })
    ));
    let long = HostId::new("h".repeat(MAX_HOST_ID_BYTES + 1));
    assert!(matches!(
        TcpBootstrap::connect_with_host(&id, 1, 2, 0, SHORT, long),
        Err(BootstrapError::HostIdTooLong { .. })
    ));
}

#[test]
fn host_identity_is_overridable() {
    assert_eq!(
        host_identity_from(Some(" node-a ".into())).as_str(),
        "node-a"
    );
    let system = host_identity_from(None);
    assert_eq!(host_identity_from(Some("  ".into())), system);
    assert!(!system.as_str().is_empty() && system.as_str().len() <= MAX_HOST_ID_BYTES);
    assert_eq!(system, host_identity_from(None), "stable within a process");
}

#[test]
fn wrong_secret_and_strays_are_refused_while_real_ranks_complete() {
    let id = loopback_id();
    // Strangers arrive first: garbage, a version-1 hello with a wrong secret, a silent
    // connection.
    let mut garbage = TcpStream::connect(id.addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut old = TcpStream::connect(id.addr).unwrap();
    let mut v1 = b"PCBS\x01\x00".to_vec();
    v1.extend_from_slice(&forged(&id).secret);
    v1.extend_from_slice(&[0; 20]);
    old.write_all(&frame(KIND_HELLO, &v1)).unwrap();
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
            assert!(is_unverified(&e), "{e}");
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
    match &got[0].0 {
        BootstrapError::Timeout {
            waiting_for, hint, ..
        } => {
            assert_eq!(waiting_for, &[1]);
            assert!(
                hint.contains("1 connection(s) with a wrong secret"),
                "{hint}"
            );
        }
        e => panic!("{e}"),
    }
    assert!(
        got[0].1 >= SHORT && got[0].1 < SHORT + SLACK,
        "{:?}",
        got[0].1
    );
    assert!(is_unverified(&got[1].0), "{}", got[1].0);
}

#[test]
fn duplicate_rank_fails_everyone() {
    let id = loopback_id();
    let start = Instant::now();
    // Rank 2 never comes, so rank 0 cannot finish before it sees both rank 1s.
    let got = run(&[0, 1, 1], |r| connect(&id, r, 3, LONG).unwrap_err());
    assert_eq!(got[0], BootstrapError::DuplicateRank { rank: 1 });
    for e in &got[1..] {
        match e {
            BootstrapError::PeerFailed { rank: 0, message } => {
                assert!(message.contains("two processes claim rank 1"), "{message}")
            }
            e => panic!("{e}"),
        }
    }
    assert!(start.elapsed() < SLACK, "fails at once, not at the timeout");
    // A second rank 0 in the process that made the id.
    assert_eq!(
        connect(&id, 0, 3, SHORT).unwrap_err(),
        BootstrapError::StaleId
    );
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
    assert!(matches!(
        decode_error(0, &body),
        BootstrapError::PeerFailed { rank: 0, .. }
    ));
}

#[test]
fn world_size_mismatch_fails_both_sides() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| connect(&id, r, 3 + r, LONG).unwrap_err());
    assert_eq!(
        got[0],
        BootstrapError::WorldSizeMismatch {
            expected: 3,
            got: 4,
            rank: 1
        }
    );
    assert!(
        matches!(&got[1], BootstrapError::PeerFailed { rank: 0, message } if message.contains("world size 4")),
        "{}",
        got[1]
    );
}

#[test]
fn config_mismatch_fails_both_sides() {
    let id = loopback_id();
    let got = run(&[0, 1], |r| {
        TcpBootstrap::connect(&id, r, 2, 100 + r as u64, LONG).unwrap_err()
    });
    assert_eq!(
        got[0],
        BootstrapError::ConfigMismatch {
            rank: 1,
            expected: 100,
            got: 101
        }
    );
    assert!(
        matches!(got[1], BootstrapError::PeerFailed { rank: 0, .. }),
        "{}",
        got[1]
    );
}

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

/// `barrier_within` (for teardown): gives up by its own timeout when a peer never comes,
/// at once when a peer is gone, and leaves the configured timeout as it was.
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

/// A rank of protocol version 1 (which sent the secret itself) with the right secret is
/// told apart from a stranger: both sides learn that the versions differ.
#[test]
fn a_rank_of_the_older_protocol_is_named() {
    let id = loopback_id();
    let mut v1 = b"PCBS\x01\x00".to_vec();
    v1.extend_from_slice(&id.secret);
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&2u32.to_le_bytes());
    v1.extend_from_slice(&0xABCDu64.to_le_bytes());
    v1.extend_from_slice(&0u16.to_le_bytes());
    let mut old = TcpStream::connect(id.addr).unwrap();
    old.write_all(&frame(KIND_HELLO, &v1)).unwrap();
    let e = connect(&id, 0, 2, LONG).unwrap_err();
    assert!(
        matches!(&e, BootstrapError::Protocol { detail } if detail.contains("version 1")),
        "{e}"
    );
    let (kind, body) = raw_read(&mut old);
    assert_eq!(kind, KIND_ERROR);
    assert!(decode_error(0, &body).to_string().contains("version 1"));
}
