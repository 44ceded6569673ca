//! Bootstrap: how the ranks of one communicator find each other and swap a few bytes.
//!
//! Before ranks in different processes can map each other's memory they must agree on
//! who is who and exchange what each needs (IPC handles, device identity, host
//! identity). This module does that once, at setup, over
//! TCP, in the manner of NCCL's `ncclUniqueId`:
//!
//! 1. Rank 0 calls [`UniqueId::new`]. That binds a TCP listener, kept in this process
//!    until rank 0 joins, and draws a 128-bit secret from the operating system.
//! 2. The id reaches every other process as text (`Display` / [`str::parse`]: 80
//!    hexadecimal characters, fit for an environment variable or a file only the user
//!    can read) or as [`UniqueId::BYTES`] bytes ([`UniqueId::to_bytes`] /
//!    [`UniqueId::from_bytes`], fit for MPI or a key-value store). Never as a
//!    command-line argument: the id holds the secret, and every local user can read a
//!    process's arguments (`/proc/<pid>/cmdline`).
//! 3. Every rank calls [`TcpBootstrap::connect`] with the id, its rank, the world size
//!    and a timeout. The other ranks connect to rank 0 (a star: rank 0 relays
//!    everything, fine for worlds of a few hundred ranks); each side proves to the
//!    other that it knows the secret (without sending it), and rank 0 checks each rank
//!    before admitting it.
//! 4. Then [`Bootstrap::all_gather`] gives every rank every rank's bytes in rank order,
//!    as many times as the caller needs (IPC handles, then checks, then a teardown
//!    [`Bootstrap::barrier`]). Every rank must make the same sequence of calls.
//!
//! ```
//! use peercomm::bootstrap::{Bootstrap, BootstrapError, TcpBootstrap, UniqueId};
//! use std::time::Duration;
//!
//! let id = UniqueId::new()?; // rank 0's process
//! let text = id.to_string(); // e.g. exported as PEERCOMM_ID for the other processes
//! let rank1 = std::thread::spawn(move || {
//!     let id: UniqueId = text.parse().unwrap();
//!     let boot = TcpBootstrap::connect(&id, 1, 2, Duration::from_secs(10)).unwrap();
//!     boot.all_gather(b"rank one").unwrap()
//! });
//! let boot = TcpBootstrap::connect(&id, 0, 2, Duration::from_secs(10))?;
//! let all = boot.all_gather(b"zero")?;
//! assert_eq!(all, vec![b"zero".to_vec(), b"rank one".to_vec()]);
//! assert_eq!(rank1.join().unwrap(), all);
//! # Ok::<(), BootstrapError>(())
//! ```
//!
//! # Which address the id holds
//!
//! [`UniqueId::new`] binds the address in the environment variable
//! `PEERCOMM_BOOTSTRAP_ADDR` ([`BOOTSTRAP_ADDR_ENV`]) when it is set (`10.0.0.5`,
//! `10.0.0.5:29500`, `[fd00::5]:29500` or `node7:29500`; port 0 or none picks a free
//! port), else `127.0.0.1:0`, which serves ranks on the same host only. For ranks on
//! several hosts set it on rank 0 to an address of rank 0's host that the others can
//! reach: peercomm does not guess among interfaces. [`UniqueId::bind`] takes the
//! address directly. An unspecified address (`0.0.0.0`, `::`) is refused, since the id
//! must name an address the others can connect to.
//!
//! The listener lives in a process-wide registry keyed by the id, from
//! [`UniqueId::new`] until rank 0's [`TcpBootstrap::connect`] (in the same process)
//! takes it, or [`UniqueId::release`] drops it. Ranks that connect before rank 0 calls
//! `connect` wait in the listener's backlog. When rank 0's `connect` returns (success or
//! failure) the listener is closed, so a stale id fails (connection refused, then a
//! typed timeout) instead of hanging, and rank 0 using the same id twice gets
//! [`BootstrapError::StaleId`]. If rank 0 runs in a process that did not make the id (a
//! launcher made it, called [`UniqueId::release`] and started the ranks), rank 0 binds
//! the id's address itself when it calls `connect`; the other ranks retry a refused
//! connection with backoff until their timeout, so it does not matter who comes first.
//!
//! # Wire format (protocol version 3)
//!
//! Every message is a frame: one kind byte, a `u32` little-endian body length, the
//! body. A body over [`MAX_FRAME_BYTES`] is refused with
//! [`BootstrapError::FrameTooLarge`] on whichever side sees it; hellos and proofs are
//! capped much lower, so a stray connection cannot make rank 0 allocate. A MAC below is
//! HMAC-SHA-256 keyed by the id's secret over a label naming the message (so that no MAC
//! serves as another), rank r's nonce, rank 0's nonce, then the bytes named; nonces are
//! 32 bytes fresh from the OS for every connection, MACs are 32 bytes and are checked in
//! constant time.
//!
//! | kind | direction | body |
//! |------|-----------|------|
//! | 1 hello | rank r → rank 0 | `"PCBS"`, protocol version `u16`, rank r's nonce |
//! | 5 challenge | rank 0 → rank r | rank 0's nonce, MAC (label "rank 0 knows the secret") |
//! | 6 proof | rank r → rank 0 | MAC (label "a rank knows the secret") over the rest: rank `u32`, world size `u32`, host id length `u16`, host id (UTF-8) |
//! | 2 welcome | rank 0 → rank r | MAC (label "rank 0 welcomes") over the rest: world size `u32`, then per rank: host id length `u16`, host id |
//! | 3 data | both ways | one rank's bytes for an all-gather |
//! | 4 error | both ways | rank where the failure began `u32`, message (UTF-8) |
//!
//! Handshake: each rank r > 0 connects and sends a hello; rank 0 answers with a
//! challenge that proves it knows the secret; rank r checks that proof and only then
//! sends its own, which also covers what it announces. The secret itself never crosses
//! the wire (protocol version 1 sent it in the hello, so anything that listened on the
//! id's port could read it). A rank r refuses a listener that does not prove the secret
//! with [`BootstrapError::UnverifiedRankZero`] (an impostor or stale process holds the
//! port, or rank r's own id is wrong: it cannot tell which), without trying again.
//!
//! Rank 0 drops, silently and without logging anything, a connection that is not a
//! peercomm hello, speaks another protocol version, leaves after its challenge or
//! answers it with a wrong proof, and keeps waiting for the real ranks (the timeout's
//! hint counts them). A rank of protocol version 1 with the right secret is told that
//! the versions differ ([`BootstrapError::Protocol`] on both sides). A right proof with
//! a wrong rank, a rank claimed twice or a different world size is fatal: rank 0 sends
//! an error frame to that rank and to every rank already admitted, then returns the
//! typed error ([`BootstrapError::DuplicateRank`], ...); the others return
//! [`BootstrapError::PeerFailed`]. When every rank has come, rank 0
//! closes its listener and sends each rank a welcome carrying every rank's [`HostId`].
//!
//! All-gather: each rank r > 0 sends one data frame; rank 0 reads them in rank order,
//! then sends each rank the other ranks' frames in rank order (rank 0 moves
//! `world_size * (world_size - 1)` frames, which is why this is a setup path only).
//!
//! # What the handshake withstands
//!
//! Rank 0 serves many connections at once without blocking on any: a connection must
//! have sent its hello and its proof within [`HELLO_DEADLINE`] (2 s) of being accepted
//! or it is closed; at most 1,024 wait at a time, and when that many do the oldest is
//! closed to make room; when `accept` reports that file descriptors, buffers or memory
//! ran out (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`) rank 0 closes its oldest waiting
//! connection, pauses accepting for 10 ms and goes on until its deadline. A rank r
//! whose connection is closed before its welcome (for any of those reasons, or because
//! rank 0 was not listening yet) connects again, within its own timeout. So idle
//! connections, half-sent headers, garbage and strangers with the wrong secret lock no
//! real rank out, and a program that took over the port after [`UniqueId::release`]
//! learns nothing and is refused.
//!
//! Not covered: a flood that opens more than 1,024 connections within one round trip of
//! a real rank can keep closing that rank's connection until its timeout; a connection
//! that arrives while the kernel's accept queue is full (128 entries, the standard
//! library's listen backlog) waits for TCP to retransmit its SYN (a second, then two,
//! ...), which the rank's timeout must allow for under such a flood; and only the
//! handshake is authenticated: later data frames are not, so the bootstrap does not
//! withstand an attacker on the path between the ranks (who can alter TCP traffic),
//! only one that can connect to rank 0's port or bind it.
//!
//! # Failures
//!
//! Every step has a deadline and ends in a [`BootstrapError`], never a hang. The
//! `timeout` given to [`TcpBootstrap::connect`] bounds the whole handshake on every rank
//! (connecting, with retries, the challenge, the proof and the welcome, all by one
//! deadline); afterwards it bounds each operation (see [`TcpBootstrap::set_timeout`]),
//! and [`Bootstrap::barrier_within`] takes its own. A rank that never comes is
//! [`BootstrapError::Timeout`] naming it on rank 0. Any rank that fails sends an error
//! frame to the ranks it talks to, so they fail at once with
//! [`BootstrapError::PeerFailed`] instead of waiting out their own timeouts (which takes
//! it at most a further 200 ms), and its bootstrap is poisoned
//! ([`BootstrapError::Poisoned`]): frame boundaries are unknown after a failure, so the
//! only way on is a new [`UniqueId`].
//!
//! # Bringing your own store
//!
//! An engine that already has a way for its processes to talk (torch.distributed, MPI,
//! its own RPC) implements [`Bootstrap`] on top of it (an all-gather of bytes) and
//! never opens a socket here; it reports its store's failures as
//! [`BootstrapError::Store`]. A store that can bound one call implements
//! [`Bootstrap::all_gather_within`] too (dropping a [`crate::Comm`] waits about a second
//! for its peers through it).
//!
//! A communicator tags every record it sends with a 10-byte header (the kind of
//! collective call and a sequence number) and checks every record it gathers, so that
//! ranks in different calls (one registers a buffer while its peer drops its
//! communicator) get [`BootstrapError::ExchangeMismatch`] on every rank instead of
//! taking each other's records for their own. A store carries the records as they are.

