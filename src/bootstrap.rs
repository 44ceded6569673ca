//! Bootstrap: how the ranks of one communicator find each other and swap a few bytes.
//!
//! Before ranks in different processes can map each other's memory they must agree on
//! who is who and exchange what each needs (IPC handles, device identity, host
//! identity, a configuration checksum). This module does that once, at setup, over
//! TCP, in the manner of NCCL's `ncclUniqueId`:
//!
//! 1. Rank 0 calls [`UniqueId::new`]. That binds a TCP listener, kept in this process
//!    until rank 0 joins, and draws a 128-bit secret from the operating system.
//! 2. The id reaches every other process as text (`Display` / [`str::parse`]: 80
//!    hexadecimal characters, fit for an environment variable or a command-line flag)
//!    or as [`UniqueId::BYTES`] bytes ([`UniqueId::to_bytes`] /
//!    [`UniqueId::from_bytes`], fit for MPI or a key-value store).
//! 3. Every rank calls [`TcpBootstrap::connect`] with the id, its rank, the world size,
//!    a checksum of its configuration and a timeout. The other ranks connect to rank 0
//!    (a star: rank 0 relays everything, fine for worlds of a few hundred ranks) and
//!    rank 0 checks each one before admitting it.
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
//!     let boot = TcpBootstrap::connect(&id, 1, 2, 0xC0FFEE, Duration::from_secs(10)).unwrap();
//!     boot.all_gather(b"rank one").unwrap()
//! });
//! let boot = TcpBootstrap::connect(&id, 0, 2, 0xC0FFEE, Duration::from_secs(10))?;
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
//! # Wire format (protocol version 1)
//!
//! Every message is a frame: one kind byte, a `u32` little-endian body length, the
//! body. A body over [`MAX_FRAME_BYTES`] is refused with
//! [`BootstrapError::FrameTooLarge`] on whichever side sees it; hellos are capped much
//! lower, so a stray connection cannot make rank 0 allocate.
//!
//! | kind | direction | body |
//! |------|-----------|------|
//! | 1 hello | rank r → rank 0 | `"PCBS"`, protocol version `u16`, secret (16 bytes), rank `u32`, world size `u32`, config checksum `u64`, host id length `u16`, host id (UTF-8) |
//! | 2 welcome | rank 0 → rank r | world size `u32`, then per rank: host id length `u16`, host id |
//! | 3 data | both ways | one rank's bytes for an all-gather |
//! | 4 error | both ways | rank where the failure began `u32`, message (UTF-8) |
//!
//! Handshake: each rank r > 0 sends a hello. Rank 0 drops, silently and without logging
//! anything, a connection that is not a peercomm hello or carries a wrong secret, and
//! keeps waiting for the real ranks. A right secret with a wrong rank, a rank claimed
//! twice, a different world size or configuration checksum is fatal: rank 0 sends an
//! error frame to that rank and to every rank already admitted, then returns the typed
//! error ([`BootstrapError::DuplicateRank`], ...); the others return
//! [`BootstrapError::PeerFailed`]. When every rank has come, rank 0 closes its listener
//! and sends each rank a welcome carrying every rank's [`HostId`].
//!
//! All-gather: each rank r > 0 sends one data frame; rank 0 reads them in rank order,
//! then sends each rank the other ranks' frames in rank order (rank 0 moves
//! `world_size * (world_size - 1)` frames, which is why this is a setup path only).
//!
//! # Failures
//!
//! Every step has a deadline (the `timeout` given to [`TcpBootstrap::connect`], per
//! operation afterwards, see [`TcpBootstrap::set_timeout`]) and ends in a
//! [`BootstrapError`], never a hang: a rank that never comes is
//! [`BootstrapError::Timeout`] naming it on rank 0. Any rank that fails sends an error
//! frame to the ranks it talks to, so they fail at once with
//! [`BootstrapError::PeerFailed`] instead of waiting out their own timeouts, and its
//! bootstrap is poisoned ([`BootstrapError::Poisoned`]): frame boundaries are unknown
//! after a failure, so the only way on is a new [`UniqueId`].
//!
//! # Bringing your own store
//!
//! An engine that already has a way for its processes to talk (torch.distributed, MPI,
//! its own RPC) implements [`Bootstrap`] on top of it (an all-gather of bytes) and
//! never opens a socket here; it reports its store's failures as
//! [`BootstrapError::Store`].

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

