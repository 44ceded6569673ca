// Kernels of an engine's own on peercomm's device API (include/peercomm_device.h),
// compiled at run time with NVRTC after peercomm::device::prelude(), or with nvcc after
// #include "peercomm_device.h". Each runs one rank's part; the engine launches the same
// kernel with the same grid on every rank, on the rank's stream. The input of each lies
// in a symmetric buffer, which `comm` (peercomm::Comm::device_comm) reaches on every
// rank. examples/device-api/host.rs is the same logic on the host backend.

// What every kernel here does around its work: enter; a publishing barrier (the inputs
// were written before the kernel, on every rank); `element(i)` for this thread's
// elements of n (a grid stride); an end barrier (the peers keep their inputs until this
// rank has read them); finish. A failed barrier leaves through abandon.
template <class Element>
__device__ void between_barriers(const peercomm::DeviceComm& comm, unsigned long long n, Element element) {
    using namespace peercomm;
    auto b = make_ctx(comm);
    if (!enter(b)) return abandon(b, WaitForPeers::No);
    if (!barrier<BarrierKind::Publish>(b)) return abandon(b, WaitForPeers::Yes);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        element(i);
    if (!barrier<BarrierKind::End>(b)) return abandon(b, WaitForPeers::Yes);
    finish(b);
}

// Element i summed over the members in the library's order: +0.0, then group-rank
// order, in f32.
__device__ __forceinline__ float member_sum(const peercomm::DeviceComm& comm, unsigned long long i) {
    float acc = 0.0f;
    for (unsigned q = 0; q < comm.group_width; ++q) acc += ((const float*)peercomm::peer_buffer(comm, q))[i];
    return acc;
}

// GELU, tanh form.
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// One-stage all-reduce (sum) of the symmetric buffer into `out`.
extern "C" __global__ void one_stage_sum(const peercomm::DeviceComm comm, float* out,
                                         unsigned long long n) {
    between_barriers(comm, n, [&](unsigned long long i) { out[i] = member_sum(comm, i); });
}

// The all-reduce of the symmetric buffer with a bias and GELU fused into its epilogue:
// out[i] = gelu(sum_q x_q[i] + bias[i]), one pass, no intermediate in memory.
extern "C" __global__ void all_reduce_bias_gelu(const peercomm::DeviceComm comm, const float* bias,
                                                float* out, unsigned long long n) {
    between_barriers(comm, n, [&](unsigned long long i) { out[i] = gelu(member_sum(comm, i) + bias[i]); });
}

// Mixture-of-experts combine on a token's home rank. Expert e (one per rank) wrote its
// output for token t of home rank h at row h * tokens + t of its symmetric buffer
// (`hidden` f32 a row; zeros where the token did not go to it); scores[t * width + e]
// is the router's weight of expert e for this rank's token t (0 where not routed). Each
// home rank sums its tokens' rows over the experts, weighted, in expert order:
// out[t][j] = sum_e scores[t][e] * y_e[me * tokens + t][j].
extern "C" __global__ void moe_combine(const peercomm::DeviceComm comm, const float* scores, float* out,
                                       unsigned tokens, unsigned hidden) {
    const unsigned me = comm.group_rank, width = comm.group_width;
    between_barriers(comm, (unsigned long long)tokens * hidden, [&](unsigned long long i) {
        const unsigned long long t = i / hidden, row = (unsigned long long)me * tokens + t;
        float acc = 0.0f;
        for (unsigned e = 0; e < width; ++e) {
            const float y = ((const float*)peercomm::peer_buffer(comm, e))[row * hidden + i % hidden];
            acc += scores[t * width + e] * y;
        }
        out[i] = acc;
    });
}

// The unfused epilogue (for the comparison): out[i] = gelu(x[i] + bias[i]).
extern "C" __global__ void bias_gelu(const float* x, const float* bias, float* out, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = gelu(x[i] + bias[i]);
}
