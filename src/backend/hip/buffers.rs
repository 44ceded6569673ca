//! The typed device buffer `HipBuffer` and its `DeviceBuffer` impls.

use std::marker::PhantomData;

use super::super::{DeviceBuffer, DeviceBufferMut};
use crate::dtype::{DType, Element};

use super::device::*;
use super::memory::*;
use super::runtime::Hip;

/// A typed device buffer on one AMD GPU.
pub struct HipBuffer<T: Element> {
    pub(super) mem: HipMemory,
    pub(super) len: usize,
    pub(super) _t: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for HipBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("mem", &self.mem)
            .finish()
    }
}

impl<T: Element> HipBuffer<T> {
    /// Device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.mem.ptr
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBuffer<Hip> for HipBuffer<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.mem.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a HipDevice) -> (u64, ()) {
        (self.mem.ptr, ())
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBufferMut<Hip> for HipBuffer<T> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a HipDevice) -> (u64, ()) {
        (self.mem.ptr, ())
    }
}
