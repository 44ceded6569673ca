//! Bad input, generic over the backend: each case asserts the exact typed
//! [`peercomm::Error`] and that nothing was written (outputs poisoned with NaN are still
//! NaN after the failed call, in-place data and inputs are bit-for-bit unchanged), then
//! that the communicator still works (nothing was half-launched: a barrier launched on
//! some ranks only would hang the next call).

use std::time::Duration;

use peercomm::backend::Backend;
use peercomm::{
    dispatch, Algorithm, AllReduceOptions, CommConfig, Communicator, DType, Element, Error,
    Result, Tensor, TensorMut, MAX_GPUS, MAX_NUM_BLOCKS_UPPER_BOUND,
};
use rand::rngs::StdRng;

use super::{open, random_values, rng, run_case};

/// Small scratch (the suite's 4 MiB slots would be refilled with the sentinel for
/// every test) with a timeout that turns a hang into a failure.
fn config(lamport_slot_bytes: usize, payload_bytes: usize) -> CommConfig {
    CommConfig {
        lamport_slot_bytes,
        payload_bytes,
        barrier_timeout: Some(Duration::from_secs(60)),
        max_blocks: Some(3),
        ..CommConfig::default()
    }
}

fn comm<B: Backend>(world: usize) -> Communicator<B> {
    open::<B>(world, config(64 << 10, 64 << 10))
}

/// A buffer on `dev` holding `values`.
fn filled<B: Backend, T: Element>(dev: &B::Device, values: &[T]) -> B::Buffer<T> {
    let mut b = B::alloc_buffer::<T>(dev, values.len()).unwrap();
    B::upload(dev, values, &mut b).unwrap();
    b
}

/// One rank's buffers: a random input (and the values it holds), a NaN output.
struct RankBufs<B: Backend, T: Element> {
    input: B::Buffer<T>,
    values: Vec<T>,
    output: B::Buffer<T>,
}

impl<B: Backend, T: Element> RankBufs<B, T> {
    fn new(dev: &B::Device, rng: &mut StdRng, len: usize, out_len: usize) -> Self {
        let values = random_values::<T>(rng, len);
        RankBufs {
            input: filled::<B, T>(dev, &values),
            values,
            output: filled::<B, T>(dev, &vec![T::from_f32(f32::NAN); out_len]),
        }
    }

    /// The input still holds its values and the output is still all NaN.
    fn assert_untouched(&self, dev: &B::Device, what: &str) {
        let got = B::download(dev, &self.input).unwrap();
        assert!(
            got.iter()
                .zip(&self.values)
                .all(|(a, b)| a.to_bits_u32() == b.to_bits_u32())
                && got.len() == self.values.len(),
            "{what}: the input (or in-place data) was written"
        );
        let out = B::download(dev, &self.output).unwrap();
        assert!(
            out.iter().all(|x| x.to_f32().is_nan()),
            "{what}: the output was written"
        );
    }
}

/// Random f32 buffers on every rank's own device, input length `lens[r]`, output
/// length `out_lens[r]`.
fn rank_bufs<B: Backend>(
    comm: &Communicator<B>,
    rng: &mut StdRng,
    lens: &[usize],
    out_lens: &[usize],
) -> Vec<RankBufs<B, f32>> {
    comm.ranks()
        .iter()
        .enumerate()
        .map(|(r, rank)| RankBufs::new(rank.device(), rng, lens[r], out_lens[r]))
        .collect()
}

/// Out-of-place over `bufs` with the given shapes (`None`: flat).
fn out_of_place<B: Backend>(
    comm: &Communicator<B>,
    bufs: &mut [RankBufs<B, f32>],
    shapes: Option<&[&[usize]]>,
    out_shapes: Option<&[&[usize]]>,
    opts: &AllReduceOptions,
) -> Result<Algorithm> {
    let (ins, outs): (Vec<_>, Vec<_>) = bufs
        .iter_mut()
        .map(|b| (&b.input, &mut b.output))
        .unzip();
    let ins: Vec<Tensor<B>> = ins
        .into_iter()
        .enumerate()
        .map(|(r, b)| match shapes {
            Some(s) => Tensor::new(b, s[r]),
            None => Tensor::flat(b),
        })
        .collect();
    let mut outs: Vec<TensorMut<B>> = outs
        .into_iter()
        .enumerate()
        .map(|(r, b)| match out_shapes {
            Some(s) => TensorMut::new(b, s[r]),
            None => TensorMut::flat(b),
        })
        .collect();
    comm.all_reduce_sum(&ins, &mut outs, opts)
}

