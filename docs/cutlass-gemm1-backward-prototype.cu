// Prototype (measured, not kept; docs/decisions.md): the fused backward's first GEMM for gated (SwiGLU)
// experts as a CUTLASS 4.2 sm90 ptr-array grouped GEMM, its epilogue a visitor tree with per-group row
// tensors read and written from registers. Build: nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a
// --expt-relaxed-constexpr -shared -Xcompiler -fPIC -I<nvidia-cutlass>/cutlass_library/source/include
// [-DTILE_M=128 -DTILE_N=128 -DPINGPONG=1]; run with the .py beside it (torchrun, one GPU, the .so paths).
//   per local expert l, rows [start_l, start_l+1) of dY ([R, H]):  g = dY_l @ W2_l   (W2_l: [H, F] row-major)
//   out[:, :F] = g * up * act'(z),  out[:, F:] = g * act(z),  h = act(z) * up     (z, up = pre[:, :F], pre[:, F:])
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using cutlass::Array;
namespace fusion = cutlass::epilogue::fusion;

namespace comet_proto {

using Element = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float silu_grad(float x) {
  float s = 1.f / (1.f + __expf(-x));
  return s * (1.f + x * (1.f - s));
}

// The rows of the epilogue's tile in a tensor that holds every group's rows one after another:
// group l's rows start at row group_start[l]; ld elements between rows.
template <class RowElement>
struct GroupRows {
  RowElement* base = nullptr;
  int64_t ld = 0;
  int32_t const* group_start = nullptr;
};

template <class RowElement, class TileCoordMNKL, class ProblemShapeMNKL>
CUTLASS_DEVICE auto group_rows_tensor(GroupRows<RowElement> const& rows, TileCoordMNKL tile_coord,
                                      ProblemShapeMNKL problem_shape) {
  auto [M, N, K, L] = problem_shape;
  int group = static_cast<int>(get<3>(tile_coord));
  RowElement* first = rows.base + int64_t(rows.group_start[group]) * rows.ld;
  return make_tensor(make_gmem_ptr(first), make_shape(M, N, Int<1>{}), make_stride(rows.ld, Int<1>{}, Int<0>{}));
}

// Loads the tile's elements of a GroupRows tensor into registers (no shared memory); visit returns them.
struct GroupRowsLoad {
  struct SharedStorage {};
  using Arguments = GroupRows<Element const>;
  using Params = Arguments;

  template <class P> static constexpr Params to_underlying_arguments(P const&, Arguments const& a, void*) { return a; }
  template <class P> static bool can_implement(P const&, Arguments const&) { return true; }
  template <class P> static size_t get_workspace_size(P const&, Arguments const&) { return 0; }
  template <class P>
  static cutlass::Status initialize_workspace(P const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GroupRowsLoad() {}
  CUTLASS_HOST_DEVICE GroupRowsLoad(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class GTensor, class RTensor, class CTensor, class Bound>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor&& g, RTensor&& r, CTensor&& c, Bound bound)
        : tC_g(cute::forward<GTensor>(g)), tC_r(cute::forward<RTensor>(r)), tC_c(cute::forward<CTensor>(c)),
          bound(bound) {}
    GTensor tC_g;
    RTensor tC_r;
    CTensor tC_c;
    Bound bound;

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      constexpr auto MCL = decltype(max_common_layout(tC_g(_, _, _, _0{}, _0{}), tC_r)){};
      constexpr int V = cute::min(8, size(MCL));
      Tensor g_vec = recast<Array<Element, V>>(coalesce(tC_g(_, _, _, epi_m, epi_n)));
      Tensor r_vec = recast<Array<Element, V>>(coalesce(tC_r));
      Tensor c_vec = tensor<1>(zipped_divide(coalesce(tC_c(_, _, _, epi_m, epi_n)), MCL.compose(Int<V>{})));
      Tensor p_vec = cute::lazy::transform(c_vec, [&](auto const& c) { return elem_less(c, bound); });
      fill(tC_r, Element(0));
      copy_if(p_vec, g_vec, r_vec);
    }

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE Array<Element, FragmentSize> visit(Array<ElementAccumulator, FragmentSize> const&, int epi_v, int,
                                                      int) {
      return recast<Array<Element, FragmentSize>>(tC_r)(epi_v);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    Tensor mRows = group_rows_tensor(*params_ptr, args.tile_coord_mnkl, args.problem_shape_mnkl);
    auto coord = make_coord(m, n, k, Int<0>{});
    Tensor tC_g = fusion::sm90_partition_for_epilogue<ReferenceSrc>(mRows, args.tile_shape_mnk, coord, args.epi_tile,
                                                                    args.tiled_copy, args.thread_idx);
    Tensor tC_r = make_tensor<Element>(take<0, 3>(shape(tC_g)));
    Tensor tC_c = fusion::sm90_partition_for_epilogue<ReferenceSrc>(make_identity_tensor(shape(mRows)),
                                                                    args.tile_shape_mnk, coord, args.epi_tile,
                                                                    args.tiled_copy, args.thread_idx);
    auto bound = make_shape(M, N, Int<1>{});
    return ConsumerStoreCallbacks<decltype(tC_g), decltype(tC_r), decltype(tC_c), decltype(bound)>(
        cute::move(tC_g), cute::move(tC_r), cute::move(tC_c), bound);
  }
};

// The root: from the product g (the accumulator), z and up (children 0 and 1), returns the gate's
// gradient (the epilogue stores it as D) and writes the up projection's gradient and the recomputed
// activation to two GroupRows tensors.
struct GatedGradOutputs {
  struct SharedStorage {};
  struct Arguments {
    GroupRows<Element> up_grad;
    GroupRows<Element> act;
  };
  using Params = Arguments;

