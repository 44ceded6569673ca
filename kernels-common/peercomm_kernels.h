// peercomm device algorithms, written once: the counter barrier, the abort protocol, the
// reduce and copy ranges, the Lamport primitives and every collective. Compiled by nvcc
// (kernels-cuda/peercomm.cu) and by hipcc / clang (kernels-hip/peercomm.hip).
//
// Layering:
//   include/peercomm_signal.h          memory layout and launch arguments (C; bindgen
//                                      mirrors it for Rust)
//   kernels-common/peercomm_kernels.h  this file: the algorithms
//   kernels-cuda/peercomm.cu           the vendor layers: memory operations and their
//   kernels-hip/peercomm.hip           scopes, timer, conversions, launch bounds, and how
//                                      an entry point reads its arguments
//
// The host backend (src/backend/host/kernels.rs, the dispatch, and the files under
// src/backend/host/kernels/: barrier glue and signal access in signals.rs, aborts and
// error records in records.rs, ranges and the group sum in packs.rs, the Lamport
// primitives in lamport.rs, one_stage.rs, two_stage.rs, collectives.rs, group.rs) is the
// executable specification: the same pack distribution over blocks, the same reduction
// order, the same Lamport generations, so every rank and every backend writes the same
// bits.
//
// What this file uses, from the device API (include/peercomm_device.h, which the
// vendor layer includes first; each operation's semantics are written there):
//   PC_INLINE, PC_GLOBAL, PC_SHARED, PC_SPIN_CHECK_INTERVAL, Vec16, make_vec16, the
//   32-bit signal-word operations at system scope (ld_relaxed_sys, ld_acquire_sys,
//   st_relaxed_sys, st_release_sys, cas_relaxed_sys), atomic_add_relaxed_dev, the
//   16-byte accesses (ld/st_volatile_vec16, ld/st_relaxed_sys_vec16,
//   st_release_sys_vec16), timer_now() and timer_ticks(ns);
// and from the vendor layer: float_from_bits, bits_from_float, float_from_f16,
// f16_from_float, bf16_from_float, double_from_bits, bits_from_double (narrowing
// rounds to nearest even), and, after including it, one `extern "C" __global__`
// function per PEERCOMM_KERNELS entry (at the end of this file).

#ifndef PEERCOMM_KERNELS_H
#define PEERCOMM_KERNELS_H

#include <stdint.h>

#include "peercomm_signal.h"

// The device API's memory operations (include/peercomm_device.h), included by the
// vendor layer, are used here unqualified.
using namespace peercomm;

typedef peercomm_allreduce_args Args;
// The block context of the library's kernels (the device API's, over their arguments).
typedef BlockCtx<Args> Ctx;

static_assert(sizeof(peercomm_signal) == 8683776, "peercomm_signal layout changed");
static_assert(sizeof(peercomm_allreduce_args) == 328, "peercomm_allreduce_args layout changed");
static_assert((PC_SPIN_CHECK_INTERVAL & (PC_SPIN_CHECK_INTERVAL - 1)) == 0,
              "PC_SPIN_CHECK_INTERVAL is a power of two");

PC_INLINE uint64_t min_u64(uint64_t x, uint64_t y) { return x < y ? x : y; }

// A lambda inlined where it is called (nvcc and clang accept the attribute after its
// parameters): the compilers outline the larger bodies of a per-width or per-operator
// dispatch otherwise, and a call costs the kernel a frame and its registers at the call.
#define PC_INLINE_LAMBDA __attribute__((always_inline))

// ---------------------------------------------------------------------------------
// Element types: raw bits in memory, f32 in registers. kCanonicalNaN is the one NaN
// that Prod, Max and Min store, as these bits; kInf the bits of +infinity. Where the
// vendor has packed f16/bf16 extrema (PC_PACKED_EXTREMA), extremum_x2 is Max's or
// Min's step over a word of two lanes; where it has a packed NaN test
// (PC_PACKED_NAN_LANES), nan_lanes_x2 marks a word's NaN lanes as 0xffff.
// kRunTimeWidth: whether the reducing kernels take the group width at run time (one
// body, reduce_range_rt) instead of one body per width (with_width): false for the
// three types every kernel takes.

struct F32 {
    typedef uint32_t Bits;
    static constexpr bool kRunTimeWidth = false;
    static constexpr Bits kNegZero = 0x80000000u;
    static constexpr Bits kCanonicalNaN = 0x7fc00000u;
    static PC_INLINE float to_float(Bits b) { return float_from_bits(b); }
    static PC_INLINE Bits from_float(float x) { return bits_from_float(x); }
};
struct F16 {
    typedef uint16_t Bits;
    static constexpr bool kRunTimeWidth = false;
    static constexpr Bits kNegZero = 0x8000u;
    static constexpr Bits kCanonicalNaN = 0x7e00u;
    static constexpr Bits kInf = 0x7c00u;
    static PC_INLINE float to_float(Bits b) { return float_from_f16(b); }
    static PC_INLINE Bits from_float(float x) { return f16_from_float(x); }
#ifdef PC_PACKED_EXTREMA
    template <bool kMax>
    static PC_INLINE uint32_t extremum_x2(uint32_t a, uint32_t b) {
        return kMax ? maximum_f16x2(a, b) : minimum_f16x2(a, b);
    }
#endif
#ifdef PC_PACKED_NAN_LANES
    static PC_INLINE uint32_t nan_lanes_x2(uint32_t w) { return unordered_f16x2(w, w); }
#endif
};
struct BF16 {
    typedef uint16_t Bits;
    static constexpr bool kRunTimeWidth = false;
    static constexpr Bits kNegZero = 0x8000u;
    static constexpr Bits kCanonicalNaN = 0x7fc0u;
    static constexpr Bits kInf = 0x7f80u;
    static PC_INLINE float to_float(Bits b) { return float_from_bits((uint32_t)b << 16); }
    static PC_INLINE Bits from_float(float x) { return bf16_from_float(x); }
#ifdef PC_PACKED_EXTREMA
    template <bool kMax>
    static PC_INLINE uint32_t extremum_x2(uint32_t a, uint32_t b) {
        return kMax ? maximum_bf16x2(a, b) : minimum_bf16x2(a, b);
    }
#endif
#ifdef PC_PACKED_NAN_LANES
    static PC_INLINE uint32_t nan_lanes_x2(uint32_t w) { return unordered_bf16x2(w, w); }
#endif
};

