//! The CUDA backend, on cudarc's driver API (dynamically loaded: it builds with no CUDA
//! installed and finds libcuda at run time).
//!
//! Users hold cudarc `CudaSlice`/`CudaView`/`CudaViewMut` buffers; every launch goes
//! on the rank's `Arc<CudaStream>`, and cudarc's event tracking is honoured: a
//! collective waits for the last write of each buffer it reads and records its own
//! read/write events on the rank's stream.
//!
//! # IPC
//! With one process per GPU, each rank maps its peers' signal memory through CUDA's
//! legacy IPC handles: [`Backend::export_memory`] is `cuIpcGetMemHandle` and
//! [`Backend::import_memory`] is `cuIpcOpenMemHandle` with
//! `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, in the importing device's context; dropping the
//! [`CudaPeerMapping`] synchronises that context and calls `cuIpcCloseMemHandle`.
//! Legacy handles were chosen over the virtual memory management API (`cuMemCreate`
//! with a POSIX-fd or fabric handle type, `cuMemExportToShareableHandle`) because they
//! work on the plain `cuMemAlloc` memory this backend already allocates for signals,
//! with no extra setup: the VMM route would need `cuMemCreate` allocations made
//! shareable up front, mapped and access-granted range by range, and its POSIX fds
//! would have to travel over a Unix socket instead of as plain bytes. Legacy IPC
//! needs the processes on one host and a peer-to-peer path between the two GPUs (the
//! open enables peer access lazily); the importer need not see the exporting device:
//! CUDA's runtime documents that `cudaIpcOpenMemHandle` "can open handles to devices
//! that may not be visible in the process calling the API", so processes isolated by
//! `CUDA_VISIBLE_DEVICES` (each seeing its own GPU as device 0) map each other's
//! signals, and nothing of the import uses the exporter's ordinal. Ranks are told apart
//! by [`Backend::identity`] (the UUID, `cuDeviceGetUuid`, and the PCI attributes), not
//! by ordinal. (Not run on two isolated GPUs yet: that run belongs to the GPU runs.)
//! Legacy IPC cannot open a handle in the process that exported it:
//! that is `Error::Unsupported`, and one process needs no import (peers' memory is
//! reached at its own address, [`Backend::map_peer`]). Every allocation of this backend
//! can be exported, not only [`MemoryKind::SharedSignal`] ones. Seen on an H200
//! (driver 580, two processes on one GPU, `tests/ipc.rs`): the import works, a
//! same-process import is answered `CUDA_ERROR_INVALID_CONTEXT` by the driver (the
//! token check answers first), and a handle whose exporter freed the memory
//! `CUDA_ERROR_INVALID_VALUE`.
//! Import each handle once per process and share the mapping (as vLLM caches its
//! opened handles): what the driver does with a second open of one handle in one
//! context is not relied on here.
//!
//! The handle, 88 bytes, little-endian (framed as every backend's, see
//! `Backend::export_memory`): magic `pccu`, version `u32` = 1, the exporting
//! process's random token `u64` (to recognise an import in the exporting process
//! before the driver is asked), the allocation's size `u64` (the importer checks the
//! range it opens is at least that large), then the 64-byte `CUipcMemHandle`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

mod graph;
pub use graph::{capture, is_capturing};

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, DeviceSlice, LaunchConfig, PushKernelArg, SyncOnDrop,
};

use super::handle::{import_error, process_token, Reader, Writer};
use super::{Backend, DeviceBuffer, DeviceBufferMut, Kernel, LaunchDims, MemoryKind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, GroupArgs};

/// The kernels of `kernels-cuda/`, compiled by build.rs into one fatbin.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/peercomm_cuda.fatbin"));

// SAFETY: AllReduceArgs is a #[repr(C)] plain-old-data struct of integers, passed by
// value exactly as the kernels declare it (the same C header).
unsafe impl DeviceRepr for AllReduceArgs {}
// SAFETY: GroupArgs is a #[repr(C)] plain-old-data struct of integers (an
// AllReduceArgs, two u32 and an array of u64 entries), passed by value exactly as the
// batched all-reduce kernels declare it (the same C header).
unsafe impl DeviceRepr for GroupArgs {}

/// The CUDA backend (feature `cuda`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cuda;

fn driver_err(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::Backend {
        backend: "cuda",
        call,
        detail: e.to_string(),
    }
}

