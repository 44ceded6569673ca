//! Capturing collectives into CUDA graphs without `unsafe` at the call site: the
//! capture over a set of streams ([`capture`]), which knows nothing of communicators
//! (their `capture` methods, over their ranks' streams, are built on it in the
//! communicator module).
//!
//! cudarc records an event on every use of a buffer while its context tracks events
//! (the default), and waits for the events of earlier uses; in a capturing stream those
//! waits and records would reach outside the capture. So the event tracking of every
//! context involved is turned off for the capture (`CudaContext::disable_event_tracking`,
//! an `unsafe` call), after every stream has been synchronised, and turned back on
//! afterwards, also when the closure fails or panics. A process-wide count per context
//! keeps concurrent captures (ranks on threads that share a GPU) from turning it back
//! on under each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    self, CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus,
};
use cudarc::driver::{CudaContext, CudaGraph, CudaStream};

use super::{driver, driver_err};
use crate::error::{Error, Result};

/// Per context (by address): captures in progress, and whether tracking was on
/// before the first of them.
static PAUSED: Mutex<Option<HashMap<usize, (usize, bool)>>> = Mutex::new(None);

/// Event tracking turned off on some contexts for as long as this lives.
struct TrackingPaused {
    contexts: Vec<Arc<CudaContext>>,
}

impl TrackingPaused {
    fn new(streams: &[Arc<CudaStream>]) -> Self {
        let mut contexts: Vec<Arc<CudaContext>> = Vec::new();
        for s in streams {
            if !contexts.iter().any(|c| Arc::ptr_eq(c, s.context())) {
                contexts.push(s.context().clone());
            }
        }
        let mut paused = PAUSED.lock().unwrap_or_else(|e| e.into_inner());
        let map = paused.get_or_insert_with(HashMap::new);
        for ctx in &contexts {
            let entry = map
                .entry(Arc::as_ptr(ctx) as usize)
                .or_insert((0, ctx.is_event_tracking()));
            if entry.0 == 0 {
                // SAFETY: cudarc's conditions concern buffers used while tracking is off.
                // The caller synchronised every capturing stream first, so no tracked
                // use is pending; while tracking is off, work on these streams is only
                // recorded into graphs, not run; tracking comes back on (if it was on)
                // when the last capture on this context ends. Buffers allocated inside
                // the closure carry no events: the capture docs forbid allocating there.
                unsafe { ctx.disable_event_tracking() };
            }
            entry.0 += 1;
        }
        TrackingPaused { contexts }
    }
}

impl Drop for TrackingPaused {
    fn drop(&mut self) {
        let mut paused = PAUSED.lock().unwrap_or_else(|e| e.into_inner());
        let Some(map) = paused.as_mut() else { return };
        for ctx in &self.contexts {
            let key = Arc::as_ptr(ctx) as usize;
            if let Some(entry) = map.get_mut(&key) {
                entry.0 -= 1;
                if entry.0 == 0 {
                    if entry.1 {
                        // SAFETY: buffers made while tracking was off stay untracked
                        // (cudarc's condition); none were made by this module, and the
                        // capture docs forbid allocating in the closure.
                        unsafe { ctx.enable_event_tracking() };
                    }
                    map.remove(&key);
                }
            }
        }
    }
}

/// Streams in capture mode; ends (and discards) every capture still open on drop, so
/// a failing or panicking closure leaves no stream capturing.
struct Capturing<'a> {
    streams: &'a [Arc<CudaStream>],
    begun: usize,
}

impl Capturing<'_> {
    fn end_all(&mut self) -> Vec<Result<Option<CudaGraph>>> {
        let begun = std::mem::take(&mut self.begun);
        self.streams[..begun]
            .iter()
            .map(|s| {
                s.end_capture(CUgraphInstantiate_flags(0))
                    .map_err(driver_err("cuStreamEndCapture"))
            })
            .collect()
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        drop(self.end_all());
    }
}

/// Captures what `f` enqueues on `streams` into one CUDA graph per stream (in the
/// streams' order), and returns the graphs with `f`'s value. Each graph replays on its
/// own stream (`CudaGraph::launch`). The bookkeeping is done here: every stream is
/// synchronised first, cudarc's event tracking is off on their contexts during the
/// capture (relaxed mode) and restored afterwards, and when `f` fails or panics the
/// captures are ended and discarded before the error (or the panic) goes on.
///
/// Rules for `f`: enqueue work only on these streams (peercomm's collectives on a
/// communicator over them, cudarc copies and kernels on them), and do not allocate
/// buffers in it (they would carry no cudarc events). A stream on which `f` enqueued
/// nothing is an error ([`Error::Unsupported`]). Buffers a graph uses must outlive
/// it, and stay in use on the streams the graphs replay on (or be synchronised
/// explicitly), as with any CUDA graph. While a capture runs, other threads must not
/// use buffers of these contexts on other streams (the event tracking they would rely
/// on is off).
pub fn capture<R>(
    streams: &[Arc<CudaStream>],
    f: impl FnOnce() -> Result<R>,
) -> Result<(Vec<CudaGraph>, R)> {
    driver()?;
    for s in streams {
        s.synchronize().map_err(driver_err("cuStreamSynchronize"))?;
    }
    let _tracking = TrackingPaused::new(streams);
    let mut capturing = Capturing { streams, begun: 0 };
    for s in streams {
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver_err("cuStreamBeginCapture"))?;
        capturing.begun += 1;
    }
    let value = f();
    let ended = capturing.end_all();
    let value = value?;
    let graphs = ended
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            // Drivers differ: some end an empty capture with no graph, others with a
            // graph of no nodes. Both are the same error here.
            let empty = || {
                Error::Unsupported(format!(
                    "nothing was enqueued on stream {i} during the capture"
                ))
            };
            let graph = g?.ok_or_else(empty)?;
            let mut nodes = 0usize;
            // SAFETY: the graph is live (owned by `graph`); a null node array asks only
            // for the count.
            unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) }
                .result()
                .map_err(driver_err("cuGraphGetNodes"))?;
            if nodes == 0 {
                return Err(empty());
            }
            Ok(graph)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((graphs, value))
}

/// Whether `stream` is capturing now (for tests: a capture must never be left open).
pub fn is_capturing(stream: &CudaStream) -> Result<bool> {
    stream
        .capture_status()
        .map(|s| s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        .map_err(driver_err("cuStreamIsCapturing"))
}
