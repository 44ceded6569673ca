//! The `DeviceBuffer` and `DeviceBufferMut` impls for cudarc's `CudaSlice`,
//! `CudaView` and `CudaViewMut`.

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use super::super::{DeviceBuffer, DeviceBufferMut};
use super::device::{Cuda, CudaDevice};
use crate::dtype::{DType, Element};

fn ordinal_of<T>(s: &impl DeviceSlice<T>) -> usize {
    s.stream().context().ordinal()
}

macro_rules! impl_cuda_buffer {
    ($($ty:ty),*) => {$(
        // SAFETY: the pointer, length, dtype and device come from the allocation itself.
        unsafe impl<T: Element> DeviceBuffer<Cuda> for $ty {
            fn dtype(&self) -> DType {
                T::DTYPE
            }
            fn len(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn device_ordinal(&self) -> usize {
                ordinal_of(self)
            }
            fn read_ptr<'a>(&'a self, dev: &'a CudaDevice) -> (u64, SyncOnDrop<'a>) {
                self.device_ptr(&dev.stream)
            }
        }
    )*};
}
impl_cuda_buffer!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);

macro_rules! impl_cuda_buffer_mut {
    ($($ty:ty),*) => {$(
        // SAFETY: the pointer, length, dtype and device come from the allocation itself.
        unsafe impl<T: Element> DeviceBufferMut<Cuda> for $ty {
            fn write_ptr<'a>(&'a mut self, dev: &'a CudaDevice) -> (u64, SyncOnDrop<'a>) {
                self.device_ptr_mut(&dev.stream)
            }
        }
    )*};
}
impl_cuda_buffer_mut!(CudaSlice<T>, CudaViewMut<'_, T>);
