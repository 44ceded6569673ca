// peercomm HIP kernels for AMD Instinct GPUs (gfx90a, gfx942, gfx950): the signal
// counter-bank barrier and the one-stage, two-stage and Lamport all-reduce over f32,
// f16 and bf16 (accumulated in f32).
//
// The memory layout and the launch arguments come from include/peercomm_signal.h, the
// header the CUDA tree and the Rust mirror share. The host backend
// (src/backend/host/kernels.rs) is the executable specification these kernels follow:
// the same pack distribution over blocks, the same reduction order (acc = in[0];
// acc += in[s] for s = 1..width, in f32) and the same Lamport generations, so every
// rank of a group writes the same bits.
//
// AMD specifics:
// - Wavefronts are 64 lanes; the all-reduce blocks are multiples of 64 threads (the
//   communicator checks). The barrier's counter work is done by lanes
//   t < group_width (<= 8) of the first wavefront of each block.
// - Ordering uses the clang `__hip_atomic_*` builtins at system scope, which lower to
//   the cache write-back / invalidate sequences of the AMDGPU memory model
//   (buffer_wbl2 / buffer_invl2 on gfx90a, buffer_wbl2 sc0 sc1 / buffer_inv sc0 sc1
//   on gfx942). tests/hip.rs checks the disassembly of the barrier kernel for them.
// - The signal allocation (counters, Lamport region and payload) is uncached device
//   memory (hipDeviceMallocUncached, or fine-grained on older runtimes), so spins see
//   the peers' stores and peers see ours without cache maintenance in between.
// - Data moves in 16-byte packs (global_load_dwordx4 / global_store_dwordx4); the
//   last, partial pack of a message is moved lane by lane.
// - Barrier timeouts read the constant-rate wall clock (s_memrealtime, 100 MHz on the
//   Instinct parts); the host overwrites `peercomm_wall_clock_khz` after loading the
//   module when the runtime reports the rate.

#include <hip/hip_runtime.h>
#include <stdint.h>

#include "peercomm_signal.h"

typedef peercomm_allreduce_args Args;

static_assert(sizeof(peercomm_signal) == 819456, "peercomm_signal layout changed");
static_assert(sizeof(peercomm_allreduce_args) == 256, "peercomm_allreduce_args layout changed");

#define PC_SENTINEL 0x80000000u
#define PC_LAMPORT_OFFSET                                                     \
    ((sizeof(peercomm_signal) + PEERCOMM_REGION_ALIGN - 1) / PEERCOMM_REGION_ALIGN * \
     PEERCOMM_REGION_ALIGN)
#define PC_INLINE __device__ __attribute__((always_inline)) inline
// Global (device) address space: the addresses in the launch arguments are plain
// integers, and without this the compiler would use the slower flat instructions.
#define PC_GLOBAL __attribute__((address_space(1)))

// Rate of the wall clock in kHz. Set by the host (hipModuleGetGlobal) after loading the
// module from hipDeviceAttributeWallClockRate; the default is the Instinct rate.
extern "C" __device__ uint32_t peercomm_wall_clock_khz = 100000;

// 16 bytes as four 32-bit words: one global_load_dwordx4 / global_store_dwordx4.
typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));

typedef PC_GLOBAL peercomm_signal GSignal;
typedef PC_GLOBAL uint32_t GWord;

PC_INLINE GSignal* signal_at(uint64_t addr) { return (GSignal*)addr; }

// Set when a wait of this block timed out (or the rank was already poisoned): the block
// leaves at the next uniform point. One per block, in LDS.
__shared__ uint32_t pc_block_abort;

