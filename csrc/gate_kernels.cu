// ds_comet gate kernels: the integer bookkeeping of DeepSpeed's top-2 and top-k gates. See comet.h.
//
// Stock's gates build these answers from one- to two-dozen small torch ops; the device finishes
// each in microseconds, so the layer waits on their launches. The answers are exact (indices,
// counts, 0/1 masks, copied values), and the one float computation here, the Gumbel noise of
// top-2 sampling, repeats torch's own ops one rounding at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "block_scan.cuh"
#include "comet.h"

namespace ds_comet {
namespace {

constexpr int kGateThreads = 256;
constexpr int kQueueThreads = 1024;

// torch.argmax's order: the first NaN, else the largest value, the lowest index among equals.
__device__ __forceinline__ bool beats(float candidate, float best) {
    return isnan(candidate) ? !isnan(best) : candidate > best;
}

// torch.distributions.Gumbel(0, 1).rsample of the uniform draw r (torch.rand), as torch computes it:
// Uniform(tiny, 1 - eps) is low + r * (high - low), then log, 0 + -1 * x, log, 0 + -1 * x. Each op
// is one rounded fp32 op in its own torch kernel, so none may be fused into an FMA here.
__device__ __forceinline__ float gumbel_of(float r) {
    const float low = 1.17549435082228750797e-38f;      // finfo(float32).tiny
    const float high = 1.0f - 1.1920928955078125e-07f;  // 1 - finfo(float32).eps, exact in fp32
    const float u = __fadd_rn(low, __fmul_rn(r, __fsub_rn(high, low)));
    const float inner = __fadd_rn(0.0f, __fmul_rn(-1.0f, logf(u)));
    return __fadd_rn(0.0f, __fmul_rn(-1.0f, logf(inner)));
}

__global__ void gumbel_noise_kernel(const float* uniform, int64_t count, float* noise) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < count) noise[i] = gumbel_of(uniform[i]);
}

// The logits' dtype: autocast makes them bf16 or fp16. Stock adds the noise in place, so the noisy
// logit is the fp32 sum rounded to that dtype; a plain logit converts to fp32 exactly.
template <typename T>
struct Logit;

template <>
struct Logit<float> {
    static __device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
    static __device__ __forceinline__ float round(float x) { return x; }
};

template <>
struct Logit<__nv_bfloat16> {
    static __device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
    static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
};

template <>
struct Logit<__half> {
    static __device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
    static __device__ __forceinline__ float round(float x) { return __half2float(__float2half_rn(x)); }
};

// choices[0][s] = argmax(gates[s]); choices[1][s] = argmax of logits[s] (+ Gumbel noise of
// uniform[s] when given) with the first choice ruled out by -inf, as stock's top-2 does.
template <typename T>
__global__ void top2_choices_kernel(const float* gates, const T* logits, const float* uniform, int64_t num_tokens,
                                    int num_experts, int32_t* choices) {
    const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (s >= num_tokens) return;
    const int64_t row = s * num_experts;
    int first = 0;
    float best = gates[row];
    for (int e = 1; e < num_experts; ++e) {
        if (beats(gates[row + e], best)) {
            best = gates[row + e];
            first = e;
        }
    }
    int second = 0;
    for (int e = 0; e < num_experts; ++e) {
        float score = -INFINITY;
        if (e != first) {
            const float logit = Logit<T>::load(logits, row + e);
            score = uniform ? Logit<T>::round(__fadd_rn(logit, gumbel_of(uniform[row + e]))) : logit;
        }
        if (e == 0 || beats(score, best)) {
            best = score;
            second = e;
        }
    }
    choices[s] = first;
    choices[num_tokens + s] = second;
}

// One block per expert e scans its routes in stock's queue order (every first choice, then every
// second choice, each by token) for their 1-based places; with capacity >= 0 a route whose place is
// past it is dropped. Writes routes[r] for e's routes and expert_counts[e].
__global__ void top2_queue_kernel(const int32_t* choices, int64_t num_tokens, int num_experts, int64_t capacity,
                                  int32_t* routes, int64_t* expert_counts) {
    const int e = blockIdx.x;
    const int64_t total = 2 * num_tokens;
    const int64_t run = (total + blockDim.x - 1) / blockDim.x;
    const int64_t begin = min(total, threadIdx.x * run), end = min(total, begin + run);
    int64_t mine = 0;
    for (int64_t r = begin; r < end; ++r) mine += choices[r] == e;
    int64_t count;
    int64_t place = block_inclusive_sum(mine, &count) - mine;
    for (int64_t r = begin; r < end && mine > 0; ++r) {
        if (choices[r] == e) {
            ++place;
            routes[r] = capacity < 0 || place <= capacity ? e : -1;
        }
    }
    if (threadIdx.x == 0) expert_counts[e] = count;
}

