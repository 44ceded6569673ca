//! peercomm: multi-GPU collectives inside one node over peer-to-peer memory (NVLink,
//! xGMI), for Rust inference and training engines: all-reduce, reduce and
//! reduce-scatter ([`ReduceOp`]: sum, product, max, min, average), all-gather, broadcast,
//! scatter, send / recv, all-to-all ([`Comm::all_to_all_v`] for expert parallelism) and a
//! fused all-reduce + residual + RMSNorm, over f32, f16, bf16, f64, i8, u8, i32,
//! u32, i64 and u64 ([`DType`]; the fused call f32, f16 and bf16), on NVIDIA (`cuda` feature, on cudarc) and AMD (`hip` feature)
//! GPUs, with NCCL/RCCL taking over where peer memory cannot serve.
//!
//! GPUs synchronise thread blocks through counters in each other's memory
//! (`include/peercomm_signal.h`), with no host round trip.
//!
//! # One rank per thread or process: [`Comm`]
//!
//! Shaped like cudarc's `nccl::Comm`: every rank builds its own [`Comm`] with
//! [`Comm::from_rank`] from the [`UniqueId`] rank 0 made; each call enqueues this rank's
//! kernel on its stream. On the host reference backend, two ranks in two threads:
//!
//! ```
//! use peercomm::backend::{host::Host, Backend};
//! use peercomm::{Comm, CommConfig, ReduceOp, UniqueId};
//!
//! // Rank 0 makes the id and hands it to the other ranks (here threads of one process;
//! // between processes as text or bytes, see "Launching ranks" below).
//! let id = UniqueId::new()?;
//! let sums = std::thread::scope(|s| {
//!     let ranks: Vec<_> = (0..2)
//!         .map(|rank| {
//!             let id = &id;
//!             s.spawn(move || -> peercomm::Result<Vec<f32>> {
//!                 // On CUDA: the rank's cudarc Arc<CudaStream> instead of the device.
//!                 let device = Host::open(rank)?;
//!                 let comm = Comm::from_rank(device, rank, 2, id, CommConfig::default())?;
//!                 let send = Host::alloc_from(comm.device(), &[rank as f32 + 1.0; 4])?;
//!                 let mut recv = Host::alloc_buffer::<f32>(comm.device(), 4)?;
//!                 comm.all_reduce(&send, &mut recv, &ReduceOp::Sum)?; // returns at once
//!                 comm.synchronize()?; // waits; a device-side timeout or mismatch is an Err here
//!                 Host::download(comm.device(), &recv)
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|r| r.join().unwrap()).collect::<peercomm::Result<Vec<_>>>()
//! })?;
//! assert_eq!(sums, vec![vec![3.0; 4]; 2]);
//! # Ok::<(), peercomm::Error>(())
//! ```
//!
//! On CUDA the buffers are cudarc `CudaSlice`s on the rank's `Arc<CudaStream>`
//! (`examples/from-nccl.rs`). Every collective of [`Comm`] has a checked example in
//! `examples/collectives.rs`: [`Comm::all_reduce`], [`Comm::all_gather`],
//! [`Comm::reduce_scatter`] (parts by [`reduce_scatter_part`]), [`Comm::broadcast`],
//! [`Comm::scatter`], [`Comm::all_reduce_residual_rms_norm`] and the in-place forms.
//!
//! # Launching ranks
//!
//! [`UniqueId::new`] binds rank 0's listener (on `127.0.0.1`, or
//! [`bootstrap::BOOTSTRAP_ADDR_ENV`]) and draws a secret; its text form or
//! [`UniqueId::to_bytes`] reaches the other ranks as NCCL's id does. A launcher that is
//! not rank 0 calls [`UniqueId::release`] before starting the ranks
//! (`examples/launch.rs`). Engines with their own store pass a [`Bootstrap`] to
//! [`Comm::from_bootstrap`].
//!
//! # One process driving every GPU: [`SingleController`]
//!
//! One communicator over several devices of this process, every collective enqueued on
//! every rank at once, with the checks only it can make (every rank's shapes).
//!
//! ```
//! use peercomm::backend::{host::Host, Backend, TypedBuffer};
//! use peercomm::{AllReduceOptions, CommConfig, DType, ReduceOp, SingleController};
//! use peercomm::{TensorView, TensorViewMut};
//!
//! // Scratch sized for the largest message (6 f32 per rank here).
//! let config = CommConfig::for_largest_message(6, DType::F32)?;
//! let comm = SingleController::<Host>::new(&[0, 1], config)?;
//! let (mut ins, mut outs) = (Vec::new(), Vec::new());
//! for (r, rank) in comm.cores().iter().enumerate() {
//!     ins.push(Host::alloc_from(rank.device(), &[r as f32 + 1.0; 6])?);
//!     outs.push(Host::alloc_buffer::<f32>(rank.device(), 6)?);
//! }
//! // Shaped views, checked alike on every rank (`all_reduce_slices` takes the buffers).
//! let inputs: Vec<_> = ins.iter().map(|b| TensorView::new(b, &[2, 3])).collect();
//! let mut outputs: Vec<_> = outs.iter_mut().map(|b| TensorViewMut::new(b, &[2, 3])).collect();
//! comm.all_reduce(&inputs, &mut outputs, &ReduceOp::Sum, &AllReduceOptions::new())?;
//! drop(outputs);
//! comm.synchronize()?; // waits, then reads every rank's error record
//! assert_eq!(outs[1].to_host(comm.core(1).device())?, vec![3.0; 6]);
//! # Ok::<(), peercomm::Error>(())
//! ```
//!
//! # Backends
//!
//! [`backend::host::Host`] (always built: CPU threads, the reference the tests run
//! everywhere), `backend::cuda::Cuda` (feature `cuda`), `backend::hip::Hip` (`hip`).
//!
//! # Layers
//!
//! A module imports only modules drawn below it, and the modules of one row nothing of
//! each other (`scripts/check-imports.py`):
//!
//! ```text
//!   unstable               internals for the crate's own tests (feature `unstable`)
//!   comm                   the communicators: single controller, per rank, capture
//!   external   tensor      NCCL / RCCL / host stand-in, per backend | shaped views
//!   backend                the Backend trait; host, cuda, hip; peer access; signals
//!   device                 the device API: its headers, DeviceComm, BarrierKind
//!   dispatch   protocol    the dispatch table (data) | the host model of the protocol
//!   signal                 the signal layout, the kernels' arguments, protocol helpers
//!   error                  Error, Result
//!   dtype      bootstrap   element types | rendezvous between processes
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod bootstrap;
mod comm;
pub mod device;
mod dispatch;
mod dtype;
mod error;
mod external;
mod os;
mod protocol;
mod signal;
mod tensor;
#[cfg(feature = "unstable")]
pub mod unstable;

