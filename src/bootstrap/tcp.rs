//! [`TcpBootstrap`]: the built-in [`Bootstrap`], a star of TCP connections through
//! rank 0, and both sides of its handshake and all-gather.

use std::fmt;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::{io_error, BootstrapError, Result};
use super::host::{host_identity, HostId};
use super::id::{claim_listener, UniqueId};
use super::wire::{
    check_frame_len, deadline_after, decode_error, decode_hello, decode_welcome, encode_hello,
    encode_welcome, expect_data, explain_closed, farewell, frame, is_timeout, read_frame,
    recv_error, write_frame, write_full, HelloVerdict, RecvError,
};
use super::{
    Bootstrap, BOOTSTRAP_ADDR_ENV, HEADER_BYTES, KIND_DATA, KIND_ERROR, KIND_HELLO, KIND_WELCOME,
    LATE_GRACE, MAX_HELLO_BYTES, MAX_HOST_ID_BYTES, MAX_PENDING, MAX_WORLD_SIZE, MIN_WAIT,
};

/// The built-in [`Bootstrap`]: TCP connections from every rank to rank 0, checked by
/// the [`UniqueId`]'s secret, the world size and a configuration checksum.
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
    /// handshake (from this call on) and, afterwards, each operation
    /// ([`TcpBootstrap::set_timeout`] changes that).
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

/// Tries to connect to rank 0 until `deadline`, retrying refusals with backoff (rank 0
/// may not be listening yet when it runs in a process that did not make the id).
fn connect_with_retry(addr: SocketAddr, deadline: Instant, timeout: Duration) -> Result<TcpStream> {
    let step = format!("connecting to rank 0 at {addr}");
    let mut refused = 0usize;
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let mut hint = if refused > 0 {
                format!(
                    "the connection was refused {refused} time(s), nothing listens there: \
                     the UniqueId is stale (its communicator already formed or ended; make \
                     a new one per communicator) or rank 0 never started"
                )
            } else {
                "rank 0 could not be reached: check the address, routes and firewalls, \
                 or raise the timeout"
                    .to_string()
            };
            if addr.ip().is_loopback() {
                hint.push_str(&format!(
                    "; the id names a loopback address, which only serves ranks on rank \
                     0's host: for other hosts set {BOOTSTRAP_ADDR_ENV} on rank 0"
                ));
            }
            return Err(BootstrapError::Timeout {
                step,
                waiting_for: vec![0],
                after: timeout,
                hint,
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
                _ => return Err(io_error(step, e)),
            },
        }
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(100));
    }
}

fn leaf_handshake(
    id: &UniqueId,
    rank: usize,
    world: usize,
    checksum: u64,
    host: &HostId,
    timeout: Duration,
) -> Result<(TcpStream, Vec<HostId>)> {
    let deadline = deadline_after(timeout);
    let mut s = connect_with_retry(id.addr, deadline, timeout)?;
    let _ = s.set_nodelay(true);
    let step = "the handshake with rank 0";
    let timeout_hint = "rank 0 has not admitted every rank yet: some rank never came (rank \
                        0's own error names it), or rank 0 never called connect; raise the \
                        timeout if ranks start far apart";
    let closed_hint = "rank 0 dropped this connection: this rank's UniqueId secret is wrong \
                       (a stale or mistyped id, or a new communicator reusing the port), or \
                       rank 0 failed";
    let hello = encode_hello(&id.secret, rank, world, checksum, host);
    if let Err(e) = write_full(&mut s, &hello, deadline) {
        let err = recv_error(
            0,
            step,
            RecvError::Io(e),
            timeout,
            timeout_hint,
            closed_hint,
        );
        return Err(explain_closed(&mut s, err));
    }
    let (kind, body) = read_frame(&mut s, deadline)
        .map_err(|e| recv_error(0, step, e, timeout, timeout_hint, closed_hint))?;
    match kind {
        KIND_WELCOME => Ok((s, decode_welcome(&body, world)?)),
        KIND_ERROR => Err(decode_error(0, &body)),
        k => Err(BootstrapError::Protocol {
            detail: format!("rank 0 sent a frame of kind {k} where a welcome belongs"),
        }),
    }
}

/// A connection rank 0 has accepted whose hello is not complete yet (non-blocking).
struct Pending {
    stream: TcpStream,
    buf: Vec<u8>,
    want: usize,
}

enum Polled {
    Waiting,
    Gone,
    Hello(Vec<u8>),
}

