//! Element types the collectives handle (their kernel codes: `DType::raw` in
//! [`crate::signal`]).

/// Element type of a tensor.
///
/// Floating types reduce in floating point (`f16` and `bf16` in f32, `f64` in f64),
/// integers in their own type, wrapping on overflow (as NCCL does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`), accumulated in f32.
    F16,
    /// bfloat16 (`half::bf16`), accumulated in f32.
    BF16,
    /// IEEE binary64, accumulated in f64.
    F64,
    /// Signed 8-bit integer (wrapping arithmetic).
    I8,
    /// Unsigned 8-bit integer (wrapping arithmetic).
    U8,
    /// Signed 32-bit integer (wrapping arithmetic).
    I32,
    /// Unsigned 32-bit integer (wrapping arithmetic).
    U32,
    /// Signed 64-bit integer (wrapping arithmetic).
    I64,
    /// Unsigned 64-bit integer (wrapping arithmetic).
    U64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }
    /// Elements per 16-byte pack.
    pub const fn lanes(self) -> usize {
        16 / self.size()
    }
    /// Short lowercase name (`f32`, `f16`, `bf16`, `f64`, `i8`, `u8`, `i32`, `u32`,
    /// `i64`, `u64`), as in kernel names.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
        }
    }
    /// Whether it is a floating-point type (the types [`ReduceOp::Avg`] takes).
    ///
    /// ```
    /// use peercomm::DType;
    /// assert!(DType::BF16.is_float() && DType::F64.is_float());
    /// assert!(!DType::I32.is_float());
    /// ```
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }
    /// Whether every kernel family takes it: `f32`, `f16`, `bf16`. The other types run
    /// the one-stage all-reduce, reduce, reduce-scatter, all-gather, broadcast and
    /// scatter only (not the two-stage or Lamport all-reduce, the batched kernel or the
    /// fused RMSNorm).
    pub(crate) const fn every_kernel(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
    /// All supported dtypes, in the order of their codes.
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];
}

cfg_if::cfg_if! {
    if #[cfg(feature = "cuda")] {
        /// What a backend needs of an element type to move it (cudarc's `DeviceRepr` and
        /// `ValidAsZeroBits` when the `cuda` feature is on).
        pub trait BackendElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
        impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> BackendElement for T {}
    } else {
        /// What a backend needs of an element type to move it (nothing without `cuda`).
        pub trait BackendElement {}
        impl<T> BackendElement for T {}
    }
}

