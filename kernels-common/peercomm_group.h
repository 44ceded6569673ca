// peercomm batched all-reduce, written once for both vendors: up to
// PEERCOMM_MAX_GROUP_CALLS all-reduces of one dtype and one group width in ONE kernel,
// with one start barrier and one end barrier (NCCL-style group calls). Included by the
// vendor layers after peercomm_kernels.h, whose context, barrier, abort protocol and
// range helpers it uses. The host backend's src/backend/host/kernels/group.rs is the
// same algorithm step by step.
//
// The batch is one concatenated pack range: entry s's pack p is pack
// entries[s].offset / 16 + p of the batch (the host lays the entries out one after
// another after the entry table, each rounded up to whole 16-byte packs). Global thread
// t handles the packs g with g % stride == t, for the staging copy and for the reduce
// alike, exactly as the one-stage kernel hands out one message's packs; so block b
// reads only what block b of each peer staged, and the per-block Publish barrier
// suffices. Each thread loops over its own packs and finds the entry of each (a loop
// over the entries instead costs every thread every entry: measured 1.53x one call
// for 8 x 4 KiB, against 1.14x so). Each pack is reduced by
// reduce_range, the one-stage kernel's loop (the batch's operator, from the call
// descriptor in `all.call`; same source order, the same partial-pack and unaligned
// handling), so every entry's bits are those of a one-stage (staged) all-reduce of that
// entry alone.
//
// Staged (all.stage_input set: ranks that reach only each other's signals), in
// phases: (1) every block writes the batch's entry table (PEERCOMM_GROUP_HEADER_BYTES)
// at the start of the own payload, the same bytes in every block, and copies its share
// of every entry's input into the own payload at the entry's offset; (2) the Publish
// barrier, carrying the batch's call descriptor in `all.call` (mismatches are typed
// errors through the usual path); (3) every block compares every peer's entry table
// with this rank's (what the descriptor cannot hold: every entry's exact length); on a
// difference it records a call mismatch and abandons before it stores anything, and
// every block of every rank finds a difference on its side, so none stores anything;
// (4) every block reduces its share of every entry from the members' payloads, in
// group-rank order, into the entry's output; (5) the End barrier (no peer overwrites a
// payload this block still reads), then finish(). In place (all.stage_input clear: one
// process, which checked every rank's entries on the host): the Start barrier, the
// reduce from every member's input (peer_inputs), the End barrier (no peer overwrites
// an input this block still reads), as the one-stage kernel does unstaged; no staging,
// no system-scope release and no table to compare. A group of one waits for nobody: it
// copies each input to its output directly (as one-stage does), between its own
// trivial barriers, and has no peer to compare its table with.
//
// The table is read by other blocks than the one that wrote it (every block writes it,
// every block reads it), yet each block's Publish barrier suffices: the same-index block
// of the writer wrote the same bytes before its release. And no table is overwritten
// while a peer still reads it: a rank's next kernel starts after this one has passed
// every End barrier (or abandoned and waited for its peers), that is after every peer
// block has read it.

#ifndef PEERCOMM_GROUP_H
#define PEERCOMM_GROUP_H

typedef peercomm_group_args GroupArgs;
typedef peercomm_group_entry GroupEntry;

static_assert(sizeof(peercomm_group_entry) == 32, "peercomm_group_entry layout changed");
static_assert(sizeof(peercomm_group_args) == 1104, "peercomm_group_args layout changed");
static_assert(PEERCOMM_GROUP_HEADER_BYTES == 16 + 8 * PEERCOMM_MAX_GROUP_CALLS, "the entry table layout changed");

// Packs of the entry table.
constexpr uint32_t kGroupHeaderPacks = PEERCOMM_GROUP_HEADER_BYTES / 16;

// Element count of entry s of this rank's table (0 past the count).
PC_INLINE uint64_t table_elements(const GroupArgs& g, uint32_t count, uint32_t s) {
    return s < count ? g.entries[s].elements : 0u;
}

// Pack i of this rank's entry table (see PEERCOMM_GROUP_HEADER_BYTES).
PC_INLINE Vec16 group_header_pack(const GroupArgs& g, uint32_t count, uint32_t i) {
    if (i == 0u) return make_vec16(count, 0u, 0u, 0u);
    const uint64_t n0 = table_elements(g, count, 2u * (i - 1u));
    const uint64_t n1 = table_elements(g, count, 2u * (i - 1u) + 1u);
    return make_vec16((uint32_t)n0, (uint32_t)(n0 >> 32), (uint32_t)n1, (uint32_t)(n1 >> 32));
}

// The descriptor an error record shows for one side of a batch whose entry tables
// differ: this batch's, with the root field (a batch's count less one, bits 12-14 of
// word 2) set to `count - 1` and the element count (words 3-4) to `n`. The host's
// signal::group_shown_call.
PC_INLINE CallWords group_shown_call(const Args& a, uint32_t count, uint64_t n) {
    CallWords c = own_call(a);
    c.w[2] = (c.w[2] & ~(7u << 12)) | (((count - 1u) & 7u) << 12);
    c.w[3] = (uint32_t)n & 0x7fffffffu;
    c.w[4] = (uint32_t)(n >> 31) & 0x7fffffffu;
    return c;
}