mod error;
mod frame;
mod host;
mod id;
mod mac;
mod tagged;
mod tcp;
mod wire;

#[cfg(test)]
mod tests;

use std::time::Duration;

pub use error::BootstrapError;
pub use host::{host_identity, HostId};
pub use id::UniqueId;
pub use tcp::TcpBootstrap;

pub(crate) use tagged::{ExchangeKind, Exchanges};

use error::Result;

/// Environment variable naming the address [`UniqueId::new`] binds: an IP address or
/// host name, with or without a port (`10.0.0.5`, `10.0.0.5:29500`, `node7:29500`).
/// Unset means `127.0.0.1:0`: ranks on this host only.
pub const BOOTSTRAP_ADDR_ENV: &str = "PEERCOMM_BOOTSTRAP_ADDR";

/// Environment variable that, when set and not empty, replaces what [`host_identity`]
/// reads from the system. Meant for tests (pretending processes of one host run on
/// different hosts) and for containers whose host identity misleads.
pub const HOST_ID_OVERRIDE_ENV: &str = "PEERCOMM_HOST_ID_OVERRIDE";

/// Largest frame body (one rank's bytes in one all-gather) the bootstrap sends or
/// accepts: 64 MiB.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// Longest [`HostId`] in bytes.
pub const MAX_HOST_ID_BYTES: usize = 1024;

