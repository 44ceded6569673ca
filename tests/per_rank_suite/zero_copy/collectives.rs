//! The zero-copy all-gather, reduce-scatter, fused, broadcast and scatter against the
//! single controller, and zero copy staging nothing.

use peercomm::backend::{Backend, DeviceBuffer, TypedBuffer};
use peercomm::{
    Algorithm, AllReduceOptions, CollectiveOptions, Comm, DType, Element, ReduceOp,
    SingleController, TensorView, TensorViewMut,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::super::common::collectives::{assert_bits, check_rms_norm, expect, output_len, Which};
use super::super::common::{self, group_sizes, random_values};
use super::super::{inputs, nan, seed, with_world, with_world_config, Placement};
use super::{assert_same_bits, bits_of, per_device, single_controller, spacer, DTYPES, LENGTHS};

/// One all-gather, reduce-scatter or fused call of the collectives matrix.
#[derive(Clone, Copy, Debug)]
enum Coll {
    Gather(Which),
    Fused {
        tokens: usize,
        hidden: usize,
        algorithm: Algorithm,
    },
}

#[derive(Clone, Copy, Debug)]
struct CollCase {
    which: Coll,
    width: usize,
    dtype: DType,
    /// Elements per member (the all-gather's input; the reduce-scatter's whole input).
    n: usize,
    blocks: u32,
}

impl CollCase {
    fn options(&self) -> CollectiveOptions {
        let o = CollectiveOptions::new()
            .group_size(self.width)
            .blocks(self.blocks);
        match self.which {
            Coll::Fused { algorithm, .. } => o.algorithm(algorithm),
            Coll::Gather(_) => o,
        }
    }
}

/// Every group size x all-gather, reduce-scatter (dtypes, lengths and grids cycling)
/// and the fused call one-stage and Auto (Lamport over the whole world) at two shapes.
fn coll_cases(world: usize) -> Vec<CollCase> {
    let mut cases = Vec::new();
    for width in group_sizes(world) {
        for which in [Which::AllGather, Which::ReduceScatter] {
            for k in 0..4 {
                let i = cases.len();
                cases.push(CollCase {
                    which: Coll::Gather(which),
                    width,
                    dtype: DTYPES[i % DTYPES.len()],
                    n: LENGTHS[(k + i) % 4],
                    blocks: 1 + (i % 2) as u32,
                });
            }
        }
        for algorithm in [Algorithm::OneStage, Algorithm::Auto] {
            for (dtype, tokens, hidden) in [(DType::BF16, 3, 1032), (DType::F16, 1, 4096)] {
                let i = cases.len();
                cases.push(CollCase {
                    which: Coll::Fused {
                        tokens,
                        hidden,
                        algorithm,
                    },
                    width,
                    dtype,
                    n: tokens * hidden,
                    blocks: 1 + (i % 2) as u32,
                });
            }
        }
    }
    cases
}

/// A fused case's residual, weight and epsilon (the same on every rank).
fn fused_extras<T: Element>(
    seed: u64,
    case: usize,
    n: usize,
    hidden: usize,
) -> (Vec<T>, Vec<T>, f32) {
    let mut rng = StdRng::seed_from_u64(seed ^ ((case as u64) << 24) ^ 0x5eed);
    let residual = random_values::<T>(&mut rng, n);
    let weight = random_values::<T>(&mut rng, hidden);
    (residual, weight, rng.random_range(1e-6f32..1e-3))
}

/// The single controller's outputs of one collectives case (for the fused call: the
/// output, then the new residual).
fn single_coll<B: Backend, T: Element>(
    comm: &SingleController<B>,
    seed: u64,
    case: usize,
    c: &CollCase,
) -> Vec<Vec<u32>> {
    let ins = inputs::<T>(seed, case, comm.world_size(), c.n);
    let alloc = |data: &dyn Fn(usize) -> Vec<T>| per_device(comm, data);

    let in_bufs = alloc(&|r| ins[r].clone());
    let what = format!("single controller {c:?}");
    let i: Vec<TensorView<'_, B>> = in_bufs.iter().map(|b| TensorView::flat(b)).collect();
    match c.which {
        Coll::Gather(which) => {
            let mut outs = alloc(&|r| nan(output_len(which, c.width, r, c.n)));
            let mut o = flat_mut::<B, T>(&mut outs);
            match which {
                Which::AllGather => comm.all_gather(&i, &mut o, &c.options()),
                _ => comm.reduce_scatter(&i, &mut o, &ReduceOp::Sum, &c.options()),
            }
            .expect(&what);
            drop(o);
            comm.synchronize().expect(&what);
            bits_of(comm, &outs)
        }
        Coll::Fused { hidden, .. } => {
            let (residual, weight, epsilon) = fused_extras::<T>(seed, case, c.n, hidden);
            let ws = alloc(&|_| weight.clone());
            let (mut res, mut outs) = (alloc(&|_| residual.clone()), alloc(&|_| nan(c.n)));
            let w: Vec<TensorView<'_, B>> = ws.iter().map(|b| TensorView::flat(b)).collect();
            let (mut r, mut o) = (flat_mut::<B, T>(&mut res), flat_mut::<B, T>(&mut outs));
            comm.all_reduce_residual_rms_norm(&i, &mut r, &w, &mut o, epsilon, &c.options())
                .expect(&what);
            drop((r, o));
            comm.synchronize().expect(&what);
            let (o, r) = (bits_of(comm, &outs), bits_of(comm, &res));
            o.into_iter().zip(r).flat_map(|(o, r)| [o, r]).collect()
        }
    }
}

/// Flat mutable views of `bufs`.
fn flat_mut<B: Backend, T: Element>(bufs: &mut [B::Buffer<T>]) -> Vec<TensorViewMut<'_, B>> {
    bufs.iter_mut().map(|b| TensorViewMut::flat(b)).collect()
}

