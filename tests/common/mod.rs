//! The reference test suite, generic over the backend: `reference_suite!(Backend,
//! available, max_blocks, lengths)`; a test needing more devices skips with a reason.
//! Checks use the f64 reference on fresh inputs, poisoned outputs, bitwise equality
//! across each group and the sign of zero ([`check_result`]).

#![allow(dead_code)]

/// `$body` with `$t` the element type of `$dtype` (defined before the modules using it).
macro_rules! for_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        for_dtype!(@ $dtype, $t => $body; F32: f32, F16: half::f16, BF16: half::bf16,
            F64: f64, I8: i8, U8: u8, I32: i32, U32: u32, I64: i64, U64: u64)
    };
    (@ $dtype:expr, $t:ident => $body:expr; $($v:ident: $ty:ty),+) => {
        match $dtype {
            $(peercomm::DType::$v => { type $t = $ty; $body })+
            // `DType` is non-exhaustive.
            #[allow(unreachable_patterns)]
            other => unreachable!("no test type for {other:?}"),
        }
    };
}

pub mod collectives;
pub mod ergonomics;
pub mod errors;
pub mod fused;
pub mod fuzz;
pub mod hazards;
pub mod launch;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use peercomm::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use peercomm::Signal;
use peercomm::{
    unstable, Algorithm, AllReduceOptions, CallField, CommConfig, DType, Element, Error, ReduceOp,
    Result, SingleController, TensorView, TensorViewMut, MAX_GPUS, MAX_NUM_BLOCKS_UPPER_BOUND,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Prints a skip notice past the test harness's output capture, so a skipped GPU test
/// is visible in a normal `cargo test` run.
pub fn announce_skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// The devices `available` reports where there are at least `need`; else `None` after
/// a printed skip.
pub fn devices(
    test: &str,
    available: std::result::Result<usize, String>,
    need: usize,
) -> Option<usize> {
    let why = match available {
        Ok(n) if n >= need => return Some(n),
        Ok(n) => format!("needs {need} devices, has {n}"),
        Err(why) => why,
    };
    announce_skip(test, &why);
    None
}

/// The CUDA devices there are, or why none (no driver, or no device).
#[cfg(feature = "cuda")]
pub fn cuda_devices() -> std::result::Result<usize, String> {
    match peercomm::backend::cuda::Cuda::device_count() {
        Ok(0) => Err("no CUDA device".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA driver: {e}")),
    }
}

/// The bit patterns of `values` (the low 32 bits of an 8-byte type: [`bits64`]).
pub fn bits<T: Element>(values: &[T]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits_u32()).collect()
}

/// The whole bit patterns of `values`.
pub fn bits64<T: Element>(values: &[T]) -> Vec<u64> {
    values.iter().map(|x| x.to_bits_u64()).collect()
}

/// The element types every kernel family takes (the others run the one-stage
/// all-reduce, reduce and the other collectives only).
pub const EVERY_KERNEL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Whether every kernel family takes `dtype` (f32, f16, bf16).
pub fn every_kernel(dtype: DType) -> bool {
    EVERY_KERNEL.contains(&dtype)
}

/// What an output holds before a call writes it: a NaN for the floats (f32, f16, bf16:
/// `f32::NAN` rounded; f64: a NaN no operator stores), 0xa5 bytes for the integers.
pub fn poison<T: Element>() -> T {
    match T::DTYPE {
        DType::F64 => T::from_bits_u64(0x7ff4_0000_0000_00a5),
        d if d.is_float() => T::from_f32(f32::NAN),
        _ => T::from_bits_u64(0xa5a5_a5a5_a5a5_a5a5),
    }
}

/// An FNV-1a digest of the bit patterns of `values`: ranks compare results through it.
pub fn digest<T: Element>(values: &[T]) -> u64 {
    values.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ v.to_bits_u64()).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Asserts that every rank's result is `CallMismatch` naming `field`: the ranks that
/// agree name `odd`, `odd` names one of them, and the message has no stray spaces.
pub fn assert_every_rank_mismatched<T: std::fmt::Debug>(
    results: &[Result<T>],
    field: CallField,
    odd: usize,
    what: &str,
) {
    for (rank, got) in results.iter().enumerate() {
        match got {
            Err(
                e @ Error::CallMismatch {
                    rank: r,
                    peer,
                    field: f,
                    mine,
                    theirs,
                },
            ) => {
                assert_eq!(*r, rank, "{what}");
                assert_eq!(*f, field, "{what}: rank {rank}: {mine} / {theirs}");
                assert_eq!(
                    *peer == odd,
                    rank != odd,
                    "{what}: rank {rank}: peer {peer}"
                );
                let text = e.to_string();
                assert!(!text.contains("  "), "stray spaces: {text}");
            }
            other => panic!("{what}: rank {rank} got {other:?}, not a CallMismatch"),
        }
    }
    eprintln!("{what}: every rank got CallMismatch({field:?})");
}

/// A buffer on `dev` holding `values`.
pub fn upload<B: Backend, T: Element>(dev: &B::Device, values: &[T]) -> B::Buffer<T> {
    let mut b = B::alloc_buffer::<T>(dev, values.len()).expect("alloc");
    B::upload(dev, values, &mut b).expect("upload");
    b
}

/// `len` [`poison`]s on `dev`: an output that shows whether anything was written.
pub fn poisoned<B: Backend, T: Element>(dev: &B::Device, len: usize) -> B::Buffer<T> {
    upload::<B, T>(dev, &vec![poison::<T>(); len])
}

/// `f(r, rank r's device)` for every rank of `comm`, in rank order.
pub fn on_ranks<B: Backend, X>(
    comm: &SingleController<B>,
    mut f: impl FnMut(usize, &B::Device) -> X,
) -> Vec<X> {
    let ranks = comm.cores().iter().enumerate();
    ranks.map(|(r, rank)| f(r, rank.device())).collect()
}

/// Flat views of `bufs`, one per rank.
pub fn views<B: Backend, D: DeviceBuffer<B>>(bufs: &[D]) -> Vec<TensorView<'_, B>> {
    bufs.iter().map(|b| TensorView::flat(b)).collect()
}

/// Flat mutable views of `bufs`, one per rank.
pub fn views_mut<B: Backend, D: DeviceBufferMut<B>>(bufs: &mut [D]) -> Vec<TensorViewMut<'_, B>> {
    bufs.iter_mut().map(|b| TensorViewMut::flat(b)).collect()
}

/// `len` elements of a buffer from byte `bytes` of it, as a buffer of its own: an
/// unaligned or partial view. `R` is a reference to the buffer (`&mut` for writes).
pub struct View<R> {
    inner: R,
    bytes: usize,
    len: usize,
}

