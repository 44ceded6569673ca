//! `--exchange` (per-rank mode): the point-to-point calls against a device-to-device copy
//! of the same bytes, in graph mode, at each size of the sweep (bytes per rank):
//! - `d2d-copy`: `cuMemcpyDtoDAsync` of the rank's message on its own GPU;
//! - `peercomm-per-rank-all-to-all`: equal parts;
//! - `peercomm-per-rank-all-to-all-v`: uneven parts (rank r sends rank q a share in
//!   proportion to 1 + (r + 2q) % world), about the same bytes per rank;
//! - `peercomm-per-rank-sendrecv`: a ring shift (a group of a send to the next rank and a
//!   receive from the one before) of the whole message;
//! - `peercomm-per-rank-all-to-all-symmetric`, `peercomm-per-rank-sendrecv-symmetric`:
//!   the same from a symmetric buffer, which the peers read in place.
//!
//! Each call is checked once per point (inputs are rank + 1, so every part shows its
//! sender), then timed as 50 captured calls a replay.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use peercomm::backend::cuda::Cuda;
use peercomm::backend::TypedBuffer as _;
use peercomm::Comm;

/// What the rows need of the sweep: the rank's communicator and stream, the timing of
/// one graph replay per batch, and how a row is made.
pub(super) struct Sweep<'a> {
    pub(super) comm: &'a Comm<Cuda>,
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) calls: usize,
    /// Median time per call of `launch` (replays of a captured graph), in us.
    pub(super) time: &'a dyn Fn(&dyn Fn()) -> f64,
    /// A row: (implementation, algorithm, us per call).
    pub(super) row: &'a dyn Fn(&str, &str, f64) -> super::Record,
}

/// Rank r's element count for rank q in the uneven all-to-all of `n` elements a rank.
fn uneven(n: usize, world: usize, r: usize, q: usize) -> usize {
    let weight = |q: usize| 1 + (r + 2 * q) % world;
    let total: usize = (0..world).map(weight).sum();
    n * weight(q) / total
}

/// The rows of one size (`n` bf16 elements a rank).
pub(super) fn rows(s: &Sweep<'_>, n: usize) -> Vec<super::Record> {
    let (comm, stream) = (s.comm, s.stream);
    let (rank, world) = (comm.rank(), comm.world_size());
    let part = n / world;
    let filled = |len: usize| -> CudaSlice<bf16> {
        stream
            .clone_htod(&vec![bf16::from_f32(rank as f32 + 1.0); len])
            .unwrap()
    };
    let send = filled(n);
    let mut recv = stream.alloc_zeros::<bf16>(n).unwrap();
    let graph = |body: &mut dyn FnMut() -> peercomm::Result<()>| {
        comm.capture(|| {
            for _ in 0..s.calls {
                body()?;
            }
            Ok(())
        })
        .expect("a captured graph")
        .0
    };
    // One row: `call` once, its output checked (each sender's part holds its rank + 1,
    // in rank order), then captured `s.calls` times and timed.
    let row = |name: &str,
               recv: &mut CudaSlice<bf16>,
               senders: &[(usize, usize)],
               call: &dyn Fn(&mut CudaSlice<bf16>) -> peercomm::Result<()>| {
        call(recv).unwrap();
        comm.synchronize().unwrap();
        let got = stream.clone_dtoh(recv).unwrap();
        let mut at = 0;
        for &(q, len) in senders {
            let want = bf16::from_f32(q as f32 + 1.0);
            assert!(
                got[at..at + len].iter().all(|&x| x == want),
                "rank {rank}: {name} of {n} elements, rank {q}'s part"
            );
            at += len;
        }
        let g = graph(&mut || call(recv));
        let us = (s.time)(&|| g.launch().unwrap());
        (s.row)(&format!("peercomm-per-rank-{name}"), "exchange", us)
    };
    let mut out = Vec::new();

    let copy = graph(&mut || {
        stream.memcpy_dtod(&send, &mut recv).unwrap();
        Ok(())
    });
    out.push((s.row)(
        "d2d-copy",
        "memcpy",
        (s.time)(&|| copy.launch().unwrap()),
    ));
    drop(copy);

    // Equal parts and a ring shift, from a plain buffer (staged) and from a symmetric
    // one (the peers read it in place, nothing staged).
    let counts = vec![part; world];
    let parts: Vec<(usize, usize)> = (0..world).map(|q| (q, part)).collect();
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let mut sym = comm.alloc_symmetric::<bf16>(n).expect("a symmetric buffer");
    sym.copy_from_host(comm.device(), &vec![bf16::from_f32(rank as f32 + 1.0); n])
        .unwrap();
    // The calls take sized buffers: one expansion per source.
    macro_rules! from_source {
        ($source:expr, $suffix:expr) => {{
            let a2a =
                |recv: &mut CudaSlice<bf16>| comm.all_to_all_v($source, &counts, recv, &counts);
            out.push(row(
                &format!("all-to-all{}", $suffix),
                &mut recv,
                &parts,
                &a2a,
            ));
            let ring = |recv: &mut CudaSlice<bf16>| {
                let mut group = comm.group();
                group.send($source, next)?;
                group.recv(recv, prev)?;
                group.end().map(|_| ())
            };
            out.push(row(
                &format!("sendrecv{}", $suffix),
                &mut recv,
                &[(prev, n)],
                &ring,
            ));
        }};
    }
    from_source!(&send, "");
    from_source!(&sym, "-symmetric");

    // Uneven parts, from the plain buffer.
    let sends: Vec<usize> = (0..world).map(|q| uneven(n, world, rank, q)).collect();
    let recvs: Vec<usize> = (0..world).map(|q| uneven(n, world, q, rank)).collect();
    let mut uneven_recv = stream
        .alloc_zeros::<bf16>(recvs.iter().sum::<usize>().max(1))
        .unwrap();
    let from: Vec<(usize, usize)> = recvs.iter().copied().enumerate().collect();
    let a2av = |recv: &mut CudaSlice<bf16>| comm.all_to_all_v(&send, &sends, recv, &recvs);
    out.push(row("all-to-all-v", &mut uneven_recv, &from, &a2av));
    out
}