// One thread per (token, expert) cell of the one-hot masks. With dropping, three rows: the first
// choices before the drop, then both choices after it; without, both choices.
__global__ void top2_masks_kernel(const int32_t* choices, const int32_t* routes, int64_t num_tokens, int num_experts,
                                  bool drop, float* masks) {
    const int64_t plane = num_tokens * num_experts;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= plane) return;
    const int64_t s = i / num_experts;
    const int e = static_cast<int>(i - s * num_experts);
    const bool first = choices[s] == e, second = choices[num_tokens + s] == e;
    if (drop) {
        masks[i] = first ? 1.0f : 0.0f;
        masks[plane + i] = first && routes[s] >= 0 ? 1.0f : 0.0f;
        masks[2 * plane + i] = second && routes[num_tokens + s] >= 0 ? 1.0f : 0.0f;
    } else {
        masks[i] = first ? 1.0f : 0.0f;
        masks[plane + i] = second ? 1.0f : 0.0f;
    }
}

// One thread per (token s, expert e) cell: mask[s][e] = 1 if e is among s's top-k (top_idx[s],
// gate values top_gate[s]); with dropping, ranked[s][e] its gate value (0 if not chosen),
// kept[s][e] = 0 and indices[j][s] = -1 until topk_keep_kernel keeps the route; without,
// indices[j][s] = e.
//
// The first blocks also count kCountedRoutes routes each into expert_counts. One global atomic
// per chosen cell put S x k atomics on the few cache lines that hold the counters, and they
// serialised there (15-27 us alone on an H200 at 4096-8192 tokens, k = 4 and 8); a block's
// histogram in shared memory leaves one global atomic per block and expert (7-9 us).
// Without room for it (num_experts past kSharedCounters), each route is counted globally.
constexpr int kCountedRoutes = 4096;
constexpr int kSharedCounters = 12288;  // 48 KiB of dynamic shared memory, the default limit

__global__ void topk_masks_kernel(const int64_t* top_idx, const float* top_gate, int64_t num_tokens, int top_k,
                                  int num_experts, bool drop, float* mask, float* kept, float* ranked, int32_t* indices,
                                  unsigned long long* expert_counts) {
    extern __shared__ unsigned int histogram[];
    const bool shared_counts = num_experts <= kSharedCounters;
    const int64_t routes = num_tokens * top_k;
    const int64_t first_route = static_cast<int64_t>(blockIdx.x) * kCountedRoutes;
    if (shared_counts && first_route < routes) {  // alike for the whole block
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) histogram[e] = 0;
        __syncthreads();
        const int64_t last_route = min(routes, first_route + kCountedRoutes);
        for (int64_t r = first_route + threadIdx.x; r < last_route; r += blockDim.x) {
            // torch.topk gives ids in range; one that is not is left uncounted, as the cells leave it.
            const uint64_t e = static_cast<uint64_t>(top_idx[r]);
            if (e < static_cast<uint64_t>(num_experts)) atomicAdd(histogram + e, 1u);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            if (histogram[e] != 0) atomicAdd(expert_counts + e, static_cast<unsigned long long>(histogram[e]));
        }
    }

    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= num_tokens * num_experts) return;
    const int64_t s = i / num_experts;
    const int e = static_cast<int>(i - s * num_experts);
    float chosen = 0.0f, value = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        if (top_idx[s * top_k + j] == e) {
            chosen = 1.0f;
            value = top_gate[s * top_k + j];
            indices[j * num_tokens + s] = drop ? -1 : e;
            if (!shared_counts) atomicAdd(expert_counts + e, 1ull);
        }
    }
    mask[i] = chosen;
    if (drop) {
        kept[i] = 0.0f;
        ranked[i] = value;
    }
}

