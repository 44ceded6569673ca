//! The device API on the per-rank `Comm`: `device_comm` over symmetric and registered
//! buffers (its fields, and the typed error on every rank for a buffer that is neither,
//! or that differs on some rank), and, on the host backend, kernels of the engine's own
//! written against the host contract (`Comm::launch_host_kernel`): checked against an
//! f64 reference, interleaved with the library's collectives (the banks are apart), and
//! a rank that never launches its kernel is a `BarrierTimeout` naming it.

use peercomm::backend::host::{Host, HostBlock, Stopped};
use peercomm::backend::{Backend, TypedBuffer as _};
use peercomm::device::BarrierKind;
use peercomm::{Comm, Error, ReduceOp};

use super::agreement::short_waits;
use super::{common, in_step, with_world, Placement};

/// A symmetric buffer and a registered one give device communicators with this rank's
/// place, the group, the bytes and every member's buffer; the registered buffer's
/// members are where the peers mapped it.
pub fn device_comm_fields<B: Backend>(place: &Placement, world: usize) {
    with_world::<B, _>(place, world, |rank, comm| {
        let sym = comm.alloc_symmetric::<f32>(1000).unwrap();
        let d = comm.device_comm(&sym).unwrap();
        assert_eq!((d.group_rank(), d.group_width()), (rank, world));
        assert_eq!(d.buffer_bytes(), 4000);
        let own = peercomm::SymmetricBuffer::device_address(&sym);
        assert_eq!(
            d.peer_buffer(rank),
            Some(own),
            "rank {rank}: its own buffer"
        );
        for q in 0..world {
            assert!(
                d.peer_buffer(q).is_some_and(|a| a != 0),
                "rank {rank}: member {q}"
            );
        }
        assert_eq!(d.peer_buffer(world), None);
        // By address, the C struct: its first word is member 0's signal, and member
        // k's buffer follows the eight signals.
        let words = d.as_kernel_arg() as *const u64;
        // SAFETY: `d` is a #[repr(transparent)] peercomm_device_comm of 16+ u64 words.
        let buffer = unsafe { *words.add(8 + rank) };
        assert_eq!(buffer, own, "rank {rank}: the C layout's buffers[rank]");
        let plain = B::alloc_from(comm.device(), &vec![0u32; 64]).unwrap();
        let registered = comm.register(plain).unwrap();
        let d = comm.device_comm(&registered).unwrap();
        assert_eq!(d.buffer_bytes(), 256);
        assert!((0..world).all(|q| d.peer_buffer(q).is_some_and(|a| a != 0)));
        comm.synchronize().unwrap();
    });
}

/// A plain buffer on every rank, a plain buffer on rank 1 only, and symmetric buffers
/// at different offsets: `CannotRegister` on every rank, naming the rank that differs
/// (rank 1; for a plain buffer everywhere, rank 0, the first); afterwards a
/// `device_comm` over the same symmetric buffer works.
pub fn device_comm_refusals<B: Backend>(place: &Placement) {
    let world = 2;
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let plain = B::alloc_from(dev, &[0f32; 64]).unwrap();
        let named = |what: &str, got: peercomm::Result<_>, first: usize| match got {
            Err(Error::CannotRegister { rank: r, .. }) => assert_eq!(r, first, "{what}"),
            other => panic!("rank {rank}, {what}: {other:?}"),
        };
        named("plain everywhere", comm.device_comm(&plain), 0);
        let sym = comm.alloc_symmetric::<f32>(64).unwrap();
        let got = match rank {
            1 => comm.device_comm(&plain),
            _ => comm.device_comm(&sym),
        };
        named("plain on rank 1", got, 1);
        let other = comm.alloc_symmetric::<f32>(64).unwrap();
        let got = match rank {
            1 => comm.device_comm(&other),
            _ => comm.device_comm(&sym),
        };
        named("another symmetric buffer on rank 1", got, 1);
        assert!(
            comm.device_comm(&sym).is_ok(),
            "rank {rank}: the same buffer"
        );
        comm.synchronize().unwrap();
    });
}

