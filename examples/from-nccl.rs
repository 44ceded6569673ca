//! The switch from cudarc's NCCL `Comm` to peercomm's per-rank `Comm`, as the README
//! shows it: [`nccl_rank`] is one rank of an engine on cudarc's NCCL today,
//! [`peercomm_rank`] the same rank on peercomm. Both run here, one thread per GPU, each
//! on the rank's own stream, and their sums are compared.
//!
//! ```text
//! cargo run --release --features cuda --example from-nccl    # one rank per visible GPU
//! ```
//!
//! Without the `cuda` feature it only says so. The NCCL half needs libnccl (loaded at
//! run time); without it only the peercomm half runs.

#[cfg(feature = "cuda")]
mod ranks {
    use std::ffi::c_char;
    use std::sync::{Arc, Condvar, Mutex};

    use cudarc::driver::{CudaSlice, CudaStream};
    use half::bf16;

    pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

    /// How rank 0's id reaches the other ranks: here a slot shared by the threads; in
    /// an engine whatever already carries NCCL's id (an environment variable, a store).
    pub struct Ids<T> {
        slot: Mutex<Option<T>>,
        ready: Condvar,
    }

    impl<T: Copy> Ids<T> {
        pub fn new() -> Self {
            Ids {
                slot: Mutex::new(None),
                ready: Condvar::new(),
            }
        }
        /// Rank 0: publishes the id's bytes and returns them.
        pub fn send(&self, bytes: T) -> T {
            *self.slot.lock().unwrap() = Some(bytes);
            self.ready.notify_all();
            bytes
        }
        /// The other ranks: waits for rank 0's bytes.
        pub fn receive(&self) -> T {
            let slot = self.slot.lock().unwrap();
            let slot = self.ready.wait_while(slot, |s| s.is_none()).unwrap();
            slot.expect("published")
        }
    }

    /// Before: one rank on cudarc's NCCL (cudarc 0.17+). (cudarc's `NcclError` is not a
    /// `std::error::Error`, hence its own result type.)
    pub fn nccl_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        ids: &Ids<[c_char; 128]>,
        send: &CudaSlice<bf16>,
        recv: &mut CudaSlice<bf16>,
    ) -> std::result::Result<(), cudarc::nccl::result::NcclError> {
        use cudarc::nccl::{Comm, Id, ReduceOp};

        let bytes = if rank == 0 {
            ids.send(*Id::new()?.internal())
        } else {
            ids.receive()
        };
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(bytes))?;
        comm.all_reduce(send, recv, &ReduceOp::Sum)?;
        Ok(())
    }

    /// After: the same rank on peercomm's per-rank `Comm`.
    pub fn peercomm_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        ids: &Ids<[u8; peercomm::UniqueId::BYTES]>,
        send: &CudaSlice<bf16>,
        recv: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        use peercomm::{Comm, CommConfig, ReduceOp, UniqueId};

        let bytes = if rank == 0 {
            ids.send(UniqueId::new()?.to_bytes())
        } else {
            ids.receive()
        };
        let id = UniqueId::from_bytes(&bytes)?;
        let comm = Comm::from_rank(stream.clone(), rank, world, &id, CommConfig::default())?;
        comm.all_reduce(send, recv, &ReduceOp::Sum)?;
        comm.synchronize()?; // waits, and reports a device-side error if one happened
        Ok(())
    }

    /// Both on every visible GPU (at most 8), one thread per rank; returns whether the
    /// peercomm sums were right (and equal NCCL's where NCCL ran).
    pub fn main() -> Result<bool> {
        use peercomm::backend::cuda::Cuda;
        use peercomm::backend::Backend;

        // Counting through peercomm first: a missing driver is a typed error here.
        let world = Cuda::device_count()?.min(peercomm::MAX_GPUS);
        if world == 0 {
            return Err("no CUDA device".into());
        }
        // cudarc loads libnccl at its first call and panics when it is missing: ask once
        // here, so that no rank waits for an id that rank 0 cannot make.
        let with_nccl =
            std::panic::catch_unwind(|| cudarc::nccl::Id::new().is_ok()).unwrap_or(false);
        if !with_nccl {
            println!("NCCL is not available (libnccl not found, or failing): peercomm only");
        }
        let (nccl_ids, peercomm_ids) = (Ids::new(), Ids::new());
        let n = 1 << 20;
        let want = (world * (world + 1) / 2) as f32;
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..world)
                .map(|rank| {
                    let (nccl_ids, peercomm_ids) = (&nccl_ids, &peercomm_ids);
                    s.spawn(move || -> Result<bool> {
                        let stream = cudarc::driver::CudaContext::new(rank)?.new_stream()?;
                        let send =
                            stream.clone_htod(&vec![bf16::from_f32(rank as f32 + 1.0); n])?;
                        let mut ours = stream.alloc_zeros::<bf16>(n)?;
                        peercomm_rank(stream.clone(), rank, world, peercomm_ids, &send, &mut ours)?;
                        let ours = stream.clone_dtoh(&ours)?;
                        let mut ok = ours.iter().all(|x| x.to_f32() == want);
                        println!(
                            "rank {rank}: peercomm sum {}",
                            if ok { "right" } else { "WRONG" }
                        );
                        if with_nccl {
                            let mut theirs = stream.alloc_zeros::<bf16>(n)?;
                            nccl_rank(stream.clone(), rank, world, nccl_ids, &send, &mut theirs)
                                .map_err(|e| format!("NCCL: {e:?}"))?;
                            let same = stream.clone_dtoh(&theirs)? == ours;
                            println!(
                                "rank {rank}: NCCL sum {}",
                                if same { "equal" } else { "DIFFERENT" }
                            );
                            ok &= same;
                        }
                        Ok(ok)
                    })
                })
                .collect();
            let mut all = true;
            for (rank, r) in ranks.into_iter().enumerate() {
                match r.join() {
                    Ok(Ok(ok)) => all &= ok,
                    Ok(Err(e)) => {
                        println!("rank {rank}: {e}");
                        all = false;
                    }
                    Err(_) => {
                        println!("rank {rank} panicked");
                        all = false;
                    }
                }
            }
            Ok(all)
        })
    }
}

fn main() -> std::process::ExitCode {
    #[cfg(feature = "cuda")]
    {
        match ranks::main() {
            Ok(true) => std::process::ExitCode::SUCCESS,
            Ok(false) => std::process::ExitCode::FAILURE,
            Err(e) => {
                eprintln!("from-nccl: {e}");
                std::process::ExitCode::FAILURE
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        println!(
            "from-nccl needs a CUDA build: cargo run --release --features cuda --example from-nccl"
        );
        std::process::ExitCode::SUCCESS
    }
}
