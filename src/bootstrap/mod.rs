//! Bootstrap: how the ranks of one communicator find each other and swap a few bytes at
//! setup (IPC handles, device and host identity), over TCP in the manner of NCCL's
//! `ncclUniqueId`:
//!
//! 1. Rank 0 calls [`UniqueId::new`]: it binds a TCP listener (kept in this process until
//!    rank 0 joins) and draws a 128-bit secret from the operating system.
//! 2. The id reaches the other processes as text (`Display` / [`str::parse`], 80 hex
//!    characters) or as [`UniqueId::BYTES`] bytes ([`UniqueId::to_bytes`] /
//!    [`UniqueId::from_bytes`]); never as a command-line argument, which every local user
//!    can read (`/proc/<pid>/cmdline`).
//! 3. Every rank calls [`TcpBootstrap::connect`]. The others connect to rank 0 (a star,
//!    fine for a few hundred ranks); each side proves it knows the secret without sending
//!    it, and rank 0 checks each rank before admitting it.
//! 4. [`Bootstrap::all_gather`] then gives every rank every rank's bytes in rank order, as
//!    often as needed. Every rank must make the same sequence of calls.
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
//! # Address and listener
//!
//! [`UniqueId::new`] binds [`BOOTSTRAP_ADDR_ENV`] when set (`10.0.0.5`, `[fd00::5]:29500`,
//! `node7:29500`), else `127.0.0.1:0`: peercomm does not guess among interfaces. The
//! listener closes when rank 0's `connect` returns (or at [`UniqueId::release`]), so a stale
//! id fails with a typed error, not a hang; the others retry refused connections.
//!
//! # Wire format (protocol version 3)
//!
//! A frame is a kind byte, a `u32` LE body length and the body (at most `MAX_FRAME_BYTES`,
//! 64 MiB, else [`BootstrapError::FrameTooLarge`]; hellos and proofs are capped far lower).
//! A MAC is HMAC-SHA-256 keyed by the secret over a label naming the message (so no MAC
//! serves as another), rank r's nonce, rank 0's nonce, then the bytes named; nonces are 32
//! fresh bytes per connection, MACs are compared in constant time.
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
//! Rank r proves the secret only after checking rank 0's challenge
//! ([`BootstrapError::UnverifiedRankZero`] if it fails). Rank 0 silently drops connections
//! that are not hellos, speak another version or fail their proof; a version-1 rank with
//! the right secret gets [`BootstrapError::Protocol`]. A right proof with a wrong or
//! duplicate rank or another world size fails rank 0 and every admitted rank. In an
//! all-gather rank 0 reads each rank's data frame in rank order and relays the others'.
//!
//! # Robustness and failures
//!
//! A connection must prove itself within `HELLO_DEADLINE` (2 s); at most 1,024 wait (the
//! oldest is closed for a new one); when `accept` runs out of descriptors, rank 0 closes its
//! oldest and pauses 10 ms; a real rank closed for these reconnects. Only the handshake is
//! authenticated. Every step ends in a [`BootstrapError`], never a hang
//! ([`BootstrapError::Timeout`] names the missing ranks); a failing rank tells its peers
//! ([`BootstrapError::PeerFailed`]) and is then [`BootstrapError::Poisoned`]: use a new id.
//!
//! An engine with its own transport implements [`Bootstrap`] (failures as
//! [`BootstrapError::Store`], [`Bootstrap::all_gather_within`] to bound teardown); each
//! record is tagged with its call and sequence number, so ranks in different calls get
//! [`BootstrapError::ExchangeMismatch`].

/// Implements [`Bootstrap`] for a type whose `gather(&self, mine, Option<Duration>)` serves
/// both all-gathers (`None`: its own deadline), given its rank and world size.
macro_rules! bootstrap_via_gather {
    ($ty:ty, |$s:ident| $rank:expr, $world:expr) => {
        impl $crate::bootstrap::Bootstrap for $ty {
            fn rank(&$s) -> usize {
                $rank
            }
            fn world_size(&$s) -> usize {
                $world
            }
            fn all_gather(&$s, mine: &[u8]) -> $crate::bootstrap::error::Result<Vec<Vec<u8>>> {
                $s.gather(mine, None)
            }
            fn all_gather_within(
                &$s,
                mine: &[u8],
                timeout: std::time::Duration,
            ) -> $crate::bootstrap::error::Result<Vec<Vec<u8>>> {
                $s.gather(mine, Some(timeout))
            }
        }
    };
}

