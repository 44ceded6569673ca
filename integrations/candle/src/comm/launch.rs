//! One collective on candle's CUDA storage: the call, its dispatch over the element
//! types, and the candle custom ops that hand an output's storage over under its lock.

use std::cell::RefCell;
use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CpuStorage, CudaStorage, InplaceOp1, InplaceOp2, Layout};
use peercomm::backend::cuda::Cuda;
use peercomm::backend::{DeviceBuffer, DeviceBufferMut};
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, ReduceOp};

use crate::error::{Error, Result};

/// A collective with everything but its buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Call<'a> {
    AllReduce(ReduceOp, &'a AllReduceOptions),
    ReduceScatter(ReduceOp, &'a CollectiveOptions),
    AllGather(&'a CollectiveOptions),
    Broadcast(usize, &'a CollectiveOptions),
    /// Dim 0 in equal parts, part q to rank q.
    AllToAll,
    /// `send[q]` rows to rank q, `recv[q]` rows from rank q, `row` elements a row.
    AllToAllV {
        send: &'a [usize],
        recv: &'a [usize],
        row: usize,
    },
}

impl Call<'_> {
    /// The peercomm name of the call, for candle's custom-op names.
    fn name(self) -> &'static str {
        match self {
            Call::AllReduce(..) => "peercomm-all-reduce",
            Call::ReduceScatter(..) => "peercomm-reduce-scatter",
            Call::AllGather(..) => "peercomm-all-gather",
            Call::Broadcast(..) => "peercomm-broadcast",
            Call::AllToAll => "peercomm-all-to-all",
            Call::AllToAllV { .. } => "peercomm-all-to-all-v",
        }
    }

    /// Enqueues the call from `input` into `output`; the algorithm for an all-reduce.
    fn run<S, R>(self, comm: &Comm<Cuda>, input: &S, output: &mut R) -> Result<Option<Algorithm>>
    where
        S: DeviceBuffer<Cuda>,
        R: DeviceBufferMut<Cuda>,
    {
        Ok(match self {
            Call::AllReduce(op, o) => Some(comm.all_reduce_with(input, output, &op, o)?),
            Call::ReduceScatter(op, o) => {
                comm.reduce_scatter_with(input, output, &op, o).map(none)?
            }
            Call::AllGather(o) => comm.all_gather_with(input, output, o).map(none)?,
            Call::Broadcast(root, o) => {
                // A non-root's input is not read (peercomm ignores it).
                let send: &dyn DeviceBuffer<Cuda> = input;
                comm.broadcast_with(Some(send), output, root, o).map(none)?
            }
            Call::AllToAll => comm.all_to_all(input, output).map(none)?,
            Call::AllToAllV { send, recv, row } => {
                let elements = |rows: &[usize]| rows.iter().map(|r| r * row).collect::<Vec<_>>();
                let (send, recv) = (elements(send), elements(recv));
                comm.all_to_all_v(input, &send, output, &recv).map(none)?
            }
        })
    }

    /// Enqueues the call in place on `buf` (the all-reduce and the broadcast).
    fn run_in_place<R>(self, comm: &Comm<Cuda>, buf: &mut R) -> Result<Option<Algorithm>>
    where
        R: DeviceBufferMut<Cuda>,
    {
        Ok(match self {
            Call::AllReduce(op, o) => Some(comm.all_reduce_in_place_with(buf, &op, o)?),
            Call::Broadcast(root, o) => comm.broadcast_in_place_with(buf, root, o).map(none)?,
            Call::ReduceScatter(..)
            | Call::AllGather(..)
            | Call::AllToAll
            | Call::AllToAllV { .. } => return Err(Error::OutputAliasesInput),
        })
    }
}

fn none(_: ()) -> Option<Algorithm> {
    None
}

/// Runs `call` from `input[ir]` into `output[or]` (the same element type: checked
/// before, else [`Error::DTypeMismatch`]).
pub(crate) fn run_slices(
    call: Call<'_>,
    comm: &Comm<Cuda>,
    (input, ir): (&CudaStorage, Range<usize>),
    (output, or): (&mut CudaStorage, Range<usize>),
) -> Result<Option<Algorithm>> {
    use CudaStorageSlice::{BF16, F16, F32};
    let (in_dtype, out_dtype) = (input.dtype(), output.dtype());
    match (&input.slice, &mut output.slice) {
        (BF16(i), BF16(o)) => call.run(comm, &i.slice(ir), &mut o.slice_mut(or)),
        (F16(i), F16(o)) => call.run(comm, &i.slice(ir), &mut o.slice_mut(or)),
        (F32(i), F32(o)) => call.run(comm, &i.slice(ir), &mut o.slice_mut(or)),
        _ if in_dtype != out_dtype => Err(Error::DTypeMismatch {
            input: in_dtype,
            output: out_dtype,
        }),
        _ => Err(Error::UnsupportedDType(in_dtype)),
    }
}

/// Runs `call` in place on `buf[range]`.
pub(crate) fn run_in_place(
    call: Call<'_>,
    comm: &Comm<Cuda>,
    buf: &mut CudaStorage,
    range: Range<usize>,
) -> Result<Option<Algorithm>> {
    let dtype = buf.dtype();
    match &mut buf.slice {
        CudaStorageSlice::BF16(s) => call.run_in_place(comm, &mut s.slice_mut(range)),
        CudaStorageSlice::F16(s) => call.run_in_place(comm, &mut s.slice_mut(range)),
        CudaStorageSlice::F32(s) => call.run_in_place(comm, &mut s.slice_mut(range)),
        _ => Err(Error::UnsupportedDType(dtype)),
    }
}

/// Runs `call` from `input[ir]` into new storage of `len` elements on the input's
/// device (allocated on its stream).
pub(crate) fn run_alloc(
    call: Call<'_>,
    comm: &Comm<Cuda>,
    input: &CudaStorage,
    ir: Range<usize>,
    len: usize,
) -> Result<CudaStorage> {
    let device = &input.device;
    // SAFETY (each arm's `alloc`): the collective writes every element of the new
    // buffer before any work ordered after it on this stream reads it; when the launch
    // is refused the buffer is dropped unread.
    let slice = match &input.slice {
        CudaStorageSlice::BF16(s) => {
            let mut out = unsafe { device.alloc(len) }?;
            call.run(comm, &s.slice(ir), &mut out)?;
            CudaStorageSlice::BF16(out)
        }
        CudaStorageSlice::F16(s) => {
            let mut out = unsafe { device.alloc(len) }?;
            call.run(comm, &s.slice(ir), &mut out)?;
            CudaStorageSlice::F16(out)
        }
        CudaStorageSlice::F32(s) => {
            let mut out = unsafe { device.alloc(len) }?;
            call.run(comm, &s.slice(ir), &mut out)?;
            CudaStorageSlice::F32(out)
        }
        _ => return Err(Error::UnsupportedDType(input.dtype())),
    };
    Ok(CudaStorage {
        slice,
        device: device.clone(),
    })
}

/// The element range a contiguous layout covers in its storage.
pub(crate) fn contiguous_range(layout: &Layout) -> Result<Range<usize>> {
    layout
        .contiguous_offsets()
        .map(|(start, end)| start..end)
        .ok_or_else(|| Error::NotContiguous {
            shape: layout.dims().to_vec(),
            stride: layout.stride().to_vec(),
        })
}

/// What a custom op found, kept for the caller (candle only passes its own error on).
type Outcome = RefCell<Option<Result<Option<Algorithm>>>>;

/// Keeps `outcome` and gives candle its result.
fn keep(slot: &Outcome, outcome: Result<Option<Algorithm>>) -> candle_core::Result<()> {
    let result = match &outcome {
        Ok(_) => Ok(()),
        Err(e) => Err(candle_core::Error::Msg(e.to_string())),
    };
    *slot.borrow_mut() = Some(outcome);
    result
}

/// The typed outcome of a custom op, or candle's error when it refused before calling it.
fn outcome(slot: Outcome, launched: candle_core::Result<()>) -> Result<Option<Algorithm>> {
    match slot.into_inner() {
        Some(outcome) => outcome,
        None => Err(launched.err().map_or_else(
            || Error::Candle(candle_core::Error::Msg("custom op not run".into())),
            Error::Candle,
        )),
    }
}

/// A call in place on one tensor's storage, as a candle custom op (candle hands it the
/// storage under its write lock).
pub(crate) struct InPlace<'a> {
    pub(crate) comm: &'a Comm<Cuda>,
    pub(crate) call: Call<'a>,
    pub(crate) outcome: Outcome,
}

