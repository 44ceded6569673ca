//! Reduction operators ([`ReduceOp`]) on the per-rank path: every operator over every
//! element type (`Avg` over the floats), out of place and in place, one-stage and
//! `Auto`, over the world and over pairs, in all-reduces, reduce-scatters, reduces and
//! groups, against the f64 reference (`Max` and `Min` bit for bit, with their rules for
//! the sign of zero and NaN; f64 and the integers bit for bit, the integers wrapping);
//! the same bits on every rank of a group and every algorithm, Lamport's under skewed
//! ranks included; `Avg` over an integer refused; another operator or element type on
//! one rank a typed error on every rank.

use std::time::Duration;

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{
    reduce_scatter_part, Algorithm, AllReduceOptions, CollectiveOptions, Comm, DType, Element,
    Error, ReduceOp,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::agreement::{every_rank_mismatched, short_waits, Call, Case};
use super::{common, with_world, Placement};

/// A NaN that no operator stores (0xa5 bytes for the integers): what an output holds
/// before the call writes it.
fn poison<T: Element>() -> T {
    match T::DTYPE {
        DType::F32 => T::from_bits_u32(0x7fa0_0001),
        DType::F16 => T::from_bits_u32(0x7d01),
        DType::BF16 => T::from_bits_u32(0x7fa1),
        _ => common::poison::<T>(),
    }
}

/// Whether `op`'s inputs hold NaNs (whose results `Prod`, `Max` and `Min` define).
fn nans(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Prod | ReduceOp::Max | ReduceOp::Min)
}

/// Every rank's input of one call: magnitudes in [0.5, 2) (a product over 8 ranks stays
/// normal) of either sign; every 13th element a zero of a random sign on every rank; with
/// `nans`, every 17th element a NaN (not the canonical one) on one rank. Integers: any
/// bits (sums and products wrap), every 13th element zero, every 11th the type's
/// extremes.
fn inputs<T: Element>(seed: u64, world: usize, n: usize, nans: bool) -> Vec<Vec<T>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let odd_nan = f32::from_bits(0xffc0_1234);
    let odd_nan_f64 = f64::from_bits(0xfff0_0000_0000_1234);
    (0..world)
        .map(|r| {
            (0..n)
                .map(|e| {
                    if !T::DTYPE.is_float() {
                        return match e {
                            _ if e % 13 == 0 => T::from_bits_u64(0),
                            _ if e % 11 == 0 => T::from_f64([-1e30, 1e30][(e + r) % 2]),
                            _ => T::from_bits_u64(rng.random()),
                        };
                    }
                    let sign: f32 = if rng.random::<bool>() { 1.0 } else { -1.0 };
                    if T::DTYPE == DType::F64 {
                        let sign = f64::from(sign);
                        return T::from_f64(match e {
                            _ if nans && e % 17 == 5 && e % world == r => odd_nan_f64,
                            _ if e % 13 == 0 => sign * 0.0,
                            _ => sign * rng.random_range(0.5f64..2.0),
                        });
                    }
                    let x = match e {
                        _ if nans && e % 17 == 5 && e % world == r => odd_nan,
                        _ if e % 13 == 0 => sign * 0.0,
                        _ => sign * rng.random_range(0.5f32..2.0),
                    };
                    T::from_f32(x)
                })
                .collect()
        })
        .collect()
}

/// The lengths the operators are checked at: odd ones (tails), and more for the types
/// every kernel takes.
fn lengths<T: Element>() -> &'static [usize] {
    match common::every_kernel(T::DTYPE) {
        true => &[1, 7, 1000, 4099],
        false => &[7, 4099],
    }
}

/// Every operator over every element type, out of place and in place, one-stage and
/// `Auto`, whole world and pairs (where the world splits), all-reduce and
/// reduce-scatter; each rank checks each output, `Auto` and one-stage agree bit for
/// bit, and so do the ranks of each group.
pub fn operators_checked<B: Backend>(place: &Placement, world: usize) {
    for dtype in DType::ALL {
        by_dtype!(dtype, operators_of::<B>(place, world));
    }
}

