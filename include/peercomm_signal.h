/*
 * peercomm signal layout and kernel launch arguments.
 *
 * This is the ONE definition of the memory protocol. It is included by the CUDA
 * kernels (kernels-cuda/), the HIP kernels (kernels-hip/) and turned into the Rust
 * mirror by bindgen (build.rs). Change it here and all three follow; the Rust test
 * `layout` pins every offset so an accidental change is caught.
 *
 * Per rank, one allocation in peer-visible device memory holds, in order:
 *   [peercomm_signal][lamport region][payload]
 * The lamport region is PEERCOMM_LAMPORT_GENERATIONS x world-size slots of
 * `lamport_slot_bytes` each (run-time sizes, 16-byte aligned); the payload is the
 * scratch of the staged and two-stage kernels (`payload_bytes`, also run-time).
 */
#ifndef PEERCOMM_SIGNAL_H
#define PEERCOMM_SIGNAL_H

#if defined(__CUDACC_RTC__) || defined(__HIPCC_RTC__)
/* Run-time compilers have no host headers: the fixed-width types, as every target
 * of peercomm defines them. */
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef signed char int8_t;
typedef int int32_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

#define PEERCOMM_MAX_GPUS 8
#define PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND 1024
#define PEERCOMM_NUM_BARRIER_DOMAINS PEERCOMM_MAX_GPUS
#define PEERCOMM_LAMPORT_GENERATIONS 3
/* Alignment of the lamport region and payload inside the signal allocation. */
#define PEERCOMM_REGION_ALIGN 256

/* lamport_state fields. */
#define PEERCOMM_LAMPORT_FLAG 0        /* generation of the next Lamport call, kept in [0, 3) */
#define PEERCOMM_LAMPORT_PREV_PACKS 1  /* 16-byte packs per slot written by the previous call */
#define PEERCOMM_LAMPORT_ARRIVALS 2    /* blocks of the current call that have finished */
#define PEERCOMM_LAMPORT_PREV_WIDTH 3  /* group width (slots used) of the previous call */

/*
 * error_state fields: written once, by the first wait of this rank that gives up
 * (BARRIER_TIMEOUT), or by a peer that gave up and tells this rank to stop
 * (PEER_ABORTED). A non-zero code is the rank's abort word: every wait polls it, and a
 * kernel that finds it set at entry does nothing. Only re-initialisation clears it.
 */
#define PEERCOMM_ERROR_CODE 0   /* 0 = none, else one of the codes below */
#define PEERCOMM_ERROR_RANK 1   /* world rank that timed out (for PEER_ABORTED: the aborter) */
#define PEERCOMM_ERROR_BLOCK 2  /* block index */
#define PEERCOMM_ERROR_DOMAIN 3 /* barrier domain */
#define PEERCOMM_ERROR_BARRIER_TIMEOUT 1
#define PEERCOMM_ERROR_PEER_ABORTED 2
/* A peer's call descriptor differs from this rank's: PEERCOMM_ERROR_RANK is that peer. */
#define PEERCOMM_ERROR_CALL_MISMATCH 3
/* Written into the code word while the other fields are filled in (then released). */
#define PEERCOMM_ERROR_WRITING 0xffffffffu

/*
 * error_detail fields, filled in with the record (before its code is released):
 * the call descriptor of the rank that wrote the record, the world rank it waited for
 * (plus one; 0 = none), and that rank's descriptor as the writer saw it: published
 * beside the barrier arrival or in the Lamport header (CALL_MISMATCH), or, when the
 * wait gave up, its current_call summary merged into the writer's own descriptor (the
 * words current_call does not hold are the writer's). THEIRS_VALID is 1 when THEIRS
 * was read.
 */
#define PEERCOMM_DETAIL_MINE 0         /* PEERCOMM_CALL_WORDS words */
#define PEERCOMM_DETAIL_AWAITED 12     /* world rank waited for, plus one */
#define PEERCOMM_DETAIL_THEIRS 13      /* PEERCOMM_CALL_WORDS words */
#define PEERCOMM_DETAIL_THEIRS_VALID 25
#define PEERCOMM_DETAIL_WORDS 28       /* whole 16-byte packs */

