//! Communicators: one per-rank core and two front doors over it.
//!
//! - `core/`: one rank (its device, signal, peers, settings, routing) and the only
//!   code that validates a rank's side of a call, plans it and launches kernels.
//! - `single/`: the single-controller [`Communicator`], one process driving every
//!   device: one core per device, calls checked across ranks, launched on each core
//!   under one lock.
//! - `per_rank/`: the per-rank [`Comm`], one rank per thread or process: a core plus
//!   its bootstrap, and its teardown.
//! - `config.rs`: what both are built with ([`CommConfig`], [`AllReduceOptions`]).

#[cfg(feature = "cuda")]
mod capture;
mod config;
mod core;
mod per_rank;
mod single;

pub use self::core::collective::CollectiveOptions;
pub use self::core::sizing::MemoryFootprint;
pub use self::core::Rank;
#[cfg(feature = "cuda")]
pub use capture::RegisteredGraph;
pub use config::{AllReduceOptions, CommConfig};
pub use per_rank::capture_inputs::CaptureInputs;
pub use per_rank::group::CommGroup;
pub use per_rank::registered::{RegisterError, Registered};
pub use per_rank::symmetric::{SymmetricBuffer, SYMMETRIC_SEGMENT_BYTES};
pub use per_rank::Comm;
#[doc(hidden)]
pub use per_rank::{free_expired_teardowns, parked_teardowns};
pub use single::group::CommunicatorGroup;
pub use single::Communicator;
