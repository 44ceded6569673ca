// peercomm HIP vendor layer: what differs on AMD Instinct GPUs (gfx90a, gfx942, gfx950)
// under the algorithms of kernels-common/peercomm_kernels.h, which is included below.
//
// AMD specifics:
// - Wavefronts are 64 lanes; the all-reduce blocks are multiples of 64 threads (the
//   communicator checks), and the barrier's counter work is done by lanes
//   t < group_width (<= 8) of each block's first wavefront.
// - Ordering uses the clang `__hip_atomic_*` builtins at system scope, which lower to
//   the cache write-back / invalidate sequences of the AMDGPU memory model
//   (buffer_wbl2 / buffer_invl2 on gfx90a, buffer_wbl2 sc0 sc1 / buffer_inv sc0 sc1 on
//   gfx942). tests/hip.rs checks the disassembly of the barrier kernel for them.
// - The signal allocation (counters, Lamport region, payload) is uncached device memory
//   (hipDeviceMallocUncached, or fine-grained on older runtimes), so spins see the
//   peers' stores and peers see ours without cache maintenance in between.
// - Every pointer made from an address is in the global address space: without it the
//   compiler would use the slower flat instructions.
// - The timeout clock is the constant-rate wall clock (s_memrealtime, 100 MHz on the
//   Instinct parts); the host overwrites `peercomm_wall_clock_khz` after loading the
//   module when the runtime reports the rate.

#include <hip/hip_runtime.h>
#include <stdint.h>

#include "peercomm_signal.h"

#define PC_INLINE __device__ __attribute__((always_inline)) inline
#define PC_GLOBAL __attribute__((address_space(1)))
// Shared memory (LDS): the block state is accessed through volatile pointers, which the
// compiler does not narrow from flat by itself.
#define PC_SHARED __attribute__((address_space(3)))
// Checks of abort and timeout between spins: every spin is a round trip to uncached
// memory, so fewer spins pass between checks than on CUDA.
#define PC_SPIN_CHECK_INTERVAL 64u

// 16 bytes as four 32-bit words: one global_load_dwordx4 / global_store_dwordx4.
typedef uint32_t Vec16 __attribute__((ext_vector_type(4)));
PC_INLINE Vec16 make_vec16(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return Vec16{x, y, z, w}; }

// Rate of the wall clock in kHz. Set by the host (hipModuleGetGlobal) after loading the
// module from hipDeviceAttributeWallClockRate; the default is the Instinct rate.
extern "C" __device__ uint32_t peercomm_wall_clock_khz = 100000;

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

// ---------------------------------------------------------------------------------
// Conversions (round to nearest even, as the `half` crate does on the host).

PC_INLINE float float_from_bits(uint32_t b) { return __builtin_bit_cast(float, b); }
PC_INLINE uint32_t bits_from_float(float x) { return __builtin_bit_cast(uint32_t, x); }
PC_INLINE float float_from_f16(uint16_t b) { return (float)__builtin_bit_cast(_Float16, b); }
PC_INLINE uint16_t f16_from_float(float x) { return __builtin_bit_cast(uint16_t, (_Float16)x); }
PC_INLINE uint16_t bf16_from_float(float x) {
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
PC_INLINE double double_from_bits(uint64_t b) { return __builtin_bit_cast(double, b); }
PC_INLINE uint64_t bits_from_double(double x) { return __builtin_bit_cast(uint64_t, x); }

#include "peercomm_kernels.h"
#include "peercomm_collectives.h"
#include "peercomm_group.h"
#include "peercomm_exchange.h"

// ---------------------------------------------------------------------------------
// Entry points. The argument struct (288 bytes) is the first and only explicit kernel
// argument, at offset 0 of the kernel-argument segment; the kernels read it there in
// place rather than through the by-value parameter, whose arrays, indexed with run-time
// ranks, would make the compiler copy all of it into scratch memory first.

PC_INLINE const Args& kernel_args() { return *(const Args*)__builtin_amdgcn_kernarg_segment_ptr(); }

// 512 threads at most, as on CUDA (CommConfig::threads_per_block is at most 512): the
// compiler then has 256 VGPRs a lane (two waves of a block per SIMD) instead of 128,
// which the chunked collectives and one-stage need to keep their packs in registers
// (tests/hip.rs checks for scratch).
#define PC_HIP_KERNEL(symbol, body) \
    extern "C" __global__ void __launch_bounds__(512) symbol(const Args) { body(kernel_args()); }

PEERCOMM_KERNELS(PC_HIP_KERNEL)
PEERCOMM_COLLECTIVE_KERNELS(PC_HIP_KERNEL)

// The batched all-reduce (1104 bytes) and the exchange (1096 bytes): an argument struct
// of their own, read in place the same way.
template <typename T>
PC_INLINE const T& wide_kernel_args() {
    return *(const T*)__builtin_amdgcn_kernarg_segment_ptr();
}

#define PC_HIP_WIDE_KERNEL(type, symbol, body) \
    extern "C" __global__ void __launch_bounds__(512) symbol(const type) { body(wide_kernel_args<type>()); }
#define PC_HIP_GROUP_KERNEL(symbol, body) PC_HIP_WIDE_KERNEL(peercomm_group_args, symbol, body)
#define PC_HIP_EXCHANGE_KERNEL(symbol, body) PC_HIP_WIDE_KERNEL(peercomm_exchange_args, symbol, body)

PEERCOMM_GROUP_KERNELS(PC_HIP_GROUP_KERNEL)
PEERCOMM_EXCHANGE_KERNELS(PC_HIP_EXCHANGE_KERNEL)