/// In place over the inputs of `bufs` with the given shapes (`None`: flat).
fn in_place<B: Backend>(
    comm: &Communicator<B>,
    bufs: &mut [RankBufs<B, f32>],
    shapes: Option<&[&[usize]]>,
    opts: &AllReduceOptions,
) -> Result<Algorithm> {
    let mut ts: Vec<TensorMut<B>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(r, b)| match shapes {
            Some(s) => TensorMut::new(&mut b.input, s[r]),
            None => TensorMut::flat(&mut b.input),
        })
        .collect();
    comm.all_reduce_sum_in_place(&mut ts, opts)
}

/// After a refused call: the queues are clean, nothing was written, and the
/// communicator still runs a (checked) all-reduce.
fn assert_nothing_written<B: Backend>(
    comm: &Communicator<B>,
    bufs: &[RankBufs<B, f32>],
    what: &str,
) {
    comm.synchronize()
        .unwrap_or_else(|e| panic!("{what}: synchronize after a refused call: {e}"));
    for (b, rank) in bufs.iter().zip(comm.ranks()) {
        b.assert_untouched(rank.device(), what);
    }
}

fn assert_still_works<B: Backend>(comm: &Communicator<B>, rng: &mut StdRng) {
    run_case::<B, f32>(comm, rng, Algorithm::Auto, 0, 33, false);
    run_case::<B, f32>(comm, rng, Algorithm::Auto, 0, 33, true);
}

#[track_caller]
fn assert_err(got: Result<Algorithm>, expected: Error, what: &str) {
    assert_eq!(got, Err(expected), "{what}");
}

#[track_caller]
fn assert_length_mismatch(got: Result<Algorithm>, rank: usize, what: &str) {
    match got {
        Err(Error::LengthMismatch { rank: r, .. }) if r == rank => {}
        other => panic!("{what}: expected LengthMismatch on rank {rank}, got {other:?}"),
    }
}

/// Ranks pass flat tensors of different lengths: a shape mismatch, found before any
/// rank's launch.
pub fn lengths_differ_across_ranks<B: Backend>() {
    let mut rng = rng("lengths_differ_across_ranks");
    let comm = comm::<B>(2);
    let expected = Error::ShapeMismatch {
        rank: 1,
        expected: vec![6],
        got: vec![7],
    };
    let mut bufs = rank_bufs(&comm, &mut rng, &[6, 7], &[6, 7]);
    let opts = AllReduceOptions::new();
    assert_err(
        out_of_place(&comm, &mut bufs, None, None, &opts),
        expected.clone(),
        "out-of-place",
    );
    assert_nothing_written(&comm, &bufs, "lengths differ, out-of-place");
    assert_err(in_place(&comm, &mut bufs, None, &opts), expected, "in-place");
    assert_nothing_written(&comm, &bufs, "lengths differ, in-place");
    assert_still_works(&comm, &mut rng);
}

/// Same element count, different shapes ([2, 3] and [3, 2]).
pub fn shapes_differ_across_ranks<B: Backend>() {
    let mut rng = rng("shapes_differ_across_ranks");
    let comm = comm::<B>(2);
    let expected = Error::ShapeMismatch {
        rank: 1,
        expected: vec![2, 3],
        got: vec![3, 2],
    };
    let shapes: &[&[usize]] = &[&[2, 3], &[3, 2]];
    let mut bufs = rank_bufs(&comm, &mut rng, &[6, 6], &[6, 6]);
    let opts = AllReduceOptions::new();
    assert_err(
        out_of_place(&comm, &mut bufs, Some(shapes), Some(shapes), &opts),
        expected.clone(),
        "out-of-place",
    );
    assert_nothing_written(&comm, &bufs, "shapes differ, out-of-place");
    assert_err(
        in_place(&comm, &mut bufs, Some(shapes), &opts),
        expected,
        "in-place",
    );
    assert_nothing_written(&comm, &bufs, "shapes differ, in-place");
    assert_still_works(&comm, &mut rng);
}

