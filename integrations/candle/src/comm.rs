//! [`CandleComm`]: one rank of a peercomm communicator, bound to a candle CUDA device.

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, Device, Layout, Storage, Tensor};
use peercomm::backend::cuda::{Cuda, CudaDevice};
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, ReduceOp};

use crate::error::{Error, Result};
use launch::{contiguous_range, run_alloc, run_in_place, Call, InPlace};

mod collectives;
mod launch;

/// One rank of a peercomm per-rank communicator, running its collectives on the stream
/// of one candle CUDA device.
///
/// Made in the thread or process that owns the rank's GPU, like cudarc's
/// `nccl::Comm::from_rank`. Every rank must make the same calls, with tensors of the same
/// dtype and shape, in the same order (as with NCCL).
///
/// # In a CUDA graph the engine captures
///
/// peercomm's collectives neither synchronise the host nor allocate, so they can sit in
/// the CUDA graph of an engine's model step, captured by the engine itself on the
/// model's stream (candle's: `cuda.cuda_stream()`, which this communicator runs on):
///
/// 1. **Before the capture,** allocate every tensor the captured calls touch: the inputs
///    and the outputs of the `*_into` forms (or use the in-place forms). The allocating
///    forms ([`CandleComm::all_reduce`], [`CandleComm::all_gather`], ...) allocate their
///    result on the stream and do not belong in a capture. Run each collective once
///    eagerly if the ranks share a GPU (a first use of a candle kernel loads its module,
///    which can wait behind a peer's collective), and synchronise the stream.
/// 2. **Turn cudarc's event tracking off** for the capture
///    (`unsafe { cuda.disable_event_tracking() }`) and back on after it
///    (`unsafe { stream.context().enable_event_tracking() }`) if it was on
///    (`cuda.is_event_tracking()`): with it on, each use of a tensor records a CUDA event,
///    and an event recorded inside a capture cannot be waited on outside it. peercomm's
///    own `Comm::capture` does the same.
/// 3. **Begin the capture** on the stream:
///    `stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)`
///    (relaxed, as peercomm's own capture: ranks in other threads keep using CUDA).
/// 4. **Call the collectives** with the tensors of step 1, e.g.
///    `comm.all_reduce_into(&partial, &out, &ReduceOp::Sum)?`, among the model's work.
/// 5. **End the capture:** `stream.end_capture(CUgraphInstantiate_flags(0))?` gives the
///    graph (`Option<CudaGraph>`).
/// 6. **Launch** it with `graph.launch()` as often as needed, after writing each step's
///    inputs into the captured tensors (`x.slice_set(&fresh, 0, 0)`, or the model's own
///    kernels); read the outputs after it, on the stream or after
///    [`CandleComm::synchronize`].
///
/// Every rank captures the same collectives in the same order, and launches its graph
/// as many times and at the same place among its eager collectives: each launch makes
/// the captured calls again, which the peers must match (a mismatch is the same typed
/// error as eagerly). The tensors must outlive the graph. The test
/// `all_reduce_in_a_graph_the_engine_captured` (`tests/tp_mlp/graph_capture.rs`) does
/// exactly this.
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

    /// The sum of `tensor` over the ranks: [`CandleComm::all_reduce_with`] with
    /// [`ReduceOp::Sum`] (allocates the result).
    pub fn all_reduce_sum(&self, tensor: &Tensor, options: &AllReduceOptions) -> Result<Tensor> {
        self.all_reduce_with(tensor, &ReduceOp::Sum, options)
    }

    /// Sums `tensor` over the ranks in place: [`CandleComm::all_reduce_in_place_with`]
    /// with [`ReduceOp::Sum`].
    pub fn all_reduce_sum_in_place(
        &self,
        tensor: &Tensor,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.all_reduce_in_place_with(tensor, &ReduceOp::Sum, options)
    }

    /// Sums the elements `layout` addresses in `storage` over the ranks, in place: the
    /// building block for a candle [`InplaceOp1`](candle_core::InplaceOp1) of your own.
    /// The storage must be on this rank's device and the layout contiguous.
    pub fn all_reduce_sum_storage(
        &self,
        storage: &mut CudaStorage,
        layout: &Layout,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check_device(&Device::Cuda(storage.device.clone()))?;
        check_dtype(storage.dtype())?;
        let range = contiguous_range(layout)?;
        let call = Call::AllReduce(ReduceOp::Sum, options);
        Ok(algorithm(run_in_place(call, &self.comm, storage, range)?))
    }

    /// Everything about a tensor that can be checked before a launch.
    fn check(&self, tensor: &Tensor) -> Result<()> {
        self.check_device(tensor.device())?;
        check_dtype(tensor.dtype())?;
        contiguous_range(tensor.layout()).map(|_| ())
    }

    /// The width of the groups of `group_size` (0: the world), as peercomm rules.
    fn width(&self, group_size: usize) -> Result<usize> {
        let world = self.world_size();
        let width = if group_size == 0 { world } else { group_size };
        if width > world || !world.is_multiple_of(width) {
            let e = peercomm::Error::InvalidGroupSize { group_size, world };
            return Err(Error::Peercomm(e));
        }
        Ok(width)
    }

    /// The shape `call` writes from an input of shape `dims`.
    fn output_dims(&self, call: Call<'_>, dims: &[usize]) -> Result<Vec<usize>> {
        let mut out = dims.to_vec();
        match call {
            Call::AllReduce(..) | Call::Broadcast(..) => {}
            Call::AllGather(o) => {
                let width = self.width(o.group_size)?;
                let rows = out.first_mut().ok_or(Error::Scalar)?;
                *rows *= width;
            }
            Call::ReduceScatter(_, o) => {
                let width = self.width(o.group_size)?;
                let rows = out.first_mut().ok_or(Error::Scalar)?;
                if !rows.is_multiple_of(width) {
                    return Err(Error::NotDivisible { rows: *rows, width });
                }
                *rows /= width;
            }
            Call::AllToAll => {
                let width = self.width(0)?;
                let rows = out.first_mut().ok_or(Error::Scalar)?;
                if !rows.is_multiple_of(width) {
                    return Err(Error::NotDivisible { rows: *rows, width });
                }
            }
            Call::AllToAllV { send, recv, .. } => {
                let rows = out.first_mut().ok_or(Error::Scalar)?;
                if send.iter().sum::<usize>() != *rows {
                    let (sent, rows) = (send.iter().sum(), *rows);
                    return Err(Error::RowCounts { sent, rows });
                }
                *rows = recv.iter().sum();
            }
        }
        Ok(out)
    }

    /// Runs `call` from `input` into a new tensor of the shape it writes.
    fn run_alloc(&self, call: Call<'_>, input: &Tensor) -> Result<Tensor> {
        self.check(input)?;
        let dims = self.output_dims(call, input.dims())?;
        let (storage, layout) = input.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(Error::NotCuda {
                location: format!("{:?}", input.device().location()),
            });
        };
        let range = contiguous_range(layout)?;
        let len = dims.iter().product();
        let out = run_alloc(call, &self.comm, storage, range, len)?;
        Ok(Tensor::from_storage(
            Storage::Cuda(out),
            dims,
            BackpropOp::none(),
            false,
        ))
    }

    /// Runs `call` from `input` into `output`'s storage; the very same elements run in
    /// place (the all-reduce and the broadcast).
    fn run_into(
        &self,
        call: Call<'_>,
        input: &Tensor,
        output: &Tensor,
    ) -> Result<Option<Algorithm>> {
        self.check(input)?;
        self.check(output)?;
        if input.dtype() != output.dtype() {
            return Err(Error::DTypeMismatch {
                input: input.dtype(),
                output: output.dtype(),
            });
        }
        let expected = self.output_dims(call, input.dims())?;
        if output.dims() != expected {
            return Err(Error::ShapeMismatch {
                expected,
                got: output.dims().to_vec(),
            });
        }
        if storage_key(input) == storage_key(output) {
            let same = contiguous_range(input.layout())? == contiguous_range(output.layout())?;
            if !same {
                return Err(Error::OutputAliasesInput);
            }
            return InPlace::new(&self.comm, call).apply(output);
        }
        launch::IntoOutput::new(&self.comm, call).apply(input, output)
    }

    /// Runs `call` in place on `tensor`.
    fn run_in_place(&self, call: Call<'_>, tensor: &Tensor) -> Result<Option<Algorithm>> {
        self.check(tensor)?;
        InPlace::new(&self.comm, call).apply(tensor)
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

/// Which storage a tensor's elements live in (equal for tensors sharing it).
fn storage_key(tensor: &Tensor) -> usize {
    let (storage, _) = tensor.storage_and_layout();
    std::ptr::from_ref::<Storage>(&*storage) as usize
}

/// An all-reduce's algorithm (every all-reduce reports one).
fn algorithm(found: Option<Algorithm>) -> Algorithm {
    found.unwrap_or(Algorithm::Auto)
}
