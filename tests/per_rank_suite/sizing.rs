//! Sizing through the per-rank API: a communicator built from the largest message,
//! `Comm::algorithm_for` agreeing with what a call does, and `Comm::memory_footprint`.

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig, DType, Error, ReduceOp};

use super::{common, Placement};

/// `for_largest_message(1000, F32)`: 1000 elements run one-stage whole, 1001 in 3
/// chunks (as `algorithm_for` says), both right; no two-stage per rank; the footprint
/// is the configuration's.
pub fn sized_for_the_largest_message<B: Backend>(place: &Placement) {
    let base = place.config(2);
    let config = CommConfig::for_largest_message(1000, DType::F32)
        .unwrap()
        .with_max_blocks(base.max_blocks)
        .with_allow_shared_devices(base.allow_shared_devices)
        .with_barrier_timeout(base.barrier_timeout);
    let mut rng = common::rng("sized_for_the_largest_message");
    let fits = common::random_inputs::<f32>(&mut rng, 2, 1000);
    let too_big = common::random_inputs::<f32>(&mut rng, 2, 1001);
    super::with_world_config::<B, _>(place, 2, &config, |rank, comm| {
        let dev = comm.device();
        assert_eq!(comm.memory_footprint(), config.memory_footprint(2).unwrap());
        let one = AllReduceOptions::new().algorithm(Algorithm::OneStage);
        let f32_for = |len, opts, in_place| comm.algorithm_for(DType::F32, len, opts, in_place);
        let one_stage = Ok(Algorithm::OneStage);
        assert_eq!(f32_for(1000, &one, false), one_stage);
        for in_place in [false, true] {
            assert_eq!(f32_for(1001, &one, in_place), one_stage);
        }
        let two = AllReduceOptions::new().algorithm(Algorithm::TwoStage);
        let refused = matches!(f32_for(1000, &two, false), Err(Error::Unsupported(_)));
        assert!(refused);
        // The call agrees with the query, in chunks.
        let send = B::alloc_from(dev, &too_big[rank]).unwrap();
        let mut recv = B::alloc_from(dev, &vec![f32::NAN; 1001]).unwrap();
        assert_eq!(
            comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &one),
            one_stage
        );

        comm.synchronize().unwrap();
        let got = recv.to_host(dev).unwrap();
        common::check_sums(&too_big, &[got.clone(), got], 2, &format!("rank {rank}"));
        // The largest message runs, under Auto and forced one-stage.
        for opts in [AllReduceOptions::new(), one] {
            let send = B::alloc_from(dev, &fits[rank]).unwrap();
            let mut recv = B::alloc_from(dev, &vec![f32::NAN; 1000]).unwrap();
            comm.all_reduce_with(&send, &mut recv, &ReduceOp::Sum, &opts)
                .unwrap();
            comm.synchronize().unwrap();
            let got = recv.to_host(dev).unwrap();
            common::check_sums(&fits, &[got.clone(), got], 2, &format!("rank {rank}"));
        }
    });
}

/// Ranks built with different configurations all get an `InvalidConfig` that names
/// each field that differs and both values, instead of a checksum.
pub fn a_configuration_mismatch_names_the_fields<B: Backend>(place: &Placement) {
    let base = place.config(2);
    let id = UniqueId::new().unwrap();
    let errors: Vec<Error> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|rank| {
                let id = &id;
                let config = base
                    .clone()
                    .with_payload_bytes(base.payload_bytes + rank * 4096);
                s.spawn(move || {
                    let dev = B::open(place.ordinal(rank)).unwrap();
                    Comm::<B>::from_rank(dev, rank, 2, id, config).err()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap()
                    .expect("a mismatched configuration is refused")
            })
            .collect()
    });
    for e in errors {
        let text = e.to_string();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
        assert!(
            text.contains(&format!(
                "rank 1 has payload_bytes = {} where rank 0 has {}",
                base.payload_bytes + 4096,
                base.payload_bytes
            )),
            "{text}"
        );
    }
}
