//! The public API as a user meets it (issue 14): waiting without the error read-back
//! and polling errors without waiting, element types inferred through the backend's
//! buffers, and bits built with `Element::from_bits_u32`.

use std::time::{Duration, Instant};

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::{AllReduceOptions, CommConfig, Element, Error, Tensor, TensorMut};

use super::{open, rng, run_case, suite_config};

/// `wait()` waits and reads no error record (a timeout goes unnoticed, nothing is
/// poisoned); `synchronize()` then reports it. `check_errors()` reads the records
/// without waiting: clean while rank 0 still waits for a peer that never comes, then
/// the timeout, before the stream has finished. Both forms recover through
/// `reinitialize()`.
pub fn wait_and_check_errors<B: Backend>(world: usize) {
    let timeout = Duration::from_millis(1500);
    let comm = open::<B>(
        world,
        CommConfig {
            barrier_timeout: Some(timeout),
            ..suite_config(Some(2))
        },
    );
    let timed_out = Error::BarrierTimeout {
        rank: 0,
        block: 0,
        domain: 0,
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

/// Generic code with no turbofish: buffers made with `alloc_from` (T from the slice),
/// read back with `to_host` (T from the buffer); -0.0, subnormals and NaN payloads
/// built with `from_bits_u32`, which a group of one returns bit for bit (`Auto`).
pub fn typed_buffers_need_no_turbofish<B: Backend>() {
    fn bits<T: Element>(v: &[T]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits_u32()).collect()
    }
    fn case<B: Backend, T: Element>(comm: &peercomm::Communicator<B>, patterns: &[u32]) {
        let values: Vec<T> = patterns.iter().map(|&b| T::from_bits_u32(b)).collect();
        assert_eq!(bits(&values), patterns, "from_bits_u32 round trip");
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        for rank in comm.ranks() {
            ins.push(B::alloc_from(rank.device(), &values).unwrap());
            let poison = vec![T::from_bits_u32(patterns[0] ^ 1); values.len()];
            outs.push(B::alloc_from(rank.device(), &poison).unwrap());
        }
        let inputs: Vec<Tensor<B>> = ins.iter().map(|b| Tensor::flat(b)).collect();
        let mut outputs: Vec<TensorMut<B>> = outs.iter_mut().map(|b| TensorMut::flat(b)).collect();
        let opts = AllReduceOptions::new().group_size(1);
        comm.all_reduce_sum(&inputs, &mut outputs, &opts).unwrap();
        drop(outputs);
        comm.synchronize().unwrap();
        for (rank, out) in comm.ranks().iter().zip(&mut outs) {
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

/// The issue-14 tests of one backend.
#[macro_export]
macro_rules! ergonomics_tests {
    ($backend:ty) => {
        #[test]
        fn wait_and_check_errors() {
            if devices_or_skip("wait_and_check_errors", 2) {
                common::ergonomics::wait_and_check_errors::<$backend>(2);
            }
        }

        #[test]
        fn typed_buffers_need_no_turbofish() {
            if devices_or_skip("typed_buffers_need_no_turbofish", 2) {
                common::ergonomics::typed_buffers_need_no_turbofish::<$backend>();
            }
        }
    };
}
