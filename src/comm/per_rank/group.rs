//! Group calls on [`Comm`]: a guard that collects calls and launches them when it ends,
//! in order, consecutive all-reduces in as few kernels as the kernels allow.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dispatch::Algorithm;
use crate::dtype::ReduceOp;
use crate::error::Result;

use super::super::AllReduceOptions;
use super::exchange::Exchange;
use super::{meta, Comm};
use crate::comm::core::launch::group::{run_group_steps, GroupStep, GroupedCall};
use crate::comm::core::launch::PeerInputs;
use crate::comm::core::planning::collective::CollectiveOptions;
use crate::comm::core::planning::PeerReads;

/// An open group on a [`Comm`] (see [`Comm::group`]). Each all-reduce, send and receive
/// is checked when made, the other collectives at [`CommGroup::end`]; nothing launches until then (and
/// overlapping buffers are refused first), and dropping the guard without it discards
/// the calls. The buffers stay borrowed until then.
pub struct CommGroup<'c, 'b, B: Backend> {
    comm: &'c Comm<B>,
    calls: Vec<Entry<'b, B>>,
}

/// A call of a group: an all-reduce (batched with its neighbours), or another
/// collective, made at the end in its place.
enum Entry<'b, B: Backend> {
    AllReduce(Pending<'b, B>),
    Other(Deferred<'b, B>),
    /// Consecutive sends and receives (one to and one from each rank at most), as one
    /// exchange, and the calls they came from.
    Exchange(Exchange<'b, B>, usize),
}

type Deferred<'b, B> = Box<dyn FnOnce(&Comm<B>) -> Result<()> + 'b>;

struct Pending<'b, B: Backend> {
    /// `None`: in place.
    send: Option<&'b dyn DeviceBuffer<B>>,
    recv: &'b mut dyn DeviceBufferMut<B>,
    call: GroupedCall,
}

impl<B: Backend> Comm<B> {
    /// Opens a group (NCCL's `group_start` / `group_end`), as
    /// [`crate::SingleController::group`]. Every rank issues the same group: a
    /// difference is `Error::CallMismatch` on every rank, nothing written.
    ///
    /// ```
    /// use peercomm::backend::{host::Host, Backend};
    /// use peercomm::{Comm, CommConfig, ReduceOp, UniqueId};
    ///
    /// let id = UniqueId::new()?;
    /// std::thread::scope(|s| {
    ///     for rank in 0..2 {
    ///         let id = &id;
    ///         s.spawn(move || {
    ///             let comm = Comm::from_rank(Host::open(rank).unwrap(), rank, 2, id, CommConfig::default()).unwrap();
    ///             let dev = comm.device();
    ///             let a = Host::alloc_from(dev, &[1.0f32; 4]).unwrap();
    ///             let b = Host::alloc_from(dev, &[2.0f32; 8]).unwrap();
    ///             let (mut sa, mut sb) = (Host::alloc_buffer::<f32>(dev, 4).unwrap(), Host::alloc_buffer::<f32>(dev, 8).unwrap());
    ///             let mut group = comm.group();
    ///             group.all_reduce(&a, &mut sa, &ReduceOp::Sum).unwrap();
    ///             group.all_reduce(&b, &mut sb, &ReduceOp::Sum).unwrap();
    ///             group.end().unwrap(); // one kernel for both
    ///             comm.synchronize().unwrap();
    ///             assert_eq!(Host::download(dev, &sa).unwrap(), vec![2.0; 4]);
    ///             assert_eq!(Host::download(dev, &sb).unwrap(), vec![4.0; 8]);
    ///         });
    ///     }
    /// });
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn group<'b>(&self) -> CommGroup<'_, 'b, B> {
        CommGroup {
            comm: self,
            calls: Vec::new(),
        }
    }
}

