//! Loopback tests of the bootstrap (threads stand in for processes, listeners bind port
//! 0, failure tests use short timeouts with bounded elapsed times) and their helpers.

use super::error::Result;
use super::mac::{self, check_challenge, nonce};
use super::wire::{deadline_after, encode_hello, encode_proof, read_frame, RecvError};
use super::*;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

/// Asserts that `$e` matches the pattern (a guard may follow), printing `$e` if not; `=>`
/// in place of the comma keeps rustfmt from spreading the call over lines.
macro_rules! assert_is {
    ($e:expr => $p:pat $(if $g:expr)?) => {
        assert_is!($e, $p $(if $g)?)
    };
    ($e:expr, $p:pat $(if $g:expr)?) => {
        match &$e {
            e => assert!(matches!(e, $p $(if $g)?), "{e:?}"),
        }
    };
}

mod admission;
mod attacks;
mod failures;
mod gather;
mod ids;
mod tagged;

const LONG: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(300);
/// Slack on top of a short timeout before a test calls the wait a hang (2-core CI).
const SLACK: Duration = Duration::from_millis(2500);

fn loopback_id() -> UniqueId {
    UniqueId::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap()
}

/// The same address with another secret: what a stale or mistyped id looks like.
fn forged(id: &UniqueId) -> UniqueId {
    let mut forged = *id;
    forged.secret[0] ^= 0xff;
    forged
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
    TcpBootstrap::connect(id, rank, world, timeout)
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
    let keys = check_challenge(&body, &id.secret, &leaf).expect("rank 0 proves the secret");
    let keys = mac::Keys {
        secret: *secret,
        ..keys
    };
    s.write_all(&encode_proof(&keys, rank, world, &HostId::new("raw")))
        .unwrap();
    s
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