PC_INLINE uint32_t block_aborted() {
    return __hip_atomic_load(&pc_block_abort, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
PC_INLINE void set_block_abort(uint32_t v) {
    __hip_atomic_store(&pc_block_abort, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}

// ---------------------------------------------------------------------------------
// Memory operations on signal words. Scope is always system: peers reach these words
// over xGMI / PCIe.

PC_INLINE uint32_t load_relaxed(const GWord* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
PC_INLINE uint32_t load_acquire(const GWord* p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
PC_INLINE void store_relaxed(GWord* p, uint32_t v) {
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// A release is "buffer_wbl2; s_waitcnt vmcnt(0); store" on gfx9 (AMDGPUUsage), but LLVM
// does not count buffer_wbl2 in vmcnt (fixed upstream by llvm-project#178316, after the
// compilers used here) and drops that wait when nothing else is outstanding, letting
// the store overtake the write-back. So: the release fence, an explicit wait, then the
// store. The empty asm computes address and value before the fence, keeping the three
// together.
PC_INLINE void store_release(GWord* p, uint32_t v) {
    asm volatile("" : "+v"(p), "+v"(v));
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "");  // "": system scope
#if defined(__GFX9__)
    __builtin_amdgcn_s_waitcnt(0x0f70);  // vmcnt(0) only (gfx9 encoding)
#endif
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// A Lamport pack: volatile so that every iteration of a spin reads memory again. The
// 16-byte access is one instruction, so no 32-bit word of it is ever torn.
PC_INLINE u32x4 load_volatile_pack(const PC_GLOBAL u32x4* p) { return *(const volatile PC_GLOBAL u32x4*)p; }
PC_INLINE void store_pack_to(PC_GLOBAL u32x4* p, u32x4 v) { *(volatile PC_GLOBAL u32x4*)p = v; }

PC_INLINE uint64_t wall_clock() { return (uint64_t)wall_clock64(); }

// ---------------------------------------------------------------------------------
// Element types: raw bits in memory, f32 in registers. Conversions round to nearest
// even, as the `half` crate does on the host.

struct F32 {
    typedef uint32_t Bits;
    static constexpr Bits kNegZero = 0x80000000u;
    static PC_INLINE float to_float(Bits b) { return __builtin_bit_cast(float, b); }
    static PC_INLINE Bits from_float(float x) { return __builtin_bit_cast(Bits, x); }
};

struct F16 {
    typedef uint16_t Bits;
    static constexpr Bits kNegZero = 0x8000u;
    static PC_INLINE float to_float(Bits b) { return (float)__builtin_bit_cast(_Float16, b); }
    static PC_INLINE Bits from_float(float x) { return __builtin_bit_cast(Bits, (_Float16)x); }
};

struct BF16 {
    typedef uint16_t Bits;
    static constexpr Bits kNegZero = 0x8000u;
    static PC_INLINE float to_float(Bits b) { return __builtin_bit_cast(float, (uint32_t)b << 16); }
    static PC_INLINE Bits from_float(float x) {
        const uint32_t u = __builtin_bit_cast(uint32_t, x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (Bits)((u >> 16) | 0x0040u);  // quiet NaN
        return (Bits)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};

// One 16-byte pack seen as lanes of an element type. Lanes are read and written with
// shifts on the four words (always with constant lane indices after unrolling), so the
// pack stays in registers: a union with an array of 16-bit lanes would make older
// compilers keep it in memory.
template <typename D>
struct Pack {
    static constexpr int kLanes = 16 / sizeof(typename D::Bits);
    static constexpr int kPerWord = kLanes / 4;
    static constexpr int kBits = 32 / kPerWord;
    u32x4 w;

    PC_INLINE typename D::Bits get(int j) const {
        const uint32_t word = w[j / kPerWord];
        return (typename D::Bits)(kPerWord == 1 ? word : word >> (kBits * (j % kPerWord)));
    }
    PC_INLINE void set(int j, typename D::Bits x) {
        if (kPerWord == 1) {
            w[j] = x;
        } else {
            const int shift = kBits * (j % kPerWord);
            const uint32_t mask = ((1u << kBits) - 1u) << shift;
            w[j / kPerWord] = (w[j / kPerWord] & ~mask) | ((uint32_t)x << shift);
        }
    }
};

// ---------------------------------------------------------------------------------
// Per-block context: the launch arguments and this rank's signal.

struct Ctx {
    const Args& a;
    GSignal* own;
};

// False, for the whole block, when this rank has recorded an error: the communicator is
// poisoned until it is re-initialised, so the kernel does nothing.
PC_INLINE bool enter(Ctx& c) {
    if (threadIdx.x == 0) set_block_abort(load_relaxed(&c.own->error_state[PEERCOMM_ERROR_CODE]) != 0u);
    __syncthreads();
    return block_aborted() == 0u;
}

// The first wait of this rank to give up writes the error record (rank, block, domain,
// then the code with release), as the host backend's record_timeout does.
PC_INLINE void record_timeout(Ctx& c) {
    GWord* e = c.own->error_state;
    uint32_t expected = 0;
    // Relaxed: the record is published by the release of the code below (an acq_rel
    // claim would also be a release missing its wait after buffer_wbl2).
    if (__hip_atomic_compare_exchange_strong(&e[PEERCOMM_ERROR_CODE], &expected, 0xffffffffu,
                                             __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                             __HIP_MEMORY_SCOPE_SYSTEM)) {
        store_relaxed(&e[PEERCOMM_ERROR_RANK], c.a.world_rank);
        store_relaxed(&e[PEERCOMM_ERROR_BLOCK], blockIdx.x);
        store_relaxed(&e[PEERCOMM_ERROR_DOMAIN], c.a.domain);
        store_release(&e[PEERCOMM_ERROR_CODE], (uint32_t)PEERCOMM_ERROR_BARRIER_TIMEOUT);
    }
    set_block_abort(1u);
}

// Bounds one spin: keep_waiting() is false once the block has given up (another lane
// timed out) or once `timeout_ns` has passed, in which case it records the timeout.
struct Waiter {
    uint64_t start = 0;
    uint64_t limit = 0;  // wall-clock ticks; 0 = wait forever
    uint32_t spins = 0;

    PC_INLINE bool keep_waiting(Ctx& c) {
        if ((++spins & 63u) != 0u) return true;
        if (block_aborted()) return false;
        if (c.a.timeout_ns == 0) return true;
        const uint64_t now = wall_clock();
        if (limit == 0) {
            // us * kHz / 1000 ticks, saturating (microsecond resolution is plenty).
            const uint64_t us = c.a.timeout_ns / 1000u + 1u, khz = peercomm_wall_clock_khz;
            limit = us > ~0ull / khz ? ~0ull : us * khz / 1000u + 1u;
            start = now;
            return true;
        }
        if (now - start > limit) {
            record_timeout(c);
            return false;
        }
        return true;
    }
};

// The counter barrier of this block across its group, in barrier domain `a.domain`.
// Lane t < width increments self_counter[d][b][t] to v, stores v into peer t's
// peer_counter[d][v % 2][b][group_rank] and spins until its own
// peer_counter[d][v % 2][b][t] == v. kPublish makes the store a system-scope release
// and the spin a system-scope acquire: what the block wrote before the barrier is
// visible to the peers' blocks after it (and what it read is read before they
// overwrite). Returns false, for the whole block, when a wait timed out.
template <bool kPublish>
__device__ bool barrier(Ctx& c) {
    if (kPublish) __syncthreads();  // every lane's accesses precede the release
    const Args& a = c.a;
    const uint32_t t = threadIdx.x;
    if (t < a.group_width) {
        const uint32_t d = a.domain, b = blockIdx.x;
        GWord* self = &c.own->self_counter[d][b][t];
        const uint32_t v = *self + 1u;  // u32 wrap-around is part of the protocol
        *self = v;
        GWord* to_peer = &signal_at(a.signals[t])->peer_counter[d][v & 1u][b][a.group_rank];
        if (kPublish) {
            store_release(to_peer, v);
        } else {
            store_relaxed(to_peer, v);
        }
        const GWord* from_peer = &c.own->peer_counter[d][v & 1u][b][t];
        Waiter w;
        while ((kPublish ? load_acquire(from_peer) : load_relaxed(from_peer)) != v) {
            if (!w.keep_waiting(c)) break;
        }
    }
    __syncthreads();
    return block_aborted() == 0u;
}

// ---------------------------------------------------------------------------------
// Data movement.

PC_INLINE bool aligned16(uint64_t p) { return (p & 15u) == 0; }

PC_INLINE uint64_t lanes_in_pack(uint64_t p, uint64_t n, uint64_t lanes) {
    const uint64_t first = p * lanes;
    return n - first < lanes ? n - first : lanes;
}

template <typename D>
PC_INLINE typename D::Bits load_elem(uint64_t base, uint64_t i) {
    return ((const PC_GLOBAL typename D::Bits*)base)[i];
}
template <typename D>
PC_INLINE void store_elem(uint64_t base, uint64_t i, typename D::Bits x) {
    ((PC_GLOBAL typename D::Bits*)base)[i] = x;
}

// Reads pack `p` of `base`: `valid` lanes, the rest zero.
template <typename D>
PC_INLINE Pack<D> load_pack(uint64_t base, uint64_t p, uint64_t valid, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    Pack<D> x;
    x.w = u32x4{0, 0, 0, 0};
    if (vec && valid == (uint64_t)L) {
        x.w = ((const PC_GLOBAL u32x4*)base)[p];
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j) x.set(j, (uint64_t)j < valid ? load_elem<D>(base, p * L + j) : 0);
    }
    return x;
}

// Writes `valid` lanes of `x` at pack `p` of `base`.
template <typename D>
PC_INLINE void store_pack(uint64_t base, uint64_t p, uint64_t valid, bool vec, const Pack<D>& x) {
    constexpr int L = Pack<D>::kLanes;
    if (vec && valid == (uint64_t)L) {
        ((PC_GLOBAL u32x4*)base)[p] = x.w;
    } else {
        // Unrolled with constant lane indices: a run-time index into the pack would put
        // it in memory (the compiler promotes such arrays to LDS, 16 bytes per thread).
#pragma unroll
        for (int j = 0; j < L; ++j)
            if ((uint64_t)j < valid) store_elem<D>(base, p * L + j, x.get(j));
    }
}

// Group sum of pack `p` of the sources, in group-rank order, f32 accumulation.
template <typename D>
PC_INLINE Pack<D> sum_pack(const Pack<D>* x, uint32_t width) {
    constexpr int L = Pack<D>::kLanes;
    float acc[L];
#pragma unroll
    for (int j = 0; j < L; ++j) acc[j] = D::to_float(x[0].get(j));
#pragma unroll
    for (int s = 1; s < PEERCOMM_MAX_GPUS; ++s) {
        if (s < (int)width) {
#pragma unroll
            for (int j = 0; j < L; ++j) acc[j] += D::to_float(x[s].get(j));
        }
    }
    Pack<D> out;
    out.w = u32x4{0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < L; ++j) out.set(j, D::from_float(acc[j]));
    return out;
}

// Reduces pack `p` (elements [p*L, min(p*L + L, n))) of every source into pack `dst_p`
// of `dst`. All loads are issued before the first add.
template <typename D>
PC_INLINE void reduce_pack(const uint64_t* srcs, uint32_t width, uint64_t p, uint64_t n, uint64_t dst,
                           uint64_t dst_p, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    const uint64_t valid = lanes_in_pack(p, n, L);
    Pack<D> x[PEERCOMM_MAX_GPUS];
#pragma unroll
    for (int s = 0; s < PEERCOMM_MAX_GPUS; ++s) {
        if (s < (int)width) x[s] = load_pack<D>(srcs[s], p, valid, vec);
    }
    store_pack<D>(dst, dst_p, valid, vec, sum_pack<D>(x, width));
}

// Copies `valid` lanes of pack `src_p` of `src` to pack `dst_p` of `dst`.
template <typename D>
PC_INLINE void copy_pack(uint64_t src, uint64_t src_p, uint64_t dst, uint64_t dst_p, uint64_t valid,
                         bool vec) {
    constexpr int L = Pack<D>::kLanes;
    if (vec && valid == (uint64_t)L) {
        ((PC_GLOBAL u32x4*)dst)[dst_p] = ((const PC_GLOBAL u32x4*)src)[src_p];
    } else {
        for (uint64_t j = 0; j < valid; ++j) store_elem<D>(dst, dst_p * L + j, load_elem<D>(src, src_p * L + j));
    }
}

// ---------------------------------------------------------------------------------
// One-stage: every rank reads every peer's input and reduces the whole message. Block
// b, thread t handles packs b*T + t + k*B*T.

template <typename D>
__device__ void one_stage(const Args& a) {
    Ctx c{a, signal_at(a.signals[a.group_rank])};
    if (!enter(c)) return;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    bool vec = aligned16(a.output) && aligned16(a.local_input);
    for (uint32_t s = 0; s < a.group_width; ++s) vec = vec && aligned16(a.inputs[s]);
    if (a.stage_input) {
        // In place: peers read a copy in this rank's payload while this rank overwrites
        // its buffer. Block b copies exactly the packs block b of every rank reads, so
        // the block's publishing barrier covers them.
        const uint64_t payload = a.payloads[a.group_rank];
        for (uint64_t p = tid; p < packs; p += stride)
            copy_pack<D>(a.local_input, p, payload, p, lanes_in_pack(p, n, L), vec);
        if (!barrier<true>(c)) return;
    } else {
        if (!barrier<false>(c)) return;
    }
    for (uint64_t p = tid; p < packs; p += stride) reduce_pack<D>(a.inputs, a.group_width, p, n, a.output, p, vec);
    // No rank may change its input (or payload) before every peer has read it.
    barrier<true>(c);
}

// ---------------------------------------------------------------------------------
// Two-stage: reduce-scatter of partition `group_rank` (ceil(packs / width) packs) into
// the own payload, barrier, all-gather of every partition from its owner's payload.
// The all-gather uses the reduce-scatter's pack assignment, so block b reads only what
// block b of the owner wrote and the per-block barrier suffices.

template <typename D>
__device__ void two_stage(const Args& a) {
    Ctx c{a, signal_at(a.signals[a.group_rank])};
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
        const uint64_t first = me * part, end = first + part < packs ? first + part : packs;
        for (uint64_t p = first + tid; p < end; p += stride)
            reduce_pack<D>(a.inputs, width, p, n, a.payloads[me], p - first, vec);
    }
    if (!barrier<true>(c)) return;
    for (uint32_t q = 0; q < width; ++q) {
        const uint64_t first = q * part, end = first + part < packs ? first + part : packs;
        for (uint64_t p = first + tid; p < end; p += stride)
            copy_pack<D>(a.payloads[q], p - first, a.output, p, lanes_in_pack(p, n, L), vec);
    }
    barrier<true>(c);
}

// ---------------------------------------------------------------------------------
// Lamport: no barrier. Each rank pushes its packs into slot `group_rank` of every group
// member's region of generation `flag`; each rank reduces its own region as soon as no
// 32-bit word of a pack is the sentinel (-0.0f bits, compared as bits), then clears the
// previous call's generation for the call after next. The last block to finish
// advances `lamport_state`.

PC_INLINE PC_GLOBAL u32x4* lamport_pack_ptr(uint64_t signal, uint32_t slot_bytes, uint32_t gen,
                                            uint32_t src, uint64_t p) {
    return (PC_GLOBAL u32x4*)(signal + PC_LAMPORT_OFFSET +
                              ((uint64_t)gen * PEERCOMM_MAX_GPUS + src) * slot_bytes + p * 16u);
}

PC_INLINE bool pack_ready(u32x4 v) {
    return v.x != PC_SENTINEL && v.y != PC_SENTINEL && v.z != PC_SENTINEL && v.w != PC_SENTINEL;
}

template <typename D>
__device__ void lamport(const Args& a) {
    Ctx c{a, signal_at(a.signals[a.group_rank])};
    if (!enter(c)) return;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint32_t width = a.group_width, me = a.group_rank, slot = a.lamport_slot_bytes;
    const uint64_t own = a.signals[me];
    GWord* state = c.own->lamport_state;
    // The previous kernel on this stream wrote these; the kernel boundary orders them.
    const uint32_t gen = load_relaxed(&state[PEERCOMM_LAMPORT_FLAG]);
    const uint32_t prev_packs = load_relaxed(&state[PEERCOMM_LAMPORT_PREV_PACKS]);
    const uint32_t prev_width = load_relaxed(&state[PEERCOMM_LAMPORT_PREV_WIDTH]);
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool vec = aligned16(a.local_input) && aligned16(a.output);

    // Push: -0.0 lanes become +0.0 (the sentinel is never sent), lanes past the end 0.
    for (uint64_t p = tid; p < packs; p += stride) {
        Pack<D> x = load_pack<D>(a.local_input, p, lanes_in_pack(p, n, L), vec);
#pragma unroll
        for (int j = 0; j < L; ++j)
            if (x.get(j) == D::kNegZero) x.set(j, 0);
        for (uint32_t q = 0; q < width; ++q) store_pack_to(lamport_pack_ptr(a.signals[q], slot, gen, me, p), x.w);
    }
    // Reduce the own region as the packs arrive.
    for (uint64_t p = tid; p < packs && !block_aborted(); p += stride) {
        Pack<D> x[PEERCOMM_MAX_GPUS];
        Waiter w;
        bool ready = false;
        while (!ready) {
            ready = true;
#pragma unroll
            for (int s = 0; s < PEERCOMM_MAX_GPUS; ++s) {
                if (s < (int)width) {
                    x[s].w = load_volatile_pack(lamport_pack_ptr(own, slot, gen, s, p));
                    ready = ready && pack_ready(x[s].w);
                }
            }
            if (!ready && !w.keep_waiting(c)) break;
        }
        if (!ready) break;
        store_pack<D>(a.output, p, lanes_in_pack(p, n, L), vec, sum_pack<D>(x, width));
    }
    // Clear the previous call's generation. Its producers are done with it: each has
    // since consumed this rank's push of that call, made after this rank read it.
    const uint32_t clear_gen = (gen + PEERCOMM_LAMPORT_GENERATIONS - 1) % PEERCOMM_LAMPORT_GENERATIONS;
    const u32x4 sentinel = {PC_SENTINEL, PC_SENTINEL, PC_SENTINEL, PC_SENTINEL};
    const uint64_t clear_total = (uint64_t)prev_width * prev_packs;
    for (uint64_t i = tid; i < clear_total; i += stride) {
        const uint32_t src = (uint32_t)(i / prev_packs);
        const uint64_t p = i % prev_packs;
        store_pack_to(lamport_pack_ptr(own, slot, clear_gen, src, p), sentinel);
    }
    // The last block to finish advances the state for the next call (read by the next
    // kernel on this stream only: agent scope).
    __syncthreads();
    if (threadIdx.x == 0 && !block_aborted()) {
        const uint32_t arrived = __hip_atomic_fetch_add(&state[PEERCOMM_LAMPORT_ARRIVALS], 1u,
                                                        __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
        if (arrived == gridDim.x - 1) {
            __hip_atomic_store(&state[PEERCOMM_LAMPORT_PREV_PACKS], (uint32_t)packs, __ATOMIC_RELAXED,
                               __HIP_MEMORY_SCOPE_AGENT);
            __hip_atomic_store(&state[PEERCOMM_LAMPORT_PREV_WIDTH], width, __ATOMIC_RELAXED,
                               __HIP_MEMORY_SCOPE_AGENT);
            __hip_atomic_store(&state[PEERCOMM_LAMPORT_ARRIVALS], 0u, __ATOMIC_RELAXED,
                               __HIP_MEMORY_SCOPE_AGENT);
            __hip_atomic_store(&state[PEERCOMM_LAMPORT_FLAG], (gen + 1) % PEERCOMM_LAMPORT_GENERATIONS,
                               __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
        }
    }
}

// ---------------------------------------------------------------------------------
// Barrier only: a start and an end barrier (the `barrier` collective and the timeout
// probe).

__device__ void barrier_only(const Args& a) {
    Ctx c{a, signal_at(a.signals[a.group_rank])};
    if (!enter(c)) return;
    if (!barrier<false>(c)) return;
    barrier<true>(c);
}

// ---------------------------------------------------------------------------------
// Flag ping-pong between group ranks 0 and 1 (measures the cross-GPU flag round trip):
// the first word of each payload is the flag, zeroed by the host before the launch.
// One lane of one block per rank; gives up silently after `timeout_ns`.

__device__ void ping_pong(const Args& a) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || a.group_rank > 1 || a.group_width < 2) return;
    GWord* mine = (GWord*)a.payloads[a.group_rank];
    GWord* theirs = (GWord*)a.payloads[1 - a.group_rank];
    const uint64_t start = wall_clock();
    const uint64_t limit = a.timeout_ns == 0 ? 0 : a.timeout_ns / 1000u * peercomm_wall_clock_khz / 1000u + 1u;
    for (uint32_t i = 1; i <= (uint32_t)a.num_elements; ++i) {
        if (a.group_rank == 0) store_release(theirs, i);
        while (load_acquire(mine) != i) {
            if (limit != 0 && wall_clock() - start > limit) return;
        }
        if (a.group_rank == 1) store_release(theirs, i);
    }
}

// ---------------------------------------------------------------------------------
// Entry points, named as `Kernel::symbol()` names them: peercomm_<family>_<dtype>.
// The argument struct is passed by value (256 bytes of kernel arguments).

//
// The kernels read the struct in place in the kernel-argument segment (it is the first
// and only explicit argument, at offset 0) rather than through the by-value parameter:
// the arrays in it are indexed with run-time ranks, which would otherwise make the
// compiler copy all 256 bytes into scratch memory first.
PC_INLINE const Args& kernel_args() { return *(const Args*)__builtin_amdgcn_kernarg_segment_ptr(); }

#define PC_EXPORT(D, name)                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) peercomm_one_stage_##name(const Args) { \
        one_stage<D>(kernel_args());                                                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) peercomm_two_stage_##name(const Args) { \
        two_stage<D>(kernel_args());                                                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) peercomm_lamport_##name(const Args) {   \
        lamport<D>(kernel_args());                                                               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) peercomm_barrier_##name(const Args) {   \
        barrier_only(kernel_args());                                                             \
    }

PC_EXPORT(F32, f32)
PC_EXPORT(F16, f16)
PC_EXPORT(BF16, bf16)

extern "C" __global__ void __launch_bounds__(1024) peercomm_pingpong_f32(const Args) { ping_pong(kernel_args()); }

// Fault injection: one lane spins for timeout_ns nanoseconds (a rank made late).
extern "C" __global__ void __launch_bounds__(1024) peercomm_delay_f32(const Args) {
    const Args& a = kernel_args();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t ticks = a.timeout_ns / 1000u * peercomm_wall_clock_khz / 1000u;
    const uint64_t start = wall_clock();
    while (wall_clock() - start < ticks) {
    }
}
