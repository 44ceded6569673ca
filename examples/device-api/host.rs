//! The kernels of kernels.cu on the host backend (the device API's host contract): the
//! same steps, barriers and arithmetic order, a closure per block, launched with
//! `Comm::launch_host_kernel`. What CI runs.

use peercomm::backend::host::{Host, HostBlock, Stopped};
use peercomm::backend::{Backend, DeviceBufferMut, TypedBuffer};
use peercomm::device::{BarrierKind, DeviceComm};
use peercomm::Comm;

use super::{gelu, Case, Outputs};

/// Blocks of every host kernel (each a thread).
const BLOCKS: u32 = 3;

/// Element i of member q's buffer.
///
/// # Safety
/// The member's buffer holds at least i + 1 f32 and nobody writes it between the
/// block's publishing barrier and its end barrier.
unsafe fn peer(comm: &DeviceComm, q: usize, i: usize) -> f32 {
    *(comm.peer_buffer(q).expect("a group member") as *const f32).add(i)
}

/// `out[i] = f(i)` for this block's elements (a grid stride), between a publishing and
/// an end barrier.
fn each(b: &HostBlock, n: usize, out: u64, f: impl Fn(usize) -> f32) -> Result<(), Stopped> {
    b.barrier(BarrierKind::Publish)?;
    for i in (b.block() as usize..n).step_by(b.blocks() as usize) {
        // SAFETY: `out` holds `n` f32 of this rank, element i written by this block only.
        unsafe { *(out as *mut f32).add(i) = f(i) };
    }
    b.barrier(BarrierKind::End)
}

/// The sum over the members in group-rank order from +0.0, in f32 (kernels.cu's order).
fn member_sum(comm: &DeviceComm, i: usize) -> f32 {
    // SAFETY: between the barriers of `each`; every buffer holds the case's n f32.
    (0..comm.group_width()).fold(0.0f32, |acc, q| acc + unsafe { peer(comm, q, i) })
}

/// Runs the three kernels of `case` on this rank; their outputs.
pub fn run(comm: &Comm<Host>, case: &Case) -> peercomm::Result<Outputs> {
    let dev = comm.device();
    let (rank, n) = (comm.rank(), case.n);
    let mut x = comm.alloc_symmetric::<f32>(n)?;
    x.copy_from_host(dev, &case.x[rank])?;
    let xs = comm.device_comm(&x)?;
    let bias = Host::alloc_from(dev, &case.bias)?;
    let bias_at = address_of(&bias, comm);
    let mut sum = Host::alloc_from(dev, &vec![f32::NAN; n])?;
    let mut fused = Host::alloc_from(dev, &vec![f32::NAN; n])?;
    let (sum_at, fused_at) = (address(&mut sum, comm), address(&mut fused, comm));
    comm.launch_host_kernel(&xs, BLOCKS, move |b| {
        each(b, n, sum_at, |i| member_sum(b.comm(), i))
    })?;
    comm.launch_host_kernel(&xs, BLOCKS, move |b| {
        each(b, n, fused_at, |i| {
            // SAFETY: the bias holds n f32 and lives until the synchronize below.
            let bias = unsafe { *(bias_at as *const f32).add(i) };
            gelu(member_sum(b.comm(), i) + bias)
        })
    })?;
    // The mixture-of-experts combine over the expert outputs' symmetric buffer.
    let (tokens, hidden) = (case.tokens, case.hidden);
    let mut y = comm.alloc_symmetric::<f32>(case.y[rank].len())?;
    y.copy_from_host(dev, &case.y[rank])?;
    let ys = comm.device_comm(&y)?;
    let scores = Host::alloc_from(dev, &case.scores[rank])?;
    let scores_at = address_of(&scores, comm);
    let mut combined = Host::alloc_from(dev, &vec![f32::NAN; tokens * hidden])?;
    let combined_at = address(&mut combined, comm);
    comm.launch_host_kernel(&ys, BLOCKS, move |b| {
        let comm = b.comm();
        let (me, width) = (comm.group_rank(), comm.group_width());
        each(b, tokens * hidden, combined_at, |i| {
            let (t, j) = (i / hidden, i % hidden);
            let row = me * tokens + t;
            (0..width).fold(0.0f32, |acc, e| {
                // SAFETY: scores hold tokens x width f32; y_e holds width x tokens rows.
                let (s, v) = unsafe {
                    let s = *(scores_at as *const f32).add(t * width + e);
                    (s, peer(comm, e, row * hidden + j))
                };
                acc + s * v
            })
        })
    })?;
    comm.synchronize()?;
    drop((bias, scores));
    Ok(Outputs {
        sum: Host::download(dev, &sum)?,
        fused: Host::download(dev, &fused)?,
        combined: Host::download(dev, &combined)?,
    })
}

/// The address of a host buffer's first element, to write.
fn address(buf: &mut <Host as Backend>::Buffer<f32>, comm: &Comm<Host>) -> u64 {
    buf.write_ptr(comm.device()).0
}

/// The address of a host buffer's first element, to read.
fn address_of(buf: &<Host as Backend>::Buffer<f32>, comm: &Comm<Host>) -> u64 {
    use peercomm::backend::DeviceBuffer;
    buf.read_ptr(comm.device()).0
}
