//! The registered graph capture on CUDA (`Comm::capture_registered`): replays read
//! their inputs in place, also across processes and from memory exported only as a
//! POSIX file descriptor.

use std::ops::{Deref, DerefMut};
use std::process::Child;

use cudarc::driver::{self, sys, CudaSlice};
use peercomm::backend::cuda::Cuda;
use peercomm::backend::Backend;
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, Error, ReduceOp};

use super::capture_inputs::opts;
use super::common::collectives::{assert_bits, expect_all_gather};
use super::{common, inputs, nan, process_faults, processes, seed, with_world, Placement};

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

/// Panics on a driver error.
fn ok(result: sys::CUresult) {
    result.result().unwrap()
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
        ok(unsafe { sys::cuMemPoolCreate(&mut pool, &props) });
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
        ok(sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        ));
        let size = bytes.div_ceil(granularity) * granularity;
        let mut handle = 0;
        ok(sys::cuMemCreate(&mut handle, size, &prop, 0));
        let mut va = 0;
        ok(sys::cuMemAddressReserve(&mut va, size, 0, 0, 0));
        ok(sys::cuMemMap(va, size, 0, handle, 0));
        ok(sys::cuMemRelease(handle));
        let access = sys::CUmemAccessDesc {
            location: location(ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        ok(sys::cuMemSetAccess(va, size, &access, 1));
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
                Free::Legacy => driver::result::free_sync(ptr).unwrap(),
                Free::Pool => {
                    ok(sys::cuMemFreeAsync(ptr, stream.cu_stream()));
                    stream.synchronize().unwrap();
                }
                Free::Vmm(size) => {
                    ok(sys::cuMemUnmap(ptr, size));
                    ok(sys::cuMemAddressFree(ptr, size));
                }
            }
        }
    }
}

/// `len` elements from `memory`, poisoned (NaN bits), on `comm`'s device.
pub fn alloc<T: peercomm::Element + driver::DeviceRepr>(
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
                        let (mut ptr, pool) = (0, posix_pool(ordinal));
                        ok(sys::cuMemAllocFromPoolAsync(
                            &mut ptr,
                            bytes,
                            pool,
                            stream.cu_stream(),
                        ));
                        stream.synchronize().unwrap();
                        (ptr, Free::Pool)
                    }
                    Memory::Vmm(shareable) => {
                        let (ptr, size) = vmm_alloc(ordinal, bytes, shareable);
                        (ptr, Free::Vmm(size))
                    }
                    _ => (driver::result::malloc_sync(bytes).unwrap(), Free::Legacy),
                }
            };
            // SAFETY: as above.
            let slice = Some(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) });
            let mut buf = Buf { slice, free };
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
    with_world::<Cuda, _>(place, world, |_, comm| {
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
            let one =
                comm.all_reduce_with(&*a, &mut *o1, &ReduceOp::Sum, &opts(Algorithm::OneStage))?;
            let two =
                comm.all_reduce_with(&*b, &mut *o2, &ReduceOp::Sum, &opts(Algorithm::TwoStage))?;
            let auto = comm.all_reduce(&*c, &mut *o3, &ReduceOp::Sum)?;
            comm.all_gather_with(&*gs, &mut *og, &CollectiveOptions::new())?;
            Ok((one, two, auto))
        })
        .unwrap();
    let i = graph.inputs();
    let counts = (i.registered(), i.in_place_calls(), i.staged_calls());
    assert_eq!(counts, (4, 4, 0), "rank {rank}");
    assert_eq!(comm.registrations().0, before.0 + 4, "rank {rank}");
    assert_eq!((ran.0, ran.1), (Algorithm::OneStage, Algorithm::TwoStage));
    let download = |b: &Buf<f32>| Cuda::download(dev, b).unwrap();
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
        for o in [&mut o1, &mut o3, &mut og] {
            Cuda::upload(dev, &nan::<f32>(o.len()), o).unwrap();
        }
        Cuda::upload(dev, &nan::<half::bf16>(m), &mut o2).unwrap();
        // Every rank's inputs are in place before any rank's replay reads them.
        comm.synchronize().unwrap();
        comm.barrier(0).unwrap();
        graph.launch().unwrap();
        comm.synchronize().unwrap();
        let (got1, got3) = (download(&o1), download(&o3));
        common::check_sums(&a_in, &vec![got1.clone(); world], world, "one-stage");
        let got2 = Cuda::download(dev, &o2).unwrap();
        common::check_sums(&b_in, &vec![got2.clone(); world], world, "two-stage");
        common::check_sums(&c_in, &vec![got3.clone(); world], world, "auto");
        let (gathered, want) = (download(&og), expect_all_gather(&g_in, world, rank));
        assert_bits(&gathered, &want, "all-gather");
        kept = (got1, got2, got3, gathered);
    }
    // The same calls captured staged, over the last replay's inputs.
    let (staged, _) = comm
        .capture(|| {
            comm.all_reduce_with(&*a, &mut *o1, &ReduceOp::Sum, &opts(Algorithm::OneStage))?;
            comm.all_reduce_with(&*c, &mut *o3, &ReduceOp::Sum, &AllReduceOptions::new())
        })
        .unwrap();
    Cuda::upload(dev, &nan::<f32>(n), &mut o1).unwrap();
    Cuda::upload(dev, &nan::<f32>(m), &mut o3).unwrap();
    comm.synchronize().unwrap();
    comm.barrier(0).unwrap();
    staged.launch().unwrap();
    comm.synchronize().unwrap();
    assert_bits(&download(&o1), &kept.0, "staged one-stage");
    assert_bits(&download(&o3), &kept.2, "staged auto");
    drop(graph);
    assert_eq!(comm.registrations(), before, "rank {rank}");
    // bf16 widens to f32 exactly: the digest sees every output's bits.
    let bf16s = kept.1.iter().map(|x| x.to_f32());
    common::digest(&[kept.0, bf16s.collect(), kept.2, kept.3].concat())
}

