//! The exchange ([`KernelKind::Exchange`]): one rank's sends and receives, to and from
//! any world ranks, as one kernel, each pair of ranks synchronised alone with the pair's
//! descriptor (`peercomm_exchange_args` in the header). What a rank sends to world rank
//! q is staged in region q of its payload (`payload_bytes / world`, whole packs); a
//! pair whose message is larger runs in chunks of a region, chunk k in the rank's k-th
//! launch, which both ranks of the pair count alike. What a peer reaches in place (a
//! registered or symmetric send buffer) is not staged: the peer reads it there, in the
//! same chunks.

use std::sync::atomic::Ordering;

use crate::backend::{Backend, Kernel, KernelKind, WideArgs};
use crate::dispatch;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::signal::{ExchangeArgs, ExchangePeer, CALL_WORDS, MAX_GPUS, PACK_BYTES};

use crate::comm::core::call;
use crate::comm::core::Rank;

/// One direction of a pair: where the data is (or goes), its type and length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Transfer {
    pub(crate) ptr: u64,
    pub(crate) dtype: DType,
    pub(crate) elements: usize,
}

impl Transfer {
    fn bytes(&self) -> usize {
        self.elements * self.dtype.size()
    }
}

/// What this rank moves with one world rank in one exchange (with itself: a local copy
/// from `send` to `recv`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PeerOps {
    pub(crate) send: Option<Transfer>,
    pub(crate) recv: Option<Transfer>,
    /// The blocks the call asked for (else chosen from the larger direction's size).
    pub(crate) blocks: Option<u32>,
    /// Where the peer reaches `send` in place (a registered or symmetric buffer, its
    /// address there), or 0: staged through the payload.
    pub(crate) send_remote: u64,
}

impl PeerOps {
    /// Whether anything moves (a transfer of no elements moves nothing).
    fn active(&self) -> bool {
        let moves = |t: &Option<Transfer>| t.is_some_and(|t| t.elements > 0);
        moves(&self.send) || moves(&self.recv)
    }
}

impl<B: Backend> Rank<B> {
    /// Launches `ops` (indexed by world rank) as one exchange, or, where a pair's
    /// message is larger than a payload region, as many as its chunks (the checks are
    /// the caller's: buffers, lengths, peers in range, no overlaps).
    pub(crate) fn exchange(&self, ops: &[PeerOps; MAX_GPUS]) -> Result<()> {
        let (settings, e) = (&self.settings, &self.endpoint);
        let (world, me) = (settings.world, e.index);
        let region = (settings.layout.payload_bytes / world) / PACK_BYTES * PACK_BYTES;
        if region == 0 || region > u32::MAX as usize {
            return Err(Error::Unsupported(format!(
                "send / recv stage through payload regions of payload_bytes / world bytes: \
                 {} bytes over {world} ranks",
                settings.layout.payload_bytes
            )));
        }
        let chunks = |q: usize| -> usize {
            let o = &ops[q];
            if q == me || !o.active() {
                return usize::from(o.active());
            }
            let n = |t: &Option<Transfer>| t.map_or(0, |t| t.bytes().div_ceil(region));
            n(&o.send).max(n(&o.recv)).max(1)
        };
        let launches = (0..world).map(chunks).max().unwrap_or(0);
        for k in 0..launches {
            let mut args = ExchangeArgs::default();
            let mut blocks = 1;
            for q in (0..world).filter(|&q| k < chunks(q)) {
                let peer = self.pair_entry(q, &ops[q], k, region);
                blocks = blocks.max(peer.blocks);
                args.peers[q] = peer;
            }
            args.all = self.exchange_common(region);
            self.check_usable()?;
            let kernel = Kernel {
                kind: KernelKind::Exchange,
                dtype: DType::F32,
            };
            B::launch_wide(
                &e.device,
                kernel,
                settings.dims(blocks),
                WideArgs::Exchange(&args),
            )?;
        }
        Ok(())
    }

    /// The arguments every block reads: the whole world's signals and payloads, this
    /// rank, domain 0, the region size and the exchange's summary descriptor (the same
    /// on every rank: a peer whose wait for this one gives up sees an exchange).
    fn exchange_common(&self, region: usize) -> crate::signal::AllReduceArgs {
        let (settings, e) = (&self.settings, &self.endpoint);
        let payload_off = settings.layout.payload_offset() as u64;
        let mut all = crate::signal::AllReduceArgs {
            timeout_ns: settings.timeout_ns(),
            lamport_slot_bytes: settings.layout.lamport_slot_bytes as u32,
            group_rank: e.index as u32,
            group_width: settings.world as u32,
            domain: 0,
            world_rank: e.index as u32,
            stage_input: region as u32,
            call: call::encode_exchange_summary(settings.world),
            ..Default::default()
        };
        for k in 0..settings.world {
            all.signals[k] = e.peer_signals[k];
            all.payloads[k] = e.peer_signals[k] + payload_off;
        }
        all
    }

    /// Chunk `k` of the pair with world rank `q` (this rank itself: the whole local
    /// copy), with the pair's descriptor.
    fn pair_entry(&self, q: usize, o: &PeerOps, k: usize, region: usize) -> ExchangePeer {
        let (settings, me) = (&self.settings, self.endpoint.index);
        let part = |t: &Option<Transfer>| -> (u64, u64) {
            let Some(t) = t else { return (0, 0) };
            if q == me {
                return (t.ptr, t.bytes() as u64);
            }
            let first = (k * region).min(t.bytes());
            let end = ((k + 1) * region).min(t.bytes());
            (t.ptr + first as u64, (end - first) as u64)
        };
        let ((send, send_bytes), (recv, recv_bytes)) = (part(&o.send), part(&o.recv));
        // Both ranks of a pair size its grid from the larger direction's whole message.
        let largest = [o.send, o.recv]
            .iter()
            .flatten()
            .map(|t| t.bytes().min(if q == me { usize::MAX } else { region }))
            .max()
            .unwrap_or(0);
        let threads = settings.config.threads_per_block;
        let blocks = o.blocks.unwrap_or_else(|| {
            dispatch::blocks_for(largest.div_ceil(PACK_BYTES), threads, settings.max_blocks)
        });
        // A chunk read in place starts where the staged one would.
        let send_remote = match (q == me, o.send_remote, o.send) {
            (false, remote, Some(t)) if remote != 0 => remote + (send - t.ptr),
            _ => 0,
        };
        let mut peer = ExchangePeer {
            send,
            send_bytes,
            recv,
            recv_bytes,
            blocks,
            send_remote,
            ..Default::default()
        };
        if q != me {
            let seq = self.endpoint.pair_calls[q].fetch_add(1, Ordering::Relaxed);
            peer.call = pair_call(me, q, o, blocks, seq, settings.world);
        }
        peer
    }
}

/// The descriptor of the pair (`me`, `q`) for this rank's `ops` with q: the same on
/// both ranks when each receives what the other sends.
fn pair_call(
    me: usize,
    q: usize,
    o: &PeerOps,
    blocks: u32,
    seq: u64,
    world: usize,
) -> [u32; CALL_WORDS] {
    let shape = |t: &Option<Transfer>| t.filter(|t| t.elements > 0).map(|t| (t.dtype, t.elements));
    // What the lower rank sends, then what the higher one sends.
    let (low_sends, high_sends) = match me < q {
        true => (shape(&o.send), shape(&o.recv)),
        false => (shape(&o.recv), shape(&o.send)),
    };
    call::encode_pair(call::Pair {
        seq: seq.wrapping_add(1),
        ranks: (me.min(q), me.max(q)),
        low_sends,
        high_sends,
        blocks,
        world,
    })
}
