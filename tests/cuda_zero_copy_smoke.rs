//! Temporary device smoke test of the zero-copy path (not committed).
#![cfg(feature = "cuda")]
use peercomm::backend::{cuda::Cuda, Backend, TypedBuffer};
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig};
use std::time::Duration;

fn run(world: usize) {
    if Cuda::device_count().unwrap_or(0) == 0 {
        eprintln!("skip: no GPU");
        return;
    }
    let gpus = Cuda::device_count().unwrap();
    let id = UniqueId::new().unwrap();
    let cfg = CommConfig {
        barrier_timeout: Some(Duration::from_secs(20)),
        max_blocks: Some(4),
        allow_shared_devices: true,
        ..CommConfig::default()
    };
    std::thread::scope(|s| {
        for rank in 0..world {
            let id = &id;
            let cfg = cfg.clone();
            s.spawn(move || {
                let dev = Cuda::open(rank % gpus).unwrap();
                let comm = Comm::<Cuda>::from_rank(dev, rank, world, id, cfg).unwrap();
                let want = (world * (world + 1) / 2) as f32;
                for n in [1usize, 1000, 4099, 1 << 20] {
                    let mut sym = comm.alloc_symmetric::<f32>(n).unwrap();
                    sym.copy_from_host(comm.device(), &vec![rank as f32 + 1.0; n])
                        .unwrap();
                    let mut out = Cuda::alloc_buffer::<f32>(comm.device(), n).unwrap();
                    for alg in [
                        Algorithm::OneStage,
                        Algorithm::TwoStage,
                        Algorithm::Auto,
                        Algorithm::Lamport,
                    ] {
                        Cuda::upload(comm.device(), &vec![f32::NAN; n], &mut out).unwrap();
                        let a = comm.all_reduce_sum_with(
                            &sym,
                            &mut out,
                            &AllReduceOptions::new().algorithm(alg),
                        );
                        if alg == Algorithm::Lamport && a.is_err() {
                            continue;
                        }
                        let a = a.unwrap();
                        comm.synchronize().unwrap();
                        let got = Cuda::download(comm.device(), &out).unwrap();
                        assert!(
                            got.iter().all(|&x| x == want),
                            "rank {rank} n {n} {a:?}: {:?}",
                            &got[..4.min(n)]
                        );
                    }
                    let buf = Cuda::alloc_from(comm.device(), &vec![rank as f32 + 1.0; n]).unwrap();
                    let reg = comm.register(buf).unwrap();
                    Cuda::upload(comm.device(), &vec![f32::NAN; n], &mut out).unwrap();
                    comm.all_reduce_sum_with(
                        &*reg,
                        &mut out,
                        &AllReduceOptions::new().algorithm(Algorithm::TwoStage),
                    )
                    .ok();
                    comm.all_reduce_sum_with(
                        &reg,
                        &mut out,
                        &AllReduceOptions::new().algorithm(Algorithm::TwoStage),
                    )
                    .unwrap();
                    comm.synchronize().unwrap_or_else(|e| panic!("{e}"));
                    drop(reg);
                }
                let plain = Cuda::alloc_from(comm.device(), &vec![1.0f32; 64]).unwrap();
                let sym = comm.alloc_symmetric::<f32>(64).unwrap();
                let mut out = Cuda::alloc_buffer::<f32>(comm.device(), 64).unwrap();
                let opts = AllReduceOptions::new().algorithm(Algorithm::OneStage);
                if rank == 0 {
                    comm.all_reduce_sum_with(&sym, &mut out, &opts).unwrap();
                } else {
                    comm.all_reduce_sum_with(&plain, &mut out, &opts).unwrap();
                }
                let e = comm.synchronize();
                eprintln!("rank {rank} mismatch: {e:?}");
                assert!(e.is_err());
                eprintln!("rank {rank}: registrations {:?}", comm.registrations());
            });
        }
    });
}

#[test]
fn zero_copy_world_2() {
    run(2);
}
#[test]
fn zero_copy_world_4() {
    run(4);
}