impl<R> View<R> {
    /// `len` elements from byte `bytes` of `inner` (the caller keeps them inside it).
    pub fn at_byte(inner: R, bytes: usize, len: usize) -> Self {
        View { inner, bytes, len }
    }
}

impl<R: std::ops::Deref> View<R> {
    /// `len` elements from element `first` of `inner`.
    pub fn elements<B: Backend>(inner: R, first: usize, len: usize) -> Self
    where
        R::Target: DeviceBuffer<B>,
    {
        let bytes = first * inner.dtype().size();
        View { inner, bytes, len }
    }
}

// SAFETY: the view is `len` elements from byte `bytes` of the inner buffer (the callers
// keep them within it), on its device, valid as long as the inner buffer's guard (which
// it returns) lives.
unsafe impl<B: Backend, R: std::ops::Deref> DeviceBuffer<B> for View<R>
where
    R::Target: DeviceBuffer<B>,
{
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.inner.device_ordinal()
    }
    fn read_ptr<'a>(&'a self, dev: &'a B::Device) -> (u64, B::Access<'a>) {
        let (p, guard) = self.inner.read_ptr(dev);
        (p + self.bytes as u64, guard)
    }
}

// SAFETY: as above, for writes.
unsafe impl<B: Backend, R: std::ops::DerefMut> DeviceBufferMut<B> for View<R>
where
    R::Target: DeviceBufferMut<B>,
{
    fn write_ptr<'a>(&'a mut self, dev: &'a B::Device) -> (u64, B::Access<'a>) {
        let bytes = self.bytes as u64;
        let (p, guard) = self.inner.write_ptr(dev);
        (p + bytes, guard)
    }
}

/// Every algorithm a call may ask for on the suite's communicators: `Auto` and each
/// forced one.
pub const REQUESTS: [Algorithm; 4] = [
    Algorithm::Auto,
    Algorithm::OneStage,
    Algorithm::TwoStage,
    Algorithm::Lamport,
];

/// Lengths every algorithm is checked at (odd ones exercise the scalar tail).
pub const LENGTHS: [usize; 5] = [1, 7, 1023, 4096, 1_000_003];

/// The seed of a test: PEERCOMM_SEED if set, else the clock; printed so a failure can
/// be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("PEERCOMM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: PEERCOMM_SEED={seed}");
    seed
}

/// A fresh seed per run, printed so a failure can be replayed with PEERCOMM_SEED.
pub fn rng(test: &str) -> StdRng {
    StdRng::seed_from_u64(seed(test))
}

/// Random values in ±[1e-3, 1]: never zero, never constant.
pub fn random_values<T: Element>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            if !T::DTYPE.is_float() {
                // Any bits: sums and products wrap.
                return T::from_bits_u64(rng.random());
            }
            if T::DTYPE == DType::F64 {
                let mag: f64 = rng.random_range(1e-3..1.0);
                return T::from_f64(if rng.random::<bool>() { mag } else { -mag });
            }
            let mag: f32 = rng.random_range(1e-3..1.0);
            let x = if rng.random::<bool>() { mag } else { -mag };
            T::from_f32(x)
        })
        .collect()
}

/// Random inputs for every rank of a world (`random_values`, one vector per rank).
pub fn random_inputs<T: Element>(rng: &mut StdRng, world: usize, n: usize) -> Vec<Vec<T>> {
    (0..world).map(|_| random_values::<T>(rng, n)).collect()
}

/// The -0.0 of T.
pub fn negative_zero<T: Element>() -> T {
    T::from_f32(-0.0)
}

/// Whether `x` is the -0.0 bit pattern.
pub fn is_negative_zero<T: Element>(x: T) -> bool {
    x.to_bits_u32() == negative_zero::<T>().to_bits_u32()
}

/// Where zeros go into random inputs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Zeros {
    /// Probability that one rank's lane is -0.0 (independently per rank).
    pub lane: f64,
    /// Probability that an element is -0.0 on every rank (its sum is -0.0, except on
    /// the Lamport path, which sends -0.0 as +0.0).
    pub column: f64,
    /// Probability that one rank's lane is +0.0.
    pub positive: f64,
}

impl Zeros {
    /// No zeros at all.
    pub const NONE: Zeros = Zeros {
        lane: 0.0,
        column: 0.0,
        positive: 0.0,
    };
    /// -0.0 lanes on some ranks only: no element's inputs are all -0.0, so every
    /// algorithm must give the same bits.
    pub const LANES: Zeros = Zeros {
        lane: 0.15,
        column: 0.0,
        positive: 0.0,
    };
    /// -0.0 lanes, all--0.0 elements and some +0.0 lanes.
    pub const ALL: Zeros = Zeros {
        lane: 0.1,
        column: 0.05,
        positive: 0.02,
    };
}

/// Overwrites lanes of `ins` with zeros as `zeros` says; columns span the whole world.
/// With `zeros.column == 0`, no element is -0.0 on every rank (world > 1).
pub fn sprinkle_zeros<T: Element>(rng: &mut StdRng, ins: &mut [Vec<T>], zeros: Zeros) {
    let n = ins[0].len();
    let world = ins.len();
    for e in 0..n {
        if zeros.column > 0.0 && rng.random_bool(zeros.column) {
            for rank in ins.iter_mut() {
                rank[e] = negative_zero::<T>();
            }
            continue;
        }
        // One "anchor" rank stays off -0.0, so no accidental all--0.0 column (in a
        // world of one every lane may be -0.0).
        let anchor = rng.random_range(0..world);
        for (r, rank) in ins.iter_mut().enumerate() {
            if zeros.lane > 0.0 && rng.random_bool(zeros.lane) && (r != anchor || world == 1) {
                rank[e] = negative_zero::<T>();
            } else if zeros.positive > 0.0 && rng.random_bool(zeros.positive) {
                rank[e] = T::from_f32(0.0);
            }
        }
    }
}

/// The relative rounding error of `dtype`.
pub fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F64 => f64::EPSILON,
        // Integers are exact.
        _ => 0.0,
    }
}

