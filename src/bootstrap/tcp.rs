//! [`TcpBootstrap`]: the built-in bootstrap, a star of TCP connections through rank 0: its
//! arguments, state, first failure and the all-gather over the star.

mod leaf;
mod root;

use std::fmt;
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::error::{io_error, BootstrapError, Result};
use super::host::{host_identity, HostId};
use super::id::{claim_listener, UniqueId};
use super::wire::{
    check_frame_len, deadline_after, expect_data, explain_closed, farewell, is_timeout, read_frame,
    recv_error, write_frame, RecvError, RAISE_TIMEOUT,
};
use super::{KIND_DATA, LATE_GRACE, MAX_HOST_ID_BYTES, MAX_WORLD_SIZE, MIN_WAIT};
use leaf::leaf_handshake;
use root::root_handshake;

/// The built-in [`Bootstrap`](super::Bootstrap): TCP connections from every rank to rank 0,
/// on which both sides prove they know the [`UniqueId`]'s secret, then checked by rank and
/// world size. Thread-safe: operations are serialised on an internal lock (every rank must
/// still make the same sequence of calls). Dropping it closes its connections; a peer still
/// in an operation then fails with [`BootstrapError::ConnectionClosed`].
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
    /// process's `host_identity`. Rank 0 calls it in the process that made `id` (or, for
    /// a released id, on the host it names). `timeout` bounds the whole handshake, with
    /// retries, then each operation ([`TcpBootstrap::set_timeout`]). A listener that
    /// cannot prove the secret is [`BootstrapError::UnverifiedRankZero`]. A world of one
    /// opens no connection.
    pub fn connect(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self> {
        Self::connect_with_host(id, rank, world_size, timeout, host_identity())
    }

    /// As [`TcpBootstrap::connect`], announcing `host` as this rank's host (tests that
    /// pretend threads run on different hosts; engines with their own notion of host).
    pub fn connect_with_host(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        host: HostId,
    ) -> Result<Self> {
        let (len, max) = (host.0.len(), MAX_HOST_ID_BYTES);
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            let max = MAX_WORLD_SIZE;
            return Err(BootstrapError::InvalidWorldSize { world_size, max });
        } else if rank >= world_size {
            return Err(BootstrapError::RankOutOfRange { rank, world_size });
        } else if len > max {
            return Err(BootstrapError::HostIdTooLong { len, max });
        }
        let (links, host_ids) = if rank > 0 {
            let (stream, hosts) = leaf_handshake(id, rank, world_size, &host, timeout)?;
            (Links::Leaf(stream), hosts)
        } else if world_size == 1 {
            claim_listener(id)?; // closes the listener of an id made here
            (Links::Alone, vec![host])
        } else {
            let listener = claim_listener(id)?.map_or_else(|| TcpListener::bind(id.addr), Ok);
            let listener = listener.map_err(|e| {
                let step = format!(
                    "rank 0 listening on {} (this id was made in another process: rank 0 must \
                     run where UniqueId::new ran, or that process must call UniqueId::release \
                     first)",
                    id.addr
                );
                io_error(step, e)
            })?;
            let (streams, hosts) = root_handshake(listener, id, world_size, host, timeout)?;
            (Links::Root(streams), hosts)
        };
        let poisoned = None;
        let state = Mutex::new(State {
            links,
            timeout,
            poisoned,
        });
        Ok(Self {
            rank,
            world_size,
            host_ids,
            state,
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

    /// An all-gather under `timeout`, else the configured one (unchanged for later calls).
    /// A failure poisons the bootstrap and spends at most 200 ms telling the peers why; a
    /// gone peer fails it at once. It waits for the internal lock.
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

bootstrap_via_gather!(TcpBootstrap, |self| self.rank, self.world_size);

/// Why a rank's connection closed, or its writes timed out, mid all-gather.
const GONE: &str = "that rank's process ended or dropped its bootstrap";
const STOPPED: &str = "that rank stopped reading";

/// Rank 0's all-gather: reads every rank's frame in rank order (naming every rank that
/// is late, not only the first), then relays them.
fn root_all_gather(
    streams: &mut [TcpStream],
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_frame_len(mine.len())?;
    let deadline = deadline_after(timeout);
    let step = "rank 0 was gathering every rank's bytes";
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
            Err(e) => Err(recv_error(r, step, e, timeout, "", GONE)),
        };
        out.push(got.unwrap_or_else(|e| {
            failure.get_or_insert(e);
            Vec::new()
        }));
    }
    if let Some(mut e) = failure {
        if let BootstrapError::PeerFailed { message: m, .. }
        | BootstrapError::ConnectionClosed { hint: m, .. } = &mut e
        {
            if !missing.is_empty() {
                let late = "; rank 0 had not heard from rank(s)";
                m.push_str(&format!("{late} {missing:?} in this all_gather by then"));
            }
        }
        return Err(e);
    }
    if !missing.is_empty() {
        return Err(BootstrapError::Timeout {
            step: step.into(),
            waiting_for: missing,
            after: timeout,
            hint: format!(
                "those ranks did not reach this all_gather: every rank must make the same \
                 sequence of bootstrap calls; {RAISE_TIMEOUT} if a rank is legitimately slow"
            ),
        });
    }
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        for (src, bytes) in out.iter().enumerate() {
            if src != r {
                write_frame(s, KIND_DATA, bytes, deadline).map_err(|e| {
                    let (step, stopped) = ("rank 0 sending the gathered bytes", STOPPED);
                    recv_error(r, step, RecvError::Io(e), timeout, stopped, GONE)
                })?;
            }
        }
    }
    Ok(out)
}

/// Rank r's all-gather: sends its frame, then reads the others'.
fn leaf_all_gather(
    s: &mut TcpStream,
    rank: usize,
    world: usize,
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    check_frame_len(mine.len())?;
    let deadline = deadline_after(timeout);
    let step = "this rank was in an all_gather through rank 0";
    let timeout_hint = "rank 0 has not relayed every rank's bytes: rank 0 or another rank \
                        did not reach this all_gather (rank 0's own error names it); every \
                        rank must make the same sequence of bootstrap calls";
    let closed_hint = "rank 0's process ended or dropped its bootstrap";
    let failed = |e| recv_error(0, step, e, timeout, timeout_hint, closed_hint);
    if let Err(e) = write_frame(s, KIND_DATA, mine, deadline) {
        return Err(explain_closed(s, failed(RecvError::Io(e))));
    }
    let mut out = Vec::with_capacity(world);
    for src in 0..world {
        out.push(match src == rank {
            true => mine.to_vec(),
            false => expect_data(0, read_frame(s, deadline).map_err(failed)?)?,
        });
    }
    Ok(out)
}