// The other types: reduced (one-stage, reduce, reduce-scatter) in their accumulator Acc,
// f64 for F64 and the integer itself for the integers (wrapping), with the group width
// a run-time value; moved (all-gather, broadcast, scatter) by the kernel of their size.
struct F64 {
    typedef uint64_t Bits;
    typedef double Acc;
    static constexpr bool kRunTimeWidth = true;
    static constexpr bool kFloat = true;
    static constexpr Bits kCanonicalNaN = 0x7ff8000000000000ull;
    static PC_INLINE Acc to_acc(Bits b) { return double_from_bits(b); }
    static PC_INLINE Bits from_acc(Acc x) { return bits_from_double(x); }
};
// B: the bits (unsigned, where Sum and Prod wrap), S: the value (Max and Min compare it).
template <typename B, typename S>
struct Int {
    typedef B Bits;
    typedef S Acc;
    static constexpr bool kRunTimeWidth = true;
    static constexpr bool kFloat = false;
    static PC_INLINE Acc to_acc(Bits b) { return (S)b; }
    static PC_INLINE Bits from_acc(Acc x) { return (B)x; }
};
struct I8 : Int<uint8_t, int8_t> {};
struct U8 : Int<uint8_t, uint8_t> {};
struct I32 : Int<uint32_t, int32_t> {};
struct U32 : Int<uint32_t, uint32_t> {};
struct I64 : Int<uint64_t, int64_t> {};
struct U64 : Int<uint64_t, uint64_t> {};

PC_INLINE uint32_t vec16_word(const Vec16& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
PC_INLINE void set_vec16_word(Vec16& v, int i, uint32_t x) {
    if (i == 0) {
        v.x = x;
    } else if (i == 1) {
        v.y = x;
    } else if (i == 2) {
        v.z = x;
    } else {
        v.w = x;
    }
}

// One 16-byte pack seen as lanes of D. Lanes are shifts on the four words, indexed by
// constants once loops are unrolled, so the pack stays in registers: a union with a lane
// array made older clang keep packs in scratch, and a run-time lane index puts the
// pack in local memory on either compiler. An 8-byte lane is two words, low first.
template <typename D>
struct Pack {
    typedef typename D::Bits Bits;
    static constexpr int kLanes = 16 / sizeof(Bits);
    static constexpr int kLanesPerWord = kLanes >= 4 ? kLanes / 4 : 1;
    static constexpr int kLaneBits = 32 / kLanesPerWord;
    Vec16 v;

    PC_INLINE Bits lane(int j) const {
        if constexpr (sizeof(Bits) == 8) {
            return (Bits)vec16_word(v, 2 * j) | (Bits)vec16_word(v, 2 * j + 1) << 32;
        } else {
            return (Bits)(vec16_word(v, j / kLanesPerWord) >> (kLaneBits * (j % kLanesPerWord)));
        }
    }
    PC_INLINE void set_lane(int j, Bits x) {
        if constexpr (sizeof(Bits) == 8) {
            set_vec16_word(v, 2 * j, (uint32_t)x);
            set_vec16_word(v, 2 * j + 1, (uint32_t)(x >> 32));
        } else if constexpr (kLanesPerWord == 1) {
            set_vec16_word(v, j, x);
        } else {
            const int shift = kLaneBits * (j % kLanesPerWord);
            const uint32_t mask = ((1u << kLaneBits) - 1u) << shift;
            const uint32_t word = vec16_word(v, j / kLanesPerWord);
            set_vec16_word(v, j / kLanesPerWord, (word & ~mask) | ((uint32_t)x << shift));
        }
    }
};

// ---------------------------------------------------------------------------------
// Data movement. Pack p (16 bytes, elements [p*L, p*L + L)) is handled by global thread
// p % stride of every rank; the last, partial pack and unaligned buffers go lane by
// lane, in the same order and with the same rounding.

PC_INLINE bool aligned16(uint64_t p) { return (p & 15u) == 0; }

PC_INLINE uint64_t lanes_in_pack(uint64_t p, uint64_t n, int lanes) {
    const uint64_t first = p * lanes;
    return n - first < (uint64_t)lanes ? n - first : (uint64_t)lanes;
}

PC_INLINE Vec16 load_vec16(uint64_t base, uint64_t p) { return ((const PC_GLOBAL Vec16*)base)[p]; }
PC_INLINE void store_vec16(uint64_t base, uint64_t p, Vec16 x) { ((PC_GLOBAL Vec16*)base)[p] = x; }

template <typename D>
PC_INLINE typename D::Bits load_elem(uint64_t base, uint64_t i) {
    return ((const PC_GLOBAL typename D::Bits*)base)[i];
}
template <typename D>
PC_INLINE void store_elem(uint64_t base, uint64_t i, typename D::Bits x) {
    ((PC_GLOBAL typename D::Bits*)base)[i] = x;
}

// Packs a thread keeps in flight per iteration with W sources: 8 loads of 16 bytes.
template <int W>
struct Unroll {
    static constexpr int G = W >= 8 ? 1 : 8 / W;
};

// One sign of zero for every sum over two or more ranks: the f32 accumulator starts at
// +0.0 (acc = +0.0 + x[0]), so an exact-zero sum is +0.0 whatever the algorithm
// (Lamport sends a Sum's or an Avg's -0.0 as +0.0) and every other sum is unchanged.
// A group of one stays an exact copy.
template <int W>
PC_INLINE float sum_start(float x0) {
    if constexpr (W > 1) {
        return 0.0f + x0;
    } else {
        return x0;
    }
}

// The reduction operator of a call (PEERCOMM_OP_*, word 2 of its descriptor).
PC_INLINE uint32_t call_op(const Args& a) { return (a.call[2] >> PEERCOMM_CALL_OP_SHIFT) & 7u; }

// The operators over f32, f16 and bf16, by peercomm_signal.h's rules, in f32 and source
// order: acc = first(x[0]), acc = step(acc, x[s]) for s = 1.., then store() rounds acc
// to the type. Each is a type, so a reduction's loop holds one operator's instructions
// alone (against one body for every operator: a loop 2-5x longer in SASS); with_op
// picks the loop once per range, a branch every thread of the call takes alike.
struct SumOp {
    static constexpr int kExtremum = 0;           // Max 1, Min -1, the others 0
    static constexpr bool kNaNCanonical = false;  // whether store makes any NaN the canonical one
    template <int W>
    static PC_INLINE float first(float x) { return sum_start<W>(x); }
    static PC_INLINE float step(float acc, float x) { return acc + x; }
    template <typename D, int W>
    static PC_INLINE typename D::Bits store(float acc) { return D::from_float(acc); }
};
// The sum over the width, one f32 rounding: a multiplication by the exact 1 / W where W
// is a power of two rounds as the division does.
struct AvgOp : SumOp {
    template <typename D, int W>
    static PC_INLINE typename D::Bits store(float acc) {
        if constexpr (W > 1 && (W & (W - 1)) == 0) {
            acc = acc * (1.0f / (float)W);
        } else if constexpr (W > 1) {
            acc = acc / (float)W;
        }
        return D::from_float(acc);
    }
};
// Prod, Max and Min store any NaN as the type's canonical NaN.
struct NaNCanonicalOp {
    static constexpr int kExtremum = 0;
    static constexpr bool kNaNCanonical = true;
    template <int W>
    static PC_INLINE float first(float x) { return x; }
    template <typename D, int W>
    static PC_INLINE typename D::Bits store(float acc) { return acc != acc ? D::kCanonicalNaN : D::from_float(acc); }
};
struct ProdOp : NaNCanonicalOp {
    static PC_INLINE float step(float acc, float x) { return acc * x; }
};
// By value, -0.0 below +0.0, a NaN on either side a NaN: the vendor's maximum_f32 and
// minimum_f32 (one instruction on sm_80+).
struct MaxOp : NaNCanonicalOp {
    static constexpr int kExtremum = 1;
    static PC_INLINE float step(float acc, float x) { return maximum_f32(acc, x); }
};
struct MinOp : NaNCanonicalOp {
    static constexpr int kExtremum = -1;
    static PC_INLINE float step(float acc, float x) { return minimum_f32(acc, x); }
};

// Runs body.template operator()<Op>() with Op the type of operator op; unknown codes
// reduce as Sum.
template <typename F>
PC_INLINE auto with_op(uint32_t op, F&& body) {
    switch (op) {
        case PEERCOMM_OP_PROD: return body.template operator()<ProdOp>();
        case PEERCOMM_OP_MAX: return body.template operator()<MaxOp>();
        case PEERCOMM_OP_MIN: return body.template operator()<MinOp>();
        case PEERCOMM_OP_AVG: return body.template operator()<AvgOp>();
        default: return body.template operator()<SumOp>();
    }
}

// The NaN lanes of a pack of f16 or bf16 as D's canonical NaN, a word of two lanes at a
// time: the vendor's packed test, else lane by lane |x| + (0x7fff - inf), which carries
// into the lane's bit 15 exactly when |x| > inf.
template <typename D>
PC_INLINE Vec16 canonical_nans(Vec16 v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t w = vec16_word(v, i);
#ifdef PC_PACKED_NAN_LANES
        const uint32_t nan = D::nan_lanes_x2(w);
#else
        constexpr uint32_t kToSign = (0x7fffu - D::kInf) * 0x10001u;
        const uint32_t nan = (((w & 0x7fff7fffu) + kToSign) >> 15 & 0x10001u) * 0xffffu;
#endif
        set_vec16_word(v, i, (w & ~nan) | ((uint32_t)D::kCanonicalNaN * 0x10001u & nan));
    }
    return v;
}

