//! Zero copy on the per-rank `Comm`: symmetric (`alloc_symmetric`) and registered
//! (`register`) inputs read in place by the peers, every output checked against f64
//! and bit for bit against a `SingleController` on the same devices, inputs, algorithm
//! and grid. Then refusals (typed, everywhere, nothing registered), differing input
//! places (`CallMismatch` on `Inputs`), and lifetimes (no leaked registration, import
//! or fd; dropped ranges reused), also across processes (children of the test binary).

use std::process::Child;
use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut, TypedBuffer};
use peercomm::bootstrap::{BootstrapError, UniqueId};
use peercomm::{
    Algorithm, AllReduceOptions, CallField, CollectiveOptions, Comm, CommConfig, DType, Element,
    Error, SingleController, TensorView, TensorViewMut,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::common::collectives::{assert_bits, check_rms_norm, expect, output_len, Which};
use super::common::{self, bits, digest, group_sizes, random_inputs, random_values, View};
use super::processes::{self, Devices};
use super::{agreement, in_step, seed, with_world, with_world_config, Placement};

/// Where a call's input lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// In a buffer of `Comm::alloc_symmetric`.
    Symmetric,
    /// In a plain buffer passed through `Comm::register`.
    Registered,
}

/// Lengths the cases cycle through: odd, so the last pack is partial for every dtype.
const LENGTHS: [usize; 5] = [1, 7, 1023, 4099, 65_537];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn nan<T: Element>(len: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); len]
}

/// Asserts `got`'s bits are `want`, naming the first element that differs.
fn assert_same_bits<T: Element>(got: &[T], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(e) = (0..got.len()).find(|&e| got[e].to_bits_u32() != want[e]) {
        panic!(
            "{what}: element {e} of {}: per rank {:?} ({:#x}), single controller {:#x}",
            got.len(),
            got[e],
            got[e].to_bits_u32(),
            want[e]
        );
    }
}

/// A single controller over the devices the per-rank world of `world` ranks uses,
/// with the same configuration.
fn single_controller<B: Backend>(place: &Placement, world: usize) -> SingleController<B> {
    let ordinals: Vec<usize> = (0..world).map(|r| place.ordinal(r)).collect();
    SingleController::<B>::new(&ordinals, place.config(world)).expect("the single controller")
}

/// Every rank's input of case `case`: the same in every thread.
fn inputs<T: Element>(seed: u64, case: usize, world: usize, len: usize) -> Vec<Vec<T>> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((case as u64) << 24));
    random_inputs::<T>(&mut rng, world, len)
}

/// A symmetric buffer of 256 bytes to 1.25 KiB, allocated before a case's input so
/// that the input lies at an offset of its segment that changes from case to case
/// (the peers must add it to the segment's mapped base).
fn spacer<B: Backend>(comm: &Comm<B>, case: usize) -> peercomm::SymmetricBuffer<B, f32> {
    comm.alloc_symmetric::<f32>(64 * (1 + case % 5)).unwrap()
}

/// One all-reduce of the zero-copy matrix.
#[derive(Clone, Copy, Debug)]
struct ReduceCase {
    width: usize,
    algorithm: Algorithm,
    in_place: bool,
    input: Input,
    dtype: DType,
    len: usize,
    blocks: u32,
}

impl ReduceCase {
    fn options(&self) -> AllReduceOptions {
        AllReduceOptions::new()
            .group_size(self.width)
            .algorithm(self.algorithm)
            .blocks(self.blocks)
    }
}

/// Every group size x `algorithms` (Lamport only where it runs: the whole world and
/// groups of one) x in and out of place x symmetric and registered inputs x dtype;
/// lengths and grids (1 or 2 blocks) cycle through the cases.
fn reduce_cases(world: usize, algorithms: &[Algorithm]) -> Vec<ReduceCase> {
    let mut cases = Vec::new();
    for width in group_sizes(world) {
        for &algorithm in algorithms {
            if algorithm == Algorithm::Lamport && width != world && width != 1 {
                continue;
            }
            for in_place in [false, true] {
                for input in [Input::Symmetric, Input::Registered] {
                    for dtype in DTYPES {
                        let i = cases.len();
                        cases.push(ReduceCase {
                            width,
                            algorithm,
                            in_place,
                            input,
                            dtype,
                            len: LENGTHS[(i / 2 + i / 7) % LENGTHS.len()],
                            blocks: 1 + (i / 3 % 2) as u32,
                        });
                    }
                }
            }
        }
    }
    cases
}

/// What the single controller gave for one call: the algorithm, every rank's bits.
type Single = (Algorithm, Vec<Vec<u32>>);

fn single_reduce<B: Backend, T: Element>(
    comm: &SingleController<B>,
    c: &ReduceCase,
    ins: &[Vec<T>],
) -> Single {
    let ranks = comm.cores();
    let dev = |r: usize| ranks[r].device();
    let mut bufs: Vec<B::Buffer<T>> = ins
        .iter()
        .enumerate()
        .map(|(r, v)| B::alloc_from(dev(r), v).unwrap())
        .collect();
    let what = format!("single controller {c:?}");
    let algorithm = if c.in_place {
        comm.all_reduce_sum_slices_in_place(&mut bufs, &c.options())
            .expect(&what)
    } else {
        let mut outs: Vec<B::Buffer<T>> = (0..ins.len())
            .map(|r| B::alloc_from(dev(r), &nan::<T>(c.len)).unwrap())
            .collect();
        let a = comm
            .all_reduce_sum_slices(&bufs, &mut outs, &c.options())
            .expect(&what);
        bufs = outs;
        a
    };
    comm.synchronize().expect(&what);
    let outs = (0..ins.len())
        .map(|r| bits(&B::download(dev(r), &bufs[r]).unwrap()))
        .collect();
    (algorithm, outs)
}

