//! All-reduce (sum) on [candle](https://docs.rs/candle-core) tensors through peercomm's
//! per-rank communicator ([`peercomm::Comm`]), for tensor-parallel inference with one
//! thread or process per GPU.
//!
//! [`CandleComm`] is one rank: made from the rank's candle CUDA device, it runs every
//! collective on that device's stream, so the sums are ordered with the rank's other
//! candle work without any synchronisation. Out of place ([`CandleComm::all_reduce_sum`])
//! a new tensor is returned; in place ([`CandleComm::all_reduce_sum_in_place`]) the
//! tensor's own storage is overwritten; [`CandleComm::all_reduce_sum_storage`] works on
//! a `CudaStorage` directly (inside a candle custom op). f32, f16 and bf16 tensors, any
//! shape, contiguous (a narrowed contiguous tensor is fine). Bad input returns a typed
//! [`Error`] before anything is launched.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use peercomm::{bootstrap::UniqueId, AllReduceOptions, CommConfig};
//! use peercomm_candle::CandleComm;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let id = UniqueId::new()?; // rank 0 makes it and sends it to the other ranks
//! let (rank, world) = (0, 2);
//! let device = Device::new_cuda_with_stream(rank)?;
//! let comm = CandleComm::from_rank(&device, rank, world, &id, CommConfig::default())?;
//! let partial = Tensor::ones((8, 4096), DType::BF16, &device)?;
//! let sum = comm.all_reduce_sum(&partial, &AllReduceOptions::new())?; // 2.0 everywhere
//! # Ok(()) }
//! ```
//!
//! [`mlp`] has the tensor-parallel MLP block of the example and the tests.

#![warn(missing_docs)]

mod comm;
mod error;
pub mod mlp;

pub use comm::CandleComm;
pub use error::{Error, Result};
pub use peercomm::{Algorithm, AllReduceOptions, CommConfig};
