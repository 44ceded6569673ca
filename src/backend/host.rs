//! The host reference backend: each "device" is a memory arena with a stream thread,
//! each block of a kernel an OS thread, and the kernels are Rust ports of the device
//! code spinning on real atomics over the same signal layout. It makes the protocol
//! testable on any machine and is what CI runs.
//!
//! Addresses are plain process addresses, so every arena is reachable from every
//! other: peer access is always available and `map_peer` is the identity.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::{Backend, DeviceBuffer, DeviceBufferMut, Kernel, LaunchDims, MemoryKind};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::signal::{AllReduceArgs, MAX_GPUS};

mod kernels;

/// The host reference backend (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Host;

type Job = Box<dyn FnOnce() + Send>;

/// A stream: one worker thread running enqueued jobs in order.
struct Stream {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Stream {
    fn new(ordinal: usize) -> Self {
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
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        }
    }

    fn enqueue(&self, job: Job) {
        let tx = self.tx.lock().expect("stream lock");
        tx.as_ref()
            .expect("stream open")
            .send(job)
            .expect("stream worker alive");
    }

    fn synchronize(&self) {
        let (done_tx, done_rx) = mpsc::channel::<()>();
        self.enqueue(Box::new(move || {
            let _ = done_tx.send(());
        }));
        done_rx.recv().expect("stream worker alive");
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Closing the channel ends the worker once its queue is drained.
        self.tx.lock().expect("stream lock").take();
        if let Some(w) = self.worker.lock().expect("stream lock").take() {
            let _ = w.join();
        }
    }
}

/// One simulated device: an ordinal and its stream.
pub struct HostDevice {
    ordinal: usize,
    stream: Arc<Stream>,
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl HostDevice {
    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

/// An allocation in a host arena, 256-byte aligned and zero-filled. Freed in stream
/// order, as `cuMemFreeAsync` does: dropping it enqueues the free on its device's
/// stream, after every kernel already enqueued there (whose barriers span the peers'
/// reads of it), so a buffer dropped right after a collective returns stays valid until
/// that collective is done.
pub struct HostMemory {
    ptr: NonNull<u8>,
    layout: Layout,
    ordinal: usize,
    stream: Arc<Stream>,
}

// SAFETY: the allocation is owned by this value and only reached through raw
// addresses by kernels whose synchronisation is the protocol under test.
unsafe impl Send for HostMemory {}
// SAFETY: as above; `&HostMemory` exposes no interior access of its own.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn new(dev: &HostDevice, bytes: usize) -> Result<Self> {
        let layout = Layout::from_size_align(bytes.max(1), 256).map_err(|_| Error::Backend {
            backend: "host",
            call: "alloc",
            detail: format!("{bytes} bytes is more than an allocation can hold"),
        })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| Error::Backend {
            backend: "host",
            call: "alloc",
            detail: format!("out of memory allocating {bytes} bytes"),
        })?;
        Ok(HostMemory {
            ptr,
            layout,
            ordinal: dev.ordinal,
            stream: dev.stream.clone(),
        })
    }
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        let (addr, layout) = (self.ptr.as_ptr() as usize, self.layout);
        self.stream.enqueue(Box::new(move || {
            // SAFETY: allocated in `new` with this layout, freed once, after every
            // kernel enqueued before the drop.
            unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
        }));
    }
}

/// A typed buffer on a host device.
pub struct HostBuffer<T: Element> {
    mem: HostMemory,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBuffer<Host> for HostBuffer<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_ordinal(&self) -> usize {
        self.mem.ordinal
    }
    fn read_ptr<'a>(&'a self, _dev: &'a HostDevice) -> (u64, ()) {
        (self.mem.addr(), ())
    }
}

// SAFETY: the pointer, length, dtype and device come from the allocation itself.

unsafe impl<T: Element> DeviceBufferMut<Host> for HostBuffer<T> {
    fn write_ptr<'a>(&'a mut self, _dev: &'a HostDevice) -> (u64, ()) {
        (self.mem.addr(), ())
    }
}

impl Backend for Host {
    const NAME: &'static str = "host";
    type Device = HostDevice;
    type Memory = HostMemory;
    type Access<'a> = ();
    type Buffer<T: Element> = HostBuffer<T>;
    type PeerMapping = ();

    fn device_count() -> Result<usize> {
        Ok(MAX_GPUS)
    }

    fn open(ordinal: usize) -> Result<HostDevice> {
        if ordinal >= MAX_GPUS {
            return Err(Error::InvalidDevices(format!(
                "host device {ordinal} does not exist (the host backend has {MAX_GPUS})"
            )));
        }
        Ok(HostDevice {
            ordinal,
            stream: Arc::new(Stream::new(ordinal)),
        })
    }

