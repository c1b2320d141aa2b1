// Stand-in for torch's CUDA device guard, which CPU builds of torch do not ship: the same
// construction from a device, for tests/cpu/test_op_builder.py's compile check of the binding.
#pragma once
#include <c10/core/Device.h>

namespace c10 {
namespace cuda {
struct CUDAGuard {
    explicit CUDAGuard(Device) {}
    CUDAGuard(const CUDAGuard&) = delete;
    CUDAGuard& operator=(const CUDAGuard&) = delete;
};
}  // namespace cuda
}  // namespace c10