/// A Rust element type peercomm reduces: `f32`, `half::f16`, `half::bf16`, `f64`, `i8`,
/// `u8`, `i32`, `u32`, `i64`, `u64`.
///
/// The conversions through f32 and f64 are for building and checking data: they are
/// exact where the value fits, else they round to nearest even (a float) or follow
/// Rust's `as` (an integer: toward zero, saturating, NaN to 0).
pub trait Element:
    BackendElement + Copy + Send + Sync + Default + std::fmt::Debug + 'static + arith::Arith
{
    /// Its [`DType`].
    const DTYPE: DType;
    /// Converts to f32: exact for `f32`, `f16`, `bf16`, `i8`, `u8`; `f64` and the wider
    /// integers round to nearest even where the value has more than 24 significant bits.
    fn to_f32(self) -> f32;
    /// An f32 as this type: the floats round to nearest even (`f64`: exact), the
    /// integers as Rust's `as` (toward zero, saturating, NaN to 0).
    fn from_f32(x: f32) -> Self;
    /// Converts to f64: exact but for `i64` and `u64` beyond 2^53 (round to nearest even).
    fn to_f64(self) -> f64;
    /// An f64 as this type: the floats round to nearest even, the integers as Rust's
    /// `as` (toward zero, saturating, NaN to 0).
    ///
    /// ```
    /// use peercomm::Element;
    /// assert_eq!(<i8 as Element>::from_f64(300.0), 127);
    /// assert_eq!(<f32 as Element>::from_f64(0.1), 0.1f32);
    /// assert_eq!(<u64 as Element>::from_f64(-1.0), 0);
    /// ```
    fn from_f64(x: f64) -> Self;
    /// The raw bits, widened (to compare results bitwise); the low 32 bits of an 8-byte
    /// type ([`Element::to_bits_u64`] has them all).
    fn to_bits_u32(self) -> u32;
    /// The value with these raw bits (the low `8 * size` bits; an 8-byte type gets them
    /// zero-extended): the inverse of [`Element::to_bits_u32`] for the types of at most 4
    /// bytes, for -0.0, subnormals, NaN payloads and poison patterns that `from_f32`
    /// cannot express.
    ///
    /// ```
    /// use peercomm::Element;
    /// let neg_zero = <half::bf16 as Element>::from_bits_u32(0x8000);
    /// assert!(neg_zero.to_f32() == 0.0 && neg_zero.to_f32().is_sign_negative());
    /// assert_eq!(<f32 as Element>::from_bits_u32(1), f32::from_bits(1)); // smallest subnormal
    /// assert_eq!(half::f16::from_bits_u32(0xABCD_3C00).to_bits_u32(), 0x3C00);
    /// assert_eq!(<i8 as Element>::from_bits_u32(0xff), -1);
    /// ```
    fn from_bits_u32(bits: u32) -> Self;
    /// The raw bits, widened to 64.
    fn to_bits_u64(self) -> u64;
    /// The value with these raw bits (the low `8 * size` bits): the inverse of
    /// [`Element::to_bits_u64`].
    ///
    /// ```
    /// use peercomm::Element;
    /// let nan = <f64 as Element>::from_bits_u64(0x7ff8_0000_0000_0000);
    /// assert!(nan.is_nan());
    /// assert_eq!(<i64 as Element>::from_bits_u64(u64::MAX), -1);
    /// assert_eq!(<u8 as Element>::from_bits_u64(0x1ff), 0xff);
    /// ```
    fn from_bits_u64(bits: u64) -> Self;
}

/// The host arithmetic of the reductions: each element type names its accumulator (f32
/// for `f32`, `f16`, `bf16`; f64 for `f64`; the integer itself for the integers), which
/// [`ReduceOp`]'s rules run in. Sealed: only peercomm's element types implement it.
pub(crate) mod arith {
    use super::ReduceOp;

    /// An element type's accumulator and the conversions to and from it.
    pub trait Arith: Sized {
        /// The type the reduction runs in.
        type Acc: Acc;
        /// The element in the accumulator (exact).
        fn to_acc(self) -> Self::Acc;
        /// The accumulator rounded to the element (round to nearest even for the floats).
        fn from_acc(acc: Self::Acc) -> Self;
    }

    /// The operators' steps in one accumulator type (see [`ReduceOp`]).
    pub trait Acc: Copy {
        /// The start from group rank 0's element, over `width` ranks.
        fn start(op: ReduceOp, x0: Self, width: usize) -> Self;
        /// `acc` combined with the next rank's element `x`.
        fn combine(op: ReduceOp, acc: Self, x: Self) -> Self;
        /// The result over `width` ranks, before rounding to the element type.
        fn finish(op: ReduceOp, acc: Self, width: usize) -> Self;
    }

