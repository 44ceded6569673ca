//! The reference test suite, generic over the backend. Each backend's test file
//! instantiates it with `reference_suite!(Backend, max_world, config)`; a backend with
//! fewer devices than a test needs skips that part with a printed reason.
//!
//! Every check compares against an f64 CPU reference on fresh random inputs (no zeros,
//! no constants), with the output poisoned (NaN) before each call, and asserts that
//! all ranks of a group produced the same bits.

#![allow(dead_code)]

pub mod errors;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use peercomm::backend::Backend;
use peercomm::{
    Algorithm, AllReduceOptions, CommConfig, Communicator, DType, Element, Error, Tensor, TensorMut,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Prints a skip notice past the test harness's output capture, so a skipped GPU test
/// is visible in a normal `cargo test` run.
pub fn announce_skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Lengths every algorithm is checked at (odd ones exercise the scalar tail).
pub const LENGTHS: [usize; 5] = [1, 7, 1023, 4096, 1_000_003];

/// A fresh seed per run, printed so a failure can be replayed with PEERCOMM_SEED.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("PEERCOMM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: PEERCOMM_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// Random values in ±[1e-3, 1]: never zero, never constant.
pub fn random_values<T: Element>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            let mag: f32 = rng.random_range(1e-3..1.0);
            let x = if rng.random::<bool>() { mag } else { -mag };
            T::from_f32(x)
        })
        .collect()
}

fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
    }
}

/// Checks `outs` (one per rank) against the f64 sums of `ins` over each group of
/// `width`, and that every rank of a group has the same bits.
pub fn check_sums<T: Element>(ins: &[Vec<T>], outs: &[Vec<T>], width: usize, what: &str) {
    let world = ins.len();
    let n = ins[0].len();
    for g in (0..world).step_by(width) {
        let members = g..g + width;
        for e in 0..n {
            let mut sum = 0f64;
            let mut abs = 0f64;
            for r in members.clone() {
                let x = ins[r][e].to_f32() as f64;
                sum += x;
                abs += x.abs();
            }
            // Rounding of the result to T, plus the f32 accumulation of `width` terms.
            let tol =
                0.5 * eps(T::DTYPE) * sum.abs() + width as f64 * f32::EPSILON as f64 * abs + 1e-7;
            let lead = outs[g][e];
            let got = lead.to_f32() as f64;
            assert!(
                got.is_finite() && (got - sum).abs() <= tol,
                "{what}: group at rank {g}, element {e} of {n}: got {got}, expected {sum} (tolerance {tol})"
            );
            for r in members.clone().skip(1) {
                assert_eq!(
                    outs[r][e].to_bits_u32(),
                    lead.to_bits_u32(),
                    "{what}: rank {r} differs from rank {g} at element {e}"
                );
            }
        }
    }
}

/// A communicator for the suite: sized so that every algorithm takes the longest
/// length, with a timeout that turns a hang into a failure.
pub fn suite_config(max_blocks: Option<u32>) -> CommConfig {
    CommConfig {
        lamport_slot_bytes: 4 << 20,
        payload_bytes: 4 << 20,
        barrier_timeout: Some(Duration::from_secs(60)),
        max_blocks,
        ..CommConfig::default()
    }
}

pub fn open<B: Backend>(world: usize, config: CommConfig) -> Communicator<B> {
    let ordinals: Vec<usize> = (0..world).collect();
    Communicator::<B>::new(&ordinals, config).expect("communicator")
}

