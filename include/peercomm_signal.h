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

#include <stdint.h>

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
/* Written into the code word while the other fields are filled in (then released). */
#define PEERCOMM_ERROR_WRITING 0xffffffffu

/* The per-GPU signal. Every peer of the group writes into it over P2P. */
typedef struct peercomm_signal {
    /* Per domain, per block, per peer: how many barriers this block has passed. */
    uint32_t self_counter[PEERCOMM_NUM_BARRIER_DOMAINS][PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND]
                         [PEERCOMM_MAX_GPUS];
    /* Written by peers: [domain][generation parity][block][writer's group rank]. */
    uint32_t peer_counter[PEERCOMM_NUM_BARRIER_DOMAINS][2][PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND]
                         [PEERCOMM_MAX_GPUS];
    uint32_t lamport_state[4];
    uint32_t error_state[4];
    /*
     * quit[block][writer's group rank] != 0: that peer's block `block` abandoned a
     * collective and will not touch this rank's memory again until re-initialisation.
     * A block that abandons a collective whose user buffers its peers read waits for
     * these from its group before its kernel may end (bounded by the timeout), so a
     * user never frees a buffer that a late peer is still reading.
     */
    uint32_t quit[PEERCOMM_MAX_NUM_BLOCKS_UPPER_BOUND][PEERCOMM_MAX_GPUS];
    /* Pads the header so the lamport region starts aligned. */
    uint32_t reserved[56];
} peercomm_signal;

/*
 * Lamport own-slot rule: a rank never writes its own slot (slot `group_rank` of its own
 * region) and reduces its own pack straight from its input; clearing skips that slot.
 * This is sound because the Lamport kernels run only over the whole world (domain 0),
 * so a rank's group rank is the same in every Lamport call on one signal buffer.
 */

/* Which data type a kernel reduces. */
typedef enum peercomm_dtype {
    PEERCOMM_DTYPE_F32 = 0,
    PEERCOMM_DTYPE_F16 = 1,
    PEERCOMM_DTYPE_BF16 = 2
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
    /* Non-zero: copy local_input into the own payload before the start barrier. */
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
    uint32_t reserved[3];
} peercomm_allreduce_args;

#endif /* PEERCOMM_SIGNAL_H */
