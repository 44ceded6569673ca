//! Capturing collectives into CUDA graphs without `unsafe` at the call site. cudarc's
//! per-use event records and waits would reach outside a capture, so event tracking is
//! off on every context involved (after synchronising each stream) and restored after,
//! also on failure or panic; a count per context keeps concurrent captures apart.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaContext, CudaGraph, CudaStream};

use super::{driver, driver_err};
use crate::error::{Error, Result};

/// Per context (by address): captures in progress, and whether tracking was on
/// before the first of them.
static PAUSED: Mutex<BTreeMap<usize, (usize, bool)>> = Mutex::new(BTreeMap::new());

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
        let mut map = PAUSED.lock().unwrap_or_else(|e| e.into_inner());
        for ctx in &contexts {
            let entry = map
                .entry(Arc::as_ptr(ctx) as usize)
                .or_insert((0, ctx.is_event_tracking()));
            if entry.0 == 0 {
                // SAFETY: every capturing stream was synchronised first (no tracked use
                // pending), work is only recorded into graphs meanwhile, tracking comes
                // back with the last capture here, and `capture` forbids allocating.
                unsafe { ctx.disable_event_tracking() };
            }
            entry.0 += 1;
        }
        TrackingPaused { contexts }
    }
}

impl Drop for TrackingPaused {
    fn drop(&mut self) {
        let mut map = PAUSED.lock().unwrap_or_else(|e| e.into_inner());
        for ctx in &self.contexts {
            let key = Arc::as_ptr(ctx) as usize;
            if let Some(entry) = map.get_mut(&key) {
                entry.0 -= 1;
                if entry.0 == 0 {
                    if entry.1 {
                        // SAFETY: `capture` forbids allocating, so no buffer stays untracked.
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

/// Captures what `f` enqueues on `streams` (relaxed mode) into one CUDA graph per
/// stream, in order, returned with `f`'s value; each replays on its own stream
/// (`CudaGraph::launch`). If `f` fails or panics the captures are discarded first.
///
/// Rules for `f`: enqueue only on these streams and allocate no buffers (they would
/// carry no cudarc events). A stream left empty is [`Error::Unsupported`]. Buffers must
/// outlive the graphs, as with any CUDA graph, and other threads must not use these
/// contexts' buffers on other streams meanwhile (event tracking is off).
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
            // Drivers end an empty capture with no graph or with one of no nodes.
            let empty = || {
                Error::Unsupported(format!(
                    "nothing was enqueued on stream {i} during the capture"
                ))
            };
            let graph = g?.ok_or_else(empty)?;
            let mut nodes = 0usize;
            // SAFETY: the graph is live; a null node array asks only for the count.
            let (g, none) = (graph.cu_graph(), std::ptr::null_mut());
            cu!(cuGraphGetNodes(g, none, &mut nodes))?;
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
