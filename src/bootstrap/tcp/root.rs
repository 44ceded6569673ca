//! Rank 0's side of the handshake: the non-blocking accept loop, the connections not yet
//! proven (read a frame at a time), the checks of each proven rank, and the welcome.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::bootstrap::error::{io_error, BootstrapError, Result};
use crate::bootstrap::host::HostId;
use crate::bootstrap::id::UniqueId;
use crate::bootstrap::mac::{nonce, Keys, Label};
use crate::bootstrap::wire::{
    deadline_after, decode_hello, decode_proof, encode_welcome, farewell, is_resource_exhausted,
    recv_error, write_full, HelloVerdict, ProofVerdict, RecvError, RAISE_TIMEOUT,
};
use crate::bootstrap::{
    ACCEPT_BACKOFF, HEADER_BYTES, HELLO_DEADLINE, KIND_HELLO, KIND_PROOF, KIND_WELCOME,
    MAX_ACCEPTS_PER_ROUND, MAX_HELLO_BYTES, MAX_PENDING, MAX_PROOF_BYTES, MIN_WAIT,
    PROOF_FIXED_BYTES, PROTOCOL_VERSION,
};

/// A rank rank 0 has admitted.
struct Joined {
    stream: TcpStream,
    host: HostId,
    keys: Keys,
}