#[cfg(test)]
mod tests;

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
const _: () = assert!(4 + MAX_WORLD_SIZE * (2 + MAX_HOST_ID_BYTES) <= MAX_FRAME_BYTES);

/// Version of the [`UniqueId`] byte layout (its first byte).
const ID_FORMAT_VERSION: u8 = 1;
/// Version of the frames spoken after connecting (in the hello).
const PROTOCOL_VERSION: u16 = 1;
/// First bytes of every hello.
const MAGIC: [u8; 4] = *b"PCBS";
const SECRET_BYTES: usize = 16;
/// Kind byte plus `u32` length.
const HEADER_BYTES: usize = 5;
/// Magic, version, secret, rank, world, checksum, host id length.
const HELLO_FIXED_BYTES: usize = 4 + 2 + SECRET_BYTES + 4 + 4 + 8 + 2;
const MAX_HELLO_BYTES: usize = HELLO_FIXED_BYTES + MAX_HOST_ID_BYTES;
/// Error messages sent to peers are cut to this many bytes.
const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// Connections rank 0 holds before they have sent a complete hello.
const MAX_PENDING: usize = 1024;
/// How long a failing rank spends telling its peers (write, then wait for them to close).
const FAREWELL: Duration = Duration::from_millis(200);
/// After one rank timed out in an all-gather, how long rank 0 still waits for each later
/// rank (to name every missing rank, not only the first).
const LATE_GRACE: Duration = Duration::from_millis(5);
/// Shortest socket timeout set (zero means "no timeout" to the OS).
const MIN_WAIT: Duration = Duration::from_millis(1);

const KIND_HELLO: u8 = 1;
const KIND_WELCOME: u8 = 2;
const KIND_DATA: u8 = 3;
const KIND_ERROR: u8 = 4;

