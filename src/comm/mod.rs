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

mod config;
mod core;
mod per_rank;
mod single;
mod zero_copy;

pub use self::core::planning::collective::CollectiveOptions;
pub use self::core::planning::sizing::MemoryFootprint;
pub use self::core::Rank;
pub use config::{AllReduceOptions, CommConfig};
pub use per_rank::group::CommGroup;
pub use per_rank::Comm;
#[doc(hidden)]
pub use per_rank::{free_expired_teardowns, parked_teardowns};
pub use single::group::CommunicatorGroup;
pub use single::Communicator;
#[cfg(feature = "cuda")]
pub use zero_copy::capture::RegisteredGraph;
pub use zero_copy::capture_inputs::CaptureInputs;
pub use zero_copy::registered::{RegisterError, Registered};
pub use zero_copy::symmetric::{SymmetricBuffer, SYMMETRIC_SEGMENT_BYTES};
