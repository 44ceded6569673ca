//! "NCCL symmetric": NCCL 2.27+'s kernels for buffers registered as symmetric windows
//! (`ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC` on memory from
//! `ncclMemAlloc`), the strongest NCCL at small sizes. cudarc binds these calls in its
//! `nccl::sys` module but its safe `Comm` hides the raw communicator, so this file
//! keeps its own communicators (one per GPU, `ncclCommInitAll`). If the loaded NCCL
//! refuses any step, the column is skipped with the reason printed.

use std::ffi::c_void;
use std::ptr::null_mut;

use cudarc::nccl::sys;
use cudarc::nccl::NcclType;

use super::gpu::{capture, time_batches, with_tracking, Gpu};
use super::*;

/// `NCCL_WIN_COLL_SYMMETRIC` from nccl.h.
const WIN_COLL_SYMMETRIC: i32 = 0x01;

/// One symmetric buffer pair per rank, registered with its communicator.
struct Rank {
    comm: sys::ncclComm_t,
    send: *mut c_void,
    recv: *mut c_void,
    windows: [sys::ncclWindow_t; 2],
}

/// NCCL communicators over the whole world with registered send and receive windows
/// of `bytes` each.
pub struct Symmetric {
    ranks: Vec<Rank>,
    bytes: usize,
}

fn check(what: &str, r: sys::ncclResult_t) -> Result<(), String> {
    r.result().map(|_| ()).map_err(|e| format!("{what}: {e:?}"))
}

