//! CUDA memory: allocations (`CudaMemory`), pool access, legacy IPC (`CudaPeerMapping`).

use std::collections::BTreeSet;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, DriverError};

use super::super::handle::import_error;
use super::super::ExportedRange;
use super::device::{backend_err, bind, driver_err, CudaDevice};
use crate::backend::handle::ipc;
use crate::error::{Error, Result};

/// The location of device `ordinal`, for any CUDA version cudarc binds: the id of
/// `{ CUmemLocationType type; int id; }` (in a union from 13.2) is written at its C offset.
pub(super) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    // SAFETY: all-zero bits are a valid CUmemLocation (a C enum and an int / a union of
    // plain integers).
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: the id is the 4-byte int at offset 4 in every CUDA version's layout (the
    // size assertion above pins the 8-byte struct); the write stays inside `location`.
    unsafe {
        std::ptr::addr_of_mut!(location)
            .cast::<i32>()
            .add(1)
            .write(ordinal as i32)
    };
    location
}

/// Memory pools known to grant read-write access to a device: (pool, device ordinal).
static GRANTED_POOLS: Mutex<BTreeSet<(usize, i32)>> = Mutex::new(BTreeSet::new());

/// [`GRANTED_POOLS`], locked.
pub(super) fn granted_pools() -> std::sync::MutexGuard<'static, BTreeSet<(usize, i32)>> {
    GRANTED_POOLS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A device allocation (signal buffers and other internal memory), freed on drop.
