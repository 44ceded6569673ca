//! `Comm::trim_symmetric`: a segment holding a buffer on any rank stays, others are
//! freed everywhere; the pool works after; an allocation against a trim is refused.

use peercomm::backend::{Backend, TypedBuffer};
use peercomm::bootstrap::BootstrapError::ExchangeMismatch;
use peercomm::{Error, SYMMETRIC_SEGMENT_BYTES};

use super::{check_rank_sum, with_world, Placement};

pub fn frees_only_segments_empty_everywhere<B: Backend>(place: &Placement, world: usize) {
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let segment = SYMMETRIC_SEGMENT_BYTES as u64;
        let note = format!("rank {rank}: an empty pool");
        assert_eq!(comm.trim_symmetric().unwrap(), 0, "{note}");
        let a = comm.alloc_symmetric::<f32>(16).unwrap();
        let held = comm.registrations();
        assert_eq!(held.0, 1, "rank {rank}: one segment");
        // Held on every rank: nothing freed.
        assert_eq!(comm.trim_symmetric().unwrap(), 0, "rank {rank}");
        assert_eq!(comm.registrations(), held, "rank {rank}");
        // Dropped on every rank but rank 0: still nothing freed, on any rank.
        let a = (rank == 0).then_some(a);
        let note = format!("rank {rank}: rank 0 holds one");
        assert_eq!(comm.trim_symmetric().unwrap(), 0, "{note}");
        assert_eq!(comm.registrations(), held, "rank {rank}");
        drop(a);
        // Empty everywhere: freed everywhere, mappings of the peers' segments too.
        assert_eq!(comm.trim_symmetric().unwrap(), segment, "rank {rank}");
        assert_eq!(comm.registrations(), (0, 0), "rank {rank}");
        // A rank that allocates where its peers trim: two different collective calls,
        // the bootstrap's exchange mismatch on every rank, in step.
        let got = if rank == 0 {
            comm.alloc_symmetric::<f32>(16).map(drop)
        } else {
            comm.trim_symmetric().map(drop)
        };
        let holds = matches!(got, Err(Error::Bootstrap(ExchangeMismatch { .. })));
        assert!(holds, "rank {rank}: {got:?}");
        assert_eq!(comm.registrations(), (0, 0), "rank {rank}");
        // The pool works after: a new segment, read in place.
        let mut s = comm.alloc_symmetric::<f32>(1000).unwrap();
        s.copy_from_host(dev, &[rank as f32 + 1.0; 1000]).unwrap();
        check_rank_sum(&comm, &s);
        drop(s);
        assert_eq!(comm.trim_symmetric().unwrap(), segment, "rank {rank}");
    });
}
