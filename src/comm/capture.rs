//! Capturing a communicator's calls into CUDA graphs: [`Communicator::capture`] over
//! every rank's stream, [`Comm::capture`] over this rank's, both built on the
//! backend's capture over a set of streams ([`capture`], which knows nothing of
//! communicators).

use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaStream};

use crate::backend::cuda::{capture, Cuda};
use crate::error::Result;

use super::{Comm, Communicator};

impl Communicator<Cuda> {
    /// Captures what `f` enqueues on every rank's stream into one CUDA graph per rank
    /// (rank order); see [`capture`] for the rules. Replay with `graph.launch()` for
    /// every graph, then [`Communicator::synchronize`] as after eager calls.
    ///
    /// ```no_run
    /// use peercomm::backend::{cuda::Cuda, Backend};
    /// use peercomm::{AllReduceOptions, CommConfig, Communicator};
    ///
    /// let comm = Communicator::<Cuda>::new(&[0, 1], CommConfig::default())?;
    /// let ins: Vec<_> = comm.ranks().iter().map(|r| Cuda::alloc_from(r.device(), &[1.0f32; 1024])).collect::<Result<_, _>>()?;
    /// let mut outs: Vec<_> = comm.ranks().iter().map(|r| Cuda::alloc_buffer::<f32>(r.device(), 1024)).collect::<Result<_, _>>()?;
    /// let (graphs, _algorithm) =
    ///     comm.capture(|| comm.all_reduce_sum_slices(&ins, &mut outs, &AllReduceOptions::new()))?;
    /// for _ in 0..100 {
    ///     for g in &graphs {
    ///         g.launch().map_err(|e| peercomm::Error::Unsupported(e.to_string()))?;
    ///     }
    /// }
    /// comm.synchronize()?;
    /// # Ok::<(), peercomm::Error>(())
    /// ```
    pub fn capture<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<(Vec<CudaGraph>, R)> {
        let streams: Vec<Arc<CudaStream>> = self
            .ranks()
            .iter()
            .map(|r| r.device().stream().clone())
            .collect();
        capture(&streams, f)
    }
}

impl Comm<Cuda> {
    /// Captures what `f` enqueues on this rank's stream into one CUDA graph; see
    /// [`capture`] for the rules. Every rank captures its own calls, in the same order.
    pub fn capture<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<(CudaGraph, R)> {
        let streams = [self.device().stream().clone()];
        let (mut graphs, value) = capture(&streams, f)?;
        Ok((graphs.remove(0), value))
    }
}