/// The reduction of one element's group `xs` (in group-rank order) as the kernels
/// compute it, for `f64` (in f64: Sum from +0.0 over two or more ranks, Max and Min with
/// -0.0 below +0.0 and any NaN 0x7ff8000000000000, Avg the sum over the width) and the
/// integers (exact, wrapping, Max and Min by value); `None` for f32, f16 and bf16 (see
/// [`check_op`]).
pub fn reduce_exactly<T: Element>(op: ReduceOp, xs: &[T]) -> Option<T> {
    let width = xs.len();
    if T::DTYPE == DType::F64 {
        let v: Vec<f64> = xs.iter().map(|x| x.to_f64()).collect();
        let r = match op {
            ReduceOp::Max | ReduceOp::Min | ReduceOp::Prod if v.iter().any(|x| x.is_nan()) => {
                f64::from_bits(0x7ff8_0000_0000_0000)
            }
            ReduceOp::Max | ReduceOp::Min => {
                let key = |x: &f64| (*x, !x.is_sign_negative());
                let pick = |a: &&f64, b: &&f64| key(a).partial_cmp(&key(b)).unwrap();
                *match op {
                    ReduceOp::Max => v.iter().max_by(pick),
                    _ => v.iter().min_by(pick),
                }
                .unwrap()
            }
            ReduceOp::Prod => v[1..].iter().fold(v[0], |a, x| a * x),
            _ => {
                let start = if width > 1 { 0.0 + v[0] } else { v[0] };
                let sum = v[1..].iter().fold(start, |a, x| a + x);
                match op {
                    ReduceOp::Avg if width > 1 => sum / width as f64,
                    _ => sum,
                }
            }
        };
        return Some(T::from_f64(r));
    }
    if T::DTYPE.is_float() {
        return None;
    }
    let bits = 8 * T::DTYPE.size() as u32;
    let mask = u64::MAX >> (64 - bits);
    let signed = T::DTYPE.name().starts_with('i');
    let value = |b: u64| -> i128 {
        match signed {
            true => ((b << (64 - bits)) as i64 >> (64 - bits)) as i128,
            false => b as i128,
        }
    };
    let b: Vec<u64> = xs.iter().map(|x| x.to_bits_u64()).collect();
    let r = b[1..].iter().fold(b[0], |acc, &x| match op {
        ReduceOp::Prod => acc.wrapping_mul(x) & mask,
        ReduceOp::Max if value(x) > value(acc) => x,
        ReduceOp::Min if value(x) < value(acc) => x,
        ReduceOp::Max | ReduceOp::Min => acc,
        _ => acc.wrapping_add(x) & mask,
    });
    Some(T::from_bits_u64(r))
}

/// Checks `outs` (one per rank) against the f64 sums of `ins` over each group of
/// `width`, and that every rank of a group has the same bits.
pub fn check_sums<T: Element>(ins: &[Vec<T>], outs: &[Vec<T>], width: usize, what: &str) {
    // Rounding of the result to T, plus the f32 accumulation of `width` terms.
    check_sums_within(ins, outs, width, what, |sum, abs| {
        0.5 * eps(T::DTYPE) * sum.abs() + width as f64 * f32::EPSILON as f64 * abs + 1e-7
    });
}

/// Checks `got` (a group's result from element `first` on) against the reference of
/// the group's inputs `ins` under `op`: `Max` and `Min` exactly; zeros' signs exactly; the
/// rest within the f32 accumulation of the group plus the rounding to `T`.
///
/// `f64` and the integers: bit for bit against [`reduce_exactly`].
pub fn check_op<T: Element>(op: ReduceOp, ins: &[&Vec<T>], got: &[T], first: usize, what: &str) {
    let width = ins.len();
    for (i, &g) in got.iter().enumerate() {
        let e = first + i;
        let xs: Vec<T> = ins.iter().map(|v| v[e]).collect();
        let at = || format!("{what}: {} element {e} of {xs:?}: got {g:?}", op.name());
        if let Some(want) = reduce_exactly(op, &xs) {
            assert_eq!(
                g.to_bits_u64(),
                want.to_bits_u64(),
                "{} (want {want:?})",
                at()
            );
            continue;
        }
        let values: Vec<f64> = xs.iter().map(|x| x.to_f32() as f64).collect();
        let canonical_nan = T::from_f32(f32::from_bits(0x7fc0_0000));
        if op == ReduceOp::Prod && values.iter().any(|v| v.is_nan()) {
            assert_eq!(g.to_bits_u32(), canonical_nan.to_bits_u32(), "{}", at());
            continue;
        }
        if matches!(op, ReduceOp::Max | ReduceOp::Min) {
            let want = if values.iter().any(|v| v.is_nan()) {
                canonical_nan
            } else {
                // By value, -0.0 below +0.0: order by (value, sign bit clear).
                let key = |x: &T| (x.to_f32() as f64, !x.to_f32().is_sign_negative());
                let pick = |a: &T, b: &T| key(a).partial_cmp(&key(b)).unwrap();
                match op {
                    ReduceOp::Max => *xs.iter().max_by(|a, b| pick(a, b)).unwrap(),
                    _ => *xs.iter().min_by(|a, b| pick(a, b)).unwrap(),
                }
            };
            assert_eq!(g.to_bits_u32(), want.to_bits_u32(), "{}", at());
            continue;
        }
        if values.iter().all(|&v| v == 0.0) {
            // Exact zeros: a product's sign is the signs' parity; the sum starts from
            // +0.0 over two or more ranks (a group of one copies).
            let negatives = xs.iter().filter(|x| x.to_f32().is_sign_negative()).count();
            let negative = (op == ReduceOp::Prod || width == 1) && negatives % 2 == 1;
            let want = T::from_f32(if negative { -0.0 } else { 0.0 });
            assert_eq!(g.to_bits_u32(), want.to_bits_u32(), "{}", at());
            continue;
        }
        let magnitudes: f64 = values.iter().map(|v| v.abs()).sum();
        let (want, scale) = match op {
            ReduceOp::Prod => {
                let p: f64 = values.iter().product();
                (p, p.abs())
            }
            ReduceOp::Avg => (values.iter().sum::<f64>() / width as f64, magnitudes),
            _ => (values.iter().sum::<f64>(), magnitudes),
        };
        let f32_steps = width as f64 * f32::EPSILON as f64;
        // Rounding to T, below its normal range too (its smallest step there: bits 1).
        let smallest = T::from_bits_u32(1).to_f32() as f64;
        let rounding = 0.5 * (eps(T::DTYPE) * want.abs()).max(smallest);
        let tol = rounding + f32_steps * scale + 1e-12;
        let got = g.to_f32() as f64;
        assert!(
            (got - want).abs() <= tol,
            "{} (want {want}, tol {tol})",
            at()
        );
    }
}

