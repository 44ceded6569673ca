//! All-gather, reduce-scatter, broadcast, scatter and the fused all-reduce + residual +
//! RMSNorm, generic over the backend: references, the single-controller sweep, bad inputs.

use peercomm::backend::Backend;
use peercomm::{
    reduce_scatter_part, CollectiveOptions, DType, Element, Error, ReduceOp, SingleController,
    TensorView, TensorViewMut,
};
use rand::rngs::StdRng;
use rand::Rng;

use super::{
    bits, eps, group_sizes, on_ranks, poisoned, random_inputs, random_values, rng, suite_config,
    upload, views, views_mut, Call,
};

/// Lengths the collectives are checked at in the sweeps (odd ones exercise the tails).
pub const COLLECTIVE_LENGTHS: [usize; 5] = [1, 7, 1023, 4099, 100_003];

/// The collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    AllGather,
    ReduceScatter,
    Broadcast {
        root: usize,
        in_place: bool,
    },
    Scatter {
        root: usize,
    },
    /// The per-rank `Comm::reduce` (sum) into the group root's output.
    Reduce {
        root: usize,
    },
}

/// Rank r's all-gather output: the group's inputs in group-rank order.
pub fn expect_all_gather<T: Element>(ins: &[Vec<T>], width: usize, r: usize) -> Vec<T> {
    let base = r / width * width;
    (base..base + width).flat_map(|q| ins[q].clone()).collect()
}

/// Rank r's reduce-scatter output as the kernels compute it: its part of the f32 sum in
/// group-rank order, rounded to T; also checked against the f64 sum.
pub fn expect_reduce_scatter<T: Element>(ins: &[Vec<T>], width: usize, r: usize) -> Vec<T> {
    let part = reduce_scatter_part(ins[0].len(), width, r % width);
    in_order_sums(ins, width, r, part)
}

/// Rank r's reduce output: the group's in-order sums on the root, its poison elsewhere.
pub fn expect_reduce<T: Element>(ins: &[Vec<T>], width: usize, r: usize, root: usize) -> Vec<T> {
    match r % width == root {
        true => in_order_sums(ins, width, r, 0..ins[0].len()),
        false => vec![super::poison::<T>(); ins[0].len()],
    }
}

/// Elements `range` of the sum over rank r's group as the kernels compute it, checked
/// against the f64 sum.
fn in_order_sums<T: Element>(
    ins: &[Vec<T>],
    width: usize,
    r: usize,
    range: std::ops::Range<usize>,
) -> Vec<T> {
    let base = r / width * width;
    range
        .map(|e| {
            let xs: Vec<T> = (base..base + width).map(|q| ins[q][e]).collect();
            if let Some(exact) = super::reduce_exactly(ReduceOp::Sum, &xs) {
                return exact;
            }
            // The kernels' order: +0.0 first (one sign of zero), then group-rank order.
            let mut acc = if width > 1 {
                0.0 + ins[base][e].to_f32()
            } else {
                ins[base][e].to_f32()
            };
            let mut sum = acc as f64;
            let mut abs = sum.abs();
            for x in ins[base + 1..base + width].iter().map(|v| v[e].to_f32()) {
                acc += x;
                sum += x as f64;
                abs += (x as f64).abs();
            }
            let out = T::from_f32(acc);
            let tol =
                0.5 * eps(T::DTYPE) * sum.abs() + width as f64 * f32::EPSILON as f64 * abs + 1e-7;
            assert!(
                (out.to_f32() as f64 - sum).abs() <= tol,
                "the in-order f32 sum strays from the f64 sum at element {e}"
            );
            out
        })
        .collect()
}

/// Rank r's broadcast output: its group root's input.
pub fn expect_broadcast<T: Element>(ins: &[Vec<T>], width: usize, r: usize, root: usize) -> Vec<T> {
    ins[r / width * width + root].clone()
}

/// Rank r's scatter output: its part of its group root's input (`width * n` elements).
pub fn expect_scatter<T: Element>(ins: &[Vec<T>], width: usize, r: usize, root: usize) -> Vec<T> {
    let src = &ins[r / width * width + root];
    let n = src.len() / width;
    let q = r % width;
    src[q * n..(q + 1) * n].to_vec()
}

