// Device helpers the communication kernels share: warp constants, ceil_div, the part of a
// prefix-summed list an item falls in, and 16-byte vectors of eight bf16 or fp16 values (device
// code only: include from .cu files).
#pragma once

#include <cstdint>

namespace ds_comet {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The largest i in [0, n) with prefix[i] <= value, for a non-decreasing prefix[0..n] with
// prefix[0] <= value < prefix[n]: the part of a prefix-summed list that item `value` falls in
// (empty parts, whose prefixes repeat, are skipped).
__device__ __forceinline__ int part_of(const int32_t* prefix, int n, int64_t value) {
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (prefix[mid] <= value)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// Eight bf16 or fp16 values (T) of a 16-byte vector, to fp32 and back.
template <typename T>
struct Vec8 {
    static __device__ __forceinline__ void to_float(const int4& raw, float* out) {
        const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(values[i]);
    }
    static __device__ __forceinline__ int4 from_float(const float* in) {
        int4 raw;
        T* values = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) values[i] = static_cast<T>(in[i]);
        return raw;
    }
};

}  // namespace ds_comet
