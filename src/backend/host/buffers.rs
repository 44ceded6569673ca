//! The typed buffer of the host backend, [`HostBuffer`].

use super::device::{Host, HostDevice};
use super::memory::HostMemory;
use crate::backend::{DeviceBuffer, DeviceBufferMut};
use crate::dtype::{DType, Element};

/// A typed buffer on a host device.
pub struct HostBuffer<T: Element> {
    pub(super) mem: HostMemory,
    pub(super) len: usize,
    pub(super) _t: std::marker::PhantomData<T>,
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.
unsafe impl<T: Element> DeviceBuffer<Host> for HostBuffer<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.mem.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a HostDevice) -> (u64, ()) {
        (self.mem.addr(), ())
    }
}

// SAFETY: as above.
unsafe impl<T: Element> DeviceBufferMut<Host> for HostBuffer<T> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a HostDevice) -> (u64, ()) {
        (self.mem.addr(), ())
    }
}