  template <class P> static constexpr Params to_underlying_arguments(P const&, Arguments const& a, void*) { return a; }
  template <class P> static bool can_implement(P const&, Arguments const&) { return true; }
  template <class P> static size_t get_workspace_size(P const&, Arguments const&) { return 0; }
  template <class P>
  static cutlass::Status initialize_workspace(P const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GatedGradOutputs() {}
  CUTLASS_HOST_DEVICE GatedGradOutputs(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class GTensor, class RTensor, class CTensor, class Bound>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor&& g_up, RTensor&& r_up, GTensor&& g_act, RTensor&& r_act,
                                          CTensor&& c, Bound bound)
        : tC_g_up(cute::forward<GTensor>(g_up)), tC_r_up(cute::forward<RTensor>(r_up)),
          tC_g_act(cute::forward<GTensor>(g_act)), tC_r_act(cute::forward<RTensor>(r_act)),
          tC_c(cute::forward<CTensor>(c)), bound(bound) {}
    GTensor tC_g_up;
    RTensor tC_r_up;
    GTensor tC_g_act;
    RTensor tC_r_act;
    CTensor tC_c;
    Bound bound;

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE Array<float, FragmentSize> visit(Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int,
                                                    int, Array<Element, FragmentSize> const& z,
                                                    Array<Element, FragmentSize> const& up) {
      Array<float, FragmentSize> gate_grad;
      Array<Element, FragmentSize> up_grad, act;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        float zi = float(z[i]), ui = float(up[i]), gi = float(acc[i]);
        float s = silu(zi);
        gate_grad[i] = gi * ui * silu_grad(zi);
        up_grad[i] = Element(gi * s);
        act[i] = Element(s * ui);
      }
      recast<Array<Element, FragmentSize>>(coalesce(tC_r_up))(epi_v) = up_grad;
      recast<Array<Element, FragmentSize>>(coalesce(tC_r_act))(epi_v) = act;
      return gate_grad;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      store(tC_g_up, tC_r_up, epi_m, epi_n);
      store(tC_g_act, tC_r_act, epi_m, epi_n);
    }

    CUTLASS_DEVICE void store(GTensor& tC_g, RTensor& tC_r, int epi_m, int epi_n) {
      constexpr auto MCL = decltype(max_common_layout(tC_g(_, _, _, _0{}, _0{}), tC_r)){};
      constexpr int V = cute::min(8, size(MCL));
      Tensor g_vec = recast<Array<Element, V>>(coalesce(tC_g(_, _, _, epi_m, epi_n)));
      Tensor r_vec = recast<Array<Element, V>>(coalesce(tC_r));
      Tensor c_vec = tensor<1>(zipped_divide(coalesce(tC_c(_, _, _, epi_m, epi_n)), MCL.compose(Int<V>{})));
      Tensor p_vec = cute::lazy::transform(c_vec, [&](auto const& c) { return elem_less(c, bound); });
      copy_if(p_vec, r_vec, g_vec);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto coord = make_coord(m, n, k, Int<0>{});
    auto partition = [&](auto tensor) {
      return fusion::sm90_partition_for_epilogue<ReferenceSrc>(tensor, args.tile_shape_mnk, coord, args.epi_tile,
                                                               args.tiled_copy, args.thread_idx);
    };
    Tensor mUp = group_rows_tensor(params_ptr->up_grad, args.tile_coord_mnkl, args.problem_shape_mnkl);
    Tensor mAct = group_rows_tensor(params_ptr->act, args.tile_coord_mnkl, args.problem_shape_mnkl);
    Tensor tC_g_up = partition(mUp);
    Tensor tC_g_act = partition(mAct);
    Tensor tC_r_up = make_tensor<Element>(take<0, 3>(shape(tC_g_up)));
    Tensor tC_r_act = make_tensor<Element>(take<0, 3>(shape(tC_g_act)));
    Tensor tC_c = partition(make_identity_tensor(shape(mUp)));
    auto bound = make_shape(M, N, Int<1>{});
    return ConsumerStoreCallbacks<decltype(tC_g_up), decltype(tC_r_up), decltype(tC_c), decltype(bound)>(
        cute::move(tC_g_up), cute::move(tC_r_up), cute::move(tC_g_act), cute::move(tC_r_act), cute::move(tC_c),
        bound);
  }
};

using Epilogue = fusion::Sm90EVT<GatedGradOutputs, GroupRowsLoad, GroupRowsLoad>;

#ifndef TILE_M
#define TILE_M 128
#define TILE_N 256
#define PINGPONG 0
#endif
using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, _64>;
using ClusterShape = Shape<_1, _1, _1>;
#if PINGPONG
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
#else
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
#endif
using LayoutA = cutlass::layout::RowMajor;     // dY rows: [M, K=H], K contiguous
using LayoutB = cutlass::layout::RowMajor;     // W2_l: [K=H, N=F], N contiguous
using LayoutD = cutlass::layout::RowMajor;     // out[:, :F], ld 2F

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, 8, Element, LayoutD*, 8,
    EpilogueSchedule, Epilogue>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, 8, Element, LayoutB*, 8, float, TileShape,
    ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// The per-group arguments the grouped kernel reads from device memory.
struct GroupArgs {
  Shape3* shapes;
  Element const** a;
  Element const** b;
  Element** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
};

__global__ void fill_group_args(GroupArgs args, Element const* dy, int64_t const* w2_table, Element* out,
                                int32_t const* group_start, int groups, int n, int k) {
  int l = blockIdx.x * blockDim.x + threadIdx.x;
  if (l >= groups) return;
  int start = group_start[l];
  int rows = group_start[l + 1] - start;
  args.shapes[l] = Shape3{rows, n, k};
  args.a[l] = dy + int64_t(start) * k;
  args.b[l] = reinterpret_cast<Element const*>(w2_table[l]);
  args.d[l] = out + int64_t(start) * 2 * n;
  args.stride_a[l] = StrideA{int64_t(k), Int<1>{}, Int<0>{}};
  args.stride_b[l] = StrideB{Int<1>{}, int64_t(n), Int<0>{}};
  args.stride_d[l] = StrideD{int64_t(2 * n), Int<1>{}, Int<0>{}};
}

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

}  // namespace comet_proto