    /// The floats' rules: Sum from +0.0 over two or more ranks, Max and Min with -0.0
    /// below +0.0, a NaN of Prod, Max or Min the canonical quiet NaN, Avg the sum over
    /// the width.
    macro_rules! float_acc {
        ($($t:ty => $nan:expr);*) => {$(
            impl Acc for $t {
                fn start(op: ReduceOp, x0: Self, width: usize) -> Self {
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg if width > 1 => 0.0 + x0,
                        ReduceOp::Max | ReduceOp::Min if x0.is_nan() => <$t>::from_bits($nan),
                        _ => x0,
                    }
                }
                fn combine(op: ReduceOp, acc: Self, x: Self) -> Self {
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc + x,
                        ReduceOp::Prod => acc * x,
                        ReduceOp::Max | ReduceOp::Min if acc.is_nan() || x.is_nan() => {
                            <$t>::from_bits($nan)
                        }
                        ReduceOp::Max | ReduceOp::Min => {
                            let max = op == ReduceOp::Max;
                            // Equal values differ at most in the sign of zero: -0.0 is
                            // the smaller.
                            let x_above = if acc == x {
                                acc.is_sign_negative()
                            } else {
                                acc < x
                            };
                            if x_above == max {
                                x
                            } else {
                                acc
                            }
                        }
                    }
                }
                fn finish(op: ReduceOp, acc: Self, width: usize) -> Self {
                    match op {
                        ReduceOp::Avg if width > 1 => acc / width as $t,
                        ReduceOp::Prod if acc.is_nan() => <$t>::from_bits($nan),
                        _ => acc,
                    }
                }
            }
        )*};
    }
    float_acc!(f32 => super::CANONICAL_NAN_BITS; f64 => super::CANONICAL_NAN_F64_BITS);

    /// The integers' rules: wrapping Sum and Prod, Max and Min by value. Avg, which no
    /// integer call reaches (it is refused before anything launches), sums.
    macro_rules! int_acc {
        ($($t:ty),*) => {$(
            impl Acc for $t {
                fn start(_: ReduceOp, x0: Self, _: usize) -> Self {
                    x0
                }
                fn combine(op: ReduceOp, acc: Self, x: Self) -> Self {
                    match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x),
                        ReduceOp::Prod => acc.wrapping_mul(x),
                        ReduceOp::Max => acc.max(x),
                        ReduceOp::Min => acc.min(x),
                    }
                }
                fn finish(_: ReduceOp, acc: Self, _: usize) -> Self {
                    acc
                }
            }
            impl Arith for $t {
                type Acc = $t;
                fn to_acc(self) -> $t {
                    self
                }
                fn from_acc(acc: $t) -> $t {
                    acc
                }
            }
        )*};
    }
    int_acc!(i8, u8, i32, u32, i64, u64);

    impl Arith for f32 {
        type Acc = f32;
        fn to_acc(self) -> f32 {
            self
        }
        fn from_acc(acc: f32) -> f32 {
            acc
        }
    }
    impl Arith for f64 {
        type Acc = f64;
        fn to_acc(self) -> f64 {
            self
        }
        fn from_acc(acc: f64) -> f64 {
            acc
        }
    }
    impl Arith for half::f16 {
        type Acc = f32;
        fn to_acc(self) -> f32 {
            self.to_f32()
        }
        fn from_acc(acc: f32) -> Self {
            half::f16::from_f32(acc)
        }
    }
    impl Arith for half::bf16 {
        type Acc = f32;
        fn to_acc(self) -> f32 {
            self.to_f32()
        }
        fn from_acc(acc: f32) -> Self {
            half::bf16::from_f32(acc)
        }
    }
}

/// The floats: `$bits` is the raw bits' type, `$to`/`$from` convert to and from f32,
/// `$to64`/`$from64` to and from f64.
macro_rules! float_element {
    ($($t:ty => $dtype:ident, $bits:ty, $to:path, $from:path, $to64:path, $from64:path);*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f32(self) -> f32 { $to(self) }
            fn from_f32(x: f32) -> Self { $from(x) }
            fn to_f64(self) -> f64 { $to64(self) }
            fn from_f64(x: f64) -> Self { $from64(x) }
            fn to_bits_u32(self) -> u32 { self.to_bits() as u32 }
            fn from_bits_u32(bits: u32) -> Self { <$t>::from_bits(bits as $bits) }
            fn to_bits_u64(self) -> u64 { self.to_bits().into() }
            fn from_bits_u64(bits: u64) -> Self { <$t>::from_bits(bits as $bits) }
        }
    )*};
}
float_element!(
    f32 => F32, u32, std::convert::identity, std::convert::identity, f64::from, f64_to_f32;
    half::f16 => F16, u16, half::f16::to_f32, half::f16::from_f32, half::f16::to_f64,
        half::f16::from_f64;
    half::bf16 => BF16, u16, half::bf16::to_f32, half::bf16::from_f32, half::bf16::to_f64,
        half::bf16::from_f64;
    f64 => F64, u64, f64_to_f32, f64::from, std::convert::identity, std::convert::identity
);

