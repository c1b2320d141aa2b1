// ds_comet routing kernels: the routing plan and the tokens each rank gets. See comet.h.
#include "block_scan.cuh"
#include "comet.h"
#include "kernel_helpers.cuh"

namespace ds_comet {
namespace {

// The sort key of a route: its expert, or num_experts for a dropped one. An id past the last
// expert (no gate makes one) counts as dropped, so that every route still gets a place.
__device__ __forceinline__ int key_of(int32_t id, int num_experts) {
    return id < 0 || id >= num_experts ? num_experts : id;
}

// A stable counting sort with no pass between blocks. Keys are the experts and num_experts (the
// dropped routes). Each block takes KEYS consecutive keys: more than one only where one key a block
// would need more blocks than the GPU runs at once, since every block reads every route. Each warp
// owns a segment of consecutive route ids and walks it 32 routes at a time, lane l reading route
// base + l (coalesced): ballots count each key's routes in route-id order, block-wide prefixes over
// the warps' counts give each warp its first place per key, and a second walk places the routes.
constexpr int kPlanThreads = 1024;

template <int KEYS>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_kernel(const int32_t* indices, int64_t routes, int num_experts, int64_t* route_order, int64_t* route_position,
                int64_t* expert_counts) {
    constexpr unsigned kAll = 0xFFFFFFFFu;
    // With one key a block, the grid has one block per key: no block is short of keys.
    const int first_key = blockIdx.x * KEYS, keys = KEYS == 1 ? 1 : min(KEYS, num_experts + 1 - first_key);
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
    const int64_t segment = ceil_div(ceil_div(routes, num_warps), kWarp) * kWarp;
    const int64_t first = min(routes, warp * segment), last = min(routes, first + segment);
    int64_t mine[KEYS], smaller = 0, any = 0;  // the same in every lane of the warp
#pragma unroll
    for (int j = 0; j < KEYS; ++j) mine[j] = 0;
#pragma unroll 4
    for (int64_t base = first; base < last; base += kWarp) {
        const int64_t r = base + lane;
        // Past the segment: a key no block has.
        const int offset = (r < last ? key_of(indices[r], num_experts) : num_experts + 1) - first_key;
        smaller += __popc(__ballot_sync(kAll, offset < 0));
#pragma unroll
        for (int j = 0; j < KEYS; ++j) mine[j] += __popc(__ballot_sync(kAll, offset == j && j < keys));
    }
    int64_t place[KEYS];
    int64_t start;  // the first place of this block's first key
    block_inclusive_sum(lane == 0 ? smaller : 0, &start);
#pragma unroll
    for (int j = 0; j < KEYS; ++j) {
        // Lane 0 carries its warp's count into the block-wide sums: thread order is warp order.
        const int64_t warp_mine = lane == 0 ? mine[j] : 0;
        int64_t key_total;
        place[j] = __shfl_sync(kAll, start + block_inclusive_sum(warp_mine, &key_total) - warp_mine, 0);
        if (threadIdx.x == 0 && j < keys && first_key + j < num_experts) expert_counts[first_key + j] = key_total;
        start += key_total;
        any += mine[j];
    }
    for (int64_t base = first; base < last && any > 0; base += kWarp) {
        const int64_t r = base + lane;
        const int offset = (r < last ? key_of(indices[r], num_experts) : num_experts + 1) - first_key;
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const bool match = offset == j && j < keys;
            const unsigned matches = __ballot_sync(kAll, match);
            if (match) {
                const int64_t at = place[j] + __popc(matches & ((1u << lane) - 1u));
                route_order[at] = r;
                route_position[r] = at;
            }
            place[j] += __popc(matches);
        }
    }
}

// Which tokens each rank gets (launch_rank_tokens): block d lists, in token order, the tokens with a
// kept route to one of d's experts.
__global__ void rank_tokens_kernel(const int32_t* indices, int64_t num_tokens, int top_k, int num_experts, int ep_size,
                                   int32_t* rank_tokens, int64_t* rank_counts) {
    const int d = blockIdx.x, L = num_experts / ep_size;
    int64_t listed = 0;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += blockDim.x) {
        const int64_t t = t0 + threadIdx.x;
        int64_t here = 0;
        for (int j = 0; t < num_tokens && j < top_k && !here; ++j) {
            const int e = indices[j * num_tokens + t];
            here = e >= 0 && e < num_experts && e / L == d;
        }
        int64_t total;
        const int64_t place = listed + block_inclusive_sum(here, &total) - here;
        if (here) rank_tokens[d * num_tokens + place] = static_cast<int32_t>(t);
        listed += total;
    }
    if (threadIdx.x == 0) rank_counts[d] = listed;
}

}  // namespace

cudaError_t launch_plan(const int32_t* indices, int64_t routes, int num_experts, int64_t* route_order,
                        int64_t* route_position, int64_t* expert_counts, cudaStream_t stream) {
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    const int keys = num_experts + 1;
    if (keys <= sms) {
        plan_kernel<1><<<keys, kPlanThreads, 0, stream>>>(indices, routes, num_experts, route_order, route_position,
                                                          expert_counts);
    } else if (keys <= 2 * sms) {
        plan_kernel<2><<<ceil_div(keys, 2), kPlanThreads, 0, stream>>>(indices, routes, num_experts, route_order,
                                                                       route_position, expert_counts);
    } else {  // past 4 keys a block, the counts' registers spill (1024 threads: 64 a thread at most)
        plan_kernel<4><<<ceil_div(keys, 4), kPlanThreads, 0, stream>>>(indices, routes, num_experts, route_order,
                                                                       route_position, expert_counts);
    }
    return cudaGetLastError();
}

cudaError_t launch_rank_tokens(const int32_t* indices, int64_t num_tokens, int top_k, int num_experts, int ep_size,
                               int32_t* rank_tokens, int64_t* rank_counts, cudaStream_t stream) {
    rank_tokens_kernel<<<ep_size, 1024, 0, stream>>>(indices, num_tokens, top_k, num_experts, ep_size, rank_tokens,
                                                     rank_counts);
    return cudaGetLastError();
}

}  // namespace ds_comet
