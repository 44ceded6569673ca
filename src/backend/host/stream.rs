//! Host streams: one worker thread running enqueued jobs in order, and [`FreeOnStream`],
//! which drops a value in stream order (as `cuMemFreeAsync` frees).

use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// A stream: one worker thread running enqueued jobs in order.
pub(super) struct Stream {
    /// `Some` until dropped; closing it ends the worker once its queue is drained.
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl Stream {
    pub(super) fn new(ordinal: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let worker = std::thread::Builder::new()
            .name(format!("peercomm-host-stream-{ordinal}"))
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("spawn host stream thread");
        Stream {
            tx: Some(tx),
            worker: Some(worker),
        }
    }

    pub(super) fn enqueue(&self, job: Job) {
        self.tx
            .as_ref()
            .expect("stream open")
            .send(job)
            .expect("stream worker alive");
    }

    pub(super) fn synchronize(&self) {
        let (done_tx, done_rx) = mpsc::channel::<()>();
        self.enqueue(Box::new(move || {
            let _ = done_tx.send(());
        }));
        done_rx.recv().expect("stream worker alive");
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Owns a `T` whose drop is enqueued on a stream, after the work enqueued before it.
pub(super) struct FreeOnStream<T: Send + 'static> {
    /// `Some` until dropped.
    value: Option<T>,
    stream: Arc<Stream>,
}

impl<T: Send + 'static> FreeOnStream<T> {
    pub(super) fn new(value: T, stream: &Arc<Stream>) -> Self {
        FreeOnStream {
            value: Some(value),
            stream: stream.clone(),
        }
    }
    pub(super) fn get(&self) -> &T {
        self.value.as_ref().expect("present until dropped")
    }
}

impl<T: Send + 'static> Drop for FreeOnStream<T> {
    fn drop(&mut self) {
        if let Some(value) = self.value.take() {
            self.stream.enqueue(Box::new(move || drop(value)));
        }
    }
}
