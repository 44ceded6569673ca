//! `--sum-types` (per-rank mode): the sum over other element types against f32 of the
//! same bytes, staged, in graph mode (rows `peercomm-per-rank-sum-<type>`, with
//! `peercomm-per-rank-sum-f32` as the baseline). Every rank's input is rank + 1, so the
//! sum is `world (world + 1) / 2` in every type; each point is checked once.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use peercomm::{Element, ReduceOp};

use super::exchange::Sweep;

/// The rows of one size (`bytes` a rank): f32 first, then each of `types` (names as
/// `DType::name` gives them: i8, u8, i32, u32, i64, u64, f64, f16, bf16).
pub(super) fn rows(s: &Sweep<'_>, bytes: usize, types: &[String]) -> Vec<super::Record> {
    let mut out = vec![row::<f32>(s, bytes)];
    for name in types {
        let row = match name.as_str() {
            "f32" => continue,
            "i8" => row::<i8>,
            "u8" => row::<u8>,
            "i32" => row::<i32>,
            "u32" => row::<u32>,
            "i64" => row::<i64>,
            "u64" => row::<u64>,
            "f64" => row::<f64>,
            "f16" => row::<half::f16>,
            "bf16" => row::<half::bf16>,
            other => panic!("--sum-types: {other} is not an element type"),
        };
        out.push(row(s, bytes));
    }
    out
}

/// The sum of `bytes` of `T` a rank, checked, then timed as captured calls.
fn row<T>(s: &Sweep<'_>, bytes: usize) -> super::Record
where
    T: Element + DeviceRepr + ValidAsZeroBits,
{
    let (comm, stream) = (s.comm, s.stream);
    let (rank, world) = (comm.rank(), comm.world_size());
    let n = bytes / T::DTYPE.size();
    let send = stream
        .clone_htod(&vec![T::from_f64(rank as f64 + 1.0); n])
        .unwrap();
    let mut recv = stream.alloc_zeros::<T>(n).unwrap();
    let ran = comm.all_reduce(&send, &mut recv, &ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    let want = (world * (world + 1) / 2) as f64;
    let got = stream.clone_dtoh(&recv).unwrap();
    assert!(
        got.iter().all(|x| x.to_f64() == want),
        "rank {rank}: wrong {} sum at {bytes} B",
        T::DTYPE.name()
    );
    let graph = comm
        .capture(|| {
            for _ in 0..s.calls {
                comm.all_reduce(&send, &mut recv, &ReduceOp::Sum)?;
            }
            Ok(())
        })
        .expect("a captured graph")
        .0;
    let us = (s.time)(&|| graph.launch().unwrap());
    let name = format!("peercomm-per-rank-sum-{}", T::DTYPE.name());
    (s.row)(&name, ran.name(), us)
}
