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
    let check = |what: &str, got: &CudaSlice<bf16>, senders: &[(usize, usize)]| {
        let got = stream.clone_dtoh(got).unwrap();
        let mut at = 0;
        for &(q, len) in senders {
            let want = bf16::from_f32(q as f32 + 1.0);
            assert!(
                got[at..at + len].iter().all(|&x| x == want),
                "rank {rank}: {what} of {n} elements, rank {q}'s part"
            );
            at += len;
        }
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

    let counts = vec![part; world];
    let a2a = |recv: &mut CudaSlice<bf16>| comm.all_to_all_v(&send, &counts, recv, &counts);
    a2a(&mut recv).unwrap();
    comm.synchronize().unwrap();
    check(
        "all-to-all",
        &recv,
        &(0..world).map(|q| (q, part)).collect::<Vec<_>>(),
    );
    let g = graph(&mut || a2a(&mut recv));
    let us = (s.time)(&|| g.launch().unwrap());
    out.push((s.row)("peercomm-per-rank-all-to-all", "exchange", us));
    drop(g);

    let sends: Vec<usize> = (0..world).map(|q| uneven(n, world, rank, q)).collect();
    let recvs: Vec<usize> = (0..world).map(|q| uneven(n, world, q, rank)).collect();
    let mut uneven_recv = stream
        .alloc_zeros::<bf16>(recvs.iter().sum::<usize>().max(1))
        .unwrap();
    let a2av = |recv: &mut CudaSlice<bf16>| comm.all_to_all_v(&send, &sends, recv, &recvs);
    a2av(&mut uneven_recv).unwrap();
    comm.synchronize().unwrap();
    let from: Vec<(usize, usize)> = recvs.iter().copied().enumerate().collect();
    check("all-to-all-v", &uneven_recv, &from);
    let g = graph(&mut || a2av(&mut uneven_recv));
    let us = (s.time)(&|| g.launch().unwrap());
    out.push((s.row)("peercomm-per-rank-all-to-all-v", "exchange", us));
    drop(g);

    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let ring = |recv: &mut CudaSlice<bf16>| {
        let mut group = comm.group();
        group.send(&send, next)?;
        group.recv(recv, prev)?;
        group.end().map(|_| ())
    };
    ring(&mut recv).unwrap();
    comm.synchronize().unwrap();
    check("send/recv", &recv, &[(prev, n)]);
    let g = graph(&mut || ring(&mut recv));
    let us = (s.time)(&|| g.launch().unwrap());
    out.push((s.row)("peercomm-per-rank-sendrecv", "exchange", us));
    drop(g);

    // The same from a symmetric buffer: the peers read it in place (nothing staged).
    let mut sym = comm.alloc_symmetric::<bf16>(n).expect("a symmetric buffer");
    sym.copy_from_host(comm.device(), &vec![bf16::from_f32(rank as f32 + 1.0); n])
        .unwrap();
    let a2a = |recv: &mut CudaSlice<bf16>| comm.all_to_all_v(&sym, &counts, recv, &counts);
    a2a(&mut recv).unwrap();
    comm.synchronize().unwrap();
    let parts: Vec<(usize, usize)> = (0..world).map(|q| (q, part)).collect();
    check("all-to-all from a symmetric buffer", &recv, &parts);
    let g = graph(&mut || a2a(&mut recv));
    let us = (s.time)(&|| g.launch().unwrap());
    out.push((s.row)(
        "peercomm-per-rank-all-to-all-symmetric",
        "exchange",
        us,
    ));
    drop(g);
    let ring = |recv: &mut CudaSlice<bf16>| {
        let mut group = comm.group();
        group.send(&sym, next)?;
        group.recv(recv, prev)?;
        group.end().map(|_| ())
    };
    ring(&mut recv).unwrap();
    comm.synchronize().unwrap();
    check("send/recv from a symmetric buffer", &recv, &[(prev, n)]);
    let g = graph(&mut || ring(&mut recv));
    let us = (s.time)(&|| g.launch().unwrap());
    out.push((s.row)(
        "peercomm-per-rank-sendrecv-symmetric",
        "exchange",
        us,
    ));
    out
}
