//! [`TcpBootstrap`]: the built-in [`Bootstrap`], a star of TCP connections through
//! rank 0, and both sides of its handshake and all-gather.

use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::{io_error, BootstrapError, Result};
use super::frame::{
    check_frame_len, deadline_after, is_closed, is_resource_exhausted, is_timeout, read_frame,
    recv_error, write_frame, write_full, RecvError,
};
use super::host::{host_identity, HostId};
use super::id::{claim_listener, UniqueId};
use super::mac::{check_challenge, encode_challenge, nonce, Nonces};
use super::wire::{
    decode_error, decode_hello, decode_proof, decode_welcome, encode_hello, encode_proof,
    encode_welcome, expect_data, explain_closed, farewell, welcome_frame, HelloVerdict,
    ProofVerdict,
};
use super::{
    Bootstrap, ACCEPT_BACKOFF, BOOTSTRAP_ADDR_ENV, HEADER_BYTES, HELLO_DEADLINE, KIND_CHALLENGE,
    KIND_DATA, KIND_ERROR, KIND_HELLO, KIND_PROOF, KIND_WELCOME, LATE_GRACE, MAX_ACCEPTS_PER_ROUND,
    MAX_HELLO_BYTES, MAX_HOST_ID_BYTES, MAX_PENDING, MAX_PROOF_BYTES, MAX_WORLD_SIZE, MIN_WAIT,
    PROOF_FIXED_BYTES, PROTOCOL_VERSION,
};

/// The built-in [`Bootstrap`]: TCP connections from every rank to rank 0, on which both
/// sides prove they know the [`UniqueId`]'s secret, then checked by the world size and
/// a configuration checksum.
///
/// Thread-safe: operations are serialised on an internal lock (but every rank must
/// still make the same sequence of calls). Dropping it closes its connections; a peer
/// still in an operation then fails with [`BootstrapError::ConnectionClosed`].
pub struct TcpBootstrap {
    rank: usize,
    world_size: usize,
    host_ids: Vec<HostId>,
    state: Mutex<State>,
}

struct State {
    links: Links,
    timeout: Duration,
    poisoned: Option<BootstrapError>,
}

enum Links {
    /// World of one: no connections.
    Alone,
    /// Rank 0: the connection to rank `i + 1` at `i`.
    Root(Vec<TcpStream>),
    /// Rank r > 0: the connection to rank 0.
    Leaf(TcpStream),
    /// After a failure.
    Closed,
}

impl fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpBootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("host_ids", &self.host_ids)
            .finish_non_exhaustive()
    }
}

impl TcpBootstrap {
    /// Joins the communicator `id` names as `rank` of `world_size` ranks, with this
    /// process's [`host_identity`]. Rank 0 must call it in the process that made `id`
    /// (or, for an id made elsewhere and released there, on the host whose address it
    /// names). `config_checksum` is any digest of the configuration every rank must
    /// share; rank 0 refuses ranks whose checksum differs. `timeout` bounds the whole
    /// handshake (from this call on: connecting, with retries, proving the secret both
    /// ways and the welcome, on every rank) and, afterwards, each operation
    /// ([`TcpBootstrap::set_timeout`] changes that).
    ///
    /// A rank r > 0 refuses a listener that cannot prove it knows the secret with
    /// [`BootstrapError::UnverifiedRankZero`]; when rank 0's port closes its connection
    /// before the welcome, it connects again within `timeout`.
    ///
    /// A world of one opens no connection.
    pub fn connect(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        config_checksum: u64,
        timeout: Duration,
    ) -> Result<Self> {
        Self::connect_with_host(
            id,
            rank,
            world_size,
            config_checksum,
            timeout,
            host_identity(),
        )
    }