/// The all-reduce from `input` (in place, or into a fresh poisoned output), waited for;
/// `read` downloads the input buffer.
fn reduce_from<B: Backend, T: Element, I: DeviceBufferMut<B>>(
    comm: &Comm<B>,
    input: &mut I,
    c: &ReduceCase,
    what: &str,
    read: impl Fn(&I) -> Vec<T>,
) -> (Algorithm, Vec<T>) {
    let dev = comm.device();
    if c.in_place {
        let a = comm
            .all_reduce_sum_in_place_with(input, &c.options())
            .expect(what);
        comm.synchronize().expect(what);
        (a, read(input))
    } else {
        let mut out = B::alloc_from(dev, &nan::<T>(c.len)).unwrap();
        let a = comm
            .all_reduce_sum_with(&*input, &mut out, &c.options())
            .expect(what);
        comm.synchronize().expect(what);
        (a, B::download(dev, &out).unwrap())
    }
}

/// One case on this rank: its input in a symmetric or a registered buffer, checked
/// against the f64 reference and the single controller's bits and algorithm.
fn check_reduce<B: Backend, T: Element>(
    comm: &Comm<B>,
    seed: u64,
    case: usize,
    c: &ReduceCase,
    single: &Single,
) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let ins = inputs::<T>(seed, case, world, c.len);
    let what = format!("per-rank case {case} {c:?} world {world} rank {rank}");
    let (algorithm, got) = match c.input {
        Input::Symmetric => {
            let _spacer = spacer(comm, case);
            let mut buf = comm.alloc_symmetric::<T>(c.len).expect(&what);
            assert_ne!(buf.placement().1, 0, "{what}: inside its segment");
            buf.copy_from_host(dev, &ins[rank]).unwrap();
            reduce_from(comm, &mut buf, c, &what, |b| b.to_host(dev).unwrap())
        }
        Input::Registered => {
            let plain = B::alloc_from(dev, &ins[rank]).unwrap();
            let mut buf = comm.register(plain).expect(&what);
            reduce_from(comm, &mut buf, c, &what, |b| B::download(dev, b).unwrap())
        }
    };
    assert_eq!(algorithm, single.0, "{what}: the algorithm that ran");
    if c.algorithm != Algorithm::Auto && c.width > 1 {
        assert_eq!(algorithm, c.algorithm, "{what}: the forced algorithm");
    }
    let base = rank / c.width * c.width;
    common::check_sums(
        &ins[base..base + c.width],
        &vec![got.clone(); c.width],
        c.width,
        &what,
    );
    assert_same_bits(&got, &single.1[rank], &what);
}

