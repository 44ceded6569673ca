//! Sizes and ranges a call cannot trust: overflowing lengths are typed errors on every
//! rank with nothing allocated or launched; a registered buffer is written through its
//! range only (overlapping ranges: `overlaps`). The lying buffers are `unsafe impl
//! DeviceBuffer` over real allocations, refused before anything dereferences them.

use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, DType, Error, ReduceOp};

use super::{with_world, Placement};

/// `len` f32 elements at `ptr` on device `ordinal`: a view that the test keeps inside a
/// live allocation (or, for `len` past it, that every call refuses before use).
pub(super) struct View<B: Backend> {
    ptr: u64,
    len: usize,
    ordinal: usize,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend> View<B> {
    pub(super) fn new(ptr: u64, offset: usize, len: usize, ordinal: usize) -> Self {
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
pub(super) fn address<B: Backend>(b: &impl DeviceBuffer<B>, dev: &B::Device) -> u64 {
    b.read_ptr(dev).0
}

/// Rank `rank`'s pattern: exact in f32 sums of a few ranks.
pub(super) fn pattern(rank: usize, len: usize) -> Vec<f32> {
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
            let line = format!("{what} too large on rank 0 only: {r:?}");
            seen.push((line, refused && !made));
        }
        for (line, _) in &seen {
            eprintln!("rank {rank}: {line}");
        }
        // After the refusals the communicator allocates, registers and all-reduces.
        still_works(rank, world, &comm);
        seen
    });
    let failures: Vec<String> = (outcomes.iter().enumerate())
        .flat_map(|(rank, seen)| seen.iter().map(move |(line, ok)| (rank, line, ok)))
        .filter(|(_, _, ok)| !**ok)
        .map(|(rank, line, _)| format!("rank {rank}: {line}"))
        .collect();

    let (none, failures) = (failures.is_empty(), failures.join("\n"));
    assert!(none, "not refused with SizeOverflow:\n{failures}");
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
    let spare = B::alloc_from(dev, &[0.0f32; 64]).unwrap();
    let mut residual = View::<B>::new(address(&spare, dev), 0, (1 << 62) + 1, ordinal);
    let results: Vec<(&str, peercomm::Result<()>)> = rows![
        "all_reduce" => comm.all_reduce(&huge(), &mut huge_out(), &ReduceOp::Sum).map(drop),
        "all_reduce in place" => comm.all_reduce_in_place(&mut huge_out(), &ReduceOp::Sum).map(drop),
        "all_gather" => comm.all_gather_with(&huge(), &mut huge_out(), &opts),
        "reduce_scatter" => comm.reduce_scatter_with(&huge(), &mut huge_out(), &ReduceOp::Sum, &opts),
        "broadcast" => comm.broadcast_with(Some(&huge()), &mut huge_out(), 0, &opts),
        "broadcast in place" => comm.broadcast_in_place_with(&mut huge_out(), 0, &opts),
        "scatter" => comm.scatter_with(Some(&huge()), &mut huge_out(), 0, &opts),
        "fused" => comm.all_reduce_residual_rms_norm(&huge(), &mut residual, &weight, &mut huge_out(), 1e-5, &opts),
    ];
    let wrong = not_refused(&results, |e| matches!(e, Error::SizeOverflow { .. }));
    let holds = wrong.is_empty();
    assert!(holds, "rank {rank}, 2^62 + 1 elements: {wrong:#?}");
    comm.synchronize().unwrap();
    let note = format!("rank {rank}: written");
    assert_eq!(real_out.to_host(dev).unwrap(), vec![7.0; 64], "{note}");
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
    comm.all_reduce_in_place(&mut s, &ReduceOp::Sum).unwrap();
    let mut reg = comm
        .register(B::alloc_from(dev, &pattern(rank, 1000)).unwrap())
        .unwrap();
    let mut out = B::alloc_buffer::<f32>(dev, 1000).unwrap();
    comm.all_reduce(&reg, &mut out, &ReduceOp::Sum).unwrap();
    comm.all_reduce_in_place(&mut reg, &ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(s.to_host(dev).unwrap(), want, "rank {rank}: symmetric");
    let note = format!("rank {rank}: registered input");
    assert_eq!(out.to_host(dev).unwrap(), want, "{note}");
    let note = format!("rank {rank}: registered in place");
    assert_eq!(reg.to_host(dev).unwrap(), want, "{note}");
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
            comm.all_reduce_with(&reg, &mut out, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            assert_eq!(out.to_host(dev).unwrap(), sum, "rank {rank}: {algorithm:?}");
            // Written in place (a collective's `&mut`), then read in place again.
            comm.all_reduce_in_place_with(&mut reg, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.all_reduce_with(&reg, &mut out, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            let twice: Vec<f32> = sum.iter().map(|x| x * world as f32).collect();
            assert_eq!(reg.to_host(dev).unwrap(), sum, "rank {rank}: {algorithm:?}");
            let note = format!("rank {rank}: {algorithm:?}");
            assert_eq!(out.to_host(dev).unwrap(), twice, "{note}");
            assert_eq!(address(&reg, dev), at, "rank {rank}: the range moved");
        }
        assert_eq!(comm.registrations().0, before + 1);
        let back = reg.into_inner();
        assert_eq!(comm.registrations().0, before);
        assert_eq!(address(&back, dev), at);
        assert_eq!(back.to_host(dev).unwrap(), sum);
    });
}

/// The calls of `results` not refused with an error `refused` accepts, in words.
pub(super) fn not_refused<W: std::fmt::Display>(
    results: &[(W, peercomm::Result<()>)],
    refused: impl Fn(&Error) -> bool,
) -> Vec<String> {
    results
        .iter()
        .filter(|(_, r)| !r.as_ref().is_err_and(&refused))
        .map(|(what, r)| format!("{what}: {r:?}"))
        .collect()
}
