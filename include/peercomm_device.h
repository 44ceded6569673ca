/*
 * peercomm device API: what peercomm's own kernels use to synchronise GPUs and reach
 * their peers, for an engine's kernels too. One header for both vendors, found by a
 * dependent's build script as DEP_PEERCOMM_INCLUDE (cargo `links` metadata) and by
 * run-time compilers as the string constants of `peercomm::device`. It includes only
 * peercomm_signal.h (the layout) and compiles under nvcc, NVRTC, hipcc and hiprtc with
 * no host headers (hipcc needs <hip/hip_runtime.h> before it, as every HIP source).
 *
 * Everything here is in namespace `peercomm`; macros start with PC_.
 *
 * This part: the memory operations, each with its order and scope in its name. Peers
 * reach the signal words over NVLink, xGMI or PCIe, so every signal-word access is at
 * system scope.
 */
#ifndef PEERCOMM_DEVICE_H
#define PEERCOMM_DEVICE_H

#include "peercomm_signal.h"

#if defined(__HIP__) || defined(__HIPCC_RTC__)

/*
 * AMD: ordering uses the clang `__hip_atomic_*` builtins at system scope, which lower
 * to the cache write-back / invalidate sequences of the AMDGPU memory model. Every
 * pointer made from an address is in the global address space (else the compiler
 * uses the slower flat instructions). The timeout clock is the constant-rate wall
 * clock, converted with peercomm_wall_clock_khz.
 */
#define PC_INLINE __device__ __attribute__((always_inline)) inline
#define PC_GLOBAL __attribute__((address_space(1)))
// Shared memory (LDS): the block state is accessed through volatile pointers, which the
// compiler does not narrow from flat by itself.
#define PC_SHARED __attribute__((address_space(3)))
// Checks of abort and timeout between spins: every spin is a round trip to uncached
// memory, so fewer spins pass between checks than on CUDA.
#define PC_SPIN_CHECK_INTERVAL 64u

// 16 bytes as four 32-bit words: one global_load_dwordx4 / global_store_dwordx4.

// Rate of the wall clock in kHz. Set by the host (hipModuleGetGlobal) after loading the
// module from hipDeviceAttributeWallClockRate; the default is the Instinct rate.
extern "C" __device__ uint32_t peercomm_wall_clock_khz = 100000;

