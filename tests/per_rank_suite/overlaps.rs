//! Inputs overlapping outputs (not exactly aliased) are refused before launch on the
//! per-rank `Comm` and the single controller, while the exact alias runs in place.

use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use peercomm::{
    Algorithm, AllReduceOptions, CollectiveOptions, Error, ReduceOp, SingleController, TensorView,
    TensorViewMut,
};

use super::bounds::{address, not_refused, pattern, View};
use super::{with_world, with_world_config, Placement, ALL_ALGORITHMS};

fn is_overlap<T: std::fmt::Debug>(r: &peercomm::Result<T>) -> bool {
    matches!(r, Err(Error::BuffersOverlap { .. }))
}

/// Inputs overlapping outputs on every rank: every per-rank collective is
/// `BuffersOverlap` before launch, nothing written; the exact alias runs in place.
pub fn overlapping_buffers_are_refused<B: Backend>(place: &Placement) {
    let world = 2;
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let n = 4096;
        let ordinal = B::ordinal(comm.device());
        let mut reg = comm
            .register(B::alloc_buffer::<f32>(dev, n).unwrap())
            .unwrap();
        reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
        let at = address(&reg, dev);
        let mut plain = B::alloc_from(dev, &pattern(rank, n)).unwrap();
        let plain_at = address(&plain, dev);
        let v = |base: u64, off: usize, len: usize| View::<B>::new(base, off, len, ordinal);
        let opts = CollectiveOptions::new();
        let weight = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
        let mut residual = B::alloc_from(dev, &[0.5f32; 1024]).unwrap();
        let fused = |input: View<B>,
                     residual: &mut dyn DeviceBufferMut<B>,
                     weight: &dyn DeviceBuffer<B>,
                     mut out: View<B>| {
            comm.all_reduce_residual_rms_norm(&input, residual, weight, &mut out, 1e-5, &opts)
        };
        let results: Vec<(&str, peercomm::Result<()>)> = rows![
            "all_reduce, registered input" => comm.all_reduce(&v(at, 0, 1024), &mut v(at, 1, 1024), &ReduceOp::Sum).map(drop),
            "all_reduce, output before the input" => comm.all_reduce(&v(at, 512, 1024), &mut v(at, 0, 1024), &ReduceOp::Sum).map(drop),
            "all_reduce, plain input" => comm.all_reduce(&v(plain_at, 0, 1024), &mut v(plain_at, 512, 1024), &ReduceOp::Sum).map(drop),
            "all_gather" => comm.all_gather_with(&v(at, 0, 512), &mut v(at, 256, 1024), &opts),
            "reduce_scatter" => comm.reduce_scatter_with(&v(at, 0, 1024), &mut v(at, 100, 512), &ReduceOp::Sum, &opts),
            "fused, input and output" => fused(v(at, 0, 1024), &mut residual, &weight, v(at, 64, 1024)),
            "fused, residual and output" => fused(v(plain_at, 0, 1024), &mut v(at, 0, 1024), &weight, v(at, 1, 1024)),
            "fused, weight and residual" => fused(v(plain_at, 0, 1024), &mut v(at, 0, 1024), &v(at, 32, 64), v(at, 2048, 1024)),
        ];
        let wrong = not_refused(&results, |e| matches!(e, Error::BuffersOverlap { .. }));
        comm.synchronize().ok();
        let reg_now = reg.to_host(dev).unwrap();
        let written = (0..n)
            .filter(|&i| reg_now[i] != pattern(rank, n)[i])
            .count();
        let plain_written = plain.to_host(dev).unwrap() != pattern(rank, n);
        // The exact alias is the in-place call: right sums, whatever the algorithm.
        let sum: Vec<f32> = (0..1024)
            .map(|i| (0..world).map(|r| pattern(r, 1024)[i]).sum())
            .collect();
        let mut alias = Vec::new();
        for &algorithm in ALL_ALGORITHMS {
            reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
            let opts = AllReduceOptions::new().algorithm(algorithm);
            let r =
                comm.all_reduce_with(&v(at, 0, 1024), &mut v(at, 0, 1024), &ReduceOp::Sum, &opts);
            comm.synchronize().unwrap();
            let got = reg.to_host(dev).unwrap();
            let bad = (0..1024).filter(|&i| got[i] != sum[i]).count();
            let past = got[1024..] != pattern(rank, n)[1024..];
            if r.is_err() || bad > 0 || past {
                alias.push(format!("{algorithm:?}: {r:?}, {bad}/1024 wrong"));
            }
        }
        plain.copy_from_host(dev, &pattern(rank, n)).unwrap();
        let r = comm.all_reduce(
            &v(plain_at, 0, 1024),
            &mut v(plain_at, 0, 1024),
            &ReduceOp::Sum,
        );
        comm.synchronize().unwrap();
        if r.is_err() || plain.to_host(dev).unwrap()[..1024] != sum[..] {
            alias.push(format!("a plain buffer: {r:?}"));
        }
        eprintln!(
            "rank {rank}: {} refusals missed, {written}/{n} registered elements written; \
             exact aliases wrong: {alias:?}",
            wrong.len()
        );
        let (none, wrong) = (wrong.is_empty(), wrong.join("\n"));
        assert!(none, "rank {rank}: not BuffersOverlap:\n{wrong}");

        assert_eq!(written, 0, "rank {rank}: a refused call wrote");
        assert!(!plain_written, "rank {rank}: a refused call wrote");
        assert!(alias.is_empty(), "rank {rank}: exact aliases: {alias:?}");
    });
}

