//! Tensors as collectives take them: a device buffer plus the shape it carries.
//! Only the element count matters to the reduction; shapes are checked to agree.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};

/// A read-only tensor: a borrowed device buffer and its shape.
pub struct TensorView<'a, B: Backend> {
    pub(crate) data: &'a dyn DeviceBuffer<B>,
    pub(crate) shape: Vec<usize>,
}

impl<'a, B: Backend> TensorView<'a, B> {
    /// A tensor of the given shape over `data`.
    pub fn new(data: &'a dyn DeviceBuffer<B>, shape: &[usize]) -> Self {
        TensorView {
            data,
            shape: shape.to_vec(),
        }
    }
    /// A rank-1 tensor over the whole buffer.
    pub fn flat(data: &'a dyn DeviceBuffer<B>) -> Self {
        TensorView {
            data,
            shape: vec![data.len()],
        }
    }
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// A writable tensor: a mutably borrowed device buffer and its shape.
pub struct TensorViewMut<'a, B: Backend> {
    pub(crate) data: &'a mut dyn DeviceBufferMut<B>,
    pub(crate) shape: Vec<usize>,
}

impl<'a, B: Backend> TensorViewMut<'a, B> {
    /// A tensor of the given shape over `data`.
    pub fn new(data: &'a mut dyn DeviceBufferMut<B>, shape: &[usize]) -> Self {
        TensorViewMut {
            data,
            shape: shape.to_vec(),
        }
    }
    /// A rank-1 tensor over the whole buffer.
    pub fn flat(data: &'a mut dyn DeviceBufferMut<B>) -> Self {
        let len = data.len();
        TensorViewMut {
            data,
            shape: vec![len],
        }
    }
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

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
