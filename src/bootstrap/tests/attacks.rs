//! Attacks on the TCP bootstrap, over loopback only, each bounded in connections and
//! time: a flood of idle connections, a squatter on a released id's port, garbage and
//! half headers, fd exhaustion (in a child process with a low `RLIMIT_NOFILE`), a leaf
//! dropped before its welcome, and the handshake's one deadline.

use super::*;
use crate::bootstrap::frame::frame;
use std::io::Read;
use std::net::TcpListener;

/// Connections of the flood test: more than rank 0's pending table holds.
const FLOOD: usize = 1100;

/// Makes sure this process may open `fds` more files (raises the soft limit towards the
/// hard one; raising affects no other test). Returns whether it can.
fn room_for_fds(fds: u64) -> bool {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{getrlimit, setrlimit, Resource};
        let lim = getrlimit(Resource::Nofile);
        let open = std::fs::read_dir("/proc/self/fd").map_or(64, |d| d.count()) as u64;
        let want = open + fds + 256;
        match lim.current {
            Some(cur) if cur < want => {
                let raised = rustix::process::Rlimit {
                    current: Some(lim.maximum.map_or(want, |m| m.min(want))),
                    maximum: lim.maximum,
                };
                let _ = setrlimit(Resource::Nofile, raised);
                getrlimit(Resource::Nofile)
                    .current
                    .is_none_or(|c| c >= want)
            }
            _ => true,
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = fds;
        true
    }
}

/// 1,100 idle connections (more than the pending table) arrive before the real rank 1:
/// rank 1 still joins, within its timeout. (The flood itself may take a few seconds: the
/// kernel's accept queue of 128 overflows and some of its connections wait for TCP's
/// retransmission; four threads open it, so that those waits overlap.)
#[test]
fn a_flood_of_idle_connections_does_not_lock_out_rank_one() {
    if !room_for_fds(2 * FLOOD as u64 + 64) {
        eprintln!("skipped: the fd limit does not allow {FLOOD} loopback connections");
        return;
    }
    let id = loopback_id();
    let timeout = Duration::from_secs(8);
    let (root, leaf, took) = thread::scope(|s| {
        // Rank 0 outlasts a slow flood; rank 1's own timeout is the one that counts.
        let root = s.spawn(|| connect(&id, 0, 2, LONG * 3).map(|b| b.all_gather(b"0")));
        let openers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    (0..FLOOD / 4)
                        .map(|_| TcpStream::connect_timeout(&id.addr, LONG))
                        .collect::<std::io::Result<Vec<TcpStream>>>()
                        .expect("flood connection")
                })
            })
            .collect();
        let idle: Vec<Vec<TcpStream>> = openers.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(idle.iter().map(Vec::len).sum::<usize>(), FLOOD);
        let start = Instant::now();
        let leaf = connect(&id, 1, 2, timeout).map(|b| b.all_gather(b"1"));
        let took = start.elapsed();
        let root = root.join().unwrap();
        drop(idle);
        (root, leaf, took)
    });
    let want = vec![b"0".to_vec(), b"1".to_vec()];
    match (&root, &leaf) {
        (Ok(Ok(r)), Ok(Ok(l))) => assert_eq!((r, l), (&want, &want)),
        _ => panic!("flooded handshake failed: rank 0: {root:?}; rank 1: {leaf:?}"),
    }
    assert!(took < timeout, "rank 1 took {took:?}");
}

/// Reads what a peer sends until it closes or `limit` passes.
fn read_all_until(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return got;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return got,
        }
    }
}

/// Accepts one connection within `limit` (the listener is left non-blocking).
fn accept_within(l: &TcpListener, limit: Duration) -> Option<TcpStream> {
    l.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        match l.accept() {
            Ok((c, _)) => {
                c.set_nonblocking(false).unwrap();
                return Some(c);
            }
            Err(_) => thread::sleep(Duration::from_millis(2)),
        }
    }
    None
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// What a squatter does once a leaf has connected and said its first words.
#[derive(Clone, Copy, Debug)]
enum Squat {
    /// Answers at once with a forged welcome.
    Welcome,
    /// Answers with a challenge of random bytes, then a forged welcome.
    Challenge,
    /// Answers with an error frame.
    Error,
    /// Answers with garbage.
    Garbage,
}