/// Case (a), all-reduce: every case of `reduce_cases` from symmetric or registered
/// inputs matches f64 and the single controller's bits and algorithm; afterwards only
/// the pool's one segment is registered.
pub fn all_reduce_matches_single_controller<B: Backend>(
    place: &Placement,
    world: usize,
    algorithms: &[Algorithm],
) {
    let seed = seed(&format!("per_rank_zero_copy_all_reduce_world_{world}"));
    let cases = reduce_cases(world, algorithms);
    let single: Vec<Single> = {
        let comm = single_controller::<B>(place, world);
        cases
            .iter()
            .enumerate()
            .map(|(i, c)| match c.dtype {
                DType::F32 => single_reduce::<B, f32>(&comm, c, &inputs(seed, i, world, c.len)),
                DType::F16 => {
                    single_reduce::<B, half::f16>(&comm, c, &inputs(seed, i, world, c.len))
                }
                DType::BF16 => {
                    single_reduce::<B, half::bf16>(&comm, c, &inputs(seed, i, world, c.len))
                }
            })
            .collect()
    };
    with_world::<B, _>(place, world, |_rank, comm| {
        for (i, c) in cases.iter().enumerate() {
            match c.dtype {
                DType::F32 => check_reduce::<B, f32>(&comm, seed, i, c, &single[i]),
                DType::F16 => check_reduce::<B, half::f16>(&comm, seed, i, c, &single[i]),
                DType::BF16 => check_reduce::<B, half::bf16>(&comm, seed, i, c, &single[i]),
            }
        }
        assert_eq!(comm.registrations(), (1, 0), "the pool's segment, no more");
    });
    eprintln!(
        "per_rank_zero_copy_all_reduce_world_{world}: {} cases per rank, bits equal to the \
         single controller's",
        cases.len()
    );
}

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
    let world = comm.world_size();
    let ranks = comm.cores();
    let dev = |r: usize| ranks[r].device();
    let ins = inputs::<T>(seed, case, world, c.n);
    let in_bufs: Vec<B::Buffer<T>> = (0..world)
        .map(|r| B::alloc_from(dev(r), &ins[r]).unwrap())
        .collect();
    let what = format!("single controller {c:?}");
    let i: Vec<TensorView<'_, B>> = in_bufs.iter().map(|b| TensorView::flat(b)).collect();
    match c.which {
        Coll::Gather(which) => {
            let mut outs: Vec<B::Buffer<T>> = (0..world)
                .map(|r| B::alloc_from(dev(r), &nan::<T>(output_len(which, c.width, r, c.n))))
                .collect::<peercomm::Result<_>>()
                .unwrap();
            {
                let mut o: Vec<TensorViewMut<'_, B>> =
                    outs.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                match which {
                    Which::AllGather => comm.all_gather(&i, &mut o, &c.options()),
                    _ => comm.reduce_scatter_sum(&i, &mut o, &c.options()),
                }
                .expect(&what);
            }
            comm.synchronize().expect(&what);
            (0..world)
                .map(|r| bits(&B::download(dev(r), &outs[r]).unwrap()))
                .collect()
        }
        Coll::Fused { hidden, .. } => {
            let (residual, weight, epsilon) = fused_extras::<T>(seed, case, c.n, hidden);
            let ws: Vec<B::Buffer<T>> = (0..world)
                .map(|r| B::alloc_from(dev(r), &weight).unwrap())
                .collect();
            let mut res: Vec<B::Buffer<T>> = (0..world)
                .map(|r| B::alloc_from(dev(r), &residual).unwrap())
                .collect();
            let mut outs: Vec<B::Buffer<T>> = (0..world)
                .map(|r| B::alloc_from(dev(r), &nan::<T>(c.n)).unwrap())
                .collect();
            {
                let w: Vec<TensorView<'_, B>> = ws.iter().map(|b| TensorView::flat(b)).collect();
                let mut r: Vec<TensorViewMut<'_, B>> =
                    res.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                let mut o: Vec<TensorViewMut<'_, B>> =
                    outs.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                comm.all_reduce_residual_rms_norm(&i, &mut r, &w, &mut o, epsilon, &c.options())
                    .expect(&what);
            }
            comm.synchronize().expect(&what);
            (0..world)
                .flat_map(|r| {
                    [
                        bits(&B::download(dev(r), &outs[r]).unwrap()),
                        bits(&B::download(dev(r), &res[r]).unwrap()),
                    ]
                })
                .collect()
        }
    }
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
                Which::AllGather => comm.all_gather(&send, &mut recv, &c.options()),
                _ => comm.reduce_scatter_sum(&send, &mut recv, &c.options()),
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
            let (out, res) = (
                B::download(dev, &out).unwrap(),
                B::download(dev, &res).unwrap(),
            );
            check_rms_norm(
                &ins, &residual, &weight, c.width, rank, epsilon, &out, &res, &what,
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
    let what = format!(
        "per-rank {which:?} {:?} group {width} n {n} rank {rank}",
        T::DTYPE
    );
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
            comm.broadcast_in_place(&mut send, root, &opts)
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
                Which::Scatter { .. } => comm.scatter(input, &mut recv, root, &opts),
                _ => comm.broadcast(input, &mut recv, root, &opts),
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
            .map(|(i, c)| match c.dtype {
                DType::F32 => single_coll::<B, f32>(&comm, seed, i, c),
                DType::F16 => single_coll::<B, half::f16>(&comm, seed, i, c),
                DType::BF16 => single_coll::<B, half::bf16>(&comm, seed, i, c),
            })
            .collect()
    };
    with_world::<B, _>(place, world, |_rank, comm| {
        for (i, c) in cases.iter().enumerate() {
            match c.dtype {
                DType::F32 => check_coll::<B, f32>(&comm, seed, i, c, &single[i]),
                DType::F16 => check_coll::<B, half::f16>(&comm, seed, i, c, &single[i]),
                DType::BF16 => check_coll::<B, half::bf16>(&comm, seed, i, c, &single[i]),
            }
        }
        let mut case = cases.len();
        for width in group_sizes(world) {
            for root in [0, width - 1] {
                for which in [
                    Which::Broadcast {
                        root,
                        in_place: false,
                    },
                    Which::Broadcast {
                        root,
                        in_place: true,
                    },
                    Which::Scatter { root },
                ] {
                    let n = LENGTHS[case % 4];
                    match DTYPES[case % DTYPES.len()] {
                        DType::F32 => check_rooted::<B, f32>(&comm, seed, case, which, width, n),
                        DType::F16 => {
                            check_rooted::<B, half::f16>(&comm, seed, case, which, width, n)
                        }
                        DType::BF16 => {
                            check_rooted::<B, half::bf16>(&comm, seed, case, which, width, n)
                        }
                    }
                    case += 1;
                }
            }
        }
        assert_eq!(comm.registrations(), (1, 0), "the pool's segment, no more");
    });
    eprintln!(
        "per_rank_zero_copy_collectives_world_{world}: {} cases per rank bit for bit the \
         single controller's",
        cases.len()
    );
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
        // The all-reduce: plain (staged in chunks), then symmetric (whole), same bits.
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        let mut out = B::alloc_from(dev, &nan::<f32>(n)).unwrap();
        comm.all_reduce_sum_with(&plain, &mut out, &one).unwrap();
        comm.synchronize().unwrap();
        let chunked = B::download(dev, &out).unwrap();
        B::upload(dev, &nan::<f32>(n), &mut out).unwrap();
        comm.all_reduce_sum_with(&sym, &mut out, &one).unwrap();
        comm.synchronize().unwrap();
        let got = B::download(dev, &out).unwrap();
        common::check_sums(
            &ins,
            &[got.clone(), got.clone()],
            world,
            "symmetric one-stage",
        );
        assert_bits(
            &chunked,
            &got,
            "plain (chunked) against symmetric one-stage",
        );
        comm.all_reduce_sum_in_place_with(&mut sym, &one).unwrap();
        comm.synchronize().unwrap();
        assert_bits(
            &sym.to_host(dev).unwrap(),
            &got,
            "in place (staged in chunks)",
        );
        sym.copy_from_host(dev, &ins[rank]).unwrap();
        // All-gather and reduce-scatter.
        let opts = CollectiveOptions::new();
        for which in [Which::AllGather, Which::ReduceScatter] {
            let what = format!("{which:?}");
            let mut recv =
                B::alloc_from(dev, &nan::<f32>(output_len(which, world, rank, n))).unwrap();
            let run = |input: &dyn DeviceBuffer<B>, recv: &mut B::Buffer<f32>| match which {
                Which::AllGather => comm.all_gather(input, recv, &opts),
                _ => comm.reduce_scatter_sum(input, recv, &opts),
            };
            run(&plain, &mut recv).unwrap();
            comm.synchronize().unwrap();
            let chunked = B::download(dev, &recv).unwrap();
            assert_bits(
                &chunked,
                &expect(which, &ins, world, rank),
                &format!("plain {what}"),
            );
            let len = chunked.len();
            B::upload(dev, &nan::<f32>(len), &mut recv).unwrap();
            run(&sym, &mut recv).unwrap();
            comm.synchronize().unwrap();
            let got = B::download(dev, &recv).unwrap();
            assert_bits(&got, &expect(which, &ins, world, rank), &what);
        }
        // The fused call, one-stage: 64 rows of 1024 bf16, 128 KiB.
        let (tokens, hidden) = (64, 1024);
        let xs = inputs::<half::bf16>(seed, 1, world, tokens * hidden);
        let (residual, weight, epsilon) =
            fused_extras::<half::bf16>(seed, 1, tokens * hidden, hidden);
        let mut x = comm.alloc_symmetric::<half::bf16>(tokens * hidden).unwrap();
        x.copy_from_host(dev, &xs[rank]).unwrap();
        let plain_x = B::alloc_from(dev, &xs[rank]).unwrap();
        let w = B::alloc_from(dev, &weight).unwrap();
        let mut res = B::alloc_from(dev, &residual).unwrap();
        let mut normed = B::alloc_from(dev, &nan::<half::bf16>(tokens * hidden)).unwrap();
        let fused = CollectiveOptions::new().algorithm(Algorithm::OneStage);
        // Plain (staged in chunks of rows) into its own residual and output.
        let mut plain_res = B::alloc_from(dev, &residual).unwrap();
        let mut plain_normed = B::alloc_from(dev, &nan::<half::bf16>(tokens * hidden)).unwrap();
        comm.all_reduce_residual_rms_norm(
            &plain_x,
            &mut plain_res,
            &w,
            &mut plain_normed,
            epsilon,
            &fused,
        )
        .unwrap();
        comm.all_reduce_residual_rms_norm(&x, &mut res, &w, &mut normed, epsilon, &fused)
            .unwrap();
        comm.synchronize().unwrap();
        assert_bits(
            &B::download(dev, &plain_normed).unwrap(),
            &B::download(dev, &normed).unwrap(),
            "plain (chunked) fused output",
        );
        assert_bits(
            &B::download(dev, &plain_res).unwrap(),
            &B::download(dev, &res).unwrap(),
            "plain (chunked) fused residual",
        );
        check_rms_norm(
            &xs,
            &residual,
            &weight,
            world,
            rank,
            epsilon,
            &B::download(dev, &normed).unwrap(),
            &B::download(dev, &res).unwrap(),
            "symmetric fused",
        );
    });
}

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
    match r {
        Err(Error::CannotRegister { .. }) => {}
        other => panic!("{what}: {other:?}, not CannotRegister"),
    }
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
        let back = refused(
            comm.register(B::alloc_from(dev, &data).unwrap()),
            Some(odd),
            &format!("rank {rank}: registered sizes differ"),
        );
        assert_eq!(
            B::download(dev, &back).unwrap(),
            data,
            "the buffer comes back"
        );
        assert_eq!(comm.registrations(), none);
        // A buffer on another device than the rank's (where the backend has another):
        // that rank's own error there, CannotRegister naming it on the others.
        if place.devices > 1 {
            let elsewhere = B::open((place.ordinal(rank) + 1) % place.devices).unwrap();
            let good = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
            let what = format!("rank {rank}: a peer's buffer is on another device");
            if rank == odd {
                let wrong = B::alloc_from(&elsewhere, &[1.0f32; 64]).unwrap();
                match comm.register(wrong) {
                    Err(peercomm::RegisterError {
                        error: Error::WrongDevice { .. },
                        ..
                    }) => {}
                    Err(e) => panic!("{what}: {e:?}"),
                    Ok(_) => panic!("{what}: registered"),
                }
            } else {
                refused(comm.register(good), Some(odd), &what);
            }
            assert_eq!(comm.registrations(), none);
        }
        // Symmetric allocations of different sizes: no segment is made.
        let len = if rank == odd { 300 } else { 200 };
        refused_alloc(
            comm.alloc_symmetric::<f32>(len),
            &format!("rank {rank}: symmetric sizes differ"),
        );
        assert_eq!(comm.registrations(), none, "no segment made");
        // A registration where a peer allocates a symmetric buffer: two different
        // collective calls, the bootstrap's exchange mismatch on every rank.
        let plain = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
        let got = if rank == odd {
            comm.alloc_symmetric::<f32>(64).map(drop)
        } else {
            comm.register(plain).map(drop).map_err(|e| e.error)
        };
        assert!(
            matches!(
                got,
                Err(Error::Bootstrap(BootstrapError::ExchangeMismatch { .. }))
            ),
            "rank {rank}: registers or allocates where a peer does the other: {got:?}"
        );
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
        refused_alloc(
            comm.alloc_symmetric::<f32>(64),
            &format!("rank {rank}: dropped in another order"),
        );
        assert_eq!(comm.registrations(), (1, 0), "still the one segment");
        meet.wait();
        // Matching calls still work: a registration and an all-reduce on it.
        let mut buf = comm
            .register(B::alloc_from(dev, &[rank as f32 + 1.0; 100]).unwrap())
            .unwrap();
        assert_eq!(comm.registrations(), (2, 0));
        comm.all_reduce_sum_in_place_with(&mut buf, &AllReduceOptions::new())
            .unwrap();
        comm.synchronize().unwrap();
        let want = (world * (world + 1) / 2) as f32;
        assert_eq!(B::download(dev, &buf).unwrap(), vec![want; 100]);
        let plain = buf.into_inner();
        assert_eq!(comm.registrations(), (1, 0));
        assert_eq!(B::download(dev, &plain).unwrap(), vec![want; 100]);
    });
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
    let mut res = B::alloc_from(dev, &vec![half::bf16::ONE; n])?;
    let weight = B::alloc_from(dev, &vec![half::bf16::ONE; 1024])?;
    match call {
        Call::OneStage => comm
            .all_reduce_sum_with(
                input,
                &mut out,
                &AllReduceOptions::new().algorithm(Algorithm::OneStage),
            )
            .map(drop),
        Call::AllGather => comm.all_gather(input, &mut out, &opts),
        Call::ReduceScatter => comm.reduce_scatter_sum(input, &mut out, &opts),
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
        assert!(
            host.iter().all(|x| x.is_nan()),
            "a mismatched call wrote its output"
        );
        assert!(
            r.iter().all(|&x| x == half::bf16::ONE),
            "a mismatched call wrote its residual"
        );
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
            assert!(
                host.iter().all(|&x| (x.to_f32() - 1.0).abs() < 1e-2),
                "fused output"
            );
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
            match got {
                Err(Error::CallMismatch {
                    rank: r,
                    peer,
                    field: CallField::Inputs,
                    ..
                }) => {
                    assert_eq!(r, rank, "{what}");
                    if rank == odd {
                        assert_ne!(peer, odd, "{what}");
                    } else {
                        assert_eq!(peer, odd, "{what}");
                    }
                }
                other => panic!("{what}: {other:?}, not CallMismatch(Inputs)"),
            }
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
        comm.all_reduce_sum_with(pass, &mut out, &opts).unwrap();
        comm.synchronize().unwrap();
        let want = half::bf16::from_f32((world * (world + 1) / 2) as f32);
        assert!(B::download(dev, &out).unwrap().iter().all(|&x| x == want));
    });
}

