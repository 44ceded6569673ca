//! The `Cuda` backend type, loading the driver, `CudaDevice` with its kernels and their
//! launches, and the buffer traits of cudarc's slices.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, DeviceSlice, LaunchConfig, PushKernelArg, SyncOnDrop,
};

use super::super::{Backend, DeviceBuffer, DeviceBufferMut, Kernel, LaunchDims};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, ExchangeArgs, GroupArgs};

/// The kernels of `kernels-cuda/`, compiled by build.rs into one fatbin.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/peercomm_cuda.fatbin"));

/// The CUDA backend (feature `cuda`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cuda;

/// An [`Error::Backend`] of CUDA's `call`.
pub(super) fn backend_err(call: &'static str, detail: String) -> Error {
    Error::Backend {
        backend: "cuda",
        call,
        detail,
    }
}

/// Maps a driver error of `call`.
pub(super) fn driver_err(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| backend_err(call, e.to_string())
}

/// Makes `ctx` current on this thread.
pub(super) fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
}

/// Loads libcuda once, looked for before cudarc's loader (which panics) is asked:
/// [`Error::NoDevice`] if absent; a panic cudarc still raises is caught, never hooked.
pub(super) fn driver() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let (p, s) = (std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
            let names = [
                format!("{p}cuda{s}.1"),
                format!("{p}cuda{s}"),
                "nvcuda.dll".into(),
            ];
            load_first_of("CUDA driver", "the NVIDIA driver", &names)?;
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

/// Loads the first of `names` that loads, kept loaded for cudarc (whose loader panics on
/// a missing library); else says the `what` library (installed with `from`) is missing.
pub(crate) fn load_first_of(
    what: &str,
    from: &str,
    names: &[String],
) -> std::result::Result<(), String> {
    // SAFETY: loading a library runs its initialisers, as cudarc's loader does next.
    if names.iter().any(|name| {
        unsafe { libloading::Library::new(name) }
            .map(std::mem::forget)
            .is_ok()
    }) {
        return Ok(());
    }
    Err(format!(
        "the {what} library could not be loaded (looked for {names:?}; is {from} installed \
         and on the library path?)"
    ))
}

/// One GPU: its context, the stream collectives run on, and the loaded kernels.
#[derive(Clone)]
pub struct CudaDevice {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) kernels: KernelTable,
}

type KernelTable = Arc<HashMap<Kernel, CudaFunction>>;

impl super::super::IntoDevice for CudaDevice {
    type Backend = Cuda;
    fn into_device(self) -> Result<CudaDevice> {
        Ok(self)
    }
}

/// cudarc's stream: collectives run on it, ordered with the caller's other work (see
/// [`CudaDevice::from_stream`]).
impl super::super::IntoDevice for Arc<CudaStream> {
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
    let map = Kernel::all()
        .map(|k| Ok((k, module.load_function(&k.symbol())?)))
        .collect::<std::result::Result<HashMap<_, _>, _>>()
        .map_err(driver_err("cuModuleGetFunction"))?;
    let map = Arc::new(map);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    cache.insert(key, map.clone());
    Ok(map)
}

// SAFETY: AllReduceArgs is a #[repr(C)] plain-old-data struct of integers, passed by
// value exactly as the kernels declare it (the same C header).
unsafe impl DeviceRepr for AllReduceArgs {}
// SAFETY: as above (an AllReduceArgs, two u32 and an array of u64 entries).
unsafe impl DeviceRepr for GroupArgs {}
// SAFETY: as for `GroupArgs`: a plain C struct of integers, passed by value.
unsafe impl DeviceRepr for ExchangeArgs {}
// SAFETY: #[repr(transparent)] over `peercomm_device_comm`, a plain C struct of integers
// that user kernels take by value as the device header declares it.
unsafe impl DeviceRepr for crate::device::DeviceComm {}

/// Launches `kernel` with `args` as its one by-value parameter on the rank's stream.
pub(super) fn launch_one<A: DeviceRepr>(
    dev: &CudaDevice,
    kernel: Kernel,
    dims: LaunchDims,
    args: &A,
) -> Result<()> {
    let func = dev
        .kernels
        .get(&kernel.exported())
        .expect("every kernel is loaded");
    let cfg = LaunchConfig {
        grid_dim: (dims.blocks, 1, 1),
        block_dim: (dims.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut builder = dev.stream.launch_builder(func);
    builder.arg(args);
    // SAFETY: each kernel takes exactly one argument struct by value (the callers check
    // the kind: `peercomm_allreduce_args`, or `peercomm_group_args` at 552 bytes, within
    // the 4 KiB of parameters), built by the communicator from live allocations.
    unsafe { builder.launch(cfg) }
        .map(|_| ())
        .map_err(driver_err("cuLaunchKernel"))
}

pub(super) fn launch_overlapping(
    dev: &CudaDevice,
    kernel: Kernel,
    dims: LaunchDims,
    args: &AllReduceArgs,
) -> Result<()> {
    super::super::check_kernel(<Cuda as Backend>::NAME, kernel, None)?;
    // Programmatic dependent launch exists from sm_90 (and the kernels' wait for
    // the previous grid is compiled only there).
    let (major, _) = dev
        .ctx
        .compute_capability()
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    if major < 9 {
        return launch_one(dev, kernel, dims, args);
    }
    let func = dev
        .kernels
        .get(&kernel.exported())
        .expect("every kernel is loaded");
    bind(&dev.ctx)?;
    let mut attr: sys::CUlaunchAttribute = unsafe {
        // SAFETY: a plain C struct (id, padding, union of integers): all zeros is valid.
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
    // SAFETY: the kernel takes one `peercomm_allreduce_args` by value (`params` points at
    // it during the call, which copies it); the function is of this device's context,
    // bound above; `attr` outlives the call.
    let (f, none) = (func.cu_function(), std::ptr::null_mut());
    cu!(cuLaunchKernelEx(&config, f, params.as_mut_ptr(), none))
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

macro_rules! impl_cuda_buffer_mut {
    ($($ty:ty),*) => {$(
        // SAFETY: the pointer, length, dtype and device come from the allocation itself.
        unsafe impl<T: Element> DeviceBufferMut<Cuda> for $ty {
            fn write_ptr<'a>(&'a mut self, dev: &'a CudaDevice) -> (u64, SyncOnDrop<'a>) {
                self.device_ptr_mut(&dev.stream)
            }
        }
    )*};
}
impl_cuda_buffer_mut!(CudaSlice<T>, CudaViewMut<'_, T>);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every symbol the backend resolves at run time is in the embedded fatbin (checked
    /// without a GPU: the names are stored as strings in its ELF images).
    #[test]
    fn fatbin_exports_every_kernel() {
        let mut names: Vec<String> = Kernel::all().map(|k| k.symbol()).collect();
        names.sort();
        names.dedup();
        // Eleven families in three dtypes, plus ping-pong, delay and the exchange; for the
        // seven other dtypes, one-stage and reduce-scatter each, and the three
        // data-movement families at 1 and 8 bytes (4 bytes run the f32 ones).
        assert_eq!(names.len(), 11 * 3 + 3 + 7 * 2 + 3 * 2);
        for name in names {
            assert!(
                FATBIN.windows(name.len()).any(|w| w == name.as_bytes()),
                "{name} is missing from the CUDA fatbin"
            );
        }
    }
}