/// Asserts `got` equals `want` bit for bit.
pub fn assert_bits<T: Element>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(e) = (0..got.len()).find(|&e| got[e].to_bits_u64() != want[e].to_bits_u64()) {
        panic!(
            "{what}: element {e} of {}: got {:?} ({:#x}), expected {:?} ({:#x})",
            got.len(),
            got[e],
            got[e].to_bits_u64(),
            want[e],
            want[e].to_bits_u64()
        );
    }
}

/// Input length per rank of `which` for an output of `n` per member.
pub fn input_len(which: Which, width: usize, n: usize) -> usize {
    match which {
        Which::Scatter { .. } => n * width,
        _ => n,
    }
}

/// Output length of rank r.
pub fn output_len(which: Which, width: usize, r: usize, input: usize) -> usize {
    match which {
        Which::AllGather => input * width,
        Which::ReduceScatter => reduce_scatter_part(input, width, r % width).len(),
        Which::Broadcast { .. } => input,
        Which::Scatter { .. } => input / width,
        Which::Reduce { .. } => input,
    }
}

/// Rank r's expected output.
pub fn expect<T: Element>(which: Which, ins: &[Vec<T>], width: usize, r: usize) -> Vec<T> {
    match which {
        Which::AllGather => expect_all_gather(ins, width, r),
        Which::ReduceScatter => expect_reduce_scatter(ins, width, r),
        Which::Broadcast { root, .. } => expect_broadcast(ins, width, r, root),
        Which::Scatter { root } => expect_scatter(ins, width, r, root),
        Which::Reduce { root } => expect_reduce(ins, width, r, root),
    }
}

/// Checks one rank's fused outputs against the f64 reference of the unfused sequence.
#[allow(clippy::too_many_arguments)]
pub fn check_rms_norm<T: Element>(
    ins: &[Vec<T>],
    res_in: &[T],
    weight: &[T],
    width: usize,
    r: usize,
    epsilon: f32,
    out: &[T],
    res_out: &[T],
    what: &str,
) {
    let hidden = weight.len();
    let base = r / width * width;
    let e_t = eps(T::DTYPE);
    for (t, row) in res_in.chunks(hidden).enumerate() {
        let at = t * hidden;
        let mut s = vec![0f64; hidden];
        let mut rr = vec![0f64; hidden];
        for k in 0..hidden {
            s[k] = (base..base + width)
                .map(|q| ins[q][at + k].to_f32() as f64)
                .sum();
            rr[k] = s[k] + row[k].to_f32() as f64;
        }
        let ms = rr.iter().map(|x| x * x).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (ms + epsilon as f64).sqrt();
        for k in 0..hidden {
            let got_r = res_out[at + k].to_f32() as f64;
            let tol_r = e_t * (s[k].abs() + rr[k].abs()) + 1e-6;
            assert!(
                (got_r - rr[k]).abs() <= tol_r,
                "{what}: residual at row {t} element {k}: got {got_r}, expected {} (tol {tol_r})",
                rr[k]
            );
            let w = weight[k].to_f32() as f64;
            let y = rr[k] * inv * w;
            let got = out[at + k].to_f32() as f64;
            let tol = w.abs() * inv * tol_r + 4.0 * e_t * y.abs() + 1e-5;
            assert!(
                got.is_finite() && (got - y).abs() <= tol,
                "{what}: output at row {t} element {k}: got {got}, expected {y} (tol {tol})"
            );
        }
    }
}

/// One single-controller call of `which` on fresh inputs, outputs poisoned, checked.
pub fn check_once<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    which: Which,
    width: usize,
    n: usize,
    blocks: Option<u32>,
) {
    let mut opts = CollectiveOptions::new().group_size(width);
    if let Some(b) = blocks {
        opts = opts.blocks(b);
    }
    let world = comm.world_size();
    let what = format!("{which:?} {:?} world {world} group {width} n {n}", T::DTYPE);
    let mut call = FuzzCall::<B, T>::new(comm, rng, which, width, n, opts);
    let outcome = call.enqueue(comm);
    comm.synchronize().expect(&what);
    call.check(comm, &outcome, &what);
}

