//! The device API's host contract: a kernel of your own, written in Rust as a closure
//! per block, over a [`DeviceComm`] on the host backend, with the barriers, the
//! timeout, the abort word and the error records of the device header over the same
//! signal layout. The logic an engine writes for its GPU kernels runs (and is tested)
//! here without a GPU; `Comm::launch_host_kernel` launches it.

use crate::device::DeviceComm;
use crate::protocol::BarrierKind;
use crate::signal::AllReduceArgs;

use super::kernels::{self, BlockFlow, Stop};

/// One block of a host kernel: its index, the grid, the [`DeviceComm`] it runs over,
/// and its barriers.
pub struct HostBlock {
    args: AllReduceArgs,
    comm: DeviceComm,
    block: u32,
    blocks: u32,
}

/// A wait of a host kernel's barrier gave up (the timeout, a peer's abort, a peer in
/// another call): return it from the kernel (`?`); the error comes back from the
/// communicator's `synchronize` as a collective's would.
#[derive(Debug)]
pub struct Stopped(Stop);

impl HostBlock {
    /// This block's index.
    pub fn block(&self) -> u32 {
        self.block
    }
    /// Blocks in the grid (the same on every rank).
    pub fn blocks(&self) -> u32 {
        self.blocks
    }
    /// The device communicator the kernel runs over.
    pub fn comm(&self) -> &DeviceComm {
        &self.comm
    }
    /// The counter barrier of this block with the peers' same-index blocks, in the
    /// user kernels' bank: `Start` orders arrival only; `Publish` makes what this block
    /// wrote before it visible to theirs after it; `End` keeps the peers from
    /// overwriting what this block read.
    pub fn barrier(&self, kind: BarrierKind) -> Result<(), Stopped> {
        // SAFETY: the signals are the communicator's, which outlives the kernel: it
        // runs on the rank's stream, which the communicator's drop drains first.
        unsafe { kernels::user_barrier(&self.args, self.block, self.blocks, kind) }.map_err(Stopped)
    }
    /// The barrier of the whole grid across the ranks (the header's `grid_barrier`):
    /// every block of every rank, ordered as `kind` says; every block calls it.
    pub fn grid_barrier(&self, kind: BarrierKind) -> Result<(), Stopped> {
        // SAFETY: as in `barrier`.
        unsafe { kernels::user_grid_barrier(&self.args, self.block, self.blocks, kind) }
            .map_err(Stopped)
    }
}

/// The arguments the host kernels' protocol reads, from a device communicator's.
fn args_of(comm: &DeviceComm) -> AllReduceArgs {
    let d = &comm.0;
    AllReduceArgs {
        signals: d.signals,
        timeout_ns: d.timeout_ns,
        group_rank: d.group_rank,
        group_width: d.group_width,
        domain: d.domain,
        world_rank: d.world_rank,
        call: d.call,
        ..Default::default()
    }
}

/// Runs block `block` of `blocks` of `kernel` over `comm`.
///
/// # Safety
/// `comm`'s signals are live until the block returns.
pub(crate) unsafe fn run_block<F>(comm: &DeviceComm, block: u32, blocks: u32, kernel: &F)
where
    F: Fn(&HostBlock) -> Result<(), Stopped>,
{
    let b = HostBlock {
        args: args_of(comm),
        comm: *comm,
        block,
        blocks,
    };
    let body = || -> BlockFlow { kernel(&b).map_err(|s| s.0) };
    kernels::run_user_block(&b.args, block, blocks, body);
}