/// A program that bound the id's port after `release()`: the leaf refuses it with the
/// typed error, and the squatter never sees the secret.
#[test]
fn a_squatter_on_a_released_port_is_refused_and_learns_nothing() {
    let id = loopback_id();
    assert!(id.release());
    let squatter = TcpListener::bind(id.addr).expect("the released port is free");
    let plays = [
        Squat::Welcome,
        Squat::Challenge,
        Squat::Error,
        Squat::Garbage,
    ];
    let forged_welcome = {
        let mut b = Vec::new();
        b.extend_from_slice(&2u32.to_le_bytes());
        for h in ["forged-0", "forged-1"] {
            b.extend_from_slice(&(h.len() as u16).to_le_bytes());
            b.extend_from_slice(h.as_bytes());
        }
        b
    };
    thread::scope(|s| {
        let heard = s.spawn(|| {
            let mut heard = Vec::new();
            for play in plays {
                let Some(mut c) = accept_within(&squatter, SLACK) else {
                    break;
                };
                let mut got = read_all_until(&mut c, Duration::from_millis(300));
                let reply = match play {
                    Squat::Welcome => frame(KIND_WELCOME, &forged_welcome),
                    Squat::Challenge => {
                        let mut f = frame(KIND_CHALLENGE, &[0x5a; CHALLENGE_BYTES]);
                        f.extend(frame(KIND_WELCOME, &forged_welcome));
                        f
                    }
                    Squat::Error => frame(KIND_ERROR, b"\0\0\0\0you are rank 0 now"),
                    Squat::Garbage => b"HTTP/1.1 200 OK\r\n\r\nhello".to_vec(),
                };
                let _ = c.write_all(&reply);
                got.extend(read_all_until(&mut c, Duration::from_secs(2)));
                heard.push((play, got));
            }
            heard
        });
        let outcomes: Vec<_> = plays
            .iter()
            .map(|&play| {
                let start = Instant::now();
                let got = connect(&id, 1, 2, Duration::from_secs(4));
                (play, got, start.elapsed())
            })
            .collect();
        for (play, got) in heard.join().unwrap() {
            assert!(
                !contains(&got, &id.secret),
                "{play:?}: the squatter read the secret in the {} bytes the leaf sent",
                got.len()
            );
        }
        for (play, got, took) in outcomes {
            match got {
                Ok(b) => panic!(
                    "{play:?}: the leaf accepted a squatter as rank 0 (host ids {:?})",
                    b.host_ids()
                ),
                Err(e) => {
                    assert!(is_unverified(&e), "{play:?}: {e:?}");
                    let text = e.to_string();
                    assert!(
                        text.contains("impostor") && text.contains("prove"),
                        "{play:?}: {e}"
                    );
                }
            }
            assert!(took < SLACK, "{play:?}: refused promptly");
        }
    });
}

/// A connection that stops halfway through its header (or its hello) is closed after
/// the hello deadline, long before rank 0's own deadline, while rank 0 waits for a
/// real rank.
#[test]
fn half_headers_are_closed_after_the_hello_deadline() {
    let id = loopback_id();
    let long = Duration::from_secs(12);
    let halves: [&[u8]; 3] = [
        &[KIND_HELLO, 38],                      // half a header
        &[KIND_HELLO, 38, 0, 0, 0, b'P', b'C'], // a header and part of a hello
        &[KIND_DATA, 9, 0, 0, 0, 1, 2, 3],      // a data frame where a hello belongs
    ];
    thread::scope(|s| {
        let root = s.spawn(|| connect(&id, 0, 3, long).map(|b| b.all_gather(b"0")));
        let leaf1 = s.spawn(|| connect(&id, 1, 3, long).map(|b| b.all_gather(b"1")));
        let start = Instant::now();
        let mut conns: Vec<TcpStream> = halves
            .iter()
            .map(|h| {
                let mut c = TcpStream::connect(id.addr).unwrap();
                c.write_all(h).unwrap();
                c
            })
            .collect();
        for (c, h) in conns.iter_mut().zip(halves) {
            let got = read_all_until(c, Duration::from_secs(5));
            assert!(got.is_empty(), "{h:?}: rank 0 answered {got:?}");
            let took = start.elapsed();
            assert!(
                took < Duration::from_secs(5),
                "{h:?}: rank 0 still held a half-sent connection after {took:?}"
            );
        }
        // Rank 2 comes now; the handshake completes.
        let leaf2 = connect(&id, 2, 3, long).map(|b| b.all_gather(b"2"));
        let want = vec![b"0".to_vec(), b"1".to_vec(), b"2".to_vec()];
        for (r, got) in [root.join().unwrap(), leaf1.join().unwrap(), leaf2]
            .into_iter()
            .enumerate()
        {
            assert_eq!(got.expect("joined").expect("gathered"), want, "rank {r}");
        }
    });
}

