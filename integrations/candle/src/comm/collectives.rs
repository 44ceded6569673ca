//! [`CandleComm`]'s collectives on tensors: all-reduce (every [`ReduceOp`]),
//! all-gather, reduce-scatter, broadcast and all-to-all (equal parts, or a row count per
//! rank), each allocating its result, into a tensor the caller allocated, or
//! (all-reduce, broadcast) in place.
//!
//! Along dim 0: an all-gather's result has the input's shape with dim 0 multiplied by
//! the group width, rank q's rows at `[q * rows, (q + 1) * rows)`; a reduce-scatter's has
//! dim 0 divided by the width, group rank q receiving the reduced rows
//! `[q * part, (q + 1) * part)`.

use candle_core::Tensor;
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, ReduceOp};

use super::launch::Call;
use super::{algorithm, CandleComm};
use crate::error::Result;

impl CandleComm {
    /// `input` reduced with `op` over the ranks, as a new tensor of its shape and dtype
    /// (allocated on this rank's stream: not inside a CUDA graph capture, where
    /// [`CandleComm::all_reduce_into`] takes a preallocated output). Returns once
    /// enqueued; later candle work on the result is ordered after it.
    pub fn all_reduce(&self, input: &Tensor, op: &ReduceOp) -> Result<Tensor> {
        self.all_reduce_with(input, op, &AllReduceOptions::new())
    }

