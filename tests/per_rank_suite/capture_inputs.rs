//! Registered captures on the per-rank `Comm`: `Comm::register_inputs_of` runs a pass
//! twice, registering between them the inputs the first pass staged, so the second
//! reads them in place (a graph capture on CUDA, eager calls here). Checked: in-place
//! reads (two-stage runs), results against f64 and the staged bits, registrations
//! ending with the value, and typed errors in step when ranks disagree.

use peercomm::backend::Backend;
use peercomm::bootstrap::BootstrapError;
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, Element, Error};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::collectives::{assert_bits, expect_all_gather};
use super::common::{self, random_inputs};
use super::{seed, with_world, Placement};

fn inputs<T: Element>(seed: u64, case: usize, world: usize, len: usize) -> Vec<Vec<T>> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((case as u64) << 24));
    random_inputs::<T>(&mut rng, world, len)
}

fn nan<T: Element>(len: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); len]
}

fn opts(a: Algorithm) -> AllReduceOptions {
    AllReduceOptions::new().algorithm(a)
}

/// One pass of five calls, outputs poisoned: one-stage f32; bf16 one-stage then
/// two-stage (only in-place reads run it); an input rank 0 shares with the first call;
/// an all-gather; an in-place two-stage all-reduce (refilled first).
pub fn second_pass_reads_in_place<B: Backend>(place: &Placement, world: usize) {
    let seed = seed("per_rank_capture_inputs_second_pass_reads_in_place");
    let (n, m, g) = (4099, 65_537, 1023);
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let a_in = inputs::<f32>(seed, 0, world, n);
        let b_in = inputs::<half::bf16>(seed, 1, world, m);
        let c_in = inputs::<f32>(seed, 2, world, n);
        let g_in = inputs::<f32>(seed, 3, world, g);
        let e_in = inputs::<f32>(seed, 4, world, m);
        let a = B::alloc_from(dev, &a_in[rank]).unwrap();
        let b = B::alloc_from(dev, &b_in[rank]).unwrap();
        let c = B::alloc_from(dev, &c_in[rank]).unwrap();
        let gs = B::alloc_from(dev, &g_in[rank]).unwrap();
        let mut e = B::alloc_from(dev, &e_in[rank]).unwrap();
        let mut o1 = B::alloc_buffer::<f32>(dev, n).unwrap();
        let mut o2 = B::alloc_buffer::<half::bf16>(dev, m).unwrap();
        let mut o3 = B::alloc_buffer::<f32>(dev, n).unwrap();
        let mut og = B::alloc_buffer::<f32>(dev, g * world).unwrap();
        let third: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                if r == 0 {
                    a_in[0].clone()
                } else {
                    c_in[r].clone()
                }
            })
            .collect();
        let before = comm.registrations();
        let mut pass = 0;
        let (algorithms, registered) = comm
            .register_inputs_of(|| {
                pass += 1;
                B::upload(dev, &nan::<f32>(n), &mut o1)?;
                B::upload(dev, &nan::<half::bf16>(m), &mut o2)?;
                B::upload(dev, &nan::<f32>(n), &mut o3)?;
                B::upload(dev, &nan::<f32>(g * world), &mut og)?;
                B::upload(dev, &e_in[rank], &mut e)?;
                let second = if pass == 1 {
                    Algorithm::OneStage
                } else {
                    Algorithm::TwoStage
                };
                comm.all_reduce_sum_with(&a, &mut o1, &opts(Algorithm::OneStage))?;
                let b_ran = comm.all_reduce_sum_with(&b, &mut o2, &opts(second))?;
                let third_input = if rank == 0 { &a } else { &c };
                comm.all_reduce_sum_with(third_input, &mut o3, &AllReduceOptions::new())?;
                comm.all_gather(&gs, &mut og, &CollectiveOptions::new())?;
                let e_ran = comm.all_reduce_sum_in_place_with(&mut e, &opts(second))?;
                comm.synchronize()?;
                Ok((b_ran, e_ran))
            })
            .unwrap();
        assert_eq!(pass, 2, "rank {rank}: the pass runs twice");
        assert_eq!(
            algorithms,
            (Algorithm::TwoStage, Algorithm::TwoStage),
            "rank {rank}"
        );
        // Rank 0's third call shares its first's buffer, its peers' do not: five.
        assert_eq!(registered.registered(), 5, "rank {rank}");
        assert_eq!(registered.in_place_calls(), 5, "rank {rank}");
        assert_eq!(registered.staged_calls(), 0, "rank {rank}");
        assert_eq!(comm.registrations().0, before.0 + 5, "rank {rank}");
        let everyone = |v: Vec<f32>| vec![v; world];
        let got1 = B::download(dev, &o1).unwrap();
        common::check_sums(&a_in, &everyone(got1.clone()), world, "one-stage, in place");
        let got2 = B::download(dev, &o2).unwrap();
        common::check_sums(&b_in, &vec![got2; world], world, "two-stage, in place");
        let got3 = B::download(dev, &o3).unwrap();
        common::check_sums(&third, &everyone(got3.clone()), world, "aliased input");
        assert_bits(
            &B::download(dev, &og).unwrap(),
            &expect_all_gather(&g_in, world, rank),
            "all-gather",
        );
        let got_e = B::download(dev, &e).unwrap();
        common::check_sums(&e_in, &everyone(got_e), world, "in-place two-stage");
        // The capture's registrations are the calls': an eager call on the same buffer
        // still stages (two-stage refused), and gives the same bits one-stage.
        match comm.all_reduce_sum_with(&b, &mut o2, &opts(Algorithm::TwoStage)) {
            Err(Error::Unsupported(_)) => {}
            other => panic!("rank {rank}: an eager call read a capture's input: {other:?}"),
        }
        B::upload(dev, &nan::<f32>(n), &mut o1).unwrap();
        comm.all_reduce_sum_with(&a, &mut o1, &opts(Algorithm::OneStage))
            .unwrap();
        B::upload(dev, &nan::<f32>(n), &mut o3).unwrap();
        let third_input = if rank == 0 { &a } else { &c };
        comm.all_reduce_sum(third_input, &mut o3).unwrap();
        comm.synchronize().unwrap();
        assert_bits(&B::download(dev, &o1).unwrap(), &got1, "staged one-stage");
        assert_bits(&B::download(dev, &o3).unwrap(), &got3, "staged aliased");
        drop(registered);
        assert_eq!(
            comm.registrations(),
            before,
            "rank {rank}: ended with the value"
        );
    });
    eprintln!("per_rank_capture_inputs_second_pass_reads_in_place world {world}: 5 calls in place");
}