/// Every collective x dtype x group size x length at one world size, single controller.
pub fn sweep<B: Backend>(world: usize, max_blocks: Option<u32>, lengths: &[usize]) {
    sweep_on(&super::open::<B>(world, suite_config(max_blocks)), lengths);
}

/// As [`sweep`], over an open communicator (for example ranks sharing devices).
pub fn sweep_on<B: Backend>(comm: &SingleController<B>, lengths: &[usize]) {
    let world = comm.world_size();
    all_to_all_on(comm, lengths);
    let mut rng = rng(&format!("collectives_world_{world}"));
    for width in group_sizes(world) {
        let mut whiches = vec![Which::AllGather, Which::ReduceScatter];
        for root in [0, width - 1] {
            whiches.push(Which::Broadcast {
                root,
                in_place: root == 0,
            });
            whiches.push(Which::Scatter { root });
        }
        for &n in lengths {
            reduce_scatter_parts_are_the_all_reduce::<B, half::bf16>(comm, &mut rng, width, n);
            for &which in &whiches {
                check_once::<B, f32>(comm, &mut rng, which, width, n, None);
                check_once::<B, half::f16>(comm, &mut rng, which, width, n, None);
                check_once::<B, half::bf16>(comm, &mut rng, which, width, n, Some(3));
            }
        }
        // The other element types at the odd lengths below 100k (tails and packs).
        for &n in lengths.iter().filter(|&&n| n % 2 == 1 && n < 100_000) {
            for (i, &which) in whiches.iter().enumerate() {
                for dtype in DType::ALL.into_iter().filter(|d| !super::every_kernel(*d)) {
                    let blocks = (i % 2 == 1).then_some(3);
                    for_dtype!(dtype, T => check_once::<B, T>(comm, &mut rng, which, width, n, blocks));
                }
            }
            // Their all-reduces, every operator they take, out of place and in place.
            for dtype in DType::ALL.into_iter().filter(|d| !super::every_kernel(*d)) {
                for op in ReduceOp::ALL {
                    let in_place = op == ReduceOp::Max;
                    let opts = peercomm::AllReduceOptions::new().group_size(width);
                    let mut call = for_dtype!(dtype, T => {
                        let ins = random_inputs::<T>(&mut rng, world, n);
                        let mut call = super::Prepared::<B, T>::new(comm, ins, in_place, opts);
                        call.op = op;
                        Box::new(call) as Box<dyn Call<B>>
                    });
                    let what = call.describe(world);
                    let outcome = call.enqueue(comm);
                    comm.synchronize().expect(&what);
                    call.check(comm, &outcome, &what);
                }
            }
        }
    }
}

/// Each reduce-scatter part holds the one-stage all-reduce's bits, so a reduce-scatter
/// then an all-gather is the all-reduce (a hierarchical path relies on it).
pub fn reduce_scatter_parts_are_the_all_reduce<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    width: usize,
    n: usize,
) {
    let world = comm.world_size();
    let ins: Vec<Vec<T>> = random_inputs::<T>(rng, world, n);
    let ranks = comm.cores();
    let dev = |r: usize| ranks[r].device();
    let in_bufs = on_ranks(comm, |r, d| upload::<B, T>(d, &ins[r]));
    let part_len = |r: usize| reduce_scatter_part(n, width, r % width).len();
    let mut parts = on_ranks(comm, |r, d| poisoned::<B, T>(d, part_len(r)));
    let mut reduced = on_ranks(comm, |_, d| poisoned::<B, T>(d, n));
    let opts = CollectiveOptions::new().group_size(width);
    let what = format!(
        "reduce-scatter vs all-reduce {:?} world {world} group {width} n {n}",
        T::DTYPE
    );
    let i = views(&in_bufs);
    comm.reduce_scatter(&i, &mut views_mut(&mut parts), &ReduceOp::Sum, &opts)
        .expect(&what);
    let ar = peercomm::AllReduceOptions::new()
        .group_size(width)
        .algorithm(peercomm::Algorithm::OneStage);
    comm.all_reduce(&i, &mut views_mut(&mut reduced), &ReduceOp::Sum, &ar)
        .expect(&what);
    comm.synchronize().expect(&what);
    for r in 0..world {
        let part = B::download(dev(r), &parts[r]).unwrap();
        let full = B::download(dev(r), &reduced[r]).unwrap();
        let range = reduce_scatter_part(n, width, r % width);
        assert_bits(&part, &full[range], &format!("{what} rank {r}"));
    }
}

