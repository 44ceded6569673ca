//! File descriptors between the ranks' processes, for memory the driver exports only as
//! one (CUDA fd pools and VMM, the host backend's shared memory), over a Unix socket
//! (`SCM_RIGHTS`, Linux).
//!
//! Each rank listens on an abstract socket of a random name ([`Listener`]), bound before
//! its record ([`Peer`]: pid, name, nonce) is gathered through the authenticated
//! bootstrap. A sender checks with `SO_PEERCRED` that the listener is the peer's process
//! and user ([`send`]). The name is public, so the receiver ([`Listener::receive`])
//! closes unread any connection of another user or of no expected sender, reads the
//! rest side by side within [`CONNECTION_READ_TIMEOUT`] each, and drops anything wrong
//! (registration, nonce, rank, a second descriptor). Both sides give up at a deadline.

use crate::error::Error;
#[cfg(not(target_os = "linux"))]
use {crate::backend::Descriptor, crate::error::Result, std::time::Instant};

/// What a sender says beside its descriptor.
const MAGIC: u64 = u64::from_le_bytes(*b"pcfdesc1");
/// Bytes of one message: magic, registration, sender rank, receiver's nonce.
const MESSAGE_BYTES: usize = 32;
/// How long a receiver waits for an accepted connection's message (a sender writes it
/// right after connecting: a slower one is closed).
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
pub(crate) enum Listener {}

#[cfg(not(target_os = "linux"))]
impl Listener {
    pub(crate) fn bind() -> Result<Self> {
        let why = "passing file descriptors between processes needs Linux";
        Err(Error::Unsupported(why.into()))
    }
    pub(crate) fn name(&self) -> &[u8] {
        match *self {}
    }
    pub(crate) fn nonce(&self) -> u64 {
        match *self {}
    }
    pub(crate) fn receive(&self, _: u64, _: &[Peer], _: Instant) -> Result<Vec<Descriptor>> {
        match *self {}
    }
}

/// Elsewhere than Linux no descriptor travels.
#[cfg(not(target_os = "linux"))]
pub(crate) fn send<F>(_: F, _: u64, _: usize, _: &Peer, _: Instant) -> Result<()> {
    Listener::bind().map(|l| match l {})
}

#[cfg(all(test, target_os = "linux"))]
pub(crate) mod tests;