pub struct CudaMemory {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<cudarc::driver::CudaStream>,
    pub(super) ptr: u64,
    pub(super) bytes: usize,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMemory")
            .field("ptr", &self.ptr)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl CudaMemory {
    /// The stream of the device it was allocated for.
    pub fn stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        &self.stream
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // Work that may still use the memory must finish first.
        let _ = self.ctx.synchronize();
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Magic of a CUDA legacy IPC record ([`ipc`]).
const IPC_MAGIC: &[u8; 4] = b"pccu";

/// Another process's allocation mapped into this one. Dropping it synchronises the
/// importing context, then unmaps (errors ignored, never panicked on).
pub struct CudaPeerMapping {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: u64,
    pub(super) bytes: usize,
    pub(super) unmap: Unmap,
}

/// How an imported mapping is given back.
#[derive(Debug)]
pub(super) enum Unmap {
    /// `cuIpcCloseMemHandle` (legacy IPC).
    Ipc,
    /// `cuMemFree` of a pointer imported from this pool, then the pool's release.
    PoolPointer(usize),
    /// `cuMemUnmap` where mapped, then `cuMemAddressFree` of the reservation.
    Reserved { mapped: bool },
}

impl CudaPeerMapping {
    /// The mapping of `bytes` at `ptr` in `dev`'s context, given back by `unmap` on drop.
    pub(super) fn new(dev: &CudaDevice, ptr: u64, bytes: usize, unmap: Unmap) -> Self {
        CudaPeerMapping {
            ctx: dev.ctx.clone(),
            ptr,
            bytes,
            unmap,
        }
    }
    /// Bytes of the exported allocation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl std::fmt::Debug for CudaPeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPeerMapping")
            .field("ordinal", &self.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for CudaPeerMapping {
    fn drop(&mut self) {
        // Work that may still use the mapping must finish first.
        let _ = self.ctx.synchronize();
        let _ = self.ctx.bind_to_thread();
        match self.unmap {
            Unmap::Ipc => {
                // SAFETY: opened here by cuIpcOpenMemHandle, closed once, after the work.
                let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
            }
            Unmap::PoolPointer(pool) => {
                // SAFETY: imported here from `pool`, freed once, after the work.
                let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
                release_pool(pool);
            }
            Unmap::Reserved { mapped } => {
                if mapped {
                    // SAFETY: `[ptr, ptr + bytes)` was mapped here, after the work.
                    let _ = unsafe { sys::cuMemUnmap(self.ptr, self.bytes) };
                }
                // SAFETY: the range was reserved here and is freed once.
                let _ = unsafe { sys::cuMemAddressFree(self.ptr, self.bytes) };
            }
        }
    }
}

/// An imported pool, shared by the pointers imported from it in one context.
pub(super) struct ImportedPool {
    /// (exporter's token, exporter's pool, importing ordinal).
    pub(super) key: (u64, u64, usize),
    pub(super) pool: usize,
    pub(super) pointers: usize,
}

/// The pools imported in this process.
pub(super) static IMPORTED_POOLS: Mutex<Vec<ImportedPool>> = Mutex::new(Vec::new());

/// One pointer of imported pool `pool` given back: the pool is destroyed with its last.
pub(super) fn release_pool(pool: usize) {
    let mut pools = IMPORTED_POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = pools.iter().position(|p| p.pool == pool) {
        pools[k].pointers -= 1;
        if pools[k].pointers == 0 {
            pools.remove(k);
            // SAFETY: every pointer imported from the pool was freed.
            let _ = unsafe { sys::cuMemPoolDestroy(pool as sys::CUmemoryPool) };
        }
    }
}

/// The current memory pool of `dev`'s device (where cudarc allocates buffers).
pub(super) fn device_pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` outlives the call; the device handle comes from a live context.
    cu!(cuDeviceGetMemPool(&mut pool, dev.ctx.cu_device()))?;
    Ok(pool)
}

/// Read-write access for device `ordinal`.
pub(super) fn read_write(ordinal: usize) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// Attribute `attr` (named `name`) of `ptr`, read as a `T` (its C type's size).
fn pointer_attribute<T: Default>(
    name: &'static str,
    attr: sys::CUpointer_attribute,
    ptr: u64,
) -> Result<T> {
    let mut value = T::default();
    // SAFETY: `value` is a valid out-pointer of the attribute's size for the call.
    let out = &mut value as *mut T as *mut c_void;
    cu!(name, cuPointerGetAttribute(out, attr, ptr))?;
    Ok(value)
}

/// The pool `ptr` was allocated from, or null.
pub(super) fn pool_of(ptr: u64) -> Result<sys::CUmemoryPool> {
    let name = "cuPointerGetAttribute(MEMPOOL_HANDLE)";
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE;
    Ok(pointer_attribute::<usize>(name, attr, ptr)? as sys::CUmemoryPool)
}

/// Whether `ptr` is `cuMemAlloc` memory (legacy CUDA IPC can export it).
pub(super) fn legacy_ipc_capable(ptr: u64) -> Result<bool> {
    let name = "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)";
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE;
    Ok(pointer_attribute::<i32>(name, attr, ptr)? != 0)
}

/// The record of the `cuMemAlloc` allocation of `bytes` at `base` (of the current
/// context).
pub(super) fn ipc_handle(base: u64, bytes: usize) -> std::result::Result<Vec<u8>, DriverError> {
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `handle` outlives the call; `base` starts a live cuMemAlloc allocation here.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }.result()?;
    let raw = handle.reserved.map(|c| c as u8);
    Ok(ipc::write(IPC_MAGIC, bytes, raw))
}

/// The allocation holding `ptr`: its base and size.
pub(super) fn address_range(ptr: u64) -> std::result::Result<(u64, usize), DriverError> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: out-pointers valid for the call; the driver checks `ptr`.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result()?;
    Ok((base, size))
}

/// A refused export.
pub(super) fn cannot(reason: String) -> Error {
    Error::CannotRegister { rank: 0, reason }
}

/// What [`export_range`] found: a legacy IPC export, or memory that legacy IPC cannot
/// export (its allocation or mapping: `size` bytes at `base`).
pub(super) enum Export {
    Legacy(ExportedRange),
    Other { base: u64, size: usize },
}

pub(super) fn export_range(dev: &CudaDevice, ptr: u64, bytes: usize) -> Result<Export> {
    bind(&dev.ctx)?;
    let (base, size) = address_range(ptr).map_err(|e| {
        cannot(format!(
            "{ptr:#x} is not device memory of this context ({e:?})"
        ))
    })?;
    if ptr + bytes as u64 > base + size as u64 {
        return Err(cannot(format!(
            "{bytes} bytes at {ptr:#x} run past the end of its allocation ({size} bytes at {base:#x})"
        )));
    }
    if !legacy_ipc_capable(ptr)? {
        // Pool and virtual memory: exported as a file descriptor where it was made so.
        return Ok(Export::Other { base, size });
    }
    let handle = ipc_handle(base, size).map_err(|e| cannot(format!("cuIpcGetMemHandle: {e:?}")))?;
    Ok(Export::Legacy(ExportedRange {
        handle,
        offset: ptr - base,
        descriptor: None,
    }))
}

pub(super) fn import_memory(dev: &CudaDevice, handle: &[u8]) -> Result<CudaPeerMapping> {
    let (bytes, raw) = ipc::read("cuda", IPC_MAGIC, handle)?;
    bind(&dev.ctx)?;
    let ipc = sys::CUipcMemHandle {
        reserved: raw.map(|b| b as std::ffi::c_char),
    };
    let lazy = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` outlives the call; the context is current; the driver checks the handle.
    let opened = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, ipc, lazy) };
    match opened {
        sys::CUresult::CUDA_SUCCESS => {}
        sys::CUresult::CUDA_ERROR_INVALID_CONTEXT => {
            return Err(ipc::same_process(
                "cuda",
                "cuIpcOpenMemHandle: CUDA_ERROR_INVALID_CONTEXT (the driver's answer to a \
                 handle of this same process)",
            ))
        }
        other => {
            return Err(backend_err(
                "cuIpcOpenMemHandle",
                format!(
                    "{other:?}: the exporter may have freed the memory or exited, run on \
                     another host, or its GPU and this one have no peer-to-peer path"
                ),
            ))
        }
    }
    // From here on the mapping's drop closes it, on the error path too.
    let mapping = CudaPeerMapping::new(dev, ptr, bytes, Unmap::Ipc);
    let (_, size) = address_range(ptr).map_err(driver_err("cuMemGetAddressRange"))?;
    if size < bytes {
        return Err(import_error(
            "cuda",
            format!("the handle says {bytes} bytes, but the allocation it opens has {size}"),
        ));
    }
    Ok(mapping)
}
