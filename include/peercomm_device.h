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

#endif  // PEERCOMM_DEVICE_H