impl<'a> InPlace<'a> {
    pub(crate) fn new(comm: &'a Comm<Cuda>, call: Call<'a>) -> Self {
        InPlace {
            comm,
            call,
            outcome: RefCell::new(None),
        }
    }

    /// Runs on `tensor`; the algorithm for an all-reduce.
    pub(crate) fn apply(self, tensor: &candle_core::Tensor) -> Result<Option<Algorithm>> {
        let launched = tensor.inplace_op1(&self);
        outcome(self.outcome, launched)
    }
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        self.call.name()
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        let err = Error::NotCuda {
            location: "Cpu".into(),
        };
        keep(&self.outcome, Err(err))
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let outcome =
            contiguous_range(layout).and_then(|r| run_in_place(self.call, self.comm, storage, r));
        keep(&self.outcome, outcome)
    }
}

/// A call from one tensor into another's storage (the output's, under its write lock,
/// the input's under a read lock), as a candle custom op.
pub(crate) struct IntoOutput<'a> {
    comm: &'a Comm<Cuda>,
    call: Call<'a>,
    outcome: Outcome,
}

impl<'a> IntoOutput<'a> {
    pub(crate) fn new(comm: &'a Comm<Cuda>, call: Call<'a>) -> Self {
        IntoOutput {
            comm,
            call,
            outcome: RefCell::new(None),
        }
    }

    /// Runs from `input` into `output` (tensors of distinct storages: checked before).
    pub(crate) fn apply(
        self,
        input: &candle_core::Tensor,
        output: &candle_core::Tensor,
    ) -> Result<Option<Algorithm>> {
        let launched = output.inplace_op2(input, &self);
        outcome(self.outcome, launched)
    }
}

impl InplaceOp2 for IntoOutput<'_> {
    fn name(&self) -> &'static str {
        self.call.name()
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        let err = Error::NotCuda {
            location: "Cpu".into(),
        };
        keep(&self.outcome, Err(err))
    }

    fn cuda_fwd(
        &self,
        out: &mut CudaStorage,
        out_layout: &Layout,
        input: &CudaStorage,
        in_layout: &Layout,
    ) -> candle_core::Result<()> {
        let outcome = contiguous_range(in_layout).and_then(|ir| {
            let or = contiguous_range(out_layout)?;
            run_slices(self.call, self.comm, (input, ir), (out, or))
        });
        keep(&self.outcome, outcome)
    }
}
