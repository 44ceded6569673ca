//! The single controller's all-gather, reduce-scatter, broadcast, scatter and fused
//! all-reduce + residual + RMSNorm: one tensor per rank (per group for a broadcast's or
//! scatter's input), checked together before anything runs, then one kernel per rank;
//! the peers read the user buffers in place (their reach is checked).

use crate::backend::{Backend, KernelKind};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;
use crate::tensor::{TensorView, TensorViewMut};

use super::launch::ALL_RANKS;
use super::validate::{meta, Meta};
use super::SingleController;
use crate::comm::core::launch::PeerInputs;
use crate::comm::core::planning::collective::{reduce_scatter_part, Collective, CollectiveOptions};
use crate::comm::core::planning::PeerReads;

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
        let first = self.check_inputs(inputs, "input")?;
        let width = self.ranks[0].collective_width(options)?.0;
        let n = first.len;
        self.check_outputs(
            outputs,
            first,
            |_| n.checked_mul(width),
            "group width x input",
        )?;
        let call = (Collective::AllGather, first.dtype, n);
        self.run_collective(call, options, inputs, outputs, |k| k)
    }

    /// Reduces `inputs[r]` with `op` over each group; rank r receives part `r % width`
    /// of the result ([`crate::reduce_scatter_part`]), bit for bit what the all-reduce
    /// gives there.
    pub fn reduce_scatter(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        op: &ReduceOp,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let options = &options.with_op(*op);
        let first = self.check_inputs(inputs, "input")?;
        let width = self.ranks[0].collective_width(options)?.0;
        let n = first.len;
        let part = |r: usize| Some(reduce_scatter_part(n, width, r % width).len());
        self.check_outputs(outputs, first, part, "this rank's part of the input")?;
        let call = (Collective::ReduceScatter, first.dtype, n);
        self.run_collective(call, options, inputs, outputs, |k| k)
    }

    /// The sum: `reduce_scatter(inputs, outputs, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `reduce_scatter(inputs, outputs, &ReduceOp::Sum, options)`")]
    pub fn reduce_scatter_sum(
        &self,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        options: &CollectiveOptions,
    ) -> Result<()> {
        self.reduce_scatter(inputs, outputs, &ReduceOp::Sum, options)
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
        let (width, first) = self.check_root_inputs(inputs, root, options)?;
        self.check_outputs(outputs, first, |_| Some(first.len), "the root's input")?;
        let call = (Collective::Broadcast { root }, first.dtype, first.len);
        self.run_collective(call, options, inputs, outputs, |k| k * width + root)
    }

    /// Broadcast in place: each group root's tensor is the message, every other
    /// member's tensor (same dtype and shape) is overwritten with it.
    pub fn broadcast_in_place(
        &self,
        tensors: &mut [TensorViewMut<'_, B>],
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let first = self.check_in_place(tensors)?;
        let plan = self.ranks[0].plan_collective(
            Collective::Broadcast { root },
            first.dtype,
            first.len,
            options,
            PeerReads::UserBuffers,
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        let ptrs = self.writes(tensors.iter_mut().map(|t| &mut *t.data).enumerate());
        self.check_overlaps(&[(&ptrs, "in-place", true)], false)?;
        let mut read = [0u64; MAX_GPUS];
        for r in (root..self.world_size()).step_by(plan.width) {
            read[r] = ptrs.at[r];
        }
        self.check_peers_reach(&plan, &read, "in-place")?;
        self.launch_all(&plan, &ptrs.at, &ptrs.at)
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
        let (width, first) = self.check_root_inputs(inputs, root, options)?;
        if first.len % width != 0 {
            return Err(Error::LengthMismatch {
                rank: root,
                what: format!(
                    "the root's input has {} elements, not a multiple of the group width {width}",
                    first.len
                ),
            });
        }
        let n = first.len / width;
        self.check_outputs(
            outputs,
            first,
            |_| Some(n),
            "the root's input / group width",
        )?;
        let call = (Collective::Scatter { root }, first.dtype, n);
        self.run_collective(call, options, inputs, outputs, |k| k * width + root)
    }

    /// [`crate::Comm::all_reduce_residual_rms_norm`] on every rank: `inputs[r]` rank r's
    /// partial activations, `residuals[r]` its residual (updated in place), `weights[r]`
    /// its RMSNorm weight, `outputs[r]` the normalised activations. All of one dtype;
    /// inputs, residuals and outputs of one shape.
    pub fn all_reduce_residual_rms_norm(
        &self,
        inputs: &[TensorView<'_, B>],
        residuals: &mut [TensorViewMut<'_, B>],
        weights: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        epsilon: f32,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let first = self.check_inputs(inputs, "input")?;
        let weight = self.check_inputs(weights, "weight")?;
        self.ranks[0].check_dtype(first.dtype, weight.dtype)?;
        let n = first.len;
        self.check_outputs(residuals, first, |_| Some(n), "input")?;
        self.check_outputs(outputs, first, |_| Some(n), "input")?;
        let hidden = weight.len;
        let plan = self.ranks[0].plan_collective(
            Collective::AllReduceRmsNorm { hidden, epsilon },
            first.dtype,
            n,
            options,
            PeerReads::UserBuffers,
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        let ins = self.reads(inputs.iter().map(|t| t.data).enumerate());
        let ws = self.reads(weights.iter().map(|t| t.data).enumerate());
        let res = self.writes(residuals.iter_mut().map(|t| &mut *t.data).enumerate());
        let outs = self.writes(outputs.iter_mut().map(|t| &mut *t.data).enumerate());
        // No in-place form: the residual is read and written, the inputs read by
        // every peer.
        let roles = [
            (&ins, "input", false),
            (&ws, "weight", false),
            (&res, "residual", true),
            (&outs, "output", true),
        ];
        self.check_overlaps(&roles, false)?;
        self.check_peers_reach(&plan, &ins.at, "input")?;
        let (all, fused) = (&ALL_RANKS[..self.world_size()], Some((&res.at, &ws.at)));
        self.launch_on(&plan, all, PeerInputs::InPlace(&ins.at), &outs.at, fused)
    }

    /// One output per rank, of its rank's device, the inputs' dtype and `len(r)`
    /// elements (`rule` says why), its shape describing its buffer.
    fn check_outputs(
        &self,
        outputs: &[TensorViewMut<'_, B>],
        first: Meta,
        len: impl Fn(usize) -> Option<usize>,
        rule: &str,
    ) -> Result<()> {
        self.check_count(outputs.len())?;
        for (r, o) in outputs.iter().enumerate() {
            let om = meta(&*o.data);
            self.check_tensor(r, &om, &o.shape, "output")?;
            self.ranks[r].check_dtype(first.dtype, om.dtype)?;
            self.ranks[r].check_len(om.len, len(r), "output", rule)?;
        }
        Ok(())
    }

    /// The roots' inputs of a broadcast or scatter: a valid root, one input per group,
    /// alike, each on its root's device. Returns the width and group 0's root's input.
    fn check_root_inputs(
        &self,
        inputs: &[TensorView<'_, B>],
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<(usize, Meta)> {
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
        let roots = inputs.iter().enumerate();
        let roots = roots.map(|(k, t)| (k * width + root, meta(t.data), Some(&t.shape[..])));
        Ok((width, self.check_alike(roots, "input", "group 0's root's")?))
    }

    /// Plans `call` on the cores and launches it from every rank's input (group k's at
    /// world rank `input_rank(k)`) into its output. Overlaps are refused, but for a
    /// broadcast root's input that is its output (it runs in place).
    fn run_collective(
        &self,
        (which, dtype, n): (Collective, DType, usize),
        options: &CollectiveOptions,
        inputs: &[TensorView<'_, B>],
        outputs: &mut [TensorViewMut<'_, B>],
        input_rank: impl Fn(usize) -> usize,
    ) -> Result<()> {
        let reads = PeerReads::UserBuffers;
        let plan = self.ranks[0].plan_collective(which, dtype, n, options, reads)?;
        if plan.elements == 0 {
            return Ok(());
        }
        let ins = self.reads(
            inputs
                .iter()
                .enumerate()
                .map(|(k, t)| (input_rank(k), t.data)),
        );
        let outs = self.writes(outputs.iter_mut().map(|t| &mut *t.data).enumerate());
        let roles = [(&ins, "input", false), (&outs, "output", true)];
        self.check_overlaps(&roles, plan.kernel.kind == KernelKind::Broadcast)?;
        self.check_peers_reach(&plan, &ins.at, "input")?;
        self.launch_all(&plan, &ins.at, &outs.at)
    }
}
