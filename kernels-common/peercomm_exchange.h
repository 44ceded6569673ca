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

// Byte copies. A message of n bytes is cut into 16-byte packs counted from its first
// byte; pack k (its bytes [16k, 16k + 16)) is moved by thread k % stride whatever the
// addresses, so that what block b of a sender stages is what block b of the receiver
// reads (the pair's barriers are per block).

// Bytes [I, I + sizeof(U)) of the 16 bytes v (little endian) as one integer U.
template <typename U, int I>
PC_INLINE U bytes_of(Vec16 v) {
    constexpr int kWord = I / 4, kShift = 8 * (I % 4);
    // The (up to) three words that hold the bytes, low first.
    const uint64_t lo = (uint64_t)vec16_word(v, kWord) |
                        (kWord + 1 < 4 ? (uint64_t)vec16_word(v, kWord + 1 < 4 ? kWord + 1 : 3) << 32 : 0u);
    if constexpr (sizeof(U) == 8 && kShift != 0) {
        return (U)((lo >> kShift) | (uint64_t)vec16_word(v, kWord + 2 < 4 ? kWord + 2 : 3) << (64 - kShift));
    } else {
        return (U)(lo >> kShift);
    }
}

// Stores bytes [I, 16) of v at dst + I, where (dst + I) % 8 = M8: each piece as wide as
// its address allows (8, 4, 2 or 1 bytes), so that 16 bytes at any address take at most
// five stores (two where dst is 8-byte aligned).
template <int I, int M8>
PC_INLINE void store_pieces(uint64_t dst, Vec16 v) {
    if constexpr (I < 16) {
        constexpr int kSize = (M8 % 8 == 0 && I + 8 <= 16)   ? 8
                              : (M8 % 4 == 0 && I + 4 <= 16) ? 4
                              : (M8 % 2 == 0 && I + 2 <= 16) ? 2
                                                             : 1;
        if constexpr (kSize == 8) {
            *(PC_GLOBAL uint64_t*)(dst + I) = bytes_of<uint64_t, I>(v);
        } else if constexpr (kSize == 4) {
            *(GlobalU32*)(dst + I) = bytes_of<uint32_t, I>(v);
        } else if constexpr (kSize == 2) {
            *(PC_GLOBAL uint16_t*)(dst + I) = bytes_of<uint16_t, I>(v);
        } else {
            *(PC_GLOBAL uint8_t*)(dst + I) = bytes_of<uint8_t, I>(v);
        }
        store_pieces<I + kSize, (M8 + kSize) % 8>(dst, v);
    }
}

// Stores the 16 bytes v at dst (any alignment) in the widest stores it allows.
PC_INLINE void store_bytes16(uint64_t dst, Vec16 v) {
    switch (dst & 15u) {
        case 0: return store_vec16(dst, 0, v);
        case 8: return store_pieces<0, 0>(dst, v);
        case 4:
        case 12: return store_pieces<0, 4>(dst, v);
        case 2:
        case 10: return store_pieces<0, 2>(dst, v);
        case 6:
        case 14: return store_pieces<0, 6>(dst, v);
        case 1:
        case 9: return store_pieces<0, 1>(dst, v);
        case 3:
        case 11: return store_pieces<0, 3>(dst, v);
        case 5:
        case 13: return store_pieces<0, 5>(dst, v);
        default: return store_pieces<0, 7>(dst, v);
    }
}

// The 16 bytes at offset 4Q + r / 8 of the 32 bytes lo, hi (little endian; r in {0, 8,
// 16, 24}).
template <int Q>
PC_INLINE Vec16 bytes_at(Vec16 lo, Vec16 hi, uint32_t r) {
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint64_t pair = (uint64_t)w[Q + i] | ((uint64_t)w[Q + i + 1] << 32);
        out[i] = (uint32_t)(pair >> r);
    }
    return make_vec16(out[0], out[1], out[2], out[3]);
}

// copy_bytes where src is not 16-byte aligned: the whole packs whose two aligned 16-byte
// source blocks lie inside the message are loaded as those blocks and shifted into
// place (neighbouring bytes are loaded but not used); the packs at the ends byte by
// byte, so that nothing outside [src, src + n) is read. Q = (src % 16) / 4.
template <int Q>
PC_INLINE void copy_bytes_shifted(uint64_t src, uint64_t dst, uint64_t n, uint64_t tid, uint64_t stride) {
    const uint64_t packs = div_ceil_u64(n, 16u);
    const uint32_t r = 8u * (uint32_t)(src & 3u);
    const uint64_t base = src & ~(uint64_t)15u;  // the aligned block of byte 0
    for (uint64_t k = tid; k < packs; k += stride) {
        const uint64_t block = base + 16u * k;
        if (block >= src && block + 32u <= src + n) {
            store_bytes16(dst + 16u * k, bytes_at<Q>(load_vec16(block, 0), load_vec16(block, 1), r));
        } else {
            const uint64_t end = min_u64(16u * k + 16u, n);
            for (uint64_t i = 16u * k; i < end; ++i)
                ((PC_GLOBAL uint8_t*)dst)[i] = ((const PC_GLOBAL uint8_t*)src)[i];
        }
    }
}

