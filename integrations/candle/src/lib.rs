//! Collectives on [candle](https://docs.rs/candle-core) tensors through peercomm's
//! per-rank communicator ([`peercomm::Comm`]), for tensor-parallel inference with one
//! thread or process per GPU: all-reduce with every [`ReduceOp`] (sum, product, max,
//! min, average), all-gather and reduce-scatter along dim 0, broadcast.
//!
//! [`CandleComm`] is one rank: made from the rank's candle CUDA device, it runs every
//! collective on that device's stream, so they are ordered with the rank's other
//! candle work without any synchronisation. Each collective comes in up to three forms:
//! allocating (`all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`: a new
//! tensor), into a tensor the caller allocated (`*_into`: allocates nothing, for CUDA
//! graph capture) and in place (`all_reduce_in_place`, `broadcast_in_place`); each has a
//! `_with` form taking the options. [`CandleComm::all_reduce_sum_storage`] works on a
//! `CudaStorage` directly (inside a candle custom op). f32, f16 and bf16 tensors, any
//! shape, contiguous (a narrowed contiguous tensor is fine). Bad input returns a typed
//! [`Error`] before anything is launched.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use peercomm_candle::{CandleComm, CommConfig, ReduceOp, UniqueId};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let id = UniqueId::new()?; // rank 0 makes it and sends it to the other ranks
//! let (rank, world) = (0, 2);
//! let device = Device::new_cuda_with_stream(rank)?;
//! let comm = CandleComm::from_rank(&device, rank, world, &id, CommConfig::default())?;
//! let partial = Tensor::ones((8, 4096), DType::BF16, &device)?;
//! let sum = comm.all_reduce(&partial, &ReduceOp::Sum)?; // 2.0 everywhere
//! let rows = comm.all_gather(&partial)?; // [16, 4096]
//! let part = comm.reduce_scatter(&partial, &ReduceOp::Max)?; // [4, 4096]
//! # Ok(()) }
//! ```
//!
//! CUDA graphs: an engine captures these collectives inside a capture it began itself
//! on the model's stream; [`CandleComm`]'s docs say how.
//!
//! [`mlp`] has the tensor-parallel MLP block of the example and the tests.

#![warn(missing_docs)]

mod comm;
mod error;
pub mod mlp;

pub use comm::CandleComm;
pub use error::{Error, Result};
pub use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, CommConfig, ReduceOp};

/// The communicator's id, which every rank passes to [`CandleComm::from_rank`]
/// (peercomm's [`peercomm::bootstrap::UniqueId`], re-exported so that an engine
/// bootstraps with no direct peercomm dependency).
///
/// Rank 0 (or a launcher that is not a rank, which then calls
/// [`UniqueId::release`]) makes it with [`UniqueId::new`] and hands it to the other
/// ranks: in one process by reference, across processes as text (`id.to_string()`,
/// parsed back with `str::parse::<UniqueId>()`) or bytes (`to_bytes` / `from_bytes`)
/// through the environment or a private channel, never on the command line, since it
/// holds the secret each connection proves it knows. The `tp-mlp` example's
/// `--processes` mode does this.
pub use peercomm::bootstrap::UniqueId;
