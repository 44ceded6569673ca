//! Launching a HIP kernel with its by-value argument struct.

use std::ffi::c_void;
use std::ptr::null_mut;

use super::super::{Kernel, LaunchDims};
use crate::error::{Error, Result};
use crate::signal::MAX_NUM_BLOCKS_UPPER_BOUND;

use super::device::*;
use super::runtime::*;

/// Launches `kernel` on `dev`'s stream with `args` as its one by-value parameter, after
/// checking the grid (`group_width`: the threads of a block's first wavefront that do
/// the barrier's counter work must exist).
///
/// # Safety
/// `A` must be the kernel's parameter type (`peercomm_allreduce_args` or
/// `peercomm_group_args`), built from live allocations of the documented layout.
pub(super) unsafe fn launch_by_value<A: Copy>(
    dev: &HipDevice,
    kernel: Kernel,
    dims: LaunchDims,
    group_width: u32,
    args: &A,
) -> Result<()> {
    if dims.blocks == 0
        || dims.blocks as usize > MAX_NUM_BLOCKS_UPPER_BOUND
        || dims.threads == 0
        || dims.threads > 512
        || group_width > dims.threads
    {
        return Err(Error::Unsupported(format!(
            "HIP launch of {} with {} blocks of {} threads: blocks must be in 1..={}, threads \
             in 1..=512 (the kernels' launch bound) and at least the group width",
            kernel.symbol(),
            dims.blocks,
            dims.threads,
            MAX_NUM_BLOCKS_UPPER_BOUND
        )));
    }
    let function = dev.function(kernel)?;
    set_device(dev.ordinal)?;
    // The kernels take the argument struct by value; HIP copies it at launch.
    let mut by_value = *args;
    let mut params = [(&mut by_value as *mut A).cast::<c_void>()];
    // SAFETY: the function belongs to the device's loaded module, its one parameter is
    // an `A` by value (the caller's contract), and `params` points at a live copy of it
    // for the duration of the call.
    hip!(hipModuleLaunchKernel(
        function,
        dims.blocks,
        1,
        1,
        dims.threads,
        1,
        1,
        0,
        dev.stream,
        params.as_mut_ptr(),
        null_mut()
    ))
}
