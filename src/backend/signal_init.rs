//! Signal buffers made and initialised through a backend, laid out as
//! [`crate::SignalLayout`] says.

use super::{Backend, MemoryKind, LAMPORT_SENTINEL};
use crate::error::Result;
use crate::signal::{Signal, SignalLayout};

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
pub(crate) fn init_signal_buffer_with_counter_base<B: Backend>(
    dev: &B::Device,
    signal: &B::Memory,
    layout: SignalLayout,
    base: u32,
) -> Result<()> {
    layout.validate()?;
    let ptr = B::memory_ptr(signal);
    let counters = std::mem::offset_of!(Signal, lamport_state);
    let header = std::mem::size_of::<Signal>();
    B::memset_d32(dev, ptr, base, counters / 4)?;
    B::memset_d32(dev, ptr + counters as u64, 0, (header - counters) / 4)?;
    B::memset_d32(
        dev,
        ptr + layout.lamport_offset() as u64,
        LAMPORT_SENTINEL,
        layout.lamport_region_bytes() / 4,
    )
}