namespace peercomm {

typedef uint32_t Vec16 __attribute__((ext_vector_type(4)));
PC_INLINE Vec16 make_vec16(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return Vec16{x, y, z, w}; }


// ---------------------------------------------------------------------------------
// Signal words, system scope.

PC_INLINE uint32_t ld_relaxed_sys(const PC_GLOBAL uint32_t* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
PC_INLINE uint32_t ld_acquire_sys(const PC_GLOBAL uint32_t* p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
PC_INLINE void st_relaxed_sys(PC_GLOBAL uint32_t* p, uint32_t v) {
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// A release is "buffer_wbl2; s_waitcnt vmcnt(0); store" on gfx9 (AMDGPUUsage), but LLVM
// does not count buffer_wbl2 in vmcnt (fixed upstream by llvm-project#178316, after the
// compilers used here) and drops that wait when nothing else is outstanding, letting
// the store overtake the write-back. So: the release fence, an explicit wait, then the
// store. The empty asm computes address and value before the fence, keeping the three
// together.
PC_INLINE void st_release_sys(PC_GLOBAL uint32_t* p, uint32_t v) {
    asm volatile("" : "+v"(p), "+v"(v));
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "");  // "": system scope
#if defined(__GFX9__)
    __builtin_amdgcn_s_waitcnt(0x0f70);  // vmcnt(0) only (gfx9 encoding)
#endif
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// True when *p was `expected` and is now `desired`.
PC_INLINE bool cas_relaxed_sys(PC_GLOBAL uint32_t* p, uint32_t expected, uint32_t desired) {
    return __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                                __HIP_MEMORY_SCOPE_SYSTEM);
}
// Agent scope: only blocks of this kernel add, and the next kernel reads.
PC_INLINE uint32_t atomic_add_relaxed_dev(PC_GLOBAL uint32_t* p, uint32_t v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

// Lamport packs: volatile, so every spin iteration reads memory again (a cache-bypassing
// load); one 16-byte access, so no 32-bit word is torn.
PC_INLINE Vec16 ld_volatile_vec16(const PC_GLOBAL Vec16* p) { return *(const volatile PC_GLOBAL Vec16*)p; }
PC_INLINE void st_volatile_vec16(PC_GLOBAL Vec16* p, Vec16 v) { *(volatile PC_GLOBAL Vec16*)p = v; }

// Barrier arrivals: a counter and a call descriptor in one 16-byte access, so a reader
// that sees the counter sees the descriptor stored with it. The signal memory is
// uncached, so volatile accesses reach it; the release is a fence (system scope) with
// the same explicit wait as st_release_sys, and the acquire side is an ld_acquire_sys
// of the counter word once the spin has seen it.
PC_INLINE Vec16 ld_relaxed_sys_vec16(const PC_GLOBAL Vec16* p) { return ld_volatile_vec16(p); }
PC_INLINE void st_relaxed_sys_vec16(PC_GLOBAL Vec16* p, Vec16 v) { st_volatile_vec16(p, v); }
PC_INLINE void st_release_sys_vec16(PC_GLOBAL Vec16* p, Vec16 v) {
    asm volatile("" : "+v"(p), "+v"(v));
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "");
#if defined(__GFX9__)
    __builtin_amdgcn_s_waitcnt(0x0f70);  // vmcnt(0) only (gfx9 encoding)
#endif
    st_volatile_vec16(p, v);
}

// ---------------------------------------------------------------------------------
// Timer: the wall clock, converted with peercomm_wall_clock_khz.

PC_INLINE uint64_t timer_now() { return (uint64_t)wall_clock64(); }
// Whole microseconds, rounded up, times kHz / 1000, rounded up, saturating (microsecond
// resolution is plenty, and it keeps the product small).
PC_INLINE uint64_t timer_ticks(uint64_t ns) {
    const uint64_t us = (ns + 999u) / 1000u, khz = peercomm_wall_clock_khz;
    if (khz != 0 && us > (~0ull - 999u) / khz) return ~0ull;
    return (us * khz + 999u) / 1000u;
}

}  // namespace peercomm

#else  // CUDA

#define PC_INLINE __device__ __forceinline__
// The compiler infers the state space (global, shared) from how the pointers are made.
#define PC_GLOBAL
#define PC_SHARED
// Checks of abort and timeout between spins: a %globaltimer read is cheap.
#define PC_SPIN_CHECK_INTERVAL 256u

namespace peercomm {

typedef uint4 Vec16;
PC_INLINE Vec16 make_vec16(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return make_uint4(x, y, z, w); }

// ---------------------------------------------------------------------------------
// Signal words, system scope.

PC_INLINE uint32_t ld_relaxed_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
PC_INLINE uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
PC_INLINE void st_relaxed_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
PC_INLINE void st_release_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// True when *p was `expected` and is now `desired`.
PC_INLINE bool cas_relaxed_sys(uint32_t* p, uint32_t expected, uint32_t desired) {
    uint32_t old;
    asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(old)
                 : "l"(p), "r"(expected), "r"(desired)
                 : "memory");
    return old == expected;
}
// Device scope: only blocks of this kernel add, and the next kernel reads.
PC_INLINE uint32_t atomic_add_relaxed_dev(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }

// Lamport packs: volatile, so every spin iteration goes to memory; one v4 access, so no
// 32-bit word is torn.
PC_INLINE Vec16 ld_volatile_vec16(const Vec16* p) {
    Vec16 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
PC_INLINE void st_volatile_vec16(Vec16* p, Vec16 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// Barrier arrivals: a counter and a call descriptor in one 16-byte access at system
// scope, so a reader that sees the counter sees the descriptor stored with it.
PC_INLINE Vec16 ld_relaxed_sys_vec16(const Vec16* p) {
    Vec16 v;
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
PC_INLINE void st_relaxed_sys_vec16(Vec16* p, Vec16 v) {
    asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}
PC_INLINE void st_release_sys_vec16(Vec16* p, Vec16 v) {
    asm volatile("st.release.sys.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// ---------------------------------------------------------------------------------
// Timer: %globaltimer counts nanoseconds.

PC_INLINE uint64_t timer_now() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
PC_INLINE uint64_t timer_ticks(uint64_t ns) { return ns; }

}  // namespace peercomm

#endif  // vendor

// =================================================================================
// The protocol, for both vendors: a block's context, the abort word and the error
// record, bounded waits, and the counter barrier. Written over any argument type A
// with the fields of peercomm_allreduce_args that it reads: signals, group_rank,
// group_width, domain, world_rank, timeout_ns and call (the library's kernels pass
// their arguments; a user kernel its peercomm_device_comm).

namespace peercomm {

typedef PC_GLOBAL peercomm_signal GlobalSignal;
typedef PC_GLOBAL uint32_t GlobalU32;

PC_INLINE GlobalSignal* signal_at(uint64_t addr) { return (GlobalSignal*)addr; }

// ---------------------------------------------------------------------------------
// Block context and the abort protocol.
//
// A rank's abort word is its own error_state[PEERCOMM_ERROR_CODE]: non-zero means stop,
// until re-initialisation. A block that gives up (a wait timed out, or the abort word is
// set) does so at a point every one of its threads reaches together, through abandon().

// What thread 0 read of the own signal at entry, and whether the block gave up. One per
// block, in shared memory.
struct BlockState {
    uint32_t abort;
    uint32_t lamport[4];  // lamport_state as read at entry
};

template <class A>
struct BlockCtx {
    const A& a;
    GlobalSignal* own;
    volatile PC_SHARED BlockState* block;
    uint32_t counter;  // threads t < group_width: self_counter[domain][block][t]
};

// The context of this block's collective. One BlockState serves every kernel: a kernel
// runs one collective.
template <class A>
PC_INLINE BlockCtx<A> make_ctx(const A& a) {
    __shared__ BlockState state;
    return BlockCtx<A>{a, signal_at(a.signals[a.group_rank]), (volatile PC_SHARED BlockState*)&state, 0};
}

// A call descriptor (PEERCOMM_CALL_WORDS words).
struct CallWords {
    uint32_t w[PEERCOMM_CALL_WORDS];
};

// Pack k of an arrival with descriptor `call`: the counter value, then descriptor words
// 3k .. 3k + 2.
PC_INLINE Vec16 arrival_pack(const uint32_t* call, uint32_t v, uint32_t k) {
    return make_vec16(v, call[3u * k], call[3u * k + 1u], call[3u * k + 2u]);
}

// Whether words 1-3 of `x` are words 3k .. 3k + 2 of the descriptor `call`.
PC_INLINE bool same_pack(const uint32_t* call, Vec16 x, uint32_t k) {
    return x.y == call[3u * k] && x.z == call[3u * k + 1u] && x.w == call[3u * k + 2u];
}

// The descriptor `call` as words.
PC_INLINE CallWords call_words(const uint32_t* call) {
    CallWords c;
#pragma unroll
    for (uint32_t i = 0; i < PEERCOMM_CALL_WORDS; ++i) c.w[i] = call[i];
    return c;
}

// This call's descriptor.
template <class A>
PC_INLINE CallWords own_call(const A& a) { return call_words(a.call); }

// The current_call summary of this call (descriptor words 0, 2, 3), running or not.
template <class A>
PC_INLINE Vec16 call_summary(const A& a, uint32_t running) {
    return make_vec16(a.call[0], a.call[2], a.call[3], running);
}

// A peer's current_call summary `x` as a descriptor: this call's, with the words the
// summary holds replaced by the peer's.
template <class A>
PC_INLINE CallWords summary_call(const A& a, Vec16 x) {
    CallWords c = own_call(a);
    c.w[0] = x.x;
    c.w[2] = x.y;
    c.w[3] = x.z;
    return c;
}

// Reads, in one trip, this rank's Lamport state and abort word (thread 0, two adjacent
// 16-byte loads) and the barrier counters (threads t < width, kept in a register).
// Block 0 publishes the call it runs in the own current_call (read by a peer whose wait
// for this rank gives up). False, for the whole block, when the abort word is set: the
// caller abandons at once (telling its peers' same-index blocks it will not touch their
// memory, so a peer that gave up on this rank stops waiting for it).
template <class A>
PC_INLINE bool enter(BlockCtx<A>& c) {
    const uint32_t t = threadIdx.x;
    if (t < c.a.group_width) c.counter = c.own->self_counter[c.a.domain][blockIdx.x][t];
    // A group of one waits for nobody, and nobody waits for it: it publishes nothing.
    if (t == 0 && blockIdx.x == 0 && c.a.group_width > 1)
        st_volatile_vec16((PC_GLOBAL Vec16*)c.own->current_call, call_summary(c.a, 1u));
    if (t == 0) {
        const Vec16 lamport = ld_volatile_vec16((const PC_GLOBAL Vec16*)c.own->lamport_state);
        const Vec16 error = ld_volatile_vec16((const PC_GLOBAL Vec16*)c.own->error_state);
        c.block->lamport[0] = lamport.x;
        c.block->lamport[1] = lamport.y;
        c.block->lamport[2] = lamport.z;
        c.block->lamport[3] = lamport.w;
        c.block->abort = error.x != 0u;  // PEERCOMM_ERROR_CODE
    }
    __syncthreads();
    return c.block->abort == 0u;
}

// What an error record says beside its code: the world rank it names, the world rank
// the writer waited for (or none), and the writer's and that rank's call descriptors.
struct ErrorDetail {
    uint32_t rank;
    uint32_t domain;
    uint32_t awaited_plus_one;  // 0: none
    CallWords mine;             // the writer's descriptor
    CallWords theirs;           // the other side's descriptor
    uint32_t theirs_valid;
};

// Writes an error record into `s` unless it has one: claims the code word
// (0 -> WRITING), fills in the fields, then releases the code, so a reader that
// acquires a final code sees the fields.
PC_INLINE void write_error_record(GlobalSignal* s, uint32_t code, const ErrorDetail& d) {
    GlobalU32* e = s->error_state;
    if (cas_relaxed_sys(&e[PEERCOMM_ERROR_CODE], 0u, PEERCOMM_ERROR_WRITING)) {
        GlobalU32* x = s->error_detail;
        st_relaxed_sys(&e[PEERCOMM_ERROR_RANK], d.rank);
        st_relaxed_sys(&e[PEERCOMM_ERROR_BLOCK], blockIdx.x);
        st_relaxed_sys(&e[PEERCOMM_ERROR_DOMAIN], d.domain);
        for (uint32_t i = 0; i < PEERCOMM_CALL_WORDS; ++i) {
            st_relaxed_sys(&x[PEERCOMM_DETAIL_MINE + i], d.mine.w[i]);
            st_relaxed_sys(&x[PEERCOMM_DETAIL_THEIRS + i], d.theirs.w[i]);
        }
        st_relaxed_sys(&x[PEERCOMM_DETAIL_AWAITED], d.awaited_plus_one);
        st_relaxed_sys(&x[PEERCOMM_DETAIL_THEIRS_VALID], d.theirs_valid);
        st_release_sys(&e[PEERCOMM_ERROR_CODE], code);
    }
}

// World rank of group rank q of this rank's group (groups are consecutive world ranks).
template <class A>
PC_INLINE uint32_t world_rank_of(const A& a, uint32_t q) { return a.world_rank - a.group_rank + q; }

// Whether a current_call summary `x` is another call that its rank runs now (word w:
// running): a rank that a wait for it gave up on is running something else than this
// call.
template <class A>
PC_INLINE bool other_call(const A& a, Vec16 x) {
    const Vec16 mine = call_summary(a, 1u);
    return x.w != 0u && (x.x != mine.x || x.y != mine.y || x.z != mine.z);
}

// The end of every collective that completed: block 0 marks the own current_call as
// no longer running. A call that was abandoned never gets here and stays the rank's
// pending call, so a peer whose wait for this rank gives up later still sees which call
// it was at.
template <class A>
PC_INLINE void finish(BlockCtx<A>& c) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && c.a.group_width > 1) st_relaxed_sys(&c.own->current_call[3], 0u);
}

// A wait of this block for group rank `awaited` gave up. If that rank runs another call
// now (its current_call is running with another descriptor: another group width puts
// it in another barrier domain, another algorithm in another kind of wait, another
// sequence number in the same domain), record a call mismatch naming it, and write the same (from
// their side) into the record of every group peer whose current call differs so: its
// own wait may find it too, or it may have completed the call with a subgroup of its
// own, and then its next synchronize reports it. Otherwise
// record the timeout on this rank,
// naming the rank it waited for, and set every group peer's abort word (their waits end
// at their next check instead of timing out in turn). Then the block leaves.
template <class A>
PC_INLINE void record_timeout(BlockCtx<A>& c, uint32_t awaited) {
    const A& a = c.a;
    const Vec16 theirs = ld_volatile_vec16((const PC_GLOBAL Vec16*)signal_at(a.signals[awaited])->current_call);
    const uint32_t who = world_rank_of(a, awaited);
    if (other_call(a, theirs)) {
        write_error_record(c.own, PEERCOMM_ERROR_CALL_MISMATCH,
                           ErrorDetail{who, a.domain, who + 1u, own_call(a), summary_call(a, theirs), 1u});
        for (uint32_t q = 0; q < a.group_width; ++q) {
            if (q == a.group_rank) continue;
            GlobalSignal* peer = signal_at(a.signals[q]);
            const Vec16 call = ld_volatile_vec16((const PC_GLOBAL Vec16*)peer->current_call);
            if (other_call(a, call))
                write_error_record(peer, PEERCOMM_ERROR_CALL_MISMATCH,
                                   ErrorDetail{a.world_rank, a.domain, a.world_rank + 1u, summary_call(a, call),
                                               own_call(a), 1u});
        }
    } else {
        const ErrorDetail d{a.world_rank, a.domain, who + 1u, own_call(a), summary_call(a, theirs), 1u};
        write_error_record(c.own, PEERCOMM_ERROR_BARRIER_TIMEOUT, d);
        for (uint32_t q = 0; q < a.group_width; ++q) {
            if (q != a.group_rank) write_error_record(signal_at(a.signals[q]), PEERCOMM_ERROR_PEER_ABORTED, d);
        }
    }
    c.block->abort = 1u;
}

// Group rank `peer` makes another call than this rank: record the mismatch on this
// rank, naming that peer, with `mine` and `theirs` as the two sides, and leave. The
// peer finds the same difference on its side, so neither tells the other to stop.
template <class A>
PC_INLINE void record_mismatch(BlockCtx<A>& c, uint32_t peer, const CallWords& mine, const CallWords& theirs) {
    const uint32_t who = world_rank_of(c.a, peer);
    write_error_record(c.own, PEERCOMM_ERROR_CALL_MISMATCH, ErrorDetail{who, c.a.domain, who + 1u, mine, theirs, 1u});
    c.block->abort = 1u;
}

// A peer's arrival (or Lamport header) carries another call descriptor than this
// rank's: the mismatch of the two descriptors.
template <class A>
PC_INLINE void record_mismatch(BlockCtx<A>& c, uint32_t peer, const CallWords& theirs) {
    record_mismatch(c, peer, own_call(c.a), theirs);
}

// Bounds one wait. Call keep_waiting() after each failed test of the awaited condition,
// so a value that has arrived wins over an abort. Every PC_SPIN_CHECK_INTERVAL calls it
// checks the block's abort flag, this rank's abort word, then the timeout (which it
// records); false means the block aborted and the wait must end.
struct Waiter {
    uint64_t start = 0;
    uint64_t limit = 0;  // timer ticks
    uint32_t spins = 0;
    bool timing = false;
    // The timeout's multiple: a wait for another wait of this rank (grid_barrier's blocks
    // other than 0) gives that one the time to record its cause first.
    uint32_t scale = 1;

    // `awaited`: the group rank this wait is for (named in the record if it gives up).
    template <class A>
    PC_INLINE bool keep_waiting(BlockCtx<A>& c, uint32_t awaited) {
        if ((++spins & (PC_SPIN_CHECK_INTERVAL - 1u)) != 0u) return true;
        if (c.block->abort) return false;
        if (ld_relaxed_sys(&c.own->error_state[PEERCOMM_ERROR_CODE]) != 0u) {
            c.block->abort = 1u;
            return false;
        }
        if (c.a.timeout_ns == 0) return true;
        const uint64_t now = timer_now();
        if (!timing) {
            start = now;
            limit = timer_ticks(c.a.timeout_ns) * scale;
            timing = true;
        } else if (now - start > limit) {
            record_timeout(c, awaited);
            return false;
        }
        return true;
    }
};

// Whether a block that gives up waits for its peers first: yes in the collectives whose
// peers read this rank's user buffers.
enum class WaitForPeers { No, Yes };

// Waits until group member t's block b has written this rank's quit[b][t] (it will not
// touch this rank's memory again), at most the timeout (none without one).
template <class A>
PC_INLINE void wait_for_quit(const BlockCtx<A>& c, uint32_t b, uint32_t t) {
    if (c.a.timeout_ns == 0) return;
    const GlobalU32* quit = &c.own->quit[b][t];
    const uint64_t start = timer_now(), limit = timer_ticks(c.a.timeout_ns);
    uint32_t spins = 0;
    while (ld_acquire_sys(quit) == 0u) {
        if ((++spins & (PC_SPIN_CHECK_INTERVAL - 1u)) == 0u && timer_now() - start > limit) break;
    }
}

// Gives up the collective, called by every thread of the block together. Tells each
// peer's same-index block that this one will not touch its memory again (its loads are
// complete: __syncthreads, then a release). With WaitForPeers::Yes it then waits, at
// most timeout_ns (0: not at all), until each peer says the same: a rank that gave up
// must not let its kernel end, and the user free the input, while a late peer that
// already passed the start barrier still reads it; that peer sees the abort at its next
// wait and quits. This wait checks only the timer: the block has already aborted.
template <class A>
PC_INLINE void abandon(BlockCtx<A>& c, WaitForPeers wait) {
    __syncthreads();
    const A& a = c.a;
    const uint32_t t = threadIdx.x, b = blockIdx.x, me = a.group_rank;
    // Block 0 also speaks for the blocks this launch does not have: a peer launched with
    // a larger grid (a block-count mismatch) must not wait for partners that never exist.
    if (b == 0) {
        for (uint32_t x = gridDim.x + t; x < PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND; x += blockDim.x)
            for (uint32_t q = 0; q < a.group_width; ++q)
                if (q != me) st_relaxed_sys(&signal_at(a.signals[q])->quit[x][me], 1u);
    }
    if (t < a.group_width && t != me) {
        st_release_sys(&signal_at(a.signals[t])->quit[b][me], 1u);
        if (wait == WaitForPeers::Yes) wait_for_quit(c, b, t);
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------
// The counter barrier of one block across its group, in barrier domain `a.domain`.
// Thread t < width increments its counter for peer t to v (u32 wrap-around is part of
// the protocol), stores v into peer t's peer_counter[d][v % 2][block][group_rank] and
// spins until its own peer_counter[d][v % 2][block][t] == v. What orders what is the
// kind, named at every call site.

enum class BarrierKind {
    // Relaxed store of the arrival, relaxed spin: orders arrival only, publishes no data.
    Start,
    // __syncthreads, then a system-scope release store and an acquire spin: what every
    // thread of the block wrote before it is visible to the peers' same-index block after
    // it (the staged input, the two-stage middle, the barrier kernel's second barrier).
    Publish,
    // __syncthreads, then a relaxed store and a relaxed spin. It publishes nothing; it
    // keeps the peers from overwriting what this block read (their inputs or payloads)
    // before this block is done reading. It measured ~1 us faster than release on H200.
    // Relaxed relies on this hardware behaviour: every load of peer data whose value has
    // been consumed (it fed a store, and __syncthreads has been passed) has been
    // performed, so a peer's store, issued after it observes our arrival, cannot change
    // the value read. sm_70+ and CDNA do no load value speculation and no load buffering.
    // The PTX and HIP memory models do not promise it: formally this needs a release.
    End,
};

// Which group ranks a barrier waits for, and the descriptor it publishes to and expects
// from each. The collectives: every member, with the call's descriptor. The exchange
// (peercomm_exchange.h) waits only for the peers it moves data with, each pair with its
// own descriptor.
struct EveryMember {
    template <class A>
    PC_INLINE bool takes_part(const A&, uint32_t) const {
        return true;
    }
    template <class A>
    PC_INLINE const uint32_t* call(const A& a, uint32_t) const {
        return a.call;
    }
};

template <BarrierKind kKind, typename Members = EveryMember, class A>
PC_INLINE bool barrier(BlockCtx<A>& c, const Members& members = Members{}) {
    constexpr bool kOrdered = kKind == BarrierKind::Publish;
    if (kKind != BarrierKind::Start) __syncthreads();
    const A& a = c.a;
    const uint32_t t = threadIdx.x;
    if (t < a.group_width && members.takes_part(a, t)) {
        const uint32_t* call = members.call(a, t);
        const uint32_t d = a.domain, b = blockIdx.x;
        const uint32_t v = ++c.counter;
        // The arrival: every pack carries v beside three descriptor words. Packs 1.. go
        // first, pack 0 last, so that a publishing barrier's release (pack 0) covers them.
        PC_GLOBAL Vec16* to_peer = (PC_GLOBAL Vec16*)signal_at(a.signals[t])->peer_counter[d][v & 1u][b][a.group_rank];
#pragma unroll
        for (uint32_t k = 1; k < PEERCOMM_CALL_PACKS; ++k) st_relaxed_sys_vec16(to_peer + k, arrival_pack(call, v, k));
        if (kOrdered) {
            st_release_sys_vec16(to_peer, arrival_pack(call, v, 0u));
        } else {
            st_relaxed_sys_vec16(to_peer, arrival_pack(call, v, 0u));
        }
        c.own->self_counter[d][b][t] = v;  // the next kernel's entry reads it
        const PC_GLOBAL Vec16* from_peer = (const PC_GLOBAL Vec16*)c.own->peer_counter[d][v & 1u][b][t];
        Waiter w;
        Vec16 x;
        while ((x = ld_relaxed_sys_vec16(from_peer)).x != v) {
            if (!w.keep_waiting(c, t)) break;
        }
        // Once the counter is v this slot does not change before this block arrives
        // again: the acquire of a publishing barrier reads its counter word once (it can
        // only read v, and pairs with the writer's release). Relaxed packs 1.. may land
        // after pack 0: each is waited for until it holds v too; a pack read that could
        // have been torn is settled by reading it again.
        if (kOrdered && x.x == v) (void)ld_acquire_sys(&c.own->peer_counter[d][v & 1u][b][t][0]);
        if (x.x == v) {
            CallWords theirs;
            bool differs = false;
#pragma unroll
            for (uint32_t k = 0; k < PEERCOMM_CALL_PACKS; ++k) {
                Vec16 p = k == 0u ? x : ld_relaxed_sys_vec16(from_peer + k);
                while (p.x != v && w.keep_waiting(c, t)) p = ld_relaxed_sys_vec16(from_peer + k);
                if (p.x == v && !same_pack(call, p, k)) p = ld_relaxed_sys_vec16(from_peer + k);
                differs = differs || (p.x == v && !same_pack(call, p, k));
                theirs.w[3u * k] = p.y;
                theirs.w[3u * k + 1u] = p.z;
                theirs.w[3u * k + 2u] = p.w;
            }
            if (differs) record_mismatch(c, t, call_words(call), theirs);
        }
    }
    __syncthreads();
    return c.block->abort == 0u;
}

// ---------------------------------------------------------------------------------
// Lamport: data that carries its own readiness. Each rank's region holds
// PEERCOMM_LAMPORT_GENERATIONS x world-width slots of lamport_slot_bytes; slot
// (gen, src) receives, pack by pack, what group rank src pushes in a call of
// generation gen.
//
// Invariants:
// - Sentinel: a 32-bit word of a pack not yet written holds 0x80000000, the bits of f32
//   -0.0. Words are compared as bits, never as floats (-0.0 == +0.0, and flush-to-zero
//   turns a negative subnormal into -0.0).
// - A producer never sends the sentinel: every -0.0 lane becomes +0.0 before the push,
//   per lane for every dtype (an f16/bf16 word equals the sentinel only when its upper
//   lane is -0.0). Lanes past the end of the message are sent as +0.0.
// - Generations: flag = lamport_state[FLAG], in [0, 3). A call pushes into and reads
//   generation flag, and clears generation (flag + 2) % 3, the previous call's, so that
//   it holds the sentinel again when the call after next writes it. The clear races no
//   write: this rank read every pack of the previous call, so those writes have landed;
//   and a peer writes that generation again only after consuming this rank's push of
//   the next call, which this rank makes after the clear (a kernel boundary between).
// - Own slot: a rank never writes its own slot (slot group_rank of its own region); it
//   reduces its own pack straight from its input, and clearing skips that slot. Sound
//   because Lamport runs only over the whole world (domain 0), so a rank's group rank is
//   the same in every Lamport call on one signal buffer.
// - State: every block reads lamport_state at entry; the last block to arrive records
//   this call's packs and width, resets the arrivals and advances the flag (a single
//   block needs no arrival count). The next kernel on the stream reads them; the kernel
//   boundary orders that. The arrival add is relaxed: each block's entry read has been
//   consumed before it arrives, the hardware property BarrierKind::End relies on.

constexpr uint32_t kLamportSentinel = 0x80000000u;
constexpr uint64_t kLamportRegionOffset =
    (sizeof(peercomm_signal) + PEERCOMM_REGION_ALIGN - 1) / PEERCOMM_REGION_ALIGN * PEERCOMM_REGION_ALIGN;

struct LamportGeneration {
    uint32_t flag;
    PC_INLINE uint32_t data() const { return flag; }
    PC_INLINE uint32_t clear() const {
        return (flag + PEERCOMM_LAMPORT_GENERATIONS - 1) % PEERCOMM_LAMPORT_GENERATIONS;
    }
    PC_INLINE uint32_t next() const { return (flag + 1) % PEERCOMM_LAMPORT_GENERATIONS; }
};

// Pack p of slot (gen, src) in the Lamport region of the signal at `signal`.
// A generation holds `slots` slots: the world width (Lamport runs only over the whole
// world, so every call on one signal buffer has the same width).
PC_INLINE PC_GLOBAL Vec16* lamport_pack_at(uint64_t signal, uint32_t slot_bytes, uint32_t slots, uint32_t gen,
                                           uint32_t src, uint64_t p) {
    return (PC_GLOBAL Vec16*)(signal + kLamportRegionOffset +
                              ((uint64_t)gen * slots + src) * slot_bytes + p * 16u);
}

// Header pack k of slot (gen, src): the slot's last PEERCOMM_LAMPORT_HEADER_PACKS packs
// hold the writer's call descriptor.
PC_INLINE PC_GLOBAL Vec16* lamport_header_at(uint64_t signal, uint32_t slot_bytes, uint32_t slots, uint32_t gen,
                                             uint32_t src, uint32_t k) {
    return lamport_pack_at(signal, slot_bytes, slots, gen, src, slot_bytes / 16u - PEERCOMM_LAMPORT_HEADER_PACKS + k);
}

// True once every word of the pack has been written (none is the sentinel).
PC_INLINE bool lamport_arrived(Vec16 v) {
    return v.x != kLamportSentinel && v.y != kLamportSentinel && v.z != kLamportSentinel &&
           v.w != kLamportSentinel;
}

// An f32 word as a producer sends it: -0.0 becomes +0.0, so that no word sent is the
// sentinel (f16 and bf16 clean each lane alike: a word is the sentinel only when its
// upper lane is -0.0).
PC_INLINE uint32_t lamport_word_f32(uint32_t bits) { return bits == kLamportSentinel ? 0u : bits; }

// Pushes pack `v` (no word the sentinel, unless clearing) into a slot, in one 16-byte
// store that reaches memory: a reader sees none of it or all of it.
PC_INLINE void lamport_push(PC_GLOBAL Vec16* at, Vec16 v) { st_volatile_vec16(at, v); }

// Reads the pack at `at` from memory, once: it has arrived when lamport_arrived() of
// it. Poll it in a bounded wait (Waiter::keep_waiting), never forever.
PC_INLINE Vec16 lamport_poll(const PC_GLOBAL Vec16* at) { return ld_volatile_vec16(at); }

}  // namespace peercomm

// =================================================================================
// Kernels of your own. A DeviceComm (Comm::device_comm in Rust, a kernel argument as it
// is) is one rank's view of one symmetric or registered buffer: every member's signal
// and buffer, its group rank and width, its barrier bank (PEERCOMM_USER_DOMAIN, which
// no collective of the library uses) and the descriptor its arrivals carry. Every
// thread of every block runs, as the library's own kernels do:
//
//   auto b = peercomm::make_ctx(comm);
//   if (!peercomm::enter(b)) return peercomm::abandon(b, peercomm::WaitForPeers::No);
//   ... write this rank's data (own buffer: comm.buffers[comm.group_rank]) ...
//   if (!peercomm::barrier<peercomm::BarrierKind::Publish>(b))
//       return peercomm::abandon(b, peercomm::WaitForPeers::Yes);
//   ... read the peers' data (comm.buffers[q]) ...
//   if (!peercomm::barrier<peercomm::BarrierKind::End>(b))
//       return peercomm::abandon(b, peercomm::WaitForPeers::Yes);
//   peercomm::finish(b);
//
// grid_barrier<Kind>(b) is the same over every block of every rank at once.
//
// What the caller keeps, on every rank of the group:
// - the same kernel, with the same grid (at most PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND
//   blocks, at least group_width threads each), launched on the rank's Comm stream;
// - in every block, one enter, then the same sequence of barriers: a barrier skipped
//   must be skipped alike on every rank and by every thread of the block;
// - the order a barrier gives is its kind's, named at the call site: Start orders
//   arrival only; Publish makes what every thread of the block wrote before it visible
//   to the peers' same-index blocks after it; End keeps the peers from overwriting what
//   this block read until it has read it, and publishes nothing;
// - a barrier that returns false gave up (the timeout, a peer's abort, a peer in
//   another call): the block leaves through abandon, at a point all its threads reach;
//   the error (BarrierTimeout naming the peer, PeerAborted, CallMismatch) comes back
//   from the Comm's synchronize or check_errors, and the rank does nothing more until
//   it is re-initialised. WaitForPeers::Yes where peers may read this rank's buffer:
//   the block then waits (bounded by the timeout) until they have stopped.

namespace peercomm {

typedef peercomm_device_comm DeviceComm;

// Group member q's buffer, as this rank reaches it.
PC_INLINE uint64_t peer_buffer(const DeviceComm& comm, uint32_t q) { return comm.buffers[q]; }

// A barrier of the whole grid across the GPUs: every block of every rank, called by
// every thread of every block. Each block arrives on this rank's grid counter (after a
// system-scope fence, so that kKind == Publish publishes what every block wrote); block
// 0 waits for all gridDim.x arrivals, passes the counter barrier of kind kKind with the
// peers' blocks 0, and releases this rank's blocks. Every block of the grid must be
// resident at once (a cooperative launch, or a grid no larger than the GPU holds, which
// ranks sharing a GPU share too); a block that is not makes the wait time out. False
// when the block must leave (abandon), as for barrier().
template <BarrierKind kKind, class A>
PC_INLINE bool grid_barrier(BlockCtx<A>& c) {
    __syncthreads();
    GlobalU32* arrivals = &c.own->user_grid[0];
    GlobalU32* passed = &c.own->user_grid[1];
    const uint32_t me = c.a.group_rank;
    uint32_t gen = 0;
    if (threadIdx.x == 0) {
        gen = ld_acquire_sys(passed);
        __threadfence_system();
        atomic_add_relaxed_dev(arrivals, 1u);
    }
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) {
            Waiter w;
            while (ld_acquire_sys(arrivals) != gridDim.x)
                if (!w.keep_waiting(c, me)) break;
        }
        __syncthreads();
        if (c.block->abort != 0u) return false;
        if (threadIdx.x == 0) st_relaxed_sys(arrivals, 0u);
        if (!barrier<kKind>(c)) return false;
        if (threadIdx.x == 0) st_release_sys(passed, gen + 1u);
    } else if (threadIdx.x == 0) {
        // Block 0 waits for the peers, under the timeout: this wait gives it twice that,
        // so that a missing peer is named by block 0's record, not this one.
        Waiter w;
        w.scale = 2;
        while (ld_acquire_sys(passed) == gen)
            if (!w.keep_waiting(c, me)) break;
    }
    __syncthreads();
    return c.block->abort == 0u;
}

}  // namespace peercomm

#endif  // PEERCOMM_DEVICE_H