/// Case (c), inputs dropped in flight (one- or two-stage, symmetric or registered), the
/// freed range refilled with NaN at once: outputs stay right, as ranges are reused only
/// after the end barrier and registered buffers are freed in stream order.
pub fn inputs_dropped_in_flight<B: Backend>(place: &Placement, world: usize) {
    let seed = seed(&format!(
        "per_rank_zero_copy_inputs_dropped_in_flight_{world}"
    ));
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
                        comm.all_reduce_sum_with(&s, &mut out, &opts).expect(&what);
                        drop(s);
                        let mut next = comm.alloc_symmetric::<f32>(len).unwrap();
                        assert_eq!(next.placement(), at, "{what}: the range is reused");
                        next.copy_from_host(dev, &nan::<f32>(len)).unwrap();
                    }
                    Input::Registered => {
                        let plain = B::alloc_from(dev, &ins[rank]).unwrap();
                        let reg = comm.register(plain).unwrap();
                        comm.all_reduce_sum_with(&reg, &mut out, &opts)
                            .expect(&what);
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
        let opts = AllReduceOptions::new()
            .algorithm(Algorithm::OneStage)
            .blocks(2);
        let register = |value: f32| {
            let freed = Arc::new(AtomicBool::new(false));
            let inner = B::alloc_from(dev, &vec![value; len]).unwrap();
            let tracked = Tracked {
                inner,
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
        comm.all_reduce_sum_with(&reg, &mut out, &opts).unwrap();
        drop(reg);
        assert!(
            !freed(&flag),
            "rank {rank}: freed while its call was in flight"
        );
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
        assert!(
            !freed(&flag),
            "rank {rank}: freed by a synchronize that reported an error"
        );
        comm.reinitialize().unwrap();
        assert!(freed(&flag), "rank {rank}: kept past reinitialize");

        // The call completes; the input is dropped before the synchronize.
        let (reg, flag) = register(rank as f32 + 1.0);
        comm.all_reduce_sum_with(&reg, &mut out, &opts).unwrap();
        drop(reg);
        assert!(
            !freed(&flag),
            "rank {rank}: freed while its call was in flight"
        );
        comm.synchronize().unwrap();
        assert!(freed(&flag), "rank {rank}: kept past a clean synchronize");
        assert_eq!(B::download(dev, &out).unwrap(), vec![3.0f32; len]);

        // Dropped after a clean synchronize: freed at once.
        let (reg, flag) = register(1.0);
        comm.all_reduce_sum_with(&reg, &mut out, &opts).unwrap();
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
                comm.all_reduce_sum_in_place_with(&mut reg, &AllReduceOptions::new())
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
            assert_eq!(
                s.placement(),
                pa,
                "cycle {cycle}: the dropped range is reused"
            );
            if cycle % 100 == 0 {
                s.copy_from_host(dev, &[rank as f32 + 1.0; 16]).unwrap();
                comm.all_reduce_sum_in_place_with(&mut s, &AllReduceOptions::new())
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
        assert!(
            after < before + cycles / 4,
            "{what}: open fds {before} -> {after} after {cycles} cycles"
        );
    }
}

// ---------------------------------------------------------------------------------
// Across processes.

/// The all-reduces every rank process makes on symmetric inputs: (length, group size,
/// algorithm, in place).
fn process_schedule(world: usize) -> Vec<(usize, usize, Algorithm, bool)> {
    let mut calls = Vec::new();
    for (i, len) in [7usize, 4099, 65_537].into_iter().enumerate() {
        for group in group_sizes(world) {
            for algorithm in [Algorithm::OneStage, Algorithm::TwoStage] {
                calls.push((len, group, algorithm, (i + group) % 2 == 1));
            }
        }
    }
    calls
}

/// One rank process's part of `symmetric_processes`: every call of the schedule on a
/// symmetric input, checked against the f64 reference; a heap buffer's registration
/// (refused across processes where `heap_refused`); returns (call, digest) per call.
pub fn symmetric_rank<B: Backend>(
    comm: &Comm<B>,
    seed: u64,
    heap_refused: bool,
) -> Vec<(usize, u64)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let mut digests = Vec::new();
    for (call, &(len, group, algorithm, in_place)) in process_schedule(world).iter().enumerate() {
        let what =
            format!("process rank {rank} call {call}: {len} x f32, group {group}, {algorithm:?}");
        let mut send = comm.alloc_symmetric::<f32>(len).expect(&what);
        send.copy_from_host(dev, &processes::input(seed, call, rank, len))
            .unwrap();
        let opts = AllReduceOptions::new()
            .group_size(group)
            .algorithm(algorithm)
            .blocks(2);
        let got = if in_place {
            let a = comm
                .all_reduce_sum_in_place_with(&mut send, &opts)
                .expect(&what);
            assert_eq!(a, algorithm, "{what}");
            comm.synchronize().expect(&what);
            send.to_host(dev).unwrap()
        } else {
            let mut recv = B::alloc_from(dev, &nan::<f32>(len)).unwrap();
            let a = comm
                .all_reduce_sum_with(&send, &mut recv, &opts)
                .expect(&what);
            assert_eq!(a, algorithm, "{what}");
            comm.synchronize().expect(&what);
            B::download(dev, &recv).unwrap()
        };
        let base = rank / group * group;
        let ins: Vec<Vec<f32>> = (base..base + group)
            .map(|r| processes::input(seed, call, r, len))
            .collect();
        common::check_sums(&ins, &vec![got.clone(); group], group, &what);
        digests.push((call, digest(&got)));
    }
    let segments = comm.registrations();
    assert_eq!(segments.0, 1, "rank {rank}: one segment");
    assert_eq!(
        segments.1,
        world - 1,
        "rank {rank}: every peer's segment mapped once"
    );
    // A heap buffer: in another process a peer cannot map it.
    let data: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let plain = B::alloc_from(dev, &data).unwrap();
    match comm.register(plain) {
        Ok(reg) => {
            assert!(
                !heap_refused,
                "rank {rank}: a heap buffer registered across processes"
            );
            drop(reg);
        }
        Err(peercomm::RegisterError { error, buffer, .. }) => {
            assert!(
                matches!(error, Error::CannotRegister { .. }),
                "rank {rank}: {error:?}"
            );
            assert_eq!(
                B::download(dev, &buffer).unwrap(),
                data,
                "the buffer comes back"
            );
        }
    }
    assert_eq!(
        comm.registrations(),
        segments,
        "rank {rank}: nothing registered"
    );
    if heap_refused {
        // Rank 0 offers a symmetric buffer, the others heap buffers of the same size:
        // refused on every rank, naming rank 1 (the first that cannot export).
        let what = format!("rank {rank}: a symmetric buffer beside heap buffers");
        let s = comm.alloc_symmetric::<f32>(256).unwrap();
        let error = if rank == 0 {
            comm.register(s).map(drop).map_err(|e| e.error)
        } else {
            comm.register(B::alloc_from(dev, &data).unwrap())
                .map(drop)
                .map_err(|e| e.error)
        };
        assert!(
            matches!(error, Err(Error::CannotRegister { rank: 1, .. })),
            "{what}: {error:?}"
        );
        assert_eq!(comm.registrations(), segments, "{what}: nothing registered");
    }
    // A symmetric buffer can be registered again (its segment is exportable).
    let again = comm.alloc_symmetric::<f32>(100).unwrap();
    let mut again = comm.register(again).unwrap();
    again
        .copy_from_host(dev, &[rank as f32 + 1.0; 100])
        .unwrap();
    comm.all_reduce_sum_in_place_with(
        &mut again,
        &AllReduceOptions::new().algorithm(Algorithm::OneStage),
    )
    .unwrap();
    comm.synchronize().unwrap();
    let want = (world * (world + 1) / 2) as f32;
    assert_eq!(again.to_host(dev).unwrap(), vec![want; 100]);
    drop(again);
    assert_eq!(comm.registrations(), segments);
    digests
}

/// Lines a child printed that start with `tag` (after the harness's own prefix, if
/// any), read until it exits, without the tag.
fn tagged(child: &mut Child, tag: &str) -> Vec<String> {
    use std::io::{BufRead, BufReader};
    BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| l.find(tag).map(|at| l[at + tag.len()..].to_string()))
        .collect()
}

