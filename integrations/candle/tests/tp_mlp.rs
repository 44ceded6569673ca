//! GPU tests of the candle integration (CUDA; each skips with a visible message when
//! no GPU is present). The tensor-parallel Llama-3-8B MLP block over two ranks equals
//! the single-GPU block within bf16 tolerance; with one GPU the two ranks share it
//! (`CommConfig::allow_shared_devices`). `collectives`: every collective, operator,
//! dtype and form against an f64 host reference, and the typed errors;
//! `graph_capture`: the all-reduce inside a CUDA graph that the test captured itself on
//! candle's stream. One test binary, which the GPU run packs.

#[path = "tp_mlp/collectives.rs"]
mod collectives;
#[path = "tp_mlp/graph_capture.rs"]
mod graph_capture;
#[path = "tp_mlp/reference.rs"]
mod reference;

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Tensor};
use peercomm::bootstrap::UniqueId;
use peercomm_candle::mlp::{random_input, Comparison, Mlp, MlpShape};
use peercomm_candle::{AllReduceOptions, CandleComm, CommConfig, Error};

/// Prints past the test harness's output capture, so a skip shows in a plain
/// `cargo test` run.
fn announce_skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// The seed of a test: PEERCOMM_SEED if set, else the clock; printed so a failure can
/// be replayed.
fn seed(test: &str) -> u64 {
    let seed = std::env::var("PEERCOMM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: PEERCOMM_SEED={seed}");
    seed
}

/// Visible GPUs, or `None` (after printing why the test skips).
fn gpus(test: &str) -> Option<usize> {
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Some(n as usize),
        Ok(_) => {
            announce_skip(test, "no CUDA device");
            None
        }
        Err(e) => {
            announce_skip(test, &format!("no CUDA driver or device ({e})"));
            None
        }
    }
}

/// Two ranks on GPUs 0 and 1, or both on GPU 0 when there is one.
fn placement(gpus: usize) -> (Vec<usize>, CommConfig) {
    let ordinals = if gpus >= 2 { vec![0, 1] } else { vec![0, 0] };
    let config = CommConfig::default().with_allow_shared_devices(gpus < 2);
    (ordinals, config)
}

const TOKENS: [usize; 4] = [1, 8, 128, 2048];

struct RankOut {
    out_of_place: Vec<Tensor>,
    in_place: Vec<Tensor>,
    partial: Vec<Tensor>,
    offset_sum: Tensor,
}