    fn ordinal(dev: &HostDevice) -> usize {
        dev.ordinal
    }

    fn multiprocessor_count(_dev: &HostDevice) -> Result<usize> {
        Ok(std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1))
    }

    fn architecture(_dev: &HostDevice) -> Result<String> {
        Ok("host".to_string())
    }

    fn can_access_peer(_dev: &HostDevice, _peer: &HostDevice) -> Result<bool> {
        Ok(true)
    }

    fn enable_peer_access(_dev: &HostDevice, _peer: &HostDevice) -> Result<()> {
        Ok(())
    }

    fn alloc(dev: &HostDevice, bytes: usize, _kind: MemoryKind) -> Result<HostMemory> {
        HostMemory::new(dev, bytes)
    }

    fn memory_ptr(mem: &HostMemory) -> u64 {
        mem.addr()
    }

    fn map_peer(_dev: &HostDevice, peer_mem: &HostMemory) -> Result<u64> {
        Ok(peer_mem.addr())
    }

    fn export_memory(_dev: &HostDevice, _mem: &HostMemory) -> Result<Vec<u8>> {
        Err(Error::Unsupported(
            "host: IPC export is not implemented yet".into(),
        ))
    }

    fn import_memory(_dev: &HostDevice, _handle: &[u8]) -> Result<()> {
        Err(Error::Unsupported(
            "host: IPC import is not implemented yet".into(),
        ))
    }

    fn mapping_ptr(_mapping: &()) -> u64 {
        0
    }

    fn memset_d32(dev: &HostDevice, ptr: u64, value: u32, words: usize) -> Result<()> {
        dev.stream.enqueue(Box::new(move || {
            let p = ptr as *mut u32;
            for i in 0..words {
                // SAFETY: the caller passes a range inside one of its allocations;
                // the stream orders this after earlier work on the device.
                unsafe { p.add(i).write_volatile(value) };
            }
        }));
        Ok(())
    }

    fn read(dev: &HostDevice, ptr: u64, dst: &mut [u8]) -> Result<()> {
        dev.stream.synchronize();
        // SAFETY: the caller passes a range inside one of its allocations and the
        // stream is idle.
        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn launch(
        dev: &HostDevice,
        kernel: Kernel,
        dims: LaunchDims,
        args: &AllReduceArgs,
    ) -> Result<()> {
        let args = *args;
        dev.stream.enqueue(Box::new(move || {
            std::thread::scope(|s| {
                for block in 0..dims.blocks {
                    let args = &args;
                    std::thread::Builder::new()
                        .name(format!("peercomm-host-block-{block}"))
                        .spawn_scoped(s, move || {
                            // SAFETY: the communicator built `args` from live
                            // allocations of the same layout the kernels expect.
                            unsafe { kernels::run_block(kernel, args, block, dims.blocks) }
                        })
                        .expect("spawn host block thread");
                }
            });
        }));
        Ok(())
    }

    fn synchronize(dev: &HostDevice) -> Result<()> {
        dev.stream.synchronize();
        Ok(())
    }

    fn alloc_buffer<T: Element>(dev: &HostDevice, len: usize) -> Result<HostBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Backend {
                backend: "host",
                call: "alloc",
                detail: format!(
                    "{len} elements of {:?} overflow the address space",
                    T::DTYPE
                ),
            })?;
        Ok(HostBuffer {
            mem: HostMemory::new(dev, bytes)?,
            len,
            _t: std::marker::PhantomData,
        })
    }

    fn upload<T: Element>(dev: &HostDevice, src: &[T], dst: &mut HostBuffer<T>) -> Result<()> {
        if src.len() != dst.len {
            return Err(Error::LengthMismatch {
                rank: dev.ordinal,
                what: format!(
                    "upload of {} elements into a buffer of {}",
                    src.len(),
                    dst.len
                ),
            });
        }
        dev.stream.synchronize();
        // SAFETY: dst holds `len` elements of T and the stream is idle.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.mem.ptr.as_ptr() as *mut T, src.len())
        };
        Ok(())
    }

    fn download<T: Element>(dev: &HostDevice, src: &HostBuffer<T>) -> Result<Vec<T>> {
        dev.stream.synchronize();
        let mut out = vec![T::default(); src.len];
        // SAFETY: src holds `len` elements of T and the stream is idle.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.mem.ptr.as_ptr() as *const T,
                out.as_mut_ptr(),
                src.len,
            )
        };
        Ok(out)
    }
}
