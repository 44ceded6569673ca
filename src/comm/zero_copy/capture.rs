//! Capturing a communicator's calls into CUDA graphs (the backend's [`capture`] over
//! every rank's stream, or this rank's), and [`Comm::capture_registered`], whose graph
//! reads every input in place.

use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaStream};

use crate::backend::cuda::{capture, Cuda};
use crate::error::{Error, Result};

use crate::comm::zero_copy::capture_inputs::CaptureInputs;
use crate::comm::zero_copy::script::Planning;
use crate::comm::{Comm, SingleController};

impl SingleController<Cuda> {
    /// Captures what `f` enqueues on every rank's stream into one CUDA graph per rank
    /// (rank order); see [`capture`] for the rules. Replay with `graph.launch()` for
    /// every graph, then [`SingleController::synchronize`] as after eager calls.
    ///
    /// ```no_run
    /// use peercomm::backend::{cuda::Cuda, Backend};
    /// use peercomm::{AllReduceOptions, CommConfig, ReduceOp, SingleController};
    ///
    /// let comm = SingleController::<Cuda>::new(&[0, 1], CommConfig::default())?;
    /// let ins: Vec<_> = comm.cores().iter().map(|r| Cuda::alloc_from(r.device(), &[1.0f32; 1024])).collect::<Result<_, _>>()?;
    /// let mut outs: Vec<_> = comm.cores().iter().map(|r| Cuda::alloc_buffer::<f32>(r.device(), 1024)).collect::<Result<_, _>>()?;
    /// let (graphs, _algorithm) =
    ///     comm.capture(|| comm.all_reduce_slices(&ins, &mut outs, &ReduceOp::Sum, &AllReduceOptions::new()))?;
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
            .cores()
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

/// A per-rank graph whose calls read the peers' inputs in place
/// ([`Comm::capture_registered`]), with the registrations it reads them through: they
/// end when it is dropped (the graph first), so it cannot be replayed without them.
pub struct RegisteredGraph {
    graph: CudaGraph,
    inputs: CaptureInputs<Cuda>,
}

impl RegisteredGraph {
    /// Replays the graph on the stream it was captured on (as `CudaGraph::launch`);
    /// every rank replays its own, then waits as after eager calls
    /// ([`Comm::synchronize`]).
    pub fn launch(&self) -> Result<()> {
        // A buffer a replay reads may not be freed before the next clean synchronize.
        self.inputs.note_replay();
        self.graph.launch().map_err(|e| Error::Backend {
            backend: "cuda",
            call: "cuGraphLaunch",
            detail: e.to_string(),
        })
    }
    /// The graph itself.
    pub fn graph(&self) -> &CudaGraph {
        &self.graph
    }
    /// What its calls read in place, and through how many registrations.
    pub fn inputs(&self) -> &CaptureInputs<Cuda> {
        &self.inputs
    }
}

impl std::fmt::Debug for RegisteredGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredGraph")
            .field("inputs", &self.inputs)
            .finish_non_exhaustive()
    }
}

impl Comm<Cuda> {
    /// Captures what `f` enqueues on this rank's stream into a graph whose calls read
    /// their inputs in place, registered or not (vLLM's `register_graph_buffers`).
    /// Collective, in the same order as the registrations and symmetric allocations.
    ///
    /// `f` is captured twice ([`Comm::register_inputs_of`] over [`Comm::capture`]): the
    /// first capture, planned as if in place and never launched, records the inputs to
    /// register; the second is kept. So `f` must capture the same calls on the same
    /// buffers each time ([`CaptureInputs::staged_calls`] counts those that did not).
    /// Across processes an input must be exportable (`cuMemAlloc`, not cudarc's pool),
    /// else [`Error::CannotRegister`] on every rank.
    pub fn capture_registered<R>(
        &self,
        mut f: impl FnMut() -> Result<R>,
    ) -> Result<(RegisteredGraph, R)> {
        let streams = [self.device().stream().clone()];
        // The first capture is planned as the second and dropped unlaunched.
        let planning = Planning::InPlace(self.rank());
        let ((mut graphs, value), inputs) =
            self.register_passes(|| capture(&streams, &mut f), planning)?;
        let graph = graphs.remove(0);
        Ok((RegisteredGraph { graph, inputs }, value))
    }
}