#ifdef PC_PACKED_EXTREMA
// Max (kMax) or Min of the W packs of f16 or bf16, two lanes a step in their own format:
// the bits of the f32 loop (an extremum rounds nothing), a third of its instructions.
template <typename D, int W, bool kMax>
PC_INLINE Vec16 fold_extrema_x2(const Vec16 (&x)[W]) {
    Vec16 acc = x[0];
#pragma unroll
    for (int s = 1; s < W; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            set_vec16_word(acc, i, D::template extremum_x2<kMax>(vec16_word(acc, i), vec16_word(x[s], i)));
    }
    return canonical_nans<D>(acc);
}
#endif

// The W packs reduced lane by lane by Op, in source order.
template <typename D, int W, typename Op>
PC_INLINE Vec16 fold_packs(const Vec16 (&x)[W]) {
    constexpr int L = Pack<D>::kLanes;
#ifdef PC_PACKED_EXTREMA
    if constexpr (Op::kExtremum != 0 && sizeof(typename D::Bits) == 2) {
        return fold_extrema_x2<D, W, (Op::kExtremum > 0)>(x);
    }
#endif
    Pack<D> in{x[0]};
    float acc[L];
#pragma unroll
    for (int j = 0; j < L; ++j) acc[j] = Op::template first<W>(D::to_float(in.lane(j)));
#pragma unroll
    for (int s = 1; s < W; ++s) {
        in.v = x[s];
#pragma unroll
        for (int j = 0; j < L; ++j) acc[j] = Op::step(acc[j], D::to_float(in.lane(j)));
    }
    Pack<D> out{make_vec16(0u, 0u, 0u, 0u)};
    if constexpr (Op::kNaNCanonical && sizeof(typename D::Bits) == 2) {
        // Rounded two lanes at a time, then made canonical two at a time: by the vendor's
        // packed test, two instructions a word and no branch; else, a NaN being rare, the
        // pack is tested for one (|x| + (0x7fff - inf) carries into a lane's bit 15 only
        // for a NaN) and made canonical only then.
#pragma unroll
        for (int j = 0; j < L; ++j) out.set_lane(j, D::from_float(acc[j]));
#ifdef PC_PACKED_NAN_LANES
        out.v = canonical_nans<D>(out.v);
#else
        constexpr uint32_t kToSign = (0x7fffu - D::kInf) * 0x10001u;
        uint32_t carries = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) carries |= (vec16_word(out.v, i) & 0x7fff7fffu) + kToSign;
        if ((carries & 0x80008000u) != 0u) out.v = canonical_nans<D>(out.v);
#endif
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j) out.set_lane(j, Op::template store<D, W>(acc[j]));
    }
    return out.v;
}

// The sum of the W packs (the fused kernels' and the Sum operator's).
template <typename D, int W>
PC_INLINE Vec16 sum_packs(const Vec16 (&x)[W]) {
    return fold_packs<D, W, SumOp>(x);
}

// Pack p lane by lane (the tail, or unaligned buffers): same order, same rounding. The
// operator is picked per step: this path is cold, and one body for every operator keeps
// the kernels smaller.
template <typename D, int W>
PC_INLINE void reduce_pack_scalar(uint32_t op, const uint64_t* srcs, uint64_t p, uint64_t n, uint64_t dst,
                                  uint64_t dst_p) {
    constexpr int L = Pack<D>::kLanes;
    for (uint64_t e = p * L, j = 0; e < n && j < (uint64_t)L; ++e, ++j) {
        const float x0 = D::to_float(load_elem<D>(srcs[0], e));
        float acc = with_op(op, [&]<typename Op>() PC_INLINE_LAMBDA { return Op::template first<W>(x0); });
        for (int s = 1; s < W; ++s) {
            const float x = D::to_float(load_elem<D>(srcs[s], e));
            acc = with_op(op, [&]<typename Op>() PC_INLINE_LAMBDA { return Op::step(acc, x); });
        }
        const typename D::Bits out =
            with_op(op, [&]<typename Op>() PC_INLINE_LAMBDA { return Op::template store<D, W>(acc); });
        store_elem<D>(dst, dst_p * L + j, out);
    }
}

