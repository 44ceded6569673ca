//! HIP memory: allocations (`HipMemory`, `HipAllocation`, the typed `HipBuffer`), IPC
//! export and import (`HipPeerMapping`).

use std::ffi::{c_char, c_uint, c_void};
use std::marker::PhantomData;
use std::ptr::null_mut;

use super::super::{Backend, DeviceBuffer, DeviceBufferMut, MemoryKind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

use super::device::*;
use super::ffi;
use super::runtime::*;
use crate::backend::handle::ipc;

/// How an allocation was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HipAllocation {
    /// `hipMalloc`: coarse-grained device memory (data buffers).
    CoarseGrained,
    /// `hipExtMallocWithFlags(hipDeviceMallocUncached)`: not cached, coherent with the
    /// peers at every access (signal memory).
    Uncached,
    /// `hipExtMallocWithFlags(hipDeviceMallocFinegrained)`: the fallback for signal
    /// memory where the runtime rejects the uncached flag.
    FineGrained,
}

/// An owned device allocation.
pub struct HipMemory {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) ordinal: usize,
    pub(super) allocation: HipAllocation,
}

impl std::fmt::Debug for HipMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("ordinal", &self.ordinal)
            .field("allocation", &self.allocation)
            .finish()
    }
}

impl HipMemory {
    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// How it was allocated.
    pub fn allocation(&self) -> HipAllocation {
        self.allocation
    }
    /// Ordinal of the device holding it.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Drop for HipMemory {
    fn drop(&mut self) {
        // SAFETY: owned by this value; hipFree waits for device work that may still use it.
        unsafe { ffi::hipFree(self.ptr as *mut c_void) };
    }
}

/// Magic of a HIP legacy IPC record ([`ipc`]).
const IPC_MAGIC: &[u8; 4] = b"pchi";

/// Another process's allocation mapped into this one ([`Backend::import_memory`]).
/// Dropping it synchronises the importing device, then closes it (errors ignored).
pub struct HipPeerMapping {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) ordinal: usize,
}

impl HipPeerMapping {
    /// Bytes of the exported allocation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Ordinal of the importing device.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl std::fmt::Debug for HipPeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipPeerMapping")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Drop for HipPeerMapping {
    fn drop(&mut self) {
        // Work that may still use the mapping must finish first.
        let _ = set_device(self.ordinal);
        // SAFETY: opened here by hipIpcOpenMemHandle, closed once, after the device's work.
        unsafe {
            ffi::hipDeviceSynchronize();
            ffi::hipIpcCloseMemHandle(self.ptr as *mut c_void);
        }
    }
}

pub(super) fn allocate(ordinal: usize, bytes: usize, kind: MemoryKind) -> Result<HipMemory> {
    set_device(ordinal)?;
    let bytes = bytes.max(1);
    let mut ptr: *mut c_void = null_mut();
    let allocation = match kind {
        MemoryKind::Plain | MemoryKind::SharedData => {
            // SAFETY: `ptr` is a valid out pointer.
            hip!(hipMalloc(&mut ptr, bytes))?;
            HipAllocation::CoarseGrained
        }
        MemoryKind::Signal | MemoryKind::SharedSignal => {
            // SAFETY: `ptr` is a valid out pointer.
            let uncached =
                unsafe { ffi::hipExtMallocWithFlags(&mut ptr, bytes, ffi::MALLOC_UNCACHED) };
            if uncached == ffi::SUCCESS {
                HipAllocation::Uncached
            } else {
                ptr = null_mut();
                // SAFETY: as above.
                let fine = unsafe {
                    ffi::hipExtMallocWithFlags(&mut ptr, bytes, ffi::MALLOC_FINE_GRAINED)
                };
                if fine != ffi::SUCCESS {
                    let (uncached, fine) = (describe(uncached), describe(fine));
                    return Err(backend_err(
                        "hipExtMallocWithFlags",
                        format!(
                            "{bytes} bytes of signal memory on device {ordinal}: uncached: \
                             {uncached}; fine-grained: {fine}"
                        ),
                    ));
                }
                HipAllocation::FineGrained
            }
        }
    };
    Ok(HipMemory {
        ptr: ptr as u64,
        bytes,
        ordinal,
        allocation,
    })
}

