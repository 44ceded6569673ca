//! Zero-copy refusals: registrations that differ between ranks are typed errors on
//! every rank with nothing registered; inputs whose places differ are `CallMismatch`
//! on `Inputs`.

use peercomm::backend::{Backend, DeviceBuffer, TypedBuffer};
use peercomm::bootstrap::BootstrapError::ExchangeMismatch;
use peercomm::{
    Algorithm, AllReduceOptions, CallField, CollectiveOptions, Comm, Element, Error, ReduceOp,
};

use super::super::common::View;
use super::super::{agreement, in_step, nan, Placement};

/// Asserts `r` is a refused registration: `CannotRegister` (naming `rank` where given),
/// with the buffer given back unchanged.
fn refused<B: Backend, T: DeviceBuffer<B>>(
    r: Result<peercomm::Registered<B, T>, peercomm::RegisterError<T>>,
    named: Option<usize>,
    what: &str,
) -> T {
    match r {
        Err(peercomm::RegisterError {
            error: Error::CannotRegister { rank, reason },
            buffer,
            ..
        }) => {
            if let Some(n) = named {
                assert_eq!(rank, n, "{what}: {reason}");
            }
            assert!(!reason.contains("  "), "{what}: stray spaces: {reason}");
            buffer
        }
        Err(e) => panic!("{what}: {e:?}, not CannotRegister"),
        Ok(_) => panic!("{what}: registered"),
    }
}

fn refused_alloc<B: Backend, T: Element>(
    r: peercomm::Result<peercomm::SymmetricBuffer<B, T>>,
    what: &str,
) {
    let refused = matches!(r, Err(Error::CannotRegister { .. }));
    assert!(refused, "{what}: {r:?}, not CannotRegister");
}

/// Case (b), refusals: different sizes, allocations after different drops, and a
/// registration against an allocation are refused on every rank (buffers come back
/// unchanged); a buffer on the wrong device is `WrongDevice` there, `CannotRegister`
/// elsewhere. Nothing registered, ranks in step (a refusing rank still joins the
/// gather), matching calls work after.
pub fn registration_refusals<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world);
    let odd = world - 1;
    in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let dev = comm.device();
        let none = (0, 0);
        // Sizes that differ: every rank names the odd one (it differs from rank 0).
        let len = if rank == odd { 65 } else { 64 };
        let data: Vec<f32> = (0..len).map(|i| i as f32 + rank as f32).collect();
        let what = format!("rank {rank}: registered sizes differ");
        let registered = comm.register(B::alloc_from(dev, &data).unwrap());
        let back = refused(registered, Some(odd), &what);

        let note = "the buffer comes back";
        assert_eq!(B::download(dev, &back).unwrap(), data, "{note}");
        assert_eq!(comm.registrations(), none);
        // A buffer on another device than the rank's (where the backend has another):
        // that rank's own error there, CannotRegister naming it on the others.
        if place.devices > 1 {
            let elsewhere = B::open((place.ordinal(rank) + 1) % place.devices).unwrap();
            let good = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
            let what = format!("rank {rank}: a peer's buffer is on another device");
            if rank == odd {
                let wrong = B::alloc_from(&elsewhere, &[1.0f32; 64]).unwrap();
                let got = comm.register(wrong).map(drop).map_err(|e| e.error);
                let wrong_device = matches!(got, Err(Error::WrongDevice { .. }));
                assert!(wrong_device, "{what}: {got:?}");
            } else {
                refused(comm.register(good), Some(odd), &what);
            }
            assert_eq!(comm.registrations(), none);
        }
        // Symmetric allocations of different sizes: no segment is made.
        let len = if rank == odd { 300 } else { 200 };
        let what = format!("rank {rank}: symmetric sizes differ");
        refused_alloc(comm.alloc_symmetric::<f32>(len), &what);
        assert_eq!(comm.registrations(), none, "no segment made");
        // A registration where a peer allocates a symmetric buffer: two different
        // collective calls, the bootstrap's exchange mismatch on every rank.
        let plain = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
        let got = if rank == odd {
            comm.alloc_symmetric::<f32>(64).map(drop)
        } else {
            comm.register(plain).map(drop).map_err(|e| e.error)
        };
        let mismatch = matches!(got, Err(Error::Bootstrap(ExchangeMismatch { .. })));
        let what = "registers or allocates where a peer does the other";
        assert!(mismatch, "rank {rank}: {what}: {got:?}");
        assert_eq!(comm.registrations(), none);
        // Matching allocations work; drops in different orders make the next
        // placement differ.
        let a = comm.alloc_symmetric::<f32>(64).unwrap();
        let b = comm.alloc_symmetric::<f32>(64).unwrap();
        assert_eq!(comm.registrations(), (1, 0), "one segment");
        let (pa, pb) = (a.placement(), b.placement());
        assert_ne!(pa, pb);
        if rank == odd {
            drop(b);
        } else {
            drop(a);
        }
        let what = format!("rank {rank}: dropped in another order");
        refused_alloc(comm.alloc_symmetric::<f32>(64), &what);
        assert_eq!(comm.registrations(), (1, 0), "still the one segment");
        meet.wait();
        // Matching calls still work: a registration and an all-reduce on it.
        let mine = B::alloc_from(dev, &[rank as f32 + 1.0; 100]).unwrap();
        let mut buf = comm.register(mine).unwrap();
        assert_eq!(comm.registrations(), (2, 0));
        comm.all_reduce_in_place_with(&mut buf, &ReduceOp::Sum, &AllReduceOptions::new())
            .unwrap();
        comm.synchronize().unwrap();
        let want = (world * (world + 1) / 2) as f32;
        assert_eq!(B::download(dev, &buf).unwrap(), vec![want; 100]);
        let plain = buf.into_inner();
        assert_eq!(comm.registrations(), (1, 0));
        assert_eq!(B::download(dev, &plain).unwrap(), vec![want; 100]);
    });
}

