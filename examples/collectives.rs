//! Every collective of the per-rank [`Comm`], as an engine calls it on its rank: two
//! ranks, one thread each, on the host reference backend (no GPU needed), every result
//! checked against what the collective defines.
//!
//! ```text
//! cargo run --release --example collectives
//! ```
//!
//! One function per collective, each run by both ranks: [`Comm::all_reduce`] and
//! [`Comm::all_reduce_in_place`], [`Comm::all_gather`], [`Comm::reduce_scatter`],
//! [`Comm::broadcast`] and [`Comm::broadcast_in_place`], [`Comm::scatter`], and the fused
//! [`Comm::all_reduce_residual_rms_norm`]. Each call returns at once (the work is queued
//! on the rank's stream); [`Comm::synchronize`] waits for it and reports a device-side
//! error if one happened. On CUDA the same calls take cudarc `CudaSlice`s on the rank's
//! stream (`Comm::<Cuda>`, see examples/from-nccl.rs); the code is otherwise the same.

use peercomm::backend::host::Host;
use peercomm::backend::{Backend, DeviceBuffer};
use peercomm::bootstrap::UniqueId;
use peercomm::{reduce_scatter_part, CollectiveOptions, Comm, CommConfig, ReduceOp};

/// Ranks in the world (two threads).
const WORLD: usize = 2;

type Buffer = <Host as Backend>::Buffer<f32>;
type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A buffer on this rank's device holding `values`.
fn buffer(comm: &Comm<Host>, values: &[f32]) -> Result<Buffer> {
    Ok(Host::alloc_from(comm.device(), values)?)
}

/// A buffer of `len` NaNs (so that an element the collective did not write shows).
fn output(comm: &Comm<Host>, len: usize) -> Result<Buffer> {
    buffer(comm, &vec![f32::NAN; len])
}

/// Waits for this rank's queued work and reads `buf` back.
fn read(comm: &Comm<Host>, buf: &Buffer) -> Result<Vec<f32>> {
    comm.synchronize()?;
    Ok(Host::download(comm.device(), buf)?)
}

fn check(what: &str, rank: usize, got: &[f32], want: &[f32]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} on rank {rank}: got {got:?}, expected {want:?}").into())
    }
}

/// Sum over the group: rank r sends r + 1 everywhere, so every element sums to 3.
fn all_reduce(comm: &Comm<Host>) -> Result<()> {
    let send = buffer(comm, &[comm.rank() as f32 + 1.0; 6])?;
    let mut recv = output(comm, 6)?;
    comm.all_reduce(&send, &mut recv, &ReduceOp::Sum)?;
    check("all_reduce", comm.rank(), &read(comm, &recv)?, &[3.0; 6])?;

    let mut buf = buffer(comm, &[comm.rank() as f32 + 1.0; 6])?;
    comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)?;
    check(
        "all_reduce_in_place",
        comm.rank(),
        &read(comm, &buf)?,
        &[3.0; 6],
    )
}

/// Every rank's 3 elements, in rank order, on every rank.
fn all_gather(comm: &Comm<Host>) -> Result<()> {
    let r = comm.rank() as f32;
    let send = buffer(comm, &[10.0 * r, 10.0 * r + 1.0, 10.0 * r + 2.0])?;
    let mut recv = output(comm, 3 * WORLD)?; // group width x input
    comm.all_gather_with(&send, &mut recv, &CollectiveOptions::new())?;
    let want = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0];
    check("all_gather", comm.rank(), &read(comm, &recv)?, &want)
}

/// The sum of 5 elements, split in parts: rank 0 gets elements 0..3, rank 1 3..5
/// (`reduce_scatter_part`: the first `n % width` parts are one element longer).
fn reduce_scatter(comm: &Comm<Host>) -> Result<()> {
    let n = 5;
    let r = comm.rank() as f32;
    let values: Vec<f32> = (0..n).map(|i| (r + 1.0) * (i as f32 + 1.0)).collect();
    let send = buffer(comm, &values)?;
    let part = reduce_scatter_part(n, WORLD, comm.rank());
    let mut recv = output(comm, part.len())?;
    comm.reduce_scatter(&send, &mut recv, &ReduceOp::Sum)?;
    // Element i sums to (1 + 2) x (i + 1).
    let want: Vec<f32> = part.map(|i| 3.0 * (i as f32 + 1.0)).collect();
    check("reduce_scatter", comm.rank(), &read(comm, &recv)?, &want)
}