/// An overlap on one rank only (also a broadcast root): it refuses before launch, the
/// peer times out at `synchronize`, both work after `reinitialize`.
pub fn overlap_on_one_rank<B: Backend>(place: &Placement) {
    let config = place
        .config(2)
        .with_barrier_timeout(Some(Duration::from_millis(300)));
    with_world_config::<B, _>(place, 2, &config, |rank, comm| {
        let dev = comm.device();
        let ordinal = B::ordinal(comm.device());
        let n = 2048;
        let mut reg = comm
            .register(B::alloc_buffer::<f32>(dev, n).unwrap())
            .unwrap();
        let at = address(&reg, dev);
        let v = |off: usize, len: usize| View::<B>::new(at, off, len, ordinal);
        let c = CollectiveOptions::new();
        for call in ["all_reduce", "broadcast"] {
            reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
            comm.synchronize().unwrap();
            // Rank 0 overlaps (its output one element past its input); rank 1 not.
            let out_at = if rank == 0 { 1 } else { 1024 };
            let r = match call {
                "all_reduce" => comm
                    .all_reduce(&v(0, 1024), &mut v(out_at, 1024), &ReduceOp::Sum)
                    .map(drop),
                _ => comm.broadcast_with(Some(&v(0, 1024)), &mut v(out_at, 1024), 0, &c),
            };
            let s = comm.synchronize();
            let got = reg.to_host(dev).unwrap();
            let want = pattern(rank, n);
            // Where the call returned Ok: its output elements that are wrong.
            let (p0, p1) = (pattern(0, n), pattern(1, n));
            let right = |i: usize| match call {
                "all_reduce" => p0[i] + p1[i],
                _ => p0[i],
            };
            let wrong = (0..1024).filter(|&i| got[out_at + i] != right(i)).count();
            let outcome = match (&r, &s) {
                (Ok(_), Ok(_)) => format!("Ok with output {wrong}/1024 wrong"),
                _ => "no result".to_string(),
            };
            eprintln!("rank {rank}: {call}: {r:?}, synchronize {s:?}: {outcome}");
            if rank == 0 {
                let written = (0..n).filter(|&i| got[i] != want[i]).count();
                assert!(is_overlap(&r), "rank 0: {call}: {r:?}");
                assert_eq!(written, 0, "rank 0: {call}: refused but written");
            } else {
                assert!(r.is_ok(), "rank 1: {call}: {r:?}");
                assert!(
                    matches!(
                        s,
                        Err(Error::BarrierTimeout { .. }) | Err(Error::PeerAborted { .. })
                    ),
                    "rank 1: {call}: the peer never came: {s:?}"
                );
            }
            // Rank 0 waits until rank 1 has given up and aborted.
            std::thread::sleep(Duration::from_millis(900));
            comm.synchronize().ok();
            comm.reinitialize().unwrap();
        }
        // Both work again.
        reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
        let mut out = B::alloc_buffer::<f32>(dev, n).unwrap();
        comm.all_reduce(&reg, &mut out, &ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        let want: Vec<f32> = (0..n)
            .map(|i| pattern(0, n)[i] + pattern(1, n)[i])
            .collect();
        assert_eq!(out.to_host(dev).unwrap(), want, "rank {rank}");
    });
}

/// The single controller: inputs overlapping own, another rank's or each other's
/// outputs are `BuffersOverlap` before launch (all-reduce, all-gather, fused); the exact
/// alias runs in place.
pub fn single_controller_overlaps<B: Backend>(place: &Placement) {
    let world = 2;
    let ordinals: Vec<usize> = (0..world).map(|r| place.ordinal(r)).collect();
    let comm = SingleController::<B>::new(&ordinals, place.config(world)).unwrap();
    let n = 4096;
    let mut bases: Vec<_> = (0..world)
        .map(|r| B::alloc_from(comm.core(r).device(), &pattern(r, n)).unwrap())
        .collect();
    let at: Vec<u64> = (0..world)
        .map(|r| address(&bases[r], comm.core(r).device()))
        .collect();
    let v = |r: usize, off: usize, len: usize| View::<B>::new(at[r], off, len, ordinals[r]);
    // Rank r's view at `off[r]`, `len` long.
    let views = |off: [usize; 2], len: usize| [0, 1].map(|r| v(r, off[r], len));
    let slices = |off| Vec::from(views(off, 1024));
    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    fn shaped<B: Backend>(v: &View<B>) -> TensorView<'_, B> {
        TensorView::new(v, &[32, 32])
    }
    fn shaped_mut<B: Backend>(v: &mut View<B>) -> TensorViewMut<'_, B> {
        TensorViewMut::new(v, &[32, 32])
    }
    let (i, mut o) = (views([0, 0], 1024), views([100, 2048], 1024));
    let mut g = views([512, 2048], 2048);
    let (mut r, mut f) = (views([3000, 3000], 1024), views([1000, 1024], 1024));
    let inputs = i.each_ref().map(shaped::<B>);
    let mut outputs = o.each_mut().map(shaped_mut::<B>);
    let mut gathered = g.each_mut().map(|g| TensorViewMut::<B>::flat(g));
    let mut residuals = r.each_mut().map(shaped_mut::<B>);
    let mut fused_out = f.each_mut().map(shaped_mut::<B>);
    let w: Vec<_> = (0..world)
        .map(|r| B::alloc_from(comm.core(r).device(), &[1.0f32; 32]).unwrap())
        .collect();
    let weights = [0, 1].map(|r| TensorView::<B>::new(&w[r], &[32]));
    let c = CollectiveOptions::new();
    let mut results: Vec<(&str, peercomm::Result<()>)> = rows![
        "slices, rank 0's output one past its input" => comm.all_reduce_slices(&slices([0, 0]), &mut slices([1, 2048]), &ReduceOp::Sum, &opts).map(drop),
        "slices, rank 1's output inside its input" => comm.all_reduce_slices(&slices([0, 0]), &mut slices([2048, 512]), &ReduceOp::Sum, &opts).map(drop),
        "shaped all-reduce" => comm.all_reduce(&inputs, &mut outputs, &ReduceOp::Sum, &opts).map(drop),
        "all_gather" => comm.all_gather(&inputs, &mut gathered, &c),
        "fused" => comm.all_reduce_residual_rms_norm(&inputs, &mut residuals, &weights, &mut fused_out, 1e-5, &c),
    ];
    if B::NAME == "host" {
        // One address space: rank 1's output over rank 0's input, and two ranks writing
        // one range (views that claim the other rank's device).
        let view = View::<B>::new;
        // Rank r's output at (buffer, offset) `o[r]`, on rank r's device.
        let outs_at = |o: [(usize, usize); 2]| -> Vec<View<B>> {
            (0..2)
                .map(|r| view(at[o[r].0], o[r].1, 1024, ordinals[r]))
                .collect()
        };

        let (mut cross, mut same) = (outs_at([(1, 2048), (0, 512)]), outs_at([(0, 2048); 2]));
        results.extend(rows![
            "slices, rank 1's output over rank 0's input" => comm.all_reduce_slices(&slices([0, 0]), &mut cross, &ReduceOp::Sum, &opts).map(drop),
            "slices, both ranks' outputs one range" => comm.all_reduce_slices(&slices([0, 0]), &mut same, &ReduceOp::Sum, &opts).map(drop),
        ]);
    }
    comm.synchronize().ok();
    let wrong = not_refused(&results, |e| matches!(e, Error::BuffersOverlap { .. }));
    let mut written = 0;
    for (r, b) in bases.iter().enumerate() {
        let got = b.to_host(comm.core(r).device()).unwrap();
        written += (0..n).filter(|&i| got[i] != pattern(r, n)[i]).count();
    }
    // The exact alias: planned in place, right sums for every algorithm.
    let mut alias = Vec::new();
    for &algorithm in ALL_ALGORITHMS {
        for (r, b) in bases.iter_mut().enumerate() {
            b.copy_from_host(comm.core(r).device(), &pattern(r, n))
                .unwrap();
        }
        let opts = AllReduceOptions::new().algorithm(algorithm);
        let r = comm.all_reduce_slices(&slices([0, 0]), &mut slices([0, 0]), &ReduceOp::Sum, &opts);
        comm.synchronize().unwrap();
        for (q, b) in bases.iter().enumerate() {
            let got = b.to_host(comm.core(q).device()).unwrap();
            let bad = (0..1024)
                .filter(|&i| got[i] != pattern(0, n)[i] + pattern(1, n)[i])
                .count();
            if r.is_err() || bad > 0 {
                alias.push(format!("rank {q}, {algorithm:?}: {r:?}, {bad}/1024 wrong"));
            }
        }
    }
    eprintln!(
        "single controller: {} refusals missed, {written} elements written; exact aliases \
         wrong: {alias:?}",
        wrong.len()
    );
    let holds = wrong.is_empty();
    assert!(holds, "not BuffersOverlap:\n{}", wrong.join("\n"));
    assert_eq!(written, 0, "a refused call wrote");
    assert!(alias.is_empty(), "exact aliases: {alias:?}");
}