/// One rank of `processes_world_2`: a capture over cudarc's buffers (refused alike
/// where legacy IPC cannot export them), then replays over `cuMemAlloc` buffers.
/// Prints `POOL <outcome>` and `DIGEST <digest>`.
fn process_rank(comm: &Comm<Cuda>, seed: u64) -> (&'static str, u64) {
    let rank = comm.rank();
    let before = comm.registrations();
    let pool = {
        let input = alloc::<f32>(comm, Memory::Cudarc, 4099);
        let mut out = alloc::<f32>(comm, Memory::Cudarc, 4099);
        let outcome = comm.capture_registered(|| {
            comm.all_reduce_with(
                &*input,
                &mut *out,
                &ReduceOp::Sum,
                &opts(Algorithm::OneStage),
            )
        });
        match outcome {
            Ok((graph, _)) => {
                assert_eq!(graph.inputs().in_place_calls(), 1, "rank {rank}");
                "registered"
            }
            Err(Error::CannotRegister { reason, .. }) => {
                eprintln!("rank {rank}: cudarc's buffers refused: {reason}");
                "refused"
            }
            Err(e) => panic!("rank {rank}: neither registered nor refused: {e}"),
        }
    };
    assert_eq!(comm.registrations(), before, "rank {rank}");
    // The refusal left the communicator usable: the legacy buffers' replays.
    (pool, replay_rank(comm, seed, Memory::CuMemAlloc))
}

/// Rank 0 of `world` here running `rank0`, ranks 1.. as child processes running
/// `role`: rank 0's result and each child's lines (every child exited successfully).
fn in_processes<R>(
    role: &str,
    world: usize,
    seed: u64,
    rank0: impl FnOnce(&Comm<Cuda>) -> R,
) -> (R, Vec<Vec<String>>) {
    let id = UniqueId::new().unwrap();
    let mut children: Vec<Child> = (1..world)
        .map(|r| processes::spawn_with(role, r, world, &id.to_string(), seed, &[]))
        .collect();
    let (dev, config) = (Cuda::open(0).unwrap(), placement().config(world));
    let mine = rank0(&Comm::<Cuda>::from_rank(dev, 0, world, &id, config).unwrap());
    let theirs = children.iter_mut().enumerate().map(|(i, child)| {
        let lines = processes::lines_of(child);
        let status = child.wait().unwrap();
        assert!(status.success(), "rank {} failed: {status}", i + 1);
        lines
    });
    (mine, theirs.collect())
}

