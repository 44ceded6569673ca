//! Pool and `cuMemCreate` memory, exported as a POSIX file descriptor (sent beside the
//! record). An imported pool is opened once per exporter pool and context and destroyed
//! with its last pointer; a VMM allocation is mapped whole into a reserved range.
//! Records (LE): magic `pccp` (pool) or `pccv` (VMM), version 1, the exporter's token,
//! the allocation's size, its base, the pool's (or allocation handle's) value in the
//! exporter, and for pools the 64-byte `CUmemPoolPtrExportData`.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::super::handle::{import_error, process_token, Reader, Writer};
use super::super::ExportedRange;
use super::device::{backend_err, bind, driver_err, CudaDevice};
use super::memory::{
    address_range, cannot, pool_of, read_write, release_pool, CudaPeerMapping, ImportedPool, Unmap,
    IMPORTED_POOLS,
};
use crate::error::{Error, Result};

/// Magic of a pool allocation's handle.
pub(super) const POOL_MAGIC: &[u8; 4] = b"pccp";
/// Magic of a virtual-memory allocation's handle.
pub(super) const VMM_MAGIC: &[u8; 4] = b"pccv";
const VERSION: u32 = 1;
/// Header 8, token 8, size 8, base 8, identity 8.
const VMM_BYTES: usize = 40;
/// As [`VMM_BYTES`], then the pool pointer's 64-byte export data.
const POOL_BYTES: usize = VMM_BYTES + 64;

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// The descriptor `export` writes to its out-value (an int for the POSIX-fd type), or
/// the refusal `refused` words from the driver's answer.
fn export_fd(
    export: impl FnOnce(*mut c_void) -> sys::CUresult,
    refused: impl FnOnce(sys::CUresult) -> String,
) -> Result<OwnedFd> {
    let mut fd: i32 = -1;
    let r = export(&mut fd as *mut i32 as *mut c_void);
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(cannot(refused(r)));
    }
    // SAFETY: the driver returned a new descriptor that this process owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Exports `[ptr, ptr + bytes)` of memory that legacy IPC cannot export (its
/// allocation, or mapping, is `size` bytes at `base`): pool memory and virtual memory
/// made shareable, as a descriptor; anything else is refused.
pub(super) fn export(ptr: u64, bytes: usize, base: u64, size: usize) -> Result<ExportedRange> {
    let pool = pool_of(ptr)?;
    if !pool.is_null() {
        return export_pool(pool, base, size, ptr - base);
    }
    export_vmm(ptr, bytes, base, size)?.ok_or_else(|| {
        cannot(
            "the memory is neither cuMemAlloc memory, nor from a memory pool, nor a \
             virtual-memory mapping, so CUDA cannot export it to another process; allocate \
             the buffer with Comm::alloc_symmetric instead (ranks in one process can \
             register any buffer)"
                .into(),
        )
    })
}

/// Exports the pool allocation of `size` bytes at `base` (holding the range at
/// `offset`), from `pool`.
fn export_pool(
    pool: sys::CUmemoryPool,
    base: u64,
    size: usize,
    offset: u64,
) -> Result<ExportedRange> {
    let descriptor = export_fd(
        // SAFETY: `out` is an int; `pool` is the live pool of an allocation of this context.
        |out| unsafe { sys::cuMemPoolExportToShareableHandle(out, pool, POSIX_FD, 0) },
        |r| {
            format!(
                "the memory comes from a stream-ordered pool made without the POSIX file \
                 descriptor handle type (as cudarc's allocations and the device's default \
                 pool are), so no other process can map it ({r:?}); allocate the buffer with \
                 Comm::alloc_symmetric, or from a pool created with handleTypes = \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (ranks in one process can register \
                 any buffer)"
            )
        },
    )?;
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: `data` outlives the call; `base` is the start of a live pool allocation.
    unsafe { sys::cuMemPoolExportPointer(&mut data, base) }
        .result()
        .map_err(|e| cannot(format!("cuMemPoolExportPointer: {e:?}")))?;
    let (fields, tail) = ((size, base, pool as u64), &data.reserved);
    Ok(exported(POOL_MAGIC, fields, tail, offset, descriptor))
}

/// The range at `offset` of an allocation, `(size, base, identity)` in the exporter, with
/// its descriptor and its record (of `magic`, ending with `tail`).
fn exported(
    magic: &[u8; 4],
    (size, base, identity): (usize, u64, u64),
    tail: &[u8],
    offset: u64,
    descriptor: OwnedFd,
) -> ExportedRange {
    let handle = Writer::new(magic, VERSION)
        .u64(process_token())
        .u64(size as u64);
    ExportedRange {
        handle: handle.u64(base).u64(identity).bytes(tail).finish(),
        offset,
        descriptor: Some(descriptor),
    }
}

