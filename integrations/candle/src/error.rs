//! Typed errors of the candle integration.

use candle_core::DType;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the candle integration can report. Every check on the tensor runs before
/// anything is launched, so an `Err` means nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The tensor's elements are not one dense row-major run (a transpose, a strided
    /// narrow, a broadcast): call `.contiguous()` first.
    #[error(
        "the tensor is not contiguous (shape {shape:?}, strides {stride:?}); call .contiguous() first"
    )]
    NotContiguous {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its strides, in elements.
        stride: Vec<usize>,
    },
    /// The tensor is not in CUDA memory (CPU or Metal).
    #[error("the tensor lives on {location}, not on a CUDA device")]
    NotCuda {
        /// Where it lives, as candle describes it.
        location: String,
    },
    /// The tensor is on another candle device than the communicator's: another GPU, or
    /// the same GPU opened as another candle device (with another stream).
    #[error(
        "the communicator's rank runs on CUDA device {expected} (one candle device), but the \
         tensor is on {got}: move it with .to_device(comm.device()) first"
    )]
    WrongDevice {
        /// Ordinal of the communicator's GPU.
        expected: usize,
        /// Where the tensor is, as candle describes it (with its own device id when the
        /// ordinal is the same).
        got: String,
    },
    /// peercomm's collectives take f32, f16 and bf16 tensors only.
    #[error("peercomm's collectives take f32, f16 and bf16 tensors, not {0:?}")]
    UnsupportedDType(DType),
    /// The output tensor's dtype is not the input's.
    #[error("the input is {input:?} but the output is {output:?}")]
    DTypeMismatch {
        /// The input's dtype.
        input: DType,
        /// The output's dtype.
        output: DType,
    },
    /// The output tensor's shape is not the one the collective produces from the input.
    #[error("the output's shape is {got:?}, but this collective writes {expected:?}")]
    ShapeMismatch {
        /// The shape the collective writes.
        expected: Vec<usize>,
        /// The output's shape.
        got: Vec<usize>,
    },
    /// A reduce-scatter splits dim 0 into one equal part per rank of the group, and the
    /// group width does not divide it.
    #[error("dim 0 ({rows}) is not a multiple of the group width {width}")]
    NotDivisible {
        /// The input's dim 0.
        rows: usize,
        /// Ranks in the group.
        width: usize,
    },
    /// An all-to-all-v's send counts do not add up to the input's dim 0.
    #[error("the send counts add up to {sent} rows but the input has {rows}")]
    RowCounts {
        /// The send counts' sum.
        sent: usize,
        /// The input's dim 0.
        rows: usize,
    },
    /// An all-gather or reduce-scatter needs a dim 0 to gather or split along; the
    /// tensor is a scalar.
    #[error("a scalar tensor has no dim 0 to gather or split along; reshape it to [1] first")]
    Scalar,
    /// The output shares its storage with the input without being exactly the input
    /// (pass the same tensor for an in-place call, or separate tensors).
    #[error("the output shares its storage with the input but is not the same elements")]
    OutputAliasesInput,
    /// peercomm refused the collective or reported a failure (bad options, a peer that
    /// timed out, a poisoned communicator); see [`peercomm::Error`].
    #[error(transparent)]
    Peercomm(#[from] peercomm::Error),
    /// candle failed (an allocation, for example).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