// Stores bytes [from, to) of v, byte i at at + i, in the widest pieces their addresses
// allow (at most five).
PC_INLINE void store_byte_range(uint64_t at, Vec16 v, uint32_t from, uint32_t to) {
    const uint64_t lo = (uint64_t)v.x | (uint64_t)v.y << 32, hi = (uint64_t)v.z | (uint64_t)v.w << 32;
    while (from < to) {
        const uint64_t addr = at + from;
        uint32_t size = 8u;
        while (size > 1u && ((addr & (size - 1u)) != 0u || from + size > to)) size >>= 1;
        // Bytes [from, from + size) of the 16, low first.
        const uint64_t bits = from >= 8u ? hi >> (8u * (from - 8u))
                              : from == 0u ? lo
                                           : lo >> (8u * from) | hi << (64u - 8u * from);
        if (size == 8u) {
            *(PC_GLOBAL uint64_t*)addr = bits;
        } else if (size == 4u) {
            *(GlobalU32*)addr = (uint32_t)bits;
        } else if (size == 2u) {
            *(PC_GLOBAL uint16_t*)addr = (uint16_t)bits;
        } else {
            *(PC_GLOBAL uint8_t*)addr = (uint8_t)bits;
        }
        from += size;
    }
}

// copy_bytes where src is 16-byte aligned and dst is not (the receiving side of a part at
// an unaligned place, d = dst % 16): the lanes of a warp hold consecutive packs, and pack
// k's last d bytes with pack k + 1's first 16 - d (from the next lane) make one aligned
// 16-byte store. Only next to a pack the warp does not hold do bytes go in narrower
// pieces: the first lane's first 16 - d bytes, the last lane's (and the last whole
// pack's) last d. Each thread reads only its own packs, so block b still reads what
// block b of the sender staged. Q = (16 - d) / 4. Every thread of the block calls it
// (the lanes of a warp trade packs).
template <int Q>
PC_INLINE void copy_bytes_to_unaligned(uint64_t src, uint64_t dst, uint64_t n, uint64_t tid, uint64_t stride) {
    constexpr int G = 4;
    const uint64_t whole = n / 16u;
    const uint32_t head = 16u - (uint32_t)(dst & 15u);  // bytes of a pack before an aligned address
    const uint32_t r = 8u * (head & 3u);
    const uint32_t lane = threadIdx.x % warp_lanes();
    // k0 + lane is this thread's pack; k0 is the same across the warp.
    for (uint64_t k0 = tid - lane; k0 < whole; k0 += G * stride) {
        Vec16 x[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t k = k0 + g * stride + lane;
            x[g] = k < whole ? load_vec16(src, k) : make_vec16(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t k = k0 + g * stride + lane;
            const Vec16 next = make_vec16(from_next_lane(x[g].x), from_next_lane(x[g].y), from_next_lane(x[g].z),
                                          from_next_lane(x[g].w));
            if (k >= whole) continue;
            const uint64_t at = dst + 16u * k;  // where pack k's bytes go
            if (lane == 0u) store_byte_range(at, x[g], 0u, head);
            if (lane + 1u < warp_lanes() && k + 1u < whole) {
                store_vec16(at + head, 0, bytes_at<Q>(x[g], next, r));
            } else {
                store_byte_range(at, x[g], head, 16u);
            }
        }
    }
    // The last, partial pack: by the thread whose pack it is.
    if (whole * 16u < n && whole % stride == tid) {
        for (uint64_t i = whole * 16u; i < n; ++i) ((PC_GLOBAL uint8_t*)dst)[i] = ((const PC_GLOBAL uint8_t*)src)[i];
    }
}

// Copies the n bytes at src to dst (pack k by thread k % stride): where both are 16-byte
// aligned, whole packs as one 16-byte load and store, four in flight per iteration; where
// src is and dst is not, copy_bytes_to_unaligned; else copy_bytes_shifted. The last,
// partial pack byte by byte. Every thread of the block calls it.
PC_INLINE void copy_bytes(uint64_t src, uint64_t dst, uint64_t n, uint64_t tid, uint64_t stride) {
    switch ((src & 15u) / 4u) {
        case 0:
            if ((src & 3u) == 0u) break;
            return copy_bytes_shifted<0>(src, dst, n, tid, stride);
        case 1: return copy_bytes_shifted<1>(src, dst, n, tid, stride);
        case 2: return copy_bytes_shifted<2>(src, dst, n, tid, stride);
        default: return copy_bytes_shifted<3>(src, dst, n, tid, stride);
    }
    switch ((16u - (uint32_t)(dst & 15u)) / 4u) {
        case 4: break;  // dst aligned
        case 0: return copy_bytes_to_unaligned<0>(src, dst, n, tid, stride);
        case 1: return copy_bytes_to_unaligned<1>(src, dst, n, tid, stride);
        case 2: return copy_bytes_to_unaligned<2>(src, dst, n, tid, stride);
        default: return copy_bytes_to_unaligned<3>(src, dst, n, tid, stride);
    }
    constexpr int G = 4;
    const uint64_t packs = div_ceil_u64(n, 16u);
    for (uint64_t p0 = tid; p0 < packs; p0 += G * stride) {
        Vec16 x[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (p < packs && (p + 1u) * 16u <= n) x[g] = load_vec16(src, p);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (p >= packs) break;
            if ((p + 1u) * 16u <= n) {
                store_bytes16(dst + 16u * p, x[g]);
            } else {
                for (uint64_t i = p * 16u; i < n; ++i)
                    ((PC_GLOBAL uint8_t*)dst)[i] = ((const PC_GLOBAL uint8_t*)src)[i];
            }
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
