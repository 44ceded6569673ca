//! Bad input, generic over the backend: each case asserts the exact typed error, that
//! nothing was written (poisoned outputs stay NaN, inputs unchanged), and that the
//! communicator still works (nothing half-launched, which would hang the next call).

use std::time::Duration;

use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use peercomm::{
    unstable, Algorithm, AllReduceOptions, CommConfig, DType, Element, Error, ReduceOp, Result,
    SingleController, TensorView, TensorViewMut, MAX_GPUS, MAX_NUM_BLOCKS_UPPER_BOUND,
};
use rand::rngs::StdRng;

use super::{open, poisoned, random_values, rng, run_case, run_case_dtype, upload, Call};

/// Small scratch (the suite's 4 MiB slots would be refilled with the sentinel for
/// every test) with a timeout that turns a hang into a failure.
fn config(lamport_slot_bytes: usize, payload_bytes: usize) -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(lamport_slot_bytes)
        .with_payload_bytes(payload_bytes)
        .with_barrier_timeout(Some(Duration::from_secs(60)))
        .with_max_blocks(Some(3))
}

fn comm<B: Backend>(world: usize) -> SingleController<B> {
    open::<B>(world, config(64 << 10, 64 << 10))
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
            input: upload::<B, T>(dev, &values),
            values,
            output: poisoned::<B, T>(dev, out_len),
        }
    }

    /// The input still holds its values and the output is still all NaN.
    fn assert_untouched(&self, dev: &B::Device, what: &str) {
        let (input, output) = (&self.input, Some(&self.output));
        super::assert_unwritten::<B, T>(dev, input, &self.values, output, what);
    }
}

/// Random f32 buffers on every rank's own device, input length `lens[r]`, output
/// length `out_lens[r]`.
fn rank_bufs<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    lens: &[usize],
    out_lens: &[usize],
) -> Vec<RankBufs<B, f32>> {
    comm.cores()
        .iter()
        .enumerate()
        .map(|(r, rank)| RankBufs::new(rank.device(), rng, lens[r], out_lens[r]))
        .collect()
}

/// The two ranks' buffers of a world of two.
fn pair<B: Backend>(
    bufs: &mut [RankBufs<B, f32>],
) -> (&mut RankBufs<B, f32>, &mut RankBufs<B, f32>) {
    let [a, b] = bufs else {
        unreachable!("two ranks")
    };
    (a, b)
}

/// Out-of-place over `bufs` with the given shapes (`None`: flat).
fn out_of_place<B: Backend>(
    comm: &SingleController<B>,
    bufs: &mut [RankBufs<B, f32>],
    shapes: Option<&[&[usize]]>,
    out_shapes: Option<&[&[usize]]>,
    opts: &AllReduceOptions,
) -> Result<Algorithm> {
    let (ins, outs): (Vec<_>, Vec<_>) = bufs.iter_mut().map(|b| (&b.input, &mut b.output)).unzip();
    let ins: Vec<TensorView<B>> = ins
        .into_iter()
        .enumerate()
        .map(|(r, b)| match shapes {
            Some(s) => TensorView::new(b, s[r]),
            None => TensorView::flat(b),
        })
        .collect();
    let mut outs: Vec<TensorViewMut<B>> = outs
        .into_iter()
        .enumerate()
        .map(|(r, b)| match out_shapes {
            Some(s) => TensorViewMut::new(b, s[r]),
            None => TensorViewMut::flat(b),
        })
        .collect();
    comm.all_reduce(&ins, &mut outs, &ReduceOp::Sum, opts)
}

/// A flat out-of-place all-reduce over `ins` and `outs`, one per rank.
fn sum<B: Backend>(
    comm: &SingleController<B>,
    ins: &[&dyn DeviceBuffer<B>],
    outs: &mut [&mut dyn DeviceBufferMut<B>],
) -> Result<Algorithm> {
    let ins: Vec<_> = ins.iter().map(|b| TensorView::flat(*b)).collect();
    let mut outs: Vec<_> = outs.iter_mut().map(|b| TensorViewMut::flat(*b)).collect();
    comm.all_reduce(&ins, &mut outs, &ReduceOp::Sum, &AllReduceOptions::new())
}

