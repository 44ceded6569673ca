//! [`CandleComm`]: one rank of a peercomm communicator, bound to a candle CUDA device.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Storage, Tensor};
use half::{bf16, f16};
use peercomm::backend::cuda::{Cuda, CudaDevice};
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, ReduceOp};

use crate::error::{Error, Result};

/// One rank of a peercomm per-rank communicator, running its collectives on the stream
/// of one candle CUDA device.
///
/// Made in the thread or process that owns the rank's GPU, like cudarc's
/// `nccl::Comm::from_rank`. Every rank must make the same calls, with tensors of the same
/// dtype and element count, in the same order (as with NCCL).
pub struct CandleComm {
    comm: Comm<Cuda>,
    device: Device,
    ordinal: usize,
}

impl CandleComm {
    /// Rank `rank` of `world_size` on `device` (a CUDA device, for example
    /// `Device::new_cuda_with_stream(ordinal)`). Every rank passes the same `id` (made by
    /// rank 0 with [`UniqueId::new`] and sent to the others) and the same `config`
    /// (`allow_shared_devices` lets several ranks share one GPU); returns once every rank
    /// has joined.
    pub fn from_rank(
        device: &Device,
        rank: usize,
        world_size: usize,
        id: &UniqueId,
        config: CommConfig,
    ) -> Result<Self> {
        let cuda = match device {
            Device::Cuda(cuda) => cuda,
            other => {
                return Err(Error::NotCuda {
                    location: format!("{:?}", other.location()),
                })
            }
        };
        let stream = cuda.cuda_stream();
        let ordinal = stream.context().ordinal();
        let peer_device = CudaDevice::from_stream(stream)?;
        let comm = Comm::<Cuda>::from_rank(peer_device, rank, world_size, id, config)?;
        Ok(CandleComm {
            comm,
            device: device.clone(),
            ordinal,
        })
    }

    /// The peercomm communicator underneath (for `synchronize`, `barrier`, the config).
    pub fn comm(&self) -> &Comm<Cuda> {
        &self.comm
    }