/*
 * The call descriptor: twelve words that every rank of a group computes alike for the
 * same call, published with every barrier arrival and in every Lamport header, and
 * compared exactly by the peers before anything is stored. Every argument that changes
 * a result is a field of its own. Bit 31 of every word is zero, so no word is the
 * Lamport sentinel.
 *   words 0-1:  the rank's call sequence number in the call's barrier domain (every
 *               launch in that domain counts), 1 + the count, bits 0-30 and 31-61
 *   word 2:     kernel kind (bits 0-4), dtype (5-8), group width - 1 (9-11), root (12-14),
 *               blocks - 1 (15-24), reduction operator (25-27)
 *   words 3-4:  element count, bits 0-30 and 31-61
 *   word 5:     where the peers read the input: 0 staged (or not read), else the
 *               registration number + 1 of the registered buffer it lies in
 *   words 6-7:  the input's byte offset in that registration, bits 0-30 and 31-61
 *   word 8:     elements per row (the fused all-reduce + RMSNorm; else 0)
 *   words 9-10: epsilon's bits (the fused collective; else 0): bits 0-30, then bit 31
 *   word 11:    the registration number + 1, bits 31-61
 * An arrival is PEERCOMM_CALL_PACKS 16-byte packs: pack k holds the counter value in
 * word 0 and descriptor words 3k .. 3k + 2 in words 1-3. Each pack is one 16-byte
 * store, so a reader that sees the counter value in every pack sees the descriptor of
 * that barrier's call, with no fence between the stores.
 */
#define PEERCOMM_CALL_WORDS 12
#define PEERCOMM_CALL_PACKS 4
/*
 * The reduction operator of word 2 (bits PEERCOMM_CALL_OP_SHIFT.., 3 bits), read by the
 * reducing kernels. Over f16/bf16 and f32 each runs in f32, in group-rank order:
 *   SUM:  +0.0 + x0 + x1 + ... (over two or more ranks: an exact-zero sum is +0.0)
 *   PROD: x0 * x1 * ...; a NaN result is the type's canonical quiet NaN
 *   MAX, MIN: by value, with -0.0 below +0.0; any NaN gives the type's canonical quiet
 *         NaN (f32 0x7fc00000, f16 0x7e00, bf16 0x7fc0), on every rank and algorithm
 *   (the Lamport kernels send a SUM's or AVG's -0.0 as +0.0, which leaves the result
 *   unchanged, and a PROD's, MAX's or MIN's word 0xffffffff, NaN lanes only, as the
 *   canonical NaN in each lane, so that 0xffffffff is free to carry the sentinel's bits:
 *   PEERCOMM_LAMPORT_SENTINEL_STANDIN)
 *   AVG:  the SUM divided by the group width (one rounding), then rounded to the type
 */
#define PEERCOMM_CALL_OP_SHIFT 25
/*
 * The kind (word 2, bits 0-4) of a reduce: the one-stage all-reduce's kernel, in which
 * only the group rank `root` stores the result.
 */
#define PEERCOMM_KIND_REDUCE 13
#define PEERCOMM_OP_SUM 0
#define PEERCOMM_OP_PROD 1
#define PEERCOMM_OP_MAX 2
#define PEERCOMM_OP_MIN 3
#define PEERCOMM_OP_AVG 4
/* A Lamport slot ends with the writer's descriptor: one pack per 3 words, lane 3 zero. */
#define PEERCOMM_LAMPORT_HEADER_PACKS PEERCOMM_CALL_PACKS
/*
 * The word a Lamport kernel sends for a PROD's, MAX's or MIN's word whose bits are the
 * sentinel's (f32 -0.0; f16 or bf16 +0.0 below a -0.0): all ones, which no such word
 * has once a word of all ones is sent as canonical NaNs. The reader turns it back.
 */
#define PEERCOMM_LAMPORT_SENTINEL_STANDIN 0xffffffffu

