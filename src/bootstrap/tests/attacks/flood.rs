//! Connections that are not ranks: idle floods, half-sent headers, garbage.

use super::*;
use crate::bootstrap::wire::frame;

/// Connections of the flood test: more than rank 0's pending table holds.
const FLOOD: usize = 1100;

/// Makes sure this process may open `fds` more files (raises the soft limit towards the
/// hard one; raising affects no other test). Returns whether it can.
fn room_for_fds(fds: u64) -> bool {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{getrlimit, setrlimit, Resource};
        let mut lim = getrlimit(Resource::Nofile);
        let open = std::fs::read_dir("/proc/self/fd").map_or(64, |d| d.count()) as u64;
        let want = open + fds + 256;
        if lim.current.is_some_and(|cur| cur < want) {
            lim.current = Some(lim.maximum.map_or(want, |m| m.min(want)));
            let _ = setrlimit(Resource::Nofile, lim);
        }
        let now = getrlimit(Resource::Nofile).current;
        now.is_none_or(|c| c >= want)
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
    assert_is!((root, leaf), (Ok(Ok(r)), Ok(Ok(l))) if *r == want && *l == want);
    assert!(took < timeout, "rank 1 took {took:?}");
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
        let mut conns = halves.map(|h| {
            let mut c = TcpStream::connect(id.addr).unwrap();
            c.write_all(h).unwrap();
            c
        });
        for (c, h) in conns.iter_mut().zip(halves) {
            let got = read_all_until(c, Duration::from_secs(5));
            assert!(got.is_empty(), "{h:?}: rank 0 answered {got:?}");
            let took = start.elapsed();
            let held = "rank 0 still held a half-sent connection after";
            assert!(took < Duration::from_secs(5), "{h:?}: {held} {took:?}");
        }
        // Rank 2 comes now; the handshake completes.
        let leaf2 = connect(&id, 2, 3, long).map(|b| b.all_gather(b"2"));
        let want = vec![b"0".to_vec(), b"1".to_vec(), b"2".to_vec()];
        let got = [root.join().unwrap(), leaf1.join().unwrap(), leaf2];
        for (r, got) in got.into_iter().enumerate() {
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
        let b = connect(&id, r, 3, LONG).unwrap();
        b.all_gather(&[r as u8]).unwrap()
    });
    assert!(start.elapsed() < SLACK, "took {:?}", start.elapsed());
    assert_eq!(got, vec![vec![vec![0], vec![1], vec![2]]; 3]);
    for mut c in garbage {
        let got = read_all_until(&mut c, Duration::from_secs(2));
        assert!(got.is_empty(), "a garbage connection was answered: {got:?}");
    }
}