/// What one rank's pass does in a refusal case.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    /// One group-of-one all-reduce of 256 floats (no peer waits for it).
    Solo,
    /// Two of them.
    TwoSolos,
    /// One of 128 floats.
    SmallSolo,
    /// Fails before any call.
    Fails,
    /// Registers a buffer instead (`Comm::register`).
    Registers,
}

fn run_part<B: Backend>(comm: &Comm<B>, part: Part) -> Result<(), Error> {
    let dev = comm.device();
    let solo = AllReduceOptions::new().group_size(1);
    let len = if part == Part::SmallSolo { 128 } else { 256 };
    let a = B::alloc_from(dev, &vec![1.0f32; len]).unwrap();
    let b = B::alloc_from(dev, &vec![2.0f32; len]).unwrap();
    let mut out = B::alloc_buffer::<f32>(dev, len).unwrap();
    match part {
        Part::Fails => {
            return comm
                .register_inputs_of(|| -> Result<(), Error> {
                    Err(Error::InvalidConfig("this rank's pass failed".into()))
                })
                .map(drop)
        }
        Part::Registers => return comm.register(a).map(drop).map_err(|e| e.error),
        _ => {}
    }
    comm.register_inputs_of(|| {
        comm.all_reduce_sum_with(&a, &mut out, &solo)?;
        if part == Part::TwoSolos {
            comm.all_reduce_sum_with(&b, &mut out, &solo)?;
        }
        comm.synchronize()
    })
    .map(drop)
}

