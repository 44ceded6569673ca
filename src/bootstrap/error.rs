//! [`BootstrapError`], the one error type of the bootstrap, and helpers to build it.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

// Named by doc links only.
#[cfg(doc)]
use super::{
    Bootstrap, HostId, UniqueId, BOOTSTRAP_ADDR_ENV, MAX_FRAME_BYTES, MAX_HOST_ID_BYTES,
    MAX_WORLD_SIZE,
};

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
    /// A world size of 0 or over `MAX_WORLD_SIZE` (32,768).
    #[error("a world of {world_size} ranks: the bootstrap serves 1 to {max}")]
    InvalidWorldSize {
        /// The world size asked for.
        world_size: usize,
        /// `MAX_WORLD_SIZE` (32,768).
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
    /// A frame body over `MAX_FRAME_BYTES` (64 MiB).
    #[error(
        "a frame of {len} bytes exceeds the {max}-byte cap: split the bytes over several \
         all_gather calls"
    )]
    FrameTooLarge {
        /// The body length sent or announced.
        len: usize,
        /// `MAX_FRAME_BYTES` (64 MiB).
        max: usize,
    },
    /// A [`HostId`] over `MAX_HOST_ID_BYTES` (1,024).
    #[error("a host identity of {len} bytes exceeds the {max}-byte cap: shorten it")]
    HostIdTooLong {
        /// Its length.
        len: usize,
        /// `MAX_HOST_ID_BYTES` (1,024).
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
    /// The process at the [`UniqueId`]'s address did not prove that it knows the secret,
    /// so this rank refused it as rank 0, having sent it only a nonce, and gave up.
    #[error("the process at {addr} did not prove it is rank 0 ({detail}): {hint}")]
    UnverifiedRankZero {
        /// The address the id names.
        addr: SocketAddr,
        /// What that process did instead of proving it.
        detail: String,
        /// Likely causes and fixes.
        hint: String,
    },
    /// A peer broke the protocol (mixed peercomm versions, or a bug).
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
    /// Ranks made different collective calls at once (say a registration and a teardown):
    /// every rank names the first rank whose record differs from its own. Nothing of the
    /// call was done (a teardown parks its memory for the peers instead of freeing it);
    /// the next call that every rank makes alike succeeds.
    #[error(
        "rank {rank} made {got} where this rank made {expected}: every rank must make the \
         same collective calls (register, alloc_symmetric, trim_symmetric, \
         register_inputs_of, reinitialize, dropping its Comm) in the same order, and \
         none while a peer drops its Comm"
    )]
    ExchangeMismatch {
        /// The first rank whose record differs from this rank's.
        rank: usize,
        /// This rank's call and the all-gather's number.
        expected: String,
        /// What `rank` sent instead.
        got: String,
    },
    /// An engine's own [`Bootstrap`] store failed.
    #[error("the bootstrap store failed: {message}")]
    Store {
        /// What the store reported.
        message: String,
    },
}

pub(super) type Result<T, E = BootstrapError> = std::result::Result<T, E>;

pub(super) fn io_error(step: impl Into<String>, e: io::Error) -> BootstrapError {
    BootstrapError::Io {
        step: step.into(),
        kind: e.kind(),
        detail: e.to_string(),
    }
}