/// Rank r's input of `n` f32 in round `round`.
fn input(seed: u64, round: usize, rank: usize, n: usize) -> Vec<f32> {
    super::inputs::<f32>(seed, round, rank + 1, n).swap_remove(rank)
}

/// A host kernel of an engine's own: every block takes a grid stride of the elements;
/// after a publishing barrier each rank's output is the sum of its two ring neighbours'
/// buffers, then an end barrier keeps the neighbours from writing their buffers again
/// before this rank has read them.
fn neighbours_sum(out: u64, n: usize) -> impl Fn(&HostBlock) -> Result<(), Stopped> {
    move |b| {
        let comm = b.comm();
        let (me, w) = (comm.group_rank(), comm.group_width());
        b.barrier(BarrierKind::Publish)?;
        let next = comm.peer_buffer((me + 1) % w).unwrap() as *const f32;
        let prev = comm.peer_buffer((me + w - 1) % w).unwrap() as *const f32;
        for i in (b.block() as usize..n).step_by(b.blocks() as usize) {
            // SAFETY: the peers' buffers hold `n` f32, written before their publishing
            // barrier and not again before the end barrier; `out` is this rank's
            // output of `n` f32, written by this block only at its stride.
            unsafe { *(out as *mut f32).add(i) = *next.add(i) + *prev.add(i) };
        }
        b.barrier(BarrierKind::End)
    }
}

/// The host contract (world `world`): rounds of a user kernel (three blocks, then five)
/// interleaved with the library's all-reduces on the same communicator, every output
/// checked against the f64 reference: the banks are apart, so neither disturbs the
/// other.
pub fn host_kernel_neighbours(place: &Placement, world: usize) {
    let seed = common::seed("host_kernel_neighbours");
    let n = 10_007;
    with_world::<Host, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let mut sym = comm.alloc_symmetric::<f32>(n).unwrap();
        let d = comm.device_comm(&sym).unwrap();
        for round in 0..4 {
            sym.copy_from_host(dev, &input(seed, round, rank, n))
                .unwrap();
            let mut out = Host::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
            let addr = out_address(&mut out);
            let blocks = [3, 5][round % 2];
            comm.launch_host_kernel(&d, blocks, neighbours_sum(addr, n))
                .unwrap();
            // A library collective between the user kernels.
            let ones = Host::alloc_from(dev, &vec![1.0f32; 257]).unwrap();
            let mut sum = Host::alloc_buffer::<f32>(dev, 257).unwrap();
            comm.all_reduce(&ones, &mut sum, &ReduceOp::Sum).unwrap();
            comm.synchronize().unwrap();
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let (a, b) = (input(seed, round, next, n), input(seed, round, prev, n));
            let got = Host::download(dev, &out).unwrap();
            for i in 0..n {
                let want = (f64::from(a[i]) + f64::from(b[i])) as f32;
                assert_eq!(
                    got[i].to_bits(),
                    want.to_bits(),
                    "rank {rank} round {round} [{i}]"
                );
            }
            let sums = Host::download(dev, &sum).unwrap();
            assert!(
                sums.iter().all(|&s| s == world as f32),
                "rank {rank}: the all-reduce"
            );
        }
    });
}

/// The address of a host buffer's first element.
fn out_address(out: &mut <Host as Backend>::Buffer<f32>) -> u64 {
    use peercomm::backend::DeviceBufferMut as _;
    let dev = Host::open(0).unwrap();
    out.write_ptr(&dev).0
}