fn operators_of<B: Backend, T: Element>(place: &Placement, world: usize) {
    let seed = common::seed("per_rank_operators");
    let groups: &[usize] = if world > 2 && world.is_multiple_of(2) {
        &[0, 2]
    } else {
        &[0]
    };
    // Per rank: (group width, digest of the all-reduce's bits) of each call.
    let results = with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let mut digests = Vec::new();
        for op in ReduceOp::ALL.into_iter().filter(|o| takes(*o, T::DTYPE)) {
            for &n in lengths::<T>() {
                for &group_size in groups {
                    let width = if group_size == 0 { world } else { group_size };
                    let members = rank / width * width..(rank / width + 1) * width;
                    let ins = inputs::<T>(seed ^ digests.len() as u64, world, n, nans(op));
                    let group: Vec<&Vec<T>> = ins[members].iter().collect();
                    let what = format!(
                        "{} world {world} rank {rank}, {n} elements, groups of {width}",
                        T::DTYPE.name()
                    );
                    let mut first: Option<Vec<u64>> = None;
                    for algorithm in [Algorithm::Auto, Algorithm::OneStage] {
                        let opts = AllReduceOptions::new()
                            .group_size(group_size)
                            .algorithm(algorithm);
                        for in_place in [false, true] {
                            let got = all_reduce(&comm, &ins[rank], op, &opts, in_place);
                            let how = format!("{what}, {algorithm:?}, in place {in_place}");
                            common::check_op(op, &group, &got, 0, &how);
                            let bits = common::bits64(&got);
                            let first = first.get_or_insert_with(|| bits.clone());
                            assert_eq!(first, &bits, "{how}: other bits than the first call");
                        }
                    }
                    let all = first.expect("at least one call");
                    // Reduce-scatter: this rank's part of the same reduction, bit for bit.
                    let part = reduce_scatter_part(n, width, rank % width);
                    let send = B::alloc_from(dev, &ins[rank]).unwrap();
                    let mut recv = B::alloc_from(dev, &vec![poison::<T>(); part.len()]).unwrap();
                    let opts = CollectiveOptions::new().group_size(group_size);
                    comm.reduce_scatter_with(&send, &mut recv, &op, &opts)
                        .unwrap();
                    comm.synchronize().unwrap();
                    let got = common::bits64(&recv.to_host(dev).unwrap());
                    assert_eq!(
                        got, all[part],
                        "{what}: reduce-scatter against the all-reduce"
                    );
                    let values: Vec<T> = all.iter().map(|&b| T::from_bits_u64(b)).collect();
                    digests.push((width, common::digest(&values)));
                }
            }
        }
        digests
    });
    for (r, mine) in results.iter().enumerate() {
        for (i, &(width, digest)) in mine.iter().enumerate() {
            let lead = r / width * width;
            assert_eq!(
                digest, results[lead][i].1,
                "call {i}: rank {r} against rank {lead}"
            );
        }
    }
}

/// One all-reduce of `mine` with `op` on `comm`, into a poisoned output (or in place),
/// waited for.
fn all_reduce<B: Backend, T: Element>(
    comm: &Comm<B>,
    mine: &[T],
    op: ReduceOp,
    opts: &AllReduceOptions,
    in_place: bool,
) -> Vec<T> {
    let dev = comm.device();
    let mut buf = B::alloc_from(dev, mine).unwrap();
    if in_place {
        comm.all_reduce_in_place_with(&mut buf, &op, opts).unwrap();
    } else {
        let send = buf;
        buf = B::alloc_from(dev, &vec![poison::<T>(); mine.len()]).unwrap();
        comm.all_reduce_with(&send, &mut buf, &op, opts).unwrap();
    }
    comm.synchronize().unwrap();
    buf.to_host(dev).unwrap()
}