    /// As [`TcpBootstrap::connect`], announcing `host` as this rank's host (tests that
    /// pretend threads run on different hosts; engines with their own notion of host).
    pub fn connect_with_host(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        config_checksum: u64,
        timeout: Duration,
        host: HostId,
    ) -> Result<Self> {
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(BootstrapError::InvalidWorldSize {
                world_size,
                max: MAX_WORLD_SIZE,
            });
        }
        if rank >= world_size {
            return Err(BootstrapError::RankOutOfRange { rank, world_size });
        }
        if host.0.len() > MAX_HOST_ID_BYTES {
            return Err(BootstrapError::HostIdTooLong {
                len: host.0.len(),
                max: MAX_HOST_ID_BYTES,
            });
        }
        let (links, host_ids) = if rank == 0 {
            let listener = claim_listener(id)?;
            if world_size == 1 {
                (Links::Alone, vec![host])
            } else {
                let listener = match listener {
                    Some(l) => l,
                    None => TcpListener::bind(id.addr).map_err(|e| {
                        io_error(
                            format!(
                                "rank 0 listening on {} (this id was made in another \
                                 process: rank 0 must run where UniqueId::new ran, or that \
                                 process must release() the id first)",
                                id.addr
                            ),
                            e,
                        )
                    })?,
                };
                let (streams, hosts) =
                    root_handshake(listener, id, world_size, config_checksum, host, timeout)?;
                (Links::Root(streams), hosts)
            }
        } else {
            let (stream, hosts) =
                leaf_handshake(id, rank, world_size, config_checksum, &host, timeout)?;
            (Links::Leaf(stream), hosts)
        };
        Ok(Self {
            rank,
            world_size,
            host_ids,
            state: Mutex::new(State {
                links,
                timeout,
                poisoned: None,
            }),
        })
    }

    /// Every rank's [`HostId`], in rank order, as announced in the handshake.
    pub fn host_ids(&self) -> &[HostId] {
        &self.host_ids
    }

    /// The deadline of each later operation.
    pub fn timeout(&self) -> Duration {
        self.lock().timeout
    }

    /// Sets the deadline of each later operation (for example longer, when ranks may
    /// spend a while between two all-gathers).
    pub fn set_timeout(&self, timeout: Duration) {
        self.lock().timeout = timeout;
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(mine, None)
    }

    /// An all-gather of nothing under `timeout` instead of [`TcpBootstrap::timeout`]
    /// (which stays as it was for later calls). It gives up after `timeout`, then spends
    /// at most a further 200 ms telling the peers why; a peer that is gone (its
    /// connection closed) fails it at once. A failure poisons the bootstrap, as any
    /// failed operation does. It waits for the internal lock like every operation, so a
    /// call running on another thread delays it.
    fn barrier_within(&self, timeout: Duration) -> Result<()> {
        self.gather(&[], Some(timeout)).map(|_| ())
    }
}

impl TcpBootstrap {
    /// An all-gather under `timeout`, or under the configured timeout when `None`.
    fn gather(&self, mine: &[u8], timeout: Option<Duration>) -> Result<Vec<Vec<u8>>> {
        let mut state = self.lock();
        if let Some(first) = &state.poisoned {
            return Err(BootstrapError::Poisoned {
                first: Box::new(first.clone()),
            });
        }
        let timeout = timeout.unwrap_or(state.timeout);
        let result = match &mut state.links {
            Links::Alone => Ok(vec![mine.to_vec()]),
            Links::Root(streams) => root_all_gather(streams, mine, timeout),
            Links::Leaf(s) => leaf_all_gather(s, self.rank, self.world_size, mine, timeout),
            Links::Closed => unreachable!("closed links are always poisoned"),
        };
        if let Err(e) = &result {
            let streams = match std::mem::replace(&mut state.links, Links::Closed) {
                Links::Root(streams) => streams,
                Links::Leaf(s) => vec![s],
                Links::Alone | Links::Closed => Vec::new(),
            };
            state.poisoned = Some(e.clone());
            farewell(streams, self.rank, e);
        }
        result
    }
}

