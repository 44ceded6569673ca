//! The per-rank [`Comm`]'s all-gather, reduce-scatter, broadcast, scatter and fused
//! all-reduce + residual + RMSNorm. Like the all-reduce, each call checks this rank's
//! buffers, plans, and launches only this rank's kernel; what the peers read is staged
//! into this rank's payload, so user buffers need no registration and every call is
//! capturable. Every rank of a group must make the same call (same dtype, lengths,
//! root, options) in the same order: lengths cannot be compared across processes
//! without a round trip, and a rank whose peers never come gets
//! [`Error::BarrierTimeout`] from [`Comm::synchronize`].

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;

use super::super::collective::{reduce_scatter_part, Collective, CollectiveOptions};
use super::super::plan::Plan;
use super::Comm;

impl<B: Backend> Comm<B> {
    /// Gathers every group member's `send` into `recv` on every member: member q's
    /// elements land at `[q * n, (q + 1) * n)`, where `n = send.len()`; `recv` holds
    /// `group width * n` elements.
    pub fn all_gather<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        // Groups peer memory serves, in the local core's numbering (see route.rs).
        let options = &self.route.local_collective(options)?;
        self.check_pair(send, recv)?;
        let width = self.settings.group_width(options.group_size)?;
        self.check_len(
            recv.len(),
            send.len().checked_mul(width),
            "output",
            "group width x input",
        )?;
        let plan = self.settings.collective_plan(
            Collective::AllGather,
            send.dtype(),
            send.len(),
            options,
        )?;
        self.enqueue_collective(&plan, Some(send), recv)
    }

    /// Sums `send` over the group; this rank receives part `group rank` of the sum
    /// ([`crate::reduce_scatter_part`]: the first `n % width` parts have one element
    /// more), bit for bit what the all-reduce gives for those elements.
    pub fn reduce_scatter_sum<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        // Groups peer memory serves, in the local core's numbering (see route.rs).
        let options = &self.route.local_collective(options)?;
        self.check_pair(send, recv)?;
        let width = self.settings.group_width(options.group_size)?;
        let part = reduce_scatter_part(send.len(), width, self.rank() % width).len();
        self.check_len(
            recv.len(),
            Some(part),
            "output",
            "this rank's part of the input",
        )?;
        let plan = self.settings.collective_plan(
            Collective::ReduceScatter,
            send.dtype(),
            send.len(),
            options,
        )?;
        self.enqueue_collective(&plan, Some(send), recv)
    }

    /// Copies the input of the group's `root` (a group rank) into every member's
    /// `recv`. The root passes `Some(send)` of `recv.len()` elements; the others may
    /// pass `None` (what they pass is not read).
    pub fn broadcast<S, R>(
        &self,
        send: Option<&S>,
        recv: &mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        // Groups peer memory serves, in the local core's numbering (see route.rs).
        let options = &self.route.local_collective(options)?;
        let send = self.root_input(send, root, options)?;
        self.check_usable()?;
        self.check_buffer(recv.device_ordinal(), "output")?;
        if let Some(s) = send {
            self.check_pair(s, recv)?;
            self.check_len(recv.len(), Some(s.len()), "output", "the root's input")?;
        }
        let plan = self.settings.collective_plan(
            Collective::Broadcast { root },
            recv.dtype(),
            recv.len(),
            options,
        )?;
        self.enqueue_collective(&plan, send, recv)
    }

    /// Broadcast in place: the root's `buf` is the message, every other member's `buf`
    /// is overwritten with it.
    pub fn broadcast_in_place<R>(
        &self,
        buf: &mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        // Groups peer memory serves, in the local core's numbering (see route.rs).
        let options = &self.route.local_collective(options)?;
        self.check_usable()?;
        self.check_buffer(buf.device_ordinal(), "in-place")?;
        let plan = self.settings.collective_plan(
            Collective::Broadcast { root },
            buf.dtype(),
            buf.len(),
            options,
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        let (ptr, guard) = buf.write_ptr(&self.rank.device);
        let mut inputs = [0u64; MAX_GPUS];
        inputs[self.rank.index] = ptr;
        let result =
            self.launch_collective(|| self.rank.launch(&self.settings, &plan, &inputs, ptr));
        drop(guard);
        result
    }

    /// Scatters the root's `send` (`group width * recv.len()` elements): member q
    /// receives elements `[q * n, (q + 1) * n)`, `n = recv.len()`. The root passes
    /// `Some(send)`; the others may pass `None`.
    pub fn scatter<S, R>(
        &self,
        send: Option<&S>,
        recv: &mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        // Groups peer memory serves, in the local core's numbering (see route.rs).
        let options = &self.route.local_collective(options)?;
        let send = self.root_input(send, root, options)?;
        self.check_usable()?;
        self.check_buffer(recv.device_ordinal(), "output")?;
        if let Some(s) = send {
            let width = self.settings.group_width(options.group_size)?;
            self.check_pair(s, recv)?;
            self.check_len(
                s.len(),
                recv.len().checked_mul(width),
                "root's input",
                "group width x output",
            )?;
        }
        let plan = self.settings.collective_plan(
            Collective::Scatter { root },
            recv.dtype(),
            recv.len(),
            options,
        )?;
        self.enqueue_collective(&plan, send, recv)
    }

    /// The end of a tensor-parallel decoder layer in one kernel: sums `input` (this
    /// rank's partial activations, rows of `weight.len()` elements) over the group,
    /// adds `residual` and writes the new residual back into it, then RMS-normalises
    /// each row of it with `weight` and `epsilon` into `output`. Each element goes
    /// through the unfused sequence's roundings to the dtype (the sum, then the
    /// residual), with f32 arithmetic; every member gets the same bits. The hidden size
    /// must be a multiple of the pack width (8 for f16/bf16, 4 for f32).
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_residual_rms_norm<S, R, W, O>(
        &self,
        input: &S,
        residual: &mut R,
        weight: &W,
        output: &mut O,
        epsilon: f32,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
        W: DeviceBuffer<B> + ?Sized,
        O: DeviceBufferMut<B> + ?Sized,
    {
        // Groups peer memory serves, in the local core's numbering (see route.rs).
        let options = &self.route.local_collective(options)?;
        self.check_pair(input, output)?;
        self.check_buffer(residual.device_ordinal(), "residual")?;
        self.check_buffer(weight.device_ordinal(), "weight")?;
        for dtype in [residual.dtype(), weight.dtype()] {
            self.check_dtype(input.dtype(), dtype)?;
        }
        self.check_len(output.len(), Some(input.len()), "output", "input")?;
        self.check_len(residual.len(), Some(input.len()), "residual", "input")?;
        let plan = self.settings.collective_plan(
            Collective::AllReduceRmsNorm {
                hidden: weight.len(),
                epsilon,
            },
            input.dtype(),
            input.len(),
            options,
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        let dev = &self.rank.device;
        let (i, ig) = input.read_ptr(dev);
        let (w, wg) = weight.read_ptr(dev);
        let (r, rg) = residual.write_ptr(dev);
        let (o, og) = output.write_ptr(dev);
        let mut inputs = [0u64; MAX_GPUS];
        inputs[self.rank.index] = i;
        let result = self.launch_collective(|| {
            self.rank
                .launch_fused(&self.settings, &plan, &inputs, o, r, w)
        });
        drop((ig, wg, rg, og));
        result
    }

    /// The root's input for a broadcast or scatter: required on the root (checked
    /// before anything else), ignored elsewhere.
    fn root_input<'s, S: ?Sized>(
        &self,
        send: Option<&'s S>,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<Option<&'s S>> {
        let width = self.settings.group_width(options.group_size)?;
        if root >= width {
            return Err(Error::InvalidRoot { root, width });
        }
        let is_root = self.rank() % width == root;
        match send {
            None if is_root => Err(Error::Unsupported(format!(
                "rank {} is the root: it passes its input",
                self.rank()
            ))),
            _ if !is_root => Ok(None),
            s => Ok(s),
        }
    }

    fn check_dtype(&self, expected: DType, got: DType) -> Result<()> {
        if expected != got {
            return Err(Error::DTypeMismatch {
                rank: self.rank(),
                expected,
                got,
            });
        }
        Ok(())
    }

    /// Usable, both buffers on this rank's device, one dtype.
    fn check_pair<S, R>(&self, send: &S, recv: &R) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBuffer<B> + ?Sized,
    {
        self.check_usable()?;
        self.check_buffer(send.device_ordinal(), "input")?;
        self.check_buffer(recv.device_ordinal(), "output")?;
        self.check_dtype(send.dtype(), recv.dtype())
    }

    fn check_len(
        &self,
        got: usize,
        expected: Option<usize>,
        which: &str,
        rule: &str,
    ) -> Result<()> {
        if expected != Some(got) {
            return Err(Error::LengthMismatch {
                rank: self.rank(),
                what: match expected {
                    Some(e) => format!("{which} has {got} elements but must have {e} ({rule})"),
                    None => format!("{which}: {rule} overflows usize"),
                },
            });
        }
        Ok(())
    }

    /// Launches this rank's kernel of `plan` from `send` (if any) into `recv`.
    fn enqueue_collective<S, R>(&self, plan: &Plan, send: Option<&S>, recv: &mut R) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        if plan.elements == 0 {
            return Ok(());
        }
        let dev = &self.rank.device;
        let (input, in_guard) = match send {
            Some(s) => {
                let (p, g) = s.read_ptr(dev);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (output, out_guard) = recv.write_ptr(dev);
        let mut inputs = [0u64; MAX_GPUS];
        inputs[self.rank.index] = input;
        let result =
            self.launch_collective(|| self.rank.launch(&self.settings, plan, &inputs, output));
        drop((in_guard, out_guard));
        result
    }
}