pub use backend::p2p::{enable_p2p, is_p2p_enabled};
pub use backend::signal_init::{create_signal_buffer, init_signal_buffer};
pub use backend::Backend;
pub use backend::{DeviceIdentity, IntoDevice};
pub use bootstrap::{Bootstrap, BootstrapError, HostId, TcpBootstrap, UniqueId};
#[cfg(feature = "cuda")]
pub use comm::RegisteredGraph;
pub use comm::{
    AllReduceOptions, CaptureInputs, CollectiveOptions, Comm, CommConfig, CommGroup,
    MemoryFootprint, Rank, RegisterError, Registered, SingleController, SingleControllerGroup,
    SymmetricBuffer, SYMMETRIC_SEGMENT_BYTES,
};
#[allow(deprecated)]
pub use comm::{Communicator, CommunicatorGroup};
pub use dispatch::Algorithm;
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CallField, Error, Recovery, Result};
#[cfg(feature = "fault-injection")]
pub use external::Simulation;
pub use external::{Fallback, FallbackConfig, SizeRouting};
/// The `half` crate peercomm's 16-bit element types come from (`half::f16`,
/// `half::bf16`), so callers need no version of their own to match.
pub use half;
pub use signal::{
    circular_add, reduce_scatter_part, Signal, SignalLayout, MAX_GPUS, MAX_NUM_BLOCKS_UPPER_BOUND,
    NUM_BARRIER_DOMAINS,
};
#[allow(deprecated)]
pub use tensor::{Tensor, TensorMut};
pub use tensor::{TensorView, TensorViewMut};