/// Disagreeing passes (one more call, another size, a failing pass, a registration
/// against a capture): the failing rank its own error, the others `CannotRegister` (or
/// `ExchangeMismatch`) naming it; nothing stays registered; a matching call works after.
pub fn disagreeing_passes_are_refused<B: Backend>(place: &Placement, world: usize) {
    let odd = world - 1;
    let cases = [
        (Part::TwoSolos, "one more call"),
        (Part::SmallSolo, "another size"),
        (Part::Fails, "a failed pass"),
        (Part::Registers, "a registration"),
    ];
    with_world::<B, _>(place, world, |rank, comm| {
        let before = comm.registrations();
        let dev = comm.device();
        for (odd_part, what) in cases {
            let part = if rank == odd { odd_part } else { Part::Solo };
            let got = run_part(&comm, part);
            match (&got, rank == odd, odd_part) {
                (Err(Error::InvalidConfig(_)), true, Part::Fails) => {}
                (
                    Err(Error::Bootstrap(BootstrapError::ExchangeMismatch { rank: r, .. })),
                    _,
                    Part::Registers,
                ) if *r == if rank == odd { 0 } else { odd } => {}
                (Err(Error::CannotRegister { rank: r, .. }), _, _) if *r == odd || rank == odd => {}
                _ => panic!("rank {rank}, {what}: {got:?}"),
            }
            assert_eq!(comm.registrations(), before, "rank {rank}, {what}");
            // Every rank still in step: a matching world call.
            let ones = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
            let mut out = B::alloc_from(dev, &[f32::NAN; 64]).unwrap();
            comm.all_reduce_sum(&ones, &mut out).unwrap();
            comm.synchronize().unwrap();
            assert_eq!(B::download(dev, &out).unwrap(), vec![world as f32; 64]);
        }
        // The same passes on every rank register, and the value ends them.
        let got = run_part(&comm, Part::TwoSolos);
        assert!(got.is_ok(), "rank {rank}: {got:?}");
        assert_eq!(comm.registrations(), before, "rank {rank}");
    });
}

/// `cycles` registered passes of one all-reduce, each value dropped: the
/// registrations end where they started, every sum right.
pub fn pass_cycles_leak_nothing<B: Backend>(place: &Placement, world: usize, cycles: usize) {
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let before = comm.registrations();
        let send = B::alloc_from(dev, &[rank as f32 + 1.0; 1000]).unwrap();
        let mut out = B::alloc_buffer::<f32>(dev, 1000).unwrap();
        let want = (world * (world + 1) / 2) as f32;
        for cycle in 0..cycles {
            let ((), inputs) = comm
                .register_inputs_of(|| {
                    comm.all_reduce_sum_with(&send, &mut out, &opts(Algorithm::OneStage))
                        .map(drop)
                })
                .unwrap();
            assert_eq!(inputs.in_place_calls(), 1);
            if cycle % 50 == 0 {
                comm.synchronize().unwrap();
                assert_eq!(B::download(dev, &out).unwrap(), vec![want; 1000]);
            }
        }
        comm.synchronize().unwrap();
        assert_eq!(comm.registrations(), before, "rank {rank}");
    });
}

/// The registered graph capture on CUDA (`Comm::capture_registered`).
#[cfg(feature = "cuda")]
pub mod graphs {
    use std::ops::{Deref, DerefMut};
    use std::process::Child;