/// Garbage of every shape arrives before the real ranks: they complete at once.
#[test]
fn garbage_connections_do_not_disturb_real_ranks() {
    let id = loopback_id();
    let mut garbage: Vec<TcpStream> = Vec::new();
    let mut send = |bytes: &[u8]| {
        let mut c = TcpStream::connect(id.addr).unwrap();
        let _ = c.write_all(bytes);
        garbage.push(c);
    };
    send(b"GET / HTTP/1.0\r\n\r\n");
    send(&[KIND_HELLO, 0xff, 0xff, 0xff, 0xff]); // a hello of 4 GiB
    send(&[KIND_HELLO, 0, 0, 0, 0]); // an empty hello
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    send(&noise);
    send(&frame(KIND_HELLO, b"PCBS\xff\xffnot a peercomm hello"));
    let start = Instant::now();
    let got = run(&[0, 1, 2], |r| {
        connect(&id, r, 3, LONG)
            .unwrap()
            .all_gather(&[r as u8])
            .unwrap()
    });
    assert!(start.elapsed() < SLACK, "took {:?}", start.elapsed());
    assert_eq!(got, vec![vec![vec![0], vec![1], vec![2]]; 3]);
    for mut c in garbage {
        let got = read_all_until(&mut c, Duration::from_secs(2));
        assert!(got.is_empty(), "a garbage connection was answered: {got:?}");
    }
}

/// The helper process of `fd_exhaustion_does_not_end_rank_zero`: rank 0 under a low
/// `RLIMIT_NOFILE`. Does nothing (and passes) unless the parent named it.
#[cfg(target_os = "linux")]
#[test]
fn fd_exhaustion_child() {
    use rustix::process::{setrlimit, Resource, Rlimit};
    if std::env::var_os(FD_CHILD_ENV).is_none() {
        return;
    }
    let id = loopback_id();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let low = open + 12;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(low),
            maximum: Some(low),
        },
    )
    .unwrap();
    println!("FD_CHILD_ID {id}");
    std::io::stdout().flush().unwrap();
    match connect(&id, 0, 2, Duration::from_secs(8)).and_then(|b| b.all_gather(b"child")) {
        Ok(all) => println!("FD_CHILD_GATHERED {all:?}"),
        Err(e) => panic!("FD_CHILD_FAILED {e}"),
    }
}

#[cfg(target_os = "linux")]
const FD_CHILD_ENV: &str = "PEERCOMM_TEST_FD_CHILD";

/// Rank 0 runs out of file descriptors (a child process with a limit a few above what
/// it has open) while idle connections pile up: accept's EMFILE is waited out, and the
/// real rank 1 still joins.
#[cfg(target_os = "linux")]
#[test]
fn fd_exhaustion_does_not_end_rank_zero() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "bootstrap::tests::attacks::fd_exhaustion_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FD_CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    let reader = thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let id: UniqueId = loop {
        match lines.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => {
                if let Some(rest) = line.split("FD_CHILD_ID ").nth(1) {
                    break rest.trim().parse().unwrap();
                }
                seen.push(line);
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child printed no id ({e:?}): {seen:?}");
            }
        }
    };
    // More idle connections than the child has descriptors left.
    let idle: Vec<TcpStream> = (0..48)
        .map(|_| TcpStream::connect(id.addr).unwrap())
        .collect();
    let leaf = connect(&id, 1, 2, Duration::from_secs(8)).and_then(|b| b.all_gather(b"parent"));
    drop(idle);
    // The child has stopped by itself by now (its own 8 s deadline); bound the wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        thread::sleep(Duration::from_millis(20));
    };
    reader.join().unwrap();
    seen.extend(lines.try_iter());
    let mut stderr = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
    assert!(
        status.success() && leaf.is_ok(),
        "rank 1: {leaf:?}; child {status}: {}\n{stderr}",
        seen.join("\n")
    );
    assert_eq!(leaf.unwrap(), vec![b"child".to_vec(), b"parent".to_vec()]);
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

/// The elapsed time of a handshake that must fail at its deadline: at least the
/// timeout, and at most 1.5 times it.
fn within_bound(what: &str, took: Duration, timeout: Duration) {
    assert!(
        took >= timeout.mul_f64(0.95) && took <= timeout.mul_f64(1.5),
        "{what}: took {took:?} for a {timeout:?} timeout"
    );
}

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
        for case in cases {
            let (what, e, took) = case.join().unwrap();
            assert!(matches!(e, BootstrapError::Timeout { .. }), "{what}: {e:?}");
            within_bound(what, took, t);
        }
    });
}
