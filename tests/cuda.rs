//! The reference suite on CUDA, plus CUDA-graph replay. Needs NVIDIA GPUs: with none
//! (no driver, or no device) every test prints why it is skipped. Run the GPU part on
//! the GPU machine with `scripts/device-test.sh` (one test thread: two communicators
//! spinning on the same GPUs at once could starve each other of SMs).
#![cfg(feature = "cuda")]

mod common;

use cudarc::driver::sys::CUstreamCaptureMode;
use peercomm::backend::cuda::Cuda;
use peercomm::backend::Backend;
use peercomm::{Algorithm, AllReduceOptions, Communicator, Error, Tensor, TensorMut};

fn cuda_devices() -> Result<usize, String> {
    match Cuda::device_count() {
        Ok(0) => Err("no CUDA device".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA driver: {e}")),
    }
}

reference_suite!(Cuda, cuda_devices(), None, common::LENGTHS);

#[test]
fn no_gpu_gives_a_typed_error() {
    if cuda_devices().is_ok() {
        common::announce_skip("no_gpu_gives_a_typed_error", "a CUDA device is present");
        return;
    }
    match Communicator::<Cuda>::new(&[0], common::suite_config(None)) {
        Err(Error::NoDevice { .. }) => {}
        Err(other) => panic!("expected NoDevice, got {other}"),
        Ok(_) => panic!("a communicator without a GPU"),
    }
}

/// Each algorithm captured into a CUDA graph (one graph per rank's stream) and replayed
/// with new inputs uploaded between replays; every replay is checked.
#[test]
fn cuda_graph_replays_with_new_data() {
    let world = match cuda_devices() {
        Ok(n) => n.min(2),
        Err(why) => {
            common::announce_skip("cuda_graph_replays_with_new_data", &why);
            return;
        }
    };
    let mut rng = common::rng("cuda_graph_replays_with_new_data");
    let comm = common::open::<Cuda>(world, common::suite_config(None));
    let len = 12_345;
    let mut replays_done = 0;
    for (algorithm, replays) in [
        (Algorithm::Auto, 1000),
        (Algorithm::OneStage, 300),
        (Algorithm::TwoStage, 300),
        (Algorithm::Lamport, 300),
    ] {
        let mut ins: Vec<_> = comm
            .ranks()
            .iter()
            .map(|r| Cuda::alloc_buffer::<half::bf16>(r.device(), len).unwrap())
            .collect();
        let mut outs: Vec<_> = comm
            .ranks()
            .iter()
            .map(|r| Cuda::alloc_buffer::<half::bf16>(r.device(), len).unwrap())
            .collect();
        comm.synchronize().unwrap();
        for r in comm.ranks() {
            r.device().stream().synchronize().unwrap();
            // SAFETY: every stream is idle and the buffers stay alive until the graphs
            // are dropped; the test orders uploads, replays and downloads itself.
            unsafe { r.device().context().disable_event_tracking() };
        }
        for r in comm.ranks() {
            r.device()
                .stream()
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .unwrap();
        }
        {
            let ins_t: Vec<Tensor<Cuda>> = ins.iter().map(|b| Tensor::flat(b)).collect();
            let mut outs_t: Vec<TensorMut<Cuda>> =
                outs.iter_mut().map(|b| TensorMut::flat(b)).collect();
            comm.all_reduce_sum(
                &ins_t,
                &mut outs_t,
                &AllReduceOptions::new().algorithm(algorithm),
            )
            .unwrap();
        }
        let graphs: Vec<_> = comm
            .ranks()
            .iter()
            .map(|r| {
                r.device()
                    .stream()
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                    .unwrap()
                    .expect("a captured graph")
            })
            .collect();
        for _ in 0..replays {
            let data: Vec<Vec<half::bf16>> = (0..world)
                .map(|_| common::random_values(&mut rng, len))
                .collect();
            let poison = vec![half::bf16::NAN; len];
            for (r, rank) in comm.ranks().iter().enumerate() {
                Cuda::upload(rank.device(), &data[r], &mut ins[r]).unwrap();
                Cuda::upload(rank.device(), &poison, &mut outs[r]).unwrap();
            }
            for g in &graphs {
                g.launch().unwrap();
            }
            comm.synchronize().unwrap();
            let got: Vec<Vec<half::bf16>> = comm
                .ranks()
                .iter()
                .zip(&outs)
                .map(|(r, o)| Cuda::download(r.device(), o).unwrap())
                .collect();
            common::check_sums(
                &data,
                &got,
                world,
                &format!("graph replay of {}", algorithm.name()),
            );
            replays_done += 1;
        }
        drop(graphs);
        for r in comm.ranks() {
            // SAFETY: the graphs are gone and every stream is synchronised.
            unsafe { r.device().context().enable_event_tracking() };
        }
    }
    eprintln!("cuda_graph_replays_with_new_data: {replays_done} replays checked on world {world}");
}