/// A group of all-reduces of mixed operators: each entry's bits are those of its call
/// alone (a batch holds one operator).
pub fn mixed_group<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("per_rank_operators_mixed_group");
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Sum,
    ];
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let n = 1000;
        let ins: Vec<Vec<Vec<f32>>> = (ops.iter().enumerate())
            .map(|(i, op)| inputs::<f32>(seed ^ i as u64, world, n, nans(*op)))
            .collect();
        let sends: Vec<_> = ins
            .iter()
            .map(|v| B::alloc_from(dev, &v[rank]).unwrap())
            .collect();
        let mut recvs: Vec<_> = (0..ops.len())
            .map(|_| B::alloc_from(dev, &vec![poison::<f32>(); n]).unwrap())
            .collect();
        let mut group = comm.group();
        for ((send, recv), op) in sends.iter().zip(recvs.iter_mut()).zip(&ops) {
            group.all_reduce(send, recv, op).unwrap();
        }
        group.end().unwrap();
        comm.synchronize().unwrap();
        for (i, op) in ops.iter().enumerate() {
            let got = recvs[i].to_host(dev).unwrap();
            let alone = all_reduce(&comm, &ins[i][rank], *op, &AllReduceOptions::new(), false);
            let what = format!("world {world} rank {rank} group entry {i}");
            common::check_op(*op, &ins[i].iter().collect::<Vec<_>>(), &got, 0, &what);
            assert_eq!(
                common::bits(&got),
                common::bits(&alone),
                "{what} against its call alone"
            );
        }
    });
}

/// Lamport takes every operator, with the bits of the one-stage kernel: over worlds 2
/// and 3 and f32, f16 and bf16, inputs full of the values its sentinel encoding moves
/// (-0.0 on every rank or some, a word with the sentinel's bits, NaNs whose bits are the
/// stand-in's), one rank late to each Lamport call, checked against the reference and
/// against one-stage bit for bit.
pub fn lamport_every_operator<B: Backend>(place: &Placement) {
    for world in [2, 3] {
        lamport_every_operator_of::<B, f32>(place, world);
        lamport_every_operator_of::<B, peercomm::half::f16>(place, world);
        lamport_every_operator_of::<B, peercomm::half::bf16>(place, world);
    }
}

fn lamport_every_operator_of<B: Backend, T: Element>(place: &Placement, world: usize) {
    let mut rng = StdRng::seed_from_u64(common::seed("per_rank_lamport_every_operator"));
    let n = 1003;
    // All ones: a NaN, and the bits that stand in for the sentinel on the way.
    let ones = T::from_bits_u64(u64::MAX >> (64 - 8 * std::mem::size_of::<T>()));
    // With `nans` (the operators that define a NaN's result), the all-ones NaNs.
    let mut inputs = |nans: bool| -> Vec<Vec<T>> {
        (0..world)
            .map(|r| {
                (0..n)
                    .map(|e| match e % 8 {
                        0 => T::from_f32(-0.0),
                        1 => T::from_f32(if r % 2 == 0 { 0.0 } else { -0.0 }),
                        2 if nans && (e / 8) % world == r => ones,
                        // A -0.0 above a +0.0: an f16 / bf16 word 0x8000_0000 on rank 0.
                        4 => T::from_f32(0.0),
                        5 if r == 0 => T::from_f32(-0.0),
                        _ => T::from_f32(rng.random_range(0.5f32..2.0) * [1.0, -1.0][e % 2]),
                    })
                    .collect()
            })
            .collect()
    };
    let by_op: Vec<Vec<Vec<T>>> = ReduceOp::ALL.iter().map(|&op| inputs(nans(op))).collect();
    with_world::<B, _>(place, world, |rank, comm| {
        for (i, (op, ins)) in ReduceOp::ALL.into_iter().zip(&by_op).enumerate() {
            let group: Vec<&Vec<T>> = ins.iter().collect();
            let what = format!(
                "{} {} world {world} rank {rank}",
                T::DTYPE.name(),
                op.name()
            );
            let lamport = AllReduceOptions::new().algorithm(Algorithm::Lamport);
            let one_stage = AllReduceOptions::new().algorithm(Algorithm::OneStage);
            for in_place in [false, true] {
                // Skewed ranks: one rank, another each call, starts its Lamport call late,
                // so the others poll for its encoded packs.
                if (2 * i + usize::from(in_place)) % world == rank {
                    comm.delay(Duration::from_millis(5)).unwrap();
                }
                let got = all_reduce(&comm, &ins[rank], op, &lamport, in_place);
                common::check_op(op, &group, &got, 0, &format!("{what}, Lamport"));
                let want = all_reduce(&comm, &ins[rank], op, &one_stage, in_place);
                assert_eq!(
                    common::bits64(&got),
                    common::bits64(&want),
                    "{what}, in place {in_place}: Lamport against one-stage"
                );
            }
        }
    });
}