/* The per-GPU signal. Every peer of the group writes into it over P2P. */
typedef struct peercomm_signal {
    /* Per domain, per block, per peer: how many barriers this block has passed. */
    uint32_t self_counter[PEERCOMM_NUM_BARRIER_DOMAINS][PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND]
                         [PEERCOMM_MAX_GPUS];
    /*
     * Written by peers: [domain][generation parity][block][writer's group rank], one
     * arrival: PEERCOMM_CALL_PACKS packs, each the counter value (word 0) and three
     * words of the writer's call descriptor (see PEERCOMM_CALL_WORDS).
     */
    uint32_t peer_counter[PEERCOMM_NUM_BARRIER_DOMAINS][2][PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND]
                         [PEERCOMM_MAX_GPUS][4 * PEERCOMM_CALL_PACKS];
    uint32_t lamport_state[4];
    uint32_t error_state[4];
    uint32_t error_detail[PEERCOMM_DETAIL_WORDS];
    /*
     * A summary of the collective this rank's kernels run or ran last (descriptor words
     * 0, 2 and 3: the sequence number, the kind word, the element count's low bits) and
     * whether it still runs (word 3: 1 from block 0's entry to its end, then 0; it
     * stays 1 when the rank has an error record: the abandoned call is still pending):
     * read by a peer whose wait for this rank gives up, to tell a rank that never came
     * (not running) from one that runs another call.
     */
    uint32_t current_call[4];
    /*
     * quit[block][writer's group rank] != 0: that peer's block `block` abandoned a
     * collective and will not touch this rank's memory again until re-initialisation.
     * A block that abandons a collective whose user buffers its peers read waits for
     * these from its group before its kernel may end (bounded by the timeout), so a
     * user never frees a buffer that a late peer is still reading.
     */
    uint32_t quit[PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND][PEERCOMM_MAX_GPUS];
    /*
     * exchange_source[q] = {low, high} words of where this rank reads what world rank q
     * sends it in the current exchange: q's own buffer, read in place (registered or
     * symmetric; the address as this rank reaches it), or 0: q's payload region. Written
     * by q's blocks before their Publish arrival, read after it (see the exchange below).
     */
    uint32_t exchange_source[PEERCOMM_MAX_GPUS][2];
    /*
     * The grid barrier of user kernels (include/peercomm_device.h, grid_barrier):
     * [0] this rank's blocks arrived at the current one, [1] grid barriers passed.
     */
    uint32_t user_grid[2];
    /* Pads the header to a multiple of PEERCOMM_REGION_ALIGN. */
    uint32_t reserved[6];
} peercomm_signal;

/*
 * Lamport own-slot rule: a rank never writes its own slot (slot `group_rank` of its own
 * region) and reduces its own pack straight from its input; clearing skips that slot.
 * This is sound because the Lamport kernels run only over the whole world (domain 0),
 * so a rank's group rank is the same in every Lamport call on one signal buffer.
 *
 * Lamport header: the last PEERCOMM_LAMPORT_HEADER_PACKS packs of every slot are not
 * data but the writer's call descriptor, pack k = {word 3k, 3k + 1, 3k + 2, 0}; data
 * packs fill the slot up to them. A reader checks every source's header before it
 * stores anything.
 */

/*
 * stage_input of a staged kernel whose message the payload holds: staged whole (any
 * message of fewer units; the planner stages longer ones in chunks).
 */
#define PEERCOMM_STAGE_WHOLE 0xffffffffu

/*
 * Which data type a kernel reduces or moves. f16 and bf16 reduce in f32, f64 in f64, the
 * integers in their own type (Sum and Prod wrap).
 */
typedef enum peercomm_dtype {
    PEERCOMM_DTYPE_F32 = 0,
    PEERCOMM_DTYPE_F16 = 1,
    PEERCOMM_DTYPE_BF16 = 2,
    PEERCOMM_DTYPE_F64 = 3,
    PEERCOMM_DTYPE_I8 = 4,
    PEERCOMM_DTYPE_U8 = 5,
    PEERCOMM_DTYPE_I32 = 6,
    PEERCOMM_DTYPE_U32 = 7,
    PEERCOMM_DTYPE_I64 = 8,
    PEERCOMM_DTYPE_U64 = 9
} peercomm_dtype;

/*
 * Launch arguments of every kernel (the all-reduce and the other collectives), passed
 * by value (the same struct on the host backend). Arrays are indexed by group rank
 * (0 .. group_width).
 */