/// Everything the bootstrap can report. Messages name the fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A socket operation failed for a reason other than a timeout or a closed peer.
    #[error("bootstrap I/O error while {step}: {detail} ({kind:?})")]
    Io {
        /// What the bootstrap was doing.
        step: String,
        /// The OS error's kind.
        kind: io::ErrorKind,
        /// The OS error's message.
        detail: String,
    },
    /// A deadline passed. On rank 0 `waiting_for` names the ranks that never came (or
    /// never reached this all-gather); on the others it is `[0]`.
    #[error("timed out after {after:?} while {step}, waiting for rank(s) {waiting_for:?}: {hint}")]
    Timeout {
        /// What the bootstrap was doing.
        step: String,
        /// Ranks it was still waiting for.
        waiting_for: Vec<usize>,
        /// The timeout that passed.
        after: Duration,
        /// Likely causes and fixes (including connections refused for a wrong secret).
        hint: String,
    },
    /// A rank number is not below the world size.
    #[error(
        "rank {rank} is out of range for a world of {world_size} rank(s): \
         ranks run from 0 to world_size - 1"
    )]
    RankOutOfRange {
        /// The rank claimed.
        rank: usize,
        /// The world size it was checked against.
        world_size: usize,
    },
    /// A world size of 0 or over [`MAX_WORLD_SIZE`].
    #[error("a world of {world_size} ranks: the bootstrap serves 1 to {max}")]
    InvalidWorldSize {
        /// The world size asked for.
        world_size: usize,
        /// [`MAX_WORLD_SIZE`].
        max: usize,
    },
    /// Two processes claim one rank number.
    #[error(
        "two processes claim rank {rank}: give every process a distinct rank in 0..world_size"
    )]
    DuplicateRank {
        /// The rank claimed twice.
        rank: usize,
    },
    /// A rank was started with another world size than rank 0.
    #[error(
        "rank {rank} was started with world size {got}, rank 0 with {expected}: \
         start every rank with the same world size"
    )]
    WorldSizeMismatch {
        /// Rank 0's world size.
        expected: usize,
        /// The other rank's.
        got: usize,
        /// The rank that differs.
        rank: usize,
    },
    /// A rank's configuration checksum differs from rank 0's.
    #[error(
        "rank {rank}'s configuration checksum {got:#018x} differs from rank 0's \
         {expected:#018x}: every rank must be built and configured alike"
    )]
    ConfigMismatch {
        /// The rank that differs.
        rank: usize,
        /// Rank 0's checksum.
        expected: u64,
        /// The other rank's.
        got: u64,
    },
    /// A [`UniqueId`] string or byte array could not be read.
    #[error("invalid UniqueId: {reason}; pass rank 0's UniqueId unchanged (its string or bytes)")]
    InvalidId {
        /// What is wrong with it.
        reason: String,
    },
    /// The bootstrap address (argument or [`BOOTSTRAP_ADDR_ENV`]) is unusable.
    #[error("invalid bootstrap address {value:?}: {reason}")]
    InvalidAddress {
        /// The address as given.
        value: String,
        /// What is wrong with it and what to give instead.
        reason: String,
    },
    /// Rank 0 already used this id in this process (or it was released).
    #[error(
        "this UniqueId was already used by rank 0 in this process (or released): make a \
         new UniqueId for every communicator, and run only one rank 0 per id"
    )]
    StaleId,
    /// A frame body over [`MAX_FRAME_BYTES`].
    #[error(
        "a frame of {len} bytes exceeds the {max}-byte cap: split the bytes over several \
         all_gather calls"
    )]
    FrameTooLarge {
        /// The body length sent or announced.
        len: usize,
        /// [`MAX_FRAME_BYTES`].
        max: usize,
    },
    /// A [`HostId`] over [`MAX_HOST_ID_BYTES`].
    #[error("a host identity of {len} bytes exceeds the {max}-byte cap: shorten it")]
    HostIdTooLong {
        /// Its length.
        len: usize,
        /// [`MAX_HOST_ID_BYTES`].
        max: usize,
    },
    /// Another rank failed and said so; `rank` is where the failure began and `message`
    /// its error. Look at that rank's own error for the cause.
    #[error("rank {rank} failed: {message}")]
    PeerFailed {
        /// The rank whose failure this is.
        rank: usize,
        /// Its error message.
        message: String,
    },
    /// A peer closed its connection mid-step without saying why.
    #[error("rank {rank} closed its connection while {step}: {hint}")]
    ConnectionClosed {
        /// The peer.
        rank: usize,
        /// What the bootstrap was doing.
        step: String,
        /// Likely causes and fixes.
        hint: String,
    },
    /// A peer sent something the protocol does not allow (mixed peercomm versions, or a
    /// bug).
    #[error("bootstrap protocol error: {detail}")]
    Protocol {
        /// What was wrong, and from which rank.
        detail: String,
    },
    /// An earlier operation on this bootstrap failed.
    #[error(
        "an earlier bootstrap operation failed ({first}); this bootstrap is unusable: \
         make a new UniqueId and bootstrap again"
    )]
    Poisoned {
        /// The first failure.
        first: Box<BootstrapError>,
    },
    /// An engine's own [`Bootstrap`] store failed.
    #[error("the bootstrap store failed: {message}")]
    Store {
        /// What the store reported.
        message: String,
    },
}

type Result<T, E = BootstrapError> = std::result::Result<T, E>;

fn io_error(step: impl Into<String>, e: io::Error) -> BootstrapError {
    BootstrapError::Io {
        step: step.into(),
        kind: e.kind(),
        detail: e.to_string(),
    }
}

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

    /// Returns once every rank has called it. The default is an all-gather of nothing.
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.all_gather(&[]).map(|_| ())
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
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
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
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
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
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
}

// ---------------------------------------------------------------------------------------
// UniqueId