// Pack p of the W sources reduced by Op (the operator op) into pack p of dst: 16 bytes at
// a time where vec and the pack is whole, else lane by lane (the batched all-reduce's
// unit).
template <typename D, int W, typename Op>
PC_INLINE void reduce_pack(uint32_t op, const uint64_t* srcs, uint64_t p, uint64_t n, uint64_t dst, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    if (vec && (p + 1) * L <= n) {
        Vec16 x[W];
#pragma unroll
        for (int s = 0; s < W; ++s) x[s] = load_vec16(srcs[s], p);
        store_vec16(dst, p, fold_packs<D, W, Op>(x));
    } else {
        reduce_pack_scalar<D, W>(op, srcs, p, n, dst, p);
    }
}

// The first pack at or after `from` that this thread handles (pack p by the thread whose
// tid is (p - first) % stride).
PC_INLINE uint64_t first_pack_from(uint64_t first, uint64_t from, uint64_t tid, uint64_t stride) {
    const uint64_t p = first + tid;
    return p >= from ? p : p + (from - p + stride - 1) / stride * stride;
}

// Reduces the packs p in [first, end) of this thread (p - first = tid mod stride) from
// the W sources into dst at pack p - dst_base, by the operator op. The whole packs of
// aligned buffers go 16 bytes at a time, the loads of G packs of every source issued
// before any is used; the last, partial pack (and every pack of unaligned buffers)
// goes lane by lane, in a loop of its own so that the main loop keeps its registers.
template <typename D, int W>
PC_INLINE void reduce_range(uint32_t op, const uint64_t* srcs, uint64_t first, uint64_t end, uint64_t n,
                            uint64_t dst, uint64_t dst_base, bool vec, uint64_t tid, uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    constexpr int G = Unroll<W>::G;
    const uint64_t whole = vec ? (n / L < first ? first : n / L < end ? n / L : end) : first;
    with_op(op, [&]<typename Op>() PC_INLINE_LAMBDA {
        for (uint64_t p0 = first + tid; p0 < whole; p0 += G * stride) {
            Vec16 x[G][W];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const uint64_t p = p0 + g * stride;
                if (p < whole) {
#pragma unroll
                    for (int s = 0; s < W; ++s) x[g][s] = load_vec16(srcs[s], p);
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const uint64_t p = p0 + g * stride;
                if (p >= whole) break;
                store_vec16(dst, p - dst_base, fold_packs<D, W, Op>(x[g]));
            }
        }
    });
    for (uint64_t p = first_pack_from(first, whole, tid, stride); p < end; p += stride)
        reduce_pack_scalar<D, W>(op, srcs, p, n, dst, p - dst_base);
}

// Copies the packs p in [first, end) of this thread from src (at pack p - src_base) to
// dst (at pack p - dst_base), four packs in flight per iteration.
template <typename D>
PC_INLINE void copy_range(uint64_t src, uint64_t src_base, uint64_t dst, uint64_t dst_base, uint64_t first,
                          uint64_t end, uint64_t n, bool vec, uint64_t tid, uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    constexpr int G = 4;
    for (uint64_t p0 = first + tid; p0 < end; p0 += G * stride) {
        Vec16 x[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (vec && p < end && (p + 1) * L <= n) x[g] = load_vec16(src, p - src_base);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const uint64_t p = p0 + g * stride;
            if (p >= end) break;
            if (vec && (p + 1) * L <= n) {
                store_vec16(dst, p - dst_base, x[g]);
            } else {
                const uint64_t valid = lanes_in_pack(p, n, L);
                for (uint64_t j = 0; j < valid; ++j)
                    store_elem<D>(dst, (p - dst_base) * L + j, load_elem<D>(src, (p - src_base) * L + j));
            }
        }
    }
}

// The all-gather of the two-stage kernel: partition q (packs [q*part, (q+1)*part)) sits
// at the start of rank q's payload. Each iteration loads pack j of every partition before
// storing any, and rank `me` starts at its own partition and rotates, so the W-1 readers
// of a partition are spread over all owners instead of queueing on one at a time. Thread
// tid touches packs q*part + tid + k*stride, the packs the same thread of rank q reduced.
template <typename D, int W>
PC_INLINE void gather_partitions(const uint64_t* payloads, uint32_t me, uint64_t part, uint64_t packs,
                                 uint64_t n, uint64_t dst, bool vec, uint64_t tid, uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    for (uint64_t j = tid; j < part; j += stride) {
        Vec16 x[W];
#pragma unroll
        for (int i = 0; i < W; ++i) {
            const uint32_t q = (me + (uint32_t)i) % (uint32_t)W;
            const uint64_t p = q * part + j;
            if (vec && p < packs && (p + 1) * L <= n) x[i] = load_vec16(payloads[q], j);
        }
#pragma unroll
        for (int i = 0; i < W; ++i) {
            const uint32_t q = (me + (uint32_t)i) % (uint32_t)W;
            const uint64_t p = q * part + j;
            if (p >= packs) continue;
            if (vec && (p + 1) * L <= n) {
                store_vec16(dst, p, x[i]);
            } else {
                const uint64_t valid = lanes_in_pack(p, n, L);
                for (uint64_t e = 0; e < valid; ++e)
                    store_elem<D>(dst, p * L + e, load_elem<D>(payloads[q], j * L + e));
            }
        }
    }
}

