//! The slice form of the single-controller all-reduce: the users' buffers as they hold
//! them (`&[CudaSlice<T>]`, one per rank), flat, with no heap allocation per call, for
//! a hot eager loop.

use crate::backend::{Backend, DeviceBuffer, DeviceBufferMut};
use crate::dispatch::Algorithm;
use crate::error::{Error, Result};
use crate::signal::MAX_GPUS;

use super::super::AllReduceOptions;
use super::validate::{meta_of as meta, Meta};
use super::SingleController;

impl<B: Backend> SingleController<B> {
    /// Sums `inputs[r]` over each group into `outputs[r]`: one buffer per rank, on
    /// that rank's device, all of one dtype and length (unequal lengths are
    /// [`Error::LengthMismatch`], as in the shaped form). Returns the algorithm that
    /// ran. The same checks and launches as [`SingleController::all_reduce_sum`] (overlapping
    /// buffers included), without building tensors.
    ///
    /// ```
    /// use peercomm::backend::{host::Host, Backend, TypedBuffer};
    /// use peercomm::{AllReduceOptions, CommConfig, SingleController};
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
    ///     comm.all_reduce_sum_slices(&ins, &mut outs, &opts)?; // no per-call Vec
    /// }
    /// comm.all_reduce_sum_slices_in_place(&mut ins, &opts)?;
    /// comm.synchronize()?;
    /// assert_eq!(outs[1].to_host(comm.core(1).device())?, vec![3.0; 5]);
    /// assert_eq!(ins[0].to_host(comm.core(0).device())?, vec![3.0; 5]);
    /// # Ok::<(), peercomm::Error>(())
    /// ```
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
        let first = self.check_slices(inputs, outputs)?;
        let mut in_ptrs = [0u64; MAX_GPUS];
        let mut out_ptrs = [0u64; MAX_GPUS];
        let mut in_guards: [Option<B::Access<'_>>; MAX_GPUS] = std::array::from_fn(|_| None);
        let mut out_guards: [Option<B::Access<'_>>; MAX_GPUS] = std::array::from_fn(|_| None);
        // As in the shaped form: each buffer is tracked on its own rank's stream.
        for (r, b) in inputs.iter().enumerate() {
            let (p, g) = b.read_ptr(self.ranks[r].device());
            in_ptrs[r] = p;
            in_guards[r] = Some(g);
        }
        for (r, b) in outputs.iter_mut().enumerate() {
            let (p, g) = b.write_ptr(self.ranks[r].device());
            out_ptrs[r] = p;
            out_guards[r] = Some(g);
        }
        let bytes = [first.len * first.dtype.size(); MAX_GPUS];
        let (dtype, len) = (first.dtype, first.len);
        let result = self.all_reduce_at(&in_ptrs, &out_ptrs, &bytes, dtype, len, options);
        drop((in_guards, out_guards));
        result
    }

    /// Sums `buffers[r]` over each group in place: the slice form of
    /// [`SingleController::all_reduce_sum_in_place`] (see
    /// [`SingleController::all_reduce_sum_slices`]).
    pub fn all_reduce_sum_slices_in_place<R>(
        &self,
        buffers: &mut [R],
        options: &AllReduceOptions,
    ) -> Result<Algorithm>
    where
        R: DeviceBufferMut<B>,
    {
        let first = self.check_slices_in_place(buffers)?;
        let routed = self.route_all_reduce(first.dtype, first.len, options, true)?;
        let mut ptrs = [0u64; MAX_GPUS];
        let mut guards: [Option<B::Access<'_>>; MAX_GPUS] = std::array::from_fn(|_| None);
        for (r, b) in buffers.iter_mut().enumerate() {
            let (p, g) = b.write_ptr(self.ranks[r].device());
            ptrs[r] = p;
            guards[r] = Some(g);
        }
        let bytes = [first.len * first.dtype.size(); MAX_GPUS];
        let result = self.all_reduce_in_place_at(routed, &ptrs, &bytes, first.dtype, first.len);
        drop(guards);
        result
    }

    /// One input and one output per rank, flat, of one dtype and length everywhere,
    /// each on its rank's device: rank 0's input.
    pub(super) fn check_slices<S, R>(&self, inputs: &[S], outputs: &[R]) -> Result<Meta>
    where
        S: DeviceBuffer<B>,
        R: DeviceBufferMut<B>,
    {
        self.check_usable()?;
        self.check_count(inputs.len())?;
        self.check_count(outputs.len())?;
        let first = meta::<B>(&inputs[0]);
        for (r, (i, o)) in inputs.iter().zip(outputs.iter()).enumerate() {
            let (im, om) = (meta::<B>(i), meta::<B>(o));
            self.check_flat(r, &im, &first, "input")?;
            self.check_tensor(r, &om, &[om.len], "output")?;
            self.ranks[r].check_all_reduce(&im, &om)?;
        }
        Ok(first)
    }

    /// One buffer per rank, flat, of one dtype and length everywhere: rank 0's.
    pub(super) fn check_slices_in_place<R: DeviceBufferMut<B>>(
        &self,
        buffers: &[R],
    ) -> Result<Meta> {
        self.check_usable()?;
        self.check_count(buffers.len())?;
        let first = meta::<B>(&buffers[0]);
        for (r, b) in buffers.iter().enumerate() {
            self.check_flat(r, &meta::<B>(b), &first, "in-place")?;
        }
        Ok(first)
    }

    fn check_flat(&self, r: usize, m: &Meta, first: &Meta, which: &'static str) -> Result<()> {
        self.check_tensor(r, m, &[m.len], which)?;
        if m.dtype != first.dtype {
            return Err(Error::DTypeMismatch {
                rank: r,
                expected: first.dtype,
                got: m.dtype,
            });
        }
        if m.len != first.len {
            return Err(Error::LengthMismatch {
                rank: r,
                what: format!("{which} has {} elements but rank 0's {}", m.len, first.len),
            });
        }
        Ok(())
    }
}