/// What rank 0 hands every other rank so they can find it: rank 0's address and a
/// 128-bit random secret that every connection must present.
///
/// Text form (`Display`, [`str::parse`]): [`UniqueId::BYTES`] bytes as lowercase
/// hexadecimal. Byte form: format version (1), address family (4 or 6), the IP address
/// (16 bytes, an IPv4 address in the first 4), the port (big-endian `u16`), the secret
/// (16 bytes), then an FNV-1a checksum (`u32`, little-endian) of the preceding 36 bytes,
/// so a truncated or mistyped id is an [`BootstrapError::InvalidId`], not a wrong secret.
/// IPv6 scope ids are not carried.
///
/// `Debug` shows the address and hides the secret.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    addr: SocketAddr,
    secret: [u8; SECRET_BYTES],
}

/// What the registry holds for an id made in this process.
enum Slot {
    /// Made, rank 0 has not joined yet.
    Listening(TcpListener),
    /// Rank 0 joined (or the id was released): the listener is gone.
    Used,
}

fn registry() -> MutexGuard<'static, HashMap<[u8; SECRET_BYTES], Slot>> {
    static REGISTRY: OnceLock<Mutex<HashMap<[u8; SECRET_BYTES], Slot>>> = OnceLock::new();
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

impl UniqueId {
    /// Length of [`UniqueId::to_bytes`].
    pub const BYTES: usize = 40;