/// [`check_sums`] with the tolerance `tol(sum, sum of magnitudes)` of each element.
pub fn check_sums_within<T: Element>(
    ins: &[Vec<T>],
    outs: &[Vec<T>],
    width: usize,
    what: &str,
    tol: impl Fn(f64, f64) -> f64,
) {
    let world = ins.len();
    let n = ins[0].len();
    for g in (0..world).step_by(width) {
        let members = g..g + width;
        assert_eq!(outs[g].len(), n, "{what}: rank {g}'s output length");
        for e in 0..n {
            let mut sum = 0f64;
            let mut abs = 0f64;
            for r in members.clone() {
                let x = ins[r][e].to_f32() as f64;
                sum += x;
                abs += x.abs();
            }
            let tol = tol(sum, abs);
            let lead = outs[g][e];
            let got = lead.to_f32() as f64;
            assert!(
                got.is_finite() && (got - sum).abs() <= tol,
                "{what}: group at rank {g}, element {e} of {n}: got {got}, expected {sum} (tolerance {tol})"
            );
            for r in members.clone().skip(1) {
                assert_eq!(
                    outs[r][e].to_bits_u32(),
                    lead.to_bits_u32(),
                    "{what}: rank {r} differs from rank {g} at element {e}"
                );
            }
        }
    }
}

/// The full check of one call's result: a group of one returns its input bit for bit;
/// otherwise [`check_sums`] and the sign of zero (the f32 sum starts at +0.0: an exact
/// zero is +0.0, a nonzero sum rounding to zero keeps its sign).
pub fn check_result<T: Element>(
    ins: &[Vec<T>],
    outs: &[Vec<T>],
    width: usize,
    ran: Algorithm,
    what: &str,
) {
    let n = ins[0].len();
    if width == 1 {
        for (r, (i, o)) in ins.iter().zip(outs).enumerate() {
            assert_eq!(o.len(), n, "{what}: rank {r}'s output length");
            for e in 0..n {
                assert_eq!(
                    o[e].to_bits_u32(),
                    i[e].to_bits_u32(),
                    "{what}: group of one, rank {r}, element {e}: got {:?} ({:#x}), \
                     the input is {:?} ({:#x})",
                    o[e],
                    o[e].to_bits_u32(),
                    i[e],
                    i[e].to_bits_u32()
                );
            }
        }
        return;
    }
    check_sums(ins, outs, width, what);
    for g in (0..ins.len()).step_by(width) {
        for e in 0..n {
            let got = outs[g][e];
            if got.to_f32() != 0.0 {
                continue;
            }
            let all_negative = (g..g + width).all(|r| is_negative_zero(ins[r][e]));
            // The kernels' f32 sum from +0.0 in group-rank order: an exact zero is
            // +0.0; a nonzero sum that rounds to zero in T keeps its sign.
            let acc = (g..g + width).fold(0.0f32, |acc, r| acc + ins[r][e].to_f32());
            let expected = T::from_f32(acc).to_bits_u32();
            assert_eq!(
                got.to_bits_u32(),
                expected,
                "{what}: group at rank {g}, element {e}: zero result {:#x}, expected {:#x} \
                 (inputs all -0.0: {all_negative}; {} ran)",
                got.to_bits_u32(),
                expected,
                ran.name()
            );
        }
    }
}

/// What a call with `requested` over groups of `width` in a world of `world` must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Runs and returns one of these algorithms.
    Runs(&'static [Algorithm]),
    /// Refused with `Error::Unsupported`, nothing written.
    Unsupported,
}

/// Lamport runs only over the whole world with width >= 2; forced at width 1 it runs
/// one-stage, over a subgroup it is refused; `Auto` never picks it where it may not.
pub fn expected(requested: Algorithm, width: usize, world: usize) -> Expected {
    const ONE: &[Algorithm] = &[Algorithm::OneStage];
    const TWO: &[Algorithm] = &[Algorithm::TwoStage];
    const LAMPORT: &[Algorithm] = &[Algorithm::Lamport];
    const BARRIERED: &[Algorithm] = &[Algorithm::OneStage, Algorithm::TwoStage];
    const ANY: &[Algorithm] = &[Algorithm::OneStage, Algorithm::TwoStage, Algorithm::Lamport];
    let lamport_legal = width == world && width >= 2;
    match requested {
        Algorithm::OneStage => Expected::Runs(ONE),
        Algorithm::TwoStage => Expected::Runs(TWO),
        Algorithm::Lamport if width == 1 => Expected::Runs(ONE),
        Algorithm::Lamport if lamport_legal => Expected::Runs(LAMPORT),
        Algorithm::Lamport => Expected::Unsupported,
        Algorithm::Auto if lamport_legal => Expected::Runs(ANY),
        Algorithm::Auto => Expected::Runs(BARRIERED),
        // Served by the external library; the suite's communicators have not set it up.
        Algorithm::Nccl | Algorithm::Hierarchical => Expected::Unsupported,
        other => panic!("the suite has no expectation for {other:?}"),
    }
}

/// A communicator for the suite: sized so that every algorithm takes the longest
/// length, with a timeout that turns a hang into a failure.
pub fn suite_config(max_blocks: Option<u32>) -> CommConfig {
    CommConfig::default()
        .with_lamport_slot_bytes(4 << 20)
        .with_payload_bytes(4 << 20)
        .with_barrier_timeout(Some(Duration::from_secs(60)))
        .with_max_blocks(max_blocks)
}

pub fn open<B: Backend>(world: usize, config: CommConfig) -> SingleController<B> {
    let ordinals: Vec<usize> = (0..world).collect();
    SingleController::<B>::new(&ordinals, config).expect("communicator")
}

/// Where the ranks of a world run: device ordinals, and whether some share a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Rank r's device ordinal.
    pub ordinals: Vec<usize>,
    /// Several ranks on one device (`CommConfig::allow_shared_devices`).
    pub shared: bool,
}

impl Placement {
    /// Rank r on device `r % devices`: one rank per device where there are enough,
    /// else round-robin (shared).
    pub fn round_robin(world: usize, devices: usize) -> Placement {
        assert!(devices > 0, "no device to place ranks on");
        Placement {
            ordinals: (0..world).map(|r| r % devices).collect(),
            shared: devices < world,
        }
    }
    /// Ranks in the world.
    pub fn world(&self) -> usize {
        self.ordinals.len()
    }
    /// Adjusts a configuration for the placement: with shared devices every rank's
    /// blocks must be resident at once, so at most 4 blocks per launch.
    pub fn config(&self, mut config: CommConfig) -> CommConfig {
        if self.shared {
            config.allow_shared_devices = true;
            config.max_blocks = Some(config.max_blocks.map_or(4, |b| b.min(4)));
        }
        config
    }
    /// Opens a communicator over the placement.
    pub fn open<B: Backend>(&self, config: CommConfig) -> SingleController<B> {
        SingleController::<B>::new(&self.ordinals, self.config(config))
            .unwrap_or_else(|e| panic!("communicator over {:?}: {e}", self.ordinals))
    }
}

/// The hazard tests' way of asking for a world: the placement, or `None` after a
/// printed skip. Backends with fewer devices than ranks share devices.
pub type Place<'a> = &'a dyn Fn(&str, usize) -> Option<Placement>;

