//! Tensors as collectives take them: a device buffer plus the shape it carries.
//! Only the element count matters to the reduction; shapes are checked to agree.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};

/// A shaped view over a borrowed buffer (`$data`: how it is borrowed).
macro_rules! view {
    ($(#[$doc:meta])* $name:ident, $data:ty) => {
        $(#[$doc])*
        pub struct $name<'a, B: Backend> {
            pub(crate) data: $data,
            pub(crate) shape: Vec<usize>,
        }

        impl<'a, B: Backend> $name<'a, B> {
            /// A tensor of the given shape over `data`.
            pub fn new(data: $data, shape: &[usize]) -> Self {
                let shape = shape.to_vec();
                $name { data, shape }
            }
            /// A rank-1 tensor over the whole buffer.
            pub fn flat(data: $data) -> Self {
                let shape = vec![data.len()];
                $name { data, shape }
            }
            /// Its shape.
            pub fn shape(&self) -> &[usize] {
                &self.shape
            }
        }
    };
}

view!(
    /// A read-only tensor: a borrowed device buffer and its shape.
    TensorView,
    &'a dyn DeviceBuffer<B>
);
view!(
    /// A writable tensor: a mutably borrowed device buffer and its shape.
    TensorViewMut,
    &'a mut dyn DeviceBufferMut<B>
);

/// Elements a shape describes (`None` when the product overflows).
pub(crate) fn shape_elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The shaped input view's old name (it clashed with candle's `Tensor`).
#[deprecated(note = "renamed `TensorView`")]
pub type Tensor<'a, B> = TensorView<'a, B>;
/// The shaped output view's old name.
#[deprecated(note = "renamed `TensorViewMut`")]
pub type TensorMut<'a, B> = TensorViewMut<'a, B>;