/// A flat in-place all-reduce over `ts`, one per rank.
fn sum_in_place<B: Backend>(
    comm: &SingleController<B>,
    ts: &mut [&mut dyn DeviceBufferMut<B>],
) -> Result<Algorithm> {
    let mut ts: Vec<_> = ts.iter_mut().map(|b| TensorViewMut::flat(*b)).collect();
    comm.all_reduce_in_place(&mut ts, &ReduceOp::Sum, &AllReduceOptions::new())
}

/// In place over the inputs of `bufs` with the given shapes (`None`: flat).
fn in_place<B: Backend>(
    comm: &SingleController<B>,
    bufs: &mut [RankBufs<B, f32>],
    shapes: Option<&[&[usize]]>,
    opts: &AllReduceOptions,
) -> Result<Algorithm> {
    let mut ts: Vec<TensorViewMut<B>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(r, b)| match shapes {
            Some(s) => TensorViewMut::new(&mut b.input, s[r]),
            None => TensorViewMut::flat(&mut b.input),
        })
        .collect();
    comm.all_reduce_in_place(&mut ts, &ReduceOp::Sum, opts)
}

/// After a refused call: the queues are clean, nothing was written, and the
/// communicator still runs a (checked) all-reduce.
fn assert_nothing_written<B: Backend>(
    comm: &SingleController<B>,
    bufs: &[RankBufs<B, f32>],
    what: &str,
) {
    comm.synchronize()
        .unwrap_or_else(|e| panic!("{what}: synchronize after a refused call: {e}"));
    for (b, rank) in bufs.iter().zip(comm.cores()) {
        b.assert_untouched(rank.device(), what);
    }
}