typedef struct peercomm_allreduce_args {
    /* Where each group member's input is read (its user buffer, or its payload when staged). */
    uint64_t inputs[PEERCOMM_MAX_GPUS];
    /* Each group member's payload (scratch). */
    uint64_t payloads[PEERCOMM_MAX_GPUS];
    /* Each group member's signal. */
    uint64_t signals[PEERCOMM_MAX_GPUS];
    /* This rank's own user input (read by the staging copy and the Lamport push). */
    uint64_t local_input;
    /* This rank's output. */
    uint64_t output;
    uint64_t num_elements;
    /*
     * A wait that spins longer than this gives up with an error record; 0 = never.
     * For the delay kernel (fault injection): how long to spin.
     */
    uint64_t timeout_ns;
    uint32_t lamport_slot_bytes;
    uint32_t group_rank;
    uint32_t group_width;
    uint32_t domain;
    uint32_t world_rank;
    /*
     * 0: the peers' inputs are read where `inputs` says. Non-zero: staged: this rank
     * copies what its peers read (from local_input) into its own payload before the
     * publishing first barrier, and they read it there. The value is also the capacity
     * C of one chunk: a message of at most C units is staged whole at the start of the
     * payload (PEERCOMM_STAGE_WHOLE asks for that for any message); a longer one runs
     * through the payload in chunks of C units, chunk k in half k % 2, pipelined (see
     * run_chunks in kernels-common/peercomm_kernels.h). The unit is a 16-byte pack of
     * the message (one-stage all-reduce, all-gather, broadcast), a pack of each part
     * (reduce-scatter, scatter: a half holds the group width's parts' chunks), or a row
     * (the fused all-reduce + RMSNorm). C is computed alike on every rank from the
     * agreed payload_bytes (src/comm/core/plan.rs `staging`, collective.rs
     * `collective_staging`), so that two chunks fit the payload. A field of its own
     * would grow this struct, which every launch passes by value and
     * peercomm_group_args embeds (the batched kernel does not read it).
     */
    uint32_t stage_input;
    /* Broadcast and scatter: the group rank whose input is sent. */
    uint32_t root;
    /* Fused all-reduce + residual + RMSNorm: elements per row (token). */
    uint32_t hidden;
    /* Fused: the residual (read, then overwritten with the updated residual). */
    uint64_t residual;
    /* Fused: the RMSNorm weight (`hidden` elements). */
    uint64_t weight;
    /* Fused: added to the mean square before the reciprocal square root. */
    float epsilon;
    /* This call's descriptor (see PEERCOMM_CALL_WORDS). */
    uint32_t call[PEERCOMM_CALL_WORDS];
} peercomm_allreduce_args;

/*
 * The batched all-reduce (kernel kind AllReduceGroup): up to PEERCOMM_MAX_GROUP_CALLS
 * all-reduces of one dtype and one group width in one kernel, with one start and one end
 * barrier. Its own struct, so that peercomm_allreduce_args (passed by value to every
 * other launch) does not grow.
 */
#define PEERCOMM_MAX_GROUP_CALLS 8

/*
 * The entry table of a batch over a group wider than one: every member writes its own at
 * the start of its own payload (every block writes the same bytes, before its Publish
 * barrier), and after that barrier every block compares every peer's table with its own
 * before it stores anything; any difference is a call mismatch on every rank (see
 * src/comm/core/group.rs). 32-bit words:
 *   word 0:              count (entries in use); words 1-3: 0
 *   words 4 + 2s, 5 + 2s: entry s's element count, low and high 32 bits (0 for s >= count)
 * = 16 + 8 x PEERCOMM_MAX_GROUP_CALLS bytes, whole 16-byte packs. The staged entries
 * follow it: entry 0's offset is PEERCOMM_GROUP_HEADER_BYTES.
 */
#define PEERCOMM_GROUP_HEADER_BYTES 80

/* One all-reduce of a batch, on this rank. */
typedef struct peercomm_group_entry {
    /* This rank's input (its user buffer). */
    uint64_t input;
    /* This rank's output. */
    uint64_t output;
    /* Elements of the entry (0: the entry writes nothing). */
    uint64_t elements;
    /*
     * Byte offset of the entry in every group member's payload: entry 0 after the entry
     * table (at PEERCOMM_GROUP_HEADER_BYTES), each next one after the previous entry's
     * elements rounded up to whole 16-byte packs (so offset / 16 is the entry's first
     * pack in the batch's concatenated pack range). Computed by the host, the same on
     * every rank of the group whose entry tables agree.
     */
    uint64_t offset;
} peercomm_group_entry;

/*
 * Launch arguments of the batched all-reduce, passed by value. `all` is read as for the
 * one-stage kernel (signals, payloads, group, domain, timeout, stage_input, and the call
 * descriptor in `all.call`, which is the batch's: see src/comm/core/group.rs); its
 * local_input, output, inputs and num_elements (the batch's total elements) are not
 * read: the entries say where the data is. A group wider than one stages through the
 * payloads when all.stage_input is non-zero; otherwise it reads every member's input in
 * place, from peer_inputs (where one process knows every rank's buffer).
 */
typedef struct peercomm_group_args {
    peercomm_allreduce_args all;
    /* Entries in use: 1 .. PEERCOMM_MAX_GROUP_CALLS. */
    uint32_t count;
    uint32_t pad;
    peercomm_group_entry entries[PEERCOMM_MAX_GROUP_CALLS];
    /* In place (all.stage_input == 0): entry s's input on group member k; else unread. */
    uint64_t peer_inputs[PEERCOMM_MAX_GROUP_CALLS][PEERCOMM_MAX_GPUS];
} peercomm_group_args;

