//! Typed errors. Every check that can fail on bad input runs before anything is
//! launched, so an `Err` from a collective means nothing was written.

use crate::dtype::DType;

mod recovery;
pub use recovery::Recovery;

/// Locks `m`, through a poisoning panic: every lock here guards bookkeeping that each
/// step leaves whole.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a timeout's rank waited for, and where: `rank 3 (block 0, barrier domain 0)...`.
fn waited_for(rank: Option<usize>, block: usize, domain: usize) -> String {
    let rank = rank.map_or_else(|| "an unknown rank".to_string(), |r| format!("rank {r}"));
    format!(
        "{rank} (block {block}, barrier domain {domain}); the communicator must be \
         re-initialised"
    )
}

/// A field of a call descriptor; a mismatch names the first that differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallField {
    /// The call's number in its barrier domain: a rank made more or fewer calls before.
    Sequence,
    /// Which collective (all-reduce, all-gather, broadcast, ...).
    Collective,
    /// The element type.
    DType,
    /// The group width (`group_size`).
    GroupWidth,
    /// The root of a broadcast or scatter.
    Root,
    /// The element count.
    Length,
    /// The blocks per launch (`blocks` option, or the grid agreed at setup).
    Blocks,
    /// The algorithm (one-stage, two-stage, Lamport).
    Algorithm,
    /// Where the peers read the input: staged, or in place in a registered buffer.
    Inputs,
    /// The row length of the fused all-reduce + RMSNorm (its weight's length).
    Hidden,
    /// The epsilon of the fused all-reduce + RMSNorm (compared bit for bit).
    Epsilon,
    /// The reduction operator ([`crate::ReduceOp`]).
    Op,
}

impl std::fmt::Display for CallField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CallField::Sequence => "call sequence number",
            CallField::Collective => "collective",
            CallField::DType => "element type",
            CallField::GroupWidth => "group width",
            CallField::Root => "root",
            CallField::Length => "element count",
            CallField::Blocks => "block count",
            CallField::Algorithm => "algorithm",
            CallField::Inputs => "where the peers read the input",
            CallField::Hidden => "row length",
            CallField::Epsilon => "epsilon",
            CallField::Op => "reduction operator",
        })
    }
}