/// One rank's call with another operator (an all-reduce, one-stage and two-stage
/// staged alike; a reduce-scatter): `CallMismatch` naming the operator on every rank,
/// nothing written; after `reinitialize` the calls work.
pub fn operator_mismatch<B: Backend>(place: &Placement, world: usize) {
    fn reduce<B: Backend>(op: ReduceOp, scatter: bool) -> Call<B> {
        Box::new(move |comm: &Comm<B>| {
            let dev = comm.device();
            let n = 4096;
            let send = B::alloc_from(dev, &vec![1.5f32; n])?;
            let len = if scatter {
                reduce_scatter_part(n, comm.world_size(), comm.rank()).len()
            } else {
                n
            };
            let mut recv = B::alloc_from(dev, &vec![poison::<f32>(); len])?;
            if scatter {
                comm.reduce_scatter(&send, &mut recv, &op)?;
            } else {
                let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                comm.all_reduce_with(&send, &mut recv, &op, &one)?;
            }
            let result = comm.synchronize();
            let written = recv
                .to_host(dev)?
                .iter()
                .filter(|x| x.to_bits() != poison::<f32>().to_bits())
                .count();
            if result.is_err() {
                assert_eq!(written, 0, "a mismatched call wrote {written} elements");
            }
            result
        })
    }
    let config = short_waits(place, world);
    let reduce_to = |root: usize| -> Call<B> {
        Box::new(move |comm: &Comm<B>| {
            let dev = comm.device();
            let send = B::alloc_from(dev, &[2.0f32; 300])?;
            let mut recv = B::alloc_from(dev, &[poison::<f32>(); 300])?;
            comm.reduce(&send, Some(&mut recv), &ReduceOp::Max, root)?;
            let result = comm.synchronize();
            if result.is_err() {
                let host = recv.to_host(dev)?;
                assert!(host
                    .iter()
                    .all(|x| x.to_bits() == poison::<f32>().to_bits()));
            }
            result
        })
    };
    let cases: Vec<Case<B>> = cases![
        "reduce roots", Root: reduce_to(0), reduce_to(1);
        "reduce against all-reduce", Collective: reduce_to(0), reduce::<B>(ReduceOp::Max, false);
        "max against min", Op: reduce::<B>(ReduceOp::Max, false), reduce::<B>(ReduceOp::Min, false);
        "sum against avg", Op: reduce::<B>(ReduceOp::Sum, false), reduce::<B>(ReduceOp::Avg, false);
        "reduce-scatter sum against prod", Op: reduce::<B>(ReduceOp::Sum, true), reduce::<B>(ReduceOp::Prod, true);
    ];
    every_rank_mismatched(place, world, &config, &cases, |comm, usual| {
        usual(comm).unwrap()
    });
}