/// Rank 0 passes f32, rank 1 f16; and, separately, an output whose dtype differs from
/// its input.
pub fn dtypes_differ_across_ranks<B: Backend>() {
    let mut rng = rng("dtypes_differ_across_ranks");
    let comm = comm::<B>(2);
    let (d0, d1) = (comm.rank(0).device(), comm.rank(1).device());
    let mut r0 = RankBufs::<B, f32>::new(d0, &mut rng, 8, 8);
    let mut r1 = RankBufs::<B, half::f16>::new(d1, &mut rng, 8, 8);
    let expected = Error::DTypeMismatch {
        rank: 1,
        expected: DType::F32,
        got: DType::F16,
    };
    let opts = AllReduceOptions::new();
    {
        let ins: Vec<Tensor<B>> = vec![Tensor::flat(&r0.input), Tensor::flat(&r1.input)];
        let mut outs: Vec<TensorMut<B>> =
            vec![TensorMut::flat(&mut r0.output), TensorMut::flat(&mut r1.output)];
        assert_eq!(
            comm.all_reduce_sum(&ins, &mut outs, &opts),
            Err(expected.clone()),
            "out-of-place"
        );
    }
    {
        let mut ts: Vec<TensorMut<B>> =
            vec![TensorMut::flat(&mut r0.input), TensorMut::flat(&mut r1.input)];
        assert_eq!(
            comm.all_reduce_sum_in_place(&mut ts, &opts),
            Err(expected),
            "in-place"
        );
    }
    comm.synchronize().unwrap();
    r0.assert_untouched(d0, "dtypes differ (rank 0)");
    r1.assert_untouched(d1, "dtypes differ (rank 1)");

    // All inputs f32, rank 1's output bf16.
    let mut bufs = rank_bufs(&comm, &mut rng, &[8, 8], &[8, 8]);
    let mut bf_out = filled::<B, half::bf16>(d1, &[half::bf16::NAN; 8]);
    {
        let ins: Vec<Tensor<B>> = bufs.iter().map(|b| Tensor::flat(&b.input)).collect();
        let mut outs: Vec<TensorMut<B>> = vec![
            TensorMut::flat(&mut bufs[0].output),
            TensorMut::flat(&mut bf_out),
        ];
        assert_eq!(
            comm.all_reduce_sum(&ins, &mut outs, &opts),
            Err(Error::DTypeMismatch {
                rank: 1,
                expected: DType::F32,
                got: DType::BF16,
            }),
            "output dtype differs from input"
        );
    }
    assert_nothing_written(&comm, &bufs, "output dtype differs");
    assert!(B::download(d1, &bf_out)
        .unwrap()
        .iter()
        .all(|x| x.is_nan()));
    assert_still_works(&comm, &mut rng);
}

/// An output longer (or shorter) than its input.
pub fn output_length_differs_from_input<B: Backend>() {
    let mut rng = rng("output_length_differs_from_input");
    let comm = comm::<B>(1);
    for out_len in [9, 7] {
        let mut bufs = rank_bufs(&comm, &mut rng, &[8], &[out_len]);
        assert_length_mismatch(
            out_of_place(&comm, &mut bufs, None, None, &AllReduceOptions::new()),
            0,
            &format!("output of {out_len} for an input of 8"),
        );
        assert_nothing_written(&comm, &bufs, "output length differs");
    }
    assert_still_works(&comm, &mut rng);
}