/// Why a rank r > 0 failed to reach rank 0 by its deadline, with what it saw on the way.
fn leaf_timeout_hint(addr: SocketAddr, refused: usize, dropped: usize, admitted: bool) -> String {
    let mut hint = if admitted {
        "rank 0 has not admitted every rank yet: some rank never came (rank 0's own error \
         names it), or rank 0 never called connect; raise the timeout if ranks start far \
         apart"
            .to_string()
    } else if refused > 0 {
        format!(
            "the connection was refused {refused} time(s), nothing listens there: the \
             UniqueId is stale (its communicator already formed or ended; make a new one \
             per communicator) or rank 0 never started"
        )
    } else {
        "rank 0 could not be reached, or did not answer: check the address, routes and \
         firewalls, that rank 0 called connect with this UniqueId, or raise the timeout"
            .to_string()
    };
    if dropped > 0 {
        hint.push_str(&format!(
            "; rank 0's port closed this rank's connection {dropped} time(s) before \
             welcoming it (rank 0 was flooded with connections, restarted, or failed: its \
             own error says why; or it runs an older peercomm)"
        ));
    }
    if addr.ip().is_loopback() {
        hint.push_str(&format!(
            "; the id names a loopback address, which only serves ranks on rank 0's host: \
             for other hosts set {BOOTSTRAP_ADDR_ENV} on rank 0"
        ));
    }
    hint
}

/// Tries to connect to rank 0 until `deadline`, retrying refusals with backoff (rank 0
/// may not be listening yet when it runs in a process that did not make the id).
fn connect_with_retry(
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
    dropped: usize,
) -> Result<TcpStream> {
    let step = format!("connecting to rank 0 at {addr}");
    let mut refused = 0usize;
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(BootstrapError::Timeout {
                step,
                waiting_for: vec![0],
                after: timeout,
                hint: leaf_timeout_hint(addr, refused, dropped, false),
            });
        }
        match TcpStream::connect_timeout(&addr, left.max(MIN_WAIT)) {
            Ok(s) => return Ok(s),
            Err(e) => match e.kind() {
                io::ErrorKind::ConnectionRefused => refused += 1,
                io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::TimedOut
                | io::ErrorKind::WouldBlock
                | io::ErrorKind::Interrupted => {}
                _ if is_resource_exhausted(&e) => {}
                _ => return Err(io_error(step, e)),
            },
        }
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

