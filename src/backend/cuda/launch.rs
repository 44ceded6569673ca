//! Launching the CUDA kernels: the `DeviceRepr` impls of the argument structs and the
//! plain, overlapping (programmatic dependent launch) and batched launches.

use cudarc::driver::sys;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::super::{Backend, Kernel, LaunchDims};
use super::device::{bind, driver_err, Cuda, CudaDevice};
use crate::error::Result;
use crate::signal::{AllReduceArgs, GroupArgs};

// SAFETY: AllReduceArgs is a #[repr(C)] plain-old-data struct of integers, passed by
// value exactly as the kernels declare it (the same C header).
unsafe impl DeviceRepr for AllReduceArgs {}
// SAFETY: as above (an AllReduceArgs, two u32 and an array of u64 entries).
unsafe impl DeviceRepr for GroupArgs {}

/// Launches `kernel` with `args` as its one by-value parameter on the rank's stream.
pub(super) fn launch_one<A: DeviceRepr>(
    dev: &CudaDevice,
    kernel: Kernel,
    dims: LaunchDims,
    args: &A,
) -> Result<()> {
    let func = dev.kernels.get(&kernel).expect("every kernel is loaded");
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
    super::super::check_plain_kernel(<Cuda as Backend>::NAME, kernel)?;
    // Programmatic dependent launch exists from sm_90 (and the kernels' wait for
    // the previous grid is compiled only there).
    let (major, _) = dev
        .ctx
        .compute_capability()
        .map_err(driver_err("cuDeviceGetAttribute"))?;
    if major < 9 {
        return launch_one(dev, kernel, dims, args);
    }
    let func = dev.kernels.get(&kernel).expect("every kernel is loaded");
    bind(&dev.ctx)?;
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
    // SAFETY: the kernel takes one `peercomm_allreduce_args` by value (`params` points at
    // it during the call, which copies it); the function is of this device's context,
    // bound above; `attr` outlives the call.
    cu!(cuLaunchKernelEx(
        &config,
        func.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut()
    ))
}
