// peercomm CUDA vendor layer: what differs on NVIDIA GPUs (sm_80, sm_90) under the
// algorithms of kernels-common/peercomm_kernels.h, which is included below.
//
// Memory operations are PTX with the scope and order in their names: peers reach the
// signal words over NVLink / PCIe, so every signal-word access is at system scope.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "peercomm_signal.h"

#include "peercomm_device.h"

// ---------------------------------------------------------------------------------
// Conversions (hardware, round to nearest even).

PC_INLINE float float_from_bits(uint32_t b) { return __uint_as_float(b); }
PC_INLINE uint32_t bits_from_float(float x) { return __float_as_uint(x); }
PC_INLINE float float_from_f16(uint16_t b) { return __half2float(__ushort_as_half(b)); }
PC_INLINE uint16_t f16_from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
PC_INLINE uint16_t bf16_from_float(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
PC_INLINE double double_from_bits(uint64_t b) { return __longlong_as_double((long long)b); }
PC_INLINE uint64_t bits_from_double(double x) { return (uint64_t)__double_as_longlong(x); }

// Max and Min of two values by peercomm_signal.h's rule, but for the NaN's bits (-0.0
// below +0.0; a NaN on either side gives a NaN, which the store makes the canonical one):
// sm_80's max.NaN / min.NaN, IEEE 754-2019's maximum and minimum in one instruction.
PC_INLINE float maximum_f32(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
PC_INLINE float minimum_f32(float a, float b) {
    float r;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
// The same over the two f16 or bf16 lanes of a word, in their own format: exact, as the
// f32 loop is, with no conversion (peercomm_kernels.h's fold_extrema_x2).
#define PC_PACKED_EXTREMA 1
#define PC_PACKED_OP2(name, insn)                               \
    PC_INLINE uint32_t name(uint32_t a, uint32_t b) {           \
        uint32_t r;                                             \
        asm(insn " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));   \
        return r;                                               \
    }
PC_PACKED_OP2(maximum_f16x2, "max.NaN.f16x2")
PC_PACKED_OP2(minimum_f16x2, "min.NaN.f16x2")
PC_PACKED_OP2(maximum_bf16x2, "max.NaN.bf16x2")
PC_PACKED_OP2(minimum_bf16x2, "min.NaN.bf16x2")
// The lanes where a or b is a NaN, as 0xffff (others 0): one packed compare (bf16x2
// from sm_90), with which Prod's store makes NaNs canonical with no test and branch per
// pack (nan_lanes_x2(w) is unordered(w, w)). sm_80 keeps the shared test.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PC_PACKED_NAN_LANES 1
PC_PACKED_OP2(unordered_f16x2, "set.nan.u32.f16x2")
PC_PACKED_OP2(unordered_bf16x2, "set.nan.u32.bf16x2")
#endif

// A warp's lanes: the word v of the next lane (the last lane gets its own back). Every
// lane of the warp calls it.
PC_INLINE uint32_t warp_lanes() { return 32u; }
PC_INLINE uint32_t from_next_lane(uint32_t v) { return __shfl_down_sync(0xffffffffu, v, 1); }

#include "peercomm_kernels.h"
#include "peercomm_collectives.h"
#include "peercomm_group.h"
#include "peercomm_exchange.h"

// ---------------------------------------------------------------------------------
// Entry points: the argument struct by value (288 bytes of kernel parameters, read
// from the constant bank).

// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the
// kernel before it is finishing. Waiting for that grid first keeps every read of the
// previous kernel's results (the input, the own signal's counters) after them; letting
// the next kernel start early is safe because it waits the same way. Without such a
// launch both instructions do nothing.
PC_INLINE void overlap_with_neighbours() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define PC_CUDA_KERNEL(symbol, body)                                                  \
    extern "C" __global__ void __launch_bounds__(512) symbol(const Args a) { \
        overlap_with_neighbours();                                                    \
        body(a);                                                                      \
    }

PEERCOMM_KERNELS(PC_CUDA_KERNEL)
PEERCOMM_COLLECTIVE_KERNELS(PC_CUDA_KERNEL)

// The batched all-reduce (1104 bytes) and the exchange (1096 bytes): an argument struct
// of their own, by value.
#define PC_CUDA_WIDE_KERNEL(type, symbol, body)                                   \
    extern "C" __global__ void __launch_bounds__(512) symbol(const type args) { \
        overlap_with_neighbours();                                                \
        body(args);                                                               \
    }
#define PC_CUDA_GROUP_KERNEL(symbol, body) PC_CUDA_WIDE_KERNEL(peercomm_group_args, symbol, body)
#define PC_CUDA_EXCHANGE_KERNEL(symbol, body) PC_CUDA_WIDE_KERNEL(peercomm_exchange_args, symbol, body)

PEERCOMM_GROUP_KERNELS(PC_CUDA_GROUP_KERNEL)
PEERCOMM_EXCHANGE_KERNELS(PC_CUDA_EXCHANGE_KERNEL)
