//! Element types the collectives handle (their kernel codes: `DType::raw` in
//! [`crate::signal`]).

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`), accumulated in f32.
    F16,
    /// bfloat16 (`half::bf16`), accumulated in f32.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// Elements per 16-byte pack.
    pub const fn lanes(self) -> usize {
        16 / self.size()
    }
    /// Short lowercase name (`f32`, `f16`, `bf16`), as in kernel names.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
    /// All supported dtypes.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
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

/// A Rust element type peercomm reduces: `f32`, `half::f16`, `half::bf16`.
pub trait Element:
    BackendElement + Copy + Send + Sync + Default + std::fmt::Debug + 'static
{
    /// Its [`DType`].
    const DTYPE: DType;
    /// Converts to f32 (exact for all three types).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// The raw bits, widened (to compare results bitwise).
    fn to_bits_u32(self) -> u32;
    /// The value with these raw bits (the low 16 for `f16`/`bf16`; the high 16 are
    /// ignored): the inverse of [`Element::to_bits_u32`], for -0.0, subnormals, NaN
    /// payloads and poison patterns that `from_f32` cannot express.
    ///
    /// ```
    /// use peercomm::Element;
    /// let neg_zero = <half::bf16 as Element>::from_bits_u32(0x8000);
    /// assert!(neg_zero.to_f32() == 0.0 && neg_zero.to_f32().is_sign_negative());
    /// assert_eq!(<f32 as Element>::from_bits_u32(1), f32::from_bits(1)); // smallest subnormal
    /// assert_eq!(half::f16::from_bits_u32(0xABCD_3C00).to_bits_u32(), 0x3C00);
    /// ```
    fn from_bits_u32(bits: u32) -> Self;
}

/// `$to`/`$from` convert to and from f32; `$bits` is the raw bits' type.
macro_rules! element {
    ($($t:ty => $dtype:ident, $bits:ty, $to:path, $from:path);*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f32(self) -> f32 { $to(self) }
            fn from_f32(x: f32) -> Self { $from(x) }
            fn to_bits_u32(self) -> u32 { self.to_bits().into() }
            fn from_bits_u32(bits: u32) -> Self { <$t>::from_bits(bits as $bits) }
        }
    )*};
}
element!(
    f32 => F32, u32, std::convert::identity, std::convert::identity;
    half::f16 => F16, u16, half::f16::to_f32, half::f16::from_f32;
    half::bf16 => BF16, u16, half::bf16::to_f32, half::bf16::from_f32
);

/// How a reducing collective combines the ranks' elements (cudarc's `nccl::ReduceOp`).
///
/// Over `f32`, `f16` and `bf16` every operator runs in f32, in group-rank order, and
/// rounds once to the element type at the end, so every rank, algorithm and message
/// size gives the same bits:
/// - `Sum`: `+0.0 + x0 + x1 + ...` (over two or more ranks an exact-zero sum is +0.0);
/// - `Prod`: `x0 * x1 * ...`;
/// - `Max`, `Min`: by value, with -0.0 below +0.0; any NaN gives the type's canonical
///   quiet NaN (`f32` 0x7fc00000, `f16` 0x7e00, `bf16` 0x7fc0);
/// - `Avg`: the `Sum`, divided by the group's width, then rounded.
///
/// A NaN that `Sum`, `Prod` or `Avg` produce has the payload the hardware gives. Calls
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
    pub(crate) fn start(self, x0: f32, width: usize) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg if width > 1 => 0.0 + x0,
            ReduceOp::Max | ReduceOp::Min if x0.is_nan() => CANONICAL_NAN,
            _ => x0,
        }
    }

    /// The accumulator `acc` combined with the next rank's element `x`.
    pub(crate) fn combine(self, acc: f32, x: f32) -> f32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Prod => acc * x,
            ReduceOp::Max | ReduceOp::Min if acc.is_nan() || x.is_nan() => CANONICAL_NAN,
            ReduceOp::Max | ReduceOp::Min => {
                let max = self == ReduceOp::Max;
                // Equal values differ at most in the sign of zero: -0.0 is the smaller.
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

    /// The result over `width` ranks, in f32 (before rounding to the element type).
    pub(crate) fn finish(self, acc: f32, width: usize) -> f32 {
        match self {
            ReduceOp::Avg if width > 1 => acc / width as f32,
            _ => acc,
        }
    }
}

/// The canonical quiet NaN (rounds to `f16` 0x7e00 and `bf16` 0x7fc0).
const CANONICAL_NAN: f32 = f32::from_bits(0x7fc0_0000);

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
        assert_eq!(bits(ReduceOp::Sum.start(neg, 2)), bits(pos));
        assert_eq!(bits(ReduceOp::Sum.start(neg, 1)), bits(neg));
    }
}
