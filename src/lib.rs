//! peercomm: multi-GPU intra-node all-reduce over peer-to-peer memory.
//!
//! GPUs synchronise thread blocks directly through counters in each other's memory
//! (the *signal counter-bank protocol*, defined once in `include/peercomm_signal.h`),
//! with no host round trip. On top of it: all-reduce (sum) over f32, f16 and bf16 with
//! one-stage, two-stage and barrier-free (Lamport) kernels, subgroups, and a dispatch
//! table per architecture, GPU count and message size.
//!
//! Backends: [`backend::host::Host`] (always built; CPU threads over memory arenas,
//! the reference the tests run everywhere), `backend::cuda::Cuda` (feature `cuda`) and
//! `backend::hip::Hip` (feature `hip`).
//!
//! ```
//! use peercomm::backend::{host::Host, Backend, TypedBuffer};
//! use peercomm::{AllReduceOptions, CommConfig, Communicator, DType, Tensor, TensorMut};
//!
//! // Scratch sized for the largest message (6 f32 per rank here).
//! let config = CommConfig::for_largest_message(6, DType::F32)?;
//! let comm = Communicator::<Host>::new(&[0, 1], config)?;
//! let mut ins = Vec::new();
//! let mut outs = Vec::new();
//! for (r, rank) in comm.ranks().iter().enumerate() {
//!     ins.push(Host::alloc_from(rank.device(), &[r as f32 + 1.0; 6])?);
//!     outs.push(Host::alloc_buffer::<f32>(rank.device(), 6)?);
//! }
//! // The slice form: the buffers as they are, one per rank.
//! comm.all_reduce_sum_slices(&ins, &mut outs, &AllReduceOptions::new())?;
//! comm.synchronize()?; // waits, then reads every rank's error record
//! assert_eq!(outs[1].to_host(comm.rank(1).device())?, vec![3.0; 6]);
//!
//! // The shaped form checks that every rank passes the same shape.
//! let inputs: Vec<_> = ins.iter().map(|b| Tensor::new(b, &[2, 3])).collect();
//! let mut outputs: Vec<_> = outs.iter_mut().map(|b| TensorMut::new(b, &[2, 3])).collect();
//! comm.all_reduce_sum(&inputs, &mut outputs, &AllReduceOptions::new())?;
//! drop(outputs);
//! comm.synchronize()?;
//! assert_eq!(outs[0].to_host(comm.rank(0).device())?, vec![3.0; 6]);
//! # Ok::<(), peercomm::Error>(())
//! ```
//!
//! # Layers
//!
//! A module imports only modules drawn below it, and the modules of one row import
//! nothing of each other (`scripts/check-imports.py` checks it, in CI):
//!
//! ```text
//!   comm                   the communicators: single controller, per rank, capture
//!   external   tensor      NCCL / RCCL / host stand-in, per backend | shaped views
//!   backend                the Backend trait; host, cuda, hip; peer access; signals
//!   dispatch   protocol    the dispatch table (data) | the host model of the protocol
//!   signal                 the signal layout, the kernels' arguments, protocol helpers
//!   error                  Error, Result
//!   dtype      bootstrap   element types | rendezvous between processes
//! ```
//!
//! This crate root only declares the modules and re-exports what users name from it.

#![warn(missing_docs)]

pub mod backend;
pub mod bootstrap;
mod comm;
pub mod dispatch;
mod dtype;
mod error;
pub mod external;
#[doc(hidden)]
pub mod protocol;
pub mod signal;
mod tensor;

pub use backend::p2p::{enable_p2p, is_p2p_enabled};
#[doc(hidden)]
pub use backend::signal_init::init_signal_buffer_with_counter_base;
pub use backend::signal_init::{create_signal_buffer, init_signal_buffer};
pub use backend::Backend;
pub use bootstrap::{Bootstrap, BootstrapError, HostId, TcpBootstrap, UniqueId};
#[doc(hidden)]
pub use comm::{free_expired_teardowns, parked_teardowns};
pub use comm::{
    AllReduceOptions, CollectiveOptions, Comm, CommConfig, Communicator, MemoryFootprint, Rank,
};
pub use dispatch::Algorithm;
pub use dtype::{BackendElement, DType, Element};
pub use error::{CallField, Error, Result};
pub use signal::{
    barrier_domain, circular_add, reduce_scatter_part, SignalLayout, MAX_GPUS,
    MAX_NUM_BLOCKS_UPPER_BOUND, NUM_BARRIER_DOMAINS,
};
pub use tensor::{Tensor, TensorMut};
