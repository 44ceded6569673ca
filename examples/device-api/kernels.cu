// Kernels of an engine's own on peercomm's device API (include/peercomm_device.h),
// compiled at run time with NVRTC after peercomm::device::prelude(), or with nvcc after
// #include "peercomm_device.h". Each runs one rank's part; the engine launches the same
// kernel with the same grid on every rank, on the rank's stream. The input of each lies
// in a symmetric buffer, which `comm` (peercomm::Comm::device_comm) reaches on every
// rank. examples/device-api/host.rs is the same logic on the host backend.

// What every kernel here does around its work: enter; a publishing barrier (the inputs
// were written before the kernel, on every rank); `work()`, this thread's part; an end
// barrier (the peers keep their inputs until this rank has read them); finish. A failed
// barrier leaves through abandon.
template <class Work>
__device__ void between_barriers(const peercomm::DeviceComm& comm, Work work) {
    using namespace peercomm;
    auto b = make_ctx(comm);
    if (!enter(b)) return abandon(b, WaitForPeers::No);
    if (!barrier<BarrierKind::Publish>(b)) return abandon(b, WaitForPeers::Yes);
    work();
    if (!barrier<BarrierKind::End>(b)) return abandon(b, WaitForPeers::Yes);
    finish(b);
}

// This thread's indices of [0, n), a grid stride apart.
template <class Element>
__device__ void grid_stride(unsigned long long n, Element element) {
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        element(i);
}

// Element i summed over the members in the library's order: +0.0, then group-rank
// order, in f32.
__device__ __forceinline__ float member_sum(const peercomm::DeviceComm& comm, unsigned long long i) {
    float acc = 0.0f;
    for (unsigned q = 0; q < comm.group_width; ++q) acc += ((const float*)peercomm::peer_buffer(comm, q))[i];
    return acc;
}

// The W members' packs of four floats summed lane by lane in the same order.
template <int W>
__device__ __forceinline__ float4 member_sum4(const float4 (&x)[W]) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int q = 0; q < W; ++q) {
        acc.x += x[q].x;
        acc.y += x[q].y;
        acc.z += x[q].z;
        acc.w += x[q].w;
    }
    return acc;
}

// The sum over the W members of the first n floats of the symmetric buffer: whole packs
// of four (16-byte loads; pack p by thread p % stride, G packs of every member loaded
// before any is summed, to keep as many loads in flight as the library's kernels), then
// the last n % 4 floats one by one. pack(p, sum) takes pack p's sums, element(i, sum)
// a tail element's.
template <int W, class Pack, class Element>
__device__ void for_each_sum(const peercomm::DeviceComm& comm, unsigned long long n, Pack pack, Element element) {
    constexpr int G = W >= 8 ? 1 : 8 / W;
    const float4* src[W];
#pragma unroll
    for (int q = 0; q < W; ++q) src[q] = (const float4*)peercomm::peer_buffer(comm, q);
    const unsigned long long packs = n / 4, tid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long p0 = tid; p0 < packs; p0 += G * stride) {
        float4 x[G][W];
#pragma unroll
        for (int g = 0; g < G; ++g)
            if (p0 + g * stride < packs)
#pragma unroll
                for (int q = 0; q < W; ++q) x[g][q] = src[q][p0 + g * stride];
#pragma unroll
        for (int g = 0; g < G; ++g)
            if (p0 + g * stride < packs) pack(p0 + g * stride, member_sum4<W>(x[g]));
    }
    for (unsigned long long i = packs * 4 + tid; i < n; i += stride) element(i, member_sum(comm, i));
}

// for_each_sum with W the group width (one loop per width: the loads of every member
// are issued before the sums).
template <class Pack, class Element>
__device__ void for_each_member_sum(const peercomm::DeviceComm& comm, unsigned long long n, Pack pack,
                                    Element element) {
    switch (comm.group_width) {
        case 1: return for_each_sum<1>(comm, n, pack, element);
        case 2: return for_each_sum<2>(comm, n, pack, element);
        case 3: return for_each_sum<3>(comm, n, pack, element);
        case 4: return for_each_sum<4>(comm, n, pack, element);
        case 5: return for_each_sum<5>(comm, n, pack, element);
        case 6: return for_each_sum<6>(comm, n, pack, element);
        case 7: return for_each_sum<7>(comm, n, pack, element);
        default: return for_each_sum<8>(comm, n, pack, element);
    }
}

