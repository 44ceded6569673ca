//! The per-rank [`Comm`]'s all-gather, reduce-scatter, broadcast, scatter and fused
//! all-reduce + residual + RMSNorm: this rank's buffers checked, then its kernel
//! launched. The peers read staged inputs, or registered and symmetric ones in place
//! (not a broadcast's or scatter's root input: the others cannot know its place).
//! Overlapping buffers are [`crate::Error::BuffersOverlap`], except a broadcast root's
//! input that is its output (in place); such an error is this rank's alone.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

use super::{meta, reads, Comm};
use crate::comm::core::launch::Fused;
use crate::comm::core::planning::collective::{Collective, CollectiveOptions};
use crate::comm::core::planning::PeerReads;

impl<B: Backend> Comm<B> {
    /// Gathers every rank's `send` into `recv` on every rank (cudarc's
    /// `Comm::all_gather`): rank q's elements land at `[q * n, (q + 1) * n)`, where
    /// `n = send.len()`; `recv` holds `world * n` elements.
    pub fn all_gather<S, R>(&self, send: &S, recv: &mut R) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_gather_with(send, recv, &CollectiveOptions::new())
    }

    /// As [`Comm::all_gather`], over the groups of the options: member q's elements land
    /// at `[q * n, (q + 1) * n)`; `recv` holds `group width * n` elements.
    pub fn all_gather_with<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_pair(&meta(send), &meta(&*recv))?;
        let (width, _) = core.collective_width(options)?;
        let n = send.len().checked_mul(width);
        core.check_len(recv.len(), n, "output", "group width x input")?;
        let call = (Collective::AllGather, send.dtype(), send.len(), options);
        self.enqueue_collective(call, Some(send), recv, (true, false))
    }

    /// Reduces `send` with `op` over the world; this rank receives part `group rank` of
    /// the result ([`crate::reduce_scatter_part`]: the first `n % width` parts have one
    /// element more), bit for bit what the all-reduce gives for those elements
    /// (cudarc's `Comm::reduce_scatter`).
    pub fn reduce_scatter<S, R>(&self, send: &S, recv: &mut R, op: &ReduceOp) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.reduce_scatter_with(send, recv, op, &CollectiveOptions::new())
    }

    /// As [`Comm::reduce_scatter`], over the groups of the options.
    pub fn reduce_scatter_with<S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: &ReduceOp,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_pair(&meta(send), &meta(&*recv))?;
        let part = core.reduce_scatter_len(send.len(), options)?;
        let rule = "this rank's part of the input";
        core.check_len(recv.len(), Some(part), "output", rule)?;
        let options = options.with_op(*op);
        let call = (
            Collective::ReduceScatter,
            send.dtype(),
            send.len(),
            &options,
        );
        self.enqueue_collective(call, Some(send), recv, (true, false))
    }

    /// The sum: `reduce_scatter_with(send, recv, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `reduce_scatter_with(send, recv, &ReduceOp::Sum, options)`")]
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
        self.reduce_scatter_with(send, recv, &ReduceOp::Sum, options)
    }

    /// Reduces `send` with `op` over the world into the `recv` of rank `root` (cudarc's
    /// `Comm::reduce`): the root passes `Some(&mut recv)` of `send.len()` elements; the
    /// others pass `None` (what a non-root passes is not written). Every rank's result
    /// would be the all-reduce's, bit for bit; only the root's is stored.
    pub fn reduce<S, R>(
        &self,
        send: &S,
        recv: Option<&mut R>,
        op: &ReduceOp,
        root: usize,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.reduce_with(send, recv, op, root, &CollectiveOptions::new())
    }

    /// As [`Comm::reduce`], over the groups of the options: `root` is a group rank.
    pub fn reduce_with<S, R>(
        &self,
        send: &S,
        recv: Option<&mut R>,
        op: &ReduceOp,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_usable()?;
        core.check_buffer(send.device_ordinal(), "input")?;
        let is_root = core.check_root((recv.is_some(), "output"), root, options)?;
        let recv = recv.filter(|_| is_root);
        if let Some(r) = &recv {
            core.check_all_reduce(&meta(send), &meta(&**r))?;
        }
        let bytes = meta(send).bytes(self.rank(), "input")?;
        let (input, _in_access) = send.read_ptr(core.device());
        let (output, _out_access) = recv.map(|r| r.write_ptr(core.device())).unzip();
        // A non-root's kernel stores nothing: no output.
        let output = output.unwrap_or(0);
        if output != 0 {
            let roles = [
                (input, bytes, "input", false),
                (output, bytes, "output", true),
            ];
            self.check_overlaps(roles, false)?;
        }
        self.enqueue_reduce(send.dtype(), send.len(), (input, output), op, root, options)
    }

    /// Reduces `buf` with `op` over the world into the `buf` of rank `root` (cudarc's
    /// `Comm::reduce_in_place`); every other rank's `buf` is left as it was.
    pub fn reduce_in_place<R>(&self, buf: &mut R, op: &ReduceOp, root: usize) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.reduce_in_place_with(buf, op, root, &CollectiveOptions::new())
    }

    /// As [`Comm::reduce_in_place`], over the groups of the options.
    pub fn reduce_in_place_with<R>(
        &self,
        buf: &mut R,
        op: &ReduceOp,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_usable()?;
        core.check_buffer(buf.device_ordinal(), "in-place")?;
        core.check_root((true, "output"), root, options)?;
        meta(&*buf).bytes(self.rank(), "in-place")?;
        let (dtype, len) = (buf.dtype(), buf.len());
        let (ptr, _access) = buf.write_ptr(core.device());
        self.enqueue_reduce(dtype, len, (ptr, ptr), op, root, options)
    }

    /// Plans and enqueues a reduce from `input` into `output` (0 on a non-root).
    fn enqueue_reduce(
        &self,
        dtype: DType,
        elements: usize,
        (input, output): (u64, u64),
        op: &ReduceOp,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let options = options.with_op(*op);
        let which = Collective::Reduce { root };
        let plan =
            (self.core).plan_collective(which, dtype, elements, &options, PeerReads::Payloads)?;
        self.enqueue(plan, input, &None, output, Fused::default())
    }

    /// Copies the input of rank `root` into every rank's `recv` (cudarc's
    /// `Comm::broadcast`). The root passes `Some(&send)` of `recv.len()` elements; the
    /// others pass `None` (no turbofish needed; what a non-root passes is not read).
    pub fn broadcast<R>(
        &self,
        send: Option<&dyn DeviceBuffer<B>>,
        recv: &mut R,
        root: usize,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.broadcast_with(send, recv, root, &CollectiveOptions::new())
    }

    /// As [`Comm::broadcast`], over the groups of the options: `root` is a group rank.
    pub fn broadcast_with<R>(
        &self,
        send: Option<&dyn DeviceBuffer<B>>,
        recv: &mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let send = self.root_send(send, recv, root, options)?;
        if let Some(s) = send {
            (self.core).check_len(recv.len(), Some(s.len()), "output", "the root's input")?;
        }
        let which = Collective::Broadcast { root };
        let call = (which, recv.dtype(), recv.len(), options);
        self.enqueue_collective(call, send, recv, (false, true))
    }

    /// Broadcast in place (cudarc's `Comm::broadcast_in_place`): the root's `buf` is the
    /// message, every other rank's `buf` is overwritten with it.
    pub fn broadcast_in_place<R>(&self, buf: &mut R, root: usize) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.broadcast_in_place_with(buf, root, &CollectiveOptions::new())
    }

    /// As [`Comm::broadcast_in_place`], over the groups of the options.
    pub fn broadcast_in_place_with<R>(
        &self,
        buf: &mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        core.check_usable()?;
        core.check_buffer(buf.device_ordinal(), "in-place")?;
        let plan = core.plan_collective(
            Collective::Broadcast { root },
            buf.dtype(),
            buf.len(),
            options,
            PeerReads::Payloads,
        )?;
        let (ptr, _access) = buf.write_ptr(core.device());
        self.enqueue(plan, ptr, &None, ptr, Fused::default())
    }

    /// Scatters the root's `send` (`world * recv.len()` elements): rank q receives
    /// elements `[q * n, (q + 1) * n)`, `n = recv.len()`. The root passes `Some(send)`;
    /// the others may pass `None`.
    pub fn scatter<R>(
        &self,
        send: Option<&dyn DeviceBuffer<B>>,
        recv: &mut R,
        root: usize,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.scatter_with(send, recv, root, &CollectiveOptions::new())
    }

    /// As [`Comm::scatter`], over the groups of the options (`root` a group rank,
    /// `send` of `group width * recv.len()` elements).
    pub fn scatter_with<R>(
        &self,
        send: Option<&dyn DeviceBuffer<B>>,
        recv: &mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        let send = self.root_send(send, recv, root, options)?;
        if let Some(s) = send {
            let (width, _) = core.collective_width(options)?;
            let n = recv.len().checked_mul(width);
            core.check_len(s.len(), n, "root's input", "group width x output")?;
        }
        let which = Collective::Scatter { root };
        let call = (which, recv.dtype(), recv.len(), options);
        self.enqueue_collective(call, send, recv, (false, false))
    }

    /// The end of a tensor-parallel decoder layer in one kernel: sums `input` (rows of
    /// `weight.len()` elements, a multiple of 8 for f16/bf16, 4 for f32) over the group,
    /// adds `residual` and writes the new residual back, then RMS-normalises each row
    /// with `weight` and `epsilon` into `output`, with the unfused sequence's roundings.
    /// `Auto` runs the Lamport kernel where the message and its 64-byte header fit
    /// `lamport_slot_bytes`, else the one-stage one (a row must fit half of
    /// `payload_bytes`); a row's bits depend only on its inputs, weight and epsilon.
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
        let core = &*self.core;
        core.check_pair(&meta(input), &meta(&*output))?;
        core.check_buffer(residual.device_ordinal(), "residual")?;
        core.check_buffer(weight.device_ordinal(), "weight")?;
        for dtype in [residual.dtype(), weight.dtype()] {
            core.check_dtype(input.dtype(), dtype)?;
        }
        core.check_len(output.len(), Some(input.len()), "output", "input")?;
        core.check_len(residual.len(), Some(input.len()), "residual", "input")?;
        let rank = self.rank();
        let bytes = meta(input).bytes(rank, "input")?;
        let weight_bytes = meta(weight).bytes(rank, "weight")?;
        let dev = core.device();
        let (i, _ia) = input.read_ptr(dev);
        let (w, _wa) = weight.read_ptr(dev);
        let (r, _ra) = residual.write_ptr(dev);
        let (o, _oa) = output.write_ptr(dev);
        // No in-place form: the residual is read and written, the input read in
        // place by the peers.
        self.check_overlaps(
            [
                (i, bytes, "input", false),
                (w, weight_bytes, "weight", false),
                (r, bytes, "residual", true),
                (o, bytes, "output", true),
            ],
            false,
        )?;
        let place = self.place_of(i, bytes);
        let plan = core.plan_collective(
            Collective::AllReduceRmsNorm {
                hidden: weight.len(),
                epsilon,
            },
            input.dtype(),
            input.len(),
            options,
            reads(&place),
        )?;
        let fused = Fused {
            residual: r,
            weight: w,
        };
        self.enqueue(plan, i, &place, o, fused)
    }

    /// A broadcast's or scatter's `send` where this rank is the root (which must pass
    /// it), checked against `recv`; `None` elsewhere (what a non-root passes is unread).
    fn root_send<'s, R>(
        &self,
        send: Option<&'s dyn DeviceBuffer<B>>,
        recv: &R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<Option<&'s dyn DeviceBuffer<B>>>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        let is_root = core.check_root((send.is_some(), "input"), root, options)?;
        let send = send.filter(|_| is_root);
        core.check_usable()?;
        core.check_buffer(recv.device_ordinal(), "output")?;
        if let Some(s) = send {
            core.check_pair(&meta(s), &meta(recv))?;
        }
        Ok(send)
    }

    /// Plans `(which, dtype, elements, options)` and launches this rank's kernel from
    /// `send` into `recv`; with `zero_copy`, a registered input is read in place.
    /// Overlaps are refused first, except (with `in_place`) the very same range.
    fn enqueue_collective<S, R>(
        &self,
        (which, dtype, elements, options): (Collective, DType, usize, &CollectiveOptions),
        send: Option<&S>,
        recv: &mut R,
        (zero_copy, in_place): (bool, bool),
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let core = &*self.core;
        let rank = self.rank();
        let out_bytes = meta(&*recv).bytes(rank, "output")?;
        let in_bytes = send.map(|s| meta(s).bytes(rank, "input")).transpose()?;
        let (input, _in_access) = send.map(|s| s.read_ptr(core.device())).unzip();
        let input = input.unwrap_or(0);
        let (output, _out_access) = recv.write_ptr(core.device());
        let mut place = None;
        if let Some(bytes) = in_bytes {
            let roles = [
                (input, bytes, "input", false),
                (output, out_bytes, "output", true),
            ];
            self.check_overlaps(roles, in_place)?;
            if zero_copy {
                place = self.place_of(input, bytes);
            }
        }
        let plan = core.plan_collective(which, dtype, elements, options, reads(&place))?;
        self.enqueue(plan, input, &place, output, Fused::default())
    }
}