impl Symmetric {
    /// Communicators on every GPU of `gpu` and windows of `bytes`, or why not.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<Self, String> {
        let world = gpu.streams.len();
        let devices: Vec<i32> = gpu
            .streams
            .iter()
            .map(|s| s.context().ordinal() as i32)
            .collect();
        let mut comms = vec![null_mut(); world];
        // SAFETY: `comms` has room for `world` handles and `devices` lists `world`
        // distinct ordinals.
        check("ncclCommInitAll", unsafe {
            sys::ncclCommInitAll(comms.as_mut_ptr(), world as i32, devices.as_ptr())
        })?;
        let mut ranks = Vec::new();
        for (r, &comm) in comms.iter().enumerate() {
            gpu.streams[r]
                .context()
                .bind_to_thread()
                .map_err(|e| e.to_string())?;
            let (mut send, mut recv) = (null_mut(), null_mut());
            // SAFETY: out-pointers to locals; NCCL allocates on the current device.
            check("ncclMemAlloc", unsafe {
                sys::ncclMemAlloc(&mut send, bytes)
            })?;
            check("ncclMemAlloc", unsafe {
                sys::ncclMemAlloc(&mut recv, bytes)
            })?;
            ranks.push(Rank {
                comm,
                send,
                recv,
                windows: [null_mut(); 2],
            });
        }
        // Registration is collective: every rank registers inside one group.
        // SAFETY: each rank's comm and buffers are live; the windows are out-pointers.
        unsafe {
            check("ncclGroupStart", sys::ncclGroupStart())?;
            for rank in ranks.iter_mut() {
                let [w0, w1] = &mut rank.windows;
                check(
                    "ncclCommWindowRegister",
                    sys::ncclCommWindowRegister(
                        rank.comm,
                        rank.send,
                        bytes,
                        w0,
                        WIN_COLL_SYMMETRIC,
                    ),
                )?;
                check(
                    "ncclCommWindowRegister",
                    sys::ncclCommWindowRegister(
                        rank.comm,
                        rank.recv,
                        bytes,
                        w1,
                        WIN_COLL_SYMMETRIC,
                    ),
                )?;
            }
            check("ncclGroupEnd", sys::ncclGroupEnd())?;
        }
        Ok(Self { ranks, bytes })
    }

    /// Enqueues one all-reduce of `n` elements of `T` over the windows.
    fn all_reduce<T: NcclType>(&self, gpu: &Gpu, n: usize) {
        assert!(n * std::mem::size_of::<T>() <= self.bytes);
        // SAFETY: the windows hold `self.bytes` each; every rank's call is in one group
        // on its own stream.
        unsafe {
            check("ncclGroupStart", sys::ncclGroupStart()).unwrap();
            for (r, rank) in self.ranks.iter().enumerate() {
                check(
                    "ncclAllReduce",
                    sys::ncclAllReduce(
                        rank.send,
                        rank.recv,
                        n,
                        T::as_nccl_type(),
                        sys::ncclRedOp_t::ncclSum,
                        rank.comm,
                        gpu.streams[r].cu_stream() as _,
                    ),
                )
                .unwrap();
            }
            check("ncclGroupEnd", sys::ncclGroupEnd()).unwrap();
        }
    }

    /// Records "nccl-symmetric" (eager and graph) for one point, after checking the
    /// sum against `host` (the inputs, copied into the send windows first).
    pub fn point<T: Element + NcclType>(
        &self,
        gpu: &Gpu,
        args: &Args,
        at: At,
        host: &[Vec<T>],
        iters: usize,
    ) -> Vec<Record> {
        let n = host[0].len();
        if n * std::mem::size_of::<T>() > self.bytes || at.group != gpu.streams.len() {
            return Vec::new();
        }
        for (r, rank) in self.ranks.iter().enumerate() {
            let stream = &gpu.streams[r];
            stream.context().bind_to_thread().unwrap();
            // SAFETY: the window holds n elements; `host[r]` outlives the synchronous
            // copy, and the receive window gets NaN words as poison.
            unsafe {
                cudarc::driver::sys::cuMemcpyHtoD_v2(
                    rank.send as u64,
                    host[r].as_ptr() as *const c_void,
                    n * std::mem::size_of::<T>(),
                )
                .result()
                .unwrap();
                cudarc::driver::sys::cuMemsetD8_v2(
                    rank.recv as u64,
                    0xff,
                    n * std::mem::size_of::<T>(),
                )
                .result()
                .unwrap();
            }
        }
        self.all_reduce::<T>(gpu, n);
        let outs: Vec<Vec<T>> = self
            .ranks
            .iter()
            .zip(&gpu.streams)
            .map(|(rank, s)| {
                s.synchronize().unwrap();
                let mut v = vec![T::from_f32(0.0); n];
                // SAFETY: the window holds n elements of T; `v` has room for them.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoH_v2(
                        v.as_mut_ptr() as *mut c_void,
                        rank.recv as u64,
                        n * std::mem::size_of::<T>(),
                    )
                    .result()
                    .unwrap();
                }
                v
            })
            .collect();
        if let Err(e) = super::check(host, &outs, at.group, "nccl-symmetric") {
            println!("NCCL SYMMETRIC WRONG SUM, not timed: {e}");
            return Vec::new();
        }
        let mut records = Vec::new();
        let eager = time_batches(&gpu.streams, args.batches, iters, || {
            for _ in 0..iters {
                self.all_reduce::<T>(gpu, n);
            }
        });
        records.push(record(at, "nccl-symmetric", "nccl", "eager", eager));
        if !args.no_graph {
            with_tracking(gpu, false);
            let graphs = capture(&gpu.streams, || {
                for _ in 0..iters {
                    self.all_reduce::<T>(gpu, n);
                }
            });
            let t = time_batches(&gpu.streams, args.batches, iters, || {
                graphs.iter().for_each(|g| g.launch().unwrap())
            });
            drop(graphs);
            with_tracking(gpu, true);
            records.push(record(at, "nccl-symmetric", "nccl", "graph", t));
        }
        records
    }
}

impl Drop for Symmetric {
    fn drop(&mut self) {
        // SAFETY: the streams were synchronised by the last timing; each handle is
        // released once, windows before their memory, memory before the communicator.
        unsafe {
            for rank in &self.ranks {
                for w in rank.windows {
                    if !w.is_null() {
                        let _ = sys::ncclCommWindowDeregister(rank.comm, w);
                    }
                }
                let _ = sys::ncclMemFree(rank.send);
                let _ = sys::ncclMemFree(rank.recv);
                let _ = sys::ncclCommDestroy(rank.comm);
            }
        }
    }
}