fn f64_to_f32(x: f64) -> f32 {
    x as f32
}

/// The integers: `$bits` is the unsigned type of the same size.
macro_rules! int_element {
    ($($t:ty => $dtype:ident, $bits:ty);*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f32(self) -> f32 { self as f32 }
            fn from_f32(x: f32) -> Self { x as $t }
            fn to_f64(self) -> f64 { self as f64 }
            fn from_f64(x: f64) -> Self { x as $t }
            fn to_bits_u32(self) -> u32 { self as $bits as u32 }
            fn from_bits_u32(bits: u32) -> Self { bits as $bits as $t }
            fn to_bits_u64(self) -> u64 { self as $bits as u64 }
            fn from_bits_u64(bits: u64) -> Self { bits as $bits as $t }
        }
    )*};
}
int_element!(
    i8 => I8, u8; u8 => U8, u8; i32 => I32, u32; u32 => U32, u32; i64 => I64, u64;
    u64 => U64, u64
);

/// How a reducing collective combines the ranks' elements (cudarc's `nccl::ReduceOp`).
///
/// Over `f32`, `f16` and `bf16` every operator runs in f32, in group-rank order, and
/// rounds once to the element type at the end, so every rank, algorithm and message
/// size gives the same bits:
/// - `Sum`: `+0.0 + x0 + x1 + ...` (over two or more ranks an exact-zero sum is +0.0);
/// - `Prod`: `x0 * x1 * ...`, a NaN result the type's canonical quiet NaN;
/// - `Max`, `Min`: by value, with -0.0 below +0.0; any NaN gives the type's canonical
///   quiet NaN (`f32` 0x7fc00000, `f16` 0x7e00, `bf16` 0x7fc0);
/// - `Avg`: the `Sum`, divided by the group's width, then rounded.
///
/// `f64` follows the same rules in f64 (its canonical NaN is 0x7ff8000000000000). The
/// integers reduce in their own type, in group-rank order: `Sum` and `Prod` wrap on
/// overflow (as NCCL's), `Max` and `Min` by value; `Avg` takes only the floating types
/// (over an integer it is [`crate::Error::Unsupported`], before anything launches).
///
/// A NaN that `Sum` or `Avg` produce has the payload the hardware gives. Calls
/// that the router sends to NCCL or RCCL use that library's arithmetic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum (the default).
    #[default]
    Sum,
    /// The product.
    Prod,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The mean over the group: the sum divided by the group's width.
    Avg,
}

impl ReduceOp {
    /// Every operator, in the order of its code.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// Short lowercase name (`sum`, `prod`, `max`, `min`, `avg`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }

    /// The accumulator's start from group rank 0's element, over `width` ranks.
    pub(crate) fn start<A: arith::Acc>(self, x0: A, width: usize) -> A {
        A::start(self, x0, width)
    }

    /// The accumulator `acc` combined with the next rank's element `x`.
    pub(crate) fn combine<A: arith::Acc>(self, acc: A, x: A) -> A {
        A::combine(self, acc, x)
    }

    /// The result over `width` ranks, in the accumulator (before rounding to the element
    /// type).
    pub(crate) fn finish<A: arith::Acc>(self, acc: A, width: usize) -> A {
        A::finish(self, acc, width)
    }

    /// Whether it takes elements of `dtype` (every operator takes the floating types;
    /// `Avg` no integer).
    pub(crate) const fn takes(self, dtype: DType) -> bool {
        !matches!(self, ReduceOp::Avg) || dtype.is_float()
    }
}

