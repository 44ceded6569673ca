//! File descriptors between the ranks' processes, for memory that the driver exports
//! only as one ([`crate::backend::ExportedRange::descriptor`]: CUDA memory pools made
//! with a POSIX-fd handle type and virtual-memory allocations; the host backend's
//! shared memory files). The bootstrap carries bytes; a descriptor travels beside them
//! over a Unix socket (`SCM_RIGHTS`), which needs Linux.
//!
//! Each rank that registers with a peer in another process listens on an abstract
//! Unix socket of a random name ([`Listener`]), bound before the name is gathered, so
//! no other process can hold that name first. A registration's gathered records carry
//! every rank's process id, socket name and a random nonce ([`Peer`]); the bootstrap
//! authenticates them. A rank with a descriptor connects to each peer in another
//! process, checks with `SO_PEERCRED` that the listener is that peer's process and of
//! this user, and sends the registration's number, its rank and the peer's nonce with
//! the descriptor ([`send`]).
//!
//! The name is no secret (every local user reads it in `/proc/net/unix`), so anyone
//! may connect. A receiver ([`Listener::receive`]) therefore checks each connection's
//! credentials (`SO_PEERCRED`) as soon as it accepts it: one of another user, or of a
//! process that sends this registration nothing, is closed at once, unread. It reads
//! the connections that pass side by side, without blocking, each within
//! [`CONNECTION_READ_TIMEOUT`] of its accept, and keeps accepting while a descriptor is
//! missing: a stalled or bogus connection delays no real sender. It takes one
//! descriptor from each expected sender; anything else (another registration's number,
//! a wrong nonce or rank, a sender's rank claimed by another process, a second
//! descriptor from a rank) is closed and ignored, descriptor included. Both sides give
//! up at a deadline: a dead peer makes the registration fail, never hang.

#[cfg(not(target_os = "linux"))]
use std::time::Instant;

use crate::error::Error;
#[cfg(not(target_os = "linux"))]
use crate::error::Result;

/// What a sender says beside its descriptor.
const MAGIC: u64 = u64::from_le_bytes(*b"pcfdesc1");
/// Bytes of one message: magic, registration, sender rank, receiver's nonce.
const MESSAGE_BYTES: usize = 32;
/// How long a receiver waits for the message of a connection it accepted (one that
/// passed the credential check): a sender writes its whole message right after its
/// connect, so a connection slower than this is stalled or bogus, and is closed. The
/// receiver reads every connection side by side, so such a connection delays no real
/// sender; this bounds only how long it holds a descriptor slot.
pub(crate) const CONNECTION_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// Connections of expected senders' processes that a receiver holds unread at once;
/// beyond that the oldest is closed.
const MAX_PENDING: usize = 64;

/// A peer to send a descriptor to, or to expect one from, as its gathered record says.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    /// The peer's rank in the group.
    pub(crate) rank: usize,
    /// Its process id (checked with `SO_PEERCRED`).
    pub(crate) pid: u32,
    /// Its listener's abstract socket name.
    pub(crate) name: Vec<u8>,
    /// Its listener's nonce, echoed by whoever sends it a descriptor.
    pub(crate) nonce: u64,
}

fn channel_error(detail: String) -> Error {
    Error::Backend {
        backend: "peercomm",
        call: "descriptor channel",
        detail,
    }
}

#[cfg(target_os = "linux")]
mod unix;

#[cfg(target_os = "linux")]
pub(crate) use unix::{send, Listener};

/// Elsewhere than Linux no descriptor travels: memory exported as one is refused.
#[cfg(not(target_os = "linux"))]
pub(crate) struct Listener(std::convert::Infallible);

#[cfg(not(target_os = "linux"))]
impl Listener {
    pub(crate) fn bind() -> Result<Self> {
        Err(Error::Unsupported(
            "passing file descriptors between processes needs Linux".into(),
        ))
    }
    pub(crate) fn name(&self) -> &[u8] {
        match self.0 {}
    }
    pub(crate) fn nonce(&self) -> u64 {
        match self.0 {}
    }
    pub(crate) fn receive(
        &self,
        _registration: u64,
        _from: &[Peer],
        _deadline: Instant,
    ) -> Result<Vec<crate::backend::Descriptor>> {
        match self.0 {}
    }
}

/// Elsewhere than Linux no descriptor travels.
#[cfg(not(target_os = "linux"))]
pub(crate) fn send<F>(
    _fd: F,
    _registration: u64,
    _me: usize,
    _to: &Peer,
    _deadline: Instant,
) -> Result<()> {
    Err(Error::Unsupported(
        "passing file descriptors between processes needs Linux".into(),
    ))
}

#[cfg(all(test, target_os = "linux"))]
mod tests;