fn variant(heap_refused: bool) -> [(String, String); 1] {
    let v = if heap_refused {
        "heap-refused"
    } else {
        "heap-any"
    };
    [(processes::VARIANT.to_string(), v.to_string())]
}

/// `world` rank processes all-reduce symmetric inputs (one- and two-stage, every group
/// size, in and out of place), checked and bitwise equal per group; each peer segment
/// mapped once; heap registrations refused where `heap_refused`; symmetric ones work.
pub fn symmetric_processes<B: Backend>(devices: &Devices, world: usize, heap_refused: bool) {
    let seed = seed(&format!("per_rank_zero_copy_processes world {world}"));
    let all = processes::digest_world::<B>(
        devices,
        world,
        "zero-copy",
        seed,
        &variant(heap_refused),
        |comm| symmetric_rank(comm, seed, heap_refused),
    );
    let groups: Vec<usize> = process_schedule(world).iter().map(|c| c.1).collect();
    let calls = processes::compare_group_digests(world, &groups, &all);
    eprintln!(
        "per_rank_zero_copy_processes world {world}: {calls} calls per rank on symmetric inputs, \
         bits equal in every group"
    );
}

/// One rank process's cycles: a symmetric buffer allocated, registered, given back and
/// dropped; heap registrations (refused where `heap_refused`); every 100th cycle an
/// all-reduce reads the registered buffer in place.
fn zero_copy_cycles<B: Backend>(comm: &Comm<B>, cycles: usize, heap_refused: bool) {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let at = comm.alloc_symmetric::<f32>(16).unwrap().placement();
    for cycle in 0..cycles {
        let s = comm.alloc_symmetric::<f32>(16).unwrap();
        assert_eq!(
            s.placement(),
            at,
            "rank {rank} cycle {cycle}: the range is reused"
        );
        let mut reg = comm.register(s).unwrap();
        if cycle % 100 == 0 {
            reg.copy_from_host(dev, &[rank as f32 + 1.0; 16]).unwrap();
            let mut out = B::alloc_from(dev, &[f32::NAN; 16]).unwrap();
            let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
            comm.all_reduce_sum_with(&reg, &mut out, &opts).unwrap();
            comm.synchronize().unwrap();
            let want = (world * (world + 1) / 2) as f32;
            assert_eq!(B::download(dev, &out).unwrap(), vec![want; 16]);
        }
        drop(reg.into_inner());
        // A registered pass over a plain buffer: exported, mapped by the peer for the
        // second pass and unmapped with the value (refused where heap memory is).
        let plain = B::alloc_from(dev, &[rank as f32 + 1.0; 16]).unwrap();
        let mut out = B::alloc_from(dev, &[f32::NAN; 16]).unwrap();
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        match comm.register_inputs_of(|| comm.all_reduce_sum_with(&plain, &mut out, &one)) {
            Ok((_, inputs)) => {
                assert!(!heap_refused, "rank {rank}: a heap buffer registered");
                assert_eq!((inputs.registered(), inputs.in_place_calls()), (1, 1));
                comm.synchronize().unwrap();
                let want = (world * (world + 1) / 2) as f32;
                assert_eq!(B::download(dev, &out).unwrap(), vec![want; 16]);
            }
            // Refused where heap memory is, and where the driver pool cannot export.
            Err(Error::CannotRegister { .. }) => {}
            Err(e) => panic!("rank {rank}: {e:?}"),
        }
        comm.synchronize().unwrap();
        match comm.register(B::alloc_from(dev, &[1.0f32; 16]).unwrap()) {
            Ok(_registered) => assert!(!heap_refused, "rank {rank}: a heap buffer registered"),
            Err(peercomm::RegisterError {
                error: Error::CannotRegister { .. },
                buffer,
                ..
            }) => drop(buffer),
            Err(e) => panic!("rank {rank}: {e:?}"),
        }
    }
}

