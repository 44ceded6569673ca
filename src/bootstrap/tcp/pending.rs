//! Connections rank 0 accepted that have not proven themselves yet, read a frame at a
//! time without blocking, and the count of those turned away (for the timeout's hint).

use std::io::{self, Read};
use std::net::TcpStream;
use std::time::Instant;

use crate::bootstrap::mac::Keys;
use crate::bootstrap::{
    HEADER_BYTES, HELLO_DEADLINE, KIND_HELLO, KIND_PROOF, MAX_HELLO_BYTES, MAX_PROOF_BYTES,
    PROOF_FIXED_BYTES,
};

/// A connection rank 0 has accepted that has not proven itself yet (non-blocking).
pub(super) struct Pending {
    pub(super) stream: TcpStream,
    /// When it was accepted: it must have proven itself by [`HELLO_DEADLINE`] after.
    pub(super) since: Instant,
    buf: Vec<u8>,
    want: usize,
    /// `None` until its hello came; then the keys of the challenge sent to it.
    pub(super) keys: Option<Keys>,
}

pub(super) enum Polled {
    Waiting,
    Gone,
    /// The body of the frame this stage expects (a hello, then a proof).
    Frame(Vec<u8>),
}

impl Pending {
    pub(super) fn new(stream: TcpStream, since: Instant) -> Self {
        Self {
            stream,
            since,
            buf: Vec::new(),
            want: HEADER_BYTES,
            keys: None,
        }
    }

    pub(super) fn poll(&mut self) -> Polled {
        let (kind, min, max) = match self.keys {
            None => (KIND_HELLO, 1, MAX_HELLO_BYTES),
            Some(_) => (KIND_PROOF, PROOF_FIXED_BYTES, MAX_PROOF_BYTES),
        };
        let mut chunk = [0u8; 512];
        loop {
            if self.buf.len() == self.want {
                if self.want > HEADER_BYTES {
                    let body = self.buf.split_off(HEADER_BYTES);
                    self.buf.clear();
                    self.want = HEADER_BYTES;
                    return Polled::Frame(body);
                }
                let len = u32::from_le_bytes(self.buf[1..].try_into().expect("4")) as usize;
                if self.buf[0] != kind || len < min || len > max {
                    return Polled::Gone;
                }
                self.want = HEADER_BYTES + len;
            }
            let n = (self.want - self.buf.len()).min(chunk.len());
            match self.stream.read(&mut chunk[..n]) {
                Ok(0) => return Polled::Gone,
                Ok(k) => self.buf.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Polled::Waiting,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Polled::Gone,
            }
        }
    }
}

/// Connections rank 0 turned away, for the timeout's hint.
#[derive(Default)]
pub(super) struct Refused {
    /// Challenged, then gave a wrong proof or closed (a rank with another secret).
    pub(super) wrong_secret: usize,
    /// Spoke another protocol version.
    pub(super) other_version: usize,
    /// Had not proven themselves by [`HELLO_DEADLINE`], or were closed to make room.
    pub(super) stalled: usize,
    /// Times `accept` reported that descriptors, buffers or memory ran out.
    pub(super) exhausted: usize,
}

impl Refused {
    pub(super) fn hint(&self) -> String {
        let stalled = format!(
            "{{n}} connection(s) were closed for not finishing their hello within \
             {HELLO_DEADLINE:?} or to make room for newer ones (a flood of connections, or \
             something other than peercomm ranks uses this port)"
        );
        let wrong = "{n} connection(s) with a wrong secret were refused (a stale or mistyped \
                     UniqueId?)";
        let version = "{n} connection(s) spoke another bootstrap protocol version (every \
                       process must run the same peercomm)";
        let exhausted = "accepting failed {n} time(s) for want of file descriptors or memory \
                         (raise the process's open-file limit)";
        let counts = [
            (self.wrong_secret, wrong),
            (self.other_version, version),
            (self.stalled, &stalled),
            (self.exhausted, exhausted),
        ];
        let said = counts.iter().filter(|(n, _)| *n > 0);
        said.map(|(n, what)| format!("; {}", what.replace("{n}", &n.to_string())))
            .collect()
    }
}
