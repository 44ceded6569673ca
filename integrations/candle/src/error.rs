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
    /// peercomm sums f32, f16 and bf16 only.
    #[error("peercomm sums f32, f16 and bf16 tensors, not {0:?}")]
    UnsupportedDType(DType),
    /// peercomm refused the collective or reported a failure (bad options, a peer that
    /// timed out, a poisoned communicator); see [`peercomm::Error`].
    #[error(transparent)]
    Peercomm(#[from] peercomm::Error),
    /// candle failed (an allocation, for example).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