    use cudarc::driver::{sys, CudaSlice};
    use peercomm::backend::cuda::Cuda;
    use peercomm::backend::Backend;
    use peercomm::bootstrap::UniqueId;
    use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, Error};

    use super::super::common::collectives::{assert_bits, expect_all_gather};
    use super::super::processes;
    use super::super::{common, seed, with_world, Placement};
    use super::{inputs, nan, opts};

    /// Where a rank's buffers come from.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub enum Memory {
        /// cudarc's own allocations (a stream-ordered pool where the driver has one).
        Cudarc,
        /// Plain `cuMemAlloc` memory, which legacy CUDA IPC exports to other processes
        /// (as an engine's own allocator may hand out).
        CuMemAlloc,
        /// A stream-ordered pool made with the POSIX file descriptor handle type (one
        /// per process): exported as a descriptor.
        PosixPool,
        /// Virtual memory (`cuMemCreate`, reserved, mapped, access granted) that
        /// requested POSIX file descriptor handles, or (`false`) none.
        Vmm(bool),
    }

    /// What a `Buf`'s drop gives back.
    enum Free {
        /// cudarc frees it.
        Cudarc,
        /// `cuMemFree`.
        Legacy,
        /// `cuMemFreeAsync` on its stream.
        Pool,
        /// Unmapped and its address range freed (`bytes` reserved).
        Vmm(usize),
    }

    const POSIX_FD: sys::CUmemAllocationHandleType =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

    /// Device 0's location (the test's processes each use their device 0).
    fn location(ordinal: i32) -> sys::CUmemLocation {
        // SAFETY: all-zero bits are a valid CUmemLocation; the id is the int at offset 4
        // in every CUDA version's layout (as the backend writes it).
        unsafe {
            let mut l: sys::CUmemLocation = std::mem::zeroed();
            l.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            (std::ptr::addr_of_mut!(l) as *mut i32)
                .add(1)
                .write(ordinal);
            l
        }
    }

    /// This process's pool with the POSIX-fd handle type, made once.
    fn posix_pool(ordinal: i32) -> sys::CUmemoryPool {
        static POOL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *POOL.get_or_init(|| {
            // SAFETY: zeroed props are valid; the fields set are the documented ones.
            let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.handleTypes = POSIX_FD;
            props.location = location(ordinal);
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: out-pointer and props valid for the call.
            unsafe { sys::cuMemPoolCreate(&mut pool, &props) }
                .result()
                .unwrap();
            pool as usize
        }) as sys::CUmemoryPool
    }

    /// `bytes` of virtual memory on device `ordinal`, mapped read-write: (address, size).
    fn vmm_alloc(ordinal: i32, bytes: usize, shareable: bool) -> (u64, usize) {
        // SAFETY: zeroed props are valid; the fields set are the documented ones.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = location(ordinal);
        if shareable {
            prop.requestedHandleTypes = POSIX_FD;
        }
        let mut granularity = 0usize;
        // SAFETY: out-pointer and props valid for the calls below; every handle and
        // range is used as the driver returned it.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()
            .unwrap();
            let size = bytes.div_ceil(granularity) * granularity;
            let mut handle = 0;
            sys::cuMemCreate(&mut handle, size, &prop, 0)
                .result()
                .unwrap();
            let mut va = 0;
            sys::cuMemAddressReserve(&mut va, size, 0, 0, 0)
                .result()
                .unwrap();
            sys::cuMemMap(va, size, 0, handle, 0).result().unwrap();
            sys::cuMemRelease(handle).result().unwrap();
            let access = sys::CUmemAccessDesc {
                location: location(ordinal),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            sys::cuMemSetAccess(va, size, &access, 1).result().unwrap();
            (va, size)
        }
    }

    /// A `CudaSlice` over memory from `Memory`: `cuMemAlloc` memory is taken back from
    /// cudarc (`leak`) and given back with `cuMemFree` on drop.
    pub struct Buf<T> {
        slice: Option<CudaSlice<T>>,
        free: Free,
    }

    impl<T> Deref for Buf<T> {
        type Target = CudaSlice<T>;
        fn deref(&self) -> &CudaSlice<T> {
            self.slice.as_ref().unwrap()
        }
    }

    impl<T> DerefMut for Buf<T> {
        fn deref_mut(&mut self) -> &mut CudaSlice<T> {
            self.slice.as_mut().unwrap()
        }
    }

    impl<T> Drop for Buf<T> {
        fn drop(&mut self) {
            let slice = self.slice.take().unwrap();
            if matches!(self.free, Free::Cudarc) {
                return;
            }
            let stream = slice.stream().clone();
            let ptr = slice.leak();
            stream.synchronize().unwrap();
            // SAFETY: `ptr` came from `alloc` as `free` says, and no work that uses it
            // is left on the stream.
            unsafe {
                match self.free {
                    Free::Cudarc => unreachable!(),
                    Free::Legacy => cudarc::driver::result::free_sync(ptr).unwrap(),
                    Free::Pool => {
                        sys::cuMemFreeAsync(ptr, stream.cu_stream())
                            .result()
                            .unwrap();
                        stream.synchronize().unwrap();
                    }
                    Free::Vmm(size) => {
                        sys::cuMemUnmap(ptr, size).result().unwrap();
                        sys::cuMemAddressFree(ptr, size).result().unwrap();
                    }
                }
            }
        }
    }

    /// `len` elements from `memory`, poisoned (NaN bits), on `comm`'s device.
    pub fn alloc<T: peercomm::Element + cudarc::driver::DeviceRepr>(
        comm: &Comm<Cuda>,
        memory: Memory,
        len: usize,
    ) -> Buf<T> {
        let dev = comm.device();
        match memory {
            Memory::Cudarc => Buf {
                slice: Some(Cuda::alloc_buffer::<T>(dev, len).unwrap()),
                free: Free::Cudarc,
            },
            memory => {
                let stream = dev.stream().clone();
                stream.context().bind_to_thread().unwrap();
                let bytes = len * std::mem::size_of::<T>();
                let ordinal = stream.context().ordinal() as i32;
                // SAFETY: a fresh allocation of `len` elements, filled (poisoned)
                // before any read; handed to cudarc for its length and stream only.
                let (ptr, free) = unsafe {
                    match memory {
                        Memory::PosixPool => {
                            let mut ptr = 0;
                            sys::cuMemAllocFromPoolAsync(
                                &mut ptr,
                                bytes,
                                posix_pool(ordinal),
                                stream.cu_stream(),
                            )
                            .result()
                            .unwrap();
                            stream.synchronize().unwrap();
                            (ptr, Free::Pool)
                        }
                        Memory::Vmm(shareable) => {
                            let (ptr, size) = vmm_alloc(ordinal, bytes, shareable);
                            (ptr, Free::Vmm(size))
                        }
                        _ => (
                            cudarc::driver::result::malloc_sync(bytes).unwrap(),
                            Free::Legacy,
                        ),
                    }
                };
                // SAFETY: as above.
                let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
                let mut buf = Buf {
                    slice: Some(slice),
                    free,
                };
                Cuda::upload(dev, &nan::<T>(len), &mut buf).unwrap();
                buf
            }
        }
    }

    /// A graph of four calls on plain inputs, captured registered (one-stage f32,
    /// two-stage bf16 2 MiB, `Auto`, all-gather): in-place reads, three checked replays
    /// with the staged capture's bits; dropping the graph ends its registrations.
    pub fn replays_read_in_place(place: &Placement, world: usize) {
        let seed = seed("cuda_per_rank_capture_registered");
        with_world::<Cuda, _>(place, world, |_rank, comm| {
            replay_rank(&comm, seed, Memory::Cudarc)
        });
        eprintln!("cuda_per_rank_capture_registered world {world}: 3 replays, 4 calls in place");
    }

    /// One rank of `replays_read_in_place`, over buffers from `memory`: returns a
    /// digest of the last replay's outputs (equal on every rank).
    pub fn replay_rank(comm: &Comm<Cuda>, seed: u64, memory: Memory) -> u64 {
        let (rank, world) = (comm.rank(), comm.world_size());
        let (n, m, g) = (4099, 1 << 20, 1023);
        let dev = comm.device();
        let mut a = alloc::<f32>(comm, memory, n);
        let mut b = alloc::<half::bf16>(comm, memory, m);
        let mut c = alloc::<f32>(comm, memory, m);
        let mut gs = alloc::<f32>(comm, memory, g);
        let mut o1 = alloc::<f32>(comm, memory, n);
        let mut o2 = alloc::<half::bf16>(comm, memory, m);
        let mut o3 = alloc::<f32>(comm, memory, m);
        let mut og = alloc::<f32>(comm, memory, g * world);
        let before = comm.registrations();
        let (graph, ran) = comm
            .capture_registered(|| {
                let one = comm.all_reduce_sum_with(&*a, &mut *o1, &opts(Algorithm::OneStage))?;
                let two = comm.all_reduce_sum_with(&*b, &mut *o2, &opts(Algorithm::TwoStage))?;
                let auto = comm.all_reduce_sum(&*c, &mut *o3)?;
                comm.all_gather(&*gs, &mut *og, &CollectiveOptions::new())?;
                Ok((one, two, auto))
            })
            .unwrap();
        let inputs_of = graph.inputs();
        assert_eq!(
            (
                inputs_of.registered(),
                inputs_of.in_place_calls(),
                inputs_of.staged_calls()
            ),
            (4, 4, 0),
            "rank {rank}"
        );
        assert_eq!(comm.registrations().0, before.0 + 4, "rank {rank}");
        assert_eq!((ran.0, ran.1), (Algorithm::OneStage, Algorithm::TwoStage));
        let mut kept = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for replay in 0..3 {
            let case = 10 * replay;
            let a_in = inputs::<f32>(seed, case, world, n);
            let b_in = inputs::<half::bf16>(seed, case + 1, world, m);
            let c_in = inputs::<f32>(seed, case + 2, world, m);
            let g_in = inputs::<f32>(seed, case + 3, world, g);
            Cuda::upload(dev, &a_in[rank], &mut a).unwrap();
            Cuda::upload(dev, &b_in[rank], &mut b).unwrap();
            Cuda::upload(dev, &c_in[rank], &mut c).unwrap();
            Cuda::upload(dev, &g_in[rank], &mut gs).unwrap();
            Cuda::upload(dev, &nan::<f32>(n), &mut o1).unwrap();
            Cuda::upload(dev, &nan::<half::bf16>(m), &mut o2).unwrap();
            Cuda::upload(dev, &nan::<f32>(m), &mut o3).unwrap();
            Cuda::upload(dev, &nan::<f32>(g * world), &mut og).unwrap();
            // Every rank's inputs are in place before any rank's replay reads them.
            comm.synchronize().unwrap();
            comm.barrier(0).unwrap();
            graph.launch().unwrap();
            comm.synchronize().unwrap();
            let got1 = Cuda::download(dev, &o1).unwrap();
            let got3 = Cuda::download(dev, &o3).unwrap();
            common::check_sums(&a_in, &vec![got1.clone(); world], world, "one-stage");
            let got2 = Cuda::download(dev, &o2).unwrap();
            common::check_sums(&b_in, &vec![got2.clone(); world], world, "two-stage");
            common::check_sums(&c_in, &vec![got3.clone(); world], world, "auto");
            let gathered = Cuda::download(dev, &og).unwrap();
            assert_bits(
                &gathered,
                &expect_all_gather(&g_in, world, rank),
                "all-gather",
            );
            kept = (got1, got2, got3, gathered);
        }
        // The same calls captured staged, over the last replay's inputs.
        let (staged, _) = comm
            .capture(|| {
                comm.all_reduce_sum_with(&*a, &mut *o1, &opts(Algorithm::OneStage))?;
                comm.all_reduce_sum_with(&*c, &mut *o3, &AllReduceOptions::new())
            })
            .unwrap();
        Cuda::upload(dev, &nan::<f32>(n), &mut o1).unwrap();
        Cuda::upload(dev, &nan::<f32>(m), &mut o3).unwrap();
        comm.synchronize().unwrap();
        comm.barrier(0).unwrap();
        staged.launch().unwrap();
        comm.synchronize().unwrap();
        assert_bits(
            &Cuda::download(dev, &o1).unwrap(),
            &kept.0,
            "staged one-stage",
        );
        assert_bits(&Cuda::download(dev, &o3).unwrap(), &kept.2, "staged auto");
        drop(graph);
        assert_eq!(comm.registrations(), before, "rank {rank}");
        // bf16 widens to f32 exactly: the digest sees every output's bits.
        let mut values = kept.0;
        values.extend(kept.1.iter().map(|x| x.to_f32()));
        values.extend(kept.2);
        values.extend(kept.3);
        crate::common::digest(&values)
    }

    /// One rank of `processes_world_2`: a capture over cudarc's buffers (refused alike
    /// where legacy IPC cannot export them), then replays over `cuMemAlloc` buffers.
    /// Prints `POOL <outcome>` and `DIGEST <digest>`.
    fn process_rank(comm: &Comm<Cuda>, seed: u64) -> (String, u64) {
        let rank = comm.rank();
        let before = comm.registrations();
        let pool = {
            let input = alloc::<f32>(comm, Memory::Cudarc, 4099);
            let mut out = alloc::<f32>(comm, Memory::Cudarc, 4099);
            let outcome = comm.capture_registered(|| {
                comm.all_reduce_sum_with(&*input, &mut *out, &opts(Algorithm::OneStage))
            });
            match outcome {
                Ok((graph, _)) => {
                    assert_eq!(graph.inputs().in_place_calls(), 1, "rank {rank}");
                    "registered".to_string()
                }
                Err(Error::CannotRegister { reason, .. }) => {
                    eprintln!("rank {rank}: cudarc's buffers refused: {reason}");
                    "refused".to_string()
                }
                Err(e) => panic!("rank {rank}: neither registered nor refused: {e}"),
            }
        };
        assert_eq!(comm.registrations(), before, "rank {rank}");
        // The refusal left the communicator usable: the legacy buffers' replays.
        (pool, replay_rank(comm, seed, Memory::CuMemAlloc))
    }

    fn placement() -> Placement {
        Placement {
            devices: Cuda::device_count().unwrap(),
            max_blocks: 4,
        }
    }

    /// The child side of `processes_world_2`: true when this process is such a child
    /// (it has run its rank).
    pub fn child(role: &str, rank: usize, world: usize, id: &UniqueId, seed: u64) -> bool {
        if role != "capture-registered" && role != "shareable" {
            return false;
        }
        let place = placement();
        let dev = Cuda::open(place.ordinal(rank)).unwrap();
        let comm = Comm::<Cuda>::from_rank(dev, rank, world, id, place.config(world)).unwrap();
        if role == "shareable" {
            for line in shareable_rank(&comm, seed) {
                println!("{line}");
            }
            return true;
        }
        let (pool, d) = process_rank(&comm, seed);
        println!("POOL {pool}");
        println!("DIGEST {d}");
        true
    }

    /// `(fds, maps)` before and after `cycles` register/drop cycles of one buffer from
    /// `memory`, after one warm-up cycle.
    fn register_cycles(comm: &Comm<Cuda>, memory: Memory, cycles: usize) -> [(usize, usize); 2] {
        let buf = alloc::<f32>(comm, memory, 1 << 16);
        let cycle = || {
            let registered = comm
                .register_borrowed(buf.as_view())
                .map_err(|e| e.error)
                .unwrap();
            assert_eq!(comm.registrations().0, 1);
            drop(registered);
            assert_eq!(comm.registrations(), (0, 0));
        };
        cycle();
        let before = processes::open_files_and_maps();
        (0..cycles).for_each(|_| cycle());
        [before, processes::open_files_and_maps()]
    }

    /// One rank of `shareable_processes_world`: its output lines (`SHAREABLE <tag> ...`).
    fn shareable_rank(comm: &Comm<Cuda>, seed: u64) -> Vec<String> {
        let rank = comm.rank();
        // Virtual memory made without a shareable handle type: refused alike, nothing
        // registered, the communicator usable.
        let plain = alloc::<f32>(comm, Memory::Vmm(false), 4099);
        let refused = match comm.register_borrowed(plain.as_view()) {
            Err(e) => match e.error {
                Error::CannotRegister { reason, .. } => {
                    eprintln!("rank {rank}: plain virtual memory refused: {reason}");
                    "refused"
                }
                other => panic!("rank {rank}: plain virtual memory: {other}"),
            },
            Ok(_) => "registered",
        };
        assert_eq!(comm.registrations(), (0, 0), "rank {rank}");
        let pool = replay_rank(comm, seed, Memory::PosixPool);
        let vmm = replay_rank(comm, seed, Memory::Vmm(true));
        let mut lines = vec![
            format!("SHAREABLE PLAIN_VMM {refused}"),
            format!("SHAREABLE DIGEST_POOL {pool}"),
            format!("SHAREABLE DIGEST_VMM {vmm}"),
        ];
        for (name, memory) in [("POOL", Memory::PosixPool), ("VMM", Memory::Vmm(true))] {
            let [(f0, m0), (f1, m1)] = register_cycles(comm, memory, SHAREABLE_CYCLES);
            lines.push(format!("SHAREABLE CYCLES_{name} {f0} {f1} {m0} {m1}"));
        }
        lines
    }

    /// Register/drop cycles per memory kind in `shareable_processes_world`.
    const SHAREABLE_CYCLES: usize = 1000;

    /// Registration across processes of POSIX-fd-only memory (descriptors over the
    /// Unix-socket channel): virtual memory without a shareable type is refused alike;
    /// pool and shareable virtual buffers are read in place by the replays, right and
    /// bitwise equal everywhere; 1,000 cycles per kind leak no fd or mapping.
    pub fn shareable_processes_world(world: usize) {
        let seed = seed("cuda_per_rank_register_shareable_processes");
        let id = UniqueId::new().unwrap();
        let text = id.to_string();
        let mut children: Vec<Child> = (1..world)
            .map(|r| processes::spawn_with("shareable", r, world, &text, seed, &[]))
            .collect();
        let place = placement();
        let dev = Cuda::open(0).unwrap();
        let comm = Comm::<Cuda>::from_rank(dev, 0, world, &id, place.config(world)).unwrap();
        let mine = shareable_rank(&comm, seed);
        let mut every = vec![mine.clone()];
        for (i, child) in children.iter_mut().enumerate() {
            let lines = processes::lines_of(child);
            let status = child.wait().unwrap();
            assert!(status.success(), "rank {} failed: {status}", i + 1);
            every.push(lines);
        }
        let tag = |lines: &[String], t: &str| {
            let t = format!("SHAREABLE {t}");
            lines
                .iter()
                .find_map(|l| l.strip_prefix(&t).map(str::to_string))
                .unwrap_or_else(|| panic!("no {t} in {lines:?}"))
        };
        for (rank, lines) in every.iter().enumerate() {
            assert_eq!(tag(lines, "PLAIN_VMM "), "refused", "rank {rank}");
            assert_eq!(
                tag(lines, "DIGEST_POOL "),
                tag(&mine, "DIGEST_POOL "),
                "rank {rank}"
            );
            assert_eq!(
                tag(lines, "DIGEST_VMM "),
                tag(&mine, "DIGEST_POOL "),
                "rank {rank}"
            );
            for kind in ["POOL", "VMM"] {
                let c: Vec<usize> = tag(lines, &format!("CYCLES_{kind} "))
                    .split_whitespace()
                    .map(|x| x.parse().unwrap())
                    .collect();
                eprintln!(
                    "rank {rank}, {kind}: {SHAREABLE_CYCLES} register/drop cycles: fds {} -> \
                     {}, maps {} -> {}",
                    c[0], c[1], c[2], c[3]
                );
                assert!(c[1] <= c[0], "rank {rank} {kind}: fds {} -> {}", c[0], c[1]);
                assert!(
                    c[3] <= c[2] + 4,
                    "rank {rank} {kind}: maps {} -> {}",
                    c[2],
                    c[3]
                );
            }
        }
        eprintln!(
            "cuda_per_rank_register_shareable_processes world {world}: POSIX-fd pool and \
             virtual memory read in place across processes, 3 replays each, bits equal on \
             every rank; plain virtual memory refused alike; {SHAREABLE_CYCLES} cycles each \
             leak no fd or mapping"
        );
    }

    /// `Comm::capture_registered` across processes: `cuMemAlloc` inputs exported by IPC
    /// and read in place by the replays, right and bitwise equal; cudarc's pool buffers
    /// refused (or registered) alike, leaving the communicator usable.
    pub fn processes_world(world: usize) {
        let seed = seed("cuda_per_rank_capture_registered_processes");
        let id = UniqueId::new().unwrap();
        let text = id.to_string();
        let mut children: Vec<Child> = (1..world)
            .map(|r| processes::spawn_with("capture-registered", r, world, &text, seed, &[]))
            .collect();
        let place = placement();
        let dev = Cuda::open(0).unwrap();
        let comm = Comm::<Cuda>::from_rank(dev, 0, world, &id, place.config(world)).unwrap();
        let (pool, d) = process_rank(&comm, seed);
        for (i, child) in children.iter_mut().enumerate() {
            let lines = processes::lines_of(child);
            let status = child.wait().unwrap();
            assert!(status.success(), "rank {} failed: {status}", i + 1);
            let tag = |t: &str| {
                lines
                    .iter()
                    .find_map(|l| l.strip_prefix(t).map(str::to_string))
                    .unwrap_or_else(|| panic!("rank {} printed no {t}", i + 1))
            };
            assert_eq!(tag("POOL "), pool, "rank {}: cudarc's buffers", i + 1);
            assert_eq!(tag("DIGEST "), d.to_string(), "rank {}'s bits", i + 1);
        }
        eprintln!(
            "cuda_per_rank_capture_registered_processes world {world}: cuMemAlloc inputs read \
             in place across processes, 3 replays, bits equal on every rank; cudarc's \
             buffers {pool}"
        );
    }
}
