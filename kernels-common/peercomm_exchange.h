// peercomm exchange, written once for both vendors: one rank's sends and receives to and
// from any world ranks in one kernel (send / recv, alone or grouped, and all-to-all).
// Included by the vendor layers after peercomm_collectives.h (the context, the barrier
// with its member policy, the abort protocol). The layout, the pairing of ranks and the
// staging are described at peercomm_exchange_args in include/peercomm_signal.h; the host
// backend's src/backend/host/kernels/exchange.rs is the same algorithm step by step.
//
// Every rank stages what it sends into its own payload, then passes the Publish barrier
// with each peer it exchanges with (each pair alone, with the pair's descriptor), reads
// what each peer sends from that peer's payload, and passes the pair's End barrier, which
// keeps the peer from reusing its payload region before this rank has read it. Where a
// peer reaches the sender's buffer in place (registered or symmetric), the sender stages
// nothing and tells the peer the address instead (exchange_source, before the Publish
// arrival); then a block that gives up waits for that peer's quit before it may end.

#ifndef PEERCOMM_EXCHANGE_H
#define PEERCOMM_EXCHANGE_H

typedef peercomm_exchange_args ExchangeArgs;

static_assert(sizeof(peercomm_exchange_peer) == 96, "peercomm_exchange_peer layout changed");
static_assert(sizeof(peercomm_exchange_args) == 328 + 8 * 96, "peercomm_exchange_args layout changed");

// The barrier members of an exchange: the peers this block moves data with, each with
// the pair's descriptor.
struct ExchangeMembers {
    const ExchangeArgs& x;
    PC_INLINE bool takes_part(const Args& a, uint32_t t) const {
        return t != a.group_rank && blockIdx.x < x.peers[t].blocks;
    }
    PC_INLINE const uint32_t* call(const Args&, uint32_t t) const { return x.peers[t].call; }
};

// Where rank `owner` stages what it sends to rank `to`: region `to` of its payload.
PC_INLINE uint64_t exchange_region(const Args& a, uint32_t owner, uint32_t to) {
    return a.payloads[owner] + (uint64_t)to * a.stage_input;
}

// Copies the n bytes at src to dst, 16-byte pack k by thread k % stride: whole packs
// where both addresses are 16-byte aligned, else 4-byte words where both are 4-byte
// aligned, else bytes. Four packs in flight per iteration.
PC_INLINE void copy_bytes(uint64_t src, uint64_t dst, uint64_t n, uint64_t tid, uint64_t stride) {
    constexpr int G = 4;
    const uint64_t packs = div_ceil_u64(n, 16u);
    const bool vec = aligned16(src) && aligned16(dst);
    const bool words = ((src | dst) & 3u) == 0u;
    for (uint64_t p0 = tid; p0 < packs; p0 += G * stride) {
        Vec16 x[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (vec && p < packs && (p + 1u) * 16u <= n) x[g] = load_vec16(src, p);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (p >= packs) break;
            if (vec && (p + 1u) * 16u <= n) {
                store_vec16(dst, p, x[g]);
                continue;
            }
            const uint64_t end = min_u64(p * 16u + 16u, n);
            uint64_t i = p * 16u;
            if (words) {
                for (; i + 4u <= end; i += 4u) ((GlobalU32*)dst)[i / 4u] = ((const GlobalU32*)src)[i / 4u];
            }
            for (; i < end; ++i) ((PC_GLOBAL uint8_t*)dst)[i] = ((const PC_GLOBAL uint8_t*)src)[i];
        }
    }
}

// This thread's index and the stride among the `blocks` blocks of a pair.
struct PairThreads {
    uint64_t tid;
    uint64_t stride;
};
PC_INLINE PairThreads pair_threads(uint32_t blocks) {
    return PairThreads{(uint64_t)blockIdx.x * blockDim.x + threadIdx.x, (uint64_t)blocks * blockDim.x};
}