/// `reduce` and `reduce_in_place` with every operator and root: the root's output is
/// the all-reduce's, bit for bit; what a non-root passes (`Some`, or its in-place
/// buffer) is left as it was, and `None` works.
pub fn reduce_checked<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("per_rank_reduce");
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        for dtype in DType::ALL {
            by_dtype!(dtype, reduce_of::<B>(&comm, seed));
        }
        // The root must pass its output; a root outside the group is refused.
        let send = B::alloc_from(dev, &[1.0f32; 8]).unwrap();
        let none = None::<&mut B::Buffer<f32>>;
        if rank == 0 {
            let err = comm.reduce(&send, none, &ReduceOp::Sum, 0).unwrap_err();
            assert!(matches!(err, Error::Unsupported(_)), "{err}");
        }
        let err = comm
            .reduce(&send, None::<&mut B::Buffer<f32>>, &ReduceOp::Sum, world)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidRoot { .. }), "{err}");
    });
}

/// `reduce_checked` over `T`: every operator it takes, every root.
fn reduce_of<B: Backend, T: Element>(comm: &Comm<B>, seed: u64) {
    let (dev, world, rank) = (comm.device(), comm.world_size(), comm.rank());
    let unwritten = |v: &[T]| {
        common::bits64(v)
            .iter()
            .all(|&b| b == poison::<T>().to_bits_u64())
    };
    for (i, op) in ReduceOp::ALL.into_iter().enumerate() {
        if !takes(op, T::DTYPE) {
            continue;
        }
        for n in [7usize, 4099] {
            let seed = seed ^ (i * 8191 + n) as u64 ^ (T::DTYPE as u64) << 40;
            let ins = inputs::<T>(seed, world, n, nans(op));
            let all = all_reduce(comm, &ins[rank], op, &AllReduceOptions::new(), false);
            let group: Vec<&Vec<T>> = ins.iter().collect();
            let what = format!(
                "world {world} rank {rank} {} {} n {n}",
                T::DTYPE.name(),
                op.name()
            );
            common::check_op(op, &group, &all, 0, &what);
            for root in 0..world {
                let what = format!("{what} root {root}");
                let send = B::alloc_from(dev, &ins[rank]).unwrap();
                let mut recv = B::alloc_from(dev, &vec![poison::<T>(); n]).unwrap();
                // Non-roots pass None on odd roots, their unwritten buffer on even ones.
                if rank == root || root % 2 == 0 {
                    comm.reduce(&send, Some(&mut recv), &op, root).unwrap();
                } else {
                    comm.reduce(&send, None::<&mut B::Buffer<T>>, &op, root)
                        .unwrap();
                }
                let mut buf = B::alloc_from(dev, &ins[rank]).unwrap();
                comm.reduce_in_place(&mut buf, &op, root).unwrap();
                comm.synchronize().unwrap();
                let (got, in_place) = (recv.to_host(dev).unwrap(), buf.to_host(dev).unwrap());
                if rank == root {
                    assert_eq!(common::bits64(&got), common::bits64(&all), "{what}");
                    assert_eq!(
                        common::bits64(&in_place),
                        common::bits64(&all),
                        "{what} in place"
                    );
                } else {
                    assert!(unwritten(&got), "{what}");
                    assert_eq!(
                        common::bits64(&in_place),
                        common::bits64(&ins[rank]),
                        "{what} in place"
                    );
                }
            }
        }
    }
}

/// Whether `op` takes elements of `dtype` (`Avg` the floats only).
fn takes(op: ReduceOp, dtype: DType) -> bool {
    op != ReduceOp::Avg || dtype.is_float()
}