/// The handle record of the allocation of `bytes` at `base` (of the current device), or
/// the runtime's status.
pub(super) fn handle_record(
    base: u64,
    bytes: usize,
) -> std::result::Result<Vec<u8>, ffi::HipStatus> {
    let mut handle = ffi::IpcMemHandle {
        reserved: [0; ffi::IPC_HANDLE_SIZE],
    };
    // SAFETY: `handle` is a valid out pointer; the runtime checks `base`.
    let status = unsafe { ffi::hipIpcGetMemHandle(&mut handle, base as *mut c_void) };
    if status != ffi::SUCCESS {
        return Err(status);
    }
    let raw = handle.reserved.map(|c| c as u8);
    Ok(ipc::write(IPC_MAGIC, bytes, raw))
}

pub(super) fn export_range(dev: &HipDevice, ptr: u64, bytes: usize) -> Result<(Vec<u8>, u64)> {
    set_device(dev.ordinal)?;
    let cannot = |reason: String| Error::CannotRegister { rank: 0, reason };
    let (mut base, mut size): (*mut c_void, usize) = (null_mut(), 0);
    // SAFETY: out pointers valid for the call; the runtime checks `ptr`.
    let status = unsafe { ffi::hipMemGetAddressRange(&mut base, &mut size, ptr as *mut c_void) };
    if status != ffi::SUCCESS {
        return Err(cannot(format!(
            "{ptr:#x} is not device memory of this device ({})",
            describe(status)
        )));
    }
    let base = base as u64;
    if ptr + bytes as u64 > base + size as u64 {
        return Err(cannot(format!(
            "{bytes} bytes at {ptr:#x} run past the end of its allocation ({size} bytes at {base:#x})"
        )));
    }
    let handle = handle_record(base, size).map_err(|status| {
        cannot(format!(
            "hipIpcGetMemHandle: {} (memory from a pool or a virtual-memory mapping cannot \
             be exported this way; allocate it with Comm::alloc_symmetric)",
            describe(status)
        ))
    })?;
    Ok((handle, ptr - base))
}

pub(super) fn import_memory(dev: &HipDevice, handle: &[u8]) -> Result<HipPeerMapping> {
    let (bytes, raw) = ipc::read(Hip::NAME, IPC_MAGIC, handle)?;
    set_device(dev.ordinal)?;
    let ipc = ffi::IpcMemHandle {
        reserved: raw.map(|b| b as c_char),
    };
    let open = |flags: c_uint| {
        let mut ptr: *mut c_void = null_mut();
        // SAFETY: `ptr` is a valid out pointer; the runtime validates the handle.
        let status = unsafe { ffi::hipIpcOpenMemHandle(&mut ptr, ipc, flags) };
        (status, ptr)
    };
    // ROCm 6 and 7 require the flag to be their hipIpcMemLazyEnablePeerAccess (1)
    // and reject anything else as an invalid value; HIP 5.x headers define it as 0.
    let (mut status, mut ptr) = open(ffi::IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if status == ffi::ERROR_INVALID_VALUE {
        (status, ptr) = open(ffi::IPC_MEM_LAZY_ENABLE_PEER_ACCESS_HIP5);
    }
    if status != ffi::SUCCESS {
        return Err(backend_err(
            "hipIpcOpenMemHandle",
            format!(
                "{}: the exporter may have freed the memory or exited, or run on another \
                 host or with other devices visible",
                describe(status)
            ),
        ));
    }
    Ok(HipPeerMapping {
        ptr: ptr as u64,
        bytes,
        ordinal: dev.ordinal,
    })
}

/// A typed device buffer on one AMD GPU.
pub struct HipBuffer<T: Element> {
    pub(super) mem: HipMemory,
    pub(super) len: usize,
    pub(super) _t: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for HipBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("mem", &self.mem)
            .finish()
    }
}

impl<T: Element> HipBuffer<T> {
    /// Device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.mem.ptr
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.
unsafe impl<T: Element> DeviceBuffer<Hip> for HipBuffer<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.mem.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a HipDevice) -> (u64, ()) {
        (self.mem.ptr, ())
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.
unsafe impl<T: Element> DeviceBufferMut<Hip> for HipBuffer<T> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a HipDevice) -> (u64, ()) {
        (self.mem.ptr, ())
    }
}
