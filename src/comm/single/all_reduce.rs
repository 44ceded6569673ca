//! The single-controller all-reduce, shaped ([`TensorView`] per rank) or on the users'
//! flat buffers (`&[CudaSlice<T>]`, no heap allocation per call): every rank's buffers
//! checked together, then routed and planned on the cores and launched on each (or
//! handed to the external library).

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dispatch::Algorithm;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::tensor::{TensorView, TensorViewMut};

use super::super::AllReduceOptions;
use super::validate::{meta, Meta, Ptrs};
use super::SingleController;
use crate::comm::core::planning::check::Routed;
use crate::comm::core::planning::PeerReads;
use crate::comm::core::routing::Path;

impl<B: Backend> SingleController<B> {
    /// Reduces `inputs[r]` with `op` over each group into `outputs[r]` (one tensor per
    /// rank, same dtype, shape and length everywhere). Returns the algorithm that ran.
    /// An input that is its rank's output, the very same range, runs in place; buffers
    /// that overlap otherwise (only an `unsafe impl DeviceBuffer` can report them) are
    /// [`Error::BuffersOverlap`], nothing launched.
    pub fn all_reduce(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let first = self.check_inputs(inputs, "input")?;
        self.check_count(outputs.len())?;
        for (r, (o, i)) in outputs.iter().zip(inputs).enumerate() {
            self.ranks[r].check_all_reduce(&meta(i.data), &meta(&*o.data))?;
            Self::check_shape(r, o.data.len(), &o.shape, "output")?;
            if o.shape != i.shape {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: i.shape.clone(),
                    got: o.shape.clone(),
                });
            }
        }
        let ins = self.reads(inputs.iter().map(|t| t.data).enumerate());
        let outs = self.writes(outputs.iter_mut().map(|t| &mut *t.data).enumerate());
        self.all_reduce_at(&ins, &outs, first, &options.with_op(*op))
    }

    /// Reduces `tensors[r]` with `op` over each group in place. Returns the algorithm
    /// that ran.
    pub fn all_reduce_in_place(
        &self,
        tensors: &mut [TensorViewMut<'_, B>],
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let first = self.check_in_place(tensors)?;
        let options = options.with_op(*op);
        let routed = self.route_all_reduce(first.dtype, first.len, &options, true)?;
        let ptrs = self.writes(tensors.iter_mut().map(|t| &mut *t.data).enumerate());
        self.all_reduce_in_place_at(routed, &ptrs, first)
    }

    /// The flat form of [`SingleController::all_reduce`]: one buffer per rank, on that
    /// rank's device, all of one dtype and length; the same checks and launches.
    ///
    /// ```
    /// use peercomm::backend::{host::Host, Backend, TypedBuffer};
    /// use peercomm::{AllReduceOptions, CommConfig, ReduceOp, SingleController};
    ///
    /// let comm = SingleController::<Host>::new(&[0, 1], CommConfig::default())?;
    /// let mut ins = Vec::new();
    /// let mut outs = Vec::new();
    /// for (r, rank) in comm.cores().iter().enumerate() {
    ///     ins.push(Host::alloc_from(rank.device(), &[r as f32 + 1.0; 5])?);
    ///     outs.push(Host::alloc_from(rank.device(), &[f32::NAN; 5])?);
    /// }
    /// let opts = AllReduceOptions::new();
    /// for _ in 0..3 {
    ///     comm.all_reduce_slices(&ins, &mut outs, &ReduceOp::Sum, &opts)?; // no per-call Vec
    /// }
    /// comm.all_reduce_slices_in_place(&mut ins, &ReduceOp::Sum, &opts)?;
    /// comm.synchronize()?;
    /// assert_eq!(outs[1].to_host(comm.core(1).device())?, vec![3.0; 5]);
    /// assert_eq!(ins[0].to_host(comm.core(0).device())?, vec![3.0; 5]);
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn all_reduce_slices<S, R>(
        &self,
        inputs: &[S],
        outputs: &mut [R],
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let first = self.check_slices(inputs, outputs)?;
        let ins = self.reads(inputs.iter().enumerate());
        let outs = self.writes(outputs.iter_mut().enumerate());
        self.all_reduce_at(&ins, &outs, first, &options.with_op(*op))
    }

    /// The flat form of [`SingleController::all_reduce_in_place`].
    pub fn all_reduce_slices_in_place<R>(
        &self,
        buffers: &mut [R],
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B>,
    {
        let first = self.check_flat(buffers, "in-place")?;
        let options = options.with_op(*op);
        let routed = self.route_all_reduce(first.dtype, first.len, &options, true)?;
        let ptrs = self.writes(buffers.iter_mut().enumerate());
        self.all_reduce_in_place_at(routed, &ptrs, first)
    }

    /// The sum: `all_reduce(inputs, outputs, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce(inputs, outputs, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.all_reduce(inputs, outputs, &ReduceOp::Sum, options)
    }

    /// The sum in place: `all_reduce_in_place(tensors, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_in_place(tensors, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_in_place(
        &self,
        tensors: &mut [TensorViewMut<'_, B>],
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.all_reduce_in_place(tensors, &ReduceOp::Sum, options)
    }

    /// The sum: `all_reduce_slices(inputs, outputs, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_slices(inputs, outputs, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_slices<S, R>(
        &self,
        inputs: &[S],
        outputs: &mut [R],
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_slices(inputs, outputs, &ReduceOp::Sum, options)
    }

    /// The sum in place: `all_reduce_slices_in_place(buffers, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_slices_in_place(buffers, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_slices_in_place<R>(
        &self,
        buffers: &mut [R],
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_slices_in_place(buffers, &ReduceOp::Sum, options)
    }

    /// The all-reduce from `ins` into `outs` (`first`: rank 0's input): a rank whose
    /// input is its output, the very same range, runs in place; other overlaps are
    /// refused.
    fn all_reduce_at<'a>(
        &self,
        ins: &Ptrs<'a, B>,
        outs: &Ptrs<'a, B>,
        first: Meta,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let roles = [(ins, "input", false), (outs, "output", true)];
        let in_place = self.check_overlaps(&roles, true)?;
        let routed = self.route_all_reduce(first.dtype, first.len, options, in_place)?;
        self.run_all_reduce(routed, &ins.at, &outs.at, first.len, first.dtype, "input")
    }

    /// The routed in-place all-reduce of `ptrs`, overlaps refused.
    fn all_reduce_in_place_at(
        &self,
        routed: Routed,
        ptrs: &Ptrs<'_, B>,
        first: Meta,
    ) -> Result<Algorithm> {
        self.check_overlaps(&[(ptrs, "in-place", true)], false)?;
        let (at, len, dtype) = (&ptrs.at, first.len, first.dtype);
        self.run_all_reduce(routed, at, at, len, dtype, "in-place")
    }

    /// Routes and plans an all-reduce on rank 0's core: the settings and routing were
    /// agreed at setup, so its answer is every rank's.
    pub(super) fn route_all_reduce(
        &self,
        dtype: DType,
        elements: usize,
        options: &AllReduceOptions,
        in_place: bool,
    ) -> Result<Routed> {
        self.ranks[0].plan_all_reduce(dtype, elements, options, in_place, PeerReads::UserBuffers)
    }

    /// Runs a routed all-reduce from every rank's `inputs` into its `outputs`.
    pub(super) fn run_all_reduce(
        &self,
        routed: Routed,
        inputs: &[u64; MAX_GPUS],
        outputs: &[u64; MAX_GPUS],
        elements: usize,
        dtype: DType,
        which: &'static str,
    ) -> Result<Algorithm> {
        let world = self.world_size();
        match routed {
            Routed::Peer(plan) => {
                if plan.elements > 0 {
                    self.check_peers_reach(&plan, inputs, which)?;
                    self.launch_all(&plan, inputs, outputs)?;
                }
                Ok(plan.algorithm)
            }
            Routed::Away(Path::External, op) => {
                let call = (elements, dtype, op);
                self.run_external(&inputs[..world], &outputs[..world], call)
            }
            Routed::Away(..) => Err(Error::Unsupported(
                "a single controller runs on one host: nothing is hierarchical".into(),
            )),
        }
    }
}