// Every kernel here is launched with 512 threads a block and says so
// (__launch_bounds__(512)), as the library's kernels do. It changes how ptxas allocates
// the loop's registers (offline for sm_90: 64 registers and a 4-byte spill with it, 72
// without): without it this one-stage sum took 1.5x the library's time at world 4 from
// 4 MiB on an H200, with it the same time (docs/perf-notes.md, round four, ninth stop).

// GELU, tanh form.
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// One-stage all-reduce (sum) of the symmetric buffer into `out` (16-byte aligned).
extern "C" __global__ void __launch_bounds__(512) one_stage_sum(const peercomm::DeviceComm comm, float* out,
                                         unsigned long long n) {
    between_barriers(comm, [&] {
        for_each_member_sum(
            comm, n, [&](unsigned long long p, float4 s) { ((float4*)out)[p] = s; },
            [&](unsigned long long i, float s) { out[i] = s; });
    });
}

// The all-reduce of the symmetric buffer with a bias and GELU fused into its epilogue:
// out[i] = gelu(sum_q x_q[i] + bias[i]), one pass, no intermediate in memory (`bias` and
// `out` 16-byte aligned).
extern "C" __global__ void __launch_bounds__(512) all_reduce_bias_gelu(const peercomm::DeviceComm comm, const float* bias,
                                                float* out, unsigned long long n) {
    between_barriers(comm, [&] {
        for_each_member_sum(
            comm, n,
            [&](unsigned long long p, float4 s) {
                const float4 b = ((const float4*)bias)[p];
                ((float4*)out)[p] = make_float4(gelu(s.x + b.x), gelu(s.y + b.y), gelu(s.z + b.z), gelu(s.w + b.w));
            },
            [&](unsigned long long i, float s) { out[i] = gelu(s + bias[i]); });
    });
}

// Mixture-of-experts combine on a token's home rank. Expert e (one per rank) wrote its
// output for token t of home rank h at row h * tokens + t of its symmetric buffer
// (`hidden` f32 a row; zeros where the token did not go to it); scores[t * width + e]
// is the router's weight of expert e for this rank's token t (0 where not routed). Each
// home rank sums its tokens' rows over the experts, weighted, in expert order:
// out[t][j] = sum_e scores[t][e] * y_e[me * tokens + t][j].
extern "C" __global__ void __launch_bounds__(512) moe_combine(const peercomm::DeviceComm comm, const float* scores, float* out,
                                       unsigned tokens, unsigned hidden) {
    const unsigned me = comm.group_rank, width = comm.group_width;
    between_barriers(comm, [&] {
        grid_stride((unsigned long long)tokens * hidden, [&](unsigned long long i) {
            const unsigned long long t = i / hidden, row = (unsigned long long)me * tokens + t;
            float acc = 0.0f;
            for (unsigned e = 0; e < width; ++e) {
                const float y = ((const float*)peercomm::peer_buffer(comm, e))[row * hidden + i % hidden];
                acc += scores[t * width + e] * y;
            }
            out[i] = acc;
        });
    });
}

// The unfused epilogue (for the comparison): out[i] = gelu(x[i] + bias[i]), 16 bytes at a
// time as the fused one (every pointer 16-byte aligned).
extern "C" __global__ void __launch_bounds__(512) bias_gelu(const float* x, const float* bias, float* out, unsigned long long n) {
    grid_stride(n / 4, [&](unsigned long long p) {
        const float4 s = ((const float4*)x)[p], b = ((const float4*)bias)[p];
        ((float4*)out)[p] = make_float4(gelu(s.x + b.x), gelu(s.y + b.y), gelu(s.z + b.z), gelu(s.w + b.w));
    });
    const unsigned long long i = n / 4 * 4 + blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu(x[i] + bias[i]);
}