/// `cycles` communicators built over `boot` and dropped, each with a symmetric buffer
/// (a segment exported to the peer and mapped there) that an all-reduce reads in place.
fn comm_cycles<B: Backend>(
    devices: &Devices,
    boot: &std::sync::Arc<peercomm::TcpBootstrap>,
    config: &CommConfig,
    rank: usize,
    cycles: usize,
) {
    for _ in 0..cycles {
        let dev = B::open(rank % devices.count).unwrap();
        let comm = Comm::<B>::from_bootstrap(dev, Box::new(boot.clone()), config.clone()).unwrap();
        let dev = comm.device();
        let mut s = comm.alloc_symmetric::<f32>(16).unwrap();
        s.copy_from_host(dev, &[rank as f32 + 1.0; 16]).unwrap();
        let mut out = B::alloc_from(dev, &[f32::NAN; 16]).unwrap();
        let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        comm.all_reduce_sum_with(&s, &mut out, &opts).unwrap();
        comm.synchronize().unwrap();
        assert_eq!(B::download(dev, &out).unwrap(), vec![3.0; 16]);
        assert_eq!(comm.registrations(), (1, 1));
    }
}

/// Cycles before the counts are taken (caches that stay: see `processes.rs`).
const WARM_UP: usize = 20;

/// The child roles of this module (`processes::child_main` hands them on); whether
/// `role` is one.
pub fn child_role<B: Backend>(
    role: &str,
    devices: &Devices,
    rank: usize,
    world: usize,
    id: &UniqueId,
    seed: u64,
) -> bool {
    let heap_refused = std::env::var(processes::VARIANT).as_deref() == Ok("heap-refused");
    match role {
        "zero-copy" => {
            let dev = B::open(rank % devices.count).unwrap();
            let config = processes::config_for(devices, world);
            let comm = Comm::<B>::from_rank(dev, rank, world, id, config).unwrap();
            for (call, d) in symmetric_rank(&comm, seed, heap_refused) {
                println!("DIGEST {call} {rank} {d}");
            }
        }
        "zero-copy-cycles" => {
            let cycles = seed as usize;
            let boot = std::sync::Arc::new(
                peercomm::TcpBootstrap::connect(id, rank, world, Duration::from_secs(30)).unwrap(),
            );
            let config = processes::config_for(devices, world)
                .with_lamport_slot_bytes(4096)
                .with_payload_bytes(64 << 10)
                .with_barrier_timeout(Some(Duration::from_secs(2)));
            let dev = B::open(rank % devices.count).unwrap();
            let comm =
                Comm::<B>::from_bootstrap(dev, Box::new(boot.clone()), config.clone()).unwrap();
            zero_copy_cycles(&comm, WARM_UP, heap_refused);
            comm_cycles::<B>(devices, &boot, &config, rank, WARM_UP);
            let before = processes::open_files_and_maps();
            let registered = comm.registrations();
            assert_eq!(
                registered,
                (1, 1),
                "rank {rank}: one segment, the peer's mapped"
            );
            zero_copy_cycles(&comm, cycles, heap_refused);
            comm_cycles::<B>(devices, &boot, &config, rank, cycles / 10);
            assert_eq!(comm.registrations(), registered, "rank {rank}");
            // The empty segment given back: its mapping in the peer closed.
            assert!(comm.trim_symmetric().unwrap() > 0, "rank {rank}");
            assert_eq!(comm.registrations(), (0, 0), "rank {rank}");
            // Teardowns a starved drop parked are freed at their deadline, not leaked.
            let (parked, until) = peercomm::unstable::parked_teardowns();
            if let Some(until) = until {
                std::thread::sleep(until.saturating_duration_since(std::time::Instant::now()));
                peercomm::unstable::free_expired_teardowns();
            }
            std::thread::sleep(Duration::from_millis(200)); // freed streams' threads exit
            let after = processes::open_files_and_maps();
            println!(
                "COUNTS {} {} {} {} {parked}",
                before.0, before.1, after.0, after.1
            );
        }
        _ => return false,
    }
    true
}