/// One collectives case on this rank, its input in a symmetric buffer: the reference
/// (exact for the copies and the in-order reduce-scatter, f64 for the fused call) and
/// the single controller's bits.
fn check_coll<B: Backend, T: Element>(
    comm: &Comm<B>,
    seed: u64,
    case: usize,
    c: &CollCase,
    single: &[Vec<u32>],
) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let ins = inputs::<T>(seed, case, world, c.n);
    let what = format!("per-rank case {case} {c:?} world {world} rank {rank}");
    let _spacer = spacer(comm, case);
    let mut send = comm.alloc_symmetric::<T>(c.n).expect(&what);
    send.copy_from_host(dev, &ins[rank]).unwrap();
    match c.which {
        Coll::Gather(which) => {
            let mut recv =
                B::alloc_from(dev, &nan::<T>(output_len(which, c.width, rank, c.n))).unwrap();
            match which {
                Which::AllGather => comm.all_gather_with(&send, &mut recv, &c.options()),
                _ => comm.reduce_scatter_with(&send, &mut recv, &ReduceOp::Sum, &c.options()),
            }
            .expect(&what);
            comm.synchronize().expect(&what);
            let got = B::download(dev, &recv).unwrap();
            assert_bits(&got, &expect(which, &ins, c.width, rank), &what);
            assert_same_bits(&got, &single[rank], &what);
        }
        Coll::Fused { hidden, .. } => {
            let (residual, weight, epsilon) = fused_extras::<T>(seed, case, c.n, hidden);
            let w = B::alloc_from(dev, &weight).unwrap();
            let mut res = B::alloc_from(dev, &residual).unwrap();
            let mut out = B::alloc_from(dev, &nan::<T>(c.n)).unwrap();
            comm.all_reduce_residual_rms_norm(&send, &mut res, &w, &mut out, epsilon, &c.options())
                .expect(&what);
            comm.synchronize().expect(&what);
            let get = |b| B::download(dev, b).unwrap();
            let (out, res, width) = (get(&out), get(&res), c.width);
            check_rms_norm(
                &ins, &residual, &weight, width, rank, epsilon, &out, &res, &what,
            );
            assert_same_bits(&out, &single[2 * rank], &format!("{what} output"));
            assert_same_bits(&res, &single[2 * rank + 1], &format!("{what} residual"));
        }
    }
}