/*
 * The exchange (kernel kind Exchange): the sends and receives of one rank, to and from
 * any world ranks, in one kernel (send / recv alone or grouped, all-to-all). The launch
 * is over the whole world (group = world, domain 0), but each pair of ranks that
 * exchanges data synchronises alone: a pair's barrier advances only the two counters the
 * pair shares (self_counter[0][block][peer] on each side), so ranks outside it never
 * wait, and whole-world collectives stay in step with it (they advance every counter).
 * Each arrival carries the pair's own descriptor, which both ranks compute alike from
 * what each sends the other (src/comm/core/call: kind Exchange, the pair's call number,
 * the lower rank's send count and type, the higher rank's), so a send that does not
 * match its receive is a call mismatch on both ranks before either stores anything.
 *
 * What this rank sends to world rank q is staged into region q of its own payload
 * (all.stage_input bytes each, a multiple of 16), after the pair's End barrier of the
 * previous exchange, and q reads it there after the pair's Publish barrier. Pack k
 * (16 bytes) of a pair's message is staged and read by thread k % (blocks x threads) of
 * the pair's `blocks`, the same on both ranks, so the per-block barrier suffices.
 *
 * Where q reaches this rank's data in place (`send_remote`: a registered or symmetric
 * buffer, as q's address), nothing is staged: every block of the pair writes that
 * address into q's exchange_source[this rank] before its Publish arrival (0 when
 * staged), and q reads the data from there after the barrier. Only the sender knows,
 * so the receiver always reads the word; chunks are counted alike either way. A block
 * whose data a peer may read in place and which gives up waits for that peer's quit
 * (bounded by the timeout) before its kernel may end, as the collectives do.
 */
typedef struct peercomm_exchange_peer {
    /* This rank's data for the peer, and its bytes (0: nothing). */
    uint64_t send;
    uint64_t send_bytes;
    /* Where this rank stores what the peer sends, and its bytes (0: nothing). */
    uint64_t recv;
    uint64_t recv_bytes;
    /*
     * Blocks that move the pair's data (1 .. the launch's grid); 0: no exchange with
     * this peer. For the rank itself (peers[world_rank]): send is copied to recv locally.
     */
    uint32_t blocks;
    /* The pair's descriptor (see PEERCOMM_CALL_WORDS). */
    uint32_t call[PEERCOMM_CALL_WORDS];
    uint32_t pad;
    /* Where the peer reaches `send` in place (its address there), or 0: staged. */
    uint64_t send_remote;
} peercomm_exchange_peer;

/*
 * Launch arguments of the exchange, passed by value. `all` is read as for the other
 * kernels (the whole world's signals and payloads, world_rank = group_rank, domain 0,
 * timeout, stage_input = the bytes of one payload region, call = the exchange's summary
 * for current_call); the peers' entries say what moves.
 */
typedef struct peercomm_exchange_args {
    peercomm_allreduce_args all;
    peercomm_exchange_peer peers[PEERCOMM_MAX_GPUS];
} peercomm_exchange_args;

/*
 * The device API's argument (include/peercomm_device.h): one rank's view of one
 * symmetric or registered buffer for kernels of the engine's own, passed by value. Its
 * first fields have the names of peercomm_allreduce_args's that the protocol reads, so
 * the library's barrier, waits and error records serve it as they are.
 */
typedef struct peercomm_device_comm {
    /* Group member k's signal, as this rank reaches it (k < group_width). */
    uint64_t signals[PEERCOMM_MAX_GPUS];
    /* Group member k's buffer (the one this value was made for), as this rank reaches it. */
    uint64_t buffers[PEERCOMM_MAX_GPUS];
    /* The buffer's bytes (the same on every member). */
    uint64_t bytes;
    /* How long one wait may take before it gives up (0: for ever). */
    uint64_t timeout_ns;
    uint32_t group_rank;
    uint32_t group_width;
    /* The barrier bank: PEERCOMM_USER_DOMAIN, which no collective of the library uses. */
    uint32_t domain;
    uint32_t world_rank;
    /* What every arrival carries (kind PEERCOMM_KIND_USER, the buffer's registration and
     * size): two ranks whose kernels work on different buffers find a call mismatch. */
    uint32_t call[PEERCOMM_CALL_WORDS];
} peercomm_device_comm;

/*
 * The barrier bank of user kernels. The library's collectives use bank 0 (the whole
 * world) and banks 1 to 4 (the widths of groups smaller than the world, which divide
 * it: at most 8 / 2); 5 to 7 are never theirs.
 */
#define PEERCOMM_USER_DOMAIN 7
/* The kind (descriptor word 2, bits 0-4) of a user kernel's barriers. */
#define PEERCOMM_KIND_USER 31

#endif /* PEERCOMM_SIGNAL_H */