/// Loads libcuda once. cudarc's loader panics when the library is missing, so the
/// library is looked for first (with libloading, under the names the driver is
/// installed as): when it is missing, that is [`Error::NoDevice`] and cudarc is never
/// asked. Nothing here touches the process-wide panic hook, so no other thread's panic
/// message can be lost while the driver loads. (Should cudarc still panic, the panic is
/// caught and reported as `NoDevice`; the default hook prints it once.)
fn driver() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            libcuda_present()?;
            match std::panic::catch_unwind(CudaContext::device_count) {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("the CUDA driver library (libcuda) could not be loaded".into()),
            }
        })
        .clone()
        .map_err(|detail| Error::NoDevice {
            backend: "cuda",
            detail,
        })
}

/// Names the CUDA driver library is installed as.
fn libcuda_names() -> Vec<String> {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    vec![
        format!("{DLL_PREFIX}cuda{DLL_SUFFIX}.1"),
        format!("{DLL_PREFIX}cuda{DLL_SUFFIX}"),
        "nvcuda.dll".to_string(),
    ]
}

/// Loads the first of `names` that loads and keeps it loaded for the process (cudarc
/// loads the same library next and keeps its handle): whether one did. The check that
/// keeps cudarc from panicking on a missing library (libcuda here, libnccl in
/// `external::nccl`).
pub(crate) fn load_first_of(names: &[String]) -> bool {
    names.iter().any(|name| {
        // SAFETY: loading the library runs its initialisers, which is what cudarc's own
        // loader does next with the same library.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                std::mem::forget(lib);
                true
            }
            Err(_) => false,
        }
    })
}

/// Whether the driver library can be loaded (it stays loaded: cudarc loads it again).
fn libcuda_present() -> std::result::Result<(), String> {
    let names = libcuda_names();
    if load_first_of(&names) {
        return Ok(());
    }
    Err(format!(
        "the CUDA driver library could not be loaded (looked for {names:?}; is the NVIDIA \
         driver installed and on the library path?)"
    ))
}

/// One GPU: its context, the stream collectives run on, and the loaded kernels.
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: KernelTable,
}

/// Every kernel entry point, resolved in one context.
type KernelTable = Arc<HashMap<Kernel, CudaFunction>>;

impl super::IntoDevice for CudaDevice {
    type Backend = Cuda;
    fn into_device(self) -> Result<CudaDevice> {
        Ok(self)
    }
}

/// cudarc's stream: collectives run on it, ordered with the caller's other work (see
/// [`CudaDevice::from_stream`]).
impl super::IntoDevice for Arc<CudaStream> {
    type Backend = Cuda;
    fn into_device(self) -> Result<CudaDevice> {
        CudaDevice::from_stream(self)
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

impl CudaDevice {
    /// Uses an existing stream (and its context): collectives on this rank are
    /// enqueued on it, ordered with the caller's other work.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Self> {
        driver()?;
        let ctx = stream.context().clone();
        let kernels = load_kernels(&ctx)?;
        Ok(CudaDevice {
            ctx,
            stream,
            kernels,
        })
    }
    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream collectives of this rank run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// Loads the embedded fatbin into a context once (per context) and resolves every
/// kernel symbol.
fn load_kernels(ctx: &Arc<CudaContext>) -> Result<KernelTable> {
    static CACHE: OnceLock<std::sync::Mutex<HashMap<usize, KernelTable>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = ctx.cu_ctx() as usize;
    if let Some(k) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(k.clone());
    }
    let module: Arc<CudaModule> = ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(FATBIN.to_vec()))
        .map_err(driver_err("cuModuleLoadData (embedded fatbin: rebuild with PEERCOMM_CUDA_ARCHS covering this GPU?)"))?;
    let mut map = HashMap::new();
    for k in Kernel::all() {
        let f = module
            .load_function(&k.symbol())
            .map_err(driver_err("cuModuleGetFunction"))?;
        map.insert(k, f);
    }
    let map = Arc::new(map);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, map.clone());
    Ok(map)
}