/// A broadcast (out of place, and in place in the symmetric buffer itself) or scatter
/// whose root's input is a symmetric buffer: still staged (only the root's input is
/// read), still the root's bits.
fn check_rooted<B: Backend, T: Element>(
    comm: &Comm<B>,
    seed: u64,
    case: usize,
    which: Which,
    width: usize,
    n: usize,
) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let len = super::common::collectives::input_len(which, width, n);
    let ins = inputs::<T>(seed, case, world, len);
    let dtype = T::DTYPE;
    let what = format!("per-rank {which:?} {dtype:?} group {width} n {n} rank {rank}");

    let opts = CollectiveOptions::new().group_size(width);
    let mut send = comm.alloc_symmetric::<T>(len).expect(&what);
    let (root, is_root) = match which {
        Which::Broadcast { root, .. } | Which::Scatter { root } => (root, rank % width == root),
        _ => unreachable!("rooted collectives only"),
    };
    let got = match which {
        Which::Broadcast { in_place: true, .. } => {
            let mine = if is_root { ins[rank].clone() } else { nan(len) };
            send.copy_from_host(dev, &mine).unwrap();
            comm.broadcast_in_place_with(&mut send, root, &opts)
                .expect(&what);
            comm.synchronize().expect(&what);
            send.to_host(dev).unwrap()
        }
        _ => {
            send.copy_from_host(dev, &ins[rank]).unwrap();
            let mut recv =
                B::alloc_from(dev, &nan::<T>(output_len(which, width, rank, len))).unwrap();
            let input = is_root.then_some(&send as &dyn DeviceBuffer<B>);
            match which {
                Which::Scatter { .. } => comm.scatter_with(input, &mut recv, root, &opts),
                _ => comm.broadcast_with(input, &mut recv, root, &opts),
            }
            .expect(&what);
            comm.synchronize().expect(&what);
            B::download(dev, &recv).unwrap()
        }
    };
    assert_bits(&got, &expect(which, &ins, width, rank), &what);
}

/// Case (a), the other collectives: all-gather, reduce-scatter and fused on symmetric
/// inputs match the single controller bit for bit; broadcast and scatter are right.
pub fn collectives_match_single_controller<B: Backend>(place: &Placement, world: usize) {
    let seed = seed(&format!("per_rank_zero_copy_collectives_world_{world}"));
    let cases = coll_cases(world);
    let single: Vec<Vec<Vec<u32>>> = {
        let comm = single_controller::<B>(place, world);
        cases
            .iter()
            .enumerate()
            .map(|(i, c)| by_dtype!(c.dtype, single_coll::<B>(&comm, seed, i, c)))
            .collect()
    };
    with_world::<B, _>(place, world, |_rank, comm| {
        for (i, c) in cases.iter().enumerate() {
            by_dtype!(c.dtype, check_coll::<B>(&comm, seed, i, c, &single[i]));
        }
        let mut case = cases.len();
        for width in group_sizes(world) {
            for root in [0, width - 1] {
                let broadcast = |in_place| Which::Broadcast { root, in_place };
                for which in [broadcast(false), broadcast(true), Which::Scatter { root }] {
                    let (n, dtype) = (LENGTHS[case % 4], DTYPES[case % DTYPES.len()]);
                    by_dtype!(dtype, check_rooted::<B>(&comm, seed, case, which, width, n));
                    case += 1;
                }
            }
        }
        assert_eq!(comm.registrations(), (1, 0), "the pool's segment, no more");
    });
    let n = cases.len();
    eprintln!("per_rank_zero_copy_collectives_world_{world}: {n} cases per rank bit for bit");
}