/// Result with a peercomm [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything peercomm can report. [`Error::recovery`] says what the caller does next.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A communicator needs between 1 and `MAX_GPUS` devices.
    #[error("a communicator spans 1 to {max} devices, not {got}")]
    InvalidWorldSize {
        /// Devices asked for.
        got: usize,
        /// `MAX_GPUS`.
        max: usize,
    },
    /// The same device was named twice, or an ordinal is out of range.
    #[error("invalid device list: {0}")]
    InvalidDevices(String),
    /// `group_size` must be 0 (whole world) or divide the world size.
    #[error("group size {group_size} does not divide the world size {world}")]
    InvalidGroupSize {
        /// The group size asked for.
        group_size: usize,
        /// Ranks in the communicator.
        world: usize,
    },
    /// One tensor per rank is needed.
    #[error("expected {expected} tensors (one per rank), got {got}")]
    WrongTensorCount {
        /// World size.
        expected: usize,
        /// Tensors passed.
        got: usize,
    },
    /// Ranks passed tensors of different element types.
    #[error("rank {rank} passed {got:?} where rank 0 passed {expected:?}")]
    DTypeMismatch {
        /// Rank whose tensor differs.
        rank: usize,
        /// Rank 0's dtype.
        expected: DType,
        /// This rank's dtype.
        got: DType,
    },
    /// Ranks (or an output and its input) passed tensors with the same element count
    /// but different shapes (differing counts are [`Error::LengthMismatch`]).
    #[error("rank {rank} passed shape {got:?} where rank 0 passed {expected:?}")]
    ShapeMismatch {
        /// Rank whose tensor differs.
        rank: usize,
        /// Rank 0's shape.
        expected: Vec<usize>,
        /// This rank's shape.
        got: Vec<usize>,
    },
    /// Element counts differ: across ranks, between a shape and its buffer, or between
    /// an output and its input.
    #[error("rank {rank}: {what}")]
    LengthMismatch {
        /// Rank concerned.
        rank: usize,
        /// What differs.
        what: String,
    },
    /// A buffer lives on another device than its rank's.
    #[error("rank {rank} runs on device {expected} but its {which} buffer is on device {got}")]
    WrongDevice {
        /// Rank concerned.
        rank: usize,
        /// `"input"`, `"output"` or `"in-place"`.
        which: &'static str,
        /// The rank's device ordinal.
        expected: usize,
        /// The buffer's device ordinal.
        got: usize,
    },
    /// A broadcast or scatter root outside the group.
    #[error("root {root} is outside a group of {width} ranks")]
    InvalidRoot {
        /// The root asked for (a group rank).
        root: usize,
        /// Ranks per group.
        width: usize,
    },
    /// The peer of a send or receive is not a rank of the world.
    #[error("peer {peer} is outside a world of {world} ranks")]
    InvalidPeer {
        /// The peer asked for (a world rank).
        peer: usize,
        /// Ranks in the world.
        world: usize,
    },
    /// The chosen algorithm needs more scratch than the communicator has (ask first
    /// with `algorithm_for`; size with `CommConfig::for_largest_message`): a staged call
    /// only where half the payload cannot hold one chunk (`needed` is then two).
    #[error(
        "{algorithm} needs {needed} bytes of scratch but the communicator has {available} \
         (CommConfig::{setting})"
    )]
    MessageTooLarge {
        /// Algorithm that was asked for or chosen.
        algorithm: &'static str,
        /// Bytes it would need.
        needed: usize,
        /// Bytes configured.
        available: usize,
        /// The `CommConfig` field that sets `available` (`lamport_slot_bytes`, `payload_bytes`).
        setting: &'static str,
    },
    /// An explicit request that cannot be honoured in this mode.
    #[error("{0}")]
    Unsupported(String),
    /// A buffer cannot be registered or a symmetric buffer allocated: the memory cannot
    /// be exported, the ranks disagree on the call, or a peer failed. Every rank gets it
    /// from the same call, and nothing is registered anywhere.
    #[error("rank {rank} cannot register the buffer: {reason}")]
    CannotRegister {
        /// The first rank that could not (a world rank).
        rank: usize,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A user buffer the peers would read directly is in memory their device cannot
    /// reach (a memory pool or virtual-memory range without access granted to it).
    #[error(
        "rank {rank}'s {which} buffer is not reachable from device {peer_device}: {detail}; \
         allocate it with cuMemAlloc or from the device's default memory pool, or grant \
         the peer access (cuMemPoolSetAccess / cuMemSetAccess)"
    )]
    BufferNotPeerAccessible {
        /// Rank whose buffer it is.
        rank: usize,
        /// `"input"` or `"in-place"`.
        which: &'static str,
        /// Device that would read it.
        peer_device: usize,
        /// What the driver reports.
        detail: String,
    },
    /// A configuration value is out of range (sizes that overflow, misaligned scratch).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A length whose bytes (rounded up to whole packs or the pool's alignment) exceed
    /// `isize::MAX`. Nothing was allocated, registered or launched.
    #[error("{what}: more bytes than any buffer can span")]
    SizeOverflow {
        /// Which length, of what (with the rank where one is concerned).
        what: String,
    },
    /// A call's buffers overlap (only through an `unsafe impl` of
    /// [`crate::backend::DeviceBuffer`]): an input and an output that are not the same
    /// range (an exact alias runs in place where the call allows it), or two outputs.
    #[error("rank {rank}: {what}")]
    BuffersOverlap {
        /// The rank whose buffers overlap (for the single controller, the first).
        rank: usize,
        /// Which buffers, and where.
        what: String,
    },
    /// Peer access is missing between two ranks' devices (no path, or mapping failed)
    /// and the fallback is [`crate::external::Fallback::Refuse`].
    #[error(
        "peer-to-peer access from rank {from_rank} (device {from}) to rank {to_rank} \
         (device {to}) is not available: {detail}. {hint}"
    )]
    P2pUnavailable {
        /// Device that would access: its ordinal in its own process.
        from: usize,
        /// Device that would be accessed: its ordinal in its own process.
        to: usize,
        /// World rank that would access.
        from_rank: usize,
        /// World rank that would be accessed.
        to_rank: usize,
        /// Both devices' identities and what failed.
        detail: String,
        /// How to fix it, or what serves instead.
        hint: String,
    },
    /// The external collective library (NCCL, RCCL) could not be loaded or has no
    /// symbol peercomm needs: install it, or keep peer memory only.
    #[error("{library} is not available: {detail}")]
    ExternalUnavailable {
        /// `"nccl"` or `"rccl"`.
        library: &'static str,
        /// What loading it said.
        detail: String,
    },
    /// A call into the external collective library failed.
    #[error("{library} call {call} failed: {detail}")]
    External {
        /// `"nccl"`, `"rccl"` or `"host"` (the host stand-in).
        library: &'static str,
        /// The call that failed.
        call: &'static str,
        /// What the library said.
        detail: String,
    },
    /// The initial check (a known pattern all-reduced through every peer mapping) failed
    /// on these ranks, and the fallback is [`crate::external::Fallback::Refuse`].
    #[error("the peer-memory check at initialisation failed on ranks {ranks:?}: {detail}")]
    PeerCheckFailed {
        /// World ranks whose check failed.
        ranks: Vec<usize>,
        /// What went wrong on the first of them.
        detail: String,
    },
    /// A barrier waited longer than the configured timeout: a peer never arrived.
    #[error(
        "barrier timeout on rank {rank}: it waited for {}",
        waited_for(*waiting_for, *block, *domain)
    )]
    BarrierTimeout {
        /// World rank that gave up.
        rank: usize,
        /// Block that gave up.
        block: usize,
        /// Barrier domain (counter bank) it waited in.
        domain: usize,
        /// The world rank that never arrived (`None` where the record does not say).
        waiting_for: Option<usize>,
    },
    /// A peer gave up and told this rank to stop: it abandoned its collective without
    /// writing its output (the cause: rank `by`'s [`Error::BarrierTimeout`], or, in a
    /// send / recv or all-to-all, `by`'s [`Error::CallMismatch`] with `waiting_for`,
    /// after which this rank's receives from the other ranks may have been written).
    #[error(
        "rank {rank} stopped because rank {by} gave up on {}",
        waited_for(*waiting_for, *block, *domain)
    )]
    PeerAborted {
        /// World rank that was told to stop.
        rank: usize,
        /// World rank that gave up and told it.
        by: usize,
        /// Block of `by` that gave up.
        block: usize,
        /// Barrier domain it waited in.
        domain: usize,
        /// The world rank `by` waited for (`None` where the record does not say).
        waiting_for: Option<usize>,
    },
    /// Rank `rank` and its peer `peer` made different calls at the same point (their
    /// call descriptors differ in `field`). Every rank of the group gets it.
    #[error(
        "rank {rank} and rank {peer} made different calls: the {field} differs ({mine} on \
         rank {rank}, {theirs} on rank {peer}); every rank must make the same collective \
         calls in the same order. The communicator must be re-initialised"
    )]
    CallMismatch {
        /// World rank that reports it.
        rank: usize,
        /// World rank whose call differs.
        peer: usize,
        /// The first field that differs.
        field: CallField,
        /// This rank's value of it.
        mine: String,
        /// The peer's value of it.
        theirs: String,
    },
    /// An earlier error (a timeout, an abort, a mismatch, a partial launch, an external
    /// library's error) left the signals in an unknown state: collectives are refused
    /// until `reinitialize`.
    #[error("the communicator is poisoned by an earlier error ({first}); call reinitialize()")]
    Poisoned {
        /// The first error that poisoned the communicator since (re-)initialising.
        first: Box<Error>,
    },
    /// The backend has no device (no GPU, no driver).
    #[error("{backend}: no device available: {detail}")]
    NoDevice {
        /// Backend name.
        backend: &'static str,
        /// What the runtime said.
        detail: String,
    },
    /// Finding the other ranks, or exchanging setup data with them, failed.
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] crate::bootstrap::BootstrapError),
    /// A driver/runtime call failed.
    #[error("{backend} call {call} failed: {detail}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// The call that failed.
        call: &'static str,
        /// What the runtime said.
        detail: String,
    },
}