impl Pending {
    fn poll(&mut self) -> Polled {
        let mut chunk = [0u8; 512];
        loop {
            if self.buf.len() == self.want {
                if self.want > HEADER_BYTES {
                    return Polled::Hello(self.buf.split_off(HEADER_BYTES));
                }
                let len = u32::from_le_bytes(self.buf[1..].try_into().expect("4")) as usize;
                if self.buf[0] != KIND_HELLO || len == 0 || len > MAX_HELLO_BYTES {
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

/// Rank 0's side of the handshake: accepts and checks hellos (without blocking on any
/// one connection) until every rank has come, then closes the listener and welcomes
/// them.
fn root_handshake(
    listener: TcpListener,
    id: &UniqueId,
    world: usize,
    checksum: u64,
    host: HostId,
    timeout: Duration,
) -> Result<(Vec<TcpStream>, Vec<HostId>)> {
    let deadline = deadline_after(timeout);
    let mut joined: Vec<Option<(TcpStream, HostId)>> = (0..world).map(|_| None).collect();
    let mut pending: Vec<Pending> = Vec::new();
    let mut missing = world - 1;
    let mut wrong_secret = 0usize;
    let mut idle = Duration::from_micros(50);
    let mut last_liveness = Instant::now();

    // Gives up: tells every admitted rank (and `offender`) why, then returns `err`.
    let fail = |err: BootstrapError,
                joined: &mut Vec<Option<(TcpStream, HostId)>>,
                offender: Option<TcpStream>| {
        let streams = joined
            .iter_mut()
            .filter_map(|j| j.take().map(|(s, _)| s))
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
        loop {
            match listener.accept() {
                Ok((s, _)) => {
                    progress = true;
                    if pending.len() < MAX_PENDING && s.set_nonblocking(true).is_ok() {
                        pending.push(Pending {
                            stream: s,
                            buf: Vec::new(),
                            want: HEADER_BYTES,
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    let err = io_error(format!("rank 0 accepting connections on {}", id.addr), e);
                    return Err(fail(err, &mut joined, None));
                }
            }
        }

        let mut i = 0;
        while i < pending.len() {
            let body = match pending[i].poll() {
                Polled::Waiting => {
                    i += 1;
                    continue;
                }
                Polled::Gone => {
                    pending.swap_remove(i);
                    progress = true;
                    continue;
                }
                Polled::Hello(body) => body,
            };
            let p = pending.swap_remove(i);
            progress = true;
            let hello = match decode_hello(&body, &id.secret) {
                HelloVerdict::Stray => continue,
                HelloVerdict::WrongSecret => {
                    wrong_secret += 1;
                    continue;
                }
                HelloVerdict::Malformed(detail) => {
                    let err = BootstrapError::Protocol {
                        detail: format!("a connection with the right secret: {detail}"),
                    };
                    return Err(fail(err, &mut joined, Some(p.stream)));
                }
                HelloVerdict::Ok(h) => h,
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
            joined[r] = Some((p.stream, hello.host));
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
                    .is_some_and(|(s, _)| matches!(s.peek(&mut [0u8; 1]), Ok(0)))
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
            let mut hint = String::from(
                "those ranks never connected: check that they were started, with this \
                 UniqueId, and can reach rank 0's address, or raise the timeout",
            );
            if wrong_secret > 0 {
                hint.push_str(&format!(
                    "; {wrong_secret} connection(s) with a wrong secret were refused (a stale \
                     or mistyped UniqueId?)"
                ));
            }
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
            std::thread::sleep(idle.min(deadline - now));
            idle = (idle * 2).min(Duration::from_millis(2));
        }
    }
    drop(listener);
    drop(pending);

    let mut hosts = vec![host];
    let mut streams = Vec::with_capacity(world - 1);
    for (s, h) in joined.into_iter().skip(1).flatten() {
        hosts.push(h);
        streams.push(s);
    }
    let welcome = frame(KIND_WELCOME, &encode_welcome(&hosts));
    let send_deadline = deadline_after(timeout);
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        let sent = s
            .set_nonblocking(false)
            .and_then(|()| s.set_nodelay(true))
            .and_then(|()| write_full(s, &welcome, send_deadline));
        if let Err(e) = sent {
            let err = recv_error(
                r,
                "welcoming every rank",
                RecvError::Io(e),
                timeout,
                "that rank stopped reading",
                "that rank gave up before the last rank came; raise the timeout",
            );
            farewell(std::mem::take(&mut streams), 0, &err);
            return Err(err);
        }
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
