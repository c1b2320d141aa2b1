// A block-wide prefix sum the plan and gate kernels share (device code only: include from .cu files).
#pragma once

#include <cstdint>

namespace ds_comet {

constexpr int kScanWarp = 32;

// Inclusive sum over the block (blockDim.x a multiple of 32, at most 1024) of one value per thread;
// *total receives the block's sum.
__device__ inline int64_t block_inclusive_sum(int64_t value, int64_t* total) {
    __shared__ int64_t warp_sums[32];
    const int lane = threadIdx.x % kScanWarp, warp = threadIdx.x / kScanWarp, num_warps = blockDim.x / kScanWarp;
#pragma unroll
    for (int step = 1; step < kScanWarp; step *= 2) {
        const int64_t up = __shfl_up_sync(0xFFFFFFFFu, value, step);
        if (lane >= step) value += up;
    }
    if (lane == kScanWarp - 1) warp_sums[warp] = value;
    __syncthreads();
    if (warp == 0) {
        int64_t sum = lane < num_warps ? warp_sums[lane] : 0;
#pragma unroll
        for (int step = 1; step < kScanWarp; step *= 2) {
            const int64_t up = __shfl_up_sync(0xFFFFFFFFu, sum, step);
            if (lane >= step) sum += up;
        }
        if (lane < num_warps) warp_sums[lane] = sum;
    }
    __syncthreads();
    const int64_t result = value + (warp > 0 ? warp_sums[warp - 1] : 0);
    *total = warp_sums[num_warps - 1];
    __syncthreads();  // warp_sums is reused by the next call
    return result;
}

}  // namespace ds_comet
