//! The single-controller all-reduce, shaped ([`TensorView`] per rank): every rank's
//! tensors checked together, then routed and planned on the cores and launched on
//! each (or handed to the external library).

use crate::backend::Backend;
use crate::dispatch::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::tensor::{TensorView, TensorViewMut};

use super::super::AllReduceOptions;
use super::validate::{bytes_of, meta, meta_mut, Meta};
use super::SingleController;
use crate::comm::core::planning::check::Routed;
use crate::comm::core::planning::PeerReads;
use crate::comm::core::routing::Path;

impl<B: Backend> SingleController<B> {
    /// Sums `inputs[r]` over each group into `outputs[r]` (one tensor per rank, same
    /// dtype, shape and length everywhere). Returns the algorithm that ran. An input
    /// that is its rank's output, the very same range, runs in place (as
    /// [`SingleController::all_reduce_sum_in_place`]); buffers that overlap otherwise (a
    /// partial overlap, another rank's buffer, two outputs: only an `unsafe impl
    /// DeviceBuffer` can report them) are [`Error::BuffersOverlap`], nothing launched.
    pub fn all_reduce_sum(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check_usable()?;
        self.check_count(inputs.len())?;
        self.check_count(outputs.len())?;
        let metas: Vec<Meta> = inputs.iter().map(meta).collect();
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        self.check_tensors(&metas, &shapes, "input")?;
        for (r, (o, i)) in outputs.iter().zip(inputs).enumerate() {
            let om = meta_mut(o);
            self.check_tensor(r, &om, &o.shape, "output")?;
            self.ranks[r].check_all_reduce(&metas[r], &om)?;
            if o.shape != i.shape {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: i.shape.clone(),
                    got: o.shape.clone(),
                });
            }
        }
        let (dtype, len) = (metas[0].dtype, metas[0].len);
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(2 * ranks.len());
        let ins = self.read_ptrs(inputs, &mut guards);
        let outs = self.write_ptrs(outputs, &mut guards);
        let bytes = bytes_of(metas.iter().copied());
        let result = self.all_reduce_at(&ins, &outs, &bytes, dtype, len, options);
        drop(guards);
        result
    }

    /// Sums `tensors[r]` over each group in place. Returns the algorithm that ran.
    pub fn all_reduce_sum_in_place(
        &self,
        tensors: &mut [TensorViewMut<'_, B>],
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        self.check_usable()?;
        self.check_count(tensors.len())?;
        let metas: Vec<Meta> = tensors.iter().map(meta_mut).collect();
        let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape.clone()).collect();
        let shape_refs: Vec<&[usize]> = shapes.iter().map(|s| s.as_slice()).collect();
        self.check_tensors(&metas, &shape_refs, "in-place")?;
        let (dtype, len) = (metas[0].dtype, metas[0].len);
        let routed = self.route_all_reduce(dtype, len, options, true)?;
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(ranks.len());
        let ptrs = self.write_ptrs(tensors, &mut guards);
        let bytes = bytes_of(metas.iter().copied());
        let result = self.all_reduce_in_place_at(routed, &ptrs, &bytes, dtype, len);
        drop(guards);
        result
    }

    /// The all-reduce from `ins` into `outs` (`bytes` per rank): a rank whose input is
    /// its output, the very same range, runs in place (the plan stages); other
    /// overlaps are refused.
    pub(super) fn all_reduce_at(
        &self,
        ins: &[u64; MAX_GPUS],
        outs: &[u64; MAX_GPUS],
        bytes: &[usize; MAX_GPUS],
        dtype: DType,
        len: usize,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let roles = [(ins, bytes, "input", false), (outs, bytes, "output", true)];
        let in_place = self.check_overlaps(&roles, true)?;
        let routed = self.route_all_reduce(dtype, len, options, in_place)?;
        self.run_all_reduce(routed, ins, outs, len, dtype, "input")
    }

    /// The routed in-place all-reduce of `ptrs` (`bytes` per rank), overlaps refused.
    pub(super) fn all_reduce_in_place_at(
        &self,
        routed: Routed,
        ptrs: &[u64; MAX_GPUS],
        bytes: &[usize; MAX_GPUS],
        dtype: DType,
        len: usize,
    ) -> Result<Algorithm> {
        self.check_overlaps(&[(ptrs, bytes, "in-place", true)], false)?;
        self.run_all_reduce(routed, ptrs, ptrs, len, dtype, "in-place")
    }

    /// Routes and plans an all-reduce on the cores (every core decides the same: their
    /// settings and routing were agreed at setup, so rank 0's answer is every rank's).
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
                if plan.elements == 0 {
                    return Ok(plan.algorithm);
                }
                self.check_peers_reach(&plan, inputs, which)?;
                self.launch_all(&plan, inputs, outputs)?;
                Ok(plan.algorithm)
            }
            Routed::Away(Path::External) => {
                self.run_external(&inputs[..world], &outputs[..world], elements, dtype)
            }
            Routed::Away(_) => Err(Error::Unsupported(
                "a single controller runs on one host: nothing is hierarchical".into(),
            )),
        }
    }
}
