//! Host allocations (heap or shared memory file, freed in stream order) and mappings of
//! exported memory.

use std::alloc::Layout;
use std::ptr::NonNull;

use super::device::{alloc_error, HostDevice};
use super::shm;
use super::stream::FreeOnStream;
use crate::backend::MemoryKind;
use crate::error::Result;

/// A 256-byte aligned, zero-filled heap block; freed when dropped.
pub(super) struct HeapBlock {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the block is owned by this value and only reached through raw addresses by
// kernels whose synchronisation is the protocol under test; any thread may free it.
unsafe impl Send for HeapBlock {}
// SAFETY: as above; `&HeapBlock` exposes only the address.
unsafe impl Sync for HeapBlock {}

impl HeapBlock {
    fn new(bytes: usize) -> Result<Self> {
        let layout = Layout::from_size_align(bytes.max(1), 256).map_err(|_| {
            alloc_error(format!("{bytes} bytes is more than an allocation can hold"))
        })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| alloc_error(format!("out of memory allocating {bytes} bytes")))?;
        Ok(HeapBlock { ptr, layout })
    }
}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once; owners drop it only
        // after the kernels that used it (stream order).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// What backs a `HostMemory`.
pub(super) enum Storage {
    /// The heap: [`MemoryKind::Plain`] and [`MemoryKind::Signal`].
    Heap(HeapBlock),
    /// A shared memory file other processes can map: shared signal and
    /// [`MemoryKind::SharedData`].
    Shared(shm::SharedFile),
}

/// An allocation in a host arena, 256-byte aligned and zero-filled (heap, or a shared
/// memory file). Freed in stream order, as `cuMemFreeAsync`: after every kernel already
/// enqueued on its device (whose barriers span the peers' reads of it).
pub struct HostMemory {
    pub(super) storage: FreeOnStream<Storage>,
    pub(super) ordinal: usize,
}

impl HostMemory {
    pub(super) fn new(dev: &HostDevice, bytes: usize, kind: MemoryKind) -> Result<Self> {
        let storage = match kind {
            MemoryKind::Plain | MemoryKind::Signal => Storage::Heap(HeapBlock::new(bytes)?),
            MemoryKind::SharedSignal | MemoryKind::SharedData => {
                Storage::Shared(shm::SharedFile::create(bytes)?)
            }
        };
        Ok(HostMemory {
            storage: FreeOnStream::new(storage, &dev.stream),
            ordinal: dev.ordinal,
        })
    }
    pub(super) fn addr(&self) -> u64 {
        match self.storage.get() {
            Storage::Heap(b) => b.ptr.as_ptr() as u64,
            Storage::Shared(f) => f.addr(),
        }
    }
}

/// Memory another process (or this one) exported, mapped here by
/// [`Backend::import_memory`](crate::backend::Backend::import_memory); unmapped in
/// stream order on the importing device's stream.
pub struct HostPeerMapping {
    pub(super) mapping: FreeOnStream<shm::Mapping>,
}

impl HostPeerMapping {
    /// Bytes mapped (the exported allocation's size).
    pub fn bytes(&self) -> usize {
        self.mapping.get().len()
    }
}

impl std::fmt::Debug for HostPeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPeerMapping")
            .field("addr", &format_args!("{:#x}", self.mapping.get().addr()))
            .field("bytes", &self.bytes())
            .finish()
    }
}
