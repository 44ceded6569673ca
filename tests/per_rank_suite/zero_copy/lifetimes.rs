//! Zero-copy lifetimes: inputs dropped in flight stay valid until the peers are done,
//! no registration or fd leaks, dropped symmetric ranges are reused.

use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer, TypedBuffer};
use peercomm::{Algorithm, AllReduceOptions, DType, Error, ReduceOp};

use super::super::common;
use super::super::{in_step, inputs, nan, seed, with_world, Placement};
use super::Input;

/// Case (c), inputs dropped in flight (one- or two-stage, symmetric or registered), the
/// freed range refilled with NaN at once: outputs stay right, as ranges are reused only
/// after the end barrier and registered buffers are freed in stream order.
pub fn inputs_dropped_in_flight<B: Backend>(place: &Placement, world: usize) {
    let seed = seed(&format!("per_rank_zero_copy_inputs_dropped_{world}"));
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let len = 65_537;
        let mut case = 0;
        for algorithm in [Algorithm::OneStage, Algorithm::TwoStage] {
            for input in [Input::Symmetric, Input::Registered] {
                let what = format!("rank {rank}: {algorithm:?} from a dropped {input:?} input");
                let ins = inputs::<f32>(seed, case, world, len);
                case += 1;
                let opts = AllReduceOptions::new().algorithm(algorithm).blocks(2);
                let mut out = B::alloc_from(dev, &nan::<f32>(len)).unwrap();
                match input {
                    Input::Symmetric => {
                        let mut s = comm.alloc_symmetric::<f32>(len).unwrap();
                        s.copy_from_host(dev, &ins[rank]).unwrap();
                        let at = s.placement();
                        comm.all_reduce_with(&s, &mut out, &ReduceOp::Sum, &opts)
                            .expect(&what);
                        drop(s);
                        let mut next = comm.alloc_symmetric::<f32>(len).unwrap();
                        assert_eq!(next.placement(), at, "{what}: the range is reused");
                        next.copy_from_host(dev, &nan::<f32>(len)).unwrap();
                    }
                    Input::Registered => {
                        let plain = B::alloc_from(dev, &ins[rank]).unwrap();
                        let reg = comm.register(plain).unwrap();
                        comm.all_reduce_with(&reg, &mut out, &ReduceOp::Sum, &opts)
                            .unwrap();
                        drop(reg);
                    }
                }
                comm.synchronize().expect(&what);
                let got = B::download(dev, &out).unwrap();
                common::check_sums(&ins, &vec![got; world], world, &what);
                assert_eq!(comm.registrations(), (1, 0), "{what}");
            }
        }
    });
}

/// A buffer that says when it is dropped (its memory freed).
struct Tracked<R> {
    inner: R,
    freed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<R> Drop for Tracked<R> {
    fn drop(&mut self) {
        self.freed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

// SAFETY: every answer is the inner buffer's.
unsafe impl<B: Backend, R: DeviceBuffer<B>> DeviceBuffer<B> for Tracked<R> {
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn device_ordinal(&self) -> usize {
        self.inner.device_ordinal()
    }
    fn read_ptr<'a>(&'a self, dev: &'a B::Device) -> (u64, B::Access<'a>) {
        self.inner.read_ptr(dev)
    }
}

/// A registered input dropped right after its call is kept until the peers are done:
/// on a timeout until `reinitialize`, else until the synchronize; one dropped after a
/// clean synchronize is freed at once.
pub fn registered_input_retired_in_flight<B: Backend>(place: &Placement) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let timeout = Duration::from_millis(400);
    let config = place.config(2).with_barrier_timeout(Some(timeout));
    in_step::<B, _>(place, 2, &config, |rank, comm, meet| {
        let dev = comm.device();
        let len = 4099;
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        let opts = opts.blocks(2);
        let register = |value: f32| {
            let freed = Arc::new(AtomicBool::new(false));
            let inner = B::alloc_from(dev, &vec![value; len]);
            let tracked = Tracked {
                inner: inner.unwrap(),
                freed: freed.clone(),
            };
            (comm.register(tracked).unwrap(), freed)
        };
        let freed = |f: &AtomicBool| f.load(Ordering::SeqCst);
        let mut out = B::alloc_from(dev, &nan::<f32>(len)).unwrap();

        // The call times out: rank 1 misses it.
        let (reg, flag) = register(1.0);
        if rank == 1 {
            comm.miss_next();
        }
        comm.all_reduce_with(&reg, &mut out, &ReduceOp::Sum, &opts)
            .unwrap();
        drop(reg);
        assert!(!freed(&flag), "rank {rank}: freed in flight");
        if rank == 0 {
            let e = comm.synchronize().expect_err("rank 0: the call timed out");
            assert!(matches!(e, Error::BarrierTimeout { .. }), "rank 0: {e:?}");
        }
        // Rank 1 reads the abort once rank 0 has sent it.
        meet.wait();
        if rank == 1 {
            let e = comm.synchronize().expect_err("rank 1: its peer gave up");
            assert!(matches!(e, Error::PeerAborted { .. }), "rank 1: {e:?}");
        }
        assert!(!freed(&flag), "rank {rank}: freed by a failed synchronize");
        comm.reinitialize().unwrap();
        assert!(freed(&flag), "rank {rank}: kept past reinitialize");

        // The call completes; the input is dropped before the synchronize.
        let (reg, flag) = register(rank as f32 + 1.0);
        comm.all_reduce_with(&reg, &mut out, &ReduceOp::Sum, &opts)
            .unwrap();
        drop(reg);
        assert!(!freed(&flag), "rank {rank}: freed in flight");
        comm.synchronize().unwrap();
        assert!(freed(&flag), "rank {rank}: kept past a clean synchronize");
        assert_eq!(B::download(dev, &out).unwrap(), vec![3.0f32; len]);

        // Dropped after a clean synchronize: freed at once.
        let (reg, flag) = register(1.0);
        comm.all_reduce_with(&reg, &mut out, &ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
        drop(reg);
        assert!(freed(&flag), "rank {rank}: kept with nothing in flight");
        assert_eq!(comm.registrations(), (0, 0), "rank {rank}");
    });
}

/// Open file descriptors of this process (Linux; `None` elsewhere).
fn open_fds() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

/// Case (c), registrations: `cycles` register/drop cycles (some via `into_inner`, some
/// used) keep `registrations()` and open fds flat on every rank (loose bound: other
/// tests run beside; `cycles_leak_nothing` counts exactly).
pub fn register_drop_cycles<B: Backend>(place: &Placement, world: usize, cycles: usize) {
    let fds = open_fds();
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let start = comm.registrations();
        assert_eq!(start, (0, 0));
        for cycle in 0..cycles {
            let data = [rank as f32 + cycle as f32; 16];
            let mut reg = comm.register(B::alloc_from(dev, &data).unwrap()).unwrap();
            assert_eq!(comm.registrations(), (1, 0));
            if cycle % 100 == 0 {
                comm.all_reduce_in_place_with(&mut reg, &ReduceOp::Sum, &AllReduceOptions::new())
                    .unwrap();
                comm.synchronize().unwrap();
                let want = (0..world).map(|r| r as f32 + cycle as f32).sum::<f32>();
                assert_eq!(B::download(dev, &reg).unwrap(), vec![want; 16]);
            }
            if cycle % 2 == 0 {
                let back = reg.into_inner();
                assert_eq!(B::download(dev, &back).unwrap().len(), 16);
            } else {
                drop(reg);
            }
            assert_eq!(comm.registrations(), start, "cycle {cycle}");
        }
    });
    check_fds(fds, cycles, "register/drop");
}