/// Releases a retained allocation handle on drop.
struct Retained(sys::CUmemGenericAllocationHandle);

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: the handle was retained (or imported) once by this process.
        let _ = unsafe { sys::cuMemRelease(self.0) };
    }
}

fn retain(ptr: u64) -> Option<Retained> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` outlives the call; the driver checks that `ptr` is mapped.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut c_void) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(Retained(handle))
}

/// Exports the virtual-memory allocation that backs `[ptr, ptr + bytes)` (mapped at
/// `base`, `size` bytes); `Ok(None)` when `ptr` is no virtual-memory mapping.
fn export_vmm(ptr: u64, bytes: usize, base: u64, size: usize) -> Result<Option<ExportedRange>> {
    let Some(first) = retain(ptr) else {
        return Ok(None);
    };
    let last = retain(ptr + bytes.max(1) as u64 - 1)
        .ok_or_else(|| cannot(format!("{bytes} bytes at {ptr:#x} run past its mapping")))?;
    if last.0 != first.0 {
        return Err(cannot(format!(
            "{bytes} bytes at {ptr:#x} span two virtual-memory allocations; register each \
             allocation's range on its own"
        )));
    }
    let descriptor = export_fd(
        // SAFETY: `out` is an int; the handle is retained.
        |out| unsafe { sys::cuMemExportToShareableHandle(out, first.0, POSIX_FD, 0) },
        |r| {
            format!(
                "the memory is a virtual-memory allocation (cuMemCreate) made without \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in its requestedHandleTypes, so no \
                 other process can map it ({r:?})"
            )
        },
    )?;
    let (fields, offset) = ((size, base, first.0), ptr - base);
    Ok(Some(exported(VMM_MAGIC, fields, &[], offset, descriptor)))
}

/// The imported pool of `key`, opened from `descriptor` when it is not open yet, with
/// one more pointer counted (given back with [`release_pool`]).
fn open_pool(key: (u64, u64, usize), descriptor: OwnedFd) -> Result<sys::CUmemoryPool> {
    let mut pools = IMPORTED_POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.iter_mut().find(|p| p.key == key) {
        p.pointers += 1;
        return Ok(p.pool as sys::CUmemoryPool);
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the handle is the fd's value (the driver does not keep it); `pool` outlives it.
    let fd = descriptor.as_raw_fd() as usize as *mut c_void;
    cu!(cuMemPoolImportFromShareableHandle(
        &mut pool, fd, POSIX_FD, 0
    ))?;
    let access = read_write(key.2);
    // SAFETY: `pool` was just imported; `access` outlives the call.
    if let Err(e) = unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) }.result() {
        // The driver may refuse to set what already holds (the pool's own device).
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        let mut location = access.location;
        // SAFETY: out-pointers valid for the call; `pool` is imported.
        let held = unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut location) };
        if held != sys::CUresult::CUDA_SUCCESS
            || flags != sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        {
            // SAFETY: the pool was imported here and has no pointer yet.
            let _ = unsafe { sys::cuMemPoolDestroy(pool) };
            return Err(driver_err("cuMemPoolSetAccess")(e));
        }
    }
    pools.push(ImportedPool {
        key,
        pool: pool as usize,
        pointers: 1,
    });
    Ok(pool)
}

/// The refusal of an import whose descriptor is not the allocation its handle names.
fn mismatch(detail: String) -> Error {
    import_error(
        "cuda",
        format!("the descriptor received does not match its handle: {detail}"),
    )
}

/// Checks that the allocation imported from a descriptor (`generic`) is what a `pccv`
/// handle of `size` bytes names: pinned device memory, `size` a whole number of granules
/// (mapping it checks the exact size: the driver maps an imported allocation only whole).
fn check_vmm_import(generic: sys::CUmemGenericAllocationHandle, size: usize) -> Result<()> {
    // SAFETY: all-zero bits are a valid CUmemAllocationProp (C enums, integers, a null
    // pointer and a union of integers); the driver fills it.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    // SAFETY: `prop` outlives the call; `generic` is a live imported handle.
    cu!(cuMemGetAllocationPropertiesFromHandle(&mut prop, generic))?;
    // The allocation's type and its location's type, read as C ints (a value this
    // build's enums lack must not be read as one): words 0 and 2 in every CUDA layout.
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    // SAFETY: reads of two aligned 4-byte ints inside `prop` (at least 16 bytes: two
    // enums then the 8-byte location).
    let (kind, location) = unsafe {
        let words = std::ptr::addr_of!(prop) as *const u32;
        (words.read(), words.add(2).read())
    };
    let pinned = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED as u32;
    let device = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32;
    if (kind, location) != (pinned, device) {
        return Err(mismatch(format!(
            "its allocation is of type {kind} at a location of type {location}, not pinned \
             device memory"
        )));
    }
    let mut granularity = 0usize;
    // SAFETY: out-pointer and `prop` (as the driver returned it) valid for the call.
    let min = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    cu!(cuMemGetAllocationGranularity(&mut granularity, &prop, min))?;
    if size == 0 || granularity == 0 || !size.is_multiple_of(granularity) {
        return Err(mismatch(format!(
            "the handle says {size} bytes, which is no whole number of the allocation's \
             {granularity}-byte granules"
        )));
    }
    Ok(())
}

/// Maps a `pccp` or `pccv` handle with its descriptor into `dev`'s context, checking
/// that the descriptor is the allocation the handle names (its size, and for virtual
/// memory its kind; a pool's export data names its pointer), else a typed error.
pub(super) fn import(
    dev: &CudaDevice,
    handle: &[u8],
    descriptor: Option<OwnedFd>,
) -> Result<CudaPeerMapping> {
    let pool = handle.starts_with(POOL_MAGIC);
    let (magic, bytes) = [(VMM_MAGIC, VMM_BYTES), (POOL_MAGIC, POOL_BYTES)][pool as usize];
    let mut r = Reader::open("cuda", handle, magic, VERSION, bytes)?;
    let (token, size, _base, identity) = (r.u64(), r.u64(), r.u64(), r.u64());
    if token == process_token() {
        return Err(Error::Unsupported(
            "cuda: import_memory: this process exported the handle; within one process use \
             the allocation's own address"
                .into(),
        ));
    }
    let descriptor = descriptor
        .ok_or_else(|| import_error("cuda", "the handle came without its descriptor".into()))?;
    let size = usize::try_from(size)
        .map_err(|_| import_error("cuda", format!("size {size} does not fit here")))?;
    bind(&dev.ctx)?;
    let ordinal = dev.ctx.ordinal();
    if pool {
        let mut data = sys::CUmemPoolPtrExportData {
            reserved: r.array::<64>(),
        };
        let pool = open_pool((token, identity, ordinal), descriptor)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `pool` is imported in this context; `data` and `ptr` outlive the call.
        if let Err(e) = unsafe { sys::cuMemPoolImportPointer(&mut ptr, pool, &mut data) }.result() {
            release_pool(pool as usize);
            return Err(backend_err(
                "cuMemPoolImportPointer",
                format!("{e:?}: the exporter may have freed the memory or exited"),
            ));
        }
        // From here the mapping's drop frees the pointer, on the error path too.
        let mapping = CudaPeerMapping::new(dev, ptr, size, Unmap::PoolPointer(pool as usize));
        let (base, bytes) = address_range(ptr).map_err(driver_err("cuMemGetAddressRange"))?;
        if (base, bytes) != (ptr, size) {
            return Err(mismatch(format!(
                "the pool allocation it opens is {bytes} bytes at offset {} of its range, \
                 where the handle says {size} bytes at offset 0",
                ptr.wrapping_sub(base)
            )));
        }
        return Ok(mapping);
    }
    let mut generic: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: the handle is the fd's value (the driver does not keep it); `generic` outlives it.
    let fd = descriptor.as_raw_fd() as usize as *mut c_void;
    cu!(cuMemImportFromShareableHandle(&mut generic, fd, POSIX_FD))?;
    // The mapping below keeps the memory; this reference goes at the end of scope.
    let generic = Retained(generic);
    check_vmm_import(generic.0, size)?;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: `va` outlives the call; the driver picks the address.
    cu!(cuMemAddressReserve(&mut va, size, 0, 0, 0))?;
    // From here the mapping's drop unmaps and frees the range, on errors too.
    let mut mapping = CudaPeerMapping::new(dev, va, size, Unmap::Reserved { mapped: false });
    // SAFETY: `va` is a fresh reservation of `size` bytes; the handle is imported. The
    // driver maps an imported allocation only whole: this checks its exact size.
    unsafe { sys::cuMemMap(va, size, 0, generic.0, 0) }
        .result()
        .map_err(|e| {
            mismatch(format!(
                "mapping the {size} bytes its handle says failed ({e:?}): the allocation is \
                 of another size"
            ))
        })?;
    mapping.unmap = Unmap::Reserved { mapped: true };
    let access = read_write(ordinal);
    // SAFETY: `[va, va + size)` is mapped; `access` outlives the call.
    cu!(cuMemSetAccess(va, size, &access, 1))?;
    Ok(mapping)
}