/// Asserts `got` is this rank's `CallMismatch` on `Inputs`, naming `odd` (on `odd`:
/// another rank).
fn assert_inputs_mismatch(got: &peercomm::Result<()>, rank: usize, odd: usize, what: &str) {
    match got {
        Err(Error::CallMismatch {
            rank: r,
            peer,
            field: CallField::Inputs,
            ..
        }) => {
            assert_eq!(*r, rank, "{what}");
            assert_eq!(*peer == odd, rank != odd, "{what}: peer {peer}");
        }
        other => panic!("{what}: {other:?}, not CallMismatch(Inputs)"),
    }
}

/// What one rank passes in a mismatched-inputs case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// Its registered buffer.
    Registered,
    /// A plain (unregistered) buffer of the same size.
    Plain,
    /// Its first symmetric buffer.
    FirstSymmetric,
    /// Its second symmetric buffer (another registered place).
    SecondSymmetric,
}

/// The collective of a mismatched-inputs case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    OneStage,
    AllGather,
    ReduceScatter,
    Fused,
}

/// One call of `call` from the input `pass` names (every rank's input holds
/// `rank + 1`), output poisoned: when it fails, the output (and the fused call's
/// residual) is checked untouched; when it succeeds, right.
fn mismatch_call<B: Backend>(
    comm: &Comm<B>,
    call: Call,
    pass: Pass,
    registered: &peercomm::Registered<B, B::Buffer<half::bf16>>,
    plain: &B::Buffer<half::bf16>,
    symmetric: &[peercomm::SymmetricBuffer<B, half::bf16>; 2],
) -> peercomm::Result<()> {
    let dev = comm.device();
    let world = comm.world_size();
    let input: &dyn DeviceBuffer<B> = match pass {
        Pass::Registered => registered,
        Pass::Plain => plain,
        Pass::FirstSymmetric => &symmetric[0],
        Pass::SecondSymmetric => &symmetric[1],
    };
    let n = input.len();
    let out_len = match call {
        Call::AllGather => n * world,
        Call::ReduceScatter => peercomm::reduce_scatter_part(n, world, comm.rank()).len(),
        Call::OneStage | Call::Fused => n,
    };
    let mut out = B::alloc_from(dev, &nan::<half::bf16>(out_len))?;
    let opts = CollectiveOptions::new().algorithm(Algorithm::OneStage);
    let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
    let mut res = B::alloc_from(dev, &vec![half::bf16::ONE; n])?;
    let weight = B::alloc_from(dev, &vec![half::bf16::ONE; 1024])?;
    match call {
        Call::OneStage => comm
            .all_reduce_with(input, &mut out, &ReduceOp::Sum, &one)
            .map(drop),
        Call::AllGather => comm.all_gather_with(input, &mut out, &opts),
        Call::ReduceScatter => comm.reduce_scatter_with(input, &mut out, &ReduceOp::Sum, &opts),
        Call::Fused => {
            comm.all_reduce_residual_rms_norm(input, &mut res, &weight, &mut out, 1e-5, &opts)
        }
    }?;
    let result = comm.synchronize();
    let host = B::download(dev, &out)?;
    let r = B::download(dev, &res)?;
    let bf = |x: usize| half::bf16::from_f32(x as f32);
    let sum = bf(world * (world + 1) / 2);
    if result.is_err() {
        let out_untouched = host.iter().all(|x| x.is_nan());
        assert!(out_untouched, "a mismatched call wrote its output");
        let res_untouched = r.iter().all(|&x| x == half::bf16::ONE);
        assert!(res_untouched, "a mismatched call wrote its residual");
        return result;
    }
    match call {
        Call::OneStage | Call::ReduceScatter => {
            assert!(host.iter().all(|&x| x == sum), "{call:?}: a wrong sum")
        }
        Call::AllGather => {
            for (q, part) in host.chunks(n).enumerate() {
                assert!(part.iter().all(|&x| x == bf(q + 1)), "all-gather part {q}");
            }
        }
        Call::Fused => {
            // Every row holds one value: the new residual is 1 + the sum, the output
            // (unit weight) 1 up to epsilon.
            assert!(r.iter().all(|&x| x == bf(1) + sum), "fused residual");
            let ones = host.iter().all(|&x| (x.to_f32() - 1.0).abs() < 1e-2);
            assert!(ones, "fused output");
        }
    }
    result
}