/// Case (c), symmetric buffers: a dropped range is the next same-size allocation's, and
/// `cycles` alloc/drop cycles keep one segment and no fd per cycle.
pub fn symmetric_drop_cycles<B: Backend>(place: &Placement, world: usize, cycles: usize) {
    let fds = open_fds();
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        assert_eq!(comm.registrations(), (0, 0));
        let a = comm.alloc_symmetric::<f32>(16).unwrap();
        let b = comm.alloc_symmetric::<half::bf16>(100).unwrap();
        let start = comm.registrations();
        assert_eq!(start, (1, 0), "one segment");
        let (pa, pb) = (a.placement(), b.placement());
        assert_eq!(pa.0, pb.0, "one segment");
        assert_ne!(pa.1, pb.1);
        drop(b);
        let c = comm.alloc_symmetric::<half::bf16>(100).unwrap();
        assert_eq!(c.placement(), pb, "the dropped range is reused");
        drop(a);
        for cycle in 0..cycles {
            let mut s = comm.alloc_symmetric::<f32>(16).unwrap();
            let note = format!("cycle {cycle}: the dropped range is reused");
            assert_eq!(s.placement(), pa, "{note}");
            if cycle % 100 == 0 {
                s.copy_from_host(dev, &[rank as f32 + 1.0; 16]).unwrap();
                comm.all_reduce_in_place_with(&mut s, &ReduceOp::Sum, &AllReduceOptions::new())
                    .unwrap();
                comm.synchronize().unwrap();
                let want = (world * (world + 1) / 2) as f32;
                assert_eq!(s.to_host(dev).unwrap(), vec![want; 16]);
            }
            drop(s);
            assert_eq!(comm.registrations(), start, "cycle {cycle}");
        }
        drop(c);
        // A buffer larger than a segment gets a segment of its own (rounded up to
        // 2 MiB), reused after its drop like any range.
        let len = peercomm::SYMMETRIC_SEGMENT_BYTES / 4 + 1;
        let big = comm.alloc_symmetric::<f32>(len).unwrap();
        assert_eq!(big.placement(), (pa.0 + 1, 0), "a segment of its own");
        assert_eq!(comm.registrations(), (2, 0));
        let at = big.placement();
        drop(big);
        let big = comm.alloc_symmetric::<f32>(len).unwrap();
        assert_eq!(big.placement(), at, "reused");
        drop(big);
        assert_eq!(comm.registrations(), (2, 0), "the pool keeps its segments");
    });
    check_fds(fds, cycles, "symmetric alloc/drop");
}

/// The descriptor bound of the in-process cycles (see `register_drop_cycles`).
fn check_fds(before: Option<usize>, cycles: usize, what: &str) {
    if let (Some(before), Some(after)) = (before, open_fds()) {
        eprintln!("{what}: {cycles} cycles, open fds {before} -> {after}");
        let flat = after < before + cycles / 4;
        assert!(flat, "{what}: open fds {before} -> {after}");
    }
}