/// One all-reduce with its buffers (input, poisoned output), built before a batch is
/// enqueued and checked after its synchronize.
pub struct Prepared<B: Backend, T: Element> {
    /// Every rank's input values.
    pub ins: Vec<Vec<T>>,
    in_bufs: Vec<B::Buffer<T>>,
    out_bufs: Vec<B::Buffer<T>>,
    /// In place: the result lands in the input buffers.
    pub in_place: bool,
    /// The call's options.
    pub opts: AllReduceOptions,
    /// The call's operator (`Sum` unless set).
    pub op: ReduceOp,
}

impl<B: Backend, T: Element> Prepared<B, T> {
    /// Uploads `ins` (one vector per rank) and poisons the outputs.
    pub fn new(
        comm: &SingleController<B>,
        ins: Vec<Vec<T>>,
        in_place: bool,
        opts: AllReduceOptions,
    ) -> Self {
        assert_eq!(ins.len(), comm.world_size());
        let (ranks, len) = (comm.cores(), ins[0].len());
        let in_bufs = ranks
            .iter()
            .zip(&ins)
            .map(|(r, v)| upload::<B, T>(r.device(), v));
        let out_bufs = ranks.iter().filter(|_| !in_place);
        let out_bufs = out_bufs
            .map(|r| poisoned::<B, T>(r.device(), len))
            .collect();
        Prepared {
            in_bufs: in_bufs.collect(),
            ins,
            out_bufs,
            in_place,
            opts,
            op: ReduceOp::Sum,
        }
    }

    /// Elements per rank.
    pub fn len(&self) -> usize {
        self.ins[0].len()
    }

    /// Group width in a world of `world`.
    pub fn width(&self, world: usize) -> usize {
        if self.opts.group_size == 0 {
            world
        } else {
            self.opts.group_size
        }
    }

    /// Every rank's result (the output buffers, or the in-place buffers).
    pub fn results(&self, comm: &SingleController<B>) -> Vec<Vec<T>> {
        let bufs = if self.in_place {
            &self.in_bufs
        } else {
            &self.out_bufs
        };
        comm.cores()
            .iter()
            .zip(bufs)
            .map(|(rank, b)| B::download(rank.device(), b).expect("download"))
            .collect()
    }

    /// Nothing was written: inputs hold their values bit for bit, outputs are all NaN.
    pub fn assert_untouched(&self, comm: &SingleController<B>, what: &str) {
        for (r, rank) in comm.cores().iter().enumerate() {
            let (input, output) = (&self.in_bufs[r], self.out_bufs.get(r));
            let what = format!("{what}: rank {r}");
            assert_unwritten::<B, T>(rank.device(), input, &self.ins[r], output, &what);
        }
    }
}

/// Nothing was written: `input` holds `values` bit for bit, `output` (if any) is all
/// [`poison`].
pub fn assert_unwritten<B: Backend, T: Element>(
    dev: &B::Device,
    input: &B::Buffer<T>,
    values: &[T],
    output: Option<&B::Buffer<T>>,
    what: &str,
) {
    let got = B::download(dev, input).expect("download");
    assert!(
        bits(&got) == bits(values),
        "{what}: the input (or in-place data) was written"
    );
    if let Some(out) = output.map(|o| B::download(dev, o).expect("download")) {
        assert!(
            bits64(&out)
                .iter()
                .all(|&b| b == poison::<T>().to_bits_u64()),
            "{what}: the output was written"
        );
    }
}

/// A prepared call of any element type, so a batch can mix dtypes.
pub trait Call<B: Backend> {
    /// Enqueues it.
    fn enqueue(&mut self, comm: &SingleController<B>) -> Result<Algorithm>;
    /// Checks it (after a synchronize).
    fn check(&self, comm: &SingleController<B>, outcome: &Result<Algorithm>, what: &str);
    /// Describes it.
    fn describe(&self, world: usize) -> String;
    /// Bytes per rank.
    fn bytes(&self) -> usize;
    /// Which collective, where it is not an all-reduce.
    fn collective(&self) -> Option<&'static str> {
        None
    }
    /// Whether it can go into a group (the all-reduce).
    fn groupable(&self) -> bool {
        false
    }
    /// Adds it to an open group instead of enqueuing it (only where `groupable`).
    fn add_to_group<'b>(
        &'b mut self,
        _group: &mut peercomm::SingleControllerGroup<'_, 'b, B>,
    ) -> Result<()> {
        unreachable!("not groupable")
    }
    /// Every rank's result as bits (after a synchronize), for bit-for-bit comparisons
    /// of one call made two ways (the all-reduce).
    fn result_bits(&self, _comm: &SingleController<B>) -> Vec<Vec<u32>> {
        unimplemented!("no bits for {}", self.describe(0))
    }
}