/// The canonical quiet NaN's bits (the f32 NaN rounds to `f16` 0x7e00 and `bf16` 0x7fc0).
const CANONICAL_NAN_BITS: u32 = 0x7fc0_0000;
/// The f64 canonical quiet NaN's bits.
const CANONICAL_NAN_F64_BITS: u64 = 0x7ff8_0000_0000_0000;
#[cfg(test)]
const CANONICAL_NAN: f32 = f32::from_bits(CANONICAL_NAN_BITS);

#[cfg(test)]
mod tests {
    use super::*;

    /// The signs of zero and NaN, which the rules fix and plain `max`/`min` do not.
    #[test]
    fn extremes_order_zeros_and_canonicalise_nan() {
        let bits = |x: f32| x.to_bits();
        let (neg, pos) = (-0.0f32, 0.0f32);
        for (acc, x) in [(neg, pos), (pos, neg)] {
            assert_eq!(bits(ReduceOp::Max.combine(acc, x)), bits(pos));
            assert_eq!(bits(ReduceOp::Min.combine(acc, x)), bits(neg));
        }
        let payload = f32::from_bits(0xffc0_1234);
        for op in [ReduceOp::Max, ReduceOp::Min] {
            assert_eq!(bits(op.combine(1.0, payload)), 0x7fc0_0000);
            assert_eq!(bits(op.combine(payload, 1.0)), 0x7fc0_0000);
            assert_eq!(bits(op.start(payload, 2)), 0x7fc0_0000);
        }
        assert_eq!(half::f16::from_f32(CANONICAL_NAN).to_bits(), 0x7e00);
        assert_eq!(half::bf16::from_f32(CANONICAL_NAN).to_bits(), 0x7fc0);
        assert_eq!(
            ReduceOp::Avg.finish(ReduceOp::Avg.start(3.0, 2) + 4.0, 2),
            3.5
        );
        let prod = ReduceOp::Prod.combine(ReduceOp::Prod.start(payload, 2), 2.0);
        assert_eq!(bits(ReduceOp::Prod.finish(prod, 2)), 0x7fc0_0000);
        let signed = ReduceOp::Prod.combine(ReduceOp::Prod.start(neg, 2), 3.0);
        assert_eq!(bits(ReduceOp::Prod.finish(signed, 2)), bits(neg));
        assert_eq!(bits(ReduceOp::Sum.start(neg, 2)), bits(pos));
        assert_eq!(bits(ReduceOp::Sum.start(neg, 1)), bits(neg));
    }

    /// f64 keeps the float rules in f64; the integers wrap and order by value.
    #[test]
    fn f64_and_integer_rules() {
        let nan = f64::from_bits(0xfff0_0000_0000_0001);
        for op in [ReduceOp::Max, ReduceOp::Min] {
            assert_eq!(op.combine(1.0f64, nan).to_bits(), CANONICAL_NAN_F64_BITS);
            assert_eq!(op.start(nan, 1).to_bits(), CANONICAL_NAN_F64_BITS);
        }
        assert_eq!(ReduceOp::Max.combine(-0.0f64, 0.0).to_bits(), 0);
        assert_eq!(ReduceOp::Min.combine(0.0f64, -0.0).to_bits(), 1 << 63);
        assert_eq!(ReduceOp::Sum.start(-0.0f64, 2).to_bits(), 0);
        assert_eq!(
            ReduceOp::Avg.finish(ReduceOp::Avg.start(1.0f64, 2) + 2.0, 2),
            1.5
        );
        assert_eq!(ReduceOp::Sum.combine(i8::MAX, 1), i8::MIN);
        assert_eq!(ReduceOp::Prod.combine(u32::MAX, 2), u32::MAX - 1);
        assert_eq!(ReduceOp::Max.combine(-3i64, -7), -3);
        assert_eq!(ReduceOp::Min.combine(3u8, 200), 3);
        assert!(!ReduceOp::Avg.takes(DType::U8) && ReduceOp::Avg.takes(DType::F64));
        assert!(DType::ALL.iter().all(|d| ReduceOp::Max.takes(*d)));
    }
}