/// Rank 1 never launches the user kernel: rank 0's synchronize is `BarrierTimeout`
/// naming rank 1 within twice the timeout; after `reinitialize` both launch it again
/// and it runs.
pub fn host_kernel_timeout(place: &Placement) {
    let config = short_waits(place, 2);
    let timeout = config.barrier_timeout.unwrap();
    let results = in_step::<Host, _>(place, 2, &config, |rank, comm: &Comm<Host>, meet| {
        let dev = comm.device();
        let n = 64;
        let mut sym = comm.alloc_symmetric::<f32>(n).unwrap();
        sym.copy_from_host(dev, &vec![rank as f32; n]).unwrap();
        let d = comm.device_comm(&sym).unwrap();
        let mut out = Host::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        let addr = out_address(&mut out);
        let start = std::time::Instant::now();
        let got = match rank {
            0 => comm
                .launch_host_kernel(&d, 2, neighbours_sum(addr, n))
                .and_then(|()| comm.synchronize()),
            _ => Ok(()),
        };
        let took = start.elapsed();
        meet.wait();
        comm.reinitialize().unwrap();
        comm.launch_host_kernel(&d, 2, neighbours_sum(addr, n))
            .unwrap();
        comm.synchronize().unwrap();
        let other = (1 - rank) as f32;
        assert_eq!(
            Host::download(dev, &out).unwrap(),
            vec![2.0 * other; n],
            "rank {rank}"
        );
        (got, took)
    });
    match &results[0].0 {
        Err(Error::BarrierTimeout { waiting_for, .. }) => assert_eq!(*waiting_for, Some(1)),
        other => panic!("rank 0: {other:?}, not a timeout waiting for rank 1"),
    }
    let took = results[0].1;
    assert!(
        took < 2 * timeout + std::time::Duration::from_secs(2),
        "took {took:?}"
    );
}

/// The single controller's device communicators (world 3): one per rank over the
/// engine's buffers, the host kernel launched on every rank and checked against the
/// f64 reference; a wrong count or another length is an error, nothing launched.
pub fn single_controller_host_kernel(place: &Placement) {
    let world = 3;
    let seed = common::seed("single_controller_host_kernel");
    let n = 5003;
    let ordinals: Vec<usize> = (0..world).map(|r| place.ordinal(r)).collect();
    let comm = peercomm::SingleController::<Host>::new(&ordinals, place.config(world)).unwrap();
    let ins: Vec<_> = (0..world)
        .map(|r| Host::alloc_from(comm.core(r).device(), &input(seed, 0, r, n)).unwrap())
        .collect();
    let mut outs: Vec<_> = (0..world)
        .map(|r| Host::alloc_from(comm.core(r).device(), &vec![f32::NAN; n]).unwrap())
        .collect();
    let views: Vec<&dyn peercomm::backend::DeviceBuffer<Host>> = ins
        .iter()
        .map(|b| b as &dyn peercomm::backend::DeviceBuffer<Host>)
        .collect();
    assert!(matches!(
        comm.device_comms(&views[..2]),
        Err(Error::LengthMismatch { .. })
    ));
    let short = Host::alloc_from(comm.core(2).device(), &vec![0f32; n - 1]).unwrap();
    let mut uneven = views.clone();
    uneven[2] = &short;
    assert!(matches!(
        comm.device_comms(&uneven),
        Err(Error::LengthMismatch { rank: 2, .. })
    ));
    let comms = comm.device_comms(&views).unwrap();
    assert_eq!(comms.len(), world);
    // One kernel for every rank: each block finds its rank's output in a table.
    let outs_at: Vec<u64> = outs
        .iter_mut()
        .enumerate()
        .map(|(r, o)| {
            use peercomm::backend::DeviceBufferMut as _;
            o.write_ptr(comm.core(r).device()).0
        })
        .collect();
    let kernel = move |b: &HostBlock| neighbours_sum(outs_at[b.comm().group_rank()], n)(b);
    comm.launch_host_kernels(&comms, 2, kernel).unwrap();
    comm.synchronize().unwrap();
    for (r, out) in outs.iter().enumerate() {
        let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
        let (a, b) = (input(seed, 0, next, n), input(seed, 0, prev, n));
        let got = Host::download(comm.core(r).device(), out).unwrap();
        for i in 0..n {
            let want = (f64::from(a[i]) + f64::from(b[i])) as f32;
            assert_eq!(got[i].to_bits(), want.to_bits(), "rank {r} [{i}]");
        }
    }
}

