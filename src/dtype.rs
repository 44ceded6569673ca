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