/// What follows `tag` in the line of `lines` that starts with it.
fn tagged(lines: &[String], tag: &str) -> String {
    let found = lines.iter().find_map(|l| l.strip_prefix(tag));
    found.expect("a tagged line").to_string()
}

fn placement() -> Placement {
    super::gpu_placement::<Cuda>("a rank process").expect("a CUDA device")
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
    let lines = if role == "shareable" {
        shareable_rank(&comm, seed)
    } else {
        let (pool, d) = process_rank(&comm, seed);
        vec![format!("POOL {pool}"), format!("DIGEST {d}")]
    };
    lines.iter().for_each(|line| println!("{line}"));
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
    let before = process_faults::open_files_and_maps();
    (0..cycles).for_each(|_| cycle());
    [before, process_faults::open_files_and_maps()]
}

/// One rank of `shareable_processes_world`: its output lines (`SHAREABLE <tag> ...`).
fn shareable_rank(comm: &Comm<Cuda>, seed: u64) -> Vec<String> {
    let rank = comm.rank();
    // Virtual memory made without a shareable handle type: refused alike, nothing
    // registered, the communicator usable.
    let plain = alloc::<f32>(comm, Memory::Vmm(false), 4099);
    let refused = match comm.register_borrowed(plain.as_view()).map_err(|e| e.error) {
        Err(Error::CannotRegister { reason, .. }) => {
            eprintln!("rank {rank}: plain virtual memory refused: {reason}");
            "refused"
        }
        Err(other) => panic!("rank {rank}: plain virtual memory: {other}"),
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
    let (mine, theirs) = in_processes("shareable", world, seed, |c| shareable_rank(c, seed));
    let every = [vec![mine.clone()], theirs].concat();
    let tag = |lines: &[String], t: &str| tagged(lines, &format!("SHAREABLE {t} "));
    let pool = tag(&mine, "DIGEST_POOL");
    for (rank, lines) in every.iter().enumerate() {
        assert_eq!(tag(lines, "PLAIN_VMM"), "refused", "rank {rank}");
        assert_eq!(tag(lines, "DIGEST_POOL"), pool, "rank {rank}");
        assert_eq!(tag(lines, "DIGEST_VMM"), pool, "rank {rank}");
        for kind in ["POOL", "VMM"] {
            let c = tag(lines, &format!("CYCLES_{kind}"));
            let c: Vec<usize> = c.split_whitespace().map(|x| x.parse().unwrap()).collect();
            let (fds, maps) = ((c[0], c[1]), (c[2], c[3]));
            eprintln!("rank {rank}, {kind}: {SHAREABLE_CYCLES} register/drop cycles: fds {fds:?}, maps {maps:?}");
            assert!(fds.1 <= fds.0, "rank {rank} {kind}: fds {fds:?}");
            assert!(maps.1 <= maps.0 + 4, "rank {rank} {kind}: maps {maps:?}");
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
    let role = "capture-registered";
    let ((pool, d), theirs) = in_processes(role, world, seed, |c| process_rank(c, seed));
    for (i, lines) in theirs.iter().enumerate() {
        let note = format!("rank {}: cudarc's buffers", i + 1);
        assert_eq!(tagged(lines, "POOL "), pool, "{note}");
        let note = format!("rank {}'s bits", i + 1);
        assert_eq!(tagged(lines, "DIGEST "), d.to_string(), "{note}");
    }
    eprintln!(
        "cuda_per_rank_capture_registered_processes world {world}: cuMemAlloc inputs read \
         in place across processes, 3 replays, bits equal on every rank; cudarc's \
         buffers {pool}"
    );
}