/// Rank r's side of the handshake, all of it (connecting, proving, being welcomed) by one
/// deadline `timeout` from now. Connects again when rank 0's port closes the connection
/// before the welcome (rank 0 evicted it, or was not ready); refuses, without trying
/// again, a listener that cannot prove it knows the secret.
fn leaf_handshake(
    id: &UniqueId,
    rank: usize,
    world: usize,
    checksum: u64,
    host: &HostId,
    timeout: Duration,
) -> Result<(TcpStream, Vec<HostId>)> {
    let deadline = deadline_after(timeout);
    let mut dropped = 0usize;
    let mut backoff = Duration::from_millis(5);
    loop {
        let mut s = connect_with_retry(id.addr, deadline, timeout, dropped)?;
        let _ = s.set_nodelay(true);
        let attempt = Attempt {
            id,
            deadline,
            timeout,
            dropped,
        };
        if let Some(hosts) = attempt.run(&mut s, rank, world, checksum, host)? {
            return Ok((s, hosts));
        }
        dropped += 1;
        drop(s);
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

/// One connection's try at rank r's handshake.
struct Attempt<'a> {
    id: &'a UniqueId,
    deadline: Instant,
    timeout: Duration,
    /// Earlier connections closed before the welcome.
    dropped: usize,
}

impl Attempt<'_> {
    const STEP: &'static str = "the handshake with rank 0";

    /// The welcome's hosts, `None` when the connection closed before the welcome (try
    /// again), or the error that ends the handshake.
    fn run(
        &self,
        s: &mut TcpStream,
        rank: usize,
        world: usize,
        checksum: u64,
        host: &HostId,
    ) -> Result<Option<Vec<HostId>>> {
        let secret = &self.id.secret;
        let leaf_nonce = nonce()?;
        if !self.send(s, &encode_hello(&leaf_nonce), false)? {
            return Ok(None);
        }
        let Some((kind, body)) = self.receive(s, false)? else {
            return Ok(None);
        };
        let nonces = match kind {
            KIND_CHALLENGE => check_challenge(&body, secret, &leaf_nonce)
                .map_err(|detail| self.unverified(detail.to_string()))?,
            KIND_ERROR => {
                return Err(self.unverified(format!(
                    "it sent an error frame instead of a challenge: {}",
                    decode_error(0, &body)
                )))
            }
            k => {
                return Err(self.unverified(format!(
                    "it sent a frame of kind {k} where rank 0's challenge belongs"
                )))
            }
        };
        let proof = encode_proof(secret, &nonces, rank, world, checksum, host);
        if !self.send(s, &proof, true)? {
            return Ok(None);
        }
        let Some((kind, body)) = self.receive(s, true)? else {
            return Ok(None);
        };
        match kind {
            KIND_WELCOME => Ok(Some(decode_welcome(&body, world, secret, &nonces)?)),
            KIND_ERROR => Err(decode_error(0, &body)),
            k => Err(BootstrapError::Protocol {
                detail: format!("rank 0 sent a frame of kind {k} where a welcome belongs"),
            }),
        }
    }

    /// Writes `frame`; `false` when the connection was closed.
    fn send(&self, s: &mut TcpStream, frame: &[u8], proven: bool) -> Result<bool> {
        match write_full(s, frame, self.deadline) {
            Ok(()) => Ok(true),
            Err(e) if is_closed(&e) => Ok(false),
            Err(e) => Err(self.failed(RecvError::Io(e), proven)),
        }
    }

    /// Reads a frame; `None` when the connection was closed first.
    fn receive(&self, s: &mut TcpStream, proven: bool) -> Result<Option<(u8, Vec<u8>)>> {
        match read_frame(s, self.deadline) {
            Ok(f) => Ok(Some(f)),
            Err(RecvError::Io(e)) if is_closed(&e) => Ok(None),
            Err(RecvError::TooLarge(len)) if !proven => Err(self.unverified(format!(
                "it announced a frame of {len} bytes where rank 0's challenge belongs"
            ))),
            Err(e) => Err(self.failed(e, proven)),
        }
    }

    fn failed(&self, e: RecvError, proven: bool) -> BootstrapError {
        let hint = leaf_timeout_hint(self.id.addr, 0, self.dropped, proven);
        recv_error(0, Self::STEP, e, self.timeout, &hint, "")
    }

    fn unverified(&self, detail: String) -> BootstrapError {
        BootstrapError::UnverifiedRankZero {
            addr: self.id.addr,
            detail,
            hint: "an impostor or a stale process holds rank 0's port (a program bound it \
                   after the id was released, or an older communicator's rank 0 still runs \
                   there), or this rank's UniqueId is not the one rank 0 made (stale or \
                   mistyped); this rank sent nothing that reveals the secret: make a new \
                   UniqueId, and check which process listens on that port"
                .into(),
        }
    }
}