// Runs body.template operator()<W>() with W = the group width as a compile-time constant.
template <typename F>
PC_INLINE void with_width(uint32_t width, F&& body) {
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

// The reduction of the run-time-width types (D::kRunTimeWidth), by peercomm_signal.h's
// rules in D::Acc and source order: F64 as the f32 rules in f64 (Sum from +0.0 over two
// or more ranks, Max and Min with -0.0 below +0.0, a NaN of Prod, Max or Min the
// canonical NaN, Avg the sum over the width); the integers wrap (Sum and Prod in the unsigned bits) and
// compare by value (Avg, refused before any launch, sums). Unknown codes reduce as Sum.
template <typename D>
PC_INLINE typename D::Acc acc_first(uint32_t op, typename D::Acc x0, uint32_t width) {
    if constexpr (D::kFloat) {
        if ((op == PEERCOMM_OP_SUM || op == PEERCOMM_OP_AVG) && width > 1u) return (typename D::Acc)0 + x0;
    }
    return x0;
}
template <typename D>
PC_INLINE typename D::Acc acc_step(uint32_t op, typename D::Acc acc, typename D::Acc x) {
    typedef typename D::Acc A;
    typedef typename D::Bits B;
    if constexpr (D::kFloat) {
        if (op == PEERCOMM_OP_PROD) return acc * x;
        if (op == PEERCOMM_OP_MAX || op == PEERCOMM_OP_MIN) {
            // A NaN stays a NaN (acc_store makes it the canonical one).
            if (acc != acc || x != x) return acc + x;
            const bool is_max = op == PEERCOMM_OP_MAX;
            const bool acc_neg = (D::from_acc(acc) >> (8 * sizeof(B) - 1)) != 0u;
            const bool take_x = acc == x ? acc_neg == is_max : (acc < x) == is_max;
            return take_x ? x : acc;
        }
        return acc + x;
    } else {
        if (op == PEERCOMM_OP_PROD) return (A)(B)((B)acc * (B)x);
        if (op == PEERCOMM_OP_MAX) return acc < x ? x : acc;
        if (op == PEERCOMM_OP_MIN) return x < acc ? x : acc;
        return (A)(B)((B)acc + (B)x);
    }
}
template <typename D>
PC_INLINE typename D::Bits acc_store(uint32_t op, typename D::Acc acc, uint32_t width) {
    if constexpr (D::kFloat) {
        if ((op == PEERCOMM_OP_MAX || op == PEERCOMM_OP_MIN || op == PEERCOMM_OP_PROD) && acc != acc)
            return D::kCanonicalNaN;
        if (op == PEERCOMM_OP_AVG && width > 1u) acc = acc / (typename D::Acc)width;
    }
    return D::from_acc(acc);
}

// reduce_range for the run-time-width types: one body for every width (a loop over the
// sources), pack p by global thread p % stride, the tail and unaligned buffers lane by
// lane, the same order and bits either way.
template <typename D>
PC_INLINE void reduce_range_rt(uint32_t op, uint32_t width, const uint64_t* srcs, uint64_t first, uint64_t end,
                               uint64_t n, uint64_t dst, uint64_t dst_base, bool vec, uint64_t tid,
                               uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    typedef typename D::Acc A;
    for (uint64_t p = first + tid; p < end; p += stride) {
        if (vec && (p + 1) * L <= n) {
            Pack<D> in{load_vec16(srcs[0], p)};
            A acc[L];
#pragma unroll
            for (int j = 0; j < L; ++j) acc[j] = acc_first<D>(op, D::to_acc(in.lane(j)), width);
            for (uint32_t s = 1; s < width; ++s) {
                in.v = load_vec16(srcs[s], p);
#pragma unroll
                for (int j = 0; j < L; ++j) acc[j] = acc_step<D>(op, acc[j], D::to_acc(in.lane(j)));
            }
            Pack<D> out{make_vec16(0u, 0u, 0u, 0u)};
#pragma unroll
            for (int j = 0; j < L; ++j) out.set_lane(j, acc_store<D>(op, acc[j], width));
            store_vec16(dst, p - dst_base, out.v);
        } else {
            for (uint64_t e = p * L, j = 0; e < n && j < (uint64_t)L; ++e, ++j) {
                A acc = acc_first<D>(op, D::to_acc(load_elem<D>(srcs[0], e)), width);
                for (uint32_t s = 1; s < width; ++s) acc = acc_step<D>(op, acc, D::to_acc(load_elem<D>(srcs[s], e)));
                store_elem<D>(dst, (p - dst_base) * L + j, acc_store<D>(op, acc, width));
            }
        }
    }
}

// reduce_range over `width` sources: one body per width for F32, F16, BF16, one body
// for every width for the other types.
template <typename D>
PC_INLINE void reduce_range_any(uint32_t op, uint32_t width, const uint64_t* srcs, uint64_t first, uint64_t end,
                                uint64_t n, uint64_t dst, uint64_t dst_base, bool vec, uint64_t tid,
                                uint64_t stride) {
    if constexpr (D::kRunTimeWidth) {
        reduce_range_rt<D>(op, width, srcs, first, end, n, dst, dst_base, vec, tid, stride);
    } else {
        with_width(width, [&]<int W>() {
            reduce_range<D, W>(op, srcs, first, end, n, dst, dst_base, vec, tid, stride);
        });
    }
}

// ---------------------------------------------------------------------------------
// Lamport (the sentinel, the generations, the slots and their invariants: the device
// API, include/peercomm_device.h): the reduction over pushed packs.

// Whether operator op keeps the sign of a zero in its result (Prod, Max, Min): a Sum's or
// an Avg's starts at +0.0, so their Lamport kernels send -0.0 as +0.0.
PC_INLINE bool lamport_keeps_sign(uint32_t op) {
    return op == PEERCOMM_OP_PROD || op == PEERCOMM_OP_MAX || op == PEERCOMM_OP_MIN;
}

// Pack x as a Lamport kernel sends it under operator op, no word the sentinel: a Sum's
// or Avg's -0.0 lanes become +0.0; under Prod, Max and Min a word of all ones (NaN lanes
// only) becomes the canonical NaN in each lane (any NaN gives the canonical one under
// them), and then a word with the sentinel's bits becomes all ones,
// PEERCOMM_LAMPORT_SENTINEL_STANDIN, which lamport_decode turns back.
template <typename D>
PC_INLINE Vec16 lamport_encode(uint32_t op, Pack<D> x) {
    if (!lamport_keeps_sign(op)) {
#pragma unroll
        for (int j = 0; j < Pack<D>::kLanes; ++j)
            if (x.lane(j) == D::kNegZero) x.set_lane(j, 0);
        return x.v;
    }
    constexpr uint32_t kNaNs = sizeof(typename D::Bits) == 2 ? D::kCanonicalNaN * 0x10001u : D::kCanonicalNaN;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t w = vec16_word(x.v, i);
        set_vec16_word(x.v, i,
                       w == PEERCOMM_LAMPORT_SENTINEL_STANDIN ? kNaNs
                       : w == kLamportSentinel                ? PEERCOMM_LAMPORT_SENTINEL_STANDIN
                                                              : w);
    }
    return x.v;
}
// A pack as lamport_encode sent it, back to the bits it stands for.
PC_INLINE Vec16 lamport_decode(uint32_t op, Vec16 v) {
    if (lamport_keeps_sign(op)) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (vec16_word(v, i) == PEERCOMM_LAMPORT_SENTINEL_STANDIN) set_vec16_word(v, i, kLamportSentinel);
    }
    return v;
}

// Pack p of this rank's input as it is sent under the call's operator (and as this rank
// reduces it itself, through lamport_decode like the peers' packs).
template <typename D>
PC_INLINE Vec16 lamport_source_pack(const Args& a, uint64_t p, uint64_t n, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    Pack<D> x{make_vec16(0u, 0u, 0u, 0u)};
    const uint64_t valid = lanes_in_pack(p, n, L);
    if (vec && valid == (uint64_t)L) {
        x.v = load_vec16(a.local_input, p);
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j)
            x.set_lane(j, (uint64_t)j < valid ? load_elem<D>(a.local_input, p * L + j) : 0);
    }
    return lamport_encode<D>(call_op(a), x);
}