/// The location of device `ordinal`, built the same way whatever CUDA version the
/// application's cudarc binds: `CUmemLocation` is `{ CUmemLocationType type; int id; }`
/// in every version, though from 13.2 the id sits in a union (and the bindings change
/// shape with it), so the id is written at its C offset.
fn device_location(ordinal: usize) -> sys::CUmemLocation {
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    // SAFETY: all-zero bits are a valid CUmemLocation (a C enum and an int / a union of
    // plain integers).
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    // SAFETY: the id is the 4-byte int at offset 4 in every CUDA version's layout (the
    // size assertion above pins the 8-byte struct); the write stays inside `location`.
    unsafe {
        (std::ptr::addr_of_mut!(location) as *mut i32)
            .add(1)
            .write(ordinal as i32)
    };
    location
}

/// Memory pools known to grant read-write access to a device: (pool, device ordinal).
fn granted_pools() -> &'static std::sync::Mutex<std::collections::HashSet<(usize, i32)>> {
    static POOLS: OnceLock<std::sync::Mutex<std::collections::HashSet<(usize, i32)>>> =
        OnceLock::new();
    POOLS.get_or_init(Default::default)
}

/// A device allocation (signal buffers and other internal memory), freed on drop.
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMemory")
            .field("ptr", &self.ptr)
            .field("bytes", &self.bytes)
            .finish()
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

/// Magic of a CUDA IPC handle.
const IPC_MAGIC: &[u8; 4] = b"pccu";
/// Version of the CUDA IPC handle layout.
const IPC_VERSION: u32 = 1;
/// Bytes of a CUDA IPC handle: header 8, exporter's process token 8, size 8,
/// `CUipcMemHandle` 64.
const IPC_HANDLE_BYTES: usize = 88;

/// The error for a handle this process exported itself.
fn same_process_import(detail: &str) -> Error {
    Error::Unsupported(format!(
        "cuda: import_memory: {detail}: CUDA IPC cannot open a handle in the process that \
         exported it; within one process use the allocation's own address (map_peer)"
    ))
}

/// Another process's allocation mapped into this one with `cuIpcOpenMemHandle`
/// ([`Backend::import_memory`]). Dropping it synchronises the importing context (kernels
/// there may still use the memory, as [`CudaMemory`]'s drop does) and closes the
/// mapping with `cuIpcCloseMemHandle`; errors are ignored there, never panicked on.
pub struct CudaPeerMapping {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl CudaPeerMapping {
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
        // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed once
        // (drop), after the context's work.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

fn ordinal_of<T>(s: &impl DeviceSlice<T>) -> usize {
    s.stream().context().ordinal()
}

macro_rules! impl_cuda_buffer {
    ($($ty:ty),*) => {$(
        // SAFETY: the pointer, length, dtype and device come from the allocation itself.
        unsafe impl<T: Element> DeviceBuffer<Cuda> for $ty {
            fn dtype(&self) -> DType {
                T::DTYPE
            }
            fn len(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn device_ordinal(&self) -> usize {
                ordinal_of(self)
            }
            fn read_ptr<'a>(&'a self, dev: &'a CudaDevice) -> (u64, SyncOnDrop<'a>) {
                self.device_ptr(&dev.stream)
            }
        }
    )*};
}
impl_cuda_buffer!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBufferMut<Cuda> for CudaSlice<T> {
    fn write_ptr<'a>(&'a mut self, dev: &'a CudaDevice) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(&dev.stream)
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBufferMut<Cuda> for CudaViewMut<'_, T> {
    fn write_ptr<'a>(&'a mut self, dev: &'a CudaDevice) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_mut(&dev.stream)
    }
}

impl Backend for Cuda {
    const NAME: &'static str = "cuda";
    type Device = CudaDevice;
    type Memory = CudaMemory;
    type Access<'a> = SyncOnDrop<'a>;
    type Buffer<T: Element> = CudaSlice<T>;
    type PeerMapping = CudaPeerMapping;

    fn device_count() -> Result<usize> {
        driver()?;
        let n = CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))?;
        Ok(n.max(0) as usize)
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        let count = Self::device_count()?;
        if ordinal >= count {
            return Err(if count == 0 {
                Error::NoDevice {
                    backend: "cuda",
                    detail: "no CUDA device".into(),
                }
            } else {
                Error::InvalidDevices(format!(
                    "CUDA device {ordinal} does not exist ({count} present)"
                ))
            });
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
        Ok(super::DeviceIdentity::new(
            dev.ctx.ordinal(),
            Some(uuid.bytes.map(|b| b as u8)),
            Some(&pci),
        ))
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
        let mut can = 0i32;
        // SAFETY: both CUdevice handles come from live contexts; `can` outlives the call.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev.ctx.cu_device(), peer.ctx.cu_device()) }
            .result()
            .map_err(driver_err("cuDeviceCanAccessPeer"))?;
        Ok(can != 0)
    }