/// One fused call, single controller, checked against the f64 reference and across the
/// group's ranks bit for bit.
pub fn check_rms_norm_once<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    width: usize,
    tokens: usize,
    hidden: usize,
) {
    let world = comm.world_size();
    let n = tokens * hidden;
    let ins: Vec<Vec<T>> = random_inputs::<T>(rng, world, n);
    let residual: Vec<T> = random_values::<T>(rng, n);
    let weight: Vec<T> = random_values::<T>(rng, hidden);
    let epsilon = rng.random_range(1e-6f32..1e-3);
    let in_bufs = on_ranks(comm, |r, d| upload::<B, T>(d, &ins[r]));
    let w_bufs = on_ranks(comm, |_, d| upload::<B, T>(d, &weight));
    let mut res_bufs = on_ranks(comm, |_, d| upload::<B, T>(d, &residual));
    let mut out_bufs = on_ranks(comm, |_, d| poisoned::<B, T>(d, n));
    let what = format!(
        "fused {:?} world {world} group {width} {tokens}x{hidden}",
        T::DTYPE
    );
    let (i, w) = (views(&in_bufs), views(&w_bufs));
    let (mut res, mut o) = (views_mut(&mut res_bufs), views_mut(&mut out_bufs));
    let opts = CollectiveOptions::new().group_size(width);
    comm.all_reduce_residual_rms_norm(&i, &mut res, &w, &mut o, epsilon, &opts)
        .expect(&what);
    drop((i, w, res, o));
    comm.synchronize().expect(&what);
    let outs = on_ranks(comm, |r, d| B::download(d, &out_bufs[r]).unwrap());
    let res = on_ranks(comm, |r, d| B::download(d, &res_bufs[r]).unwrap());
    for r in 0..world {
        let what = format!("{what} rank {r}");
        check_rms_norm(
            &ins, &residual, &weight, width, r, epsilon, &outs[r], &res[r], &what,
        );
        let lead = r / width * width;
        assert_eq!(
            bits(&outs[r]),
            bits(&outs[lead]),
            "{what}: output differs from rank {lead}"
        );
        assert_eq!(
            bits(&res[r]),
            bits(&res[lead]),
            "{what}: residual differs from rank {lead}"
        );
    }
}

/// The fused kernel over group sizes, decode and odd token counts, small and large rows.
pub fn rms_norm_sweep<B: Backend>(world: usize, max_blocks: Option<u32>) {
    rms_norm_sweep_on(&super::open::<B>(world, suite_config(max_blocks)));
}

/// As [`rms_norm_sweep`], over an open communicator.
pub fn rms_norm_sweep_on<B: Backend>(comm: &SingleController<B>) {
    let world = comm.world_size();
    let mut rng = rng(&format!("rms_norm_world_{world}"));
    for width in group_sizes(world) {
        for (tokens, hidden) in [(1, 8), (3, 4096), (17, 1032), (2, 16384)] {
            check_rms_norm_once::<B, half::bf16>(comm, &mut rng, width, tokens, hidden);
            check_rms_norm_once::<B, half::f16>(comm, &mut rng, width, tokens, hidden);
        }
        check_rms_norm_once::<B, f32>(comm, &mut rng, width, 5, 256);
    }
}

