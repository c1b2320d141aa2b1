// Experiment (not product code): what the gated backward's first GEMM costs in CUTLASS when its
// epilogue moves every extra tensor through shared memory and TMA, on equal-size expert groups
// (a batched GEMM, one batch per expert), so that CUTLASS's own aux nodes address them.
//   per expert l (rows [l M, (l + 1) M) of every row tensor):  g = dY_l @ W2_l   (W2_l: [H, F] row-major)
//   out[:, :F] = g * up * silu'(z),  out[:, F:] = g * silu(z),  h = silu(z) * up   (z, up = pre[:, :F], pre[:, F:])
// Build: nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC
//        -I<nvidia-cutlass>/cutlass_library/source/include batched_tma_epilogue.cu -o libbatched.so
#include <cuda_runtime.h>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using cutlass::Array;
namespace fusion = cutlass::epilogue::fusion;
namespace epi_detail = cutlass::epilogue::collective::detail;

namespace batched_experiment {

using Element = cutlass::bfloat16_t;

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float silu_grad(float x) {
  float s = 1.f / (1.f + __expf(-x));
  return s * (1.f + x * (1.f - s));
}

// Element-wise functors on fragments, as Sm90Compute calls them.
template <class T> struct UpGrad;     // (g, z) -> g silu(z)
template <class T> struct Activated;  // (z, up) -> silu(z) up
template <class T> struct GateGrad;   // (g, z, up) -> g up silu'(z)
template <class T> struct FirstOf;    // (a, b, c) -> a: ties the stores into the output

template <int N> struct UpGrad<Array<float, N>> {
  CUTLASS_DEVICE Array<float, N> operator()(Array<float, N> const& g, Array<float, N> const& z) const {
    Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = g[i] * silu(z[i]);
    return out;
  }
};
template <int N> struct Activated<Array<float, N>> {
  CUTLASS_DEVICE Array<float, N> operator()(Array<float, N> const& z, Array<float, N> const& up) const {
    Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = silu(z[i]) * up[i];
    return out;
  }
};
template <int N> struct GateGrad<Array<float, N>> {
  CUTLASS_DEVICE Array<float, N> operator()(Array<float, N> const& g, Array<float, N> const& z,
                                            Array<float, N> const& up) const {
    Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = g[i] * up[i] * silu_grad(z[i]);
    return out;
  }
};
template <int N> struct FirstOf<Array<float, N>> {
  CUTLASS_DEVICE Array<float, N> operator()(Array<float, N> const& a, Array<float, N> const&,
                                            Array<float, N> const&) const {
    return a;
  }
};

#ifndef TILE_N
#define TILE_N 256
#endif
using TileShape = Shape<_128, Int<TILE_N>, _64>;
using ClusterShape = Shape<_1, _1, _1>;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using RowMajor = cutlass::layout::RowMajor;

using EpiDesc = epi_detail::EpilogueDescriptor<TileShape, cutlass::epilogue::collective::EpilogueTileAuto, void,
                                               Element, EpilogueSchedule>;
using LoadDesc = epi_detail::AuxLoadDescriptor<EpiDesc, RowMajor, Element>;
using StoreDesc = epi_detail::AuxStoreDescriptor<EpiDesc, RowMajor, Element>;
using RowsLoad = fusion::Sm90AuxLoad<LoadDesc::Stages, typename EpiDesc::EpilogueTile, Element,
                                     typename LoadDesc::Stride, typename LoadDesc::SmemLayoutAtom,
                                     typename LoadDesc::CopyOpS2R>;
using RowsStore = fusion::Sm90AuxStore<StoreDesc::Stages, typename EpiDesc::EpilogueTile, Element,
                                       cutlass::FloatRoundStyle::round_to_nearest, typename StoreDesc::Stride,
                                       typename StoreDesc::SmemLayoutAtom, typename StoreDesc::CopyOpR2S>;
template <template <class> class Fn>
using Compute = fusion::Sm90Compute<Fn, float, float, cutlass::FloatRoundStyle::round_to_nearest>;

// Nodes in topological order: 0 g, 1 z, 2 up, 3 up grad, 4 its store, 5 activation, 6 its store,
// 7 gate grad, 8 the output (the gate grad, after both stores).
using Edges = cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<0, 1>, cute::seq<3>, cute::seq<1, 2>,
                          cute::seq<5>, cute::seq<0, 1, 2>, cute::seq<7, 4, 6>>;
using Epilogue = fusion::Sm90TopologicalVisitor<float, Edges, fusion::Sm90AccFetch, RowsLoad, RowsLoad,
                                                Compute<UpGrad>, RowsStore, Compute<Activated>, RowsStore,
                                                Compute<GateGrad>, Compute<FirstOf>>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, 8, Element, RowMajor, 8,
    EpilogueSchedule, Epilogue>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, RowMajor, 8, Element, RowMajor, 8, float, TileShape,
    ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

}  // namespace batched_experiment

