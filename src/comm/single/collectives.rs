//! The single-controller [`SingleController`]'s all-gather, reduce-scatter, broadcast,
//! scatter and fused all-reduce + residual + RMSNorm: one tensor per rank (per group
//! for a broadcast's or scatter's input), validated together before anything runs,
//! then one kernel per rank. In one process the peers read the user buffers directly
//! (their reach is checked).

use crate::backend::{Backend, KernelKind};
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::tensor::{TensorView, TensorViewMut};

use super::validate::{bytes_of, meta, meta_mut, Meta};
use super::SingleController;
use crate::comm::core::launch::PeerInputs;
use crate::comm::core::planning::collective::{reduce_scatter_part, Collective, CollectiveOptions};
use crate::comm::core::planning::{PeerReads, Plan};

impl<B: Backend> SingleController<B> {
    /// Gathers `inputs[r]` (one per rank, same dtype and shape everywhere) over each
    /// group: member q's `n` elements land at `[q * n, (q + 1) * n)` of every member's
    /// output, which holds `group width * n` elements (any shape of that many).
    pub fn all_gather(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        options: &CollectiveOptions,
    ) -> Result<()> {
        let metas = self.check_inputs(inputs)?;
        let width = self.ranks[0].collective_width(options)?.0;
        let n = metas[0].len;
        self.check_outputs(outputs, &metas, |_| n.checked_mul(width))?;
        let plan = self.ranks[0].plan_collective(
            Collective::AllGather,
            metas[0].dtype,
            n,
            options,
            PeerReads::UserBuffers,
        )?;
        self.launch_collective(&plan, inputs, outputs)
    }

    /// Sums `inputs[r]` over each group; rank r receives part `r % width` of the sum
    /// ([`crate::reduce_scatter_part`]), bit for bit what the all-reduce gives there.
    pub fn reduce_scatter_sum(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        options: &CollectiveOptions,
    ) -> Result<()> {
        let metas = self.check_inputs(inputs)?;
        let width = self.ranks[0].collective_width(options)?.0;
        let n = metas[0].len;
        self.check_outputs(outputs, &metas, |r| {
            Some(reduce_scatter_part(n, width, r % width).len())
        })?;
        let plan = self.ranks[0].plan_collective(
            Collective::ReduceScatter,
            metas[0].dtype,
            n,
            options,
            PeerReads::UserBuffers,
        )?;
        self.launch_collective(&plan, inputs, outputs)
    }

    /// Copies each group's root input into every member's output: `inputs[k]` is the
    /// input of group k's root (group rank `root`, world rank `k * width + root`),
    /// `outputs[r]` rank r's output of the same length.
    pub fn broadcast(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let (width, roots) = self.check_root_inputs(inputs, root, options)?;
        let n = roots[0].len;
        self.check_outputs(outputs, &roots, |_| Some(n))?;
        let plan = self.ranks[0].plan_collective(
            Collective::Broadcast { root },
            roots[0].dtype,
            n,
            options,
            PeerReads::UserBuffers,
        )?;
        self.launch_root_collective(&plan, inputs, outputs, width, root)
    }

