// Stand-in for torch's CUDA header, which CPU builds of torch do not ship: just enough for
// tests/cpu/test_op_builder.py to check that csrc/comet_binding.cpp compiles against torch's headers.
#pragma once
#include <cuda_runtime.h>

namespace at {
namespace cuda {
struct StreamStandIn {
    operator cudaStream_t() const { return nullptr; }
};
inline StreamStandIn getCurrentCUDAStream() { return {}; }
}  // namespace cuda
}  // namespace at