/// Most ranks one [`TcpBootstrap`] serves (so that the welcome, which lists every
/// rank's [`HostId`], always fits in a frame).
pub const MAX_WORLD_SIZE: usize = 1 << 15;
const _: () = assert!(MAC_BYTES + 4 + MAX_WORLD_SIZE * (2 + MAX_HOST_ID_BYTES) <= MAX_FRAME_BYTES);

/// How long rank 0 keeps a connection that has not proven itself yet: from accepting it
/// until its proof has come (hello, challenge, proof: one round trip for a real rank).
/// A connection that takes longer is closed without a word, so idle or half-sent
/// connections cannot hold rank 0's table of pending connections; a rank that was
/// closed this way connects again (within its own timeout).
pub const HELLO_DEADLINE: Duration = Duration::from_secs(2);

/// Version of the [`UniqueId`] byte layout (its first byte).
const ID_FORMAT_VERSION: u8 = 1;
/// Version of the frames spoken after connecting (in the hello). Version 1 sent the
/// secret itself in the hello; version 2 proves it by challenge-response; version 3
/// carries no configuration checksum in the proof.
const PROTOCOL_VERSION: u16 = 3;
/// First bytes of every hello.
const MAGIC: [u8; 4] = *b"PCBS";
const SECRET_BYTES: usize = 16;
/// Random bytes each side of a handshake draws.
const NONCE_BYTES: usize = 32;
/// An HMAC-SHA-256 tag.
const MAC_BYTES: usize = 32;
/// Kind byte plus `u32` length.
const HEADER_BYTES: usize = 5;
/// Magic, version, rank r's nonce.
const HELLO_BYTES: usize = 4 + 2 + NONCE_BYTES;
/// The longest hello rank 0 reads: a version-1 hello (magic, version, secret, rank,
/// world, checksum, host id length, host id), so that a rank of that version is still
/// recognised.
const MAX_HELLO_BYTES: usize = 4 + 2 + SECRET_BYTES + 4 + 4 + 8 + 2 + MAX_HOST_ID_BYTES;
/// Rank 0's nonce and MAC.
const CHALLENGE_BYTES: usize = NONCE_BYTES + MAC_BYTES;
/// MAC, rank, world, host id length.
const PROOF_FIXED_BYTES: usize = MAC_BYTES + 4 + 4 + 2;
const MAX_PROOF_BYTES: usize = PROOF_FIXED_BYTES + MAX_HOST_ID_BYTES;
/// Error messages sent to peers are cut to this many bytes.
const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// Connections rank 0 holds before they have proven themselves; when it is full, the
/// oldest is closed to make room for a new one.
const MAX_PENDING: usize = 1024;
/// Connections rank 0 accepts in a row before it reads the pending ones again (so that
/// a stream of connections cannot keep it from its deadline).
const MAX_ACCEPTS_PER_ROUND: usize = MAX_PENDING;
/// How long rank 0 stops accepting after `accept` reported that descriptors, buffers or
/// memory ran out (it closes its oldest pending connection first).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// How long a failing rank spends telling its peers (write, then wait for them to close).
const FAREWELL: Duration = Duration::from_millis(200);
/// After one rank timed out in an all-gather, how long rank 0 still waits for the later
/// ranks, all together (to name every missing rank, not only the first); each later rank
/// still gets at least [`MIN_WAIT`].
const LATE_GRACE: Duration = Duration::from_millis(5);
/// Shortest socket timeout set (zero means "no timeout" to the OS).
const MIN_WAIT: Duration = Duration::from_millis(1);