/// The grid barrier of the host contract (world `world`, four blocks, three rounds):
/// each block writes its quarter of this rank's symmetric buffer, then after the grid
/// barrier reads the quarter another block of the next rank wrote, which only a barrier
/// over every block of every rank orders; each round's values differ, so a stale read
/// shows.
pub fn host_grid_barrier(place: &Placement, world: usize) {
    let n = 4 * 1024;
    with_world::<Host, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let sym = comm.alloc_symmetric::<f32>(n).unwrap();
        let d = comm.device_comm(&sym).unwrap();
        let mut out = Host::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        let out_at = out_address(&mut out);
        for round in 0..3u32 {
            let kernel = move |b: &HostBlock| -> Result<(), Stopped> {
                let comm = b.comm();
                let (me, w) = (comm.group_rank(), comm.group_width());
                let quarter = n / b.blocks() as usize;
                let mine = comm.peer_buffer(me).unwrap() as *mut f32;
                let first = b.block() as usize * quarter;
                // Higher blocks write later.
                std::thread::sleep(std::time::Duration::from_millis(20 * b.block() as u64));
                for i in first..first + quarter {
                    // SAFETY: this block's quarter of this rank's buffer.
                    unsafe { *mine.add(i) = (round * 1000) as f32 + (me * n + i) as f32 };
                }
                b.grid_barrier(BarrierKind::Publish)?;
                let next = comm.peer_buffer((me + 1) % w).unwrap() as *const f32;
                let other = (b.block() as usize + 1) % b.blocks() as usize * quarter;
                for k in 0..quarter {
                    // SAFETY: the next rank's buffer, written before its grid barrier,
                    // not again before the next one; `out` is this rank's, this
                    // block's quarter.
                    unsafe { *(out_at as *mut f32).add(first + k) = *next.add(other + k) };
                }
                b.grid_barrier(BarrierKind::End)
            };
            comm.launch_host_kernel(&d, 4, kernel).unwrap();
            comm.synchronize().unwrap();
            let got = Host::download(dev, &out).unwrap();
            let next = (rank + 1) % world;
            for (i, g) in got.iter().enumerate() {
                let (q, k) = (i / (n / 4), i % (n / 4));
                let j = (q + 1) % 4 * (n / 4) + k;
                let want = (round * 1000) as f32 + (next * n + j) as f32;
                assert_eq!(*g, want, "rank {rank} round {round} [{i}]");
            }
        }
    });
}

/// A grid barrier that rank 1 never reaches (four blocks): rank 0's record names rank
/// 1, not one of its own blocks (which wait for block 0 twice as long); after
/// `reinitialize` both pass it.
pub fn host_grid_barrier_timeout(place: &Placement) {
    let config = short_waits(place, 2);
    let grid = |b: &HostBlock| -> Result<(), Stopped> { b.grid_barrier(BarrierKind::Publish) };
    let results = in_step::<Host, _>(place, 2, &config, |rank, comm: &Comm<Host>, meet| {
        let sym = comm.alloc_symmetric::<f32>(64).unwrap();
        let d = comm.device_comm(&sym).unwrap();
        let got = match rank {
            0 => comm
                .launch_host_kernel(&d, 4, grid)
                .and_then(|()| comm.synchronize()),
            _ => Ok(()),
        };
        meet.wait();
        comm.reinitialize().unwrap();
        comm.launch_host_kernel(&d, 4, grid).unwrap();
        comm.synchronize().unwrap();
        got
    });
    match &results[0] {
        Err(Error::BarrierTimeout { waiting_for, .. }) => {
            assert_eq!(*waiting_for, Some(1), "{:?}", results[0])
        }
        other => panic!("rank 0: {other:?}, not a timeout waiting for rank 1"),
    }
}