/// A connection rank 0 has accepted that has not proven itself yet (non-blocking).
struct Pending {
    stream: TcpStream,
    /// When it was accepted: it must have proven itself by [`HELLO_DEADLINE`] after.
    since: Instant,
    buf: Vec<u8>,
    want: usize,
    /// `None` until its hello came; then the nonces of the challenge sent to it.
    nonces: Option<Nonces>,
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
            nonces: None,
        }
    }

    fn poll(&mut self) -> Polled {
        let (kind, min, max) = match self.nonces {
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

/// A rank rank 0 has admitted.
struct Joined {
    stream: TcpStream,
    host: HostId,
    nonces: Nonces,
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
        let mut hint = String::new();
        if self.wrong_secret > 0 {
            hint.push_str(&format!(
                "; {} connection(s) with a wrong secret were refused (a stale or mistyped \
                 UniqueId?)",
                self.wrong_secret
            ));
        }
        if self.other_version > 0 {
            hint.push_str(&format!(
                "; {} connection(s) spoke another bootstrap protocol version (every process \
                 must run the same peercomm)",
                self.other_version
            ));
        }
        if self.stalled > 0 {
            hint.push_str(&format!(
                "; {} connection(s) were closed for not finishing their hello within \
                 {HELLO_DEADLINE:?} or to make room for newer ones (a flood of connections, \
                 or something other than peercomm ranks uses this port)",
                self.stalled
            ));
        }
        if self.exhausted > 0 {
            hint.push_str(&format!(
                "; accepting failed {} time(s) for want of file descriptors or memory \
                 (raise the process's open-file limit)",
                self.exhausted
            ));
        }
        hint
    }
}

/// Rank 0's side of the handshake: accepts, challenges and checks connections (without
/// blocking on any one) until every rank has proven itself, then closes the listener and
/// welcomes them, all by one deadline `timeout` from now.
fn root_handshake(
    listener: TcpListener,
    id: &UniqueId,
    world: usize,
    checksum: u64,
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

    // Gives up: tells every admitted rank (and `offender`) why, then returns `err`.
    let fail =
        |err: BootstrapError, joined: &mut Vec<Option<Joined>>, offender: Option<TcpStream>| {
            let streams = joined
                .iter_mut()
                .filter_map(|j| j.take().map(|j| j.stream))
                .chain(offender)
                .collect();
            farewell(streams, 0, &err);
            err
        };

    listener
        .set_nonblocking(true)
        .map_err(|e| io_error("setting up rank 0's listener", e))?;
    while missing > 0 {
        let mut progress = false;
        let now = Instant::now();
        if accept_after.is_some_and(|t| now >= t) {
            accept_after = None;
        }
        let mut accepts = if accept_after.is_some() {
            0
        } else {
            MAX_ACCEPTS_PER_ROUND
        };
        while accepts > 0 {
            accepts -= 1;
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
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                    ) => {}
                Err(e) if is_resource_exhausted(&e) => {
                    // Out of descriptors (or memory) for now: close the oldest pending
                    // connection, which frees one, and accept again a little later.
                    refused.exhausted += 1;
                    if pending.pop_front().is_some() {
                        refused.stalled += 1;
                    }
                    accept_after = Some(now + ACCEPT_BACKOFF);
                    break;
                }
                Err(e) => {
                    let err = io_error(format!("rank 0 accepting connections on {}", id.addr), e);
                    return Err(fail(err, &mut joined, None));
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
                    if p.nonces.is_some() {
                        // Challenged, then left: a rank that could not check rank 0's
                        // proof, so most likely one with another secret.
                        refused.wrong_secret += 1;
                    }
                    progress = true;
                    continue;
                }
                Polled::Frame(body) => body,
            };
            progress = true;
            let Some(nonces) = p.nonces else {
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
                        return Err(fail(err, &mut joined, Some(p.stream)));
                    }
                    HelloVerdict::Challenge(leaf) => {
                        let nonces = Nonces {
                            leaf,
                            root: match nonce() {
                                Ok(n) => n,
                                Err(e) => return Err(fail(e, &mut joined, None)),
                            },
                        };
                        // A fresh connection's send buffer takes the whole challenge; one
                        // that does not is dropped.
                        let challenge = encode_challenge(&id.secret, &nonces);
                        if matches!(p.stream.write(&challenge), Ok(n) if n == challenge.len()) {
                            p.nonces = Some(nonces);
                            pending.push_back(p);
                        }
                    }
                }
                continue;
            };
            let hello = match decode_proof(&body, &id.secret, &nonces) {
                ProofVerdict::Unproven => {
                    refused.wrong_secret += 1;
                    continue;
                }
                ProofVerdict::Malformed(detail) => {
                    let err = BootstrapError::Protocol {
                        detail: format!("a connection with the right secret: {detail}"),
                    };
                    return Err(fail(err, &mut joined, Some(p.stream)));
                }
                ProofVerdict::Ok(h) => h,
            };
            let r = hello.rank;
            let err = if hello.world != world {
                Some(BootstrapError::WorldSizeMismatch {
                    expected: world,
                    got: hello.world,
                    rank: r,
                })
            } else if r >= world {
                Some(BootstrapError::RankOutOfRange {
                    rank: r,
                    world_size: world,
                })
            } else if r == 0 || joined[r].is_some() {
                Some(BootstrapError::DuplicateRank { rank: r })
            } else if hello.checksum != checksum {
                Some(BootstrapError::ConfigMismatch {
                    rank: r,
                    expected: checksum,
                    got: hello.checksum,
                })
            } else {
                None
            };
            if let Some(err) = err {
                return Err(fail(err, &mut joined, Some(p.stream)));
            }
            joined[r] = Some(Joined {
                stream: p.stream,
                host: hello.host,
                nonces,
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
                let absent: Vec<usize> = (1..world).filter(|&r| joined[r].is_none()).collect();
                let err = BootstrapError::ConnectionClosed {
                    rank: r,
                    step: "waiting for every rank to join".into(),
                    hint: format!(
                        "that rank gave up (its own error says why: often its timeout passed \
                         before the last rank came), while rank(s) {absent:?} had not come; \
                         start ranks closer together or raise the timeout"
                    ),
                };
                return Err(fail(err, &mut joined, None));
            }
        }

        let now = Instant::now();
        if now >= deadline {
            let waiting_for = (1..world).filter(|&r| joined[r].is_none()).collect();
            let hint = format!(
                "those ranks never connected: check that they were started, with this \
                 UniqueId, and can reach rank 0's address, or raise the timeout{}",
                refused.hint()
            );
            let err = BootstrapError::Timeout {
                step: format!("rank 0 waiting for every rank to join at {}", id.addr),
                waiting_for,
                after: timeout,
                hint,
            };
            return Err(fail(err, &mut joined, None));
        }
        if progress {
            idle = Duration::from_micros(50);
        } else {
            let mut wake = deadline;
            if let Some(t) = accept_after {
                wake = wake.min(t);
            }
            std::thread::sleep(idle.min(wake.saturating_duration_since(now)));
            idle = (idle * 2).min(Duration::from_millis(2));
        }
    }
    drop(listener);
    drop(pending);

    let mut hosts = vec![host];
    let mut admitted = Vec::with_capacity(world - 1);
    for j in joined.into_iter().skip(1).flatten() {
        hosts.push(j.host);
        admitted.push((j.stream, j.nonces));
    }
    let list = encode_welcome(&hosts);
    // The handshake's own deadline; a last rank that came just before it still gets its
    // welcome written.
    let send_deadline = deadline.max(deadline_after(MIN_WAIT));
    let mut streams = Vec::with_capacity(world - 1);
    let mut failure = None;
    for (i, (mut s, nonces)) in admitted.into_iter().enumerate() {
        if failure.is_none() {
            let welcome = welcome_frame(&id.secret, &nonces, &list);
            let sent = s
                .set_nonblocking(false)
                .and_then(|()| s.set_nodelay(true))
                .and_then(|()| write_full(&mut s, &welcome, send_deadline));
            if let Err(e) = sent {
                failure = Some(recv_error(
                    i + 1,
                    "welcoming every rank",
                    RecvError::Io(e),
                    timeout,
                    "that rank stopped reading",
                    "that rank gave up before the last rank came; raise the timeout",
                ));
            }
        }
        streams.push(s);
    }
    if let Some(err) = failure {
        farewell(streams, 0, &err);
        return Err(err);
    }
    Ok((streams, hosts))
}

