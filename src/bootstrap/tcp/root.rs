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

/// An error that ends the handshake, and the connection that caused it (told too).
type Fatal = (BootstrapError, Option<TcpStream>);

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
    listener
        .set_nonblocking(true)
        .map_err(|e| io_error("setting up rank 0's listener", e))?;
    let mut a = Admission {
        id,
        world,
        deadline: deadline_after(timeout),
        timeout,
        joined: (0..world).map(|_| None).collect(),
        pending: VecDeque::new(),
        refused: Refused::default(),
        accept_after: None,
    };
    let admitted = a.run(&listener);
    drop((listener, std::mem::take(&mut a.pending)));
    let others = a.joined.iter().flatten().map(|j| j.host.clone());
    let hosts: Vec<HostId> = std::iter::once(host).chain(others).collect();
    let result = admitted.and_then(|()| a.welcome(&hosts));
    let streams = a.joined.into_iter().flatten().map(|j| j.stream);
    match result {
        Ok(()) => Ok((streams.collect(), hosts)),
        Err((err, offender)) => {
            farewell(streams.chain(offender).collect(), 0, &err);
            Err(err)
        }
    }
}

/// Rank 0's admission state until every rank has proven itself.
struct Admission<'a> {
    id: &'a UniqueId,
    world: usize,
    /// The whole handshake's deadline, `timeout` from its start.
    deadline: Instant,
    timeout: Duration,
    /// Rank r's connection at r once admitted (rank 0 stays `None`).
    joined: Vec<Option<Joined>>,
    /// Oldest first: a connection goes to the back when accepted, and again when its
    /// hello has been answered.
    pending: VecDeque<Pending>,
    refused: Refused,
    /// While set, accepting pauses (`accept` ran out of descriptors or memory).
    accept_after: Option<Instant>,
}