/// Rank 1's message on every rank; the others pass `None` as their input.
fn broadcast(comm: &Comm<Host>) -> Result<()> {
    let root = 1;
    let message = [7.0, 8.0, 9.0, 10.0];
    let send = buffer(comm, &message)?;
    let mut recv = output(comm, message.len())?;
    let input = (comm.rank() == root).then_some(&send as &dyn DeviceBuffer<Host>);
    comm.broadcast_with(input, &mut recv, root, &CollectiveOptions::new())?;
    check("broadcast", comm.rank(), &read(comm, &recv)?, &message)?;

    // In place: the root's buffer is the message, the others' are overwritten.
    let mine = if comm.rank() == root {
        message
    } else {
        [0.0; 4]
    };
    let mut buf = buffer(comm, &mine)?;
    comm.broadcast_in_place_with(&mut buf, root, &CollectiveOptions::new())?;
    check(
        "broadcast_in_place",
        comm.rank(),
        &read(comm, &buf)?,
        &message,
    )
}

/// Rank 0's 6 elements, 3 to each rank in rank order.
fn scatter(comm: &Comm<Host>) -> Result<()> {
    let root = 0;
    let send = buffer(comm, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0])?; // width x output, on the root
    let mut recv = output(comm, 3)?;
    let input = (comm.rank() == root).then_some(&send as &dyn DeviceBuffer<Host>);
    comm.scatter_with(input, &mut recv, root, &CollectiveOptions::new())?;
    let first = 3.0 * comm.rank() as f32;
    let want = [first, first + 1.0, first + 2.0];
    check("scatter", comm.rank(), &read(comm, &recv)?, &want)
}

/// The end of a tensor-parallel layer in one kernel: sum the partial activations over
/// the group, add the residual (written back), RMS-normalise each row with the weight.
fn all_reduce_residual_rms_norm(comm: &Comm<Host>) -> Result<()> {
    let (tokens, hidden, epsilon) = (2, 8, 1e-6f32); // hidden: a multiple of 4 for f32
    let r = comm.rank() as f32;
    let partial: Vec<f32> = (0..tokens * hidden)
        .map(|i| (r + 1.0) * 0.25 * (i % 5) as f32)
        .collect();
    let residual0: Vec<f32> = (0..tokens * hidden)
        .map(|i| 0.5 - 0.125 * i as f32)
        .collect();
    let weight: Vec<f32> = (0..hidden).map(|i| 1.0 + 0.5 * i as f32).collect();
    let input = buffer(comm, &partial)?;
    let mut residual = buffer(comm, &residual0)?;
    let weights = buffer(comm, &weight)?;
    let mut normed = output(comm, tokens * hidden)?;
    comm.all_reduce_residual_rms_norm(
        &input,
        &mut residual,
        &weights,
        &mut normed,
        epsilon,
        &CollectiveOptions::new(),
    )?;
    let (got_residual, got) = (read(comm, &residual)?, read(comm, &normed)?);
    // The unfused sequence on the CPU: both ranks' partials are (1 + 2) x 0.25 x (i % 5),
    // exact in f32, so the new residual is exact and the norm agrees to rounding.
    let x: Vec<f32> = (0..tokens * hidden)
        .map(|i| 3.0 * 0.25 * (i % 5) as f32 + residual0[i])
        .collect();
    check("fused residual", comm.rank(), &got_residual, &x)?;
    for row in 0..tokens {
        let xs = &x[row * hidden..(row + 1) * hidden];
        let mean_square = xs.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
        let scale = 1.0 / (mean_square + epsilon).sqrt();
        for (j, v) in xs.iter().enumerate() {
            let want = v * scale * weight[j];
            let have = got[row * hidden + j];
            if (have - want).abs() > 1e-5 * (1.0 + want.abs()) {
                return Err(format!(
                    "all_reduce_residual_rms_norm on rank {}: row {row} element {j}: got {have}, expected {want}",
                    comm.rank()
                )
                .into());
            }
        }
    }
    Ok(())
}

/// One rank: join, then every collective in the same order as the other rank.
fn run_rank(rank: usize, id: &UniqueId) -> Result<()> {
    let device = Host::open(rank)?;
    let comm = Comm::<Host>::from_rank(device, rank, WORLD, id, CommConfig::default())?;
    all_reduce(&comm)?;
    all_gather(&comm)?;
    reduce_scatter(&comm)?;
    broadcast(&comm)?;
    scatter(&comm)?;
    all_reduce_residual_rms_norm(&comm)?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Rank 0 makes the id; here every rank is a thread of this process and borrows it.
    let id = UniqueId::new().expect("a bootstrap id");
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                let id = &id;
                s.spawn(move || run_rank(rank, id))
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err("the rank panicked".into())))
            .collect()
    });
    let mut failed = false;
    for (rank, result) in results.iter().enumerate() {
        match result {
            Ok(()) => println!(
                "rank {rank}: all_reduce, all_reduce_in_place, all_gather, \
                 reduce_scatter, broadcast, broadcast_in_place, scatter, \
                 all_reduce_residual_rms_norm: checked"
            ),
            Err(e) => {
                println!("rank {rank}: FAILED: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}