impl<'b, B: Backend> CommGroup<'_, 'b, B> {
    /// Adds `send` reduced with `op` over the world into `recv` (see
    /// [`Comm::all_reduce`]).
    pub fn all_reduce<S, R>(&mut self, send: &'b S, recv: &'b mut R, op: &ReduceOp) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_with(send, recv, op, &AllReduceOptions::new())
    }

    /// As [`CommGroup::all_reduce`], with options.
    pub fn all_reduce_with<S, R>(
        &mut self,
        send: &'b S,
        recv: &'b mut R,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.comm
            .core
            .check_all_reduce(&meta(send), &meta(&*recv))?;
        let shape = (send.dtype(), send.len());
        let options = options.with_op(*op);
        self.add(Some(send as &dyn DeviceBuffer<B>), recv, shape, &options)
    }

    /// Adds `buf` reduced with `op` over the world in place.
    pub fn all_reduce_in_place<R>(&mut self, buf: &'b mut R, op: &ReduceOp) -> Result<()>
    where
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_in_place_with(buf, op, &AllReduceOptions::new())
    }

    /// As [`CommGroup::all_reduce_in_place`], with options.
    pub fn all_reduce_in_place_with<R: DeviceBufferMut<B>>(
        &mut self,
        buf: &'b mut R,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<()> {
        let core = &*self.comm.core;
        core.check_usable()?;
        core.check_buffer(buf.device_ordinal(), "in-place")?;
        let (dtype, elements) = (buf.dtype(), buf.len());
        self.add(None, buf, (dtype, elements), &options.with_op(*op))
    }

    /// The sum: `all_reduce(send, recv, &ReduceOp::Sum)`.
    #[deprecated(note = "use `all_reduce(send, recv, &ReduceOp::Sum)` (cudarc's signature)")]
    pub fn all_reduce_sum<S, R>(&mut self, send: &'b S, recv: &'b mut R) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce(send, recv, &ReduceOp::Sum)
    }

    /// The sum with options: `all_reduce_with(send, recv, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_with(send, recv, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_with<S, R>(
        &mut self,
        send: &'b S,
        recv: &'b mut R,
        options: &AllReduceOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_reduce_with(send, recv, &ReduceOp::Sum, options)
    }

    /// The sum in place: `all_reduce_in_place(buf, &ReduceOp::Sum)`.
    #[deprecated(note = "use `all_reduce_in_place(buf, &ReduceOp::Sum)`")]
    pub fn all_reduce_sum_in_place<R: DeviceBufferMut<B>>(&mut self, buf: &'b mut R) -> Result<()> {
        self.all_reduce_in_place(buf, &ReduceOp::Sum)
    }

    /// The sum in place with options:
    /// `all_reduce_in_place_with(buf, &ReduceOp::Sum, options)`.
    #[deprecated(note = "use `all_reduce_in_place_with(buf, &ReduceOp::Sum, options)`")]
    pub fn all_reduce_sum_in_place_with<R: DeviceBufferMut<B>>(
        &mut self,
        buf: &'b mut R,
        options: &AllReduceOptions,
    ) -> Result<()> {
        self.all_reduce_in_place_with(buf, &ReduceOp::Sum, options)
    }

    /// Adds [`Comm::reduce_scatter`] (made at [`CommGroup::end`], in its place).
    pub fn reduce_scatter<S, R>(
        &mut self,
        send: &'b S,
        recv: &'b mut R,
        op: &ReduceOp,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.reduce_scatter_with(send, recv, op, &CollectiveOptions::new())
    }

    /// Adds [`Comm::reduce_scatter_with`].
    pub fn reduce_scatter_with<S, R>(
        &mut self,
        send: &'b S,
        recv: &'b mut R,
        op: &ReduceOp,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let (op, options) = (*op, *options);
        self.defer(Box::new(move |c| {
            c.reduce_scatter_with(send, recv, &op, &options)
        }))
    }

    /// Adds [`Comm::all_gather`] (made at [`CommGroup::end`], in its place).
    pub fn all_gather<S, R>(&mut self, send: &'b S, recv: &'b mut R) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.all_gather_with(send, recv, &CollectiveOptions::new())
    }

    /// Adds [`Comm::all_gather_with`].
    pub fn all_gather_with<S, R>(
        &mut self,
        send: &'b S,
        recv: &'b mut R,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let options = *options;
        self.defer(Box::new(move |c| c.all_gather_with(send, recv, &options)))
    }

    /// Adds [`Comm::broadcast`] (made at [`CommGroup::end`], in its place).
    pub fn broadcast<R>(
        &mut self,
        send: Option<&'b dyn DeviceBuffer<B>>,
        recv: &'b mut R,
        root: usize,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        self.broadcast_with(send, recv, root, &CollectiveOptions::new())
    }

    /// Adds [`Comm::broadcast_with`].
    pub fn broadcast_with<R>(
        &mut self,
        send: Option<&'b dyn DeviceBuffer<B>>,
        recv: &'b mut R,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let options = *options;
        self.defer(Box::new(move |c| {
            c.broadcast_with(send, recv, root, &options)
        }))
    }

    /// Adds [`Comm::broadcast_in_place`] (made at [`CommGroup::end`], in its place).
    pub fn broadcast_in_place<R>(&mut self, buf: &'b mut R, root: usize) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let options = CollectiveOptions::new();
        self.defer(Box::new(move |c| {
            c.broadcast_in_place_with(buf, root, &options)
        }))
    }

    /// Adds [`Comm::reduce`] (made at [`CommGroup::end`], in its place).
    pub fn reduce<S, R>(
        &mut self,
        send: &'b S,
        recv: Option<&'b mut R>,
        op: &ReduceOp,
        root: usize,
    ) -> Result<()>
    where
        S: DeviceBuffer<B> + ?Sized,
        R: DeviceBufferMut<B> + ?Sized,
    {
        let (op, options) = (*op, CollectiveOptions::new());
        self.defer(Box::new(move |c| {
            c.reduce_with(send, recv, &op, root, &options)
        }))
    }

    /// Adds [`Comm::reduce_in_place`] (made at [`CommGroup::end`], in its place).
    pub fn reduce_in_place<R>(&mut self, buf: &'b mut R, op: &ReduceOp, root: usize) -> Result<()>
    where
        R: DeviceBufferMut<B> + ?Sized,
    {
        let (op, options) = (*op, CollectiveOptions::new());
        self.defer(Box::new(move |c| {
            c.reduce_in_place_with(buf, &op, root, &options)
        }))
    }

    /// Adds [`Comm::send`]: with the group's other sends and receives, one exchange, so
    /// that a rank may send to one peer and receive from another in any order (a ring
    /// shift) without waiting for itself. At most one send to each peer per exchange: a
    /// second starts another.
    pub fn send<S: DeviceBuffer<B>>(&mut self, data: &'b S, peer: usize) -> Result<()> {
        self.send_with(data, peer, &CollectiveOptions::new())
    }

    /// Adds [`Comm::send_with`] (see [`CommGroup::send`]).
    pub fn send_with<S: DeviceBuffer<B>>(
        &mut self,
        data: &'b S,
        peer: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let mut x = Exchange::default();
        self.comm.add_send(&mut x, data, peer, options)?;
        self.add_exchange(x)
    }

    /// Adds [`Comm::recv`] (see [`CommGroup::send`]).
    pub fn recv<R: DeviceBufferMut<B>>(&mut self, buf: &'b mut R, peer: usize) -> Result<()> {
        self.recv_with(buf, peer, &CollectiveOptions::new())
    }

    /// Adds [`Comm::recv_with`] (see [`CommGroup::send`]).
    pub fn recv_with<R: DeviceBufferMut<B>>(
        &mut self,
        buf: &'b mut R,
        peer: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        let mut x = Exchange::default();
        self.comm.add_recv(&mut x, buf, peer, options)?;
        self.add_exchange(x)
    }

    /// Adds [`Comm::all_to_all`] (with the group's sends and receives where they go to
    /// other peers).
    pub fn all_to_all<S, R>(&mut self, send: &'b S, recv: &'b mut R) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.all_to_all_with(send, recv, &CollectiveOptions::new())
    }

    /// Adds [`Comm::all_to_all_with`].
    pub fn all_to_all_with<S, R>(
        &mut self,
        send: &'b S,
        recv: &'b mut R,
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let counts = self.comm.equal_parts(send.len(), options)?;
        self.all_to_all_v_with(send, &counts, recv, &counts, options)
    }

    /// Adds [`Comm::all_to_all_v`].
    pub fn all_to_all_v<S, R>(
        &mut self,
        send: &'b S,
        send_counts: &[usize],
        recv: &'b mut R,
        recv_counts: &[usize],
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let options = CollectiveOptions::new();
        self.all_to_all_v_with(send, send_counts, recv, recv_counts, &options)
    }

    /// Adds [`Comm::all_to_all_v_with`].
    pub fn all_to_all_v_with<S, R>(
        &mut self,
        send: &'b S,
        send_counts: &[usize],
        recv: &'b mut R,
        recv_counts: &[usize],
        options: &CollectiveOptions,
    ) -> Result<()>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        let mut x = Exchange::default();
        let (sends, recvs) = ((send, send_counts), (recv, recv_counts));
        self.comm.add_all_to_all_v(&mut x, sends, recvs, options)?;
        self.add_exchange(x)
    }

    /// Joins `x` to the exchange the group ends with where its peers are free there.
    fn add_exchange(&mut self, x: Exchange<'b, B>) -> Result<()> {
        match self.calls.last_mut() {
            Some(Entry::Exchange(last, calls)) if last.can_take(&x) => {
                last.take(x);
                *calls += 1;
            }
            _ => self.calls.push(Entry::Exchange(x, 1)),
        }
        Ok(())
    }

    /// Keeps a collective other than the all-reduce, made at the end in its place.
    fn defer(&mut self, call: Deferred<'b, B>) -> Result<()> {
        self.comm.core.check_usable()?;
        self.calls.push(Entry::Other(call));
        Ok(())
    }

    /// Calls in the group so far.
    pub fn len(&self) -> usize {
        let calls = |e: &Entry<'b, B>| match e {
            Entry::Exchange(_, calls) => *calls,
            _ => 1,
        };
        self.calls.iter().map(calls).sum()
    }

    /// Whether no call was added yet.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Keeps a call once planning it alone succeeds: a typed error now, not at the end.
    fn add(
        &mut self,
        send: Option<&'b dyn DeviceBuffer<B>>,
        recv: &'b mut dyn DeviceBufferMut<B>,
        (dtype, elements): (crate::DType, usize),
        options: &AllReduceOptions,
    ) -> Result<()> {
        let call = GroupedCall {
            dtype,
            elements,
            options: *options,
            in_place: send.is_none(),
        };
        let reads = PeerReads::Payloads;
        (self.comm.core).plan_all_reduce(dtype, elements, options, call.in_place, reads)?;
        self.calls
            .push(Entry::AllReduce(Pending { send, recv, call }));
        Ok(())
    }

    /// Ends the group: launches its calls in order (the algorithm of each; one-stage for
    /// the collectives other than the all-reduce). An error once some were launched
    /// poisons the communicator, as a failed launch does.
    pub fn end(self) -> Result<Vec<Algorithm>> {
        let comm = self.comm;
        let mut algorithms = Vec::with_capacity(self.calls.len());
        let mut run = Vec::new();
        let mut entries = self.calls.into_iter();
        loop {
            let next = entries.next();
            let last = next.is_none();
            let outcome = match next {
                Some(Entry::AllReduce(p)) => {
                    run.push(p);
                    continue;
                }
                // The all-reduces before it launch first.
                Some(Entry::Other(call)) => end_all_reduces(comm, std::mem::take(&mut run))
                    .map(|a| algorithms.extend(a))
                    .and_then(|()| call(comm))
                    .map(|()| algorithms.push(Algorithm::OneStage)),
                Some(Entry::Exchange(x, calls)) => end_all_reduces(comm, std::mem::take(&mut run))
                    .map(|a| algorithms.extend(a))
                    .and_then(|()| comm.launch_exchange(x))
                    .map(|()| algorithms.extend(vec![Algorithm::OneStage; calls])),
                None => {
                    end_all_reduces(comm, std::mem::take(&mut run)).map(|a| algorithms.extend(a))
                }
            };
            if let Err(e) = outcome {
                if !algorithms.is_empty() {
                    comm.core.poison(&e);
                }
                return Err(e);
            }
            if last {
                return Ok(algorithms);
            }
        }
    }
}

