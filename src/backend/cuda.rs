//! The CUDA backend, on cudarc's driver API (loaded at run time: it builds without CUDA).
//! Users hold cudarc `CudaSlice`/`CudaView`/`CudaViewMut` buffers; launches go on the
//! rank's `Arc<CudaStream>` and honour cudarc's event tracking.
//!
//! # IPC
//! `cuMemAlloc` memory (signals) travels as a legacy IPC handle, opened with lazy peer
//! access and closed after synchronising when the [`CudaPeerMapping`] drops: no setup.
//! One host and a P2P path; the importer need not see the exporting device. A handle
//! cannot be opened in its exporting process (`Error::Unsupported`: use
//! [`Backend::map_peer`]). Pool and VMM memory travels with a file descriptor.

/// One driver call (`unsafe`: the site's `// SAFETY:` note covers it), its error
/// mapped to [`Error::Backend`] naming the call (the function, or the name given).
macro_rules! cu {
    ($f:ident($($a:expr),* $(,)?)) => {
        cu!(stringify!($f), $f($($a),*))
    };
    ($name:expr, $f:ident($($a:expr),* $(,)?)) => {
        unsafe { cudarc::driver::sys::$f($($a),*) }
            .result()
            .map_err($crate::backend::cuda::driver_err($name))
    };
}

mod device;
mod graph;
mod memory;
mod shareable;

pub(crate) use device::load_first_of;
use device::{backend_err, bind, driver, driver_err};
pub use device::{Cuda, CudaDevice};
pub use graph::{capture, is_capturing};
use memory::{device_location, device_pool, granted_pools, legacy_ipc_capable, pool_of};
pub use memory::{CudaMemory, CudaPeerMapping};

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaSlice, SyncOnDrop};

use super::{Backend, Descriptor, ExportedRange, Kernel, LaunchDims, MemoryKind, WideArgs};
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::signal::AllReduceArgs;

impl super::sealed::Sealed for Cuda {}

impl Backend for Cuda {
    const NAME: &'static str = "cuda";
    type Device = CudaDevice;
    type Memory = CudaMemory;
    type Access<'a> = SyncOnDrop<'a>;
    fn untracked_access<'a>() -> Self::Access<'a> {
        cudarc::driver::SyncOnDrop::Sync(None)
    }
    type Buffer<T: Element> = CudaSlice<T>;
    type PeerMapping = CudaPeerMapping;