    /// As [`CandleComm::all_reduce`], with options (group size, algorithm, blocks).
    pub fn all_reduce_with(
        &self,
        input: &Tensor,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Tensor> {
        self.run_alloc(Call::AllReduce(*op, options), input)
    }

    /// `input` reduced with `op` over the ranks into `output`, a tensor of the same
    /// shape and dtype that the caller allocated (for example before a CUDA graph
    /// capture): allocates nothing. Passing the same tensor twice runs in place; an
    /// output that shares the input's storage otherwise is
    /// [`Error::OutputAliasesInput`](crate::Error::OutputAliasesInput). Returns the
    /// algorithm that runs.
    pub fn all_reduce_into(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: &ReduceOp,
    ) -> Result<Algorithm> {
        self.all_reduce_into_with(input, output, op, &AllReduceOptions::new())
    }

    /// As [`CandleComm::all_reduce_into`], with options.
    pub fn all_reduce_into_with(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let call = Call::AllReduce(*op, options);
        Ok(algorithm(self.run_into(call, input, output)?))
    }

    /// Reduces `tensor` with `op` over the ranks in place: its storage is overwritten
    /// (every tensor sharing that storage sees the result); allocates nothing. Returns
    /// the algorithm that runs.
    pub fn all_reduce_in_place(&self, tensor: &Tensor, op: &ReduceOp) -> Result<Algorithm> {
        self.all_reduce_in_place_with(tensor, op, &AllReduceOptions::new())
    }

    /// As [`CandleComm::all_reduce_in_place`], with options.
    pub fn all_reduce_in_place_with(
        &self,
        tensor: &Tensor,
        op: &ReduceOp,
        options: &AllReduceOptions,
    ) -> Result<Algorithm> {
        let call = Call::AllReduce(*op, options);
        Ok(algorithm(self.run_in_place(call, tensor)?))
    }

    /// Every rank's `input` stacked along dim 0 in rank order, as a new tensor (dim 0
    /// multiplied by the world size; allocated on this rank's stream). Every rank passes
    /// the same shape. A scalar is [`Error::Scalar`](crate::Error::Scalar).
    pub fn all_gather(&self, input: &Tensor) -> Result<Tensor> {
        self.all_gather_with(input, &CollectiveOptions::new())
    }

    /// As [`CandleComm::all_gather`], over the groups of the options (dim 0 multiplied
    /// by the group width, the members' rows in group-rank order).
    pub fn all_gather_with(&self, input: &Tensor, options: &CollectiveOptions) -> Result<Tensor> {
        self.run_alloc(Call::AllGather(options), input)
    }

    /// As [`CandleComm::all_gather`], into `output`, which the caller allocated with the
    /// gathered shape ([`Error::ShapeMismatch`](crate::Error::ShapeMismatch) otherwise):
    /// allocates nothing.
    pub fn all_gather_into(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.all_gather_into_with(input, output, &CollectiveOptions::new())
    }

    /// As [`CandleComm::all_gather_into`], over the groups of the options.
    pub fn all_gather_into_with(
        &self,
        input: &Tensor,
        output: &Tensor,
        options: &CollectiveOptions,
    ) -> Result<()> {
        self.run_into(Call::AllGather(options), input, output)
            .map(drop)
    }

    /// `input` reduced with `op` over the ranks, split along dim 0 into one part per
    /// rank: rank q receives part q (dim 0 divided by the world size), as a new tensor
    /// (allocated on this rank's stream). A dim 0 that the world size does not divide is
    /// [`Error::NotDivisible`](crate::Error::NotDivisible), a scalar
    /// [`Error::Scalar`](crate::Error::Scalar), before anything is launched.
    pub fn reduce_scatter(&self, input: &Tensor, op: &ReduceOp) -> Result<Tensor> {
        self.reduce_scatter_with(input, op, &CollectiveOptions::new())
    }

    /// As [`CandleComm::reduce_scatter`], over the groups of the options (dim 0 divided
    /// by the group width, part q to group rank q).
    pub fn reduce_scatter_with(
        &self,
        input: &Tensor,
        op: &ReduceOp,
        options: &CollectiveOptions,
    ) -> Result<Tensor> {
        self.run_alloc(Call::ReduceScatter(*op, options), input)
    }

    /// As [`CandleComm::reduce_scatter`], into `output`, which the caller allocated with
    /// the part's shape: allocates nothing.
    pub fn reduce_scatter_into(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: &ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_into_with(input, output, op, &CollectiveOptions::new())
    }

    /// As [`CandleComm::reduce_scatter_into`], over the groups of the options.
    pub fn reduce_scatter_into_with(
        &self,
        input: &Tensor,
        output: &Tensor,
        op: &ReduceOp,
        options: &CollectiveOptions,
    ) -> Result<()> {
        self.run_into(Call::ReduceScatter(*op, options), input, output)
            .map(drop)
    }

    /// Rank `root`'s `input` on every rank, as a new tensor (allocated on this rank's
    /// stream). Every rank passes a tensor of the message's shape and dtype; only the
    /// root's elements are read.
    pub fn broadcast(&self, input: &Tensor, root: usize) -> Result<Tensor> {
        self.broadcast_with(input, root, &CollectiveOptions::new())
    }

    /// As [`CandleComm::broadcast`], over the groups of the options (`root` is a group
    /// rank).
    pub fn broadcast_with(
        &self,
        input: &Tensor,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<Tensor> {
        self.run_alloc(Call::Broadcast(root, options), input)
    }

    /// As [`CandleComm::broadcast`], into `output` (the input's shape and dtype), which
    /// the caller allocated: allocates nothing. The same tensor twice runs in place.
    pub fn broadcast_into(&self, input: &Tensor, output: &Tensor, root: usize) -> Result<()> {
        self.broadcast_into_with(input, output, root, &CollectiveOptions::new())
    }

    /// As [`CandleComm::broadcast_into`], over the groups of the options.
    pub fn broadcast_into_with(
        &self,
        input: &Tensor,
        output: &Tensor,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        self.run_into(Call::Broadcast(root, options), input, output)
            .map(drop)
    }

    /// Broadcast in place: the root's `tensor` is the message, every other rank's is
    /// overwritten with it (its storage: every tensor sharing it sees the message).
    pub fn broadcast_in_place(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.broadcast_in_place_with(tensor, root, &CollectiveOptions::new())
    }

    /// As [`CandleComm::broadcast_in_place`], over the groups of the options.
    pub fn broadcast_in_place_with(
        &self,
        tensor: &Tensor,
        root: usize,
        options: &CollectiveOptions,
    ) -> Result<()> {
        self.run_in_place(Call::Broadcast(root, options), tensor)
            .map(drop)
    }

    /// All-to-all along dim 0 (expert parallelism): `input`'s dim 0 in world-size equal
    /// parts, part q sent to rank q; the result (the input's shape, allocated on this
    /// rank's stream) holds rank q's part for this rank at part q. A dim 0 that the world
    /// size does not divide is [`Error::NotDivisible`](crate::Error::NotDivisible).
    pub fn all_to_all(&self, input: &Tensor) -> Result<Tensor> {
        self.run_alloc(Call::AllToAll, input)
    }

    /// As [`CandleComm::all_to_all`], into `output` (the input's shape), which the caller
    /// allocated: allocates nothing.
    pub fn all_to_all_into(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.run_into(Call::AllToAll, input, output).map(drop)
    }

    /// All-to-all with a row count per rank (a mixture-of-experts dispatch or combine,
    /// the router's counts): `send_rows[q]` rows of `input` go to rank q, taken in rank
    /// order (they add up to its dim 0, else
    /// [`Error::RowCounts`](crate::Error::RowCounts)); `recv_rows[q]` rows come from rank
    /// q, stacked in rank order in the result (dim 0 their sum, the other dims the
    /// input's). Rank q's `send_rows[r]` must equal rank r's `recv_rows[q]`.
    pub fn all_to_all_v(
        &self,
        input: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        let row = input.dims().iter().skip(1).product();
        let call = Call::AllToAllV {
            send: send_rows,
            recv: recv_rows,
            row,
        };
        self.run_alloc(call, input)
    }

    /// As [`CandleComm::all_to_all_v`], into `output` (dim 0 the sum of `recv_rows`),
    /// which the caller allocated: allocates nothing.
    pub fn all_to_all_v_into(
        &self,
        input: &Tensor,
        output: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<()> {
        let row = input.dims().iter().skip(1).product();
        let call = Call::AllToAllV {
            send: send_rows,
            recv: recv_rows,
            row,
        };
        self.run_into(call, input, output).map(drop)
    }
}