/// Asserts that `call` over flat views of `outs` (rank r's at index r) is refused with
/// the error `matches` describes and leaves `outs` NaN.
fn refused<B: Backend>(
    comm: &SingleController<B>,
    outs: &mut [B::Buffer<f32>],
    call: impl FnOnce(&mut [TensorViewMut<'_, B>]) -> peercomm::Result<()>,
    matches: fn(&Error) -> bool,
    what: &str,
) {
    let err = call(&mut views_mut(outs)).expect_err(what);
    assert!(matches(&err), "{what}: unexpected error {err}");
    untouched::<B>(comm, outs, what);
}

/// Asserts that `bufs` (rank r's at index r) still hold their NaN poison.
fn untouched<B: Backend>(comm: &SingleController<B>, bufs: &[B::Buffer<f32>], what: &str) {
    comm.synchronize().unwrap();
    for (r, b) in bufs.iter().enumerate() {
        let got = B::download(comm.core(r).device(), b).unwrap();
        assert!(
            got.iter().all(|x| x.is_nan()),
            "{what}: rank {r}'s buffer was written"
        );
    }
}

/// The bad-input matrix of the collectives on a world of 2: each call gets its typed
/// error and writes nothing.
pub fn bad_inputs<B: Backend>() {
    let comm = super::open::<B>(2, suite_config(None));
    let dev = |r: usize| comm.core(r).device();
    let ones = |r: usize, len: usize| upload::<B, f32>(dev(r), &vec![1.0; len]);
    let nan = |a: usize, b: usize| [poisoned::<B, f32>(dev(0), a), poisoned::<B, f32>(dev(1), b)];
    let opts = CollectiveOptions::new();
    let ins = [ones(0, 10), ones(1, 10)];
    let short = ones(1, 9);
    let i = views(&ins);
    let rank1_length = |e: &Error| matches!(e, Error::LengthMismatch { rank: 1, .. });
    let bad_root = |e: &Error| matches!(e, Error::InvalidRoot { width: 2, .. });
    let rank0_length = |e: &Error| matches!(e, Error::LengthMismatch { rank: 0, .. });
    let count = |e: &Error| matches!(e, Error::WrongTensorCount { expected: 1, got } if *got == 2);
    // `refuse!(what, the outputs' lengths, error => |o| call)`.
    macro_rules! refuse {
        ($what:expr, $lens:expr, $err:expr => |$o:ident| $call:expr) => {{
            let (a, b) = $lens;
            refused(&comm, &mut nan(a, b), |$o| $call, $err, $what)
        }};
    }

    // All-gather: an output of the wrong size; inputs of different lengths.
    refuse!("all-gather output size", (20, 19), rank1_length => |o| comm.all_gather(&i, o, &opts));
    let uneven = [TensorView::flat(&ins[0]), TensorView::flat(&short)];
    refuse!("all-gather uneven inputs", (20, 20), rank1_length =>
        |o| comm.all_gather(&uneven, o, &opts));
    // Reduce-scatter: parts of 10 over 2 are 5 and 5.
    refuse!("reduce-scatter output size", (5, 6), rank1_length =>
        |o| comm.reduce_scatter(&i, o, &ReduceOp::Sum, &opts));
    // Broadcast and scatter: a root outside the group, a wrong input count, sizes.
    for root in [2, 7] {
        refuse!("broadcast root", (10, 10), bad_root =>
            |o| comm.broadcast(&i[..1], o, root, &opts));
        refuse!("scatter root", (5, 5), bad_root => |o| comm.scatter(&i[..1], o, root, &opts));
        refuse!("broadcast in place root", (10, 10), bad_root =>
            |o| comm.broadcast_in_place(o, root, &opts));
    }
    refuse!("broadcast input count", (10, 10), count => |o| comm.broadcast(&i, o, 0, &opts));
    refuse!("broadcast output size", (10, 9), rank1_length =>
        |o| comm.broadcast(&i[..1], o, 0, &opts));
    refuse!("scatter output size", (4, 4), rank0_length => |o| comm.scatter(&i[..1], o, 0, &opts));

    // Fused: a hidden size that is not whole packs, elements that are not whole rows,
    // a residual of the wrong length, a weight of another dtype, a bad epsilon.
    let x = [ones(0, 64), ones(1, 64)];
    let xi = views(&x);
    for (w_len, res_len, eps, want, what) in [
        (6, 64, 1e-5, "Unsupported", "hidden not whole packs"),
        (24, 64, 1e-5, "Unsupported", "not whole rows"),
        (16, 63, 1e-5, "LengthMismatch", "residual size"),
        (16, 64, f32::NAN, "Unsupported", "epsilon NaN"),
        (16, 64, -1.0, "Unsupported", "negative epsilon"),
    ] {
        let w = [ones(0, w_len), ones(1, w_len)];
        let mut res = nan(res_len, res_len);
        let fused = |o: &mut [TensorViewMut<'_, B>]| {
            let mut rt = views_mut(&mut res);
            comm.all_reduce_residual_rms_norm(&xi, &mut rt, &views(&w), o, eps, &opts)
        };
        let what = format!("fused {what}");
        let matches: fn(&Error) -> bool = match want {
            "Unsupported" => |e| matches!(e, Error::Unsupported(_)),
            _ => |e| matches!(e, Error::LengthMismatch { .. }),
        };
        refused(&comm, &mut nan(64, 64), fused, matches, &what);
        untouched::<B>(&comm, &res, &format!("{what} (residual)"));
    }
    let w16 = [half::bf16::ONE; 16];
    let w16 = [upload::<B, _>(dev(0), &w16), upload::<B, _>(dev(1), &w16)];
    let mut res = nan(64, 64);
    let fused = |o: &mut [TensorViewMut<'_, B>]| {
        let (rt, wi) = (&mut views_mut(&mut res), &views(&w16));
        comm.all_reduce_residual_rms_norm(&xi, rt, wi, o, 1e-5, &opts)
    };
    let dtype = |e: &Error| matches!(e, Error::DTypeMismatch { .. });
    refused(&comm, &mut nan(64, 64), fused, dtype, "fused weight dtype");
    untouched::<B>(&comm, &res, "fused weight dtype (residual)");
}

/// A collective call for the schedule fuzzer ([`super::fuzz`]): prepared when drawn,
/// enqueued with the batch, checked bit for bit after the batch's synchronize.
pub struct FuzzCall<B: Backend, T: Element> {
    which: Which,
    width: usize,
    opts: CollectiveOptions,
    ins: Vec<Vec<T>>,
    in_bufs: Vec<B::Buffer<T>>,
    outs: Vec<B::Buffer<T>>,
}

impl<B: Backend, T: Element> FuzzCall<B, T> {
    fn new(
        comm: &SingleController<B>,
        rng: &mut StdRng,
        which: Which,
        width: usize,
        n: usize,
        opts: CollectiveOptions,
    ) -> Self {
        let world = comm.world_size();
        let len = input_len(which, width, n);
        let ins: Vec<Vec<T>> = random_inputs::<T>(rng, world, len);
        let in_bufs = on_ranks(comm, |r, d| upload::<B, T>(d, &ins[r]));
        let outs = on_ranks(comm, |r, d| match which {
            Which::Broadcast { root, in_place } if in_place && r % width == root => {
                upload::<B, T>(d, &ins[r])
            }
            _ => poisoned::<B, T>(d, output_len(which, width, r, len)),
        });
        FuzzCall {
            which,
            width,
            opts,
            ins,
            in_bufs,
            outs,
        }
    }
}

/// Panics with `what` where a collective the fuzzer drew was refused (each is valid).
fn ran(outcome: &peercomm::Result<peercomm::Algorithm>, what: &str) {
    if let Err(e) = outcome {
        panic!("{what}: refused: {e}");
    }
}

/// Draws a collective over groups of `width` (`group_size` as the caller asks for it)
/// with about `bytes` per rank, of a random kind, dtype and root.
pub fn fuzz_call<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    dtype: DType,
    width: usize,
    opts: CollectiveOptions,
    bytes: usize,
) -> Box<dyn Call<B>> {
    let root = rng.random_range(0..width);
    // The fuzzer's payload bounds nothing here (one process reads the user buffers),
    // but keep all-gather outputs and scatter inputs within a few MiB.
    let n = (bytes / dtype.size() / width).max(1);
    if rng.random_range(0..6) == 5 {
        // The whole world's all-to-all (the single controller's has no groups).
        return for_dtype!(dtype, T => Box::new(AllToAllCall::<B, T>::new(comm, rng, n)));
    }
    let which = match rng.random_range(0..5) {
        0 => Which::AllGather,
        1 => Which::ReduceScatter,
        2 => Which::Broadcast {
            root,
            in_place: false,
        },
        3 => Which::Broadcast {
            root,
            in_place: true,
        },
        _ => Which::Scatter { root },
    };
    for_dtype!(dtype, T => Box::new(FuzzCall::<B, T>::new(comm, rng, which, width, n, opts)))
}

impl<B: Backend, T: Element> Call<B> for FuzzCall<B, T> {
    fn enqueue(&mut self, comm: &SingleController<B>) -> peercomm::Result<peercomm::Algorithm> {
        let world = comm.world_size();
        let width = self.width;
        let roots = |root: usize| -> Vec<TensorView<'_, B>> {
            (root..world)
                .step_by(width)
                .map(|r| TensorView::flat(&self.in_bufs[r]))
                .collect()
        };
        let mut o = views_mut(&mut self.outs);
        let i = views(&self.in_bufs);
        match self.which {
            Which::AllGather => comm.all_gather(&i, &mut o, &self.opts),
            Which::ReduceScatter => comm.reduce_scatter(&i, &mut o, &ReduceOp::Sum, &self.opts),
            Which::Broadcast {
                root,
                in_place: true,
            } => comm.broadcast_in_place(&mut o, root, &self.opts),
            Which::Broadcast { root, .. } => comm.broadcast(&roots(root), &mut o, root, &self.opts),
            Which::Scatter { root } => comm.scatter(&roots(root), &mut o, root, &self.opts),
            Which::Reduce { .. } => unreachable!("the single controller has no reduce"),
        }
        .map(|()| peercomm::Algorithm::OneStage)
    }
    fn check(
        &self,
        comm: &SingleController<B>,
        outcome: &peercomm::Result<peercomm::Algorithm>,
        what: &str,
    ) {
        ran(outcome, what);
        for r in 0..comm.world_size() {
            let got = B::download(comm.core(r).device(), &self.outs[r]).expect("download");
            assert_bits(
                &got,
                &expect(self.which, &self.ins, self.width, r),
                &format!("{what}, rank {r}"),
            );
        }
    }
    fn describe(&self, world: usize) -> String {
        format!(
            "{:?} {:?} world {world} group {} input {} blocks {:?}",
            self.which,
            T::DTYPE,
            self.width,
            self.ins[0].len(),
            self.opts.blocks
        )
    }
    fn bytes(&self) -> usize {
        self.ins[0].len() * std::mem::size_of::<T>()
    }
    fn collective(&self) -> Option<&'static str> {
        Some(match self.which {
            Which::AllGather => "all_gather",
            Which::ReduceScatter => "reduce_scatter",
            Which::Broadcast {
                in_place: false, ..
            } => "broadcast",
            Which::Broadcast { in_place: true, .. } => "broadcast_in_place",
            Which::Scatter { .. } => "scatter",
            Which::Reduce { .. } => "reduce",
        })
    }
}