    /// Broadcast in place: each group root's tensor is the message, every other
    /// member's tensor (same dtype and shape) is overwritten with it.
    pub fn broadcast_in_place(
        &self,
        tensors: &mut [TensorViewMut<'_, B>],
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        self.check_usable()?;
        self.check_count(tensors.len())?;
        let metas: Vec<Meta> = tensors.iter().map(meta_mut).collect();
        let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape.clone()).collect();
        let shape_refs: Vec<&[usize]> = shapes.iter().map(Vec::as_slice).collect();
        self.check_tensors(&metas, &shape_refs, "in-place")?;
        let plan = self.ranks[0].plan_collective(
            Collective::Broadcast { root },
            metas[0].dtype,
            metas[0].len,
            options,
            PeerReads::UserBuffers,
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        let mut guards = Vec::with_capacity(tensors.len());
        let ptrs = self.write_ptrs(tensors, &mut guards);
        let bytes = bytes_of(metas.iter().copied());
        self.check_overlaps(&[(&ptrs, &bytes, "in-place", true)], false)?;
        let mut read = [0u64; MAX_GPUS];
        for r in (root..self.world_size()).step_by(plan.width) {
            read[r] = ptrs[r];
        }
        let result = self
            .check_peers_reach(&plan, &read, "in-place")
            .and_then(|_| self.launch_all(&plan, &ptrs, &ptrs));
        drop(guards);
        result
    }

    /// Scatters each group root's input: `inputs[k]` (group k's root, `width * n`
    /// elements) gives member q of group k elements `[q * n, (q + 1) * n)`, where
    /// `n` is every output's length.
    pub fn scatter(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let (width, roots) = self.check_root_inputs(inputs, root, options)?;
        if roots[0].len % width != 0 {
            return Err(Error::LengthMismatch {
                rank: root,
                what: format!(
                    "the root's input has {} elements, not a multiple of the group width {width}",
                    roots[0].len
                ),
            });
        }
        let n = roots[0].len / width;
        self.check_outputs(outputs, &roots, |_| Some(n))?;
        let plan = self.ranks[0].plan_collective(
            Collective::Scatter { root },
            roots[0].dtype,
            n,
            options,
            PeerReads::UserBuffers,
        )?;
        self.launch_root_collective(&plan, inputs, outputs, width, root)
    }

    /// The fused all-reduce + residual add + RMSNorm on every rank (see
    /// [`crate::Comm::all_reduce_residual_rms_norm`]): `inputs[r]` rank r's partial
    /// activations, `residuals[r]` its residual (updated in place), `weights[r]` its
    /// RMSNorm weight (the hidden size is its length), `outputs[r]` the normalised
    /// activations. All of one dtype; inputs, residuals and outputs of one shape.
    /// `options.algorithm` chooses between the one-stage and the Lamport kernel, which
    /// give the same bits ([`CollectiveOptions::algorithm`]).
    pub fn all_reduce_residual_rms_norm(
        &self,
        inputs: &[TensorView<'_, B>],
        residuals: &mut [TensorViewMut<'_, B>],
        weights: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        epsilon: f32,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let metas = self.check_inputs(inputs)?;
        self.check_count(weights.len())?;
        let wmetas: Vec<Meta> = weights.iter().map(meta).collect();
        let wshapes: Vec<&[usize]> = weights.iter().map(|t| t.shape.as_slice()).collect();
        self.check_tensors(&wmetas, &wshapes, "weight")?;
        if wmetas[0].dtype != metas[0].dtype {
            return Err(Error::DTypeMismatch {
                rank: 0,
                expected: metas[0].dtype,
                got: wmetas[0].dtype,
            });
        }
        let n = metas[0].len;
        self.check_outputs(residuals, &metas, |_| Some(n))?;
        self.check_outputs(outputs, &metas, |_| Some(n))?;
        let plan = self.ranks[0].plan_collective(
            Collective::AllReduceRmsNorm {
                hidden: wmetas[0].len,
                epsilon,
            },
            metas[0].dtype,
            n,
            options,
            PeerReads::UserBuffers,
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(4 * ranks.len());
        let ins = self.read_ptrs(inputs, &mut guards);
        let ws = self.read_ptrs(weights, &mut guards);
        let res = self.write_ptrs(residuals, &mut guards);
        let outs = self.write_ptrs(outputs, &mut guards);
        // No in-place form: the residual is read and written, the inputs read by
        // every peer.
        let bytes = bytes_of(metas.iter().copied());
        let weight_bytes = bytes_of(wmetas.iter().copied());
        self.check_overlaps(
            &[
                (&ins, &bytes, "input", false),
                (&ws, &weight_bytes, "weight", false),
                (&res, &bytes, "residual", true),
                (&outs, &bytes, "output", true),
            ],
            false,
        )?;
        let all: Vec<usize> = (0..self.world_size()).collect();
        let result = self.check_peers_reach(&plan, &ins, "input").and_then(|_| {
            self.launch_on(
                &plan,
                &all,
                PeerInputs::InPlace(&ins),
                &outs,
                Some((&res, &ws)),
            )
        });
        drop(guards);
        result
    }

    /// Usable, one input per rank, one dtype and shape everywhere, on its device.
    fn check_inputs(&self, inputs: &[TensorView<'_, B>]) -> Result<Vec<Meta>> {
        self.check_usable()?;
        self.check_count(inputs.len())?;
        let metas: Vec<Meta> = inputs.iter().map(meta).collect();
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        self.check_tensors(&metas, &shapes, "input")?;
        Ok(metas)
    }

    /// One output per rank, of its rank's device, the inputs' dtype and `len(r)`
    /// elements, its shape describing its buffer.
    fn check_outputs(
        &self,
        outputs: &[TensorViewMut<'_, B>],
        inputs: &[Meta],
        len: impl Fn(usize) -> Option<usize>,
    ) -> Result<()> {
        self.check_count(outputs.len())?;
        for (r, o) in outputs.iter().enumerate() {
            let om = meta_mut(o);
            self.check_tensor(r, &om, &o.shape, "output")?;
            if om.dtype != inputs[0].dtype {
                return Err(Error::DTypeMismatch {
                    rank: r,
                    expected: inputs[0].dtype,
                    got: om.dtype,
                });
            }
            let expected = len(r);
            if expected != Some(om.len) {
                return Err(Error::LengthMismatch {
                    rank: r,
                    what: match expected {
                        Some(e) => format!("output has {} elements but must have {e}", om.len),
                        None => "the output length overflows usize".into(),
                    },
                });
            }
        }
        Ok(())
    }

    /// The roots' inputs of a broadcast or scatter: a valid root, one input per group,
    /// one dtype and shape, each on its root's device. Returns the width and their
    /// metadata.
    fn check_root_inputs(
        &self,
        inputs: &[TensorView<'_, B>],
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<(usize, Vec<Meta>)> {
        self.check_usable()?;
        let width = self.ranks[0].collective_width(options)?.0;
        if root >= width {
            return Err(Error::InvalidRoot { root, width });
        }
        let groups = self.world_size() / width;
        if inputs.len() != groups {
            return Err(Error::WrongTensorCount {
                expected: groups,
                got: inputs.len(),
            });
        }
        let metas: Vec<Meta> = inputs.iter().map(meta).collect();
        for (k, (m, t)) in metas.iter().zip(inputs).enumerate() {
            let r = k * width + root;
            if m.dtype != metas[0].dtype {
                return Err(Error::DTypeMismatch {
                    rank: r,
                    expected: metas[0].dtype,
                    got: m.dtype,
                });
            }
            self.check_tensor(r, m, &t.shape, "input")?;
            if m.len != metas[0].len {
                return Err(Error::LengthMismatch {
                    rank: r,
                    what: format!(
                        "the root's input has {} elements but group 0's root's {}",
                        m.len, metas[0].len
                    ),
                });
            }
            if t.shape != inputs[0].shape {
                return Err(Error::ShapeMismatch {
                    rank: r,
                    expected: inputs[0].shape.clone(),
                    got: t.shape.clone(),
                });
            }
        }
        Ok((width, metas))
    }

    /// Launches a collective whose every rank has an input (the all-reduce too): each
    /// buffer is tracked on its own rank's stream only, since peers read rank j's input
    /// between their start and end barriers, which rank j's kernel spans, so the waits
    /// and records on rank j's stream also cover the peers' reads.
    pub(super) fn launch_collective(
        &self,
        plan: &Plan,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
    ) -> Result<()> {
        if plan.elements == 0 {
            return Ok(());
        }
        let out_bytes = bytes_of(outputs.iter().map(meta_mut));
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(2 * ranks.len());
        let in_ptrs = self.read_ptrs(inputs, &mut guards);
        let out_ptrs = self.write_ptrs(outputs, &mut guards);
        // No in-place form: any overlap is refused.
        let in_bytes = bytes_of(inputs.iter().map(meta));
        let result = self.launch_checked(plan, (&in_ptrs, &in_bytes), (&out_ptrs, &out_bytes));
        drop(guards);
        result
    }

    /// Launches a broadcast or scatter: group k's input is at world rank
    /// `k * width + root`; the other ranks have none.
    fn launch_root_collective(
        &self,
        plan: &Plan,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        width: usize,
        root: usize,
    ) -> Result<()> {
        if plan.elements == 0 {
            return Ok(());
        }
        let out_bytes = bytes_of(outputs.iter().map(meta_mut));
        let ranks = &self.ranks;
        let mut guards = Vec::with_capacity(inputs.len() + ranks.len());
        let mut in_ptrs = [0u64; MAX_GPUS];
        for (k, t) in inputs.iter().enumerate() {
            let r = k * width + root;
            let (p, g) = t.data.read_ptr(ranks[r].device());
            in_ptrs[r] = p;
            guards.push(g);
        }
        let out_ptrs = self.write_ptrs(outputs, &mut guards);
        // A broadcast root's input that is its output runs in place; a scatter has no
        // in-place form.
        let mut in_bytes = [0; MAX_GPUS];
        for (k, t) in inputs.iter().enumerate() {
            in_bytes[k * width + root] = t.data.len() * t.data.dtype().size();
        }
        let result = self.launch_checked(plan, (&in_ptrs, &in_bytes), (&out_ptrs, &out_bytes));
        drop(guards);
        result
    }

    /// Refuses overlapping buffers (a broadcast root's exact alias runs in place),
    /// checks that the peers reach the inputs, and launches on every rank.
    fn launch_checked(
        &self,
        plan: &Plan,
        (ins, in_bytes): (&[u64; MAX_GPUS], &[usize; MAX_GPUS]),
        (outs, out_bytes): (&[u64; MAX_GPUS], &[usize; MAX_GPUS]),
    ) -> Result<()> {
        let roles = [
            (ins, in_bytes, "input", false),
            (outs, out_bytes, "output", true),
        ];
        self.check_overlaps(&roles, plan.kernel.kind == KernelKind::Broadcast)?;
        self.check_peers_reach(plan, ins, "input")?;
        self.launch_all(plan, ins, outs)
    }
}