// Waits until pack p of every other source has arrived in the own region of generation
// gen, into x (the own slot is left alone); false when the block aborted meanwhile.
template <int W>
PC_INLINE bool lamport_wait_pack(Ctx& c, uint32_t gen, uint64_t p, Vec16 (&x)[W]) {
    const Args& a = c.a;
    const uint32_t me = a.group_rank, slot = a.lamport_slot_bytes;
    const uint64_t own = a.signals[me];
    Waiter w;
    while (true) {
        bool arrived = true;
        uint32_t missing = 0;  // a source whose pack has not arrived
#pragma unroll
        for (int s = 0; s < W; ++s) {
            if (s == (int)me) continue;
            x[s] = lamport_poll(lamport_pack_at(own, slot, (uint32_t)W, gen, s, p));
            if (!lamport_arrived(x[s])) missing = (uint32_t)s;
            arrived = arrived && lamport_arrived(x[s]);
        }
        if (arrived) return true;
        if (!w.keep_waiting(c, missing)) return false;
    }
}

// The own pack joins x, and the reduction by the call's operator goes to pack p of the
// output.
template <typename D, int W, typename Op>
PC_INLINE void lamport_store(const Args& a, uint64_t p, uint64_t n, bool vec, Vec16 (&x)[W]) {
    constexpr int L = Pack<D>::kLanes;
    const uint32_t op = call_op(a);
#pragma unroll
    for (int s = 0; s < W; ++s) {
        if (s == (int)a.group_rank) x[s] = lamport_source_pack<D>(a, p, n, vec);
        x[s] = lamport_decode(op, x[s]);
    }
    Pack<D> out{fold_packs<D, W, Op>(x)};
    const uint64_t valid = lanes_in_pack(p, n, L);
    if (vec && valid == (uint64_t)L) {
        store_vec16(a.output, p, out.v);
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j)
            if ((uint64_t)j < valid) store_elem<D>(a.output, p * L + j, out.lane(j));
    }
}

// Every block pushes this call's header (the same bytes) into slot group_rank of
// every other member's region of generation gen, first (thread 0): a block that starts
// after another block of this rank found a mismatch returns at entry, so the header must
// not wait for any one block, or a peer would wait for it until its timeout.
PC_INLINE void lamport_push_header(Ctx& c, uint32_t gen) {
    const Args& a = c.a;
    if (threadIdx.x != 0) return;
    for (uint32_t q = 0; q < a.group_width; ++q)
        if (q != a.group_rank)
            for (uint32_t k = 0; k < PEERCOMM_LAMPORT_HEADER_PACKS; ++k)
                lamport_push(
                    lamport_header_at(a.signals[q], a.lamport_slot_bytes, a.group_width, gen, a.group_rank, k),
                    make_vec16(a.call[3u * k], a.call[3u * k + 1u], a.call[3u * k + 2u], 0u));
}

// Pack p of this rank's input, as lamport_source_pack made it, into slot group_rank of
// every other member's region of generation gen (the own slot is never written).
PC_INLINE void lamport_push_pack(const Args& a, uint32_t gen, uint64_t p, Vec16 x) {
    for (uint32_t q = 0; q < a.group_width; ++q)
        if (q != a.group_rank)
            lamport_push(lamport_pack_at(a.signals[q], a.lamport_slot_bytes, a.group_width, gen, a.group_rank, p), x);
}

// The end of every Lamport kernel, called by every thread of every block: clears the
// previous call's generation of the own region (its width x packs, headers included,
// the own slot skipped) for the call after next; then, unless the block aborted (the
// state is not advanced), the last block to arrive records this call's `packs` and width
// and advances the flag; then finish().
PC_INLINE void lamport_end(Ctx& c, uint64_t packs) {
    const Args& a = c.a;
    const uint32_t width = a.group_width, me = a.group_rank, slot = a.lamport_slot_bytes;
    const uint64_t own = a.signals[me];
    const LamportGeneration gen{c.block->lamport[PEERCOMM_LAMPORT_FLAG]};
    const uint32_t prev_packs = c.block->lamport[PEERCOMM_LAMPORT_PREV_PACKS];
    const uint32_t prev_width = c.block->lamport[PEERCOMM_LAMPORT_PREV_WIDTH];
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const Vec16 sentinel = make_vec16(kLamportSentinel, kLamportSentinel, kLamportSentinel, kLamportSentinel);
    const uint64_t clear_total = (uint64_t)prev_width * prev_packs;
    for (uint64_t i = tid; i < clear_total; i += stride) {
        const uint32_t src = (uint32_t)(i / prev_packs);
        if (src == me) continue;
        lamport_push(lamport_pack_at(own, slot, width, gen.clear(), src, i % prev_packs), sentinel);
    }
    if (tid < prev_width && tid != me)
        for (uint32_t k = 0; k < PEERCOMM_LAMPORT_HEADER_PACKS; ++k)
            lamport_push(lamport_header_at(own, slot, width, gen.clear(), (uint32_t)tid, k), sentinel);
    __syncthreads();
    if (c.block->abort) return abandon(c, WaitForPeers::No);  // the state is not advanced
    if (threadIdx.x == 0) {
        GlobalU32* s = c.own->lamport_state;
        const bool last =
            gridDim.x == 1 || atomic_add_relaxed_dev(&s[PEERCOMM_LAMPORT_ARRIVALS], 1u) == gridDim.x - 1;
        if (last) {
            s[PEERCOMM_LAMPORT_PREV_PACKS] = (uint32_t)packs;
            s[PEERCOMM_LAMPORT_PREV_WIDTH] = width;
            s[PEERCOMM_LAMPORT_ARRIVALS] = 0;
            s[PEERCOMM_LAMPORT_FLAG] = gen.next();
        }
    }
    finish(c);
}

// Thread blockDim - 1 - s checks source s's header (it may also reduce packs): a source
// that runs another call is a mismatch. The last threads are the idle ones of a small
// message, so the header wait overlaps the first packs' wait.
PC_INLINE void lamport_check_header(Ctx& c, uint32_t gen) {
    const Args& a = c.a;
    const uint32_t s = blockDim.x - 1u - threadIdx.x;
    if (s >= a.group_width || s == a.group_rank) return;
    Waiter w;
    CallWords theirs;
    bool differs = false;
    for (uint32_t k = 0; k < PEERCOMM_LAMPORT_HEADER_PACKS; ++k) {
        const PC_GLOBAL Vec16* at =
            lamport_header_at(a.signals[a.group_rank], a.lamport_slot_bytes, a.group_width, gen, s, k);
        Vec16 h = lamport_poll(at);
        while (!lamport_arrived(h)) {
            if (!w.keep_waiting(c, s)) return;
            h = lamport_poll(at);
        }
        theirs.w[3u * k] = h.x;
        theirs.w[3u * k + 1u] = h.y;
        theirs.w[3u * k + 2u] = h.z;
        differs = differs || h.x != a.call[3u * k] || h.y != a.call[3u * k + 1u] || h.z != a.call[3u * k + 2u];
    }
    if (differs) record_mismatch(c, s, theirs);
}