fn root_all_gather(
    streams: &mut [TcpStream],
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_frame_len(mine.len())?;
    let deadline = deadline_after(timeout);
    let step = "rank 0 gathering every rank's bytes";
    let mut out = Vec::with_capacity(streams.len() + 1);
    out.push(mine.to_vec());
    // After the first rank that is late or fails, the later ranks get only a short grace,
    // so that the error names every rank that had not reached this all_gather.
    let mut missing = Vec::new();
    let mut failure = None;
    let mut grace_end = None;
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        let by = if missing.is_empty() && failure.is_none() {
            deadline
        } else {
            let end = *grace_end.get_or_insert_with(|| deadline_after(LATE_GRACE));
            end.max(deadline_after(MIN_WAIT))
        };
        let got = match read_frame(s, by) {
            Ok(f) => expect_data(r, f),
            Err(RecvError::Io(e)) if is_timeout(&e) => {
                missing.push(r);
                Ok(Vec::new())
            }
            Err(e) => Err(recv_error(
                r,
                step,
                e,
                timeout,
                "",
                "that rank's process ended or dropped its bootstrap",
            )),
        };
        match got {
            Ok(bytes) => out.push(bytes),
            Err(e) => {
                failure.get_or_insert(e);
                out.push(Vec::new());
            }
        }
    }
    let late =
        format!("; rank 0 had not heard from rank(s) {missing:?} in this all_gather by then");
    match failure {
        Some(BootstrapError::PeerFailed { rank, message }) if !missing.is_empty() => {
            return Err(BootstrapError::PeerFailed {
                rank,
                message: message + &late,
            })
        }
        Some(BootstrapError::ConnectionClosed { rank, step, hint }) if !missing.is_empty() => {
            return Err(BootstrapError::ConnectionClosed {
                rank,
                step,
                hint: hint + &late,
            })
        }
        Some(e) => return Err(e),
        None if !missing.is_empty() => {
            return Err(BootstrapError::Timeout {
                step: step.into(),
                waiting_for: missing,
                after: timeout,
                hint: "those ranks did not reach this all_gather: every rank must make the \
                       same sequence of bootstrap calls; raise the timeout (set_timeout) if \
                       a rank is legitimately slow"
                    .into(),
            })
        }
        None => {}
    }
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        for (src, bytes) in out.iter().enumerate() {
            if src != r {
                write_frame(s, KIND_DATA, bytes, deadline).map_err(|e| {
                    recv_error(
                        r,
                        "rank 0 sending the gathered bytes",
                        RecvError::Io(e),
                        timeout,
                        "that rank stopped reading",
                        "that rank's process ended or dropped its bootstrap",
                    )
                })?;
            }
        }
    }
    Ok(out)
}

fn leaf_all_gather(
    s: &mut TcpStream,
    rank: usize,
    world: usize,
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_frame_len(mine.len())?;
    let deadline = deadline_after(timeout);
    let step = "an all_gather through rank 0";
    let timeout_hint = "rank 0 has not relayed every rank's bytes: rank 0 or another rank \
                        did not reach this all_gather (rank 0's own error names it); every \
                        rank must make the same sequence of bootstrap calls";
    let closed_hint = "rank 0's process ended or dropped its bootstrap";
    write_frame(s, KIND_DATA, mine, deadline).map_err(|e| {
        explain_closed(
            s,
            recv_error(
                0,
                step,
                RecvError::Io(e),
                timeout,
                timeout_hint,
                closed_hint,
            ),
        )
    })?;
    let mut out = Vec::with_capacity(world);
    for src in 0..world {
        if src == rank {
            out.push(mine.to_vec());
            continue;
        }
        let f = read_frame(s, deadline)
            .map_err(|e| recv_error(0, step, e, timeout, timeout_hint, closed_hint))?;
        out.push(expect_data(0, f)?);
    }
    Ok(out)
}