    fn device_count() -> Result<usize> {
        driver()?;
        let n = CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))?;
        Ok(n.max(0) as usize)
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        let count = Self::device_count()?;
        if count == 0 {
            let detail = "no CUDA device".into();
            return Err(Error::NoDevice {
                backend: "cuda",
                detail,
            });
        } else if ordinal >= count {
            let e = format!("CUDA device {ordinal} does not exist ({count} present)");
            return Err(Error::InvalidDevices(e));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        CudaDevice::from_stream(stream)
    }

    fn ordinal(dev: &CudaDevice) -> usize {
        dev.ctx.ordinal()
    }

    fn identity(dev: &CudaDevice) -> Result<super::DeviceIdentity> {
        // cudarc calls cuDeviceGetUuid_v2 where the CUDA version has it (13.x), else
        // cuDeviceGetUuid; both give the MIG instance's UUID on a MIG instance.
        let uuid = dev.ctx.uuid().map_err(driver_err("cuDeviceGetUuid"))?;
        let attribute = |a: CUdevice_attribute| {
            dev.ctx
                .attribute(a)
                .map(|v| v.max(0) as u32)
                .map_err(driver_err("cuDeviceGetAttribute"))
        };
        let pci = super::identity::pci_bus_id(
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
            0,
        );
        let (ordinal, uuid) = (dev.ctx.ordinal(), Some(uuid.bytes.map(|b| b as u8)));
        Ok(super::DeviceIdentity::new(ordinal, uuid, Some(&pci)))
    }

    fn multiprocessor_count(dev: &CudaDevice) -> Result<usize> {
        dev.ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|n| n as usize)
            .map_err(driver_err("cuDeviceGetAttribute"))
    }

    fn architecture(dev: &CudaDevice) -> Result<String> {
        let (major, minor) = dev
            .ctx
            .compute_capability()
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        Ok(format!("sm_{major}{minor}"))
    }

    fn can_access_peer(dev: &CudaDevice, peer: &CudaDevice) -> Result<bool> {
        let (mut can, a, b) = (0i32, dev.ctx.cu_device(), peer.ctx.cu_device());
        // SAFETY: both CUdevice handles come from live contexts; `can` outlives the call.
        cu!(cuDeviceCanAccessPeer(&mut can, a, b))?;
        Ok(can != 0)
    }

    fn enable_peer_access(dev: &CudaDevice, peer: &CudaDevice) -> Result<()> {
        bind(&dev.ctx)?;
        // SAFETY: the current context is `dev`'s and `peer`'s context is alive.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        use sys::CUresult::{CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as ENABLED, CUDA_SUCCESS};
        if !matches!(r, CUDA_SUCCESS | ENABLED) {
            return Err(backend_err("cuCtxEnablePeerAccess", format!("{r:?}")));
        }
        // Peer access does not cover stream-ordered (pool) allocations, which cudarc
        // uses: grant `dev` access to `peer`'s pool too.
        let pool = device_pool(peer)?;
        let desc = memory::read_write(dev.ctx.ordinal());
        // SAFETY: `desc` is one valid descriptor and outlives the call.
        cu!(cuMemPoolSetAccess(pool, &desc, 1))?;
        granted_pools().insert((pool as usize, dev.ctx.ordinal() as i32));
        Ok(())
    }

    fn alloc(dev: &CudaDevice, bytes: usize, _kind: MemoryKind) -> Result<CudaMemory> {
        // Plain cuMemAlloc: covered by peer access and coherent at the owner's L2.
        bind(&dev.ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` outlives the call; the context is current.
        cu!("cuMemAlloc", cuMemAlloc_v2(&mut ptr, bytes.max(1)))?;
        Ok(CudaMemory {
            ctx: dev.ctx.clone(),
            stream: dev.stream.clone(),
            ptr,
            bytes,
        })
    }

    fn memory_ptr(mem: &CudaMemory) -> u64 {
        mem.ptr
    }

    fn map_peer(_dev: &CudaDevice, peer_mem: &CudaMemory) -> Result<u64> {
        // One process with unified addressing: the peer's address is valid here.
        Ok(peer_mem.ptr)
    }

    fn prepare_shared_device(dev: &CudaDevice) -> Result<()> {
        use sys::CUmemPool_attribute::*;
        let pool = device_pool(dev)?;
        let (mut off, mut keep) = (0i32, u64::MAX);
        // SAFETY: `value` points at the attribute's C type (int, cuuint64_t), live for the call.
        let set =
            |attr, value: *mut std::ffi::c_void| cu!(cuMemPoolSetAttribute(pool, attr, value));
        // No allocation waits, through the pool, for a free on another rank's stream.
        set(
            CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            (&mut off as *mut i32).cast(),
        )?;
        // Keep freed memory in the pool: releasing it at a synchronisation can wait for the
        // whole device, including another rank's kernel waiting for this rank.
        set(
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
    }

    fn peer_access_problem(dev: &CudaDevice, ptr: u64, peer: usize) -> Result<Option<String>> {
        if dev.ctx.ordinal() == peer {
            return Ok(None);
        }
        let peer_ordinal = peer as i32;
        let location = device_location(peer);
        let pool = pool_of(ptr)?;
        if !pool.is_null() {
            if granted_pools().contains(&(pool as usize, peer_ordinal)) {
                return Ok(None);
            }
            let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
            let mut loc = location;
            // SAFETY: `pool` came from the driver for a live allocation; out-pointers are valid.
            cu!(cuMemPoolGetAccess(&mut flags, pool, &mut loc))?;
            return Ok(match flags {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => {
                    granted_pools().insert((pool as usize, peer_ordinal));
                    None
                }
                other => Some(format!("its memory pool grants the peer {other:?}")),
            });
        }
        if legacy_ipc_capable(ptr)? {
            // cuMemAlloc memory: covered by the context's peer access.
            return Ok(None);
        }
        // A virtual-memory mapping (cuMemCreate + cuMemMap): access is per range.
        let mut flags: u64 = 0;
        // SAFETY: `flags` and `location` are valid for the call; `ptr` is a mapped address.
        let r = unsafe { sys::cuMemGetAccess(&mut flags, &location, ptr) };
        Ok(match r {
            sys::CUresult::CUDA_SUCCESS if flags & 1 != 0 => None,
            sys::CUresult::CUDA_SUCCESS => Some(format!(
                "its virtual-memory mapping grants the peer access flags {flags}"
            )),
            other => Some(format!(
                "the driver cannot tell whether the peer may read it ({other:?})"
            )),
        })
    }

    fn export_memory(_dev: &CudaDevice, mem: &CudaMemory) -> Result<Vec<u8>> {
        bind(&mem.ctx)?;
        memory::ipc_handle(mem.ptr, mem.bytes).map_err(driver_err("cuIpcGetMemHandle"))
    }

    fn export_range(dev: &CudaDevice, ptr: u64, bytes: usize) -> Result<ExportedRange> {
        match memory::export_range(dev, ptr, bytes)? {
            memory::Export::Legacy(exported) => Ok(exported),
            memory::Export::Other { base, size } => shareable::export(ptr, bytes, base, size),
        }
    }

    fn import_range(
        dev: &CudaDevice,
        handle: &[u8],
        descriptor: Option<Descriptor>,
    ) -> Result<CudaPeerMapping> {
        if handle.starts_with(shareable::POOL_MAGIC) || handle.starts_with(shareable::VMM_MAGIC) {
            return shareable::import(dev, handle, descriptor);
        }
        if descriptor.is_some() {
            let detail = "a legacy IPC handle came with a descriptor".into();
            return Err(super::handle::import_error("cuda", detail));
        }
        memory::import_memory(dev, handle)
    }

    fn import_memory(dev: &CudaDevice, handle: &[u8]) -> Result<CudaPeerMapping> {
        memory::import_memory(dev, handle)
    }

    fn mapping_ptr(mapping: &CudaPeerMapping) -> u64 {
        mapping.ptr
    }

    fn memset_d32(dev: &CudaDevice, ptr: u64, value: u32, words: usize) -> Result<()> {
        bind(&dev.ctx)?;
        // SAFETY: a range of the caller's live allocation, ordered on the rank's stream.
        cu!(cuMemsetD32Async(ptr, value, words, dev.stream.cu_stream()))
    }

    fn memset_d16(dev: &CudaDevice, ptr: u64, value: u16, halves: usize) -> Result<()> {
        bind(&dev.ctx)?;
        // SAFETY: as for memset_d32 (and 2-byte aligned).
        cu!(cuMemsetD16Async(ptr, value, halves, dev.stream.cu_stream()))
    }

    fn read(dev: &CudaDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        bind(&dev.ctx)?;
        let (host, n, s) = (dst.as_mut_ptr().cast(), dst.len(), dev.stream.cu_stream());
        // SAFETY: a range of the caller's live allocation; synchronised before `dst` is read.
        cu!("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2(host, ptr, n, s))?;
        Self::synchronize(dev)
    }

    fn write(dev: &CudaDevice, ptr: u64, src: &[u8]) -> Result<()> {
        bind(&dev.ctx)?;
        let (host, n, s) = (src.as_ptr().cast(), src.len(), dev.stream.cu_stream());
        // SAFETY: a range of the caller's live allocation; synchronised before returning.
        cu!("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2(ptr, host, n, s))?;
        Self::synchronize(dev)
    }

    fn read_words_now(dev: &CudaDevice, ptr: u64, dst: &mut [u32]) -> Result<()> {
        bind(&dev.ctx)?;
        let (host, n) = (dst.as_mut_ptr().cast(), std::mem::size_of_val(dst));
        // SAFETY: a range of the caller's live allocation; this synchronous copy (legacy
        // default stream: it does not wait for the rank's stream) writes `dst` at once.
        cu!("cuMemcpyDtoH", cuMemcpyDtoH_v2(host, ptr, n))
    }

    fn launch(
        dev: &CudaDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        super::check_kernel(Self::NAME, kernel, None)?;
        device::launch_one(dev, kernel, dims, args)
    }

    fn launch_overlapping(
        dev: &CudaDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        device::launch_overlapping(dev, kernel, dims, args)
    }

    fn launch_wide(
        dev: &CudaDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: WideArgs<'_>,
    ) -> Result<()> {
        super::check_kernel(Self::NAME, kernel, Some(args))?;
        match args {
            WideArgs::Group(g) => device::launch_one(dev, kernel, dims, g),
            WideArgs::Exchange(x) => device::launch_one(dev, kernel, dims, x),
        }
    }

    fn synchronize(dev: &CudaDevice) -> Result<()> {
        dev.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

    fn alloc_buffer<T: Element>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
        // cudarc multiplies without checking: a wrapped size would allocate too little.
        if !matches!(len.checked_mul(std::mem::size_of::<T>()), Some(b) if b <= isize::MAX as usize)
        {
            let detail = format!(
                "{len} elements of {:?} overflow the address space",
                T::DTYPE
            );
            return Err(backend_err("cuMemAllocAsync", detail));
        }
        dev.stream
            .alloc_zeros::<T>(len)
            .map_err(driver_err("cuMemAllocAsync"))
    }

    fn upload<T: Element>(dev: &CudaDevice, src: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        let (n, len) = (src.len(), dst.len());
        if n != len {
            let what = format!("upload of {n} elements into a buffer of {len}");
            return Err(Error::LengthMismatch {
                rank: dev.ctx.ordinal(),
                what,
            });
        }
        dev.stream
            .memcpy_htod(src, dst)
            .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        Self::synchronize(dev)
    }

    fn download<T: Element>(dev: &CudaDevice, src: &CudaSlice<T>) -> Result<Vec<T>> {
        dev.stream
            .clone_dtoh(src)
            .map_err(driver_err("cuMemcpyDtoHAsync"))
    }
}

super::impl_typed_buffer!(Cuda, CudaSlice);
