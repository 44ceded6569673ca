//! Group calls on [`SingleController`]: a guard that collects all-reduces (every rank's
//! buffers, as `all_reduce_sum_slices` takes them) and launches them when it ends.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dispatch::Algorithm;
use crate::dtype::ReduceOp;
use crate::error::Result;

use super::super::AllReduceOptions;
use super::validate::Meta;
use super::SingleController;
use crate::comm::core::launch::group::{run_group_steps, GroupStep, GroupedCall};
use crate::comm::core::planning::PeerReads;

/// An open group of all-reduces on a [`SingleController`] (see
/// [`SingleController::group`]). Each call is checked when made; nothing launches until
/// [`SingleControllerGroup::end`], which first refuses overlapping buffers (but an input
/// that is its output, the very same range, runs in place). Dropping the guard without
/// it discards the calls, so an early return cannot leave the group open.
pub struct SingleControllerGroup<'c, 'b, B: Backend> {
    comm: &'c SingleController<B>,
    calls: Vec<Pending<'b, B>>,
}

struct Pending<'b, B: Backend> {
    /// Every rank's input (`None`: in place, the output is the input).
    inputs: Option<Vec<&'b dyn DeviceBuffer<B>>>,
    outputs: Vec<&'b mut dyn DeviceBufferMut<B>>,
    call: GroupedCall,
}

impl<B: Backend> SingleController<B> {
    /// Opens a group: the all-reduces issued through the guard launch when it ends, in
    /// order; consecutive ones of one dtype and group width (algorithm left to peercomm)
    /// run as one kernel per rank, up to 8 whose inputs and an 80-byte entry table fit
    /// the payload. Each result is bit for bit what the call gives alone.
    ///
    /// ```
    /// use peercomm::backend::{host::Host, Backend};
    /// use peercomm::{CommConfig, ReduceOp, SingleController};
    ///
    /// let comm = SingleController::<Host>::new(&[0, 1], CommConfig::default())?;
    /// let ins: Vec<_> = comm.cores().iter().map(|r| Host::alloc_from(r.device(), &[1.0f32; 4]).unwrap()).collect();
    /// let mut a: Vec<_> = comm.cores().iter().map(|r| Host::alloc_buffer::<f32>(r.device(), 4).unwrap()).collect();
    /// let mut b: Vec<_> = comm.cores().iter().map(|r| Host::alloc_from(r.device(), &[3.0f32; 4]).unwrap()).collect();
    /// let mut group = comm.group();
    /// group.all_reduce_slices(&ins, &mut a, &ReduceOp::Sum)?;
    /// group.all_reduce_slices_in_place(&mut b, &ReduceOp::Sum)?;
    /// group.end()?; // one kernel per rank for both
    /// comm.synchronize()?;
    /// assert_eq!(Host::download(comm.core(1).device(), &a[1])?, vec![2.0; 4]);
    /// assert_eq!(Host::download(comm.core(0).device(), &b[0])?, vec![6.0; 4]);
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn group<'b>(&self) -> SingleControllerGroup<'_, 'b, B> {
        SingleControllerGroup {
            comm: self,
            calls: Vec::new(),
        }
    }
}