/// Rank 0's side of the handshake: accepts, challenges and checks connections (without
/// blocking on any one) until every rank has proven itself, then closes the listener and
/// welcomes them, all by one deadline `timeout` from now.
pub(super) fn root_handshake(
    listener: TcpListener,
    id: &UniqueId,
    world: usize,
    host: HostId,
    timeout: Duration,
) -> Result<(Vec<TcpStream>, Vec<HostId>)> {
    let deadline = deadline_after(timeout);
    let mut joined: Vec<Option<Joined>> = (0..world).map(|_| None).collect();
    // Oldest first: a connection goes to the back when accepted, and again when its
    // hello has been answered.
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut missing = world - 1;
    let mut refused = Refused::default();
    let mut accept_after: Option<Instant> = None;
    let mut idle = Duration::from_micros(50);
    let mut last_liveness = Instant::now();
    let absent = |joined: &[Option<Joined>]| -> Vec<usize> {
        (1..world).filter(|&r| joined[r].is_none()).collect()
    };
    // Gives up: tells every admitted rank (and `offender`) why, then returns `err`.
    let fail = |err: BootstrapError, joined: &mut [Option<Joined>], offender: Option<TcpStream>| {
        let admitted = joined.iter_mut().filter_map(|j| j.take().map(|j| j.stream));
        farewell(admitted.chain(offender).collect(), 0, &err);
        Err(err)
    };

    listener
        .set_nonblocking(true)
        .map_err(|e| io_error("setting up rank 0's listener", e))?;
    while missing > 0 {
        let mut progress = false;
        let now = Instant::now();
        accept_after = accept_after.filter(|&t| now < t);
        for _ in 0..MAX_ACCEPTS_PER_ROUND {
            use io::ErrorKind::*;
            if accept_after.is_some() {
                break;
            }
            match listener.accept() {
                Ok((s, _)) => {
                    progress = true;
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if pending.len() >= MAX_PENDING {
                        pending.pop_front();
                        refused.stalled += 1;
                    }
                    pending.push_back(Pending::new(s, now));
                }
                Err(e) if e.kind() == WouldBlock => break,
                Err(e) if matches!(e.kind(), Interrupted | ConnectionAborted | ConnectionReset) => {
                }
                Err(e) if is_resource_exhausted(&e) => {
                    // Out of descriptors (or memory) for now: close the oldest pending
                    // connection, which frees one, and accept again a little later.
                    refused.exhausted += 1;
                    refused.stalled += usize::from(pending.pop_front().is_some());
                    accept_after = Some(now + ACCEPT_BACKOFF);
                    break;
                }
                Err(e) => {
                    let err = io_error(format!("rank 0 accepting connections on {}", id.addr), e);
                    return fail(err, &mut joined, None);
                }
            }
        }

        for mut p in std::mem::take(&mut pending) {
            if now.saturating_duration_since(p.since) >= HELLO_DEADLINE {
                refused.stalled += 1;
                progress = true;
                continue;
            }
            let body = match p.poll() {
                Polled::Waiting => {
                    pending.push_back(p);
                    continue;
                }
                Polled::Gone => {
                    // Challenged, then left: a rank that could not check rank 0's proof,
                    // so most likely one with another secret.
                    refused.wrong_secret += usize::from(p.keys.is_some());
                    progress = true;
                    continue;
                }
                Polled::Frame(body) => body,
            };
            progress = true;
            let Some(keys) = p.keys else {
                match decode_hello(&body, &id.secret) {
                    HelloVerdict::Stray => {}
                    HelloVerdict::OtherVersion => refused.other_version += 1,
                    HelloVerdict::OlderRank(version) => {
                        let err = BootstrapError::Protocol {
                            detail: format!(
                                "a connection with the right secret speaks bootstrap \
                                 protocol version {version}, rank 0 version \
                                 {PROTOCOL_VERSION}: every process must run the same \
                                 peercomm"
                            ),
                        };
                        return fail(err, &mut joined, Some(p.stream));
                    }
                    HelloVerdict::Challenge(leaf) => {
                        let root = match nonce() {
                            Ok(n) => n,
                            Err(e) => return fail(e, &mut joined, None),
                        };
                        let keys = Keys {
                            secret: id.secret,
                            leaf,
                            root,
                        };
                        // A fresh connection's send buffer takes the whole challenge; one
                        // that does not is dropped.
                        let challenge = keys.challenge();
                        if matches!(p.stream.write(&challenge), Ok(n) if n == challenge.len()) {
                            p.keys = Some(keys);
                            pending.push_back(p);
                        }
                    }
                }
                continue;
            };
            let hello = match decode_proof(&body, &keys) {
                ProofVerdict::Unproven => {
                    refused.wrong_secret += 1;
                    continue;
                }
                ProofVerdict::Malformed(detail) => {
                    let detail = format!("a connection with the right secret: {detail}");
                    let err = BootstrapError::Protocol { detail };
                    return fail(err, &mut joined, Some(p.stream));
                }
                ProofVerdict::Ok(h) => h,
            };
            let (r, got) = (hello.rank, hello.world);
            let err = if got != world {
                Some(BootstrapError::WorldSizeMismatch {
                    expected: world,
                    got,
                    rank: r,
                })
            } else if r >= world {
                Some(BootstrapError::RankOutOfRange {
                    rank: r,
                    world_size: world,
                })
            } else if r == 0 || joined[r].is_some() {
                Some(BootstrapError::DuplicateRank { rank: r })
            } else {
                None
            };
            if let Some(err) = err {
                return fail(err, &mut joined, Some(p.stream));
            }
            joined[r] = Some(Joined {
                stream: p.stream,
                host: hello.host,
                keys,
            });
            missing -= 1;
        }
        if missing == 0 {
            break;
        }

        // An admitted rank that closes (it gave up) fails the handshake now rather than
        // at rank 0's deadline.
        if last_liveness.elapsed() >= Duration::from_millis(10) {
            last_liveness = Instant::now();
            let gone = joined.iter().position(|j| {
                j.as_ref()
                    .is_some_and(|j| matches!(j.stream.peek(&mut [0u8; 1]), Ok(0)))
            });
            if let Some(r) = gone {
                let err = BootstrapError::ConnectionClosed {
                    rank: r,
                    step: "waiting for every rank to join".into(),
                    hint: format!(
                        "that rank gave up (its own error says why: often its timeout passed \
                         before the last rank came), while rank(s) {:?} had not come; \
                         start ranks closer together or {RAISE_TIMEOUT}",
                        absent(&joined)
                    ),
                };
                return fail(err, &mut joined, None);
            }
        }

        let now = Instant::now();
        if now >= deadline {
            let hint = format!(
                "those ranks never connected: check that they were started and call \
                 Comm::from_rank (or TcpBootstrap::connect) with this UniqueId, and can reach \
                 rank 0's address, or {RAISE_TIMEOUT}{}",
                refused.hint()
            );
            let err = BootstrapError::Timeout {
                step: format!("rank 0 waiting for every rank to join at {}", id.addr),
                waiting_for: absent(&joined),
                after: timeout,
                hint,
            };
            return fail(err, &mut joined, None);
        }
        if progress {
            idle = Duration::from_micros(50);
        } else {
            let wake = accept_after.map_or(deadline, |t| t.min(deadline));
            std::thread::sleep(idle.min(wake.saturating_duration_since(now)));
            idle = (idle * 2).min(Duration::from_millis(2));
        }
    }
    drop((listener, pending));

    let joined: Vec<Joined> = joined.into_iter().skip(1).flatten().collect();
    let mut hosts = vec![host];
    hosts.extend(joined.iter().map(|j| j.host.clone()));
    let list = encode_welcome(&hosts);
    // The handshake's own deadline; a last rank that came just before it still gets its
    // welcome written.
    let send_deadline = deadline.max(deadline_after(MIN_WAIT));
    let mut streams = Vec::with_capacity(world - 1);
    let mut failure = None;
    for (i, j) in joined.into_iter().enumerate() {
        let mut s = j.stream;
        if failure.is_none() {
            let welcome = j.keys.signed(Label::Welcome, KIND_WELCOME, &list);
            let sent = s
                .set_nonblocking(false)
                .and_then(|()| s.set_nodelay(true))
                .and_then(|()| write_full(&mut s, &welcome, send_deadline));
            failure = sent.err().map(|e| {
                recv_error(
                    i + 1,
                    "welcoming every rank",
                    RecvError::Io(e),
                    timeout,
                    "that rank stopped reading",
                    &format!("that rank gave up before the last rank came; {RAISE_TIMEOUT}"),
                )
            });
        }
        streams.push(s);
    }
    if let Some(err) = failure {
        farewell(streams, 0, &err);
        return Err(err);
    }
    Ok((streams, hosts))
}

/// A connection rank 0 has accepted that has not proven itself yet (non-blocking).
struct Pending {
    stream: TcpStream,
    /// When it was accepted: it must have proven itself by [`HELLO_DEADLINE`] after.
    since: Instant,
    buf: Vec<u8>,
    want: usize,
    /// `None` until its hello came; then the keys of the challenge sent to it.
    keys: Option<Keys>,
}

enum Polled {
    Waiting,
    Gone,
    /// The body of the frame this stage expects (a hello, then a proof).
    Frame(Vec<u8>),
}

impl Pending {
    fn new(stream: TcpStream, since: Instant) -> Self {
        Self {
            stream,
            since,
            buf: Vec::new(),
            want: HEADER_BYTES,
            keys: None,
        }
    }

    fn poll(&mut self) -> Polled {
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
struct Refused {
    /// Challenged, then gave a wrong proof or closed (a rank with another secret).
    wrong_secret: usize,
    /// Spoke another protocol version.
    other_version: usize,
    /// Had not proven themselves by [`HELLO_DEADLINE`], or were closed to make room.
    stalled: usize,
    /// Times `accept` reported that descriptors, buffers or memory ran out.
    exhausted: usize,
}

impl Refused {
    fn hint(&self) -> String {
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