fn assert_still_works<B: Backend>(comm: &SingleController<B>, rng: &mut StdRng) {
    run_case::<B, f32>(comm, rng, Algorithm::Auto, 0, 33, false).unwrap();
    run_case::<B, f32>(comm, rng, Algorithm::Auto, 0, 33, true).unwrap();
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

/// One `#[test]` per bad-input case `case: devices it needs`, calling
/// `common::errors::<case>`. Used inside `reference_suite!`.
#[macro_export]
macro_rules! bad_input_tests {
    ($backend:ty, $($case:ident: $need:expr),+ $(,)?) => {$(
        #[test]
        fn $case() {
            if devices_or_skip(stringify!($case), $need) {
                common::errors::$case::<$backend>();
            }
        }
    )+};
}

/// Tensors of different lengths are `LengthMismatch` on rank 1 before any launch,
/// whether flat or with shapes (element counts decide, whatever the shapes say).
pub fn lengths_differ<B: Backend>() {
    let mut rng = rng("lengths_differ");
    let comm = comm::<B>(2);
    let mut bufs = rank_bufs(&comm, &mut rng, &[6, 7], &[6, 7]);
    let opts = AllReduceOptions::new();
    let explicit: &[&[usize]] = &[&[6], &[7]];
    let explicit_2d: &[&[usize]] = &[&[2, 3], &[7, 1]];
    for (form, shapes) in [
        ("flat", None),
        ("explicit [6]/[7]", Some(explicit)),
        ("explicit [2, 3]/[7, 1]", Some(explicit_2d)),
    ] {
        let what = format!("lengths differ, {form}, out-of-place");
        let got = out_of_place(&comm, &mut bufs, shapes, shapes, &opts);
        assert_length_mismatch(got, 1, &what);
        assert_nothing_written(&comm, &bufs, &what);
        let what = format!("lengths differ, {form}, in-place");
        assert_length_mismatch(in_place(&comm, &mut bufs, shapes, &opts), 1, &what);
        assert_nothing_written(&comm, &bufs, &what);
    }
    assert_still_works(&comm, &mut rng);
}

/// Same element count, different shapes ([2, 3] and [3, 2]).
pub fn shapes_differ<B: Backend>() {
    let mut rng = rng("shapes_differ");
    let comm = comm::<B>(2);
    let expected = Error::ShapeMismatch {
        rank: 1,
        expected: vec![2, 3],
        got: vec![3, 2],
    };
    let shapes: &[&[usize]] = &[&[2, 3], &[3, 2]];
    let mut bufs = rank_bufs(&comm, &mut rng, &[6, 6], &[6, 6]);
    let opts = AllReduceOptions::new();
    let got = out_of_place(&comm, &mut bufs, Some(shapes), Some(shapes), &opts);
    assert_err(got, expected.clone(), "out-of-place");
    assert_nothing_written(&comm, &bufs, "shapes differ, out-of-place");
    let got = in_place(&comm, &mut bufs, Some(shapes), &opts);
    assert_err(got, expected, "in-place");
    assert_nothing_written(&comm, &bufs, "shapes differ, in-place");
    assert_still_works(&comm, &mut rng);
}

/// Rank 0 passes f32, rank 1 f16; and, separately, an output whose dtype differs from
/// its input.
pub fn dtypes_differ<B: Backend>() {
    let mut rng = rng("dtypes_differ");
    let comm = comm::<B>(2);
    let (d0, d1) = (comm.core(0).device(), comm.core(1).device());
    let mut r0 = RankBufs::<B, f32>::new(d0, &mut rng, 8, 8);
    let mut r1 = RankBufs::<B, half::f16>::new(d1, &mut rng, 8, 8);
    let (expected, got) = (DType::F32, DType::F16);
    let expected = Error::DTypeMismatch {
        rank: 1,
        expected,
        got,
    };
    let got = sum(
        &comm,
        &[&r0.input, &r1.input],
        &mut [&mut r0.output, &mut r1.output],
    );
    assert_err(got, expected.clone(), "out-of-place");
    let got = sum_in_place(&comm, &mut [&mut r0.input, &mut r1.input]);
    assert_err(got, expected, "in-place");
    comm.synchronize().unwrap();
    r0.assert_untouched(d0, "dtypes differ (rank 0)");
    r1.assert_untouched(d1, "dtypes differ (rank 1)");

    // All inputs f32, rank 1's output bf16.
    let mut bufs = rank_bufs(&comm, &mut rng, &[8, 8], &[8, 8]);
    let mut bf_out = poisoned::<B, half::bf16>(d1, 8);
    let (a, b) = pair(&mut bufs);
    let got = sum(
        &comm,
        &[&a.input, &b.input],
        &mut [&mut a.output, &mut bf_out],
    );
    let (expected, got_dtype) = (DType::F32, DType::BF16);
    let expected = Error::DTypeMismatch {
        rank: 1,
        expected,
        got: got_dtype,
    };
    assert_err(got, expected, "output dtype differs from input");
    assert_nothing_written(&comm, &bufs, "output dtype differs");
    assert!(
        B::download(d1, &bf_out).unwrap().iter().all(|x| x.is_nan()),
        "output dtype differs: the bf16 output was written"
    );
    assert_still_works(&comm, &mut rng);
}

/// An output longer or shorter than its input.
pub fn output_length_differs_from_input<B: Backend>() {
    let mut rng = rng("output_length_differs_from_input");
    let comm = comm::<B>(2);
    for out_len in [9, 7] {
        let mut bufs = rank_bufs(&comm, &mut rng, &[8, 8], &[8, out_len]);
        assert_length_mismatch(
            out_of_place(&comm, &mut bufs, None, None, &AllReduceOptions::new()),
            1,
            &format!("rank 1's output of {out_len} for an input of 8"),
        );
        assert_nothing_written(&comm, &bufs, "output length differs");
    }
    assert_still_works(&comm, &mut rng);
}

/// A shape whose element count is not its buffer's length: on every rank, on one rank,
/// and on an output only.
pub fn shape_does_not_describe_buffer<B: Backend>() {
    let mut rng = rng("shape_does_not_describe_buffer");
    let comm = comm::<B>(2);
    let opts = AllReduceOptions::new();
    // [2, 4] = 8 elements over buffers of 6, on both ranks.
    let shapes: &[&[usize]] = &[&[2, 4], &[2, 4]];
    let mut every = rank_bufs(&comm, &mut rng, &[6, 6], &[6, 6]);
    let got = out_of_place(&comm, &mut every, Some(shapes), Some(shapes), &opts);
    assert_length_mismatch(got, 0, "out-of-place, every rank");
    let got = in_place(&comm, &mut every, Some(shapes), &opts);
    assert_length_mismatch(got, 0, "in-place, every rank");
    // Shape [6] everywhere, but rank 1's buffers hold 7.
    let shapes: &[&[usize]] = &[&[6], &[6]];
    let mut one = rank_bufs(&comm, &mut rng, &[6, 7], &[6, 7]);
    let got = out_of_place(&comm, &mut one, Some(shapes), Some(shapes), &opts);
    assert_length_mismatch(got, 1, "out-of-place, rank 1");
    let got = in_place(&comm, &mut one, Some(shapes), &opts);
    assert_length_mismatch(got, 1, "in-place, rank 1");
    // Only rank 1's output shape is wrong.
    let mut output = rank_bufs(&comm, &mut rng, &[6, 6], &[6, 6]);
    let got = out_of_place(&comm, &mut output, None, Some(&[&[6], &[2, 4]]), &opts);
    assert_length_mismatch(got, 1, "output shape, rank 1");
    assert_nothing_written(&comm, &every, "shape does not describe buffer (every rank)");
    assert_nothing_written(&comm, &one, "shape does not describe buffer (rank 1)");
    assert_nothing_written(&comm, &output, "output shape does not describe buffer");
    assert_still_works(&comm, &mut rng);
}

/// group_size 3 (does not divide 2), 4 and 16 (larger than the world), for both kinds
/// of all-reduce and the barrier.
pub fn group_size_must_divide_world<B: Backend>() {
    let mut rng = rng("group_size_must_divide_world");
    let comm = comm::<B>(2);
    let mut bufs = rank_bufs(&comm, &mut rng, &[64, 64], &[64, 64]);
    for group_size in [3, 4, 2 * MAX_GPUS] {
        let expected = Error::InvalidGroupSize {
            group_size,
            world: 2,
        };
        let opts = AllReduceOptions::new().group_size(group_size);
        let what = format!("group_size {group_size}");
        let got = out_of_place(&comm, &mut bufs, None, None, &opts);
        assert_err(got, expected.clone(), &what);
        assert_err(
            in_place(&comm, &mut bufs, None, &opts),
            expected.clone(),
            &what,
        );
        assert_eq!(comm.barrier(group_size), Err(expected), "{what}: barrier");
    }
    assert_nothing_written(&comm, &bufs, "group size does not divide the world");
    assert_still_works(&comm, &mut rng);
}

/// No devices, and `MAX_GPUS + 1`, are refused before any device is opened; needs no
/// device, so it runs everywhere.
pub fn world_of_zero_or_nine<B: Backend>() {
    let invalid = |got| Some(Error::InvalidWorldSize { got, max: MAX_GPUS });
    let too_many: Vec<usize> = (0..=MAX_GPUS).collect();
    for ordinals in [&[][..], &too_many[..]] {
        let got = SingleController::<B>::new(ordinals, CommConfig::default()).err();
        assert_eq!(got, invalid(ordinals.len()), "{} ordinals", ordinals.len());
    }
    let got = SingleController::<B>::from_devices(Vec::new(), CommConfig::default()).err();
    assert_eq!(got, invalid(0), "no devices");
}

/// The same ordinal twice.
pub fn device_listed_twice<B: Backend>() {
    match SingleController::<B>::new(&[0, 0], config(64 << 10, 64 << 10)) {
        Err(Error::InvalidDevices(_)) => {}
        Err(e) => panic!("expected InvalidDevices, got {e:?}"),
        Ok(_) => panic!("a communicator over device 0 twice"),
    }
}

/// Scratch of 1 KiB Lamport slot and 4 KiB payload, a 16 KiB message: Lamport and
/// two-stage are refused with the sizes; one-stage runs (in place: in chunks).
pub fn message_larger_than_scratch<B: Backend>() {
    let mut rng = rng("message_larger_than_scratch");
    let comm = open::<B>(2, config(1024, 4096));
    let n = 4096; // f32: 16 KiB
    let mut bufs = rank_bufs(&comm, &mut rng, &[n, n], &[n, n]);
    let too_large = |algorithm, needed, available| Error::MessageTooLarge {
        algorithm,
        needed,
        available,
        setting: if algorithm == "lamport" {
            "lamport_slot_bytes"
        } else {
            "payload_bytes"
        },
    };
    // The query answers the same, launching nothing.
    let query = |algorithm, in_place| {
        let opts = AllReduceOptions::new().algorithm(algorithm);
        comm.algorithm_for(DType::F32, n, &opts, in_place)
    };
    let lamport_too_large = too_large("lamport", 16384 + 64, 1024);
    assert_eq!(query(Algorithm::Lamport, false), Err(lamport_too_large));
    let two_stage_too_large = too_large("two_stage", 8192, 4096);
    assert_eq!(query(Algorithm::TwoStage, false), Err(two_stage_too_large));
    for in_place in [false, true] {
        assert_eq!(
            query(Algorithm::OneStage, in_place),
            Ok(Algorithm::OneStage)
        );
    }
    // 1024 bytes of Lamport slot hold 60 packs and the 4-pack header: 240 f32 or 480
    // bf16 elements.
    let lamport = AllReduceOptions::new().algorithm(Algorithm::Lamport);
    assert_eq!(
        comm.algorithm_for(DType::BF16, 480, &lamport, false),
        Ok(Algorithm::Lamport)
    );
    assert_eq!(
        comm.algorithm_for(DType::BF16, 481, &lamport, false),
        Err(too_large("lamport", 1040, 1024))
    );
    // Two-stage keeps one partition of 16 KiB / 2 ranks in the payload.
    for (algorithm, expected) in [
        (Algorithm::Lamport, too_large("lamport", 16384 + 64, 1024)),
        (Algorithm::TwoStage, too_large("two_stage", 8192, 4096)),
    ] {
        let (opts, what) = (
            AllReduceOptions::new().algorithm(algorithm),
            algorithm.name(),
        );
        let got = out_of_place(&comm, &mut bufs, None, None, &opts);
        assert_err(got, expected.clone(), &format!("{what}, out-of-place"));
        let got = in_place(&comm, &mut bufs, None, &opts);
        assert_err(got, expected, &format!("{what}, in-place"));
    }
    assert_nothing_written(&comm, &bufs, "message larger than scratch");
    assert_eq!(
        run_case::<B, f32>(&comm, &mut rng, Algorithm::OneStage, 0, n, false),
        Ok(Algorithm::OneStage)
    );
    // In place, one-stage stages the message: in chunks, through the payload's halves.
    for dtype in DType::ALL {
        assert_eq!(
            run_case_dtype::<B>(&comm, &mut rng, dtype, Algorithm::OneStage, 0, n + 3, true),
            Ok(Algorithm::OneStage),
            "{dtype:?}"
        );
    }
    assert_still_works(&comm, &mut rng);
}

/// `Auto` skips an algorithm whose scratch is too small (1 KiB slot, 2 KiB payload):
/// 4 KiB runs one-stage out of place and two-stage in place (whole scratch first); a
/// message no scratch holds whole runs in place as one-stage in chunks.
pub fn auto_falls_back_to_what_fits<B: Backend>() {
    let mut rng = rng("auto_falls_back_to_what_fits");
    let comm = open::<B>(2, config(1024, 2048));
    let arch = comm.architecture().to_string();
    let n = 1024; // f32: 4 KiB
    let preferred = unstable::choose(&arch, 2, 4 * n);
    let out_of_place_ran =
        run_case::<B, f32>(&comm, &mut rng, Algorithm::Auto, 0, n, false).unwrap();
    if preferred == Algorithm::Lamport {
        assert_eq!(
            out_of_place_ran,
            Algorithm::OneStage,
            "out-of-place fallback"
        );
    } else {
        eprintln!(
            "auto_falls_back_to_what_fits: {arch} does not prefer Lamport at 4 KiB \
             ({}); only checking that Auto ran something that fits",
            preferred.name()
        );
        assert_ne!(out_of_place_ran, Algorithm::Lamport);
    }
    assert_eq!(
        run_case::<B, f32>(&comm, &mut rng, Algorithm::Auto, 0, n, true),
        Ok(Algorithm::TwoStage),
        "in-place fallback"
    );
    // 256 KiB fits no scratch whole: in place, one-stage in chunks (of 64 packs).
    assert_eq!(
        comm.algorithm_for(DType::F32, 1 << 16, &AllReduceOptions::new(), true),
        Ok(Algorithm::OneStage)
    );
    assert_eq!(
        run_case::<B, f32>(&comm, &mut rng, Algorithm::Auto, 0, (1 << 16) + 1, true),
        Ok(Algorithm::OneStage),
        "auto, in-place, chunked"
    );
    assert_still_works(&comm, &mut rng);
}

/// Rank 0's input (then rank 1's output, then rank 0's in-place tensor) allocated on
/// the other rank's device.
pub fn buffer_on_the_wrong_device<B: Backend>() {
    let mut rng = rng("buffer_on_the_wrong_device");
    let comm = comm::<B>(2);
    let (o0, o1) = (comm.core(0).ordinal(), comm.core(1).ordinal());
    let mut bufs = rank_bufs(&comm, &mut rng, &[64, 64], &[64, 64]);
    // Buffers of the same length and dtype, on the other rank's device.
    let mut stray_in = RankBufs::<B, f32>::new(comm.core(1).device(), &mut rng, 64, 64);
    let mut stray_out = RankBufs::<B, f32>::new(comm.core(0).device(), &mut rng, 64, 64);
    let wrong = |rank, which, expected, got| Error::WrongDevice {
        rank,
        which,
        expected,
        got,
    };
    let (a, b) = pair(&mut bufs);
    let got = sum(
        &comm,
        &[&stray_in.input, &b.input],
        &mut [&mut a.output, &mut b.output],
    );
    let what = "rank 0's input on rank 1's device";
    assert_err(got, wrong(0, "input", o0, o1), what);
    let got = sum(
        &comm,
        &[&a.input, &b.input],
        &mut [&mut a.output, &mut stray_out.output],
    );
    let what = "rank 1's output on rank 0's device";
    assert_err(got, wrong(1, "output", o1, o0), what);
    let got = sum_in_place(&comm, &mut [&mut stray_in.input, &mut b.input]);
    let what = "rank 0's in-place tensor on rank 1's device";
    assert_err(got, wrong(0, "in-place", o0, o1), what);
    comm.synchronize().unwrap();
    stray_in.assert_untouched(comm.core(1).device(), "stray input");
    stray_out.assert_untouched(comm.core(0).device(), "stray output");
    assert_nothing_written(&comm, &bufs, "buffer on the wrong device");
    assert_still_works(&comm, &mut rng);
}

/// Fewer or more tensors than ranks, inputs or outputs.
pub fn wrong_number_of_tensors<B: Backend>() {
    let mut rng = rng("wrong_number_of_tensors");
    let comm = comm::<B>(2);
    let mut bufs = rank_bufs(&comm, &mut rng, &[64, 64], &[64, 64]);
    let mut extra = RankBufs::<B, f32>::new(comm.core(0).device(), &mut rng, 64, 64);
    let count = |got| Error::WrongTensorCount { expected: 2, got };
    let (a, b) = pair(&mut bufs);
    let got = sum(&comm, &[&a.input], &mut [&mut a.output, &mut b.output]);
    assert_err(got, count(1), "1 input");
    let got = sum(&comm, &[&a.input, &b.input], &mut [&mut a.output]);
    assert_err(got, count(1), "1 output");
    assert_err(sum(&comm, &[], &mut []), count(0), "no tensors");
    let ts: &mut [&mut dyn DeviceBufferMut<B>] =
        &mut [&mut a.input, &mut b.input, &mut extra.input];
    assert_err(sum_in_place(&comm, ts), count(3), "3 in-place tensors");
    let got = sum_in_place(&comm, &mut ts[..1]);
    assert_err(got, count(1), "1 in-place tensor");
    comm.synchronize().unwrap();
    extra.assert_untouched(comm.core(0).device(), "extra tensor");
    assert_nothing_written(&comm, &bufs, "wrong number of tensors");
    assert_still_works(&comm, &mut rng);
}

/// `blocks` of 0 and above `MAX_NUM_BLOCKS_UPPER_BOUND`, for every algorithm.
pub fn block_count_out_of_range<B: Backend>() {
    let mut rng = rng("block_count_out_of_range");
    let comm = comm::<B>(2);
    let mut bufs = rank_bufs(&comm, &mut rng, &[64, 64], &[64, 64]);
    for blocks in [0, MAX_NUM_BLOCKS_UPPER_BOUND as u32 + 1, u32::MAX] {
        for algorithm in super::REQUESTS {
            let opts = AllReduceOptions::new().algorithm(algorithm).blocks(blocks);
            let what = format!("{} with {blocks} blocks", algorithm.name());
            for got in [
                out_of_place(&comm, &mut bufs, None, None, &opts),
                in_place(&comm, &mut bufs, None, &opts),
            ] {
                match got {
                    Err(Error::Unsupported(m)) if m.contains("blocks") => {}
                    other => panic!("{what}: expected Unsupported(blocks), got {other:?}"),
                }
            }
        }
    }
    assert_nothing_written(&comm, &bufs, "block count out of range");
    assert_still_works(&comm, &mut rng);
}

/// Whether `f` returned an error (as opposed to a value, or a panic), for sizes that
/// overflow: a panic fails the test with its message.
fn refused<T>(what: &str, f: impl FnOnce() -> Result<T>) {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Err(e)) => eprintln!("{what}: refused: {e}"),
        Ok(Ok(_)) => panic!("{what}: accepted; expected a typed error"),
        Err(_) => panic!("{what}: panicked; expected a typed error"),
    }
}