/// A shape whose element count is not its buffer's length: on every rank, and on one
/// rank only.
pub fn shape_product_differs_from_buffer<B: Backend>() {
    let mut rng = rng("shape_product_differs_from_buffer");
    let comm = comm::<B>(2);
    let opts = AllReduceOptions::new();
    // [2, 4] = 8 elements over buffers of 6, on both ranks.
    let shapes: &[&[usize]] = &[&[2, 4], &[2, 4]];
    let mut bufs = rank_bufs(&comm, &mut rng, &[6, 6], &[6, 6]);
    assert_length_mismatch(
        out_of_place(&comm, &mut bufs, Some(shapes), Some(shapes), &opts),
        0,
        "out-of-place, every rank",
    );
    assert_length_mismatch(
        in_place(&comm, &mut bufs, Some(shapes), &opts),
        0,
        "in-place, every rank",
    );
    assert_nothing_written(&comm, &bufs, "shape product differs (every rank)");
    // Same shape [6] everywhere, but rank 1's buffers hold 7.
    let shapes: &[&[usize]] = &[&[6], &[6]];
    let mut bufs = rank_bufs(&comm, &mut rng, &[6, 7], &[6, 7]);
    assert_length_mismatch(
        out_of_place(&comm, &mut bufs, Some(shapes), Some(shapes), &opts),
        1,
        "out-of-place, rank 1",
    );
    assert_length_mismatch(
        in_place(&comm, &mut bufs, Some(shapes), &opts),
        1,
        "in-place, rank 1",
    );
    // Only the output's shape is wrong.
    let mut bufs2 = rank_bufs(&comm, &mut rng, &[6, 6], &[6, 6]);
    assert_length_mismatch(
        out_of_place(&comm, &mut bufs2, None, Some(&[&[6], &[2, 4]]), &opts),
        1,
        "output shape, rank 1",
    );
    assert_nothing_written(&comm, &bufs, "shape product differs (rank 1)");
    assert_nothing_written(&comm, &bufs2, "output shape product differs");
    assert_still_works(&comm, &mut rng);
}

/// group_size 3 (does not divide 2) and 4 (larger than the world), for both kinds of
/// all-reduce and the barrier.
pub fn group_size_does_not_divide_world<B: Backend>() {
    let mut rng = rng("group_size_does_not_divide_world");
    let comm = comm::<B>(2);
    let mut bufs = rank_bufs(&comm, &mut rng, &[64, 64], &[64, 64]);
    for group_size in [3, 4, 2 * MAX_GPUS] {
        let expected = Error::InvalidGroupSize {
            group_size,
            world: 2,
        };
        let opts = AllReduceOptions::new().group_size(group_size);
        let what = format!("group_size {group_size}");
        assert_err(
            out_of_place(&comm, &mut bufs, None, None, &opts),
            expected.clone(),
            &what,
        );
        assert_err(in_place(&comm, &mut bufs, None, &opts), expected.clone(), &what);
        assert_eq!(comm.barrier(group_size), Err(expected), "{what}: barrier");
    }
    assert_nothing_written(&comm, &bufs, "group size does not divide");
    assert_still_works(&comm, &mut rng);
}

/// No devices, and more than `MAX_GPUS`: refused before any device is opened (9
/// ordinals: a backend with 8 devices would otherwise fail to open the 9th with another
/// error, and one without devices would report that it has none).
pub fn world_size_0_and_9() {
    fn check<B: Backend>() {
        let too_many: Vec<usize> = (0..=MAX_GPUS).collect();
        for ordinals in [&[][..], &too_many[..]] {
            match Communicator::<B>::new(ordinals, CommConfig::default()) {
                Err(e) => assert_eq!(
                    e,
                    Error::InvalidWorldSize {
                        got: ordinals.len(),
                        max: MAX_GPUS
                    }
                ),
                Ok(_) => panic!("a communicator over {} devices", ordinals.len()),
            }
        }
        match Communicator::<B>::from_devices(Vec::new(), CommConfig::default()) {
            Err(e) => assert_eq!(e, Error::InvalidWorldSize { got: 0, max: MAX_GPUS }),
            Ok(_) => panic!("a communicator over no devices"),
        }
    }
    check_world_size_fn::<fn()>(check::<peercomm::backend::host::Host>);
}

/// Runs a world-size check (kept generic so the macro can pass its backend).
pub fn world_size_0_and_9_on<B: Backend>() {
    let too_many: Vec<usize> = (0..=MAX_GPUS).collect();
    for ordinals in [&[][..], &too_many[..]] {
        match Communicator::<B>::new(ordinals, CommConfig::default()) {
            Err(e) => assert_eq!(
                e,
                Error::InvalidWorldSize {
                    got: ordinals.len(),
                    max: MAX_GPUS
                },
                "{} ordinals",
                ordinals.len()
            ),
            Ok(_) => panic!("a communicator over {} devices", ordinals.len()),
        }
    }
    match Communicator::<B>::from_devices(Vec::new(), CommConfig::default()) {
        Err(e) => assert_eq!(
            e,
            Error::InvalidWorldSize {
                got: 0,
                max: MAX_GPUS
            }
        ),
        Ok(_) => panic!("a communicator over no devices"),
    }
}

fn check_world_size_fn<F>(f: fn()) {
    f()
}