const KIND_HELLO: u8 = 1;
const KIND_WELCOME: u8 = 2;
const KIND_DATA: u8 = 3;
const KIND_ERROR: u8 = 4;
const KIND_CHALLENGE: u8 = 5;
const KIND_PROOF: u8 = 6;

/// An all-gather of bytes among the ranks of one communicator: what peercomm needs from
/// whatever connects its processes. [`TcpBootstrap`] is the built-in one; an engine
/// with its own store (torch.distributed, MPI, an RPC layer) implements this instead.
///
/// Every rank must make the same sequence of calls.
pub trait Bootstrap: Send + Sync {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Sends `mine` to every rank and returns every rank's bytes in rank order
    /// (`result[self.rank()] == mine`). Lengths may differ between ranks.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError>;

    /// As [`Bootstrap::all_gather`], giving up after `timeout` (at most), for teardown:
    /// returns an error instead of waiting longer when a peer is gone or never comes.
    /// The default calls [`Bootstrap::all_gather`], which waits as long as the store's
    /// own deadline; stores that can bound one call should override it.
    /// [`TcpBootstrap`] does (without changing the timeout of later calls).
    fn all_gather_within(
        &self,
        mine: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let _ = timeout;
        self.all_gather(mine)
    }

    /// Returns once every rank has called it. The default is an all-gather of nothing.
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.all_gather(&[]).map(|_| ())
    }

    /// A barrier that gives up after `timeout` (at most). The default is
    /// [`Bootstrap::all_gather_within`] of nothing.
    fn barrier_within(&self, timeout: Duration) -> Result<(), BootstrapError> {
        self.all_gather_within(&[], timeout).map(|_| ())
    }
}

/// A shared or boxed bootstrap is one too (`Arc<dyn Bootstrap>` can be handed around).
impl<B: Bootstrap + ?Sized> Bootstrap for &B {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather(mine)
    }
    fn all_gather_within(&self, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather_within(mine, timeout)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
    fn barrier_within(&self, timeout: Duration) -> Result<()> {
        (**self).barrier_within(timeout)
    }
}

/// See the impl for `&B`.
impl<B: Bootstrap + ?Sized> Bootstrap for Box<B> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather(mine)
    }
    fn all_gather_within(&self, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather_within(mine, timeout)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
    fn barrier_within(&self, timeout: Duration) -> Result<()> {
        (**self).barrier_within(timeout)
    }
}

/// See the impl for `&B`.
impl<B: Bootstrap + ?Sized> Bootstrap for std::sync::Arc<B> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather(mine)
    }
    fn all_gather_within(&self, mine: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather_within(mine, timeout)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
    fn barrier_within(&self, timeout: Duration) -> Result<()> {
        (**self).barrier_within(timeout)
    }
}
