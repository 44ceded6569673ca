// peercomm collectives beside the all-reduce, written once for both vendors: all-gather,
// reduce-scatter (the call's operator), broadcast, scatter, and the fused all-reduce + residual add +
// RMSNorm. Included by the vendor layers after peercomm_kernels.h, whose barrier, abort
// protocol, range helpers and element types they use. The host backend's
// src/backend/host/kernels/collectives.rs is the same algorithms step by step.
//
// Every collective reads peer data from `a.inputs[q]`: the peers' user buffers where
// they can be reached (one process, `stage_input == 0`), else the peers' payloads, into
// which each rank first stages what the peers read (`stage_input != 0`). Staging and
// reading give pack k of a staged range to the same thread (k % stride of the grid), so
// block b reads only what block b of the owner wrote and the per-block Publish barrier
// suffices. Every collective pairs its start barrier (Start, or Publish after staging)
// with an End barrier, which keeps a peer from overwriting a payload or input this
// block still reads. A staged message the payload cannot hold whole runs through it
// in chunks (run_chunks in peercomm_kernels.h, with its barrier reasoning): a chunk of
// the message (all-gather, broadcast), of every part (reduce-scatter, scatter), or a
// run of rows (the fused kernel); stage_input is then the capacity of one chunk in
// packs (per part) or rows, and larger than it the message is chunked.

#ifndef PEERCOMM_COLLECTIVES_H
#define PEERCOMM_COLLECTIVES_H

template <typename D>
PC_INLINE uint64_t elem_addr(uint64_t base, uint64_t e) {
    return base + e * sizeof(typename D::Bits);
}

PC_INLINE uint64_t div_ceil_u64(uint64_t x, uint64_t y) { return (x + y - 1) / y; }

// The reduce-scatter split of n elements over `width` ranks: part q starts at
// q * (n / width) + min(q, n % width) and has n / width elements, one more for the first
// n % width parts. The same rule as `peercomm::reduce_scatter_part`.
struct Part {
    uint64_t first;
    uint64_t count;
};
PC_INLINE Part split_part(uint64_t n, uint32_t width, uint32_t q) {
    const uint64_t base = n / width, rem = n % width;
    return Part{q * base + min_u64(q, rem), base + (q < rem ? 1u : 0u)};
}

// Where part q of a split starts in a staged payload, in packs: each part begins at a
// pack boundary, so it is staged and read as a message of its own.
template <typename D>
PC_INLINE uint64_t staged_part_pack(uint64_t n, uint32_t width, uint32_t q) {
    constexpr int L = Pack<D>::kLanes;
    uint64_t packs = 0;
    for (uint32_t s = 0; s < q; ++s) packs += div_ceil_u64(split_part(n, width, s).count, L);
    return packs;
}

// Copies an n-element message from src to dst, pack k by global thread k % stride.
template <typename D>
PC_INLINE void copy_message(uint64_t src, uint64_t dst, uint64_t n, uint64_t tid, uint64_t stride) {
    constexpr int L = Pack<D>::kLanes;
    const bool vec = aligned16(src) && aligned16(dst);
    copy_range<D>(src, 0, dst, 0, 0, div_ceil_u64(n, L), n, vec, tid, stride);
}

// The first barrier of a collective: Publish after this rank staged (the peers read the
// payload it wrote), else Start.
PC_INLINE bool first_barrier(Ctx& c, bool staged) {
    return staged ? barrier<BarrierKind::Publish>(c) : barrier<BarrierKind::Start>(c);
}

