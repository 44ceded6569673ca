//! Unaligned views: all-reduces from element 1 or 3 of a buffer, the output one byte
//! further on the host (misaligned for the type; CUDA would fault), checked against the
//! reference with the bytes around the output view untouched.

use peercomm::backend::Backend;
use peercomm::half::f16;
use peercomm::{Algorithm, AllReduceOptions, Comm, Element, ReduceOp};

use super::common::View;
use super::Placement;

/// The little-endian bytes of `values`.
fn bytes_of<T: Element>(values: &[T]) -> Vec<u8> {
    let size = T::DTYPE.size();
    values
        .iter()
        .flat_map(|v| v.to_bits_u32().to_le_bytes()[..size].to_vec())
        .collect()
}

/// The values whose little-endian bytes are `bytes`.
fn values_of<T: Element>(bytes: &[u8]) -> Vec<T> {
    let size = T::DTYPE.size();
    bytes
        .chunks_exact(size)
        .map(|b| {
            let mut w = [0u8; 4];
            w[..size].copy_from_slice(b);
            T::from_bits_u32(u32::from_le_bytes(w))
        })
        .collect()
}

/// Rank `rank`'s element `i`: small integers, so every sum is exact in every type.
fn input<T: Element>(rank: usize, i: usize) -> T {
    T::from_f32(((i * 5 + rank * 3) % 17) as f32 - 8.0)
}

/// One all-reduce of `n` from element `first` into byte `first * size + extra`,
/// checked with the bytes around it.
fn one_call<B: Backend, T: Element>(
    comm: &Comm<B>,
    n: usize,
    first: usize,
    extra: usize,
    algorithm: Algorithm,
) {
    let (dev, world, rank) = (comm.device(), comm.world_size(), comm.rank());
    let size = T::DTYPE.size();
    let what = format!(
        "rank {rank}: {:?} {algorithm:?}, {n} elements, input from element {first}, output \
         from byte {}",
        T::DTYPE,
        first * size + extra
    );
    let padded: Vec<T> = (0..first + n + 1)
        .map(|i| {
            i.checked_sub(first)
                .filter(|&i| i < n)
                .map_or(T::from_f32(99.0), |i| input(rank, i))
        })
        .collect();
    let send = B::alloc_from(dev, &padded).unwrap();
    let sentinel = vec![T::from_f32(99.0); first + n + 1];
    let mut recv = B::alloc_from(dev, &sentinel).unwrap();
    let at = first * size + extra;
    let view_in = View::at_byte(&send, first * size, n);
    let mut view_out = View::at_byte(&mut recv, at, n);
    let opts = AllReduceOptions::new().algorithm(algorithm);
    let ran = comm.all_reduce_with(&view_in, &mut view_out, &ReduceOp::Sum, &opts);
    assert_eq!(ran, Ok(algorithm), "{what}");
    comm.synchronize().expect(&what);
    let out = bytes_of(&B::download(dev, &recv).unwrap());
    let before = bytes_of(&sentinel);
    assert_eq!(out[..at], before[..at], "{what}: written before the view");
    let end = at + n * size;
    assert_eq!(out[end..], before[end..], "{what}: written after the view");
    let got = values_of::<T>(&out[at..end]);
    for (i, g) in got.iter().enumerate() {
        let want: f64 = (0..world)
            .map(|r| f64::from(input::<T>(r, i).to_f32()))
            .sum();
        assert_eq!(f64::from(g.to_f32()), want, "{what}: element {i}");
    }
}

/// Views from elements 1 and 3 (f16, f32; one-stage, Lamport; partial last pack), the
/// output `extra` bytes further, world 2.
pub fn misaligned_views<B: Backend>(place: &Placement, extra: usize) {
    super::with_world::<B, _>(place, 2, |_rank, comm| {
        for first in [1, 3] {
            for algorithm in [Algorithm::OneStage, Algorithm::Lamport] {
                one_call::<B, f16>(&comm, 37, first, extra, algorithm);
                one_call::<B, f32>(&comm, 37, first, extra, algorithm);
            }
        }
    });
}