/// Lifetimes across processes: two child rank processes run `cycles` zero-copy cycles
/// and `cycles / 10` communicators; registrations, imports, open files and mappings
/// end where they started (small slack for harness threads).
// `B` is the children's backend.
#[allow(clippy::extra_unused_type_parameters)]
pub fn cycles_leak_nothing<B: Backend>(cycles: usize, heap_refused: bool) {
    let id = UniqueId::new().unwrap();
    let _ = id.release(); // rank 0 runs in a child: it binds the address itself
    let extra = variant(heap_refused);
    let text = id.to_string();
    let mut children: Vec<Child> = (0..2)
        .map(|rank| {
            processes::spawn_with("zero-copy-cycles", rank, 2, &text, cycles as u64, &extra)
        })
        .collect();
    let counts: Vec<Vec<usize>> = children
        .iter_mut()
        .map(|child| {
            tagged(child, "COUNTS ")
                .first()
                .expect("the child's counts")
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .collect()
        })
        .collect();
    for child in &mut children {
        assert!(child.wait().unwrap().success(), "a rank process failed");
    }
    for (rank, c) in counts.iter().enumerate() {
        eprintln!(
            "per_rank_zero_copy_cycles_leak_nothing: {cycles} cycles; rank {rank} fds {} -> {}, \
             maps {} -> {}, teardowns parked (then freed at their deadline) {}",
            c[0], c[2], c[1], c[3], c[4]
        );
        assert!(
            c[2] <= c[0] + 16,
            "rank {rank} fds: {} -> {} after {cycles} cycles",
            c[0],
            c[2]
        );
        assert!(
            c[3] <= c[1] + 16,
            "rank {rank} maps: {} -> {} after {cycles} cycles",
            c[1],
            c[3]
        );
    }
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
            comm.all_reduce_sum_with(&input, &mut out, &opts).unwrap();
            let got = comm.synchronize();
            let host = B::download(dev, &out).unwrap();
            let wrong = host.iter().filter(|x| !x.is_nan()).count();
            match got {
                Err(Error::CallMismatch {
                    rank: r,
                    peer,
                    field: CallField::Inputs,
                    ..
                }) => {
                    assert_eq!(r, rank, "{what}");
                    assert_eq!(peer == odd, rank != odd, "{what}");
                    assert_eq!(wrong, 0, "{what}: a mismatched call wrote its output");
                }
                other => panic!("{what}: {other:?} with {wrong}/{n} elements written"),
            }
            meet.wait();
            comm.reinitialize().unwrap();
        }
    });
}