// Reduces, in source order, the packs of this thread as they arrive in the own region
// of generation gen. Nothing is stored before every source's header is checked: each
// thread first waits for its first pack while the header checkers wait for the
// headers, then the block meets; a mismatch (or an abort) stops it there. Later packs
// need no check. Stops early when the block aborts.
template <typename D, int W>
PC_INLINE void lamport_reduce(Ctx& c, uint32_t gen, uint64_t packs, uint64_t n, bool vec, uint64_t tid,
                              uint64_t stride) {
    const Args& a = c.a;
    Vec16 x[W];
    const bool first = tid < packs && lamport_wait_pack<W>(c, gen, tid, x);
    lamport_check_header(c, gen);
    __syncthreads();
    if (c.block->abort) return;
    with_op(call_op(a), [&]<typename Op>() PC_INLINE_LAMBDA {
        if (first) lamport_store<D, W, Op>(a, tid, n, vec, x);
        for (uint64_t p = tid + stride; p < packs && !c.block->abort; p += stride) {
            if (!lamport_wait_pack<W>(c, gen, p, x)) break;
            lamport_store<D, W, Op>(a, p, n, vec, x);
        }
    });
}

// ---------------------------------------------------------------------------------
// Collectives. Each begins with enter() and gives up only through abandon(); the kind
// of every barrier is named where it is used.

// Staging in chunks. A staged kernel whose message the payload cannot hold whole runs
// it through the payload in chunks (the planner's `staging`, src/comm/core/plan.rs, and
// `collective_staging`, src/comm/core/collective.rs; stage_input carries the capacity
// of a chunk). Chunk k goes into half k % 2 of the payload (`Chunks::half`); per block:
//   stage 0, Publish, {stage k+1 into the other half, use k, Publish} for every k but
//   the last, use the last chunk, End, finish.
// Distribution: position i of a staged chunk (a pack, or a row of the fused kernel) is
// written and read by the same thread of every rank (pack i by global thread
// i % stride, as every kernel gives pack g of a message to thread g % stride, counted
// from the chunk's first pack): so block b reads from each member's half exactly what
// block b of that member staged, which that member's Publish barrier published, and a
// block writes the same positions of a half for every chunk that uses it.
// Reuse: chunk k+2 overwrites half k % 2 after the Publish barrier that follows this
// block's use of chunk k. Each peer's block b arrives at that barrier only after its
// own use of chunk k, its last read of this rank's half k % 2 at block b's positions,
// the only positions this block writes (the release / acquire orders those reads
// before these writes); no other block of this rank writes them. The payload is
// written again by the next kernel only after this one ended, every block of it past
// the End barrier. In place, a thread stages position i of a chunk before it writes
// position i of the output, and no other thread reads it there.

// The two halves of the staged chunks: chunk k in half k % 2 of every member's payload.
struct Chunks {
    uint64_t count;       // chunks in the message
    uint64_t half_bytes;  // offset of the second half: what one chunk may fill
    PC_INLINE uint64_t half(const Args& a, uint32_t q, uint64_t k) const {
        return a.payloads[q] + (k & 1u) * half_bytes;
    }
};

// The pipeline above: stage(k) writes chunk k into this rank's half, use(k) reads chunk
// k from the members' halves; every barrier keeps the abort protocol.
template <typename Stage, typename Use>
PC_INLINE void run_chunks(Ctx& c, const Chunks& chunks, Stage&& stage, Use&& use) {
    stage(0);
    if (!barrier<BarrierKind::Publish>(c)) return abandon(c, WaitForPeers::Yes);
    for (uint64_t k = 0; k < chunks.count; ++k) {
        const bool last = k + 1 == chunks.count;
        if (!last) stage(k + 1);
        use(k);
        // Publishes chunk k + 1, and tells the peers this block is done with chunk k.
        const bool passed = last ? barrier<BarrierKind::End>(c) : barrier<BarrierKind::Publish>(c);
        if (!passed) return abandon(c, WaitForPeers::Yes);
    }
    finish(c);
}

// Chunk k of a message of n elements in chunks of `cap` packs, as a message of its own:
// its first element, its packs and its elements.
struct ChunkRange {
    uint64_t first, packs, elems;
};
template <typename D>
PC_INLINE ChunkRange chunk_range(uint64_t n, uint64_t cap, uint64_t k) {
    constexpr int L = Pack<D>::kLanes;
    const uint64_t first = k * cap * L;
    if (first >= n) return ChunkRange{first, 0, 0};
    const uint64_t elems = min_u64(cap * L, n - first);
    return ChunkRange{first, (elems + L - 1) / L, elems};
}

// Whether this rank stores the one-stage kernel's result: every rank of an all-reduce,
// the root alone of a reduce (whose other ranks only publish their inputs).
PC_INLINE bool stores_result(const Args& a) {
    return (a.call[2] & 0x1fu) != PEERCOMM_KIND_REDUCE || a.group_rank == a.root;
}

// The staged one-stage all-reduce of a message of more than C = a.stage_input packs (at
// most half the payload): chunk k is the message's packs [k*C, k*C + C), staged by
// copy_range and reduced by reduce_range from every member's half, in source order: the
// bits are the unchunked kernel's.
template <typename D>
PC_INLINE void one_stage_chunked(Ctx& c, uint64_t n, uint64_t packs, bool vec, uint64_t tid, uint64_t stride) {
    const Args& a = c.a;
    const uint64_t cap = a.stage_input;
    const uint32_t width = a.group_width;
    const Chunks chunks{(packs + cap - 1) / cap, cap * 16u};
    auto elem_at = [&](uint64_t base, uint64_t e) { return base + e * sizeof(typename D::Bits); };
    auto stage = [&](uint64_t k) PC_INLINE_LAMBDA {
        const ChunkRange r = chunk_range<D>(n, cap, k);
        copy_range<D>(elem_at(a.local_input, r.first), 0, chunks.half(a, a.group_rank, k), 0, 0, r.packs, r.elems,
                      vec, tid, stride);
    };
    auto use = [&](uint64_t k) PC_INLINE_LAMBDA {
        const ChunkRange r = chunk_range<D>(n, cap, k);
        uint64_t srcs[PEERCOMM_MAX_GPUS];
#pragma unroll
        for (uint32_t s = 0; s < PEERCOMM_MAX_GPUS; ++s) srcs[s] = s < width ? chunks.half(a, s, k) : 0u;
        if (!stores_result(a)) return;
        reduce_range_any<D>(call_op(a), width, srcs, 0, r.packs, r.elems, elem_at(a.output, r.first), 0, vec, tid,
                            stride);
    };
    run_chunks(c, chunks, stage, use);
}