/// One all-reduce of fresh random data of `len` elements of T, checked.
pub fn run_case<B: Backend, T: Element>(
    comm: &Communicator<B>,
    rng: &mut StdRng,
    algorithm: Algorithm,
    group_size: usize,
    len: usize,
    in_place: bool,
) -> Algorithm {
    let world = comm.world_size();
    let width = if group_size == 0 { world } else { group_size };
    let ins: Vec<Vec<T>> = (0..world).map(|_| random_values::<T>(rng, len)).collect();
    let mut in_bufs = Vec::with_capacity(world);
    let mut out_bufs = Vec::with_capacity(world);
    let poison = vec![T::from_f32(f32::NAN); len];
    for (r, rank) in comm.ranks().iter().enumerate() {
        let dev = rank.device();
        let mut b = B::alloc_buffer::<T>(dev, len).unwrap();
        B::upload(dev, &ins[r], &mut b).unwrap();
        in_bufs.push(b);
        if !in_place {
            let mut o = B::alloc_buffer::<T>(dev, len).unwrap();
            B::upload(dev, &poison, &mut o).unwrap();
            out_bufs.push(o);
        }
    }
    let opts = AllReduceOptions::new()
        .group_size(group_size)
        .algorithm(algorithm);
    let what = format!(
        "{} {:?} world {world} group {width} len {len} {}",
        algorithm.name(),
        T::DTYPE,
        if in_place { "in-place" } else { "out-of-place" }
    );
    let ran = if in_place {
        let mut ts: Vec<TensorMut<B>> = in_bufs.iter_mut().map(|b| TensorMut::flat(b)).collect();
        comm.all_reduce_sum_in_place(&mut ts, &opts)
    } else {
        let ins_t: Vec<Tensor<B>> = in_bufs.iter().map(|b| Tensor::flat(b)).collect();
        let mut outs_t: Vec<TensorMut<B>> =
            out_bufs.iter_mut().map(|b| TensorMut::flat(b)).collect();
        comm.all_reduce_sum(&ins_t, &mut outs_t, &opts)
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    comm.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
    let results = if in_place { &in_bufs } else { &out_bufs };
    let outs: Vec<Vec<T>> = comm
        .ranks()
        .iter()
        .zip(results)
        .map(|(rank, b)| B::download(rank.device(), b).unwrap())
        .collect();
    check_sums(&ins, &outs, width, &what);
    ran
}

fn run_case_dtype<B: Backend>(
    comm: &Communicator<B>,
    rng: &mut StdRng,
    dtype: DType,
    algorithm: Algorithm,
    group_size: usize,
    len: usize,
    in_place: bool,
) -> Algorithm {
    match dtype {
        DType::F32 => run_case::<B, f32>(comm, rng, algorithm, group_size, len, in_place),
        DType::F16 => run_case::<B, half::f16>(comm, rng, algorithm, group_size, len, in_place),
        DType::BF16 => run_case::<B, half::bf16>(comm, rng, algorithm, group_size, len, in_place),
    }
}

pub fn group_sizes(world: usize) -> Vec<usize> {
    (1..=world).filter(|w| world % w == 0).collect()
}

/// Every algorithm (and Auto) x dtype x valid group size x length, out-of-place and
/// in-place, for one world size.
pub fn sweep_world<B: Backend>(world: usize, max_blocks: Option<u32>, lengths: &[usize]) {
    let mut rng = rng(&format!("sweep_world_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    let mut cases = 0;
    for group in group_sizes(world) {
        for algorithm in [
            Algorithm::Auto,
            Algorithm::OneStage,
            Algorithm::TwoStage,
            Algorithm::Lamport,
        ] {
            for dtype in DType::ALL {
                for &len in lengths {
                    for in_place in [false, true] {
                        run_case_dtype(&comm, &mut rng, dtype, algorithm, group, len, in_place);
                        cases += 1;
                    }
                }
            }
        }
    }
    eprintln!("sweep_world_{world}: {cases} all-reduces checked");
}

/// Subgroup (widths 1, 2 and 4 where narrower than and dividing the world) and whole-world all-reduces
/// interleaved on one set of signal buffers, every algorithm, each call checked.
pub fn interleaved_subgroups<B: Backend>(world: usize, calls: usize, max_blocks: Option<u32>) {
    let mut rng = rng(&format!("interleaved_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    let mut widths: Vec<usize> = [1, 2, 4]
        .into_iter()
        .filter(|w| *w < world && world % w == 0)
        .collect();
    widths.push(0);
    for i in 0..calls {
        let group = widths[i % widths.len()];
        let algorithm = Algorithm::ALL[(i / widths.len()) % 3];
        let dtype = DType::ALL[i % 3];
        let len = [1023, 4096, 33][i % 3];
        run_case_dtype(&comm, &mut rng, dtype, algorithm, group, len, i % 2 == 1);
    }
    eprintln!("interleaved_{world}: {calls} calls over widths {widths:?}");
}

/// Counters start just below u32::MAX so every barrier domain wraps mid-test.
pub fn counter_wraparound<B: Backend>(world: usize, max_blocks: Option<u32>) {
    let mut rng = rng(&format!("wraparound_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    comm.reinitialize_with_counter_base(u32::MAX - 7).unwrap();
    for i in 0..24 {
        for group in group_sizes(world) {
            let algorithm = Algorithm::ALL[i % 3];
            run_case::<B, f32>(&comm, &mut rng, algorithm, group, 1023, i % 2 == 0);
        }
    }
}

/// Thousands of collectives enqueued back to back with no host synchronisation in
/// between; the inputs stay the same, so every output must hold the same sums.
pub fn back_to_back<B: Backend>(world: usize, calls: usize, max_blocks: Option<u32>) {
    let mut rng = rng(&format!("back_to_back_{world}"));
    let comm = open::<B>(world, suite_config(max_blocks));
    let len = 1000;
    let ins: Vec<Vec<f32>> = (0..world)
        .map(|_| random_values::<f32>(&mut rng, len))
        .collect();
    let mut in_bufs = Vec::new();
    let mut out_bufs = Vec::new();
    for (r, rank) in comm.ranks().iter().enumerate() {
        let mut b = B::alloc_buffer::<f32>(rank.device(), len).unwrap();
        B::upload(rank.device(), &ins[r], &mut b).unwrap();
        in_bufs.push(b);
        let mut o = B::alloc_buffer::<f32>(rank.device(), len).unwrap();
        B::upload(rank.device(), &vec![f32::NAN; len], &mut o).unwrap();
        out_bufs.push(o);
    }
    for i in 0..calls {
        let opts = AllReduceOptions::new().algorithm(Algorithm::ALL[i % 3]);
        let ins_t: Vec<Tensor<B>> = in_bufs.iter().map(|b| Tensor::flat(b)).collect();
        let mut outs_t: Vec<TensorMut<B>> =
            out_bufs.iter_mut().map(|b| TensorMut::flat(b)).collect();
        comm.all_reduce_sum(&ins_t, &mut outs_t, &opts).unwrap();
    }
    comm.synchronize().unwrap();
    let outs: Vec<Vec<f32>> = comm
        .ranks()
        .iter()
        .zip(&out_bufs)
        .map(|(r, b)| B::download(r.device(), b).unwrap())
        .collect();
    check_sums(&ins, &outs, world, &format!("{calls} back-to-back calls"));
}

/// A barrier whose peers never launch: the waiting rank records a timeout naming rank,
/// block and domain; the communicator refuses collectives until re-initialised, then
/// works again.
pub fn barrier_timeout<B: Backend>(world: usize) {
    let config = CommConfig {
        barrier_timeout: Some(Duration::from_millis(300)),
        ..suite_config(None)
    };
    let comm = open::<B>(world, config);
    comm.barrier_on_ranks(0, &[0]).unwrap();
    let err = comm.synchronize().unwrap_err();
    assert_eq!(
        err,
        Error::BarrierTimeout {
            rank: 0,
            block: 0,
            domain: 0
        }
    );
    assert!(comm.is_poisoned());
    let mut rng = rng("barrier_timeout");
    let mut bufs: Vec<_> = comm
        .ranks()
        .iter()
        .map(|r| B::alloc_buffer::<f32>(r.device(), 4).unwrap())
        .collect();
    let mut ts: Vec<TensorMut<B>> = bufs.iter_mut().map(|b| TensorMut::flat(b)).collect();
    assert_eq!(
        comm.all_reduce_sum_in_place(&mut ts, &AllReduceOptions::new()),
        Err(Error::Poisoned)
    );
    comm.reinitialize().unwrap();
    assert!(!comm.is_poisoned());
    for algorithm in Algorithm::ALL {
        run_case::<B, f32>(&comm, &mut rng, algorithm, 0, 777, false);
    }
}

/// Generates the suite's `#[test]` functions for one backend. `$available` is an
/// expression giving `Result<usize, String>`: the devices there are, or why none.
#[macro_export]
macro_rules! reference_suite {
    ($backend:ty, $available:expr, $max_blocks:expr, $lengths:expr) => {
        fn devices_or_skip(test: &str, need: usize) -> bool {
            let available: Result<usize, String> = $available;
            match available {
                Ok(n) if n >= need => true,
                Ok(n) => {
                    common::announce_skip(
                        test,
                        &format!("needs {need} devices, {} has {n}", stringify!($backend)),
                    );
                    false
                }
                Err(why) => {
                    common::announce_skip(test, &why);
                    false
                }
            }
        }

        world_test!($backend, $max_blocks, $lengths, sweep_world_1, 1);
        world_test!($backend, $max_blocks, $lengths, sweep_world_2, 2);
        world_test!($backend, $max_blocks, $lengths, sweep_world_3, 3);
        world_test!($backend, $max_blocks, $lengths, sweep_world_4, 4);
        world_test!($backend, $max_blocks, $lengths, sweep_world_5, 5);
        world_test!($backend, $max_blocks, $lengths, sweep_world_6, 6);
        world_test!($backend, $max_blocks, $lengths, sweep_world_7, 7);
        world_test!($backend, $max_blocks, $lengths, sweep_world_8, 8);

        /// The largest of `worlds` (descending) this backend has devices for, or a
        /// printed skip.
        fn largest_world(test: &str, worlds: &[usize]) -> Option<usize> {
            let available: Result<usize, String> = $available;
            match available {
                Ok(n) => match worlds.iter().copied().find(|&w| w <= n) {
                    Some(w) => Some(w),
                    None => {
                        common::announce_skip(
                            test,
                            &format!("needs {} devices, has {n}", worlds[worlds.len() - 1]),
                        );
                        None
                    }
                },
                Err(why) => {
                    common::announce_skip(test, &why);
                    None
                }
            }
        }

        #[test]
        fn interleaved_subgroups_and_world() {
            if let Some(world) = largest_world("interleaved_subgroups_and_world", &[8, 4, 2]) {
                common::interleaved_subgroups::<$backend>(world, 1200, $max_blocks);
            }
        }

        #[test]
        fn counter_wraparound() {
            if let Some(world) = largest_world("counter_wraparound", &[8, 4, 2, 1]) {
                common::counter_wraparound::<$backend>(world, $max_blocks);
            }
        }

        #[test]
        fn back_to_back_calls() {
            if let Some(world) = largest_world("back_to_back_calls", &[8, 2, 1]) {
                common::back_to_back::<$backend>(world, 3000, $max_blocks);
            }
        }

        bad_input_tests!(
            $backend,
            lengths_differ,
            shapes_differ,
            dtypes_differ,
            output_length_differs_from_input,
            shape_does_not_describe_buffer,
            group_size_must_divide_world,
            world_of_zero_or_nine,
            device_listed_twice,
            message_larger_than_scratch,
            auto_falls_back_to_what_fits,
            buffer_on_the_wrong_device,
            wrong_number_of_tensors,
            block_count_out_of_range,
        );

        #[test]
        fn barrier_timeout_is_reported_and_recoverable() {
            if devices_or_skip("barrier_timeout_is_reported_and_recoverable", 2) {
                common::barrier_timeout::<$backend>(2);
            }
        }
    };
}

/// One `#[test]` running the full sweep at one world size.
#[macro_export]
macro_rules! world_test {
    ($backend:ty, $max_blocks:expr, $lengths:expr, $name:ident, $world:expr) => {
        #[test]
        fn $name() {
            if devices_or_skip(stringify!($name), $world) {
                common::sweep_world::<$backend>($world, $max_blocks, &$lengths);
            }
        }
    };
}