// After a failed barrier: if this rank found a pair's descriptors differ (its own record
// is that mismatch, written inside the barrier), the block's other exchange peers passed
// theirs with it and would wait for it until the timeout; each is told to stop
// (PEER_ABORTED, naming this rank), but the peer that differs, which finds the same. Not
// after a timeout (whose record tells every rank) or an abort (the rank that found the
// cause tells its own peers: no echo). Called by every thread of the block.
PC_INLINE void tell_other_peers(Ctx& c, const ExchangeMembers& members) {
    __syncthreads();
    const Args& a = c.a;
    const uint32_t t = threadIdx.x;
    if (t >= a.group_width || !members.takes_part(a, t)) return;
    if (ld_acquire_sys(&c.own->error_state[PEERCOMM_ERROR_CODE]) != PEERCOMM_ERROR_CALL_MISMATCH) return;
    const uint32_t named = ld_relaxed_sys(&c.own->error_state[PEERCOMM_ERROR_RANK]);
    if (t == named) return;
    const CallWords call = call_words(members.call(a, t));
    write_error_record(signal_at(a.signals[t]), PEERCOMM_ERROR_PEER_ABORTED,
                       ErrorDetail{a.world_rank, a.domain, named + 1u, call, call, 1u});
}

// Gives up the exchange: tells the peers (abandon), then, for each peer that may read
// this block's data in place, waits for its quit (bounded by the timeout), so that the
// user never frees a buffer a late peer still reads. Called by every thread of the block.
PC_INLINE void abandon_exchange(Ctx& c, const ExchangeArgs& x) {
    abandon(c, WaitForPeers::No);
    const Args& a = c.a;
    const uint32_t t = threadIdx.x, b = blockIdx.x;
    if (t < a.group_width && t != a.group_rank && b < x.peers[t].blocks && x.peers[t].send_remote != 0u) {
        wait_for_quit(c, b, t);
    }
    __syncthreads();
}

PC_INLINE void exchange(const ExchangeArgs& x) {
    const Args& a = x.all;
    Ctx c = make_ctx(a);
    const ExchangeMembers members{x};
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    const uint32_t me = a.group_rank, width = a.group_width;
    for (uint32_t q = 0; q < width; ++q) {
        const peercomm_exchange_peer& p = x.peers[q];
        if (blockIdx.x >= p.blocks || p.send_bytes == 0u) continue;
        if (q != me && threadIdx.x == 0) {
            // Where q reads this rank's data: the buffer itself, or (0) the region.
            GlobalSignal* peer = signal_at(a.signals[q]);
            st_relaxed_sys(&peer->exchange_source[me][0], (uint32_t)p.send_remote);
            st_relaxed_sys(&peer->exchange_source[me][1], (uint32_t)(p.send_remote >> 32));
        }
        if (q != me && p.send_remote != 0u) continue;
        const PairThreads th = pair_threads(p.blocks);
        // The own part goes straight to the output; a peer's into the own payload.
        const uint64_t to = q == me ? p.recv : exchange_region(a, me, q);
        copy_bytes(p.send, to, p.send_bytes, th.tid, th.stride);
    }
    if (!barrier<BarrierKind::Publish>(c, members)) {
        tell_other_peers(c, members);
        return abandon_exchange(c, x);
    }
    for (uint32_t q = 0; q < width; ++q) {
        const peercomm_exchange_peer& p = x.peers[q];
        if (q == me || blockIdx.x >= p.blocks || p.recv_bytes == 0u) continue;
        const PairThreads th = pair_threads(p.blocks);
        const uint64_t remote = (uint64_t)ld_relaxed_sys(&c.own->exchange_source[q][0]) |
                                ((uint64_t)ld_relaxed_sys(&c.own->exchange_source[q][1]) << 32);
        const uint64_t from = remote != 0u ? remote : exchange_region(a, q, me);
        copy_bytes(from, p.recv, p.recv_bytes, th.tid, th.stride);
    }
    if (!barrier<BarrierKind::End>(c, members)) {
        tell_other_peers(c, members);
        return abandon_exchange(c, x);
    }
    finish(c);
}

// The exchange's entry point: (symbol, device function), as `Kernel::symbol()` names it.
// It moves bytes, so one kernel serves every element type.
#define PEERCOMM_EXCHANGE_KERNELS(X) X(peercomm_exchange_f32, exchange)

#endif  // PEERCOMM_EXCHANGE_H