// All-gather: each member's n elements land at [q * n, (q + 1) * n) of every member's
// output. Staged: the own input goes into the own payload first. Members read the
// sources starting with their own group rank, so the peers' links share the load.
template <typename D>
PC_INLINE void all_gather(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    const uint64_t n = a.num_elements;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool staged = a.stage_input != 0u;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t cap = a.stage_input, packs = div_ceil_u64(n, L);
    if (staged && packs > cap) {
        // Chunk k of every member's message, from its half into the member's place.
        const Chunks chunks{div_ceil_u64(packs, cap), cap * 16u};
        auto stage = [&](uint64_t k) PC_INLINE_LAMBDA {
            const ChunkRange r = chunk_range<D>(n, cap, k);
            copy_message<D>(elem_addr<D>(a.local_input, r.first), chunks.half(a, me, k), r.elems, tid, stride);
        };
        auto use = [&](uint64_t k) PC_INLINE_LAMBDA {
            const ChunkRange r = chunk_range<D>(n, cap, k);
            for (uint32_t i = 0; i < width; ++i) {
                const uint32_t q = (me + i) % width;
                copy_message<D>(chunks.half(a, q, k), elem_addr<D>(a.output, q * n + r.first), r.elems, tid, stride);
            }
        };
        return run_chunks(c, chunks, stage, use);
    }
    if (staged) copy_message<D>(a.local_input, a.payloads[me], n, tid, stride);
    if (!first_barrier(c, staged)) return abandon(c, WaitForPeers::Yes);
    for (uint32_t i = 0; i < width; ++i) {
        const uint32_t q = (me + i) % width;
        copy_message<D>(a.inputs[q], elem_addr<D>(a.output, q * n), n, tid, stride);
    }
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Reduce-scatter: group rank r reduces part r (split_part) of every member's n-element
// input by the call's operator, in group-rank order and D's accumulator like the
// all-reduce, so its
// bits equal the all-reduce's for those elements. Staged: the own input goes into the own payload
// part by part, each part at a pack boundary (staged_part_pack).
template <typename D>
PC_INLINE void reduce_scatter(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool staged = a.stage_input != 0u;
    const uint64_t cap = a.stage_input, most = div_ceil_u64(split_part(n, width, 0).count, L);
    if (staged && most > cap) {
        // Chunk k of every part q (its packs [k*cap, k*cap + cap)) at pack q * cap of
        // the half; rank me reduces chunk k of part me from every member's half.
        const Chunks chunks{div_ceil_u64(most, cap), width * cap * 16u};
        auto stage = [&](uint64_t k) PC_INLINE_LAMBDA {
            for (uint32_t q = 0; q < width; ++q) {
                const Part part = split_part(n, width, q);
                const ChunkRange r = chunk_range<D>(part.count, cap, k);
                copy_message<D>(elem_addr<D>(a.local_input, part.first + r.first), chunks.half(a, me, k) + q * cap * 16u,
                                r.elems, tid, stride);
            }
        };
        auto use = [&](uint64_t k) PC_INLINE_LAMBDA {
            const ChunkRange r = chunk_range<D>(split_part(n, width, me).count, cap, k);
            uint64_t srcs[PEERCOMM_MAX_GPUS];
            const uint64_t dst = elem_addr<D>(a.output, r.first);
            bool vec = aligned16(dst);
#pragma unroll
            for (uint32_t s = 0; s < PEERCOMM_MAX_GPUS; ++s) {
                srcs[s] = s < width ? chunks.half(a, s, k) + me * cap * 16u : 0u;
                vec = vec && (s >= width || aligned16(srcs[s]));
            }
            reduce_range_any<D>(call_op(a), width, srcs, 0, r.packs, r.elems, dst, 0, vec, tid, stride);
        };
        return run_chunks(c, chunks, stage, use);
    }
    if (staged) {
        for (uint32_t q = 0; q < width; ++q) {
            const Part part = split_part(n, width, q);
            copy_message<D>(elem_addr<D>(a.local_input, part.first),
                            a.payloads[me] + staged_part_pack<D>(n, width, q) * 16u, part.count, tid, stride);
        }
    }
    if (!first_barrier(c, staged)) return abandon(c, WaitForPeers::Yes);
    const Part mine = split_part(n, width, me);
    const uint64_t staged_at = staged_part_pack<D>(n, width, me) * 16u;
    uint64_t srcs[PEERCOMM_MAX_GPUS];
    bool vec = aligned16(a.output);
#pragma unroll
    for (uint32_t s = 0; s < PEERCOMM_MAX_GPUS; ++s) {
        srcs[s] = s < width ? (staged ? a.inputs[s] + staged_at : elem_addr<D>(a.inputs[s], mine.first)) : 0u;
        vec = vec && (s >= width || aligned16(srcs[s]));
    }
    const uint64_t packs = div_ceil_u64(mine.count, L);
    reduce_range_any<D>(call_op(a), width, srcs, 0, packs, mine.count, a.output, 0, vec, tid, stride);
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Broadcast: the root's n elements to every member's output. Staged: the root puts its
// input into its payload. The root copies its own input (nothing when in place).
template <typename D>
PC_INLINE void broadcast(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    const uint64_t n = a.num_elements;
    const uint32_t me = a.group_rank, root = a.root;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool staged = a.stage_input != 0u;
    constexpr int L = Pack<D>::kLanes;
    const uint64_t cap = a.stage_input, packs = div_ceil_u64(n, L);
    if (staged && packs > cap) {
        // The root stages chunk k; every member takes it (the root from its input).
        const Chunks chunks{div_ceil_u64(packs, cap), cap * 16u};
        auto stage = [&](uint64_t k) PC_INLINE_LAMBDA {
            const ChunkRange r = chunk_range<D>(n, cap, k);
            if (me == root)
                copy_message<D>(elem_addr<D>(a.local_input, r.first), chunks.half(a, me, k), r.elems, tid, stride);
        };
        auto use = [&](uint64_t k) PC_INLINE_LAMBDA {
            const ChunkRange r = chunk_range<D>(n, cap, k);
            if (me != root) {
                copy_message<D>(chunks.half(a, root, k), elem_addr<D>(a.output, r.first), r.elems, tid, stride);
            } else if (a.output != a.local_input) {
                copy_message<D>(elem_addr<D>(a.local_input, r.first), elem_addr<D>(a.output, r.first), r.elems, tid,
                                stride);
            }
        };
        return run_chunks(c, chunks, stage, use);
    }
    if (staged && me == root) copy_message<D>(a.local_input, a.payloads[me], n, tid, stride);
    if (!first_barrier(c, staged)) return abandon(c, WaitForPeers::Yes);
    if (me != root) {
        copy_message<D>(a.inputs[root], a.output, n, tid, stride);
    } else if (a.output != a.local_input) {
        copy_message<D>(a.local_input, a.output, n, tid, stride);
    }
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Scatter: member q gets elements [q * n, (q + 1) * n) of the root's width * n. Staged:
// the root puts part q into its payload at pack q * ceil(n / L).
template <typename D>
PC_INLINE void scatter(const Args& a) {
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, part_bytes = div_ceil_u64(n, L) * 16u;
    const uint32_t width = a.group_width, me = a.group_rank, root = a.root;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const bool staged = a.stage_input != 0u;
    const uint64_t cap = a.stage_input, packs = div_ceil_u64(n, L);
    if (staged && packs > cap) {
        // The root stages chunk k of every part q at pack q * cap of its half; member
        // me takes chunk k of part me (the root from its input).
        const Chunks chunks{div_ceil_u64(packs, cap), width * cap * 16u};
        auto stage = [&](uint64_t k) PC_INLINE_LAMBDA {
            if (me != root) return;
            const ChunkRange r = chunk_range<D>(n, cap, k);
            for (uint32_t q = 0; q < width; ++q)
                copy_message<D>(elem_addr<D>(a.local_input, q * n + r.first), chunks.half(a, me, k) + q * cap * 16u,
                                r.elems, tid, stride);
        };
        auto use = [&](uint64_t k) PC_INLINE_LAMBDA {
            const ChunkRange r = chunk_range<D>(n, cap, k);
            const uint64_t src = me == root ? elem_addr<D>(a.local_input, me * n + r.first)
                                            : chunks.half(a, root, k) + me * cap * 16u;
            copy_message<D>(src, elem_addr<D>(a.output, r.first), r.elems, tid, stride);
        };
        return run_chunks(c, chunks, stage, use);
    }
    if (staged && me == root) {
        for (uint32_t q = 0; q < width; ++q)
            copy_message<D>(elem_addr<D>(a.local_input, q * n), a.payloads[me] + q * part_bytes, n, tid, stride);
    }
    if (!first_barrier(c, staged)) return abandon(c, WaitForPeers::Yes);
    const uint64_t src = me == root ? elem_addr<D>(a.local_input, me * n)
                         : staged   ? a.inputs[root] + me * part_bytes
                                    : elem_addr<D>(a.inputs[root], me * n);
    copy_message<D>(src, a.output, n, tid, stride);
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// ---------------------------------------------------------------------------------
// Fused all-reduce + residual add + RMSNorm over rows of `hidden` elements (a multiple
// of the pack width), num_elements / hidden rows, in two kernels: one-stage
// (allreduce_rmsnorm: barriers, the peers' inputs or payloads read in place) and Lamport
// (lamport_rmsnorm: no barrier, the inputs pushed into the peers' Lamport regions). Row t
// belongs to block t % gridDim.x; pack k of a row to thread k % blockDim.x, for staging,
// pushing and reading alike. Both compute their rows with the one function
// rmsnorm_rows; per element, the unfused sequence with its roundings to D:
//   s = D(sum over members in group-rank order, f32)        the all-reduce (sum_packs)
//   r = D(f32(s) + f32(residual))                           written back to residual
// then per row ms = (sum of f32(r)^2) / hidden, where thread k's partial sum runs over
// its packs k, k + blockDim, ... of the row, lane by lane, with an explicit fused
// multiply-add (no contraction left to the compiler), and the block's partial sums go
// through a fixed-shape tree in shared memory (block_sum); inv = 1 / sqrt(ms + epsilon),
// and output = D(f32(r) * inv * f32(weight)). Every rank computes every row, so every
// rank writes the same bits; and what a row gets depends only on its own data, the
// hidden size, epsilon and the block size (threads_per_block, fixed per communicator),
// never on the row count, the grid or the kernel: the two kernels give the same bits,
// whatever the batch a row is in.

// Sum of every thread's `x` in the block, by a tree over a power-of-two padded array:
// the same order for every block and rank of one launch shape. With `abort` (a block's
// abort flag), `stop` says whether it was set when every thread had arrived: read before
// the last barrier, so every thread reads the same value, and no thread can set it
// before all have read it (a wait comes only after that barrier).
PC_INLINE float block_sum(float x, volatile PC_SHARED float* red, const volatile PC_SHARED uint32_t* abort,
                          bool& stop) {
    const uint32_t t = threadIdx.x, n = blockDim.x;
    uint32_t p = 1;
    while (p < n) p <<= 1;
    red[t] = x;
    for (uint32_t i = n + t; i < p; i += n) red[i] = 0.0f;
    __syncthreads();
    for (uint32_t s = p >> 1; s > 0; s >>= 1) {
        if (t < s) red[t] = red[t] + red[t + s];
        __syncthreads();
    }
    const float total = red[0];
    stop = abort != nullptr && *abort != 0u;
    __syncthreads();
    return total;
}

template <typename D>
PC_INLINE Pack<D> load_pack(uint64_t base, uint64_t p, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    Pack<D> x{make_vec16(0u, 0u, 0u, 0u)};
    if (vec) {
        x.v = load_vec16(base, p);
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j) x.set_lane(j, load_elem<D>(base, p * L + j));
    }
    return x;
}

template <typename D>
PC_INLINE void store_pack(uint64_t base, uint64_t p, Pack<D> x, bool vec) {
    constexpr int L = Pack<D>::kLanes;
    if (vec) {
        store_vec16(base, p, x.v);
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j) store_elem<D>(base, p * L + j, x.lane(j));
    }
}

// The rows of this block in the fused kernels (row t = blockIdx.x, + gridDim.x, ...),
// by every thread of the block together: `sources(p, x)` fills x[0..W) with pack p of
// every member's input in group-rank order, or returns false when the block aborted
// (set in `abort`); then this thread loads no more, and every thread of the block
// returns false after the row's block_sum, having written part of that row's residual
// and none of its output. Else true, every row written.
template <typename D, int W, typename Sources>
PC_INLINE bool rmsnorm_rows(const Args& a, bool vec, volatile PC_SHARED float* red,
                            const volatile PC_SHARED uint32_t* abort, Sources&& sources) {
    constexpr int L = Pack<D>::kLanes;
    const uint64_t hidden = a.hidden, row_packs = hidden / L, rows = a.num_elements / hidden;
    for (uint64_t t = blockIdx.x; t < rows; t += gridDim.x) {
        const uint64_t row = t * row_packs;
        float sq = 0.0f;
        for (uint64_t k = threadIdx.x; k < row_packs; k += blockDim.x) {
            const uint64_t p = row + k;
            Vec16 x[W];
            if (!sources(p, x)) break;
            Pack<D> sum{sum_packs<D, W>(x)};
            Pack<D> res = load_pack<D>(a.residual, p, vec);
#pragma unroll
            for (int j = 0; j < L; ++j) {
                const typename D::Bits r = D::from_float(D::to_float(sum.lane(j)) + D::to_float(res.lane(j)));
                res.set_lane(j, r);
                const float f = D::to_float(r);
                sq = fmaf(f, f, sq);
            }
            store_pack<D>(a.residual, p, res, vec);
        }
        bool stop = false;
        const float total = block_sum(sq, red, abort, stop);
        if (stop) return false;
        const float inv = 1.0f / sqrtf(total / (float)hidden + a.epsilon);
        for (uint64_t k = threadIdx.x; k < row_packs; k += blockDim.x) {
            const uint64_t p = row + k;
            // This thread wrote pack p of the residual above: it reads its own store.
            const Pack<D> res = load_pack<D>(a.residual, p, vec);
            const Pack<D> w = load_pack<D>(a.weight, k, vec);
            Pack<D> out{make_vec16(0u, 0u, 0u, 0u)};
#pragma unroll
            for (int j = 0; j < L; ++j)
                out.set_lane(j, D::from_float(D::to_float(res.lane(j)) * inv * D::to_float(w.lane(j))));
            store_pack<D>(a.output, p, out, vec);
        }
    }
    return true;
}

// The staged fused kernel of more rows than R = a.stage_input (the rows half the
// payload holds): chunk k is rows [k*R, k*R + R), row k*R + i at row i of the half,
// staged and computed by block i % gridDim.x (pack j of a row by thread j % blockDim.x),
// by rmsnorm_rows on the chunk seen as a batch of its own. A row's bits depend only on
// its own data, the hidden size, epsilon and the block size: they are the unchunked
// kernel's.
template <typename D>
PC_INLINE void allreduce_rmsnorm_chunked(Ctx& c, volatile PC_SHARED float* tree, bool vec) {
    const Args& a = c.a;
    constexpr int L = Pack<D>::kLanes;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint64_t hidden = a.hidden, row_packs = hidden / L, rows = a.num_elements / hidden, cap = a.stage_input;
    const Chunks chunks{div_ceil_u64(rows, cap), cap * row_packs * 16u};
    auto chunk_rows = [&](uint64_t k) { return min_u64(cap, rows - k * cap); };
    auto stage = [&](uint64_t k) PC_INLINE_LAMBDA {
        const uint64_t first = k * cap * row_packs, dst = chunks.half(a, me, k);
        for (uint64_t t = blockIdx.x; t < chunk_rows(k); t += gridDim.x)
            for (uint64_t j = threadIdx.x; j < row_packs; j += blockDim.x) {
                const uint64_t p = t * row_packs + j;
                store_pack<D>(dst, p, load_pack<D>(a.local_input, first + p, vec), vec);
            }
    };
    auto use = [&](uint64_t k) PC_INLINE_LAMBDA {
        Args view = a;
        const uint64_t first = k * cap * hidden;
        view.num_elements = chunk_rows(k) * hidden;
        view.residual = elem_addr<D>(a.residual, first);
        view.output = elem_addr<D>(a.output, first);
        with_width(width, [&]<int W>() {
            rmsnorm_rows<D, W>(view, vec, tree, nullptr, [&](uint64_t p, Vec16 (&x)[W]) {
#pragma unroll
                for (int s = 0; s < W; ++s) x[s] = load_pack<D>(chunks.half(a, (uint32_t)s, k), p, vec).v;
                return true;
            });
        });
    };
    run_chunks(c, chunks, stage, use);
}

template <typename D>
PC_INLINE void allreduce_rmsnorm(const Args& a) {
    __shared__ float red[1024];
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint64_t row_packs = a.hidden / L, rows = a.num_elements / a.hidden;
    const bool staged = a.stage_input != 0u;
    bool vec = aligned16(a.output) && aligned16(a.residual) && aligned16(a.weight) && aligned16(a.local_input);
    for (uint32_t s = 0; s < width; ++s) vec = vec && aligned16(a.inputs[s]);
    if (staged && rows > a.stage_input) return allreduce_rmsnorm_chunked<D>(c, (volatile PC_SHARED float*)red, vec);
    if (staged) {
        for (uint64_t t = blockIdx.x; t < rows; t += gridDim.x)
            for (uint64_t k = threadIdx.x; k < row_packs; k += blockDim.x) {
                const uint64_t p = t * row_packs + k;
                store_pack<D>(a.payloads[me], p, load_pack<D>(a.local_input, p, vec), vec);
            }
    }
    if (!first_barrier(c, staged)) return abandon(c, WaitForPeers::Yes);
    volatile PC_SHARED float* tree = (volatile PC_SHARED float*)red;
    // Every member's pack read in place (their inputs, or the payloads staged into).
    with_width(width, [&]<int W>() {
        rmsnorm_rows<D, W>(a, vec, tree, nullptr, [&](uint64_t p, Vec16 (&x)[W]) {
#pragma unroll
            for (int s = 0; s < W; ++s) x[s] = load_pack<D>(a.inputs[s], p, vec).v;
            return true;
        });
    });
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Lamport fused all-reduce + residual add + RMSNorm: no barrier. The whole world of two
// or more ranks, the message plus the header pack within one Lamport slot (the planner
// checks both). It pushes, as the Lamport all-reduce does (kernels-common/
// peercomm_kernels.h: header first, the sentinel protocol, the generations, the own-slot
// rule, lamport_end), but by rows: block b pushes the packs of its own rows t = b,
// b + gridDim, ..., pack k of a row by thread k % blockDim. Then it checks every
// source's header (a mismatch stops every block before anything is written), and
// computes its rows with rmsnorm_rows, each pack of each member as it arrives in
// the own region (the own pack straight from the input, sent the same way). Inputs go
// out with -0.0 lanes as +0.0 (the sentinel cannot travel), which leaves every sum
// unchanged: sum_packs starts from +0.0 + x[0] and adds the rest, and neither that start
// nor any later partial sum can be -0.0 (a round-to-nearest sum is -0.0 only when both
// addends are), so adding -0.0 or +0.0 gives the same partial sum. So each row's bits
// are the one-stage fused kernel's. Peers write only into this rank's signal, never
// read its user buffers: a block that gives up does not wait for them.
template <typename D>
PC_INLINE void lamport_rmsnorm(const Args& a) {
    __shared__ float red[1024];
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint64_t n = a.num_elements, packs = n / L;  // hidden is whole packs
    const uint64_t row_packs = a.hidden / L, rows = n / a.hidden;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint32_t gen = c.block->lamport[PEERCOMM_LAMPORT_FLAG];
    const bool vec = aligned16(a.local_input) && aligned16(a.output) && aligned16(a.residual) && aligned16(a.weight);
    lamport_push_header(c, gen);
    for (uint64_t t = blockIdx.x; t < rows; t += gridDim.x)
        for (uint64_t k = threadIdx.x; k < row_packs; k += blockDim.x) {
            const uint64_t p = t * row_packs + k;
            lamport_push_pack(a, gen, p, lamport_source_pack<D>(a, p, n, vec));
        }
    lamport_check_header(c, gen);
    __syncthreads();
    if (!c.block->abort) {
        volatile PC_SHARED float* tree = (volatile PC_SHARED float*)red;
        const volatile PC_SHARED uint32_t* abort = &c.block->abort;
        with_width(width, [&]<int W>() {
            rmsnorm_rows<D, W>(a, vec, tree, abort, [&](uint64_t p, Vec16 (&x)[W]) {
                if (!lamport_wait_pack<W>(c, gen, p, x)) return false;
#pragma unroll
                for (int s = 0; s < W; ++s)
                    if (s == (int)me) x[s] = lamport_source_pack<D>(a, p, n, vec);
                return true;
            });
        });
    }
    // Clears the previous generation; abandons (the state not advanced) if the block
    // aborted.
    lamport_end(c, packs);
}

// The data-movement kernels copy raw bits: a type of the same size runs the same kernel
// (i32 and u32 the f32 one, i8 the u8 one, f64 and i64 the u64 one: `Kernel::symbol`).
#define PEERCOMM_COLLECTIVE_KERNELS(X)                            \
    X(peercomm_all_gather_f32, all_gather<F32>)                   \
    X(peercomm_all_gather_f16, all_gather<F16>)                   \
    X(peercomm_all_gather_bf16, all_gather<BF16>)                 \
    X(peercomm_all_gather_u8, all_gather<U8>)                     \
    X(peercomm_all_gather_u64, all_gather<U64>)                   \
    X(peercomm_reduce_scatter_f32, reduce_scatter<F32>)           \
    X(peercomm_reduce_scatter_f16, reduce_scatter<F16>)           \
    X(peercomm_reduce_scatter_bf16, reduce_scatter<BF16>)         \
    X(peercomm_reduce_scatter_f64, reduce_scatter<F64>)           \
    X(peercomm_reduce_scatter_i8, reduce_scatter<I8>)             \
    X(peercomm_reduce_scatter_u8, reduce_scatter<U8>)             \
    X(peercomm_reduce_scatter_i32, reduce_scatter<I32>)           \
    X(peercomm_reduce_scatter_u32, reduce_scatter<U32>)           \
    X(peercomm_reduce_scatter_i64, reduce_scatter<I64>)           \
    X(peercomm_reduce_scatter_u64, reduce_scatter<U64>)           \
    X(peercomm_broadcast_f32, broadcast<F32>)                     \
    X(peercomm_broadcast_f16, broadcast<F16>)                     \
    X(peercomm_broadcast_bf16, broadcast<BF16>)                   \
    X(peercomm_broadcast_u8, broadcast<U8>)                       \
    X(peercomm_broadcast_u64, broadcast<U64>)                     \
    X(peercomm_scatter_f32, scatter<F32>)                         \
    X(peercomm_scatter_f16, scatter<F16>)                         \
    X(peercomm_scatter_bf16, scatter<BF16>)                       \
    X(peercomm_scatter_u8, scatter<U8>)                           \
    X(peercomm_scatter_u64, scatter<U64>)                         \
    X(peercomm_allreduce_rmsnorm_f32, allreduce_rmsnorm<F32>)     \
    X(peercomm_allreduce_rmsnorm_f16, allreduce_rmsnorm<F16>)     \
    X(peercomm_allreduce_rmsnorm_bf16, allreduce_rmsnorm<BF16>)   \
    X(peercomm_lamport_rmsnorm_f32, lamport_rmsnorm<F32>)         \
    X(peercomm_lamport_rmsnorm_f16, lamport_rmsnorm<F16>)         \
    X(peercomm_lamport_rmsnorm_bf16, lamport_rmsnorm<BF16>)

#endif  // PEERCOMM_COLLECTIVES_H