/// The single controller's all-to-all: equal parts and a random count matrix (some
/// zeros), over f32 and u8, each output poisoned first and checked bit for bit against
/// what its senders sent, in rank order.
pub fn all_to_all_on<B: Backend>(comm: &SingleController<B>, lengths: &[usize]) {
    let world = comm.world_size();
    let mut rng = rng(&format!("all_to_all_world_{world}"));
    for &n in lengths.iter().filter(|&&n| n < 100_000) {
        let equal = vec![vec![n; world]; world];
        let uneven: Vec<Vec<usize>> = (0..world)
            .map(|_| (0..world).map(|_| rng.random_range(0..=n)).collect())
            .collect();
        for counts in [equal, uneven] {
            all_to_all_once::<B, f32>(comm, &mut rng, &counts);
            all_to_all_once::<B, u8>(comm, &mut rng, &counts);
        }
    }
}

fn all_to_all_once<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    counts: &[Vec<usize>],
) {
    let mut call = AllToAllCall::<B, T>::with_counts(comm, rng, counts.to_vec());
    let what = call.describe(comm.world_size());
    let outcome = call.enqueue(comm);
    comm.synchronize().expect(&what);
    call.check(comm, &outcome, &what);
}

/// One single-controller all-to-all: equal parts (`all_to_all`) or a count matrix
/// (`all_to_all_v`), its outputs poisoned first, checked bit for bit against what the
/// senders sent, in rank order. The fuzzer draws it among the other collectives.
pub struct AllToAllCall<B: Backend, T: Element> {
    counts: Vec<Vec<usize>>,
    ins: Vec<Vec<T>>,
    in_bufs: Vec<B::Buffer<T>>,
    outs: Vec<B::Buffer<T>>,
}

