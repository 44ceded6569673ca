// peercomm batched all-reduce, written once for both vendors: up to
// PEERCOMM_MAX_GROUP_CALLS all-reduces of one dtype and one group width in ONE kernel,
// with one start barrier and one end barrier (NCCL-style group calls). Included by the
// vendor layers after peercomm_kernels.h, whose context, barrier, abort protocol and
// range helpers it uses. The host backend's src/backend/host/kernels/group.rs is the
// same algorithm step by step.
//
// The batch is one concatenated pack range: entry s's pack p is pack
// entries[s].offset / 16 + p of the batch (the host lays the entries out one after
// another, each rounded up to whole 16-byte packs). Global thread t handles the packs g
// with g % stride == t, for the staging copy and for the reduce alike, exactly as the
// one-stage kernel hands out one message's packs; so block b reads only what block b of
// each peer staged, and the per-block Publish barrier suffices. Each pack is reduced by
// reduce_range, the one-stage kernel's loop (same source order, the same sum_start sign
// of zero, the same partial-pack and unaligned handling), so every entry's bits are
// those of a one-stage (staged) all-reduce of that entry alone.
//
// Phases: (1) every block copies its share of every entry's input into the own payload
// at the entry's offset; (2) the Publish barrier, carrying the batch's call descriptor
// in `all.call` (mismatches are typed errors through the usual path); (3) every block
// reduces its share of every entry from the members' payloads, in group-rank order,
// into the entry's output; (4) the End barrier (no peer overwrites a payload this block
// still reads), then finish(). A group of one waits for nobody: it copies each input to
// its output directly (as one-stage does), between its own trivial barriers.

#ifndef PEERCOMM_GROUP_H
#define PEERCOMM_GROUP_H

typedef peercomm_group_args GroupArgs;
typedef peercomm_group_entry GroupEntry;

static_assert(sizeof(peercomm_group_entry) == 32, "peercomm_group_entry layout changed");
static_assert(sizeof(peercomm_group_args) == 552, "peercomm_group_args layout changed");

// The first thread-relative pack of an entry whose first batch-wide pack is `base`:
// this thread handles the entry's local packs p with (base + p) % stride == tid, the
// first of which is (tid - base) mod stride. A 32-bit remainder where the base fits
// (stride is at most 1024 x 1024): a 64-bit one is a long software sequence.
PC_INLINE uint64_t entry_first_pack(uint64_t tid, uint64_t stride, uint64_t base) {
    const uint64_t r = (base >> 32) == 0u ? (uint64_t)((uint32_t)base % (uint32_t)stride) : base % stride;
    return tid >= r ? tid - r : tid + stride - r;
}

template <typename D>
PC_INLINE void all_reduce_group(const GroupArgs& g) {
    const Args& a = g.all;
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint32_t width = a.group_width, me = a.group_rank;
    const uint32_t count = g.count < PEERCOMM_MAX_GROUP_CALLS ? g.count : PEERCOMM_MAX_GROUP_CALLS;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    // A group wider than one always stages: the peers read only the payloads.
    const bool staged = width > 1u;
    if (staged) {
        const uint64_t own = a.payloads[me];
        for (uint32_t s = 0; s < count; ++s) {
            const GroupEntry& e = g.entries[s];
            const uint64_t n = e.elements, dst = own + e.offset;
            copy_range<D>(e.input, 0, dst, 0, 0, (n + L - 1) / L, n, aligned16(e.input) && aligned16(dst),
                          entry_first_pack(tid, stride, e.offset / 16u), stride);
        }
        if (!barrier<BarrierKind::Publish>(c)) return abandon(c, WaitForPeers::Yes);
    } else {
        if (!barrier<BarrierKind::Start>(c)) return abandon(c, WaitForPeers::Yes);
    }
    with_width(width, [&]<int W>() {
        for (uint32_t s = 0; s < count; ++s) {
            const GroupEntry& e = g.entries[s];
            const uint64_t n = e.elements;
            uint64_t srcs[W];
            bool vec = aligned16(e.output);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                srcs[k] = staged ? a.payloads[k] + e.offset : e.input;
                vec = vec && aligned16(srcs[k]);
            }
            reduce_range<D, W>(srcs, 0, (n + L - 1) / L, n, e.output, 0, vec,
                               entry_first_pack(tid, stride, e.offset / 16u), stride);
        }
    });
    if (!barrier<BarrierKind::End>(c)) return abandon(c, WaitForPeers::Yes);
    finish(c);
}

// Every batched all-reduce entry point, (symbol, device function), as `Kernel::symbol()`
// names them. A vendor layer expands it with its own entry-point form (the argument is
// a peercomm_group_args).
#define PEERCOMM_GROUP_KERNELS(X)                            \
    X(peercomm_allreduce_group_f32, all_reduce_group<F32>)   \
    X(peercomm_allreduce_group_f16, all_reduce_group<F16>)   \
    X(peercomm_allreduce_group_bf16, all_reduce_group<BF16>)

#endif  // PEERCOMM_GROUP_H
