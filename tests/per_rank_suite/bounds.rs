//! Sizes and ranges a call cannot trust: overflowing lengths are typed errors on every
//! rank with nothing allocated or launched; a registered buffer is written through its
//! range only; inputs overlapping outputs (not exactly aliased) are refused before
//! launch, while the exact alias runs in place. The lying buffers are `unsafe impl
//! DeviceBuffer` over real allocations, refused before anything dereferences them.

use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use peercomm::{
    Algorithm, AllReduceOptions, CollectiveOptions, Comm, DType, Error, SingleController,
    TensorView, TensorViewMut,
};

use super::{with_world, Placement};

/// `len` f32 elements at `ptr` on device `ordinal`: a view that the test keeps inside a
/// live allocation (or, for `len` past it, that every call refuses before use).
struct View<B: Backend> {
    ptr: u64,
    len: usize,
    ordinal: usize,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend> View<B> {
    fn new(ptr: u64, offset: usize, len: usize, ordinal: usize) -> Self {
        View {
            ptr: ptr + 4 * offset as u64,
            len,
            ordinal,
            _b: std::marker::PhantomData,
        }
    }
}

// SAFETY: the tests make views inside live allocations of the device they name, and
// synchronise before those are freed; a view whose length runs past its allocation is
// refused by every call before any kernel or copy could use it.
unsafe impl<B: Backend> DeviceBuffer<B> for View<B> {
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a B::Device) -> (u64, B::Access<'a>) {
        (self.ptr, B::untracked_access())
    }
}

// SAFETY: as above.
unsafe impl<B: Backend> DeviceBufferMut<B> for View<B> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a B::Device) -> (u64, B::Access<'a>) {
        (self.ptr, B::untracked_access())
    }
}

/// The address of a buffer on `dev`.
fn address<B: Backend>(b: &impl DeviceBuffer<B>, dev: &B::Device) -> u64 {
    b.read_ptr(dev).0
}

/// Rank `rank`'s pattern: exact in f32 sums of a few ranks.
fn pattern(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (rank * 10_000 + i) as f32).collect()
}

/// What a call returned, in words (a panic included), and whether it was refused with
/// `SizeOverflow`.
fn outcome<T>(r: std::thread::Result<peercomm::Result<T>>) -> (String, bool) {
    match r {
        Ok(Ok(_)) => ("Ok".into(), false),
        Ok(Err(e)) => (
            format!("Err({e:?})"),
            matches!(e, Error::SizeOverflow { .. }),
        ),
        Err(p) => (
            format!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ),
            false,
        ),
    }
}

