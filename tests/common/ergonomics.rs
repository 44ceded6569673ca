//! The public API as a user meets it: `wait` and `check_errors`, element types
//! inferred from buffers, and bits built with `Element::from_bits_u32`.

use std::time::{Duration, Instant};

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{AllReduceOptions, Element, Error, ReduceOp};

use super::{
    check_sums, on_ranks, open, random_inputs, rng, run_case, suite_config, views, views_mut,
};

/// `wait()` reads no error record (a timeout goes unnoticed) and `synchronize()` then
/// reports it; `check_errors()` reports it without waiting for the stream. Both recover
/// through `reinitialize()`.
pub fn wait_and_check_errors<B: Backend>(world: usize) {
    let timeout = Duration::from_millis(1500);
    let comm = open::<B>(
        world,
        suite_config(Some(2)).with_barrier_timeout(Some(timeout)),
    );
    let timed_out = Error::BarrierTimeout {
        rank: 0,
        block: 0,
        domain: 0,
        waiting_for: Some(1),
    };
    // wait(): no read-back.
    comm.barrier_on_ranks(0, &[0]).unwrap();
    comm.wait().expect("wait reads no error record");
    assert!(!comm.is_poisoned(), "wait must not poison");
    assert_eq!(comm.synchronize(), Err(timed_out.clone()));
    assert!(comm.is_poisoned());
    comm.reinitialize().unwrap();

    // check_errors(): no wait.
    let started = Instant::now();
    comm.barrier_on_ranks(0, &[0]).unwrap();
    assert_eq!(
        comm.check_errors(),
        Ok(()),
        "no error recorded yet, {:?} into a wait of {timeout:?}",
        started.elapsed()
    );
    let seen = loop {
        match comm.check_errors() {
            Ok(()) => {
                assert!(
                    started.elapsed() < 3 * timeout + Duration::from_secs(5),
                    "check_errors never saw the timeout"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => break e,
        }
    };
    let polled_after = started.elapsed();
    assert_eq!(seen, timed_out);
    assert!(
        comm.is_poisoned(),
        "check_errors poisons as synchronize does"
    );
    assert!(
        polled_after >= timeout,
        "the timeout was reported after {polled_after:?}, before the {timeout:?} limit"
    );
    comm.wait().unwrap();
    comm.reinitialize().unwrap();
    assert_eq!(comm.check_errors(), Ok(()));
    let mut rng = rng("wait_and_check_errors");
    run_case::<B, f32>(&comm, &mut rng, peercomm::Algorithm::Auto, 0, 1001, false).unwrap();
    comm.wait().unwrap();
    comm.check_errors().unwrap();
}

/// Generic code with no turbofish (`alloc_from`, `to_host`); -0.0, subnormals and NaN
/// payloads from `from_bits_u32` come back bit for bit from a group of one.
pub fn typed_buffers_need_no_turbofish<B: Backend>() {
    use super::bits;
    fn case<B: Backend, T: Element>(comm: &peercomm::SingleController<B>, patterns: &[u32]) {
        let values: Vec<T> = patterns.iter().map(|&b| T::from_bits_u32(b)).collect();
        assert_eq!(bits(&values), patterns, "from_bits_u32 round trip");
        let poison = vec![T::from_bits_u32(patterns[0] ^ 1); values.len()];
        let alloc = |v: &[T]| -> Vec<B::Buffer<T>> {
            comm.cores()
                .iter()
                .map(|r| B::alloc_from(r.device(), v).unwrap())
                .collect()
        };
        let (ins, mut outs) = (alloc(&values), alloc(&poison));
        let opts = AllReduceOptions::new().group_size(1);
        comm.all_reduce(
            &views(&ins),
            &mut views_mut(&mut outs),
            &ReduceOp::Sum,
            &opts,
        )
        .unwrap();
        comm.synchronize().unwrap();
        for (rank, out) in comm.cores().iter().zip(&mut outs) {
            assert_eq!(bits(&out.to_host(rank.device()).unwrap()), patterns);
            out.copy_from_host(rank.device(), &values).unwrap();
            assert_eq!(bits(&out.to_host(rank.device()).unwrap()), patterns);
        }
    }
    let comm = open::<B>(2, suite_config(Some(2)));
    // -0.0, the smallest subnormals of each sign, a quiet NaN with a payload, +0.0, 1.
    case::<B, f32>(
        &comm,
        &[0x8000_0000, 1, 0x8000_0001, 0x7fc0_1234, 0, 0x3f80_0000],
    );
    case::<B, half::f16>(&comm, &[0x8000, 1, 0x8001, 0x7e12, 0, 0x3c00]);
    case::<B, half::bf16>(&comm, &[0x8000, 1, 0x8001, 0x7fc1, 0, 0x3f80]);
}

/// The slice form: every algorithm, in and out of place, f32 and bf16, odd lengths,
/// against the reference; bad lengths and buffer counts get the shaped form's errors.
pub fn slice_form<B: Backend>(world: usize) {
    fn run<B: Backend, T: Element>(
        comm: &peercomm::SingleController<B>,
        rng: &mut rand::rngs::StdRng,
        len: usize,
    ) {
        let world = comm.world_size();
        for algorithm in super::REQUESTS {
            let opts = AllReduceOptions::new().algorithm(algorithm);
            let data = random_inputs::<T>(rng, world, len);
            let poison = vec![T::from_f32(f32::NAN); len];
            let ins = on_ranks(comm, |r, d| B::alloc_from(d, &data[r]).unwrap());
            let mut outs = on_ranks(comm, |_, d| B::alloc_from(d, &poison).unwrap());
            comm.all_reduce_slices(&ins, &mut outs, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            let got = on_ranks(comm, |r, d| outs[r].to_host(d).unwrap());
            check_sums(&data, &got, world, &format!("slices, {algorithm:?}, {len}"));
            // In place, over fresh data.
            let data = random_inputs::<T>(rng, world, len);
            let mut bufs = on_ranks(comm, |r, d| B::alloc_from(d, &data[r]).unwrap());
            comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            let got = on_ranks(comm, |r, d| bufs[r].to_host(d).unwrap());
            let what = format!("slices in place, {algorithm:?}, {len}");
            check_sums(&data, &got, world, &what);
        }
    }
    let comm = open::<B>(world, suite_config(Some(2)));
    let mut rng = rng("slice_form");
    for len in [1, 33, 4099] {
        run::<B, f32>(&comm, &mut rng, len);
        run::<B, half::bf16>(&comm, &mut rng, len);
    }

    // Refusals: nothing written.
    let devs: Vec<&B::Device> = comm.cores().iter().map(|r| r.device()).collect();
    let lens: Vec<usize> = (0..world).map(|r| if r == 1 { 7 } else { 6 }).collect();
    let values: Vec<Vec<f32>> = lens.iter().map(|&n| vec![1.5; n]).collect();
    let mut ins = on_ranks(&comm, |r, d| B::alloc_from(d, &values[r]).unwrap());
    let nans = |r: usize| vec![f32::NAN; lens[r]];
    let mut outs = on_ranks(&comm, |r, d| B::alloc_from(d, &nans(r)).unwrap());
    let opts = AllReduceOptions::new();
    let length_mismatch_on =
        |got: peercomm::Result<peercomm::Algorithm>, rank: usize, what: &str| match got {
            Err(Error::LengthMismatch { rank: r, .. }) if r == rank => {}
            other => panic!("{what}: expected LengthMismatch on rank {rank}, got {other:?}"),
        };
    let got = comm.all_reduce_slices(&ins, &mut outs, &ReduceOp::Sum, &opts);
    length_mismatch_on(got, 1, "unequal inputs");
    let got = comm.all_reduce_slices_in_place(&mut ins, &ReduceOp::Sum, &opts);
    length_mismatch_on(got, 1, "unequal, in place");
    let same = on_ranks(&comm, |_, d| B::alloc_from(d, &[1.5f32; 6]).unwrap());
    let got = comm.all_reduce_slices(&same, &mut outs, &ReduceOp::Sum, &opts);
    length_mismatch_on(got, 1, "rank 1's output of 7");
    assert_eq!(
        comm.all_reduce_slices(&same[1..], &mut outs[1..], &ReduceOp::Sum, &opts),
        Err(Error::WrongTensorCount {
            expected: world,
            got: world - 1
        })
    );
    comm.synchronize().unwrap();
    for r in 0..world {
        assert_eq!(
            ins[r].to_host(devs[r]).unwrap(),
            values[r],
            "rank {r}'s input was written"
        );
        assert!(
            outs[r].to_host(devs[r]).unwrap().iter().all(|x| x.is_nan()),
            "rank {r}'s output was written"
        );
    }
}

/// `miss_next(1)`: rank 0 times out with nothing written; the switch is one-shot, so
/// after `reinitialize()` the next call is right. An out-of-range rank is refused.
pub fn miss_next_times_out_and_recovers<B: Backend>() {
    let comm = open::<B>(
        2,
        suite_config(Some(2)).with_barrier_timeout(Some(Duration::from_millis(300))),
    );
    let mut rng = rng("miss_next_times_out_and_recovers");
    let devs: Vec<&B::Device> = comm.cores().iter().map(|r| r.device()).collect();
    let data = random_inputs::<f32>(&mut rng, 2, 777);
    let mut bufs: Vec<B::Buffer<f32>> = (0..2)
        .map(|r| B::alloc_from(devs[r], &data[r]).unwrap())
        .collect();
    let opts = AllReduceOptions::new().algorithm(peercomm::Algorithm::OneStage);
    assert!(matches!(comm.miss_next(2), Err(Error::InvalidDevices(_))));
    comm.miss_next(1).unwrap();
    comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &opts)
        .unwrap();
    assert_eq!(
        comm.synchronize(),
        Err(Error::BarrierTimeout {
            rank: 0,
            block: 0,
            domain: 0,
            waiting_for: Some(1),
        })
    );
    for r in 0..2 {
        assert_eq!(
            bufs[r].to_host(devs[r]).unwrap(),
            data[r],
            "rank {r} was written"
        );
    }
    comm.reinitialize().unwrap();
    let data = random_inputs::<f32>(&mut rng, 2, 777);
    for r in 0..2 {
        bufs[r].copy_from_host(devs[r], &data[r]).unwrap();
    }
    comm.all_reduce_slices_in_place(&mut bufs, &ReduceOp::Sum, &opts)
        .unwrap();
    comm.synchronize().unwrap();
    let got: Vec<Vec<f32>> = (0..2).map(|r| bufs[r].to_host(devs[r]).unwrap()).collect();
    check_sums(&data, &got, 2, "after recovery from a missed call");
}

/// The ergonomics tests of one backend, each on two devices.
#[macro_export]
macro_rules! ergonomics_tests {
    ($backend:ty) => {
        sized_tests!(|w| common::ergonomics::wait_and_check_errors::<$backend>(w);
            wait_and_check_errors: 2);
        sized_tests!(|w| common::ergonomics::slice_form::<$backend>(w); slice_form: 2);
        sized_tests!(|_: usize| common::ergonomics::miss_next_times_out_and_recovers::<$backend>();
            miss_next_times_out_and_recovers: 2);
        sized_tests!(|_: usize| common::ergonomics::typed_buffers_need_no_turbofish::<$backend>();
            typed_buffers_need_no_turbofish: 2);
    };
}
