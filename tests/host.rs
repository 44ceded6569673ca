//! The reference suite on the host backend: 8 simulated devices, 3 blocks each (an odd
//! count exercises uneven grid strides). Runs on any machine, and in CI.

mod common;

reference_suite!(
    peercomm::backend::host::Host,
    Ok(peercomm::MAX_GPUS),
    Some(3),
    common::LENGTHS
);