    fn enable_peer_access(dev: &CudaDevice, peer: &CudaDevice) -> Result<()> {
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the current context is `dev`'s and `peer`'s context is alive.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            }
            other => {
                return Err(Error::Backend {
                    backend: "cuda",
                    call: "cuCtxEnablePeerAccess",
                    detail: format!("{other:?}"),
                })
            }
        }
        // Peer access does not cover stream-ordered allocations (cudarc allocates from
        // the device's memory pool when it can): grant `dev` access to `peer`'s pool too,
        // so the one-stage kernel can read user buffers of any origin.
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` outlives the call; the device handle comes from a live context.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, peer.ctx.cu_device()) }
            .result()
            .map_err(driver_err("cuDeviceGetMemPool"))?;
        let desc = sys::CUmemAccessDesc {
            location: device_location(dev.ctx.ordinal()),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `desc` is one valid descriptor and outlives the call.
        unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }
            .result()
            .map_err(driver_err("cuMemPoolSetAccess"))?;
        granted_pools()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((pool as usize, dev.ctx.ordinal() as i32));
        Ok(())
    }

    fn alloc(dev: &CudaDevice, bytes: usize, _kind: MemoryKind) -> Result<CudaMemory> {
        // Plain cuMemAlloc (not the stream-ordered pool): peer access covers it once
        // enabled, and it is coherent for NVLink/PCIe peers at the owner's L2, so signal
        // memory needs no special flags on NVIDIA.
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` outlives the call; the context is current.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }
            .result()
            .map_err(driver_err("cuMemAlloc"))?;
        Ok(CudaMemory {
            ctx: dev.ctx.clone(),
            ptr,
            bytes,
        })
    }

    fn memory_ptr(mem: &CudaMemory) -> u64 {
        mem.ptr
    }

    fn map_peer(_dev: &CudaDevice, peer_mem: &CudaMemory) -> Result<u64> {
        // One process with unified addressing and peer access on: the peer's address is
        // valid here as it is. (One process per GPU would import an IPC handle.)
        Ok(peer_mem.ptr)
    }

    fn prepare_shared_device(dev: &CudaDevice) -> Result<()> {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` outlives the call; the device handle comes from a live context.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, dev.ctx.cu_device()) }
            .result()
            .map_err(driver_err("cuDeviceGetMemPool"))?;
        // No allocation waits, through the pool, for a free on another rank's stream.
        let mut off: i32 = 0;
        // SAFETY: the attribute takes an int; `off` outlives the call.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                &mut off as *mut i32 as *mut std::ffi::c_void,
            )
        }
        .result()
        .map_err(driver_err("cuMemPoolSetAttribute"))?;
        // Keep freed memory in the pool: giving it back to the system at a stream
        // synchronisation can wait for the whole device, including another rank's
        // kernel that waits for this rank's next launch.
        let mut keep = u64::MAX;
        // SAFETY: the attribute takes a cuuint64_t; `keep` outlives the call.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut std::ffi::c_void,
            )
        }
        .result()
        .map_err(driver_err("cuMemPoolSetAttribute"))
    }

    fn peer_access_problem(
        dev: &CudaDevice,
        ptr: u64,
        peer: &CudaDevice,
    ) -> Result<Option<String>> {
        if dev.ctx.ordinal() == peer.ctx.ordinal() {
            return Ok(None);
        }
        let peer_ordinal = peer.ctx.ordinal() as i32;
        let location = device_location(peer.ctx.ordinal());
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer of the attribute's type for the call.
        unsafe {
            sys::cuPointerGetAttribute(
                &mut pool as *mut _ as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                ptr,
            )
        }
        .result()
        .map_err(driver_err("cuPointerGetAttribute(MEMPOOL_HANDLE)"))?;
        if !pool.is_null() {
            if granted_pools()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&(pool as usize, peer_ordinal))
            {
                return Ok(None);
            }
            let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
            let mut loc = location;
            // SAFETY: `pool` came from the driver for a live allocation; out-pointers are valid.
            unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut loc) }
                .result()
                .map_err(driver_err("cuMemPoolGetAccess"))?;
            return Ok(match flags {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => {
                    granted_pools()
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert((pool as usize, peer_ordinal));
                    None
                }
                other => Some(format!("its memory pool grants the peer {other:?}")),
            });
        }
        let mut legacy: i32 = 0;
        // SAFETY: `legacy` is a valid out-pointer of the attribute's type (int).
        unsafe {
            sys::cuPointerGetAttribute(
                &mut legacy as *mut i32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                ptr,
            )
        }
        .result()
        .map_err(driver_err(
            "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
        ))?;
        if legacy != 0 {
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
        mem.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `handle` outlives the call; `ptr` is the base of a live cuMemAlloc
        // allocation of the current context.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, mem.ptr) }
            .result()
            .map_err(driver_err("cuIpcGetMemHandle"))?;
        Ok(Writer::new(IPC_MAGIC, IPC_VERSION)
            .u64(process_token())
            .u64(mem.bytes as u64)
            .bytes(&handle.reserved.map(|c| c as u8))
            .finish())
    }

    fn import_memory(dev: &CudaDevice, handle: &[u8]) -> Result<CudaPeerMapping> {
        let mut r = Reader::open("cuda", handle, IPC_MAGIC, IPC_VERSION, IPC_HANDLE_BYTES)?;
        let (token, bytes, raw) = (r.u64(), r.u64(), r.array::<64>());
        if token == process_token() {
            return Err(same_process_import("this process exported the handle"));
        }
        let bytes = usize::try_from(bytes)
            .map_err(|_| import_error("cuda", format!("size {bytes} does not fit here")))?;
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let ipc = sys::CUipcMemHandle {
            reserved: raw.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` outlives the call and `dev`'s context is current; the driver
        // validates the handle's contents.
        let opened = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                ipc,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        };
        match opened {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_INVALID_CONTEXT => {
                return Err(same_process_import(
                    "cuIpcOpenMemHandle: CUDA_ERROR_INVALID_CONTEXT (the driver's answer to a \
                     handle of this same process)",
                ))
            }
            other => {
                return Err(Error::Backend {
                    backend: "cuda",
                    call: "cuIpcOpenMemHandle",
                    detail: format!(
                        "{other:?}: the exporter may have freed the memory or exited, run on \
                         another host, or its GPU and this one have no peer-to-peer path"
                    ),
                })
            }
        }
        // From here on the mapping's drop closes it, on the error path too.
        let mapping = CudaPeerMapping {
            ctx: dev.ctx.clone(),
            ptr,
            bytes,
        };
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-pointers valid for the call; `ptr` is a live mapping.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(driver_err("cuMemGetAddressRange"))?;
        if size < bytes {
            return Err(import_error(
                "cuda",
                format!("the handle says {bytes} bytes, but the allocation it opens has {size}"),
            ));
        }
        Ok(mapping)
    }

    fn mapping_ptr(mapping: &CudaPeerMapping) -> u64 {
        mapping.ptr
    }

    fn memset_d32(dev: &CudaDevice, ptr: u64, value: u32, words: usize) -> Result<()> {
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the caller passes a range inside one of its live allocations on this
        // device; the memset is ordered on the rank's stream.
        unsafe { sys::cuMemsetD32Async(ptr, value, words, dev.stream.cu_stream()) }
            .result()
            .map_err(driver_err("cuMemsetD32Async"))
    }

    fn memset_d16(dev: &CudaDevice, ptr: u64, value: u16, halves: usize) -> Result<()> {
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the caller passes a 2-byte aligned range inside one of its live
        // allocations on this device; the memset is ordered on the rank's stream.
        unsafe { sys::cuMemsetD16Async(ptr, value, halves, dev.stream.cu_stream()) }
            .result()
            .map_err(driver_err("cuMemsetD16Async"))
    }

    fn read(dev: &CudaDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the caller passes a range inside one of its live allocations; the
        // stream is synchronised before `dst` is read.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr() as *mut _,
                ptr,
                dst.len(),
                dev.stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        dev.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

    fn read_words_now(dev: &CudaDevice, ptr: u64, dst: &mut [u32]) -> Result<()> {
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        // SAFETY: the caller passes a range inside one of its live allocations. The
        // synchronous copy runs on the legacy default stream, which does not wait for
        // the rank's non-blocking stream (a rank built on the legacy default stream
        // itself waits instead); `dst` is written before the call returns.
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut _, ptr, std::mem::size_of_val(dst)) }
            .result()
            .map_err(driver_err("cuMemcpyDtoH"))
    }

    fn launch(
        dev: &CudaDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        super::check_plain_kernel(Self::NAME, kernel)?;
        let func = dev.kernels.get(&kernel).expect("every kernel is loaded");
        let cfg = LaunchConfig {
            grid_dim: (dims.blocks, 1, 1),
            block_dim: (dims.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = dev.stream.launch_builder(func);
        builder.arg(args);
        // SAFETY: the kernel takes exactly one `peercomm_allreduce_args` by value, and
        // the communicator built it from live allocations of the documented layout.
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel"))
    }

    fn launch_overlapping(
        dev: &CudaDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        super::check_plain_kernel(Self::NAME, kernel)?;
        // Programmatic dependent launch exists from sm_90 (and the kernels' wait for
        // the previous grid is compiled only there).
        let (major, _) = dev
            .ctx
            .compute_capability()
            .map_err(driver_err("cuDeviceGetAttribute"))?;
        if major < 9 {
            return Self::launch(dev, kernel, dims, args);
        }
        let func = dev.kernels.get(&kernel).expect("every kernel is loaded");
        dev.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let mut attr: sys::CUlaunchAttribute = unsafe {
            // SAFETY: a plain C struct (an id, padding and a union of integers): all
            // zero bytes is a valid value, overwritten below.
            std::mem::zeroed()
        };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: dims.blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: dims.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: dev.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut params = [args as *const AllReduceArgs as *mut std::ffi::c_void];
        // SAFETY: the kernel takes exactly one `peercomm_allreduce_args` by value
        // (`params` points at it for the duration of the call, which copies it); the
        // function belongs to this device's context, bound above; `attr` lives until
        // the call returns.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(driver_err("cuLaunchKernelEx"))
    }

    fn launch_group(
        dev: &CudaDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &GroupArgs,
    ) -> Result<()> {
        super::check_group_kernel(Self::NAME, kernel, args)?;
        let func = dev.kernels.get(&kernel).expect("every kernel is loaded");
        let cfg = LaunchConfig {
            grid_dim: (dims.blocks, 1, 1),
            block_dim: (dims.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = dev.stream.launch_builder(func);
        builder.arg(args);
        // SAFETY: the batched all-reduce kernel takes exactly one `peercomm_group_args`
        // by value (552 bytes, within the 4 KiB of kernel parameters), and the
        // communicator built it from live allocations of the documented layout and from
        // buffers it holds for the call.
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(driver_err("cuLaunchKernel"))
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
            return Err(Error::Backend {
                backend: "cuda",
                call: "cuMemAllocAsync",
                detail: format!(
                    "{len} elements of {:?} overflow the address space",
                    T::DTYPE
                ),
            });
        }
        dev.stream
            .alloc_zeros::<T>(len)
            .map_err(driver_err("cuMemAllocAsync"))
    }

    fn upload<T: Element>(dev: &CudaDevice, src: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::LengthMismatch {
                rank: dev.ctx.ordinal(),
                what: format!(
                    "upload of {} elements into a buffer of {}",
                    src.len(),
                    dst.len()
                ),
            });
        }
        dev.stream
            .memcpy_htod(src, dst)
            .map_err(driver_err("cuMemcpyHtoDAsync"))?;
        dev.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

    fn download<T: Element>(dev: &CudaDevice, src: &CudaSlice<T>) -> Result<Vec<T>> {
        dev.stream
            .clone_dtoh(src)
            .map_err(driver_err("cuMemcpyDtoHAsync"))
    }
}

super::impl_typed_buffer!(Cuda, CudaSlice);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every symbol the backend resolves at run time is in the embedded fatbin (checked
    /// without a GPU: the names are stored as strings in its ELF images).
    #[test]
    fn fatbin_exports_every_kernel() {
        let names: Vec<String> = Kernel::all().map(|k| k.symbol()).collect();
        // Eleven families (three all-reduces, the barrier, four other collectives, the
        // one-stage and Lamport fused all-reduce + RMSNorm, the batched all-reduce) in
        // three dtypes, plus ping-pong and delay.
        assert_eq!(names.len(), 11 * 3 + 2);
        for name in names {
            assert!(
                FATBIN.windows(name.len()).any(|w| w == name.as_bytes()),
                "{name} is missing from the CUDA fatbin"
            );
        }
    }
}
