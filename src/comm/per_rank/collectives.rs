//! The per-rank [`Comm`]'s all-gather, reduce-scatter, broadcast, scatter and fused
//! all-reduce + residual + RMSNorm. Each call checks this rank's buffers and launches
//! only its kernel; what the peers read is staged into this rank's payload, except
//! all-gather, reduce-scatter and fused inputs in registered or symmetric buffers, read
//! in place (broadcast and scatter read only the root's input, at a place the others
//! cannot know). Every rank of a group makes the same calls in the same order.
//!
//! Overlapping buffers are [`crate::Error::BuffersOverlap`] before anything launches,
//! except a broadcast root's input that is its output (it runs in place). Such an
//! argument error is this rank's alone: its peers' call is not met.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dtype::DType;
use crate::error::Result;

use super::{mark_place, meta, peer_inputs, reads, Comm};
use crate::comm::core::launch::{Fused, PeerInputs};
use crate::comm::core::planning::collective::{Collective, CollectiveOptions};
use crate::comm::core::planning::PeerReads;

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
        let core = &*self.core;
        core.check_pair(&meta(send), &meta(&*recv))?;
        let (width, _) = core.collective_width(options)?;
        core.check_len(
            recv.len(),
            send.len().checked_mul(width),
            "output",
            "group width x input",
        )?;
        let call = (Collective::AllGather, send.dtype(), send.len(), options);
        self.enqueue_collective(call, Some(send), recv, (true, false))
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
        let core = &*self.core;
        core.check_pair(&meta(send), &meta(&*recv))?;
        let part = core.reduce_scatter_len(send.len(), options)?;
        core.check_len(
            recv.len(),
            Some(part),
            "output",
            "this rank's part of the input",
        )?;
        let call = (Collective::ReduceScatter, send.dtype(), send.len(), options);
        self.enqueue_collective(call, Some(send), recv, (true, false))
    }

    /// Copies the input of the group's `root` (a group rank) into every member's
    /// `recv`. The root passes `Some(&send)` of `recv.len()` elements; the others
    /// pass `None` (no turbofish needed; what a non-root passes is not read).
    pub fn broadcast<R>(
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
        let is_root = core.check_root(send.is_some(), root, options)?;
        let send = send.filter(|_| is_root);
        core.check_usable()?;
        core.check_buffer(recv.device_ordinal(), "output")?;
        if let Some(s) = send {
            core.check_pair(&meta(s), &meta(&*recv))?;
            core.check_len(recv.len(), Some(s.len()), "output", "the root's input")?;
        }
        // Only the root's input is read, at a place the others cannot know: staged.
        let call = (
            Collective::Broadcast { root },
            recv.dtype(),
            recv.len(),
            options,
        );
        self.enqueue_collective(call, send, recv, (false, true))
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
        if plan.elements == 0 {
            return Ok(());
        }
        let (ptr, guard) = buf.write_ptr(core.device());
        let result = core
            .check_usable()
            .and_then(|()| core.launch(&plan, PeerInputs::Own(ptr), ptr));
        drop(guard);
        result
    }

    /// Scatters the root's `send` (`group width * recv.len()` elements): member q
    /// receives elements `[q * n, (q + 1) * n)`, `n = recv.len()`. The root passes
    /// `Some(send)`; the others may pass `None`.
    pub fn scatter<R>(
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
        let is_root = core.check_root(send.is_some(), root, options)?;
        let send = send.filter(|_| is_root);
        core.check_usable()?;
        core.check_buffer(recv.device_ordinal(), "output")?;
        if let Some(s) = send {
            let (width, _) = core.collective_width(options)?;
            core.check_pair(&meta(s), &meta(&*recv))?;
            core.check_len(
                s.len(),
                recv.len().checked_mul(width),
                "root's input",
                "group width x output",
            )?;
        }
        // Only the root's input is read, at a place the others cannot know: staged.
        let call = (
            Collective::Scatter { root },
            recv.dtype(),
            recv.len(),
            options,
        );
        self.enqueue_collective(call, send, recv, (false, false))
    }

    /// The end of a tensor-parallel decoder layer in one kernel: sums `input` (rows of
    /// `weight.len()` elements) over the group, adds `residual` and writes the new
    /// residual back, then RMS-normalises each row with `weight` and `epsilon` into
    /// `output`. Each element goes through the unfused sequence's roundings with f32
    /// arithmetic; every member gets the same bits. The hidden size must be a multiple
    /// of the pack width (8 for f16/bf16, 4 for f32).
    ///
    /// `Auto` ([`CollectiveOptions::algorithm`]) runs the Lamport kernel over the world
    /// where the message and its 64-byte header fit `lamport_slot_bytes`, else the
    /// one-stage one (staged in runs of whole rows: a row must fit half of
    /// `payload_bytes`). A row's results depend only on that row's inputs, the weight
    /// and epsilon: not on its batch's token count or the algorithm.
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
        let (i, ig) = input.read_ptr(dev);
        let (w, wg) = weight.read_ptr(dev);
        let (r, rg) = residual.write_ptr(dev);
        let (o, og) = output.write_ptr(dev);
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
        let mut plan = core.plan_collective(
            Collective::AllReduceRmsNorm {
                hidden: weight.len(),
                epsilon,
            },
            input.dtype(),
            input.len(),
            options,
            reads(&place),
        )?;
        if plan.elements == 0 {
            return Ok(());
        }
        mark_place(&mut plan, &place);
        let fused = Fused {
            residual: r,
            weight: w,
        };
        let result = core
            .check_usable()
            .and_then(|()| core.launch_fused(&plan, peer_inputs(i, &place), o, fused));
        drop((ig, wg, rg, og));
        result
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
        let dev = core.device();
        let out_bytes = meta(&*recv).bytes(self.rank(), "output")?;
        let (input, in_guard) = match send {
            Some(s) => {
                let bytes = meta(s).bytes(self.rank(), "input")?;
                let (p, g) = s.read_ptr(dev);
                (p, Some((g, bytes)))
            }
            None => (0, None),
        };
        let (output, out_guard) = recv.write_ptr(dev);
        if let Some((_, in_bytes)) = &in_guard {
            self.check_overlaps(
                [
                    (input, *in_bytes, "input", false),
                    (output, out_bytes, "output", true),
                ],
                in_place,
            )?;
        }
        let place = match &in_guard {
            Some((_, bytes)) if zero_copy => self.place_of(input, *bytes),
            _ => None,
        };
        let mut plan = core.plan_collective(which, dtype, elements, options, reads(&place))?;
        if plan.elements == 0 {
            return Ok(());
        }
        mark_place(&mut plan, &place);
        let result = core
            .check_usable()
            .and_then(|()| core.launch(&plan, peer_inputs(input, &place), output));
        drop((in_guard, out_guard));
        result
    }
}