impl<'b, B: Backend> SingleControllerGroup<'_, 'b, B> {
    /// Adds [`SingleController::all_reduce_slices`] of `inputs` into `outputs`.
    pub fn all_reduce_slices<S, R>(
        &mut self,
        inputs: &'b [S],
        outputs: &'b mut [R],
        op: &ReduceOp,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_slices_with(inputs, outputs, op, &AllReduceOptions::new())
    }

    /// As [`SingleControllerGroup::all_reduce_slices`], with options.
    pub fn all_reduce_slices_with<S, R>(
        &mut self,
        inputs: &'b [S],
        outputs: &'b mut [R],
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let first = self.comm.check_slices(inputs, outputs)?;
        let inputs = inputs.iter().map(|b| b as &dyn DeviceBuffer<B>);
        self.add(
            first,
            &options.with_op(*op),
            Some(inputs.collect()),
            outputs,
        )
    }

    /// Adds every rank's `buffers[r]` reduced with `op` over the world in place.
    pub fn all_reduce_slices_in_place<R: DeviceBufferMut<B>>(
        &mut self,
        buffers: &'b mut [R],
        op: &ReduceOp,
    ) -> Result<()> {
        self.all_reduce_slices_in_place_with(buffers, op, &AllReduceOptions::new())
    }

    /// As [`SingleControllerGroup::all_reduce_slices_in_place`], with options.
    pub fn all_reduce_slices_in_place_with<R: DeviceBufferMut<B>>(
        &mut self,
        buffers: &'b mut [R],
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<()> {
        let first = self.comm.check_flat(buffers, "in-place")?;
        self.add(first, &options.with_op(*op), None, buffers)
    }

    /// The sum: `all_reduce_slices(inputs, outputs, &ReduceOp::Sum)`.
    #[deprecated(note = "use `all_reduce_slices(inputs, outputs, &ReduceOp::Sum)`")]
    pub fn all_reduce_sum_slices<S, R>(
        &mut self,
        inputs: &'b [S],
        outputs: &'b mut [R],
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_slices(inputs, outputs, &ReduceOp::Sum)
    }

    /// The sum with options.
    #[deprecated(note = "use `all_reduce_slices_with(inputs, outputs, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_slices_with<S, R>(
        &mut self,
        inputs: &'b [S],
        outputs: &'b mut [R],
        options: &AllReduceOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_slices_with(inputs, outputs, &ReduceOp::Sum, options)
    }

    /// The sum in place.
    #[deprecated(note = "use `all_reduce_slices_in_place(buffers, &ReduceOp::Sum)`")]
    pub fn all_reduce_sum_slices_in_place<R: DeviceBufferMut<B>>(
        &mut self,
        buffers: &'b mut [R],
    ) -> Result<()> {
        self.all_reduce_slices_in_place(buffers, &ReduceOp::Sum)
    }

    /// The sum in place with options.
    #[deprecated(note = "use `all_reduce_slices_in_place_with(buffers, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_slices_in_place_with<R: DeviceBufferMut<B>>(
        &mut self,
        buffers: &'b mut [R],
        options: &AllReduceOptions,
    ) -> Result<()> {
        self.all_reduce_slices_in_place_with(buffers, &ReduceOp::Sum, options)
    }

    /// Calls in the group so far.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether no call was added yet.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Routes the call now (refusing it here, not at `end`) and keeps it; `inputs`
    /// `None` is in place.
    fn add<R: DeviceBufferMut<B>>(
        &mut self,
        first: Meta,
        options: &AllReduceOptions,
        inputs: Option<Vec<&'b dyn DeviceBuffer<B>>>,
        outputs: &'b mut [R],
    ) -> Result<()> {
        let in_place = inputs.is_none();
        let call = GroupedCall {
            dtype: first.dtype,
            elements: first.len,
            options: *options,
            in_place,
        };
        self.comm
            .route_all_reduce(call.dtype, call.elements, &call.options, in_place)?;
        let outputs = outputs.iter_mut().map(|b| b as &mut dyn DeviceBufferMut<B>);
        self.calls.push(Pending {
            inputs,
            outputs: outputs.collect(),
            call,
        });
        Ok(())
    }

    /// Ends the group: launches its calls (the algorithm of each, in order). An error
    /// once some were launched poisons the communicator.
    pub fn end(self) -> Result<Vec<Algorithm>> {
        let mut pending = self.calls;
        if pending.is_empty() {
            return Ok(Vec::new());
        }
        let comm = self.comm;
        let mut calls: Vec<GroupedCall> = pending.iter().map(|p| p.call).collect();
        // Call s's outputs and inputs on every rank (`None`: its outputs, in place).
        let io: Vec<_> = pending
            .iter_mut()
            .map(|p| {
                let outs = comm.writes(p.outputs.iter_mut().map(|b| &mut **b).enumerate());
                let ins = p
                    .inputs
                    .as_ref()
                    .map(|i| comm.reads(i.iter().copied().enumerate()));
                (outs, ins)
            })
            .collect();
        let ins = |s: usize| io[s].1.as_ref().map_or(&io[s].0.at, |i| &i.at);
        // Before anything is planned or launched: a call whose input is its output on
        // some rank, the very same range, runs in place; other overlaps are refused.
        for (call, (outs, ins)) in calls.iter_mut().zip(&io) {
            let outputs = (outs, "output", true);
            match ins {
                None => drop(comm.check_overlaps(&[outputs], false)?),
                Some(ins) => {
                    call.in_place = comm.check_overlaps(&[(ins, "input", false), outputs], true)?
                }
            }
        }
        let steps = comm.ranks[0].plan_grouped(&calls, PeerReads::UserBuffers)?;
        run_group_steps(
            steps,
            calls.len(),
            |e| comm.poison(e),
            |step| match step {
                GroupStep::Batch { first, plan } => {
                    if plan.total_elements > 0 {
                        let io: Vec<_> = (first..first + plan.count)
                            .map(|s| (ins(s), &io[s].0.at))
                            .collect();
                        comm.launch_group_on_all(&plan, &io)?;
                    }
                    Ok(None)
                }
                GroupStep::Alone { index, routed } => {
                    let c = &calls[index];
                    let which = if c.in_place { "in-place" } else { "input" };
                    comm.run_all_reduce(
                        routed,
                        ins(index),
                        &io[index].0.at,
                        c.elements,
                        c.dtype,
                        which,
                    )
                    .map(|a| Some((index, a)))
                }
            },
        )
    }
}

/// The single controller's group guard's old name.
#[deprecated(note = "renamed `SingleControllerGroup`")]
pub type CommunicatorGroup<'c, 'b, B> = SingleControllerGroup<'c, 'b, B>;