/// `Avg` over an integer: `Unsupported` naming the type, before anything launches, on
/// every collective that reduces (all-reduce in and out of place, reduce-scatter, reduce),
/// nothing written; the communicator works after it.
pub fn integer_avg_refused<B: Backend>(place: &Placement) {
    fn refused<T: Element>(result: peercomm::Result<impl std::fmt::Debug>, what: &str) {
        match result {
            Err(Error::Unsupported(m)) => {
                assert!(
                    m.contains("avg") && m.contains(T::DTYPE.name()),
                    "{what}: {m}"
                )
            }
            other => panic!("{what}: Avg over {:?}: {other:?}", T::DTYPE),
        }
    }
    fn of<B: Backend, T: Element>(comm: &Comm<B>) {
        let (dev, rank, n) = (comm.device(), comm.rank(), 300);
        let mine: Vec<T> = (0..n).map(|e| T::from_f64((e % 7 + rank) as f64)).collect();
        let send = B::alloc_from(dev, &mine).unwrap();
        let mut recv = B::alloc_from(dev, &vec![poison::<T>(); n]).unwrap();
        let mut buf = B::alloc_from(dev, &mine).unwrap();
        let avg = ReduceOp::Avg;
        let opts = AllReduceOptions::new();
        refused::<T>(
            comm.all_reduce_with(&send, &mut recv, &avg, &opts),
            "all-reduce",
        );
        refused::<T>(
            comm.all_reduce_in_place_with(&mut buf, &avg, &opts),
            "in place",
        );
        let part = reduce_scatter_part(n, comm.world_size(), rank).len();
        let mut scattered = B::alloc_from(dev, &vec![poison::<T>(); part]).unwrap();
        refused::<T>(
            comm.reduce_scatter(&send, &mut scattered, &avg),
            "reduce-scatter",
        );
        refused::<T>(comm.reduce(&send, Some(&mut recv), &avg, 0), "reduce");
        comm.synchronize().unwrap();
        let unwritten = |v: &[T]| {
            common::bits64(v)
                .iter()
                .all(|&b| b == poison::<T>().to_bits_u64())
        };
        assert!(
            unwritten(&recv.to_host(dev).unwrap()),
            "{:?}: output written",
            T::DTYPE
        );
        assert!(
            unwritten(&scattered.to_host(dev).unwrap()),
            "{:?}: part written",
            T::DTYPE
        );
        assert_eq!(
            common::bits64(&buf.to_host(dev).unwrap()),
            common::bits64(&mine)
        );
        // The sum still runs.
        comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts)
            .unwrap();
        comm.synchronize().unwrap();
    }
    with_world::<B, _>(place, 2, |_, comm| {
        for dtype in DType::ALL.into_iter().filter(|d| !d.is_float()) {
            by_dtype!(dtype, of::<B>(&comm));
        }
    });
}

/// One rank's call over i32 where the others pass f32 (the same bytes, and the same
/// data-movement kernel): `CallMismatch` naming the dtype on every rank, nothing written,
/// for the all-reduce, reduce-scatter, all-gather and broadcast.
pub fn dtype_mismatch<B: Backend>(place: &Placement, world: usize) {
    fn call<B: Backend, T: Element>(which: &'static str) -> Call<B> {
        Box::new(move |comm: &Comm<B>| {
            let (dev, world, rank, n) = (comm.device(), comm.world_size(), comm.rank(), 1000);
            let send = B::alloc_from(dev, &vec![T::from_f64(3.0); n])?;
            let len = match which {
                "reduce-scatter" => reduce_scatter_part(n, world, rank).len(),
                "all-gather" => n * world,
                _ => n,
            };
            let mut recv = B::alloc_from(dev, &vec![poison::<T>(); len])?;
            match which {
                "all-reduce" => comm.all_reduce(&send, &mut recv, &ReduceOp::Sum).map(drop),
                "reduce-scatter" => comm.reduce_scatter(&send, &mut recv, &ReduceOp::Max),
                "all-gather" => comm.all_gather(&send, &mut recv),
                _ => comm.broadcast((rank == 0).then_some(&send), &mut recv, 0),
            }?;
            let result = comm.synchronize();
            if result.is_err() {
                let host = recv.to_host(dev)?;
                let poisoned = common::bits64(&host)
                    .iter()
                    .all(|&b| b == poison::<T>().to_bits_u64());
                assert!(poisoned, "a mismatched {which} wrote its output");
            }
            result
        })
    }
    let config = short_waits(place, world);
    let mut cases: Vec<Case<B>> = Vec::new();
    for which in ["all-reduce", "reduce-scatter", "all-gather", "broadcast"] {
        cases.extend(cases![
            which, DType: call::<B, f32>(which), call::<B, i32>(which);
        ]);
    }
    every_rank_mismatched(place, world, &config, &cases, |comm, usual| {
        usual(comm).unwrap()
    });
}