// After the Publish barrier: thread t < width, t != group_rank, compares group rank t's
// entry table (the count, then every entry's element count) with this rank's. On a
// difference it records a call mismatch naming that rank, showing both descriptors
// with the count and the first differing entry's element count of each side
// (group_shown_call), so the host names the element count (or, were only the counts to
// differ, the root). False, for the whole block, when the block must leave: a
// difference, or an abort seen meanwhile.
PC_INLINE bool same_entry_tables(Ctx& c, const GroupArgs& g, uint32_t count) {
    const Args& a = c.a;
    const uint32_t t = threadIdx.x;
    if (t < a.group_width && t != a.group_rank) {
        Vec16 theirs[kGroupHeaderPacks];
#pragma unroll
        for (uint32_t i = 0; i < kGroupHeaderPacks; ++i) theirs[i] = load_vec16(a.payloads[t], i);
        const uint32_t their_count = theirs[0].x;
        bool differs = their_count != count;
        uint64_t mine_n = table_elements(g, count, 0u), their_n = mine_n;
        bool found = false;
#pragma unroll
        for (uint32_t s = 0; s < PEERCOMM_MAX_GROUP_CALLS; ++s) {
            const Vec16 p = theirs[1u + s / 2u];
            const uint64_t n = s % 2u == 0u ? ((uint64_t)p.y << 32 | p.x) : ((uint64_t)p.w << 32 | p.z);
            const uint64_t own = table_elements(g, count, s);
            if (!found && n != own) {
                found = true;
                mine_n = own;
                their_n = n;
            }
        }
        differs = differs || found;
        if (differs)
            record_mismatch(c, t, group_shown_call(a, count, mine_n), group_shown_call(a, their_count, their_n));
    }
    __syncthreads();
    return c.block->abort == 0u;
}

// The first thread-relative pack of an entry whose first batch-wide pack is `base`:
// this thread handles the entry's local packs p with (base + p) % stride == tid, the
// first of which is (tid - base) mod stride. A 32-bit remainder where the base fits
// (stride is at most 1024 x 1024): a 64-bit one is a long software sequence.
PC_INLINE uint64_t entry_first_pack(uint64_t tid, uint64_t stride, uint64_t base) {
    const uint64_t r = (base >> 32) == 0u ? (uint64_t)((uint32_t)base % (uint32_t)stride) : base % stride;
    return tid >= r ? tid - r : tid + stride - r;
}

// The entry whose packs hold batch pack gp (the last entry starting at or before it:
// entries lie one after another, an empty one at the next one's offset).
PC_INLINE uint32_t entry_of_pack(const GroupArgs& g, uint32_t count, uint64_t gp) {
    uint32_t s = 0;
#pragma unroll
    for (uint32_t i = 1; i < PEERCOMM_MAX_GROUP_CALLS; ++i)
        if (i < count && g.entries[i].offset / 16u <= gp) s = i;
    return s;
}

template <typename D>
PC_INLINE void all_reduce_group(const GroupArgs& g) {
    const Args& a = g.all;
    Ctx c = make_ctx(a);
    if (!enter(c)) return abandon(c, WaitForPeers::No);
    constexpr int L = Pack<D>::kLanes;
    const uint32_t width = a.group_width, me = a.group_rank, op = call_op(a);
    const uint32_t count = g.count < PEERCOMM_MAX_GROUP_CALLS ? g.count : PEERCOMM_MAX_GROUP_CALLS;
    const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    // The batch's packs [first, end) (entry 0's first to the last entry's end); this
    // thread's are those g with g % stride == tid, from `start`: one loop over this
    // thread's packs, each finding its entry, rather than a loop over every entry.
    const uint64_t first = g.entries[0].offset / 16u;
    const GroupEntry& tail = g.entries[count - 1u];
    const uint64_t end = tail.offset / 16u + (tail.elements + L - 1) / L;
    const uint64_t start = first + entry_first_pack(tid, stride, first);
    // A group wider than one stages where the peers can read only the payloads; where
    // one process knows every member's buffers, it reads them in place.
    const bool staged = width > 1u && a.stage_input != 0u;
    if (staged) {
        const uint64_t own = a.payloads[me];
        if (threadIdx.x < kGroupHeaderPacks) store_vec16(own, threadIdx.x, group_header_pack(g, count, threadIdx.x));
        for (uint64_t gp = start; gp < end; gp += stride) {
            const GroupEntry& e = g.entries[entry_of_pack(g, count, gp)];
            const uint64_t n = e.elements, packs = (n + L - 1) / L, p = gp - e.offset / 16u;
            if (p >= packs) continue;
            const uint64_t dst = own + e.offset;
            copy_range<D>(e.input, 0, dst, 0, 0, packs, n, aligned16(e.input) && aligned16(dst), p, packs);
        }
        if (!barrier<BarrierKind::Publish>(c)) return abandon(c, WaitForPeers::Yes);
        // Nothing is stored before every peer's entry table matches this rank's.
        if (!same_entry_tables(c, g, count)) return abandon(c, WaitForPeers::Yes);
    } else {
        if (!barrier<BarrierKind::Start>(c)) return abandon(c, WaitForPeers::Yes);
    }
    with_width(width, [&]<int W>() {
        with_op(op, [&]<typename Op>() PC_INLINE_LAMBDA {
            for (uint64_t gp = start; gp < end; gp += stride) {
                const uint32_t s = entry_of_pack(g, count, gp);
                const GroupEntry& e = g.entries[s];
                const uint64_t n = e.elements, packs = (n + L - 1) / L, p = gp - e.offset / 16u;
                if (p >= packs) continue;
                uint64_t srcs[W];
                bool vec = aligned16(e.output);
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    srcs[k] = staged ? a.payloads[k] + e.offset : width > 1u ? g.peer_inputs[s][k] : e.input;
                    vec = vec && aligned16(srcs[k]);
                }
                reduce_pack<D, W, Op>(op, srcs, p, n, e.output, vec);
            }
        });
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