impl<B: Backend, T: Element> Call<B> for Prepared<B, T> {
    /// Enqueues the all-reduce (no synchronisation).
    fn enqueue(&mut self, comm: &SingleController<B>) -> Result<Algorithm> {
        if self.in_place {
            comm.all_reduce_in_place(&mut views_mut(&mut self.in_bufs), &self.op, &self.opts)
        } else {
            let outs = &mut views_mut(&mut self.out_bufs);
            comm.all_reduce(&views(&self.in_bufs), outs, &self.op, &self.opts)
        }
    }
    /// Checks what the call returned and, if it ran, its result (after a synchronize):
    /// the outcome the rules of [`expected`] give, then [`check_result`].
    fn check(&self, comm: &SingleController<B>, outcome: &Result<Algorithm>, what: &str) {
        let world = comm.world_size();
        let width = self.width(world);
        // The two-stage and Lamport kernels take f32, f16 and bf16; Avg the floats.
        let algorithm_for_type = every_kernel(T::DTYPE)
            || !matches!(
                self.opts.algorithm,
                Algorithm::TwoStage | Algorithm::Lamport
            );
        let op_for_type = self.op != ReduceOp::Avg || T::DTYPE.is_float();
        let expected = match expected(self.opts.algorithm, width, world) {
            _ if !algorithm_for_type || !op_for_type => Expected::Unsupported,
            e => e,
        };
        match expected {
            Expected::Unsupported => match outcome {
                Err(Error::Unsupported(_)) => self.assert_untouched(comm, what),
                other => panic!(
                    "{what}: Lamport over a subgroup, two-stage or \
                     Lamport over a type other than f32, f16, bf16, or Avg over an integer \
                     must be refused with Error::Unsupported and nothing written; got {other:?}"
                ),
            },
            Expected::Runs(allowed) => {
                let ran = match outcome {
                    Ok(a) => *a,
                    Err(e) => panic!("{what}: {e}"),
                };
                let results = self.results(comm);
                if self.op == ReduceOp::Sum && every_kernel(T::DTYPE) {
                    check_result(&self.ins, &results, width, ran, what);
                } else {
                    for (r, got) in results.iter().enumerate() {
                        let group: Vec<&Vec<T>> =
                            self.ins[r / width * width..][..width].iter().collect();
                        check_op(self.op, &group, got, 0, &format!("{what}, rank {r}"));
                    }
                }
                assert!(
                    allowed.contains(&ran),
                    "{what}: returned {} but may only run {:?} (Lamport runs only over \
                     the whole world of width >= 2; forced with width 1 it runs one-stage)",
                    ran.name(),
                    allowed.iter().map(|a| a.name()).collect::<Vec<_>>()
                );
            }
        }
    }
    /// A description for failure messages.
    fn describe(&self, world: usize) -> String {
        format!(
            "{} {} {:?} world {world} group {} len {} {}{}",
            self.op.name(),
            self.opts.algorithm.name(),
            T::DTYPE,
            self.width(world),
            self.len(),
            if self.in_place {
                "in-place"
            } else {
                "out-of-place"
            },
            match self.opts.blocks {
                Some(b) => format!(" blocks {b}"),
                None => String::new(),
            }
        )
    }
    fn bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
    fn groupable(&self) -> bool {
        true
    }
    fn result_bits(&self, comm: &SingleController<B>) -> Vec<Vec<u32>> {
        self.results(comm)
            .into_iter()
            .map(|v| v.into_iter().map(Element::to_bits_u32).collect())
            .collect()
    }
    fn add_to_group<'b>(
        &'b mut self,
        group: &mut peercomm::SingleControllerGroup<'_, 'b, B>,
    ) -> Result<()> {
        if self.in_place {
            group.all_reduce_slices_in_place_with(&mut self.in_bufs, &self.op, &self.opts)
        } else {
            group.all_reduce_slices_with(&self.in_bufs, &mut self.out_bufs, &self.op, &self.opts)
        }
    }
}

/// Random inputs of `dtype` (with `zeros`) for every rank, prepared as a [`Call`].
#[allow(clippy::too_many_arguments)]
pub fn prepare_random<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    dtype: DType,
    len: usize,
    zeros: Zeros,
    in_place: bool,
    opts: AllReduceOptions,
) -> Box<dyn Call<B>> {
    for_dtype!(dtype, T => {
        let mut ins = random_inputs::<T>(rng, comm.world_size(), len);
        sprinkle_zeros(rng, &mut ins, zeros);
        Box::new(Prepared::<B, T>::new(comm, ins, in_place, opts))
    })
}

/// Enqueues every call of a batch back to back (no synchronisation in between), then
/// synchronises once and checks every call.
pub fn run_batch<B: Backend>(
    comm: &SingleController<B>,
    calls: &mut [Box<dyn Call<B>>],
    what: &str,
) {
    let outcomes: Vec<Result<Algorithm>> = calls.iter_mut().map(|c| c.enqueue(comm)).collect();
    comm.synchronize()
        .unwrap_or_else(|e| panic!("{what}: synchronize after {} calls: {e}", calls.len()));
    let world = comm.world_size();
    for (i, (c, outcome)) in calls.iter().zip(&outcomes).enumerate() {
        c.check(
            comm,
            outcome,
            &format!("{what}, call {i} of {}: {}", calls.len(), c.describe(world)),
        );
    }
}

/// One all-reduce of fresh random data of `len` elements of T, synchronised and
/// checked (including what the call returned, per [`expected`]). Returns the outcome.
pub fn run_case<B: Backend, T: Element>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    algorithm: Algorithm,
    group_size: usize,
    len: usize,
    in_place: bool,
) -> Result<Algorithm> {
    let ins = random_inputs::<T>(rng, comm.world_size(), len);
    let opts = AllReduceOptions::new()
        .group_size(group_size)
        .algorithm(algorithm);
    let mut call = Prepared::<B, T>::new(comm, ins, in_place, opts);
    let what = call.describe(comm.world_size());
    let outcome = call.enqueue(comm);
    comm.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
    call.check(comm, &outcome, &what);
    outcome
}

pub fn run_case_dtype<B: Backend>(
    comm: &SingleController<B>,
    rng: &mut StdRng,
    dtype: DType,
    algorithm: Algorithm,
    group_size: usize,
    len: usize,
    in_place: bool,
) -> Result<Algorithm> {
    for_dtype!(dtype, T => run_case::<B, T>(comm, rng, algorithm, group_size, len, in_place))
}

pub fn group_sizes(world: usize) -> Vec<usize> {
    (1..=world).filter(|w| world.is_multiple_of(*w)).collect()
}

