// peercomm CUDA kernels: the signal counter-bank barrier, and the one-stage, two-stage
// and Lamport all-reduce, for f32, f16 and bf16 (accumulated in f32).
//
// The layout and the launch arguments come from the one header shared with the HIP
// tree and the Rust side. The host backend (src/backend/host/kernels.rs) is the
// executable specification: same pack distribution, same reduction order, same
// Lamport generations, so every rank and every backend produces the same bits.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "peercomm_signal.h"

typedef peercomm_allreduce_args Args;

#define LAMPORT_SENTINEL 0x80000000u
#define LAMPORT_OFFSET \
    ((sizeof(peercomm_signal) + PEERCOMM_REGION_ALIGN - 1) / PEERCOMM_REGION_ALIGN * PEERCOMM_REGION_ALIGN)

// ---------------------------------------------------------------------------------
// Memory operations at system scope (peers reach this memory over NVLink/PCIe).

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Lamport packs: volatile so every spin iteration goes to memory.
__device__ __forceinline__ uint4 ld_volatile_pack(const void* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ void st_volatile_pack(void* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------------------------
// Element types: raw bits in memory, f32 in registers.

struct F32 {
    typedef uint32_t Bits;
    static constexpr Bits kNegZero = 0x80000000u;
    static __device__ __forceinline__ float to_float(Bits b) { return __uint_as_float(b); }
    static __device__ __forceinline__ Bits from_float(float x) { return __float_as_uint(x); }
};
struct F16 {
    typedef uint16_t Bits;
    static constexpr Bits kNegZero = 0x8000u;
    static __device__ __forceinline__ float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
    static __device__ __forceinline__ Bits from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
};
struct BF16 {
    typedef uint16_t Bits;
    static constexpr Bits kNegZero = 0x8000u;
    static __device__ __forceinline__ float to_float(Bits b) {
        return __bfloat162float(__ushort_as_bfloat16(b));
    }
    static __device__ __forceinline__ Bits from_float(float x) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
};

template <typename D>
struct Pack {
    static constexpr int kLanes = 16 / sizeof(typename D::Bits);
    union {
        uint4 v;
        typename D::Bits e[kLanes];
    };
};

// ---------------------------------------------------------------------------------
// Kernel context: the own signal, what thread 0 read of it at entry (in shared memory),
// and, in threads t < group_width, the barrier counter for peer t kept in a register.

struct Entry {
    uint32_t abort;       // set when a wait of this block timed out (or an earlier one did)
    uint32_t lamport[4];  // lamport_state as read at entry
};

struct Ctx {
    const Args& a;
    peercomm_signal* own;
    volatile Entry* entry;  // __shared__
    uint32_t counter;       // self_counter[domain][block][threadIdx.x], threads t < width
};

__device__ __forceinline__ uint4 ld_volatile_u4(const uint32_t* p) { return ld_volatile_pack(p); }

// Reads, in one trip, the error record and the Lamport state (thread 0) and this
// thread's barrier counter (threads t < width). Returns false (uniformly for the block)
// when this rank already recorded an error: the communicator is poisoned and nothing
// may run until it is re-initialised.
__device__ __forceinline__ bool enter(Ctx& c) {
    const uint32_t t = threadIdx.x;
    if (t < c.a.group_width) c.counter = c.own->self_counter[c.a.domain][blockIdx.x][t];
    if (t == 0) {
        // lamport_state and error_state are adjacent 16-byte words.
        const uint4 lam = ld_volatile_u4(c.own->lamport_state);
        const uint4 err = ld_volatile_u4(c.own->error_state);
        c.entry->lamport[0] = lam.x;
        c.entry->lamport[1] = lam.y;
        c.entry->lamport[2] = lam.z;
        c.entry->lamport[3] = lam.w;
        c.entry->abort = err.x != 0;
    }
    __syncthreads();
    return c.entry->abort == 0;
}

__device__ void record_timeout(Ctx& c) {
    uint32_t* e = c.own->error_state;
    if (atomicCAS_system(&e[PEERCOMM_ERROR_CODE], 0u, 0xffffffffu) == 0u) {
        e[PEERCOMM_ERROR_RANK] = c.a.world_rank;
        e[PEERCOMM_ERROR_BLOCK] = blockIdx.x;
        e[PEERCOMM_ERROR_DOMAIN] = c.a.domain;
        __threadfence_system();
        atomicExch_system(&e[PEERCOMM_ERROR_CODE], (uint32_t)PEERCOMM_ERROR_BARRIER_TIMEOUT);
    }
    c.entry->abort = 1;
}

// Spin helper: true while the caller should keep waiting; records the timeout and
// returns false once `timeout_ns` has passed (or another thread of the block gave up).
struct Waiter {
    uint64_t start = 0;
    uint32_t spins = 0;
    __device__ __forceinline__ bool keep_waiting(Ctx& c) {
        if ((++spins & 255u) != 0u) return true;
        if (c.entry->abort) return false;
        if (c.a.timeout_ns == 0) return true;
        uint64_t now = global_timer_ns();
        if (start == 0) {
            start = now;
        } else if (now - start > c.a.timeout_ns) {
            record_timeout(c);
            return false;
        }
        return true;
    }
};

// The counter barrier of this block across its group. Returns false (uniformly) when a
// wait timed out.
// - kPublish: release/acquire at system scope; everything the block wrote before it is
//   visible to the peers' blocks after it (staged input, two-stage middle).
// - kAfterReads (end barriers): nothing is published, the barrier only keeps the peers
//   from overwriting what this block read. Relaxed is enough: every thread has used
//   the values it loaded before __syncthreads, so its loads are complete.
template <bool kPublish, bool kAfterReads = false>
__device__ bool barrier(Ctx& c) {
    if (kPublish || kAfterReads) __syncthreads();
    const uint32_t t = threadIdx.x;
    const Args& a = c.a;
    if (t < a.group_width) {
        const uint32_t d = a.domain, b = blockIdx.x;
        const uint32_t v = ++c.counter;  // wraps by design
        peercomm_signal* peer = (peercomm_signal*)a.signals[t];
        uint32_t* to_peer = &peer->peer_counter[d][v & 1u][b][a.group_rank];
        if (kPublish) {
            st_release_sys(to_peer, v);
        } else {
            st_relaxed_sys(to_peer, v);
        }
        c.own->self_counter[d][b][t] = v;  // persists for the next kernel
        const uint32_t* from_peer = &c.own->peer_counter[d][v & 1u][b][t];
        Waiter w;
        while ((kPublish ? ld_acquire_sys(from_peer) : ld_relaxed_sys(from_peer)) != v) {
            if (!w.keep_waiting(c)) break;
        }
    }
    __syncthreads();
    return c.entry->abort == 0;
}

// ---------------------------------------------------------------------------------
// Data movement helpers.

__device__ __forceinline__ bool aligned16(uint64_t p) { return (p & 15u) == 0; }

template <typename D>
__device__ __forceinline__ typename D::Bits load_elem(uint64_t base, uint64_t i) {
    return ((const typename D::Bits*)base)[i];
}
template <typename D>
__device__ __forceinline__ void store_elem(uint64_t base, uint64_t i, typename D::Bits x) {
    ((typename D::Bits*)base)[i] = x;
}

__device__ __forceinline__ uint64_t lanes_in_pack(uint64_t p, uint64_t n, int L) {
    const uint64_t first = p * L;
    return n - first < (uint64_t)L ? n - first : (uint64_t)L;
}

// Packs a thread keeps in flight per iteration with W sources: 8 loads of 16 bytes.
template <int W>
struct Unroll {
    static constexpr int G = W >= 8 ? 1 : 8 / W;
};

// out = sum over the W packs of x, in source order (the same order on every rank).
template <typename D, int W>
__device__ __forceinline__ uint4 sum_packs(const uint4 (&x)[W]) {
    constexpr int L = Pack<D>::kLanes;
    Pack<D> in;
    in.v = x[0];
    float acc[L];
#pragma unroll
    for (int j = 0; j < L; ++j) acc[j] = D::to_float(in.e[j]);
#pragma unroll
    for (int s = 1; s < W; ++s) {
        in.v = x[s];
#pragma unroll
        for (int j = 0; j < L; ++j) acc[j] += D::to_float(in.e[j]);
    }
    Pack<D> out;
#pragma unroll
    for (int j = 0; j < L; ++j) out.e[j] = D::from_float(acc[j]);
    return out.v;
}

// Scalar path of one pack (the tail, or unaligned buffers): same order, same rounding.
template <typename D, int W>
__device__ __forceinline__ void reduce_pack_scalar(const uint64_t* srcs, uint64_t p, uint64_t n, uint64_t dst,
                                                   uint64_t dst_p) {
    constexpr int L = Pack<D>::kLanes;
    for (uint64_t e = p * L, j = 0; e < n && j < (uint64_t)L; ++e, ++j) {
        float acc = D::to_float(load_elem<D>(srcs[0], e));
#pragma unroll
        for (int s = 1; s < W; ++s) acc += D::to_float(load_elem<D>(srcs[s], e));
        store_elem<D>(dst, dst_p * L + j, D::from_float(acc));
    }
}

// Reduces packs [first, end) handled by this thread (p = first + tid + k*stride) from
// the W sources into dst at pack (p - dst_base). Each iteration issues the loads of G
// packs of all sources before using any of them.
template <typename D, int W>
__device__ __forceinline__ void reduce_range(const uint64_t* srcs, uint64_t first, uint64_t end, uint64_t n,
                                             uint64_t dst, uint64_t dst_base, bool vec, uint64_t tid,
                                             uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    constexpr int G = Unroll<W>::G;
    for (uint64_t p0 = first + tid; p0 < end; p0 += G * stride) {
        uint4 x[G][W];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (vec && p < end && (p + 1) * L <= n) {
#pragma unroll
                for (int s = 0; s < W; ++s) x[g][s] = ((const uint4*)srcs[s])[p];
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (p >= end) break;
            if (vec && (p + 1) * L <= n) {
                ((uint4*)dst)[p - dst_base] = sum_packs<D, W>(x[g]);
            } else {
                reduce_pack_scalar<D, W>(srcs, p, n, dst, p - dst_base);
            }
        }
    }
}

// Copies packs [first, end) handled by this thread from src (at pack p - src_base) to
// dst (at pack p - dst_base), four packs in flight per iteration.
template <typename D>
__device__ __forceinline__ void copy_range(uint64_t src, uint64_t src_base, uint64_t dst, uint64_t dst_base,
                                           uint64_t first, uint64_t end, uint64_t n, bool vec, uint64_t tid,
                                           uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    constexpr int G = 4;
    for (uint64_t p0 = first + tid; p0 < end; p0 += G * stride) {
        uint4 x[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (vec && p < end && (p + 1) * L <= n) x[g] = ((const uint4*)src)[p - src_base];
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (p >= end) break;
            if (vec && (p + 1) * L <= n) {
                ((uint4*)dst)[p - dst_base] = x[g];
            } else {
                const uint64_t valid = lanes_in_pack(p, n, L);
                for (uint64_t j = 0; j < valid; ++j)
                    store_elem<D>(dst, (p - dst_base) * L + j, load_elem<D>(src, (p - src_base) * L + j));
            }
        }
    }
}

// Runs body.template operator()<W>() with W = the group width as a compile-time constant.
template <typename F>
__device__ __forceinline__ void with_width(uint32_t width, F&& body) {
    switch (width) {
        case 1: body.template operator()<1>(); break;
        case 2: body.template operator()<2>(); break;
        case 3: body.template operator()<3>(); break;
        case 4: body.template operator()<4>(); break;
        case 5: body.template operator()<5>(); break;
        case 6: body.template operator()<6>(); break;
        case 7: body.template operator()<7>(); break;
        default: body.template operator()<8>(); break;
    }
}

// ---------------------------------------------------------------------------------
// One-stage: every rank reads every peer's input and reduces the whole message.

template <typename D>
__device__ void one_stage(const Args& a) {
    __shared__ Entry entry;
    Ctx c{a, (peercomm_signal*)a.signals[a.group_rank], &entry, 0};
    if (!enter(c)) return;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    bool vec = aligned16(a.output) && aligned16(a.local_input);
    for (uint32_t s = 0; s < a.group_width; ++s) vec = vec && aligned16(a.inputs[s]);
    if (a.stage_input) {
        // In place: the peers read a copy in the own payload while this rank overwrites
        // its buffer. Block b copies exactly the packs block b of every rank reads.
        copy_range<D>(a.local_input, 0, a.payloads[a.group_rank], 0, 0, packs, n, vec, tid, stride);
        if (!barrier<true>(c)) return;
    } else {
        if (!barrier<false>(c)) return;
    }
    with_width(a.group_width, [&]<int W>() { reduce_range<D, W>(a.inputs, 0, packs, n, a.output, 0, vec, tid, stride); });
    // The peers' inputs must not change until every rank has read them.
    barrier<false, true>(c);
}

// ---------------------------------------------------------------------------------
// Two-stage: reduce-scatter into the own payload, barrier, all-gather from the peers'
// payloads. Block b reads in the all-gather exactly what block b of the owner wrote.

template <typename D>
__device__ void two_stage(const Args& a) {
    __shared__ Entry entry;
    Ctx c{a, (peercomm_signal*)a.signals[a.group_rank], &entry, 0};
    if (!enter(c)) return;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint64_t part = (packs + width - 1) / width;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    bool vec = aligned16(a.output);
    for (uint32_t s = 0; s < width; ++s) vec = vec && aligned16(a.inputs[s]) && aligned16(a.payloads[s]);
    if (!barrier<false>(c)) return;
    {
        const uint64_t first = me * part, end = min(first + part, packs);
        with_width(width, [&]<int W>() {
            reduce_range<D, W>(a.inputs, first, end, n, a.payloads[me], first, vec, tid, stride);
        });
    }
    if (!barrier<true>(c)) return;
    for (uint32_t q = 0; q < width; ++q) {
        const uint64_t first = q * part, end = min(first + part, packs);
        copy_range<D>(a.payloads[q], first, a.output, 0, first, end, n, vec, tid, stride);
    }
    // The peers' payloads must not change until every rank has gathered them.
    barrier<false, true>(c);
}

// ---------------------------------------------------------------------------------
// Lamport: no barrier. Each rank pushes its packs into slot `group_rank` of every
// other group member's region for generation `flag`; each rank reduces, in source
// order, the peers' packs from its own region once no 32-bit word of a pack is the
// sentinel (its own pack straight from its input), then clears the previous
// generation.

__device__ __forceinline__ uint8_t* lamport_pack_ptr(uint64_t signal, uint32_t slot_bytes, uint32_t gen,
                                                     uint32_t src, uint64_t p) {
    return (uint8_t*)signal + LAMPORT_OFFSET + ((uint64_t)gen * PEERCOMM_MAX_GPUS + src) * slot_bytes + p * 16;
}

__device__ __forceinline__ bool pack_ready(uint4 v) {
    return v.x != LAMPORT_SENTINEL && v.y != LAMPORT_SENTINEL && v.z != LAMPORT_SENTINEL &&
           v.w != LAMPORT_SENTINEL;
}

// Pack p of the own input as it is sent: -0.0 lanes as +0.0 (-0.0 marks "not yet
// written"), lanes past the end zero.
template <typename D>
__device__ __forceinline__ uint4 lamport_source_pack(const Args& a, uint64_t p, uint64_t n, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    Pack<D> x;
    const uint64_t valid = lanes_in_pack(p, n, L);
    if (vec && valid == (uint64_t)L) {
        x.v = ((const uint4*)a.local_input)[p];
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j) x.e[j] = (uint64_t)j < valid ? load_elem<D>(a.local_input, p * L + j) : 0;
    }
#pragma unroll
    for (int j = 0; j < L; ++j)
        if (x.e[j] == D::kNegZero) x.e[j] = 0;
    return x.v;
}

template <typename D, int W>
__device__ __forceinline__ void lamport_reduce(Ctx& c, uint32_t gen, uint64_t packs, uint64_t n, bool vec,
                                               uint64_t tid, uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    const Args& a = c.a;
    const uint32_t me = a.group_rank, slot = a.lamport_slot_bytes;
    const uint64_t own = a.signals[me];
    for (uint64_t p = tid; p < packs && !c.entry->abort; p += stride) {
        uint4 x[W];
        Waiter w;
        bool ready = false;
        while (!ready) {
            ready = true;
#pragma unroll
            for (int s = 0; s < W; ++s) {
                if (s == (int)me) continue;
                x[s] = ld_volatile_pack(lamport_pack_ptr(own, slot, gen, s, p));
                ready = ready && pack_ready(x[s]);
            }
            if (!ready && !w.keep_waiting(c)) break;
        }
        if (!ready) break;
#pragma unroll
        for (int s = 0; s < W; ++s)
            if (s == (int)me) x[s] = lamport_source_pack<D>(a, p, n, vec);
        Pack<D> out;
        out.v = sum_packs<D, W>(x);
        const uint64_t valid = lanes_in_pack(p, n, L);
        if (vec && valid == (uint64_t)L) {
            ((uint4*)a.output)[p] = out.v;
        } else {
            for (uint64_t j = 0; j < valid; ++j) store_elem<D>(a.output, p * L + j, out.e[j]);
        }
    }
}

template <typename D>
__device__ void lamport(const Args& a) {
    __shared__ Entry entry;
    Ctx c{a, (peercomm_signal*)a.signals[a.group_rank], &entry, 0};
    if (!enter(c)) return;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint32_t width = a.group_width, me = a.group_rank, slot = a.lamport_slot_bytes;
    const uint64_t own = a.signals[me];
    const uint32_t gen = entry.lamport[PEERCOMM_LAMPORT_FLAG];
    const uint32_t prev_packs = entry.lamport[PEERCOMM_LAMPORT_PREV_PACKS];
    const uint32_t prev_width = entry.lamport[PEERCOMM_LAMPORT_PREV_WIDTH];
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool vec = aligned16(a.local_input) && aligned16(a.output);

    // Push to every other member.
    for (uint64_t p = tid; p < packs; p += stride) {
        const uint4 x = lamport_source_pack<D>(a, p, n, vec);
        for (uint32_t q = 0; q < width; ++q)
            if (q != me) st_volatile_pack(lamport_pack_ptr(a.signals[q], slot, gen, me, p), x);
    }
    with_width(width, [&]<int W>() { lamport_reduce<D, W>(c, gen, packs, n, vec, tid, stride); });
    // Clear the previous call's generation for the call after next. Its producers are
    // done with it: each of them has since consumed this rank's push of that call,
    // which this rank made after reading that generation. The own slot is never written.
    const uint32_t clear_gen = (gen + PEERCOMM_LAMPORT_GENERATIONS - 1) % PEERCOMM_LAMPORT_GENERATIONS;
    const uint4 sentinel = make_uint4(LAMPORT_SENTINEL, LAMPORT_SENTINEL, LAMPORT_SENTINEL, LAMPORT_SENTINEL);
    const uint64_t clear_total = (uint64_t)prev_width * prev_packs;
    for (uint64_t i = tid; i < clear_total; i += stride) {
        const uint32_t src = (uint32_t)(i / prev_packs);
        if (src == me) continue;
        st_volatile_pack(lamport_pack_ptr(own, slot, clear_gen, src, i % prev_packs), sentinel);
    }
    // The last block to finish advances the state; the next kernel on this stream reads
    // it (kernel boundaries order it). Every block read the state at entry, before its
    // arrival, whose count depends on that read.
    __syncthreads();
    if (threadIdx.x == 0 && !entry.abort) {
        uint32_t* state = c.own->lamport_state;
        const bool last = gridDim.x == 1 || atomicAdd(&state[PEERCOMM_LAMPORT_ARRIVALS], 1u) == gridDim.x - 1;
        if (last) {
            state[PEERCOMM_LAMPORT_PREV_PACKS] = (uint32_t)packs;
            state[PEERCOMM_LAMPORT_PREV_WIDTH] = width;
            state[PEERCOMM_LAMPORT_ARRIVALS] = 0;
            state[PEERCOMM_LAMPORT_FLAG] = (gen + 1) % PEERCOMM_LAMPORT_GENERATIONS;
        }
    }
}

// ---------------------------------------------------------------------------------
// Barrier only: a start and an end barrier (the `barrier` collective and the timeout
// probe).

__device__ void barrier_only(const Args& a) {
    __shared__ Entry entry;
    Ctx c{a, (peercomm_signal*)a.signals[a.group_rank], &entry, 0};
    if (!enter(c)) return;
    if (!barrier<false>(c)) return;
    barrier<true>(c);
}

// ---------------------------------------------------------------------------------
// Flag ping-pong between group ranks 0 and 1 (benchmark of the cross-GPU round trip):
// the first word of each payload is the flag, zeroed by the host before the launch.

extern "C" __global__ void peercomm_pingpong_f32(const Args a) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || a.group_rank > 1 || a.group_width < 2) return;
    uint32_t* mine = (uint32_t*)a.payloads[a.group_rank];
    uint32_t* theirs = (uint32_t*)a.payloads[1 - a.group_rank];
    const uint64_t start = global_timer_ns();
    for (uint32_t i = 1; i <= (uint32_t)a.num_elements; ++i) {
        if (a.group_rank == 0) st_release_sys(theirs, i);
        while (ld_acquire_sys(mine) != i) {
            if (a.timeout_ns != 0 && global_timer_ns() - start > a.timeout_ns) return;
        }
        if (a.group_rank == 1) st_release_sys(theirs, i);
    }
}

// Fault injection: one thread spins for timeout_ns nanoseconds (a rank made late).
extern "C" __global__ void peercomm_delay_f32(const Args a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t start = global_timer_ns();
    while (global_timer_ns() - start < a.timeout_ns) {
    }
}

// ---------------------------------------------------------------------------------
// Exported entry points: peercomm_<algorithm>_<dtype>, as `Kernel::symbol()` names them.

#define PEERCOMM_EXPORT(D, name)                                                                        \
    extern "C" __global__ void __launch_bounds__(512) peercomm_one_stage_##name(const Args a) {      \
        one_stage<D>(a);                                                                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(512) peercomm_two_stage_##name(const Args a) {      \
        two_stage<D>(a);                                                                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(512) peercomm_lamport_##name(const Args a) {        \
        lamport<D>(a);                                                                                 \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(512) peercomm_barrier_##name(const Args a) {        \
        barrier_only(a);                                                                               \
    }

PEERCOMM_EXPORT(F32, f32)
PEERCOMM_EXPORT(F16, f16)
PEERCOMM_EXPORT(BF16, bf16)