/// Launches consecutive all-reduces of a group, batched where they can be.
fn end_all_reduces<B: Backend>(
    comm: &Comm<B>,
    mut pending: Vec<Pending<'_, B>>,
) -> Result<Vec<Algorithm>> {
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    let core = &*comm.core;
    let calls: Vec<GroupedCall> = pending.iter().map(|p| p.call).collect();
    let steps = core.plan_grouped(&calls, PeerReads::Payloads)?;
    let dev = core.device();
    let mut io = Vec::with_capacity(pending.len());
    let mut guards = Vec::with_capacity(2 * pending.len());
    for p in pending.iter_mut() {
        let input = p.send.map(|send| send.read_ptr(dev));
        let (output, out_access) = p.recv.write_ptr(dev);
        guards.push(out_access);
        let input = match input {
            Some((input, access)) => {
                guards.push(access);
                // Before anything is launched; sizes were checked with the call.
                let bytes = p.call.elements * p.call.dtype.size();
                let roles = [
                    (input, bytes, "input", false),
                    (output, bytes, "output", true),
                ];
                comm.check_overlaps(roles, true)?;
                input
            }
            None => output,
        };
        io.push((input, output));
    }
    run_group_steps(
        steps,
        calls.len(),
        |e| core.poison(e),
        |step| match step {
            GroupStep::Batch { first, plan } => {
                if plan.total_elements > 0 {
                    let entries: Vec<_> = io[first..first + plan.count]
                        .iter()
                        .map(|&(input, output)| (PeerInputs::Own(input), output))
                        .collect();
                    core.check_usable()?;
                    core.launch_group(&plan, &entries)?;
                }
                Ok(None)
            }
            GroupStep::Alone { index, routed } => {
                let c = &calls[index];
                let (input, output) = io[index];
                comm.run(
                    routed, input, &None, output, c.elements, c.dtype, &c.options,
                )
                .map(|a| Some((index, a)))
            }
        },
    )
}