/// Case (b), places that differ (a plain input among registered ones, a symmetric input
/// elsewhere) for all-reduce, all-gather, reduce-scatter and fused: `CallMismatch` on
/// `Inputs` everywhere, nothing written, `reinitialize` recovers. Lamport reads no peer
/// input, so a plain input there is fine.
pub fn mismatched_inputs<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world);
    let odd = world - 1;
    let n = 4096;
    let cases = [
        (Call::OneStage, Pass::Registered, Pass::Plain),
        (Call::OneStage, Pass::Plain, Pass::Registered),
        (Call::OneStage, Pass::FirstSymmetric, Pass::SecondSymmetric),
        (Call::OneStage, Pass::FirstSymmetric, Pass::Registered),
        (Call::AllGather, Pass::Registered, Pass::Plain),
        (
            Call::ReduceScatter,
            Pass::FirstSymmetric,
            Pass::SecondSymmetric,
        ),
        (Call::Fused, Pass::FirstSymmetric, Pass::Plain),
    ];
    in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let dev = comm.device();
        let ones = vec![half::bf16::from_f32(rank as f32 + 1.0); n];
        let registered = comm.register(B::alloc_from(dev, &ones).unwrap()).unwrap();
        let plain = B::alloc_from(dev, &ones).unwrap();
        let mut symmetric = [
            comm.alloc_symmetric::<half::bf16>(n).unwrap(),
            comm.alloc_symmetric::<half::bf16>(n).unwrap(),
        ];
        for s in symmetric.iter_mut() {
            s.copy_from_host(dev, &ones).unwrap();
        }
        for &(call, usual, other) in &cases {
            let what = format!("rank {rank}: {call:?}, {usual:?} against {other:?}");
            let pass = if rank == odd { other } else { usual };
            let got = mismatch_call(comm, call, pass, &registered, &plain, &symmetric);
            assert_inputs_mismatch(&got, rank, odd, &what);
            meet.wait();
            comm.reinitialize().unwrap();
            // A matching call works again.
            mismatch_call(comm, call, usual, &registered, &plain, &symmetric)
                .unwrap_or_else(|e| panic!("{what}: the matching call after: {e}"));
        }
        // Lamport pushes every rank's input into the peers' slots: a plain input on
        // one rank beside registered ones is the same call, and the sum is right.
        let pass: &dyn DeviceBuffer<B> = if rank == odd { &plain } else { &*registered };
        let mut out = B::alloc_from(dev, &nan::<half::bf16>(n)).unwrap();
        let opts = AllReduceOptions::new().algorithm(Algorithm::Lamport);
        comm.all_reduce_with(pass, &mut out, &ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
        let want = half::bf16::from_f32((world * (world + 1) / 2) as f32);
        assert!(B::download(dev, &out).unwrap().iter().all(|&x| x == want));
    });
}

/// Places are compared exactly: every rank's input a window of one registered buffer,
/// the last rank's at another offset (0 against 39,328 bytes confuses any narrower
/// digest; every other offset too): `CallMismatch` on `Inputs` everywhere, output
/// untouched.
pub fn places_compared_exactly<B: Backend>(place: &Placement, world: usize) {
    let config = agreement::short_waits(place, world);
    let odd = world - 1;
    let n = 256;
    let far = 39_328 / 2; // bf16 elements
    let offsets = [(0, far), (far, 0), (0, n), (n, 3 * n), (16, 0)];
    in_step::<B, _>(place, world, &config, |rank, comm, meet| {
        let dev = comm.device();
        // Every window holds a value of its own, so a sum over the wrong window shows.
        let values: Vec<half::bf16> = (0..far + 4 * n)
            .map(|e| half::bf16::from_f32((rank + 1) as f32 * if e < far { 1.0 } else { 100.0 }))
            .collect();
        let registered = comm.register(B::alloc_from(dev, &values).unwrap()).unwrap();
        for &(usual, other) in &offsets {
            let what = format!("rank {rank}: window at {usual} against {other}");
            let at = if rank == odd { other } else { usual };
            let input = View::elements(&*registered, at, n);
            let mut out = B::alloc_from(dev, &nan::<half::bf16>(n)).unwrap();
            let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
            comm.all_reduce_with(&input, &mut out, &ReduceOp::Sum, &opts)
                .unwrap();
            let got = comm.synchronize();
            let host = B::download(dev, &out).unwrap();
            let wrong = host.iter().filter(|x| !x.is_nan()).count();
            assert_inputs_mismatch(&got, rank, odd, &format!("{what}, {wrong}/{n} written"));
            assert_eq!(wrong, 0, "{what}: a mismatched call wrote its output");
            meet.wait();
            comm.reinitialize().unwrap();
        }
    });
}
