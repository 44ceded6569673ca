//! The issue-18 regression cases written against the API of 0f820a1 (before the fixes),
//! to see them fail there. Host backend, threads.
use std::time::Duration;
use peercomm::backend::{host::Host, Backend, TypedBuffer};
use peercomm::bootstrap::UniqueId;
use peercomm::{Algorithm, AllReduceOptions, Comm, CommConfig};

fn cfg() -> CommConfig {
    CommConfig {
        barrier_timeout: Some(Duration::from_millis(1500)),
        bootstrap_timeout: Duration::from_secs(30),
        ..CommConfig::default()
    }
}

fn world<R: Send>(n: usize, config: CommConfig, body: impl Fn(usize, Comm<Host>) -> R + Sync) -> Vec<R> {
    world_after(n, config, &|_| {}, body)
}

fn world_after<R: Send>(n: usize, config: CommConfig, before: &(dyn Fn(usize) + Sync), body: impl Fn(usize, Comm<Host>) -> R + Sync) -> Vec<R> {
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n).map(|r| { let (id, body, config) = (&id, &body, config.clone());
            s.spawn(move || { before(r); body(r, Comm::<Host>::from_rank(Host::open(r).unwrap(), r, n, id, config).unwrap()) }) }).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Item 1: ranks pinned to 1 and 2 cores, the grid left to peercomm.
#[test]
fn item1_unequal_core_counts() {
    use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
    let mine = sched_getaffinity(None).unwrap();
    let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| mine.is_set(c)).collect();
    assert!(cpus.len() >= 2);
    let n = 65_536;
    let pin = |r: usize| {
        let mut set = CpuSet::new();
        for &c in &cpus[..r + 1] { set.set(c); }
        sched_setaffinity(None, &set).unwrap();
    };
    let outs = world_after(2, CommConfig { max_blocks: None, ..cfg() }, &pin, |r, comm| {
        let dev = comm.device();
        let send = Host::alloc_from(dev, &vec![r as f32 + 1.0; n]).unwrap();
        let mut recv = Host::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        comm.all_reduce_sum(&send, &mut recv, &AllReduceOptions::new().algorithm(Algorithm::OneStage)).unwrap();
        (comm.synchronize(), recv.to_host(dev).unwrap())
    });
    for (r, (sync, out)) in outs.iter().enumerate() {
        let wrong = out.iter().filter(|&&x| x != 3.0).count();
        assert!(wrong == 0 || sync.is_err(), "rank {r}: synchronize {sync:?} with {wrong} of {n} elements wrong");
    }
}

/// Item 2: rank 0 all-reduces 1000 elements, rank 1 500.
#[test]
fn item2_mismatched_lengths() {
    let got = world(2, cfg(), |r, comm| {
        let n = if r == 0 { 1000 } else { 500 };
        let dev = comm.device();
        let send = Host::alloc_from(dev, &vec![1.0f32; n]).unwrap();
        let mut recv = Host::alloc_from(dev, &vec![f32::NAN; n]).unwrap();
        comm.all_reduce_sum(&send, &mut recv, &AllReduceOptions::new().algorithm(Algorithm::OneStage)).unwrap();
        comm.synchronize()
    });
    for (r, g) in got.iter().enumerate() {
        assert!(g.is_err(), "rank {r}: a mismatched call returned {g:?}");
    }
}

/// Item 8: world 3, rank 1 never launches: every error names rank 1.
#[test]
fn item8_the_missing_rank_is_named() {
    let got = world(3, cfg(), |r, comm| {
        let dev = comm.device();
        let mut buf = Host::alloc_from(dev, &vec![1.0f32; 1000]).unwrap();
        if r == 1 { comm.miss_next(); }
        comm.all_reduce_sum_in_place(&mut buf, &AllReduceOptions::new().algorithm(Algorithm::OneStage)).unwrap();
        comm.synchronize()
    });
    for r in [0, 2] {
        let text = got[r].as_ref().unwrap_err().to_string();
        assert!(text.contains("waited for rank 1") || text.contains("waiting for rank 1"), "rank {r}: {text}");
        assert!(!text.contains("  "), "rank {r}: stray spaces in {text:?}");
    }
}

/// Item 10: inputs all -0.0: the bits must not depend on the algorithm.
#[test]
fn item10_one_sign_of_zero() {
    let got = world(2, cfg(), |_r, comm| {
        let dev = comm.device();
        let send = Host::alloc_from(dev, &vec![-0.0f32; 64]).unwrap();
        let mut bits = Vec::new();
        for a in [Algorithm::OneStage, Algorithm::Lamport] {
            let mut recv = Host::alloc_from(dev, &vec![7.0f32; 64]).unwrap();
            comm.all_reduce_sum(&send, &mut recv, &AllReduceOptions::new().algorithm(a)).unwrap();
            comm.synchronize().unwrap();
            bits.push(recv.to_host(dev).unwrap()[0].to_bits());
        }
        bits
    });
    assert_eq!(got[0][0], got[0][1], "one-stage {:#x} against Lamport {:#x}", got[0][0], got[0][1]);
}