impl<B: Backend, T: Element> AllToAllCall<B, T> {
    /// Equal parts of `n` (half the time) or random counts in `0..=n`, a third of the
    /// pairs empty.
    fn new(comm: &SingleController<B>, rng: &mut StdRng, n: usize) -> Self {
        let world = comm.world_size();
        let counts = if rng.random_bool(0.5) {
            vec![vec![n; world]; world]
        } else {
            (0..world)
                .map(|_| {
                    (0..world)
                        .map(|_| match rng.random_bool(1.0 / 3.0) {
                            true => 0,
                            false => rng.random_range(1..=n),
                        })
                        .collect()
                })
                .collect()
        };
        Self::with_counts(comm, rng, counts)
    }

    fn with_counts(comm: &SingleController<B>, rng: &mut StdRng, counts: Vec<Vec<usize>>) -> Self {
        let world = comm.world_size();
        let sent = |r: usize| counts[r].iter().sum::<usize>();
        let got = |q: usize| counts.iter().map(|c| c[q]).sum::<usize>();
        let ins: Vec<Vec<T>> = (0..world)
            .map(|r| random_values::<T>(rng, sent(r)))
            .collect();
        let in_bufs = on_ranks(comm, |r, dev| upload::<B, T>(dev, &ins[r]));
        let outs = on_ranks(comm, |q, dev| poisoned::<B, T>(dev, got(q)));
        AllToAllCall {
            counts,
            ins,
            in_bufs,
            outs,
        }
    }