mod error;
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
pub(crate) use host::host_identity;
pub use host::HostId;
pub use id::UniqueId;
pub use tcp::TcpBootstrap;

pub(crate) use tagged::{ExchangeKind, Exchanges};

use error::Result;

/// Environment variable naming the address [`UniqueId::new`] binds: an IP address or
/// host name, with or without a port. Unset means `127.0.0.1:0`: ranks on this host only.
pub const BOOTSTRAP_ADDR_ENV: &str = "PEERCOMM_BOOTSTRAP_ADDR";

/// Environment variable that, when set and not empty, replaces what `host_identity`
/// reads from the system (for tests, and containers whose host identity misleads).
pub const HOST_ID_OVERRIDE_ENV: &str = "PEERCOMM_HOST_ID_OVERRIDE";

/// Largest frame body (one rank's bytes in one all-gather).
pub(crate) const MAX_FRAME_BYTES: usize = 64 << 20;
/// Longest [`HostId`] in bytes.
pub(crate) const MAX_HOST_ID_BYTES: usize = 1024;
/// Most ranks one [`TcpBootstrap`] serves, so the welcome (every [`HostId`]) fits a frame.
pub(crate) const MAX_WORLD_SIZE: usize = 1 << 15;
const _: () = assert!(MAC_BYTES + 4 + MAX_WORLD_SIZE * (2 + MAX_HOST_ID_BYTES) <= MAX_FRAME_BYTES);
/// How long rank 0 keeps a connection that has not proven itself (one round trip for a
/// real rank), so idle connections cannot fill its pending table.
pub(crate) const HELLO_DEADLINE: Duration = Duration::from_secs(2);

/// Version of the [`UniqueId`] byte layout (its first byte).
const ID_FORMAT_VERSION: u8 = 1;
/// Version of the frames spoken after connecting (in the hello).
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
/// The longest hello rank 0 reads: version 1's (secret, rank, world, checksum, host id),
/// so that such a rank is still recognised.
const MAX_HELLO_BYTES: usize = 4 + 2 + SECRET_BYTES + 4 + 4 + 8 + 2 + MAX_HOST_ID_BYTES;
/// Rank 0's nonce and MAC.
const CHALLENGE_BYTES: usize = NONCE_BYTES + MAC_BYTES;
/// MAC, rank, world, host id length.
const PROOF_FIXED_BYTES: usize = MAC_BYTES + 4 + 4 + 2;
const MAX_PROOF_BYTES: usize = PROOF_FIXED_BYTES + MAX_HOST_ID_BYTES;
/// Error messages sent to peers are cut to this many bytes.
const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// Unproven connections rank 0 holds; when full, the oldest is closed.
const MAX_PENDING: usize = 1024;
/// Accepts in a row before rank 0 reads the pending ones (a stream of connections
/// cannot keep it from its deadline).
const MAX_ACCEPTS_PER_ROUND: usize = MAX_PENDING;
/// Pause in accepting after `accept` ran out of descriptors, buffers or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// How long a failing rank spends telling its peers (write, then wait for them to close).
const FAREWELL: Duration = Duration::from_millis(200);
/// After one rank timed out in an all-gather, how long rank 0 still waits for the later
/// ranks together (to name every missing one); each still gets at least [`MIN_WAIT`].
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
/// whatever connects its processes. [`TcpBootstrap`] is the built-in one; an engine with
/// its own store implements this instead. Every rank must make the same sequence of calls.
pub trait Bootstrap: Send + Sync {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Sends `mine` to every rank and returns every rank's bytes in rank order
    /// (`result[self.rank()] == mine`). Lengths may differ between ranks.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError>;

    /// As [`Bootstrap::all_gather`], giving up after at most `timeout` (for teardown, when
    /// a peer may be gone). The default ignores `timeout` and waits the store's own
    /// deadline; stores that can bound one call should override it ([`TcpBootstrap`] does).
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

/// Borrowed, boxed and shared bootstraps are bootstraps too (`Arc<dyn Bootstrap>`).
macro_rules! forward_bootstrap {
    ($($ty:ty),*) => {$(
        impl<B: Bootstrap + ?Sized> Bootstrap for $ty {
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
    )*};
}
forward_bootstrap!(&B, Box<B>, std::sync::Arc<B>);