    /// Makes an id for a new communicator (on rank 0): binds a listener on
    /// [`BOOTSTRAP_ADDR_ENV`] if set, else on `127.0.0.1` (same host only), at a free
    /// port unless the variable names one, and draws the secret from the OS.
    pub fn new() -> Result<Self> {
        let addr = match std::env::var(BOOTSTRAP_ADDR_ENV) {
            Ok(v) if !v.trim().is_empty() => parse_bootstrap_addr(&v)?,
            Ok(_) | Err(std::env::VarError::NotPresent) => {
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
            }
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(BootstrapError::InvalidAddress {
                    value: v.to_string_lossy().into_owned(),
                    reason: format!("{BOOTSTRAP_ADDR_ENV} is not valid UTF-8"),
                })
            }
        };
        Self::bind(addr)
    }

    /// As [`UniqueId::new`], listening on `addr` (port 0 picks a free port). `addr` must
    /// be one the other ranks can connect to, not `0.0.0.0` or `::`.
    pub fn bind(addr: SocketAddr) -> Result<Self> {
        if addr.ip().is_unspecified() {
            return Err(BootstrapError::InvalidAddress {
                value: addr.to_string(),
                reason: unspecified_reason(),
            });
        }
        let listener = TcpListener::bind(addr)
            .map_err(|e| io_error(format!("binding the bootstrap listener on {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_error("reading the bootstrap listener's address", e))?;
        let mut secret = [0u8; SECRET_BYTES];
        getrandom::fill(&mut secret).map_err(|e| BootstrapError::Io {
            step: "drawing the bootstrap secret from the OS".into(),
            kind: io::ErrorKind::Other,
            detail: e.to_string(),
        })?;
        registry().insert(secret, Slot::Listening(listener));
        Ok(Self { addr, secret })
    }

    /// Rank 0's address, which the other ranks connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The id as bytes, for a transport that carries bytes (MPI, a key-value store).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0] = ID_FORMAT_VERSION;
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                b[1] = 4;
                b[2..6].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                b[1] = 6;
                b[2..18].copy_from_slice(&ip.octets());
            }
        }
        b[18..20].copy_from_slice(&self.addr.port().to_be_bytes());
        b[20..36].copy_from_slice(&self.secret);
        let sum = fnv1a32(&b[..36]);
        b[36..40].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Reads an id written by [`UniqueId::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let invalid = |reason: String| Err(BootstrapError::InvalidId { reason });
        if bytes.len() != Self::BYTES {
            return invalid(format!(
                "{} bytes where a UniqueId has {}",
                bytes.len(),
                Self::BYTES
            ));
        }
        if bytes[0] != ID_FORMAT_VERSION {
            return invalid(format!(
                "format version {} where this peercomm reads version {ID_FORMAT_VERSION} \
                 (every process must run the same peercomm)",
                bytes[0]
            ));
        }
        let sum = u32::from_le_bytes(bytes[36..40].try_into().expect("4 bytes"));
        if sum != fnv1a32(&bytes[..36]) {
            return invalid("its checksum does not match: it was garbled in transit".into());
        }
        let ip = match bytes[1] {
            4 if bytes[6..18].iter().all(|&x| x == 0) => IpAddr::V4(Ipv4Addr::from(
                <[u8; 4]>::try_from(&bytes[2..6]).expect("4"),
            )),
            6 => IpAddr::V6(Ipv6Addr::from(
                <[u8; 16]>::try_from(&bytes[2..18]).expect("16"),
            )),
            f => {
                return invalid(format!(
                    "address family {f} (with its padding) is not 4 or 6"
                ))
            }
        };
        let port = u16::from_be_bytes([bytes[18], bytes[19]]);
        if port == 0 || ip.is_unspecified() {
            return invalid(format!(
                "address {} cannot be connected to",
                SocketAddr::new(ip, port)
            ));
        }
        let secret = bytes[20..36].try_into().expect("16 bytes");
        Ok(Self {
            addr: SocketAddr::new(ip, port),
            secret,
        })
    }

    /// Closes this id's listener if this process made the id and rank 0 has not joined
    /// yet; returns whether it did. Afterwards rank 0 cannot use the id in this process
    /// ([`BootstrapError::StaleId`]). For an id that will not be used, or for a launcher
    /// that makes the id for a rank 0 in another process (which then binds the address
    /// itself).
    pub fn release(&self) -> bool {
        matches!(
            registry().insert(self.secret, Slot::Used),
            Some(Slot::Listening(_))
        )
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .field("secret", &format_args!("<hidden>"))
            .finish()
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.to_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = BootstrapError;

    /// Reads the text form (surrounding whitespace is ignored; either case of hex).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.len() != 2 * Self::BYTES {
            return Err(BootstrapError::InvalidId {
                reason: format!(
                    "{} characters where a UniqueId has {} hexadecimal ones",
                    s.chars().count(),
                    2 * Self::BYTES
                ),
            });
        }
        let digits = s.as_bytes();
        let mut bytes = [0u8; Self::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            match (hex_value(digits[2 * i]), hex_value(digits[2 * i + 1])) {
                (Some(hi), Some(lo)) => *b = hi << 4 | lo,
                _ => {
                    return Err(BootstrapError::InvalidId {
                        reason: format!(
                            "a character that is not hexadecimal near position {}",
                            2 * i
                        ),
                    })
                }
            }
        }
        Self::from_bytes(&bytes)
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

fn unspecified_reason() -> String {
    format!(
        "an unspecified address cannot be connected to: name an address of rank 0's host \
         that the other ranks can reach (e.g. 10.0.0.5 or 10.0.0.5:29500) in \
         {BOOTSTRAP_ADDR_ENV}"
    )
}

/// Reads a bootstrap address: `ip:port`, `ip`, `host:port` or `host` (a missing port is
/// port 0, a free one).
fn parse_bootstrap_addr(value: &str) -> Result<SocketAddr> {
    let v = value.trim();
    let invalid = |reason: String| BootstrapError::InvalidAddress {
        value: value.to_string(),
        reason,
    };
    let addr = if let Ok(a) = v.parse::<SocketAddr>() {
        a
    } else if let Ok(ip) = v
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        SocketAddr::new(ip, 0)
    } else {
        let resolved = if v.contains(':') {
            v.to_socket_addrs()
        } else {
            (v, 0).to_socket_addrs()
        };
        resolved
            .map_err(|e| {
                invalid(format!(
                    "not an address and not a host name that resolves ({e}): give an IP \
                     address or host name with an optional port, e.g. 10.0.0.5:29500"
                ))
            })?
            .next()
            .ok_or_else(|| invalid("the host name resolves to no address".into()))?
    };
    if addr.ip().is_unspecified() {
        return Err(invalid(unspecified_reason()));
    }
    Ok(addr)
}

/// Takes the listener of an id rank 0 is about to use: `Some` if this process made the
/// id, `None` if another did (rank 0 binds itself), [`BootstrapError::StaleId`] if rank
/// 0 already used it here.
fn claim_listener(id: &UniqueId) -> Result<Option<TcpListener>> {
    match registry().insert(id.secret, Slot::Used) {
        Some(Slot::Listening(l)) => Ok(Some(l)),
        Some(Slot::Used) => Err(BootstrapError::StaleId),
        None => Ok(None),
    }
}

// ---------------------------------------------------------------------------------------
// Host identity

/// Which machine (operating-system instance) a rank runs on, as text; equal ids mean
/// one host. Read with [`host_identity`]; exchanged by [`TcpBootstrap`] during the
/// handshake ([`TcpBootstrap::host_ids`]).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct HostId(String);

impl HostId {
    /// A host id from any text (tests, or an engine's own notion of host).
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// This process's host: [`HOST_ID_OVERRIDE_ENV`] if set and not empty, else
/// `hostname/boot-id` (Linux's `/proc/sys/kernel/random/boot_id`, which differs between
/// machines and between boots even where host names repeat; else `/etc/machine-id`),
/// or the host name alone where neither is readable. Containers sharing a kernel share
/// the boot id but usually not the host name, so they count as different hosts.
pub fn host_identity() -> HostId {
    host_identity_from(std::env::var(HOST_ID_OVERRIDE_ENV).ok())
}

fn host_identity_from(override_value: Option<String>) -> HostId {
    if let Some(v) = override_value.filter(|v| !v.trim().is_empty()) {
        return HostId(v.trim().to_string());
    }
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let hostname = read("/proc/sys/kernel/hostname")
        .or_else(|| read("/etc/hostname"))
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .or_else(|| std::env::var("COMPUTERNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown-host".into());
    let instance = read("/proc/sys/kernel/random/boot_id")
        .or_else(|| read("/etc/machine-id"))
        .or_else(|| read("/var/lib/dbus/machine-id"));
    let mut id = match instance {
        Some(i) => format!("{hostname}/{i}"),
        None => hostname,
    };
    truncate_utf8(&mut id, MAX_HOST_ID_BYTES);
    HostId(id)
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

// ---------------------------------------------------------------------------------------
// Frames

fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Fills `buf` from a blocking stream by `deadline` (`TimedOut` after it,
/// `UnexpectedEof` if the peer closes first).
fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left.max(MIN_WAIT)))?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a blocking stream by `deadline`.
fn write_full(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_write_timeout(Some(left.max(MIN_WAIT)))?;
        match s.write(&buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn header(kind: u8, len: usize) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0] = kind;
    h[1..].copy_from_slice(
        &u32::try_from(len)
            .expect("frame length checked")
            .to_le_bytes(),
    );
    h
}

fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_BYTES + body.len());
    f.extend_from_slice(&header(kind, body.len()));
    f.extend_from_slice(body);
    f
}

fn write_frame(s: &mut TcpStream, kind: u8, body: &[u8], deadline: Instant) -> io::Result<()> {
    if body.len() <= 64 << 10 {
        write_full(s, &frame(kind, body), deadline)
    } else {
        write_full(s, &header(kind, body.len()), deadline)?;
        write_full(s, body, deadline)
    }
}

enum RecvError {
    Io(io::Error),
    TooLarge(usize),
}

fn read_frame(s: &mut TcpStream, deadline: Instant) -> Result<(u8, Vec<u8>), RecvError> {
    let mut h = [0u8; HEADER_BYTES];
    read_full(s, &mut h, deadline).map_err(RecvError::Io)?;
    let len = u32::from_le_bytes(h[1..].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(RecvError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    read_full(s, &mut body, deadline).map_err(RecvError::Io)?;
    Ok((h[0], body))
}

fn check_frame_len(len: usize) -> Result<()> {
    if len > MAX_FRAME_BYTES {
        return Err(BootstrapError::FrameTooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    Ok(())
}

/// Reads little-endian fields off a frame body, front to back.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn text_u16(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

struct Hello {
    rank: usize,
    world: usize,
    checksum: u64,
    host: HostId,
}

fn encode_hello(
    secret: &[u8; SECRET_BYTES],
    rank: usize,
    world: usize,
    checksum: u64,
    host: &HostId,
) -> Vec<u8> {
    let mut b = Vec::with_capacity(HELLO_FIXED_BYTES + host.0.len());
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b.extend_from_slice(secret);
    b.extend_from_slice(&(rank as u32).to_le_bytes());
    b.extend_from_slice(&(world as u32).to_le_bytes());
    b.extend_from_slice(&checksum.to_le_bytes());
    b.extend_from_slice(&(host.0.len() as u16).to_le_bytes());
    b.extend_from_slice(host.0.as_bytes());
    frame(KIND_HELLO, &b)
}

enum HelloVerdict {
    /// Not a peercomm hello: drop quietly.
    Stray,
    /// A peercomm hello with another secret: drop quietly, count it.
    WrongSecret,
    /// Right secret, but the rest cannot be read.
    Malformed(String),
    Ok(Hello),
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads a hello body. The magic, version and secret sit at the front in every protocol
/// version, so a rank of another version with the right secret is told apart from a
/// stranger.
fn decode_hello(body: &[u8], secret: &[u8; SECRET_BYTES]) -> HelloVerdict {
    let mut f = Fields(body);
    if f.take(4) != Some(&MAGIC[..]) {
        return HelloVerdict::Stray;
    }
    let Some(version) = f.u16() else {
        return HelloVerdict::Stray;
    };
    match f.take(SECRET_BYTES) {
        Some(s) if constant_time_eq(s, secret) => {}
        Some(_) => return HelloVerdict::WrongSecret,
        None => return HelloVerdict::Stray,
    }
    if version != PROTOCOL_VERSION {
        return HelloVerdict::Malformed(format!(
            "it speaks bootstrap protocol version {version}, rank 0 version \
             {PROTOCOL_VERSION}: every process must run the same peercomm"
        ));
    }
    let hello = (|| {
        let rank = f.u32()? as usize;
        let world = f.u32()? as usize;
        let checksum = f.u64()?;
        let host = HostId(f.text_u16()?);
        f.0.is_empty().then_some(Hello {
            rank,
            world,
            checksum,
            host,
        })
    })();
    match hello {
        Some(h) => HelloVerdict::Ok(h),
        None => HelloVerdict::Malformed("its hello is truncated or too long".into()),
    }
}

fn encode_welcome(hosts: &[HostId]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(hosts.len() as u32).to_le_bytes());
    for h in hosts {
        b.extend_from_slice(&(h.0.len() as u16).to_le_bytes());
        b.extend_from_slice(h.0.as_bytes());
    }
    b
}

fn decode_welcome(body: &[u8], world: usize) -> Result<Vec<HostId>> {
    let mut f = Fields(body);
    let hosts = (|| {
        let n = f.u32()? as usize;
        if n != world {
            return None;
        }
        let hosts = (0..n)
            .map(|_| f.text_u16().map(HostId))
            .collect::<Option<Vec<_>>>()?;
        f.0.is_empty().then_some(hosts)
    })();
    hosts.ok_or_else(|| BootstrapError::Protocol {
        detail: format!("rank 0's welcome does not list {world} host ids"),
    })
}

fn encode_error(origin: usize, message: &str) -> Vec<u8> {
    let mut m = message.to_string();
    truncate_utf8(&mut m, MAX_ERROR_MESSAGE_BYTES);
    let mut b = Vec::with_capacity(4 + m.len());
    b.extend_from_slice(&(origin as u32).to_le_bytes());
    b.extend_from_slice(m.as_bytes());
    frame(KIND_ERROR, &b)
}

fn decode_error(from: usize, body: &[u8]) -> BootstrapError {
    let mut f = Fields(body);
    match f.u32() {
        Some(origin) => BootstrapError::PeerFailed {
            rank: origin as usize,
            message: String::from_utf8_lossy(f.0).into_owned(),
        },
        None => BootstrapError::PeerFailed {
            rank: from,
            message: "(an unreadable error frame)".into(),
        },
    }
}

/// A data frame's body, or the error the frame carries instead.
fn expect_data(from: usize, (kind, body): (u8, Vec<u8>)) -> Result<Vec<u8>> {
    match kind {
        KIND_DATA => Ok(body),
        KIND_ERROR => Err(decode_error(from, &body)),
        k => Err(BootstrapError::Protocol {
            detail: format!("rank {from} sent a frame of kind {k} where a data frame belongs"),
        }),
    }
}

/// Maps a failure to hear from (or talk to) rank `peer` to a typed error.
fn recv_error(
    peer: usize,
    step: &str,
    e: RecvError,
    timeout: Duration,
    timeout_hint: &str,
    closed_hint: &str,
) -> BootstrapError {
    match e {
        RecvError::TooLarge(len) => BootstrapError::FrameTooLarge {
            len,
            max: MAX_FRAME_BYTES,
        },
        RecvError::Io(e) if is_timeout(&e) => BootstrapError::Timeout {
            step: step.into(),
            waiting_for: vec![peer],
            after: timeout,
            hint: timeout_hint.into(),
        },
        RecvError::Io(e) if is_closed(&e) => BootstrapError::ConnectionClosed {
            rank: peer,
            step: step.into(),
            hint: closed_hint.into(),
        },
        RecvError::Io(e) => io_error(format!("{step} (rank {peer})"), e),
    }
}

/// When writing to rank 0 failed because it closed the connection, rank 0 may have said
/// why first: returns the error frame waiting to be read, if any, else `err`.
fn explain_closed(s: &mut TcpStream, err: BootstrapError) -> BootstrapError {
    if !matches!(err, BootstrapError::ConnectionClosed { .. }) {
        return err;
    }
    match read_frame(s, deadline_after(Duration::from_millis(50))) {
        Ok((KIND_ERROR, body)) => decode_error(0, &body),
        _ => err,
    }
}

/// Tells each peer why this rank fails (an error frame), then closes the connections
/// gracefully: half-close, and read until the peer closes or [`FAREWELL`] passes, so
/// that unread bytes do not turn the close into a reset that could destroy the error
/// frame before the peer reads it.
fn farewell(mut streams: Vec<TcpStream>, me: usize, err: &BootstrapError) {
    let (origin, message) = match err {
        BootstrapError::PeerFailed { rank, message } => (*rank, message.clone()),
        e => (me, e.to_string()),
    };
    let f = encode_error(origin, &message);
    let deadline = deadline_after(FAREWELL);
    for s in &mut streams {
        let _ = s.set_nonblocking(false);
        let _ = write_full(s, &f, deadline);
        let _ = s.shutdown(Shutdown::Write);
        let _ = s.set_nonblocking(true);
    }
    let mut scratch = vec![0u8; 64 << 10];
    while !streams.is_empty() && Instant::now() < deadline {
        streams.retain_mut(|s| match s.read(&mut scratch) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted,
        });
        if !streams.is_empty() {
            std::thread::sleep(MIN_WAIT);
        }
    }
}

// ---------------------------------------------------------------------------------------
// TcpBootstrap

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
        let mut state = self.lock();
        if let Some(first) = &state.poisoned {
            return Err(BootstrapError::Poisoned {
                first: Box::new(first.clone()),
            });
        }
        let timeout = state.timeout;
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
    for (i, s) in streams.iter_mut().enumerate() {
        let r = i + 1;
        let by = if missing.is_empty() && failure.is_none() {
            deadline
        } else {
            deadline_after(LATE_GRACE)
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