/// Slot or payload sizes whose signal size overflows `usize` are a typed error, not a
/// panic or a wrapped allocation (the payloads wrap to exactly the size without them,
/// so a missing check would pass silently).
pub fn signal_size_overflow_is_refused<B: Backend>() {
    let cases = [
        ("payload_bytes = usize::MAX", 64 << 10, usize::MAX),
        ("payload_bytes = usize::MAX - 15", 64 << 10, usize::MAX - 15),
        (
            "lamport_slot_bytes whose 24 slots overflow",
            (usize::MAX / 16) & !15,
            64 << 10,
        ),
        (
            "lamport_slot_bytes near usize::MAX",
            usize::MAX & !15,
            64 << 10,
        ),
    ];
    for (what, lamport_slot_bytes, payload_bytes) in cases {
        let config = config(64 << 10, 64 << 10)
            .with_lamport_slot_bytes(lamport_slot_bytes)
            .with_payload_bytes(payload_bytes);
        refused(what, || SingleController::<B>::new(&[0], config));
    }
}

/// A typed buffer whose byte size overflows `usize` is an error from `alloc_buffer`
/// (usize::MAX / 4 + 1 f32 wraps to 0 bytes).
pub fn buffer_of_overflowing_size_is_refused<B: Backend>() {
    let comm = comm::<B>(1);
    let dev = comm.core(0).device();
    refused("usize::MAX f32", || {
        B::alloc_buffer::<f32>(dev, usize::MAX).map(|_| ())
    });
    refused("usize::MAX / 4 + 1 f32 (2^64 bytes)", || {
        B::alloc_buffer::<f32>(dev, usize::MAX / 4 + 1).map(|_| ())
    });
    refused("usize::MAX / 2 + 1 bf16 (2^64 bytes)", || {
        B::alloc_buffer::<half::bf16>(dev, usize::MAX / 2 + 1).map(|_| ())
    });
    let mut rng = rng("buffer_of_overflowing_size_is_refused");
    run_case::<B, f32>(&comm, &mut rng, Algorithm::Auto, 0, 33, false).unwrap();
}