/// Zero copy stages nothing: with a payload a quarter of the message, symmetric inputs
/// run whole (one-stage, all-gather, reduce-scatter, fused) with the bits of plain,
/// chunked inputs; in place one-stage still stages (peers would read overwritten data).
pub fn stages_nothing<B: Backend>(place: &Placement) {
    let world = 2;
    let config = place.config(world).with_payload_bytes(64 << 10);
    let seed = seed("per_rank_zero_copy_stages_nothing");
    with_world_config::<B, _>(place, world, &config, |rank, comm| {
        let dev = comm.device();
        let n = 64 << 10; // f32: 256 KiB
        let ins = inputs::<f32>(seed, 0, world, n);
        let mut sym = comm.alloc_symmetric::<f32>(n).unwrap();
        sym.copy_from_host(dev, &ins[rank]).unwrap();
        let plain = B::alloc_from(dev, &ins[rank]).unwrap();
        type Call<'a, B> = &'a dyn Fn(&dyn DeviceBuffer<B>, &mut <B as Backend>::Buffer<f32>);
        // `call` from each input into a poisoned output of `len`: the outputs.
        let outputs = |inputs: [&dyn DeviceBuffer<B>; 2], len: usize, call: Call<B>| {
            inputs.map(|input| {
                let mut out = B::alloc_from(dev, &nan::<f32>(len)).unwrap();
                call(input, &mut out);
                comm.synchronize().unwrap();
                B::download(dev, &out).unwrap()
            })
        };
        // The all-reduce: plain (staged in chunks), then symmetric (whole), same bits.
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        let [chunked, got] = outputs([&plain, &sym], n, &|input, out| {
            comm.all_reduce_with(input, out, &ReduceOp::Sum, &one)
                .unwrap();
        });
        let what = "symmetric one-stage";
        common::check_sums(&ins, &[got.clone(), got.clone()], world, what);
        assert_bits(&chunked, &got, "plain (chunked) against symmetric");
        comm.all_reduce_in_place_with(&mut sym, &ReduceOp::Sum, &one)
            .unwrap();
        comm.synchronize().unwrap();
        let in_place = sym.to_host(dev).unwrap();
        assert_bits(&in_place, &got, "in place (staged in chunks)");
        sym.copy_from_host(dev, &ins[rank]).unwrap();
        let opts = CollectiveOptions::new();
        for which in [Which::AllGather, Which::ReduceScatter] {
            let len = output_len(which, world, rank, n);
            let [chunked, got] = outputs([&plain, &sym], len, &|input, out| {
                match which {
                    Which::AllGather => comm.all_gather_with(input, out, &opts),
                    _ => comm.reduce_scatter_with(input, out, &ReduceOp::Sum, &opts),
                }
                .unwrap()
            });
            let want = expect(which, &ins, world, rank);
            assert_bits(&chunked, &want, &format!("plain {which:?}"));
            assert_bits(&got, &want, &format!("{which:?}"));
        }
        // The fused call, one-stage: 64 rows of 1024 bf16, 128 KiB; plain (staged in
        // chunks of rows), then symmetric, each into its own residual and output.
        let (tokens, hidden) = (64, 1024);
        let len = tokens * hidden;
        let xs = inputs::<half::bf16>(seed, 1, world, len);
        let (residual, weight, epsilon) = fused_extras::<half::bf16>(seed, 1, len, hidden);
        let mut x = comm.alloc_symmetric::<half::bf16>(len).unwrap();
        x.copy_from_host(dev, &xs[rank]).unwrap();
        let plain_x = B::alloc_from(dev, &xs[rank]).unwrap();
        let w = B::alloc_from(dev, &weight).unwrap();
        let fused = CollectiveOptions::new().algorithm(Algorithm::OneStage);
        let [plain_out, out] = [&plain_x as &dyn DeviceBuffer<B>, &x].map(|input| {
            let mut res = B::alloc_from(dev, &residual).unwrap();
            let mut normed = B::alloc_from(dev, &nan::<half::bf16>(len)).unwrap();
            comm.all_reduce_residual_rms_norm(input, &mut res, &w, &mut normed, epsilon, &fused)
                .unwrap();
            (res, normed)
        });
        comm.synchronize().unwrap();
        let get = |b: &B::Buffer<half::bf16>| B::download(dev, b).unwrap();
        let (res, normed) = (get(&out.0), get(&out.1));
        assert_bits(&get(&plain_out.1), &normed, "plain (chunked) fused output");
        assert_bits(&get(&plain_out.0), &res, "plain (chunked) fused residual");
        let what = "symmetric fused";
        check_rms_norm(
            &xs, &residual, &weight, world, rank, epsilon, &normed, &res, what,
        );
    });
}