extern "C" {

size_t batched_workspace_bytes(int m, int n, int k, int experts, int sms) {
  using namespace batched_experiment;
  typename Gemm::Arguments arguments;
  arguments.mode = cutlass::gemm::GemmUniversalMode::kBatched;
  arguments.problem_shape = {m, n, k, experts};
  arguments.hw_info.sm_count = sms;
  return Gemm::get_workspace_size(arguments);
}

// dy [E M, K]; w2 [E, K, N]; pre [E M, 2N]; out [E M, 2N]; act [E M, N]; all bf16, row-major.
int batched_bwd_gemm1_gated(void const* dy, void const* w2, void const* pre, void* out, void* act, int m, int n,
                            int k, int experts, int sms, void* workspace, cudaStream_t stream) {
  using namespace batched_experiment;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;
  using StrideRows = typename LoadDesc::Stride;
  StrideA stride_a{};
  get<0>(stride_a) = int64_t(k);
  get<2>(stride_a) = int64_t(m) * k;
  StrideB stride_b{};
  get<1>(stride_b) = int64_t(n);
  get<2>(stride_b) = int64_t(n) * k;
  StrideD stride_d{};
  get<0>(stride_d) = int64_t(2 * n);
  get<2>(stride_d) = int64_t(m) * 2 * n;
  StrideRows wide{};  // a column half of a [E M, 2N] tensor
  get<0>(wide) = int64_t(2 * n);
  get<2>(wide) = int64_t(m) * 2 * n;
  typename StoreDesc::Stride narrow{};  // a [E M, N] tensor
  get<0>(narrow) = int64_t(n);
  get<2>(narrow) = int64_t(m) * n;
  Element const* pre_rows = static_cast<Element const*>(pre);
  Element* out_rows = static_cast<Element*>(out);

  typename Gemm::Arguments arguments;
  arguments.mode = cutlass::gemm::GemmUniversalMode::kBatched;
  arguments.problem_shape = {m, n, k, experts};
  arguments.mainloop = {static_cast<Element const*>(dy), stride_a, static_cast<Element const*>(w2), stride_b};
  arguments.epilogue.ptr_C = nullptr;
  arguments.epilogue.ptr_D = out_rows;
  arguments.epilogue.dD = stride_d;
  arguments.epilogue.thread = {
      {},                                    // 0 g
      {pre_rows, Element(0), wide},          // 1 z
      {pre_rows + n, Element(0), wide},      // 2 up
      {},                                    // 3 up grad
      {out_rows + n, wide},                  // 4 its store
      {},                                    // 5 activation
      {static_cast<Element*>(act), narrow},  // 6 its store
      {},                                    // 7 gate grad
      {}};                                   // 8 output
  arguments.hw_info.sm_count = sms;
  Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(arguments, workspace, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}

}  // extern "C"