    fn equal(&self) -> bool {
        self.counts
            .iter()
            .flatten()
            .all(|&c| c == self.counts[0][0])
    }
}

impl<B: Backend, T: Element> Call<B> for AllToAllCall<B, T> {
    fn enqueue(&mut self, comm: &SingleController<B>) -> peercomm::Result<peercomm::Algorithm> {
        let equal = self.equal();
        let mut o = views_mut(&mut self.outs);
        let i = views(&self.in_bufs);
        match equal {
            true => comm.all_to_all(&i, &mut o),
            false => comm.all_to_all_v(&i, &mut o, &self.counts),
        }
        .map(|()| peercomm::Algorithm::OneStage)
    }
    fn check(
        &self,
        comm: &SingleController<B>,
        outcome: &peercomm::Result<peercomm::Algorithm>,
        what: &str,
    ) {
        ran(outcome, what);
        let world = comm.world_size();
        for (q, out) in self.outs.iter().enumerate() {
            let got = B::download(comm.core(q).device(), out).expect("download");
            let want: Vec<T> = (0..world)
                .flat_map(|r| {
                    let start: usize = self.counts[r][..q].iter().sum();
                    self.ins[r][start..start + self.counts[r][q]].to_vec()
                })
                .collect();
            assert_bits(&got, &want, &format!("{what}, rank {q}"));
        }
    }
    fn describe(&self, world: usize) -> String {
        format!(
            "all-to-all {:?} world {world} counts {:?}",
            T::DTYPE,
            self.counts
        )
    }
    fn bytes(&self) -> usize {
        self.ins[0].len() * std::mem::size_of::<T>()
    }
    fn collective(&self) -> Option<&'static str> {
        Some(match self.equal() {
            true => "all_to_all",
            false => "all_to_all_v",
        })
    }
}
