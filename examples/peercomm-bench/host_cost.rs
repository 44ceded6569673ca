//! `--host-cost`: where an eager call's host time goes. The eager latency of small
//! messages is set by the host, not the GPUs, so this times, on the host clock, the
//! calls themselves (not the GPU work): batches of calls are enqueued, timed, then the
//! streams drained outside the timed part. Rows (bf16, 1 KiB, whole world, `Auto`):
//! - "call, tracking on": `all_reduce` (sum) as a cudarc user makes it by default;
//! - "call, tracking off": the same with cudarc's event tracking disabled, so the
//!   difference is what cudarc's per-buffer event records and waits cost;
//! - "launch only": `delay_all(0)`, a near-empty kernel on every rank through the
//!   calls' launch path (in parallel, as the calls, unless the configuration turned
//!   `parallel_launch` off) without validation or planning, so the rest of a call is
//!   validation, planning and building the arguments.
//!
//! Then one greppable line per launch mode, parallel launch off then on
//! (`SingleController::set_parallel_launch`, in the same run):
//! `host cost (single, W ranks, parallel launch off|on): call X us, untracked call Y
//! us, empty launch Z us: X/Zx / Y/Zx the launch`, where the empty launch goes through
//! the same path in the same mode (`delay_all`).

use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use peercomm::backend::cuda::Cuda;
use peercomm::ReduceOp;

use super::gpu::{with_tracking, Gpu};
use super::*;

/// Calls per timed batch: few enough that the launch queue never fills.
const CALLS: usize = 100;

/// Median host time per call over `batches` batches, in us.
fn host_us(gpu: &Gpu, batches: usize, mut call: impl FnMut()) -> f64 {
    call();
    gpu.comm.wait().unwrap();
    let samples = (0..batches)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..CALLS {
                call();
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / CALLS as f64;
            gpu.comm.wait().unwrap();
            us
        })
        .collect();
    median(samples)
}

pub fn run(gpu: &Gpu, args: &Args) {
    let world = gpu.comm.world_size();
    let n = 512; // 1 KiB of bf16
    let ins: Vec<CudaSlice<half::bf16>> = (0..world)
        .map(|r| Cuda::alloc_buffer(gpu.comm.core(r).device(), n).unwrap())
        .collect();
    let mut outs: Vec<CudaSlice<half::bf16>> = (0..world)
        .map(|r| Cuda::alloc_buffer(gpu.comm.core(r).device(), n).unwrap())
        .collect();
    let opts = AllReduceOptions::new();
    let batches = args.batches.max(11);
    let mut call = || {
        let it: Vec<TensorView<Cuda>> = ins.iter().map(|b| TensorView::flat(b)).collect();
        let mut ot: Vec<TensorViewMut<Cuda>> =
            outs.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
        gpu.comm
            .all_reduce(&it, &mut ot, &ReduceOp::Sum, &opts)
            .unwrap();
    };
    let tracked = host_us(gpu, batches, &mut call);
    with_tracking(gpu, false);
    let untracked = host_us(gpu, batches, &mut call);
    with_tracking(gpu, true);
    let empty_launch = || gpu.comm.delay_all(Duration::ZERO).unwrap();
    let launch_only = host_us(gpu, batches, empty_launch);
    println!(
        "\nhost time per eager call, {world} ranks on {} GPU(s), 1 KiB bf16 (median of {batches} x {CALLS}):",
        gpu.streams
            .iter()
            .map(|s| s.context().ordinal())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    );
    println!("  call, tracking on        {tracked:6.2} us");
    println!(
        "  call, tracking off       {untracked:6.2} us  (cudarc's event tracking: {:.2} us)",
        tracked - untracked
    );
    println!(
        "  launch only, all ranks   {launch_only:6.2} us  (validation, planning, arguments: {:.2} us)",
        untracked - launch_only
    );
    // Parallel launch off, then on, in the same run: the call (tracking on and off) and
    // the empty launch through the same path in the same mode.
    let configured = gpu.comm.parallel_launch();
    for parallel in [false, true] {
        gpu.comm.set_parallel_launch(parallel).unwrap();
        let tracked = host_us(gpu, batches, &mut call);
        with_tracking(gpu, false);
        let untracked = host_us(gpu, batches, &mut call);
        with_tracking(gpu, true);
        let launch = host_us(gpu, batches, empty_launch);
        println!(
            "host cost (single, {world} ranks, parallel launch {}): call {tracked:6.2} us, untracked call {untracked:6.2} us, empty launch {launch:6.2} us: {:.2}x / {:.2}x the launch",
            if parallel { "on" } else { "off" },
            tracked / launch,
            untracked / launch
        );
    }
    gpu.comm.set_parallel_launch(configured).unwrap();
}