impl Admission<'_> {
    fn absent(&self) -> Vec<usize> {
        (1..self.world)
            .filter(|&r| self.joined[r].is_none())
            .collect()
    }

    /// Accepts and reads connections until every rank is admitted, backing off while idle.
    fn run(&mut self, listener: &TcpListener) -> Result<(), Fatal> {
        let deadline = self.deadline;
        let mut idle = Duration::from_micros(50);
        let mut last_liveness = Instant::now();
        loop {
            let now = Instant::now();
            let progress = self.accept(listener, now)? | self.read_pending(now)?;
            if self.joined[1..].iter().all(Option::is_some) {
                return Ok(());
            }
            // An admitted rank that closes (it gave up) fails the handshake now rather
            // than at rank 0's deadline.
            if last_liveness.elapsed() >= Duration::from_millis(10) {
                last_liveness = Instant::now();
                self.check_alive()?;
            }
            let now = Instant::now();
            if now >= deadline {
                let hint = format!(
                    "those ranks never connected: check that they were started and call \
                     Comm::from_rank (or TcpBootstrap::connect) with this UniqueId, and can \
                     reach rank 0's address, or {RAISE_TIMEOUT}{}",
                    self.refused.hint()
                );
                let step = format!("rank 0 waiting for every rank to join at {}", self.id.addr);
                let waiting_for = self.absent();
                return Err((
                    BootstrapError::Timeout {
                        step,
                        waiting_for,
                        after: self.timeout,
                        hint,
                    },
                    None,
                ));
            }
            if progress {
                idle = Duration::from_micros(50);
            } else {
                let wake = self.accept_after.map_or(deadline, |t| t.min(deadline));
                std::thread::sleep(idle.min(wake.saturating_duration_since(now)));
                idle = (idle * 2).min(Duration::from_millis(2));
            }
        }
    }

    /// Accepts up to [`MAX_ACCEPTS_PER_ROUND`] connections; whether any came.
    fn accept(&mut self, listener: &TcpListener, now: Instant) -> Result<bool, Fatal> {
        use io::ErrorKind::*;
        self.accept_after = self.accept_after.filter(|&t| now < t);
        let mut progress = false;
        for _ in 0..MAX_ACCEPTS_PER_ROUND {
            if self.accept_after.is_some() {
                break;
            }
            match listener.accept() {
                Ok((s, _)) => {
                    progress = true;
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING {
                        self.pending.pop_front();
                        self.refused.stalled += 1;
                    }
                    self.pending.push_back(Pending::new(s, now));
                }
                Err(e) if e.kind() == WouldBlock => break,
                Err(e) if matches!(e.kind(), Interrupted | ConnectionAborted | ConnectionReset) => {
                }
                Err(e) if is_resource_exhausted(&e) => {
                    // Out of descriptors (or memory) for now: close the oldest pending
                    // connection, which frees one, and accept again a little later.
                    self.refused.exhausted += 1;
                    self.refused.stalled += usize::from(self.pending.pop_front().is_some());
                    self.accept_after = Some(now + ACCEPT_BACKOFF);
                    break;
                }
                Err(e) => {
                    let step = format!("rank 0 accepting connections on {}", self.id.addr);
                    return Err((io_error(step, e), None));
                }
            }
        }
        Ok(progress)
    }

    /// Reads what the pending connections sent and answers each whole frame; whether any
    /// connection moved on.
    fn read_pending(&mut self, now: Instant) -> Result<bool, Fatal> {
        let mut progress = false;
        for mut p in std::mem::take(&mut self.pending) {
            if now.saturating_duration_since(p.since) >= HELLO_DEADLINE {
                self.refused.stalled += 1;
                progress = true;
                continue;
            }
            match p.poll() {
                Polled::Waiting => self.pending.push_back(p),
                // Challenged, then left: a rank that could not check rank 0's proof, so
                // most likely one with another secret.
                Polled::Gone => {
                    self.refused.wrong_secret += usize::from(p.keys.is_some());
                    progress = true;
                }
                Polled::Frame(body) => {
                    self.answer(p, &body)?;
                    progress = true;
                }
            }
        }
        Ok(progress)
    }

    /// Answers a hello with a challenge, or checks a proof and admits its rank.
    fn answer(&mut self, mut p: Pending, body: &[u8]) -> Result<(), Fatal> {
        let Some(keys) = p.keys else {
            match decode_hello(body, &self.id.secret) {
                HelloVerdict::Stray => {}
                HelloVerdict::OtherVersion => self.refused.other_version += 1,
                HelloVerdict::OlderRank(version) => {
                    let detail = format!(
                        "a connection with the right secret speaks bootstrap protocol version \
                         {version}, rank 0 version {PROTOCOL_VERSION}: every process must run \
                         the same peercomm"
                    );
                    return Err((BootstrapError::Protocol { detail }, Some(p.stream)));
                }
                HelloVerdict::Challenge(leaf) => {
                    let root = nonce().map_err(|e| (e, None))?;
                    let secret = self.id.secret;
                    let keys = Keys { secret, leaf, root };
                    // A fresh connection's send buffer takes the whole challenge; one that
                    // does not is dropped.
                    let challenge = keys.challenge();
                    if matches!(p.stream.write(&challenge), Ok(n) if n == challenge.len()) {
                        p.keys = Some(keys);
                        self.pending.push_back(p);
                    }
                }
            }
            return Ok(());
        };
        let hello = match decode_proof(body, &keys) {
            ProofVerdict::Unproven => {
                self.refused.wrong_secret += 1;
                return Ok(());
            }
            ProofVerdict::Malformed(detail) => {
                let detail = format!("a connection with the right secret: {detail}");
                return Err((BootstrapError::Protocol { detail }, Some(p.stream)));
            }
            ProofVerdict::Ok(h) => h,
        };
        let (rank, got, world) = (hello.rank, hello.world, self.world);
        let err = if got != world {
            BootstrapError::WorldSizeMismatch {
                expected: world,
                got,
                rank,
            }
        } else if rank >= world {
            BootstrapError::RankOutOfRange {
                rank,
                world_size: world,
            }
        } else if rank == 0 || self.joined[rank].is_some() {
            BootstrapError::DuplicateRank { rank }
        } else {
            let (stream, host) = (p.stream, hello.host);
            self.joined[rank] = Some(Joined { stream, host, keys });
            return Ok(());
        };
        Err((err, Some(p.stream)))
    }

    /// Sends each admitted rank its signed welcome listing `hosts`, by the handshake's
    /// deadline (a last rank that came just before it still gets its welcome written).
    fn welcome(&mut self, hosts: &[HostId]) -> Result<(), Fatal> {
        let timeout = self.timeout;
        let list = encode_welcome(hosts);
        let deadline = self.deadline.max(deadline_after(MIN_WAIT));
        let mut ranks = self.joined.iter_mut().flatten().zip(1..);
        ranks.try_for_each(|(j, r)| {
            let welcome = j.keys.signed(Label::Welcome, KIND_WELCOME, &list);
            let s = &mut j.stream;
            let sent = s
                .set_nonblocking(false)
                .and_then(|()| s.set_nodelay(true))
                .and_then(|()| write_full(s, &welcome, deadline));
            sent.map_err(|e| {
                let (step, stopped) = ("welcoming every rank", "that rank stopped reading");
                let gave_up =
                    format!("that rank gave up before the last rank came; {RAISE_TIMEOUT}");
                (
                    recv_error(r, step, RecvError::Io(e), timeout, stopped, &gave_up),
                    None,
                )
            })
        })
    }

    /// Fails when an admitted rank has closed its connection.
    fn check_alive(&self) -> Result<(), Fatal> {
        let closed = |j: &Option<Joined>| {
            j.as_ref()
                .is_some_and(|j| matches!(j.stream.peek(&mut [0u8; 1]), Ok(0)))
        };
        let Some(rank) = self.joined.iter().position(closed) else {
            return Ok(());
        };
        let hint = format!(
            "that rank gave up (its own error says why: often its timeout passed before the \
             last rank came), while rank(s) {:?} had not come; start ranks closer together or \
             {RAISE_TIMEOUT}",
            self.absent()
        );
        let step = "waiting for every rank to join".into();
        Err((BootstrapError::ConnectionClosed { rank, step, hint }, None))
    }
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
