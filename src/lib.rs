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

use std::collections::HashSet;
use std::sync::Mutex;

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

use backend::MemoryKind;

/// Pairs (backend, from, to) whose peer access this process has enabled.
/// (backend name, from ordinal, to ordinal).
type PeerPair = (&'static str, usize, usize);
static ENABLED_PEERS: Mutex<Option<HashSet<PeerPair>>> = Mutex::new(None);

/// Enables peer access between every ordered pair of `devices`. Returns `Ok(false)`
/// (and enables nothing more) when some pair cannot reach each other; never panics.
pub fn enable_p2p<B: Backend>(devices: &[B::Device]) -> Result<bool> {
    for a in devices {
        for b in devices {
            if B::ordinal(a) != B::ordinal(b) && !B::can_access_peer(a, b)? {
                return Ok(false);
            }
        }
    }
    let mut enabled = ENABLED_PEERS.lock().unwrap_or_else(|e| e.into_inner());
    let set = enabled.get_or_insert_with(HashSet::new);
    for a in devices {
        for b in devices {
            let (oa, ob) = (B::ordinal(a), B::ordinal(b));
            if oa != ob {
                B::enable_peer_access(a, b)?;
                set.insert((B::NAME, oa, ob));
            }
        }
    }
    Ok(true)
}

/// Whether [`enable_p2p`] has enabled peer access between every ordered pair of these
/// devices in this process.
pub fn is_p2p_enabled<B: Backend>(devices: &[B::Device]) -> bool {
    let enabled = ENABLED_PEERS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(set) = enabled.as_ref() else {
        return devices.len() <= 1;
    };
    devices.iter().all(|a| {
        devices.iter().all(|b| {
            let (oa, ob) = (B::ordinal(a), B::ordinal(b));
            oa == ob || set.contains(&(B::NAME, oa, ob))
        })
    })
}

/// Allocates one signal buffer of `layout` on `dev` (uncached / fine-grained where the
/// vendor distinguishes) and initialises it.
pub fn create_signal_buffer<B: Backend>(
    dev: &B::Device,
    layout: SignalLayout,
) -> Result<B::Memory> {
    let mem = B::alloc(dev, layout.checked_total_bytes()?, MemoryKind::Signal)?;
    init_signal_buffer::<B>(dev, &mem, layout)?;
    Ok(mem)
}

/// Zeroes a signal buffer's counters, Lamport state and error record, and fills its
/// Lamport region with the -0.0 sentinel. Enqueued on the device's stream; every rank
/// must be idle (no collective in flight) while any is re-initialised.
pub fn init_signal_buffer<B: Backend>(
    dev: &B::Device,
    signal: &B::Memory,
    layout: SignalLayout,
) -> Result<()> {
    init_signal_buffer_with_counter_base::<B>(dev, signal, layout, 0)
}

/// As [`init_signal_buffer`], with every barrier counter set to `base` instead of 0.
#[doc(hidden)]
pub fn init_signal_buffer_with_counter_base<B: Backend>(
    dev: &B::Device,
    signal: &B::Memory,
    layout: SignalLayout,
    base: u32,
) -> Result<()> {
    layout.validate()?;
    let ptr = B::memory_ptr(signal);
    let counters = std::mem::offset_of!(signal::Signal, lamport_state);
    let header = std::mem::size_of::<signal::Signal>();
    B::memset_d32(dev, ptr, base, counters / 4)?;
    B::memset_d32(dev, ptr + counters as u64, 0, (header - counters) / 4)?;
    B::memset_d32(
        dev,
        ptr + layout.lamport_offset() as u64,
        backend::LAMPORT_SENTINEL,
        layout.lamport_region_bytes() / 4,
    )
}
