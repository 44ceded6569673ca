//! The per-rank `Comm`'s other collectives and the fused call, one thread per rank:
//! inputs rebuilt from a shared seed, outputs poisoned and checked against
//! tests/common/collectives.rs (fused bits compared by digest); then bad inputs.

use peercomm::backend::Backend;
use peercomm::{CollectiveOptions, Comm, DType, Element, Error, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::common::collectives::{
    assert_bits, check_rms_norm, expect, input_len, output_len, Which,
};
use super::common::{digest, group_sizes, random_inputs, random_values};
use super::{common, inputs, nan, seed, with_world, Placement};

fn upload<B: Backend, T: Element>(dev: &B::Device, v: &[T]) -> B::Buffer<T> {
    B::alloc_from(dev, v).expect("alloc")
}

fn poisoned<B: Backend, T: Element>(dev: &B::Device, len: usize) -> B::Buffer<T> {
    upload::<B, T>(dev, &nan(len))
}

/// One call of `which` on this rank, checked against the reference.
pub(super) fn check_call<B: Backend, T: Element>(
    comm: &Comm<B>,
    seed: u64,
    call: usize,
    which: Which,
    width: usize,
    n: usize,
) {
    let (world, rank) = (comm.world_size(), comm.rank());
    let len = input_len(which, width, n);
    let ins = inputs::<T>(seed, call, world, len);
    let dev = comm.device();
    let send = upload::<B, T>(dev, &ins[rank]);
    let opts = CollectiveOptions::new().group_size(width);
    let what = format!(
        "per-rank {which:?} {:?} world {world} group {width} n {n} rank {rank}",
        T::DTYPE
    );
    let is_root = |root: usize| rank % width == root;
    let out = match which {
        Which::Broadcast {
            root,
            in_place: true,
        } => {
            let mut buf = if is_root(root) {
                upload::<B, T>(dev, &ins[rank])
            } else {
                poisoned::<B, T>(dev, len)
            };
            comm.broadcast_in_place_with(&mut buf, root, &opts)
                .expect(&what);
            buf
        }
        _ => {
            let mut recv = poisoned::<B, T>(dev, output_len(which, width, rank, len));
            match which {
                Which::AllGather => comm.all_gather_with(&send, &mut recv, &opts),
                Which::ReduceScatter => {
                    comm.reduce_scatter_with(&send, &mut recv, &ReduceOp::Sum, &opts)
                }
                Which::Broadcast { root, .. } => {
                    comm.broadcast_with(is_root(root).then_some(&send), &mut recv, root, &opts)
                }
                Which::Scatter { root } => {
                    comm.scatter_with(is_root(root).then_some(&send), &mut recv, root, &opts)
                }
                // Every rank passes its output: a non-root's is left as it was.
                Which::Reduce { root } => {
                    comm.reduce_with(&send, Some(&mut recv), &ReduceOp::Sum, root, &opts)
                }
            }
            .expect(&what);
            recv
        }
    };
    comm.synchronize().expect(&what);
    let got = B::download(dev, &out).expect("download");
    assert_bits(&got, &expect(which, &ins, width, rank), &what);
}

/// One fused call on this rank: the f64 reference, and a digest of its outputs.
pub(super) fn check_fused<B: Backend, T: Element>(
    comm: &Comm<B>,
    seed: u64,
    call: usize,
    width: usize,
    tokens: usize,
    hidden: usize,
) -> u64 {
    let (world, rank) = (comm.world_size(), comm.rank());
    let mut rng = StdRng::seed_from_u64(seed ^ ((call as u64) << 24));
    let n = tokens * hidden;
    let ins: Vec<Vec<T>> = random_inputs::<T>(&mut rng, world, n);
    let residual: Vec<T> = random_values::<T>(&mut rng, n);
    let weight: Vec<T> = random_values::<T>(&mut rng, hidden);
    let epsilon = rng.random_range(1e-6f32..1e-3);
    let dev = comm.device();
    let input = upload::<B, T>(dev, &ins[rank]);
    let w = upload::<B, T>(dev, &weight);
    let mut res = upload::<B, T>(dev, &residual);
    let mut out = poisoned::<B, T>(dev, n);
    let what = format!(
        "per-rank fused {:?} world {world} group {width} {tokens}x{hidden} rank {rank}",
        T::DTYPE
    );
    let opts = CollectiveOptions::new().group_size(width);
    comm.all_reduce_residual_rms_norm(&input, &mut res, &w, &mut out, epsilon, &opts)
        .expect(&what);
    comm.synchronize().expect(&what);
    let (out, res) = (
        B::download(dev, &out).unwrap(),
        B::download(dev, &res).unwrap(),
    );
    check_rms_norm(
        &ins, &residual, &weight, width, rank, epsilon, &out, &res, &what,
    );
    digest(&[out, res].concat())
}

/// Every collective x dtype x group size x odd lengths, then the fused kernel; the
/// fused outputs agree bit for bit across each group.
pub fn checked<B: Backend>(place: &Placement, world: usize) {
    let seed = seed(&format!("per_rank_collectives_world_{world}"));
    let digests = with_world::<B, _>(place, world, |_rank, comm| {
        let mut call = 0;
        for width in group_sizes(world) {
            let mut whiches = vec![Which::AllGather, Which::ReduceScatter];
            for root in [0, width - 1] {
                let in_place = root != 0;
                whiches.extend([Which::Broadcast { root, in_place }, Which::Scatter { root }]);
                whiches.push(Which::Reduce { root });
            }
            for n in [1usize, 7, 1023, 4099, 65_537] {
                for &which in &whiches {
                    check_call::<B, f32>(&comm, seed, call, which, width, n);
                    check_call::<B, half::f16>(&comm, seed, call + 1, which, width, n);
                    check_call::<B, half::bf16>(&comm, seed, call + 2, which, width, n);
                    call += 3;
                }
            }
            // The other element types, at odd lengths (a tail and several packs).
            for n in [7usize, 4099] {
                for &which in &whiches {
                    for dtype in DType::ALL.into_iter().filter(|d| !common::every_kernel(*d)) {
                        by_dtype!(dtype, check_call::<B>(&comm, seed, call, which, width, n));
                        call += 1;
                    }
                }
            }
        }
        let mut digests = Vec::new();
        for width in group_sizes(world) {
            for (tokens, hidden) in [(1, 4096), (7, 1032), (2, 16384)] {
                let (c, w) = (&comm, width);
                let bf = check_fused::<B, half::bf16>(c, seed, call, w, tokens, hidden);
                let h = check_fused::<B, half::f16>(c, seed, call + 1, w, tokens, hidden);
                digests.extend([bf, h]);

                call += 2;
            }
        }
        digests
    });
    for (i, w) in group_sizes(world).into_iter().enumerate() {
        let per_width = digests[0].len() / group_sizes(world).len();
        for r in 0..world {
            let lead = r / w * w;
            assert_eq!(
                digests[r][i * per_width..(i + 1) * per_width],
                digests[lead][i * per_width..(i + 1) * per_width],
                "fused outputs of rank {r} differ from rank {lead}'s (group {w})"
            );
        }
    }
}

/// The per-rank bad-input matrix on a world of 2: typed errors, nothing written, and
/// the communicator still works after them (a call every rank makes).
pub fn bad_inputs<B: Backend>(place: &Placement) {
    with_world::<B, _>(place, 2, |rank, comm| {
        let dev = comm.device();
        let opts = CollectiveOptions::new();
        let send = upload::<B, f32>(dev, &[1.0 + rank as f32; 10]);
        let untouched = |b: &B::Buffer<f32>, what: &str| {
            comm.synchronize().unwrap();
            let nans = B::download(dev, b).unwrap().iter().all(|x| x.is_nan());
            assert!(nans, "{what}: written");
        };
        let mut recv = poisoned::<B, f32>(dev, 19);
        let e = comm.all_gather_with(&send, &mut recv, &opts).unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        untouched(&recv, "all-gather output size");
        let mut recv = poisoned::<B, f32>(dev, 6);
        let e = comm
            .reduce_scatter_with(&send, &mut recv, &ReduceOp::Sum, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        untouched(&recv, "reduce-scatter output size");
        let mut recv = poisoned::<B, f32>(dev, 10);
        let e = comm
            .broadcast_with(Some(&send), &mut recv, 2, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidRoot { root: 2, width: 2 }), "{e}");
        let e = comm
            .scatter_with(Some(&send), &mut recv, 9, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidRoot { root: 9, width: 2 }), "{e}");
        let e = comm
            .broadcast_with(None, &mut recv, rank, &opts)
            .unwrap_err();
        let holds = matches!(e, Error::Unsupported(_));
        assert!(holds, "the root without input: {e}");
        let e = comm.broadcast_with(Some(&send), &mut poisoned::<B, f32>(dev, 9), rank, &opts);
        assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
        untouched(&recv, "broadcast refusals");
        let mut part = poisoned::<B, f32>(dev, 4);
        let e = comm
            .scatter_with(Some(&send), &mut part, rank, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        untouched(&part, "scatter output size");
        // The fused kernel chunks by whole rows: two rows of 2 MiB + 16 bytes fit
        // neither whole nor a row per half of the 4 MiB payload.
        let hidden = (1 << 20) + 8;
        let x = upload::<B, half::bf16>(dev, &vec![half::bf16::ONE; 2 * hidden]);
        let w = upload::<B, half::bf16>(dev, &vec![half::bf16::ONE; hidden]);
        let mut res = poisoned::<B, half::bf16>(dev, 2 * hidden);
        let mut out = poisoned::<B, half::bf16>(dev, 2 * hidden);
        let e = comm
            .all_reduce_residual_rms_norm(&x, &mut res, &w, &mut out, 1e-5, &opts)
            .unwrap_err();
        let two_rows = 2 * hidden * 2;
        assert_eq!(
            e,
            Error::MessageTooLarge {
                algorithm: "allreduce_rmsnorm",
                needed: two_rows,
                available: 4 << 20,
                setting: "payload_bytes",
            }
        );
        comm.synchronize().unwrap();
        for b in [&res, &out] {
            let nans = B::download(dev, b).unwrap().iter().all(|x| x.is_nan());
            assert!(nans, "fused rows larger than half the payload: written");
        }
        // Fused: hidden not whole packs; residual of the wrong length.
        let x = upload::<B, half::bf16>(dev, &[half::bf16::ONE; 64]);
        let w12 = upload::<B, half::bf16>(dev, &[half::bf16::ONE; 12]);
        let w16 = upload::<B, half::bf16>(dev, &[half::bf16::ONE; 16]);
        let mut res = poisoned::<B, half::bf16>(dev, 64);
        let mut out = poisoned::<B, half::bf16>(dev, 64);
        let e = comm
            .all_reduce_residual_rms_norm(&x, &mut res, &w12, &mut out, 1e-5, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        let mut short = poisoned::<B, half::bf16>(dev, 56);
        let e = comm
            .all_reduce_residual_rms_norm(&x, &mut short, &w16, &mut out, 1e-5, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        comm.synchronize().unwrap();
        for b in [&res, &out, &short] {
            let nans = B::download(dev, b).unwrap().iter().all(|x| x.is_nan());
            assert!(nans, "fused refusal wrote");
        }
        // Still usable: a good all-gather.
        let mut recv = poisoned::<B, f32>(dev, 20);
        comm.all_gather_with(&send, &mut recv, &opts).unwrap();
        comm.synchronize().unwrap();
        let got = B::download(dev, &recv).unwrap();
        assert_eq!(got, [vec![1.0; 10], vec![2.0; 10]].concat());
    });
}