/// Overflowing lengths: symmetric allocations (every dtype), a registration, every
/// collective and `algorithm_for` are typed errors on every rank; all works after.
pub fn huge_lengths_are_refused<B: Backend>(place: &Placement, world: usize) {
    // (dtype, elements): usize::MAX / size (a 0-byte span), usize::MAX / 2, usize::MAX,
    // and a span rounding up to just under 2^64 (a segment size wrapping to 0).
    let near_top = |size: usize| (usize::MAX - 1024) / size;
    let cases: Vec<(DType, usize)> = vec![
        (DType::F32, usize::MAX / 4),
        (DType::F32, usize::MAX / 2),
        (DType::F32, usize::MAX),
        (DType::F16, usize::MAX / 2),
        (DType::BF16, usize::MAX / 2),
        (DType::F16, usize::MAX / 4),
        (DType::F32, near_top(4)),
        (DType::BF16, near_top(2)),
    ];
    let outcomes = with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let real = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
        let view = |len| View::<B>::new(address(&real, dev), 0, len, real.device_ordinal());
        // Each call must be SizeOverflow, with nothing registered.
        type Call<'a> = Box<dyn Fn() -> peercomm::Result<()> + 'a>;
        let mut calls: Vec<(String, Call)> = Vec::new();
        for &(dtype, len) in &cases {
            let comm = &comm;
            calls.push((
                format!("alloc_symmetric::<{}>({len})", dtype.name()),
                Box::new(move || match dtype {
                    DType::F32 => comm.alloc_symmetric::<f32>(len).map(drop),
                    DType::F16 => comm.alloc_symmetric::<peercomm::half::f16>(len).map(drop),
                    _ => comm.alloc_symmetric::<peercomm::half::bf16>(len).map(drop),
                }),
            ));
        }
        // A registration whose bytes wrap to 4 (2^62 + 1 elements of 4 bytes).
        calls.push((
            format!("register of {} f32", (1u64 << 62) + 1),
            Box::new(|| {
                comm.register(view((1 << 62) + 1))
                    .map(drop)
                    .map_err(|e| e.error)
            }),
        ));
        // algorithm_for with a message no buffer can hold.
        for (dtype, len) in [(DType::F32, usize::MAX), (DType::BF16, usize::MAX / 2 + 7)] {
            let comm = &comm;
            calls.push((
                format!("algorithm_for({}, {len})", dtype.name()),
                Box::new(move || {
                    comm.algorithm_for(dtype, len, &AllReduceOptions::new(), false)
                        .map(drop)
                }),
            ));
        }
        let mut seen: Vec<(String, bool)> = calls
            .iter()
            .map(|(what, call)| {
                let before = comm.registrations();
                let (got, refused) =
                    outcome(std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)));
                let now = comm.registrations();
                let made = match now == before {
                    true => String::new(),
                    false => format!(" (registrations {before:?} -> {now:?}: allocated)"),
                };
                (format!("{what}: {got}{made}"), refused && now == before)
            })
            .collect();
        // Only rank 0 asks for too much: SizeOverflow there, CannotRegister naming it on
        // the peers (its refusal travels in the gathered record), nothing anywhere.
        let before = comm.registrations();
        let one = match rank {
            0 => comm.alloc_symmetric::<f32>(usize::MAX / 4).map(drop),
            _ => comm.alloc_symmetric::<f32>(1000).map(drop),
        };
        let len = if rank == 0 { (1 << 62) + 1 } else { 64 };
        let registered = comm.register(view(len)).map(drop).map_err(|e| e.error);
        for (what, r) in [("alloc_symmetric", one), ("register", registered)] {
            let refused = match (rank, &r) {
                (0, Err(Error::SizeOverflow { .. })) => true,
                (_, Err(Error::CannotRegister { rank: 0, .. })) => rank > 0,
                _ => false,
            };
            let made = comm.registrations() != before;
            seen.push((
                format!("{what} too large on rank 0 only: {r:?}"),
                refused && !made,
            ));
        }
        for (line, _) in &seen {
            eprintln!("rank {rank}: {line}");
        }
        // After the refusals the communicator allocates, registers and all-reduces.
        still_works(rank, world, &comm);
        seen
    });
    let mut failures = Vec::new();
    for (rank, seen) in outcomes.iter().enumerate() {
        for (line, refused) in seen {
            if !refused {
                failures.push(format!("rank {rank}: {line}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "not refused with SizeOverflow:\n{}",
        failures.join("\n")
    );
}

/// Every collective with a buffer whose length overflows is `SizeOverflow` on every
/// rank before launch, nothing written; the communicator then works.
pub fn huge_buffers_in_collectives_are_refused<B: Backend>(place: &Placement, world: usize) {
    with_world::<B, _>(place, world, |rank, comm| {
        huge_collectives_are_refused(rank, &comm);
        still_works(rank, world, &comm);
    });
}

/// Every collective with a buffer whose length overflows: `SizeOverflow` before launch.
fn huge_collectives_are_refused<B: Backend>(rank: usize, comm: &Comm<B>) {
    let dev = comm.device();
    let real = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
    let mut real_out = B::alloc_from(dev, &[7.0f32; 64]).unwrap();
    let at = address(&real, dev);
    let out_at = address(&real_out, dev);
    let ordinal = real.device_ordinal();
    let huge = || View::<B>::new(at, 0, (1 << 62) + 1, ordinal);
    let huge_out = || View::<B>::new(out_at, 0, (1 << 62) + 1, ordinal);
    let opts = CollectiveOptions::new();
    let weight = B::alloc_from(dev, &[1.0f32; 4]).unwrap();
    let mut results: Vec<(&str, peercomm::Result<()>)> = vec![
        (
            "all_reduce",
            comm.all_reduce_sum(&huge(), &mut huge_out()).map(drop),
        ),
        (
            "all_reduce in place",
            comm.all_reduce_sum_in_place(&mut huge_out()).map(drop),
        ),
        (
            "all_gather",
            comm.all_gather(&huge(), &mut huge_out(), &opts),
        ),
        (
            "reduce_scatter",
            comm.reduce_scatter_sum(&huge(), &mut huge_out(), &opts),
        ),
        (
            "broadcast",
            comm.broadcast(Some(&huge()), &mut huge_out(), 0, &opts),
        ),
        (
            "broadcast in place",
            comm.broadcast_in_place(&mut huge_out(), 0, &opts),
        ),
        (
            "scatter",
            comm.scatter(Some(&huge()), &mut huge_out(), 0, &opts),
        ),
    ];
    let spare = B::alloc_from(dev, &[0.0f32; 64]).unwrap();
    let mut residual = View::<B>::new(address(&spare, dev), 0, (1 << 62) + 1, ordinal);
    results.push((
        "fused",
        comm.all_reduce_residual_rms_norm(
            &huge(),
            &mut residual,
            &weight,
            &mut huge_out(),
            1e-5,
            &opts,
        ),
    ));
    let wrong = not_refused(&results, |e| matches!(e, Error::SizeOverflow { .. }));
    assert!(
        wrong.is_empty(),
        "rank {rank}, 2^62 + 1 elements: {wrong:#?}"
    );
    comm.synchronize().unwrap();
    assert_eq!(
        real_out.to_host(dev).unwrap(),
        vec![7.0; 64],
        "rank {rank}: written"
    );
    real_out.copy_from_host(dev, &[0.0; 64]).unwrap();
}

/// A symmetric allocation, a registration and all-reduces on both, checked.
fn still_works<B: Backend>(rank: usize, world: usize, comm: &Comm<B>) {
    let dev = comm.device();
    let want: Vec<f32> = (0..1000)
        .map(|i| (0..world).map(|r| pattern(r, 1000)[i]).sum())
        .collect();
    let mut s = comm.alloc_symmetric::<f32>(1000).unwrap();
    s.copy_from_host(dev, &pattern(rank, 1000)).unwrap();
    comm.all_reduce_sum_in_place(&mut s).unwrap();
    let mut reg = comm
        .register(B::alloc_from(dev, &pattern(rank, 1000)).unwrap())
        .unwrap();
    let mut out = B::alloc_buffer::<f32>(dev, 1000).unwrap();
    comm.all_reduce_sum(&reg, &mut out).unwrap();
    comm.all_reduce_sum_in_place(&mut reg).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(s.to_host(dev).unwrap(), want, "rank {rank}: symmetric");
    assert_eq!(
        out.to_host(dev).unwrap(),
        want,
        "rank {rank}: registered input"
    );
    assert_eq!(
        reg.to_host(dev).unwrap(),
        want,
        "rank {rank}: registered in place"
    );
}

/// Sanctioned writes into a registered buffer (a collective's `&mut`, host copies) hit
/// its registered range: peers read them in place, `into_inner` returns them.
pub fn registered_writes_keep_the_range<B: Backend>(place: &Placement, world: usize) {
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let n = 1000;
        let before = comm.registrations().0;
        let mut reg = comm
            .register(B::alloc_buffer::<f32>(dev, n).unwrap())
            .unwrap();
        let at = address(&reg, dev);
        reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
        assert_eq!(reg.to_host(dev).unwrap(), pattern(rank, n));
        let sum: Vec<f32> = (0..n)
            .map(|i| (0..world).map(|r| pattern(r, n)[i]).sum())
            .collect();
        let mut out = B::alloc_buffer::<f32>(dev, n).unwrap();
        for algorithm in [Algorithm::OneStage, Algorithm::TwoStage, Algorithm::Auto] {
            let opts = AllReduceOptions::new().algorithm(algorithm);
            reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
            comm.all_reduce_sum_with(&reg, &mut out, &opts).unwrap();
            comm.synchronize().unwrap();
            assert_eq!(out.to_host(dev).unwrap(), sum, "rank {rank}: {algorithm:?}");
            // Written in place (a collective's `&mut`), then read in place again.
            comm.all_reduce_sum_in_place_with(&mut reg, &opts).unwrap();
            comm.all_reduce_sum_with(&reg, &mut out, &opts).unwrap();
            comm.synchronize().unwrap();
            let twice: Vec<f32> = sum.iter().map(|x| x * world as f32).collect();
            assert_eq!(reg.to_host(dev).unwrap(), sum, "rank {rank}: {algorithm:?}");
            assert_eq!(
                out.to_host(dev).unwrap(),
                twice,
                "rank {rank}: {algorithm:?}"
            );
            assert_eq!(address(&reg, dev), at, "rank {rank}: the range moved");
        }
        assert_eq!(comm.registrations().0, before + 1);
        let back = reg.into_inner();
        assert_eq!(comm.registrations().0, before);
        assert_eq!(address(&back, dev), at);
        assert_eq!(back.to_host(dev).unwrap(), sum);
    });
}

fn is_overlap<T: std::fmt::Debug>(r: &peercomm::Result<T>) -> bool {
    matches!(r, Err(Error::BuffersOverlap { .. }))
}

/// The calls of `results` not refused with an error `refused` accepts, in words.
fn not_refused<W: std::fmt::Display>(
    results: &[(W, peercomm::Result<()>)],
    refused: impl Fn(&Error) -> bool,
) -> Vec<String> {
    results
        .iter()
        .filter(|(_, r)| !r.as_ref().is_err_and(&refused))
        .map(|(what, r)| format!("{what}: {r:?}"))
        .collect()
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
        let results: Vec<(&str, peercomm::Result<()>)> = vec![
            (
                "all_reduce, registered input",
                comm.all_reduce_sum(&v(at, 0, 1024), &mut v(at, 1, 1024))
                    .map(drop),
            ),
            (
                "all_reduce, output before the input",
                comm.all_reduce_sum(&v(at, 512, 1024), &mut v(at, 0, 1024))
                    .map(drop),
            ),
            (
                "all_reduce, plain input",
                comm.all_reduce_sum(&v(plain_at, 0, 1024), &mut v(plain_at, 512, 1024))
                    .map(drop),
            ),
            (
                "all_gather",
                comm.all_gather(&v(at, 0, 512), &mut v(at, 256, 1024), &opts),
            ),
            (
                "reduce_scatter",
                comm.reduce_scatter_sum(&v(at, 0, 1024), &mut v(at, 100, 512), &opts),
            ),
            (
                "fused, input and output",
                comm.all_reduce_residual_rms_norm(
                    &v(at, 0, 1024),
                    &mut residual,
                    &weight,
                    &mut v(at, 64, 1024),
                    1e-5,
                    &opts,
                ),
            ),
            (
                "fused, residual and output",
                comm.all_reduce_residual_rms_norm(
                    &v(plain_at, 0, 1024),
                    &mut v(at, 0, 1024),
                    &weight,
                    &mut v(at, 1, 1024),
                    1e-5,
                    &opts,
                ),
            ),
            (
                "fused, weight and residual",
                comm.all_reduce_residual_rms_norm(
                    &v(plain_at, 0, 1024),
                    &mut v(at, 0, 1024),
                    &v(at, 32, 64),
                    &mut v(at, 2048, 1024),
                    1e-5,
                    &opts,
                ),
            ),
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
        for algorithm in [
            Algorithm::OneStage,
            Algorithm::TwoStage,
            Algorithm::Lamport,
            Algorithm::Auto,
        ] {
            reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
            let opts = AllReduceOptions::new().algorithm(algorithm);
            let r = comm.all_reduce_sum_with(&v(at, 0, 1024), &mut v(at, 0, 1024), &opts);
            comm.synchronize().unwrap();
            let got = reg.to_host(dev).unwrap();
            let bad = (0..1024).filter(|&i| got[i] != sum[i]).count();
            let past = got[1024..] != pattern(rank, n)[1024..];
            if r.is_err() || bad > 0 || past {
                alias.push(format!("{algorithm:?}: {r:?}, {bad}/1024 wrong"));
            }
        }
        plain.copy_from_host(dev, &pattern(rank, n)).unwrap();
        let r = comm.all_reduce_sum(&v(plain_at, 0, 1024), &mut v(plain_at, 0, 1024));
        comm.synchronize().unwrap();
        if r.is_err() || plain.to_host(dev).unwrap()[..1024] != sum[..] {
            alias.push(format!("a plain buffer: {r:?}"));
        }
        eprintln!(
            "rank {rank}: {} refusals missed, {written}/{n} registered elements written; \
             exact aliases wrong: {alias:?}",
            wrong.len()
        );
        assert!(
            wrong.is_empty(),
            "rank {rank}: not BuffersOverlap:\n{}",
            wrong.join("\n")
        );
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
    super::with_world_config::<B, _>(place, 2, &config, |rank, comm| {
        let dev = comm.device();
        let ordinal = B::ordinal(comm.device());
        let n = 2048;
        let mut reg = comm
            .register(B::alloc_buffer::<f32>(dev, n).unwrap())
            .unwrap();
        let at = address(&reg, dev);
        let v = |off: usize, len: usize| View::<B>::new(at, off, len, ordinal);
        for call in ["all_reduce", "broadcast"] {
            reg.copy_from_host(dev, &pattern(rank, n)).unwrap();
            comm.synchronize().unwrap();
            // Rank 0 overlaps (its output one element past its input); rank 1 not.
            let out_at = if rank == 0 { 1 } else { 1024 };
            let r = match call {
                "all_reduce" => comm
                    .all_reduce_sum(&v(0, 1024), &mut v(out_at, 1024))
                    .map(drop),
                _ => comm.broadcast(
                    Some(&v(0, 1024)),
                    &mut v(out_at, 1024),
                    0,
                    &CollectiveOptions::new(),
                ),
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
        comm.all_reduce_sum(&reg, &mut out).unwrap();
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
    let ins = |off: [usize; 2]| vec![v(0, off[0], 1024), v(1, off[1], 1024)];
    let outs = |off: [usize; 2]| vec![v(0, off[0], 1024), v(1, off[1], 1024)];
    let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let mut results: Vec<(String, peercomm::Result<()>)> = Vec::new();
    results.push((
        "slices, rank 0's output one past its input".into(),
        comm.all_reduce_sum_slices(&ins([0, 0]), &mut outs([1, 2048]), &opts)
            .map(drop),
    ));
    results.push((
        "slices, rank 1's output inside its input".into(),
        comm.all_reduce_sum_slices(&ins([0, 0]), &mut outs([2048, 512]), &opts)
            .map(drop),
    ));
    {
        let (i0, i1) = (v(0, 0, 1024), v(1, 0, 1024));
        let (mut o0, mut o1) = (v(0, 100, 1024), v(1, 2048, 1024));
        let inputs = [
            TensorView::<B>::new(&i0, &[32, 32]),
            TensorView::new(&i1, &[32, 32]),
        ];
        let mut outputs = [
            TensorViewMut::<B>::new(&mut o0, &[32, 32]),
            TensorViewMut::new(&mut o1, &[32, 32]),
        ];
        results.push((
            "shaped all-reduce".into(),
            comm.all_reduce_sum(&inputs, &mut outputs, &opts).map(drop),
        ));
        let (mut g0, mut g1) = (v(0, 512, 2048), v(1, 2048, 2048));
        let mut gathered = [
            TensorViewMut::<B>::flat(&mut g0),
            TensorViewMut::flat(&mut g1),
        ];
        results.push((
            "all_gather".into(),
            comm.all_gather(&inputs, &mut gathered, &CollectiveOptions::new()),
        ));
        let w: Vec<_> = (0..world)
            .map(|r| B::alloc_from(comm.core(r).device(), &[1.0f32; 32]).unwrap())
            .collect();
        let weights = [
            TensorView::<B>::new(&w[0], &[32]),
            TensorView::new(&w[1], &[32]),
        ];
        let (mut r0, mut r1) = (v(0, 3000, 1024), v(1, 3000, 1024));
        let mut residuals = [
            TensorViewMut::<B>::new(&mut r0, &[32, 32]),
            TensorViewMut::new(&mut r1, &[32, 32]),
        ];
        let (mut f0, mut f1) = (v(0, 1000, 1024), v(1, 1024, 1024));
        let mut fused_out = [
            TensorViewMut::<B>::new(&mut f0, &[32, 32]),
            TensorViewMut::new(&mut f1, &[32, 32]),
        ];
        results.push((
            "fused".into(),
            comm.all_reduce_residual_rms_norm(
                &inputs,
                &mut residuals,
                &weights,
                &mut fused_out,
                1e-5,
                &CollectiveOptions::new(),
            ),
        ));
    }
    if B::NAME == "host" {
        // One address space: rank 1's output over rank 0's input, and two ranks writing
        // one range (views that claim the other rank's device).
        let cross = vec![
            View::<B>::new(at[1], 2048, 1024, ordinals[0]),
            View::<B>::new(at[0], 512, 1024, ordinals[1]),
        ];
        results.push((
            "slices, rank 1's output over rank 0's input".into(),
            comm.all_reduce_sum_slices(&ins([0, 0]), &mut { cross }, &opts)
                .map(drop),
        ));
        let same = vec![
            View::<B>::new(at[0], 2048, 1024, ordinals[0]),
            View::<B>::new(at[0], 2048, 1024, ordinals[1]),
        ];
        results.push((
            "slices, both ranks' outputs one range".into(),
            comm.all_reduce_sum_slices(&ins([0, 0]), &mut { same }, &opts)
                .map(drop),
        ));
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
    for algorithm in [
        Algorithm::OneStage,
        Algorithm::TwoStage,
        Algorithm::Lamport,
        Algorithm::Auto,
    ] {
        for (r, b) in bases.iter_mut().enumerate() {
            b.copy_from_host(comm.core(r).device(), &pattern(r, n))
                .unwrap();
        }
        let opts = AllReduceOptions::new().algorithm(algorithm);
        let r = comm.all_reduce_sum_slices(&ins([0, 0]), &mut outs([0, 0]), &opts);
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
    assert!(
        wrong.is_empty(),
        "not BuffersOverlap:\n{}",
        wrong.join("\n")
    );
    assert_eq!(written, 0, "a refused call wrote");
    assert!(alias.is_empty(), "exact aliases: {alias:?}");
}
