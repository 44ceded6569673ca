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

#include "peercomm_device.h"

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

// Max and Min of two values by peercomm_signal.h's rule, but for the NaN's bits (-0.0
// below +0.0; a NaN on either side gives a NaN, which the store makes the canonical one).
// gfx9's v_max_f32 returns the number beside a NaN, so the rule is spelled out; the
// conditions combine with & and |, not && and ||: no branch per lane.
PC_INLINE float maximum_f32(float a, float b) {
    const bool tie = (b == a) & (bits_from_float(a) > bits_from_float(b));
    return ((b != b) | (b > a) | tie) ? b : a;
}
PC_INLINE float minimum_f32(float a, float b) {
    const bool tie = (b == a) & (bits_from_float(b) > bits_from_float(a));
    return ((b != b) | (b < a) | tie) ? b : a;
}

// A wavefront's lanes: the word v of the next lane (the last lane gets its own back).
// Every lane of the wavefront calls it.
PC_INLINE uint32_t warp_lanes() { return (uint32_t)warpSize; }
PC_INLINE uint32_t from_next_lane(uint32_t v) { return (uint32_t)__shfl_down((int)v, 1); }

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