#[test]
fn tensor_parallel_block_matches_single_gpu() {
    let Some(n) = gpus("tensor_parallel_block_matches_single_gpu") else {
        return;
    };
    let (ordinals, config) = placement(n);
    let world = ordinals.len();
    eprintln!("ranks on GPUs {ordinals:?}");
    let shape = MlpShape::LLAMA3_8B;
    let seed = seed("tensor_parallel_block_matches_single_gpu");
    let weights = Arc::new(Mlp::random(shape, DType::BF16, seed, &Device::Cpu).unwrap());
    let inputs: Vec<Tensor> = TOKENS
        .iter()
        .map(|&t| {
            random_input(
                t,
                shape.hidden,
                DType::BF16,
                seed ^ (100 + t as u64),
                &Device::Cpu,
            )
            .unwrap()
        })
        .collect();

    // The single-GPU block.
    let reference: Vec<Tensor> = {
        let dev = Device::new_cuda_with_stream(0).unwrap();
        let full = Mlp::shard(&weights, 0, 1, &dev).unwrap();
        inputs
            .iter()
            .map(|x| {
                full.forward(&x.to_device(&dev).unwrap())
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
            })
            .collect()
    };

    let id = UniqueId::new().unwrap();
    // Ranks sharing one GPU share its context: a first use of a kernel (candle and
    // cuBLAS load modules lazily) can wait for the whole context, including a peer's
    // collective that spins waiting for this rank. So every rank runs each shape once
    // and makes its other tensors before any rank starts a collective.
    let warm = std::sync::Barrier::new(world);
    let outs: Vec<RankOut> = std::thread::scope(|s| {
        let workers: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(rank, &ordinal)| {
                let (weights, inputs, id, config, warm) =
                    (&weights, &inputs, &id, config.clone(), &warm);
                s.spawn(move || {
                    let dev = Device::new_cuda_with_stream(ordinal).unwrap();
                    let comm = CandleComm::from_rank(&dev, rank, world, id, config).unwrap();
                    let shard = weights.shard(rank, world, &dev).unwrap();
                    let opts = AllReduceOptions::new();
                    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
                    let mut r = RankOut {
                        out_of_place: vec![],
                        in_place: vec![],
                        partial: vec![],
                        offset_sum: Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(),
                    };
                    for x in inputs {
                        shard.forward(&x.to_device(&dev).unwrap()).unwrap();
                    }
                    // A contiguous tensor that starts inside its storage (rows 1..4 of 5).
                    let own =
                        random_input(5, 7, DType::F32, seed ^ (900 + rank as u64), &dev).unwrap();
                    dev.synchronize().unwrap();
                    warm.wait();
                    for x in inputs {
                        let partial = shard.forward(&x.to_device(&dev).unwrap()).unwrap();
                        let sum = comm.all_reduce_sum(&partial, &opts).unwrap();
                        let in_place = partial.copy().unwrap();
                        comm.all_reduce_sum_in_place(&in_place, &opts).unwrap();
                        comm.synchronize().unwrap();
                        r.out_of_place.push(cpu(&sum));
                        r.in_place.push(cpu(&in_place));
                        r.partial.push(cpu(&partial));
                    }
                    let sum = comm.all_reduce_sum(&own.i(1..4).unwrap(), &opts).unwrap();
                    comm.synchronize().unwrap();
                    r.offset_sum = cpu(&sum);
                    r
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });

    for (k, &tokens) in TOKENS.iter().enumerate() {
        for (rank, r) in outs.iter().enumerate() {
            let c = Comparison::new(&r.out_of_place[k], &reference[k]).unwrap();
            eprintln!(
                "tokens {tokens:5} rank {rank}: max |tp - single| = {:.3e} (rms {:.3e}, {:.2} of the tolerance)",
                c.max_abs, c.rms, c.worst
            );
            assert!(c.passes(), "tokens {tokens}, rank {rank}: {c:?}");
            assert_eq!(
                bits(&r.in_place[k]),
                bits(&r.out_of_place[k]),
                "in place differs, rank {rank}"
            );
            assert_eq!(
                bits(&r.out_of_place[k]),
                bits(&outs[0].out_of_place[k]),
                "rank {rank} differs from rank 0"
            );
            // The tolerance discriminates: one rank's partial sum alone is far off.
            let alone = Comparison::new(&r.partial[k], &reference[k]).unwrap();
            assert!(!alone.passes(), "a partial sum passed the check: {alone:?}");
        }
    }
    // f32, two addends: the f32 sum is exact rounding of the true sum.
    let want: Vec<f32> = (0..world)
        .map(|rank| {
            random_input(5, 7, DType::F32, seed ^ (900 + rank as u64), &Device::Cpu)
                .unwrap()
                .i(1..4)
                .unwrap()
        })
        .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .reduce(|a, b| a.iter().zip(&b).map(|(x, y)| x + y).collect())
        .unwrap();
    for r in &outs {
        assert_eq!(
            r.offset_sum
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            want
        );
    }
}

fn bits(t: &Tensor) -> Vec<u16> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_vec1::<half::bf16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn bad_tensors_get_typed_errors_and_nothing_written() {
    let Some(_) = gpus("bad_tensors_get_typed_errors_and_nothing_written") else {
        return;
    };
    let dev = Device::new_cuda_with_stream(0).unwrap();
    let id = UniqueId::new().unwrap();
    assert!(matches!(
        CandleComm::from_rank(&Device::Cpu, 0, 1, &id, CommConfig::default()),
        Err(Error::NotCuda { .. })
    ));
    let comm = CandleComm::from_rank(&dev, 0, 1, &id, CommConfig::default()).unwrap();
    let opts = AllReduceOptions::new();
    let seed = seed("bad_tensors_get_typed_errors_and_nothing_written");
    let t = random_input(4, 6, DType::F32, seed, &dev).unwrap();
    let before = t.to_vec2::<f32>().unwrap();

    let transposed = t.t().unwrap();
    assert!(matches!(
        comm.all_reduce_sum(&transposed, &opts),
        Err(Error::NotContiguous { .. })
    ));
    assert!(matches!(
        comm.all_reduce_sum_in_place(&transposed, &opts),
        Err(Error::NotContiguous { .. })
    ));
    let on_cpu = t.to_device(&Device::Cpu).unwrap();
    assert!(matches!(
        comm.all_reduce_sum(&on_cpu, &opts),
        Err(Error::NotCuda { .. })
    ));
    assert!(matches!(
        comm.all_reduce_sum_in_place(&on_cpu, &opts),
        Err(Error::NotCuda { .. })
    ));
    for dtype in [DType::F64, DType::U32, DType::U8, DType::I64] {
        let other = t.to_dtype(dtype).unwrap();
        assert!(
            matches!(comm.all_reduce_sum(&other, &opts), Err(Error::UnsupportedDType(d)) if d == dtype)
        );
        assert!(
            matches!(comm.all_reduce_sum_in_place(&other, &opts), Err(Error::UnsupportedDType(d)) if d == dtype)
        );
    }
    // The same GPU opened as another candle device (another stream).
    let second = Device::new_cuda_with_stream(0).unwrap();
    let elsewhere = t.to_device(&second).unwrap();
    assert!(matches!(
        comm.all_reduce_sum(&elsewhere, &opts),
        Err(Error::WrongDevice { expected: 0, .. })
    ));
    assert!(matches!(
        comm.all_reduce_sum_in_place(&elsewhere, &opts),
        Err(Error::WrongDevice { .. })
    ));
    // peercomm's own checks come through typed: a group size that does not divide 1.
    let bad_group = AllReduceOptions::new().group_size(2);
    assert!(matches!(
        comm.all_reduce_sum_in_place(&t, &bad_group),
        Err(Error::Peercomm(peercomm::Error::InvalidGroupSize { .. }))
    ));
    comm.synchronize().unwrap();
    assert_eq!(t.to_vec2::<f32>().unwrap(), before, "a refused call wrote");
    assert_eq!(
        elsewhere.to_vec2::<f32>().unwrap(),
        before,
        "a refused call wrote"
    );

    // A world of one: the sum is the input, bit for bit, for every dtype, also when the
    // tensor starts inside its storage.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let big = random_input(8, 6, dtype, seed ^ 2, &dev).unwrap();
        let view = big.i(2..5).unwrap();
        let sum = comm.all_reduce_sum(&view, &opts).unwrap();
        assert_eq!(sum.dims(), &[3, 6]);
        assert_eq!(sum.dtype(), dtype);
        let in_place = view.copy().unwrap();
        comm.all_reduce_sum_in_place(&in_place, &opts).unwrap();
        comm.synchronize().unwrap();
        let as_f64 = |x: &Tensor| x.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
        assert_eq!(as_f64(&sum), as_f64(&view));
        assert_eq!(as_f64(&in_place), as_f64(&view));
    }
}