    /// The candle device every collective of this rank runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Waits for this rank's collectives, and reports a device-side failure (a peer that
    /// never arrived) as a typed error.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.comm.synchronize()?)
    }

    /// The sum of `tensor` over the ranks (of each group, with
    /// [`AllReduceOptions::group_size`]), as a new tensor of the same shape and dtype on
    /// this rank's device. Returns once the collective is enqueued on the device's
    /// stream; later candle work on the result is ordered after it.
    pub fn all_reduce_sum(&self, tensor: &Tensor, options: &AllReduceOptions) -> Result<Tensor> {
        self.check(tensor)?;
        let (storage, layout) = tensor.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            unreachable!("checked: a CUDA tensor");
        };
        let (start, end) = contiguous_range(layout)?;
        let device = &storage.device;
        // SAFETY (each arm's `alloc`): the collective writes every element of the new
        // buffer before any work ordered after it on this stream reads it; when the launch
        // is refused the buffer is dropped unread.
        let out = match &storage.slice {
            CudaStorageSlice::BF16(s) => {
                let mut out = unsafe { device.alloc::<bf16>(end - start) }?;
                self.comm.all_reduce_with(
                    &s.slice(start..end),
                    &mut out,
                    &ReduceOp::Sum,
                    options,
                )?;
                CudaStorage::wrap_cuda_slice(out, device.clone())
            }
            CudaStorageSlice::F16(s) => {
                let mut out = unsafe { device.alloc::<f16>(end - start) }?;
                self.comm.all_reduce_with(
                    &s.slice(start..end),
                    &mut out,
                    &ReduceOp::Sum,
                    options,
                )?;
                CudaStorage::wrap_cuda_slice(out, device.clone())
            }
            CudaStorageSlice::F32(s) => {
                let mut out = unsafe { device.alloc::<f32>(end - start) }?;
                self.comm.all_reduce_with(
                    &s.slice(start..end),
                    &mut out,
                    &ReduceOp::Sum,
                    options,
                )?;
                CudaStorage::wrap_cuda_slice(out, device.clone())
            }
            _ => unreachable!("checked: a supported dtype"),
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(out),
            layout.shape().clone(),
            BackpropOp::none(),
            false,
        ))
    }

    /// Sums `tensor` over the ranks in place: its storage is overwritten (every tensor
    /// sharing that storage sees the sum). Returns the algorithm that runs.
    pub fn all_reduce_sum_in_place(
        &self,
        tensor: &Tensor,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check(tensor)?;
        let op = InPlace {
            comm: self,
            options,
            outcome: RefCell::new(None),
        };
        let launched = tensor.inplace_op1(&op);
        match op.outcome.into_inner() {
            Some(outcome) => outcome,
            // candle refused before calling the op (it never does for a CUDA tensor).
            None => Err(launched.err().map_or_else(
                || Error::Candle(candle_core::Error::Msg("in-place op not run".into())),
                Error::Candle,
            )),
        }
    }

    /// Sums the elements `layout` addresses in `storage` over the ranks, in place: the
    /// building block for a candle [`InplaceOp1`] of your own. The storage must be on this
    /// rank's device and the layout contiguous.
    pub fn all_reduce_sum_storage(
        &self,
        storage: &mut CudaStorage,
        layout: &Layout,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check_device(&Device::Cuda(storage.device.clone()))?;
        check_dtype(storage.dtype())?;
        let (start, end) = contiguous_range(layout)?;
        let algorithm = match &mut storage.slice {
            CudaStorageSlice::BF16(s) => self.comm.all_reduce_in_place_with(
                &mut s.slice_mut(start..end),
                &ReduceOp::Sum,
                options,
            )?,
            CudaStorageSlice::F16(s) => self.comm.all_reduce_in_place_with(
                &mut s.slice_mut(start..end),
                &ReduceOp::Sum,
                options,
            )?,
            CudaStorageSlice::F32(s) => self.comm.all_reduce_in_place_with(
                &mut s.slice_mut(start..end),
                &ReduceOp::Sum,
                options,
            )?,
            _ => unreachable!("checked: a supported dtype"),
        };
        Ok(algorithm)
    }

    /// Everything about a tensor that can be checked before a launch.
    fn check(&self, tensor: &Tensor) -> Result<()> {
        self.check_device(tensor.device())?;
        check_dtype(tensor.dtype())?;
        contiguous_range(tensor.layout()).map(|_| ())
    }

    fn check_device(&self, device: &Device) -> Result<()> {
        match device {
            Device::Cuda(_) if device.same_device(&self.device) => Ok(()),
            Device::Cuda(cuda) => Err(Error::WrongDevice {
                expected: self.ordinal,
                got: format!("{:?} ({:?})", device.location(), cuda.id()),
            }),
            other => Err(Error::NotCuda {
                location: format!("{:?}", other.location()),
            }),
        }
    }
}

fn check_dtype(dtype: candle_core::DType) -> Result<()> {
    use candle_core::DType::{BF16, F16, F32};
    match dtype {
        BF16 | F16 | F32 => Ok(()),
        other => Err(Error::UnsupportedDType(other)),
    }
}

/// The element range a contiguous layout covers in its storage.
fn contiguous_range(layout: &Layout) -> Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| Error::NotContiguous {
            shape: layout.dims().to_vec(),
            stride: layout.stride().to_vec(),
        })
}

/// The in-place all-reduce as a candle custom op (candle hands it the storage under its
/// write lock); the typed outcome is kept for [`CandleComm::all_reduce_sum_in_place`].
struct InPlace<'a> {
    comm: &'a CandleComm,
    options: &'a AllReduceOptions,
    outcome: RefCell<Option<Result<Algorithm>>>,
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "peercomm-all-reduce-sum"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        let err = Error::NotCuda {
            location: "Cpu".into(),
        };
        let msg = err.to_string();
        *self.outcome.borrow_mut() = Some(Err(err));
        Err(candle_core::Error::Msg(msg))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let outcome = self
            .comm
            .all_reduce_sum_storage(storage, layout, self.options);
        let result = match &outcome {
            Ok(_) => Ok(()),
            Err(e) => Err(candle_core::Error::Msg(e.to_string())),
        };
        *self.outcome.borrow_mut() = Some(outcome);
        result
    }
}
