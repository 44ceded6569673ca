//! Rank 0's side of the handshake: the non-blocking accept loop, the checks of each
//! proven rank, and the welcome.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::pending::{Pending, Polled, Refused};
use crate::bootstrap::error::{io_error, BootstrapError, Result};
use crate::bootstrap::frame::{
    deadline_after, is_resource_exhausted, recv_error, write_full, RecvError, RAISE_TIMEOUT,
};
use crate::bootstrap::host::HostId;
use crate::bootstrap::id::UniqueId;
use crate::bootstrap::mac::{encode_challenge, nonce, Nonces};
use crate::bootstrap::wire::{
    decode_hello, decode_proof, encode_welcome, farewell, welcome_frame, HelloVerdict, ProofVerdict,
};
use crate::bootstrap::{
    ACCEPT_BACKOFF, HELLO_DEADLINE, MAX_ACCEPTS_PER_ROUND, MAX_PENDING, MIN_WAIT, PROTOCOL_VERSION,
};

/// A rank rank 0 has admitted.
struct Joined {
    stream: TcpStream,
    host: HostId,
    nonces: Nonces,
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
                         start ranks closer together or {RAISE_TIMEOUT}"
                    ),
                };
                return Err(fail(err, &mut joined, None));
            }
        }

        let now = Instant::now();
        if now >= deadline {
            let waiting_for = (1..world).filter(|&r| joined[r].is_none()).collect();
            let hint = format!(
                "those ranks never connected: check that they were started and call \
                 Comm::from_rank (or TcpBootstrap::connect) with this UniqueId, and can reach \
                 rank 0's address, or {RAISE_TIMEOUT}{}",
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
                    &format!("that rank gave up before the last rank came; {RAISE_TIMEOUT}"),
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