/// Barrier timeouts of `Duration::MAX` and just past `u64::MAX` ns saturate (a truncating
/// conversion would give about 1 ms): with rank 1 delayed 100 ms no rank gives up.
pub fn huge_barrier_timeout_saturates<B: Backend>() {
    let mut rng = rng("huge_barrier_timeout_saturates");
    for timeout in [
        Duration::MAX,
        Duration::from_nanos(u64::MAX) + Duration::from_millis(1),
    ] {
        let comm = SingleController::<B>::new(
            &[0, 1],
            config(64 << 10, 64 << 10).with_barrier_timeout(Some(timeout)),
        )
        .unwrap_or_else(|e| panic!("barrier_timeout {timeout:?}: {e}"));
        for algorithm in Algorithm::ALL {
            let ins = super::random_inputs::<f32>(&mut rng, 2, 1000);
            let opts = AllReduceOptions::new().algorithm(algorithm);
            let mut call = super::Prepared::<B, f32>::new(&comm, ins, false, opts);
            let what = format!("barrier_timeout {timeout:?}: {}", call.describe(2));
            // After the uploads (which wait for the rank's stream), so the call starts late.
            comm.delay_rank(1, Duration::from_millis(100)).unwrap();
            let outcome = call.enqueue(&comm);
            comm.synchronize()
                .unwrap_or_else(|e| panic!("{what}, rank 1 late by 100 ms: {e}"));
            call.check(&comm, &outcome, &what);
        }
    }
}