/// A group of every collective the guard takes, between two all-reduces: each result is
/// that of its call alone, in the group's order.
pub fn group_of_collectives<B: Backend>(place: &Placement, world: usize) {
    let seed = common::seed("per_rank_group_of_collectives");
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let n = 1000;
        let ins = inputs::<f32>(seed, world, n, false);
        let mine = &ins[rank];
        let part = reduce_scatter_part(n, world, rank).len();
        let fresh = |len| B::alloc_from(dev, &vec![poison::<f32>(); len]).unwrap();
        let send = B::alloc_from(dev, mine).unwrap();
        let (mut first, mut last) = (fresh(n), fresh(n));
        let (mut scattered, mut gathered) = (fresh(part), fresh(n * world));
        let (mut reduced, mut broadcast) = (fresh(n), fresh(n));
        let mut in_place = B::alloc_from(dev, mine).unwrap();
        let root = world - 1;
        let mut group = comm.group();
        group.all_reduce(&send, &mut first, &ReduceOp::Sum).unwrap();
        group
            .reduce_scatter(&send, &mut scattered, &ReduceOp::Max)
            .unwrap();
        group.all_gather(&send, &mut gathered).unwrap();
        let root_send = (rank == root).then_some(&send as &dyn peercomm::backend::DeviceBuffer<B>);
        group.broadcast(root_send, &mut broadcast, root).unwrap();
        group
            .reduce(&send, Some(&mut reduced), &ReduceOp::Min, root)
            .unwrap();
        group
            .reduce_in_place(&mut in_place, &ReduceOp::Avg, 0)
            .unwrap();
        group.all_reduce(&send, &mut last, &ReduceOp::Prod).unwrap();
        assert_eq!(group.len(), 7);
        group.end().unwrap();
        comm.synchronize().unwrap();
        let host = |b: &B::Buffer<f32>| common::bits(&b.to_host(dev).unwrap());
        let alone = |op| {
            common::bits(&all_reduce(
                &comm,
                mine,
                op,
                &AllReduceOptions::new(),
                false,
            ))
        };
        let what = format!("world {world} rank {rank}");
        assert_eq!(host(&first), alone(ReduceOp::Sum), "{what}: all-reduce");
        assert_eq!(
            host(&last),
            alone(ReduceOp::Prod),
            "{what}: last all-reduce"
        );
        let max = alone(ReduceOp::Max);
        assert_eq!(
            host(&scattered),
            max[reduce_scatter_part(n, world, rank)],
            "{what}: reduce-scatter"
        );
        let everyone: Vec<u32> = ins.iter().flat_map(|v| common::bits(v)).collect();
        assert_eq!(host(&gathered), everyone, "{what}: all-gather");
        assert_eq!(
            host(&broadcast),
            common::bits(&ins[root]),
            "{what}: broadcast"
        );
        let (min, avg) = (alone(ReduceOp::Min), alone(ReduceOp::Avg));
        let untouched = vec![poison::<f32>().to_bits(); n];
        assert_eq!(
            host(&reduced),
            if rank == root { min } else { untouched },
            "{what}: reduce"
        );
        let kept = if rank == 0 { avg } else { common::bits(mine) };
        assert_eq!(host(&in_place), kept, "{what}: reduce in place");
    });
}