// Per entry of the capacity topk (capacity_idx[c][e] = a token among e's `capacity` best): keeps
// the route if the token chose e.
__global__ void topk_keep_kernel(const int64_t* capacity_idx, int64_t entries, const int64_t* top_idx,
                                 int64_t num_tokens, int top_k, int num_experts, const float* mask, float* kept,
                                 int32_t* indices) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= entries) return;
    const int e = static_cast<int>(i % num_experts);
    const int64_t s = capacity_idx[i];
    if (mask[s * num_experts + e] == 0.0f) return;
    kept[s * num_experts + e] = 1.0f;
    for (int j = 0; j < top_k; ++j) {
        if (top_idx[s * top_k + j] == e) indices[j * num_tokens + s] = e;
    }
}

int64_t blocks_for(int64_t items, int threads) { return (items + threads - 1) / threads; }

}  // namespace

cudaError_t launch_gumbel_noise(const float* uniform, int64_t count, float* noise, cudaStream_t stream) {
    if (count == 0) return cudaSuccess;
    gumbel_noise_kernel<<<blocks_for(count, kGateThreads), kGateThreads, 0, stream>>>(uniform, count, noise);
    return cudaGetLastError();
}

cudaError_t launch_top2_routes(const float* gates, const void* logits, int logits_code, const float* uniform,
                               int64_t num_tokens, int num_experts, int64_t capacity, int32_t* choices, int32_t* routes,
                               float* masks, int64_t* expert_counts, cudaStream_t stream) {
    if (num_tokens == 0) return cudaMemsetAsync(expert_counts, 0, num_experts * sizeof(int64_t), stream);
    const int64_t blocks = blocks_for(num_tokens, kGateThreads);
    if (logits_code == 0) {
        top2_choices_kernel<<<blocks, kGateThreads, 0, stream>>>(gates, static_cast<const __nv_bfloat16*>(logits),
                                                                 uniform, num_tokens, num_experts, choices);
    } else if (logits_code == 1) {
        top2_choices_kernel<<<blocks, kGateThreads, 0, stream>>>(gates, static_cast<const __half*>(logits), uniform,
                                                                 num_tokens, num_experts, choices);
    } else {
        top2_choices_kernel<<<blocks, kGateThreads, 0, stream>>>(gates, static_cast<const float*>(logits), uniform,
                                                                 num_tokens, num_experts, choices);
    }
    top2_queue_kernel<<<num_experts, kQueueThreads, 0, stream>>>(choices, num_tokens, num_experts, capacity, routes,
                                                                 expert_counts);
    top2_masks_kernel<<<blocks_for(num_tokens * num_experts, kGateThreads), kGateThreads, 0, stream>>>(
        choices, routes, num_tokens, num_experts, capacity >= 0, masks);
    return cudaGetLastError();
}

cudaError_t launch_topk_masks(const int64_t* top_idx, const float* top_gate, int64_t num_tokens, int top_k,
                              int num_experts, bool drop, float* mask, float* kept, float* ranked, int32_t* indices,
                              int64_t* expert_counts, cudaStream_t stream) {
    cudaError_t err = cudaMemsetAsync(expert_counts, 0, num_experts * sizeof(int64_t), stream);
    if (err != cudaSuccess || num_tokens == 0) return err;
    // Enough blocks for every cell and for every route's count (num_experts < top_k cannot come
    // from torch.topk, but the grid must not depend on that).
    const int64_t blocks =
        std::max(blocks_for(num_tokens * num_experts, kGateThreads), blocks_for(num_tokens * top_k, kCountedRoutes));
    const size_t shared_bytes = num_experts <= kSharedCounters ? num_experts * sizeof(unsigned int) : 0;
    topk_masks_kernel<<<blocks, kGateThreads, shared_bytes, stream>>>(
        top_idx, top_gate, num_tokens, top_k, num_experts, drop, mask, kept, ranked, indices,
        reinterpret_cast<unsigned long long*>(expert_counts));
    return cudaGetLastError();
}

cudaError_t launch_topk_keep(const int64_t* capacity_idx, int64_t entries, const int64_t* top_idx, int64_t num_tokens,
                             int top_k, int num_experts, const float* mask, float* kept, int32_t* indices,
                             cudaStream_t stream) {
    if (entries == 0) return cudaSuccess;
    topk_keep_kernel<<<blocks_for(entries, kGateThreads), kGateThreads, 0, stream>>>(
        capacity_idx, entries, top_idx, num_tokens, top_k, num_experts, mask, kept, indices);
    return cudaGetLastError();
}

}  // namespace ds_comet