extern "C" {

// Bytes of device scratch the call needs for `groups` groups on `sms` SMs.
size_t proto_scratch_bytes(int groups, int sms) {
  using namespace comet_proto;
  size_t per_group = align_up(sizeof(Shape3) * groups) + 3 * align_up(sizeof(void*) * groups) +
                     align_up(sizeof(StrideA) * groups) + align_up(sizeof(StrideB) * groups) +
                     align_up(sizeof(StrideD) * groups);
  typename Gemm::Arguments arguments;
  arguments.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  arguments.problem_shape = {groups, nullptr, nullptr};
  arguments.hw_info.sm_count = sms;
  return per_group + align_up(Gemm::get_workspace_size(arguments));
}

int proto_bwd_gemm1_gated(void const* dy, int64_t const* w2_table, void const* pre, void* out, void* act,
                          int32_t const* group_start, int groups, int n, int k, int sms, void* scratch,
                          size_t scratch_bytes, cudaStream_t stream) {
  using namespace comet_proto;
  char* p = static_cast<char*>(scratch);
  GroupArgs ga;
  ga.shapes = reinterpret_cast<Shape3*>(p); p += align_up(sizeof(Shape3) * groups);
  ga.a = reinterpret_cast<Element const**>(p); p += align_up(sizeof(void*) * groups);
  ga.b = reinterpret_cast<Element const**>(p); p += align_up(sizeof(void*) * groups);
  ga.d = reinterpret_cast<Element**>(p); p += align_up(sizeof(void*) * groups);
  ga.stride_a = reinterpret_cast<StrideA*>(p); p += align_up(sizeof(StrideA) * groups);
  ga.stride_b = reinterpret_cast<StrideB*>(p); p += align_up(sizeof(StrideB) * groups);
  ga.stride_d = reinterpret_cast<StrideD*>(p); p += align_up(sizeof(StrideD) * groups);
  fill_group_args<<<(groups + 127) / 128, 128, 0, stream>>>(ga, static_cast<Element const*>(dy), w2_table,
                                                            static_cast<Element*>(out), group_start, groups, n, k);
  Element const* pre_rows = static_cast<Element const*>(pre);
  Element* out_rows = static_cast<Element*>(out);
  typename Gemm::Arguments arguments;
  arguments.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  arguments.problem_shape = {groups, ga.shapes, nullptr};
  arguments.mainloop = {ga.a, ga.stride_a, ga.b, ga.stride_b};
  arguments.epilogue.ptr_C = nullptr;
  arguments.epilogue.dC = nullptr;
  arguments.epilogue.ptr_D = ga.d;
  arguments.epilogue.dD = ga.stride_d;
  arguments.epilogue.thread = {
      {GroupRows<Element const>{pre_rows, 2 * int64_t(n), group_start}},
      {GroupRows<Element const>{pre_rows + n, 2 * int64_t(n), group_start}},
      {GroupRows<Element>{out_rows + n, 2 * int64_t(n), group_start},
       GroupRows<Element>{static_cast<Element*>(act), int64_t(n), group_start}}};
  arguments.hw_info.sm_count = sms;
  arguments.hw_info.device_id = 0;
  Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(arguments, p, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}

}  // extern "C"