/// Every algorithm x dtype x group size x length, in and out of place, at one world
/// size (forced Lamport over a subgroup: `Unsupported`).
pub fn sweep_world<B: Backend>(world: usize, max_blocks: Option<u32>, lengths: &[usize]) {
    let mut rng = rng(&format!("sweep_world_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    let mut cases = 0;
    let mut refused = 0;
    for group in group_sizes(world) {
        for algorithm in REQUESTS {
            for dtype in DType::ALL {
                for &len in lengths {
                    for in_place in [false, true] {
                        let outcome =
                            run_case_dtype(&comm, &mut rng, dtype, algorithm, group, len, in_place);
                        cases += 1;
                        refused += outcome.is_err() as usize;
                    }
                }
            }
        }
    }
    eprintln!("sweep_world_{world}: {cases} all-reduces checked ({refused} refused as specified)");
}

/// Subgroup calls of every narrower width with whole-world Lamport calls between them:
/// the Lamport state must survive the subgroups' barriers; each call checked.
pub fn interleaved_subgroups<B: Backend>(world: usize, calls: usize, max_blocks: Option<u32>) {
    let mut rng = rng(&format!("interleaved_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    let widths: Vec<usize> = [1, 2, 4]
        .into_iter()
        .filter(|w| *w < world && world.is_multiple_of(*w))
        .collect();
    assert!(!widths.is_empty(), "world {world} has no subgroup");
    // Subgroups take the barrier algorithms (and Lamport where it means one-stage);
    // the world calls are mostly Lamport, with the barrier algorithms now and then.
    let sub_algorithms = [
        Algorithm::OneStage,
        Algorithm::TwoStage,
        Algorithm::Auto,
        Algorithm::Lamport,
    ];
    let world_algorithms = [
        Algorithm::Lamport,
        Algorithm::Lamport,
        Algorithm::OneStage,
        Algorithm::Lamport,
        Algorithm::TwoStage,
        Algorithm::Auto,
    ];
    let mut lamport_calls = 0;
    for i in 0..calls {
        let dtype = DType::ALL[i % 3];
        let len = [1023, 4096, 33, 1, 777][i % 5];
        let in_place = (i / 2) % 2 == 1;
        if i % 2 == 0 {
            let width = widths[(i / 2) % widths.len()];
            let mut algorithm = sub_algorithms[(i / 2 / widths.len()) % sub_algorithms.len()];
            if algorithm == Algorithm::Lamport && width != 1 {
                algorithm = Algorithm::Auto;
            }
            run_case_dtype(&comm, &mut rng, dtype, algorithm, width, len, in_place)
                .expect("a legal subgroup call");
        } else {
            let algorithm = world_algorithms[(i / 2) % world_algorithms.len()];
            let ran = run_case_dtype(&comm, &mut rng, dtype, algorithm, 0, len, in_place)
                .expect("a whole-world call");
            lamport_calls += (ran == Algorithm::Lamport) as usize;
        }
    }
    assert!(lamport_calls > 0, "no whole-world Lamport call ran");
    eprintln!(
        "interleaved_{world}: {calls} calls over subgroup widths {widths:?} and the world \
         ({lamport_calls} whole-world Lamport calls)"
    );
}

/// Elements of T a call needs for the planner to launch all `max_blocks` blocks of a
/// `kind` over groups of `width` (odd, so the scalar tail is covered too).
fn len_for_all_blocks<T: Element>(
    algorithm: Algorithm,
    width: usize,
    threads_per_block: u32,
    max_blocks: u32,
) -> usize {
    let lanes = T::DTYPE.lanes();
    let work_packs = threads_per_block as usize * (max_blocks as usize - 1) + 1;
    let packs = match algorithm {
        Algorithm::TwoStage => work_packs * width,
        _ => work_packs,
    };
    let len = packs * lanes + 3;
    let work = match algorithm {
        Algorithm::TwoStage => len.div_ceil(lanes).div_ceil(width),
        _ => len.div_ceil(lanes),
    };
    assert_eq!(
        unstable::blocks_for(work, threads_per_block, max_blocks),
        max_blocks,
        "{} over {width}: {len} elements do not launch all {max_blocks} blocks",
        algorithm.name()
    );
    len
}

/// Counters start just below u32::MAX; every domain in use wraps in every block (all
/// `max_blocks` launched, asserted), then read back equal on every rank.
pub fn counter_wraparound<B: Backend>(world: usize, max_blocks: Option<u32>) {
    let mut rng = rng(&format!("wraparound_{world}"));
    let config = suite_config(max_blocks);
    let comm = open::<B>(world, config.clone());
    let base = u32::MAX - 7;
    comm.reinitialize_with_counter_base(base).unwrap();
    let blocks = config
        .max_blocks
        .map(|b| b as usize)
        .unwrap_or_else(|| B::multiprocessor_count(comm.core(0).device()).unwrap())
        .clamp(1, MAX_NUM_BLOCKS_UPPER_BOUND) as u32;
    let tpb = config.threads_per_block;
    for i in 0..24 {
        for group in group_sizes(world) {
            let algorithm = if group == world {
                Algorithm::ALL[i % 3]
            } else {
                [Algorithm::OneStage, Algorithm::TwoStage][i % 2]
            };
            let len = len_for_all_blocks::<f32>(algorithm, group, tpb, blocks);
            run_case::<B, f32>(&comm, &mut rng, algorithm, group, len, i % 2 == 0)
                .expect("a legal call");
        }
    }
    // Read back self_counter[d][b][t] of every rank for every domain with barriers.
    let counters = std::mem::offset_of!(Signal, self_counter);
    let mut checked = 0;
    for width in group_sizes(world).into_iter().filter(|&w| w >= 2) {
        let d = unstable::barrier_domain(width, world);
        for (r, rank) in comm.cores().iter().enumerate() {
            let row = MAX_NUM_BLOCKS_UPPER_BOUND * MAX_GPUS * 4;
            let mut raw = vec![0u8; row];
            B::read(
                rank.device(),
                rank.signal_ptr() + (counters + d * row) as u64,
                &mut raw,
            )
            .unwrap();
            let word = |b: usize, t: usize| {
                let i = (b * MAX_GPUS + t) * 4;
                u32::from_le_bytes(raw[i..i + 4].try_into().unwrap())
            };
            let first = word(0, 0);
            assert!(
                first < base && first < 10_000,
                "rank {r}, domain {d}: block 0's counter is {first}: it did not wrap past \
                 u32::MAX from {base}"
            );
            for b in 0..blocks as usize {
                for t in 0..width {
                    assert_eq!(
                        word(b, t),
                        first,
                        "rank {r}, domain {d}, block {b}, peer {t}: counter differs from \
                         block 0's (every block must pass every barrier, and wrap)"
                    );
                    checked += 1;
                }
            }
        }
    }
    eprintln!(
        "wraparound_{world}: {checked} counters wrapped ({blocks} blocks per launch, base {base})"
    );
}

/// Thousands of calls back to back with no synchronisation, outputs kept alive until
/// the one synchronize, then every call checked.
pub fn back_to_back<B: Backend>(world: usize, calls: usize, max_blocks: Option<u32>) {
    let mut rng = rng(&format!("back_to_back_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    let lengths = [1, 3, 7, 16, 33, 100, 255, 1000, 1023, 2049, 4096];
    let mut batch: Vec<Box<dyn Call<B>>> = (0..calls)
        .map(|i| {
            let len = lengths[rng.random_range(0..lengths.len())];
            let opts = AllReduceOptions::new().algorithm(Algorithm::ALL[i % 3]);
            prepare_random(
                &comm,
                &mut rng,
                DType::ALL[(i / 3) % 3],
                len,
                Zeros::NONE,
                i % 4 == 3,
                opts,
            )
        })
        .collect();
    run_batch(
        &comm,
        &mut batch,
        &format!("{calls} back-to-back calls, world {world}"),
    );
    eprintln!("back_to_back_{world}: {calls} calls enqueued without synchronisation, all checked");
}

/// A barrier whose peers never launch: a timeout naming rank, block and domain within
/// twice the timeout; refused until `reinitialize`, then works.
pub fn barrier_timeout<B: Backend>(world: usize) {
    let timeout = Duration::from_millis(300);
    let config = suite_config(None).with_barrier_timeout(Some(timeout));
    let comm = open::<B>(world, config);
    let started = Instant::now();
    comm.barrier_on_ranks(0, &[0]).unwrap();
    let err = comm.synchronize().unwrap_err();
    let took = started.elapsed();
    assert_eq!(
        err,
        Error::BarrierTimeout {
            rank: 0,
            block: 0,
            domain: 0,
            waiting_for: Some(1),
        }
    );
    assert!(
        took <= 2 * timeout + Duration::from_secs(2),
        "the timeout of {timeout:?} took {took:?} to report"
    );
    assert!(comm.is_poisoned());
    let mut rng = rng("barrier_timeout");
    let mut bufs: Vec<_> = comm
        .cores()
        .iter()
        .map(|r| B::alloc_buffer::<f32>(r.device(), 4).unwrap())
        .collect();
    let mut ts: Vec<TensorViewMut<B>> = bufs.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
    match comm.all_reduce_in_place(&mut ts, &ReduceOp::Sum, &AllReduceOptions::new()) {
        Err(Error::Poisoned { first }) if matches!(*first, Error::BarrierTimeout { .. }) => {}
        other => panic!("expected Poisoned by the barrier timeout, got {other:?}"),
    }
    comm.reinitialize().unwrap();
    assert!(!comm.is_poisoned());
    for algorithm in Algorithm::ALL {
        run_case::<B, f32>(&comm, &mut rng, algorithm, 0, 777, false).unwrap();
    }
    hazards::late_peer_times_out_and_writes_nothing(&comm, &mut rng, timeout);
}

/// Generates the suite's `#[test]` functions for one backend. `$available` is an
/// expression giving `Result<usize, String>`: the devices there are, or why none.
#[macro_export]
macro_rules! reference_suite {
    ($backend:ty, $available:expr, $max_blocks:expr, $lengths:expr) => {
        fn devices_or_skip(test: &str, need: usize) -> bool {
            common::devices(test, $available, need).is_some()
        }

        /// A placement of `world` ranks (shared round-robin where devices are too few);
        /// `None` after a printed skip when there is no device.
        fn place_or_skip(test: &str, world: usize) -> Option<common::Placement> {
            let p = common::Placement::round_robin(world, common::devices(test, $available, 1)?);
            if p.shared {
                eprintln!("{test}: {world} ranks share devices: {:?}", p.ordinals);
            }
            Some(p)
        }

        /// The largest of `worlds` (descending) this backend has devices for, or a
        /// printed skip.
        fn largest_world(test: &str, worlds: &[usize]) -> Option<usize> {
            let n = common::devices(test, $available, worlds[worlds.len() - 1])?;
            worlds.iter().copied().find(|&w| w <= n)
        }

        sized_tests!(|w| common::sweep_world::<$backend>(w, $max_blocks, &$lengths);
            sweep_world_1: 1, sweep_world_2: 2, sweep_world_3: 3, sweep_world_4: 4,
            sweep_world_5: 5, sweep_world_6: 6, sweep_world_7: 7, sweep_world_8: 8);
        // The collectives sweep, then the fused call.
        sized_tests!(|w| {
            let lengths = &common::collectives::COLLECTIVE_LENGTHS;
            common::collectives::sweep::<$backend>(w, $max_blocks, lengths);
            common::collectives::rms_norm_sweep::<$backend>(w, $max_blocks);
        }; collectives_world_1: 1, collectives_world_2: 2, collectives_world_3: 3,
            collectives_world_4: 4, collectives_world_8: 8);

        #[test]
        fn collectives_bad_inputs() {
            if devices_or_skip("collectives_bad_inputs", 2) {
                common::collectives::bad_inputs::<$backend>();
            }
        }

        #[test]
        fn interleaved_subgroups_and_world() {
            if let Some(world) = largest_world("interleaved_subgroups_and_world", &[8, 4, 2]) {
                common::interleaved_subgroups::<$backend>(world, 1200, $max_blocks);
            }
        }

        #[test]
        fn counter_wraparound() {
            if let Some(world) = largest_world("counter_wraparound", &[8, 4, 2, 1]) {
                common::counter_wraparound::<$backend>(world, $max_blocks);
            }
        }

        #[test]
        fn back_to_back_calls() {
            if let Some(world) = largest_world("back_to_back_calls", &[8, 2, 1]) {
                common::back_to_back::<$backend>(world, 3000, $max_blocks);
            }
        }

        bad_input_tests!($backend, lengths_differ: 2, shapes_differ: 2, dtypes_differ: 2,
            output_length_differs_from_input: 2, shape_does_not_describe_buffer: 2,
            group_size_must_divide_world: 2, device_listed_twice: 1,
            message_larger_than_scratch: 2, auto_falls_back_to_what_fits: 2,
            buffer_on_the_wrong_device: 2, wrong_number_of_tensors: 2,
            block_count_out_of_range: 2, signal_size_overflow_is_refused: 1,
            buffer_of_overflowing_size_is_refused: 1, huge_barrier_timeout_saturates: 2);

        /// Needs no device, so it runs everywhere.
        #[test]
        fn world_of_zero_or_nine() {
            common::errors::world_of_zero_or_nine::<$backend>();
        }

        #[test]
        fn barrier_timeout_is_reported_and_recoverable() {
            if devices_or_skip("barrier_timeout_is_reported_and_recoverable", 2) {
                common::barrier_timeout::<$backend>(2);
            }
        }

        hazard_tests!(
            $backend,
            $max_blocks,
            lamport_after_width_change_with_late_rank,
            drop_buffers_before_synchronize,
            concurrent_callers_share_one_communicator,
            late_peer_after_timeout,
            sign_of_zero_in_groups_of_one,
            algorithms_agree_bitwise_and_ignore_length,
        );

        ergonomics_tests!($backend);

        // The single controller's parallel launch.
        #[test]
        fn parallel_launch_matches_sequential() {
            common::launch::parallel_matches_sequential::<$backend>(&place_or_skip, $max_blocks);
        }

        #[test]
        fn parallel_launch_failure_poisons() {
            common::launch::launch_failure_poisons::<$backend>(&place_or_skip, $max_blocks);
        }

        #[test]
        fn parallel_launch_drop_joins_threads() {
            common::launch::drop_joins_launch_threads::<$backend>(&place_or_skip, $max_blocks, 100);
        }
    };
}

/// `#[test]`s each running `$run(world)` at one world size, or a printed skip where
/// the backend has fewer devices.
#[macro_export]
macro_rules! sized_tests {
    ($run:expr; $($name:ident: $world:expr),+ $(,)?) => {$(
        #[test]
        fn $name() {
            if devices_or_skip(stringify!($name), $world) {
                ($run)($world);
            }
        }
    )+};
}

/// `#[test]` functions of one expression each: `name => expr;`, docs and attributes
/// allowed before a name.
#[macro_export]
macro_rules! tests {
    ($($(#[$meta:meta])* $name:ident => $body:expr;)+) => {
        $(
            $(#[$meta])*
            #[test]
            fn $name() {
                $body;
            }
        )+
    };
}