// One-stage: every rank reads every peer's input and reduces the whole message (a
// reduce: the root alone).
template <typename D>
PC_INLINE void one_stage(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    bool vec = aligned16(a.output) && aligned16(a.local_input);
    for (uint32_t s = 0; s < a.group_width; ++s) vec = vec && aligned16(a.inputs[s]);
    if (a.stage_input) {
        if (packs > a.stage_input) return one_stage_chunked<D>(c, n, packs, vec, tid, stride);
        // The peers read a copy in the own payload (they cannot reach the buffer, or
        // this rank overwrites it in place). Block b copies exactly the packs block b
        // of every rank reads.
        copy_range<D>(a.local_input, 0, a.payloads[a.group_rank], 0, 0, packs, n, vec, tid, stride);
        if (!barrier<BarrierKind::Publish>(c)) return abandon(c, WaitForPeers::Yes);
    } else {
        if (!barrier<BarrierKind::Start>(c)) return abandon(c, WaitForPeers::Yes);
    }
    if (stores_result(a)) {
        reduce_range_any<D>(call_op(a), a.group_width, a.inputs, 0, packs, n, a.output, 0, vec, tid, stride);
    }
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Two-stage: reduce-scatter of partition group_rank into the own payload, barrier,
// all-gather of every partition from its owner's payload. The all-gather keeps the
// reduce-scatter's pack assignment, so block b reads exactly what block b of the owner
// wrote and the per-block barrier suffices.
template <typename D>
PC_INLINE void two_stage(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint64_t part = (packs + width - 1) / width;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    bool vec = aligned16(a.output);
    for (uint32_t s = 0; s < width; ++s) vec = vec && aligned16(a.inputs[s]) && aligned16(a.payloads[s]);
    if (!barrier<BarrierKind::Start>(c)) return abandon(c, WaitForPeers::Yes);
    {
        const uint64_t first = me * part, end = min_u64(first + part, packs);
        with_width(width, [&]<int W>() {
            reduce_range<D, W>(call_op(a), a.inputs, first, end, n, a.payloads[me], first, vec, tid, stride);
        });
    }
    if (!barrier<BarrierKind::Publish>(c)) return abandon(c, WaitForPeers::Yes);
    with_width(width, [&]<int W>() { gather_partitions<D, W>(a.payloads, me, part, packs, n, a.output, vec, tid, stride); });
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Lamport: no barrier. Push the own packs into slot group_rank of every other member's
// region, reduce the own region as the packs arrive, clear the previous generation.
// Peers write only into this rank's signal, never read its user buffers: a block that
// gives up does not wait for them.
template <typename D>
PC_INLINE void lamport(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = (n + L - 1) / L;
    const uint32_t width = a.group_width;
    const LamportGeneration gen{c.block->lamport[PEERCOMM_LAMPORT_FLAG]};
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool vec = aligned16(a.local_input) && aligned16(a.output);

    lamport_push_header(c, gen.data());
    for (uint64_t p = tid; p < packs; p += stride)
        lamport_push_pack(a, gen.data(), p, lamport_source_pack<D>(a, p, n, vec));
    // The headers are checked inside, before anything is stored.
    with_width(width, [&]<int W>() PC_INLINE_LAMBDA { lamport_reduce<D, W>(c, gen.data(), packs, n, vec, tid, stride); });
    lamport_end(c, packs);
}

// Barrier only (the `barrier` collective and the timeout probe): arrival, then a
// barrier that publishes what the block (and, cumulatively, the kernels before it on
// this stream) wrote.
PC_INLINE void barrier_only(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    if (!barrier<BarrierKind::Start>(c)) return abandon(c, WaitForPeers::No);
    if (!barrier<BarrierKind::Publish>(c)) return abandon(c, WaitForPeers::No);
    finish(c);
}

// Flag ping-pong between group ranks 0 and 1 (the cross-GPU flag round trip): the first
// word of each payload is the flag, zeroed by the host before the launch. One thread of
// one block per rank; gives up silently after timeout_ns.
PC_INLINE void ping_pong(const Args& a) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || a.group_rank > 1 || a.group_width < 2) return;
    GlobalU32* mine = (GlobalU32*)a.payloads[a.group_rank];
    GlobalU32* theirs = (GlobalU32*)a.payloads[1 - a.group_rank];
    const uint64_t start = timer_now(), limit = timer_ticks(a.timeout_ns);
    for (uint32_t i = 1; i <= (uint32_t)a.num_elements; ++i) {
        if (a.group_rank == 0) st_release_sys(theirs, i);
        while (ld_acquire_sys(mine) != i) {
            if (a.timeout_ns != 0 && timer_now() - start > limit) return;
        }
        if (a.group_rank == 1) st_release_sys(theirs, i);
    }
}

// Fault injection: one thread spins for timeout_ns (a rank made late); touches no memory.
PC_INLINE void delay(const Args& a) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t start = timer_now(), ticks = timer_ticks(a.timeout_ns);
    while (timer_now() - start < ticks) {
    }
}

// ---------------------------------------------------------------------------------
// Every exported kernel, (symbol, device function), as `Kernel::symbol()` names them.
// A vendor layer expands it with its own entry-point form.

#define PEERCOMM_KERNELS(X)                     \
    X(peercomm_one_stage_f32, one_stage<F32>)   \
    X(peercomm_one_stage_f16, one_stage<F16>)   \
    X(peercomm_one_stage_bf16, one_stage<BF16>) \
    X(peercomm_one_stage_f64, one_stage<F64>)   \
    X(peercomm_one_stage_i8, one_stage<I8>)     \
    X(peercomm_one_stage_u8, one_stage<U8>)     \
    X(peercomm_one_stage_i32, one_stage<I32>)   \
    X(peercomm_one_stage_u32, one_stage<U32>)   \
    X(peercomm_one_stage_i64, one_stage<I64>)   \
    X(peercomm_one_stage_u64, one_stage<U64>)   \
    X(peercomm_two_stage_f32, two_stage<F32>)   \
    X(peercomm_two_stage_f16, two_stage<F16>)   \
    X(peercomm_two_stage_bf16, two_stage<BF16>) \
    X(peercomm_lamport_f32, lamport<F32>)       \
    X(peercomm_lamport_f16, lamport<F16>)       \
    X(peercomm_lamport_bf16, lamport<BF16>)     \
    X(peercomm_barrier_f32, barrier_only)       \
    X(peercomm_barrier_f16, barrier_only)       \
    X(peercomm_barrier_bf16, barrier_only)      \
    X(peercomm_pingpong_f32, ping_pong)         \
    X(peercomm_delay_f32, delay)

#endif  // PEERCOMM_KERNELS_H
