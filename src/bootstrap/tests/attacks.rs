//! Attacks on the TCP bootstrap over loopback, each bounded in connections and time,
//! and their shared helpers.

use super::*;
use std::io::Read;
use std::net::TcpListener;

mod deadline;
#[cfg(target_os = "linux")]
mod fds;
mod flood;
mod port;

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
