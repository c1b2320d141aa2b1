// Torch binding of the ds_comet kernels: checks arguments, passes raw pointers and the tensors'
// GPU's current CUDA stream to the launchers comet.h declares.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "comet.h"

namespace {

using ds_comet::GroupShape;

void check_cuda(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

// The kernels move rows as 16-byte vectors; a view that starts mid-vector would fault on the device.
void check_aligned(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                " must start on a 16-byte boundary (a view at an odd offset does not; pass a copy)");
}

void check_launch(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, "ds_comet ", what, " launch failed: ", cudaGetErrorString(err));
}

// Each call's tensors live on one GPU, and the binding launches there, on that GPU's current stream,
// whatever device is current: without the guard a kernel would run on the current device and read
// another GPU's memory through its pointers. Empty tensors ("none") are never read, so they may be
// anywhere. Returns the GPU of the first tensor that is not empty (the first one's, if all are).
c10::Device one_device(const char* what, std::initializer_list<std::reference_wrapper<const torch::Tensor>> tensors) {
    c10::Device device = tensors.begin()->get().device();
    for (const torch::Tensor& t : tensors) {
        if (t.numel() > 0) {
            device = t.device();
            break;
        }
    }
    for (const torch::Tensor& t : tensors) {
        TORCH_CHECK(t.numel() == 0 || t.device() == device, "ds_comet ", what, ": every tensor must be on ", device,
                    ", got one on ", t.device());
    }
    return device;
}

int64_t* as_record(int64_t address) { return reinterpret_cast<int64_t*>(address); }

// One workspace's tensors, which every exchange, dispatch and combine of its group takes
// (ds_comet/kernels/workspace.py builds it once, with the workspace): each symmetric part's table
// of peer addresses, this rank's parts and arrays that the kernels address directly (comet.h says
// what each holds), and the error record. Checked once, when it is built.
struct Workspace {
    // [P] int64 on the GPU each: every rank's address of the part.
    torch::Tensor peer_recv, peer_origin, peer_stage, peer_stage_routes, peer_stage_scale, peer_reduced, peer_row_dot,
        peer_meta;
    // This rank's parts that the kernels address directly, not through a peer table.
    torch::Tensor meta, row_dot, stage_routes, stage_scale;
    // This rank's arrays that no peer reads (not symmetric), rewritten every call.
    torch::Tensor layout, route_row, route_stage;
    // The address of the error record (kErrorRecordWords int64 words of pinned host memory).
    int64_t error_record = 0;
};

// Each tensor of a Workspace: its name (the constructor's keyword), its dtype, and whether it is a
// peer table (one entry per rank).
struct WorkspaceTensor {
    const char* name;
    torch::Tensor Workspace::* member;
    at::ScalarType dtype;
    bool peer_table;
};

const WorkspaceTensor kWorkspaceTensors[] = {
    {"peer_recv", &Workspace::peer_recv, at::kLong, true},
    {"peer_origin", &Workspace::peer_origin, at::kLong, true},
    {"peer_stage", &Workspace::peer_stage, at::kLong, true},
    {"peer_stage_routes", &Workspace::peer_stage_routes, at::kLong, true},
    {"peer_stage_scale", &Workspace::peer_stage_scale, at::kLong, true},
    {"peer_reduced", &Workspace::peer_reduced, at::kLong, true},
    {"peer_row_dot", &Workspace::peer_row_dot, at::kLong, true},
    {"peer_meta", &Workspace::peer_meta, at::kLong, true},
    {"meta", &Workspace::meta, at::kInt, false},
    {"row_dot", &Workspace::row_dot, at::kFloat, false},
    {"stage_routes", &Workspace::stage_routes, at::kLong, false},
    {"stage_scale", &Workspace::stage_scale, at::kFloat, false},
    {"layout", &Workspace::layout, at::kInt, false},
    {"route_row", &Workspace::route_row, at::kLong, false},
    {"route_stage", &Workspace::route_stage, at::kInt, false},
};

// A Workspace from keywords: every tensor of kWorkspaceTensors, all on one GPU, and error_record.
Workspace workspace_of(const py::kwargs& given) {
    for (const auto& item : given) {
        const std::string name = py::str(item.first);
        const bool known =
            name == "error_record" || std::any_of(std::begin(kWorkspaceTensors), std::end(kWorkspaceTensors),
                                                  [&](const WorkspaceTensor& t) { return name == t.name; });
        TORCH_CHECK(known, "Workspace has no ", name);
    }
    Workspace workspace;
    TORCH_CHECK(given.contains("error_record"), "Workspace needs error_record");
    workspace.error_record = given["error_record"].cast<int64_t>();
    for (const WorkspaceTensor& t : kWorkspaceTensors) {
        TORCH_CHECK(given.contains(t.name), "Workspace needs ", t.name);
        workspace.*t.member = given[t.name].cast<torch::Tensor>();
        check_cuda(workspace.*t.member, t.name, t.dtype);
    }
    const int64_t ranks = workspace.peer_meta.numel();
    const c10::Device device = workspace.layout.device();
    TORCH_CHECK(ranks > 0, "Workspace: the peer tables must have an entry per rank");
    for (const WorkspaceTensor& t : kWorkspaceTensors) {
        const torch::Tensor& tensor = workspace.*t.member;
        TORCH_CHECK(tensor.device() == device, "Workspace: every tensor must be on ", device, ", got ", t.name, " on ",
                    tensor.device());
        TORCH_CHECK(!t.peer_table || tensor.numel() == ranks, "Workspace: ", t.name, " has ", tensor.numel(),
                    " entries, peer_meta ", ranks, ": every peer table has one per rank");
    }
    TORCH_CHECK(workspace.stage_routes.numel() == workspace.stage_scale.numel(),
                "Workspace: stage_routes and stage_scale must have an entry per staged route each");
    TORCH_CHECK(workspace.route_row.numel() == workspace.route_stage.numel(),
                "Workspace: route_row and route_stage must have an entry per route each");
    return workspace;
}

// The workspace with a recv table of the caller's ([P] int64 on its GPU): a rank alone in its group
// dispatches into a tensor of its own.
Workspace with_peer_recv(const Workspace& workspace, const torch::Tensor& peer_recv) {
    check_cuda(peer_recv, "peer_recv", at::kLong);
    TORCH_CHECK(peer_recv.numel() == workspace.peer_recv.numel() && peer_recv.device() == workspace.layout.device(),
                "peer_recv must have an entry per rank, on the workspace's GPU (", workspace.layout.device(), ")");
    Workspace replaced = workspace;
    replaced.peer_recv = peer_recv;
    return replaced;
}

// The kernels index every peer table by rank: it must have the group's P entries.
void check_group(const GroupShape& shape, const Workspace& workspace) {
    TORCH_CHECK(workspace.peer_meta.numel() == shape.ep_size, "the workspace's peer tables have ",
                workspace.peer_meta.numel(), " entries, but the group has ", shape.ep_size, " ranks");
}

void exchange(const GroupShape& shape, const Workspace& workspace, const torch::Tensor& expert_counts,
              const torch::Tensor& rank_counts, const std::vector<int64_t>& header) {
    check_cuda(expert_counts, "expert_counts", at::kLong);
    check_cuda(rank_counts, "rank_counts", at::kLong);
    TORCH_CHECK(rank_counts.numel() == shape.ep_size, "rank_counts must have ep_size entries");
    TORCH_CHECK(expert_counts.numel() == shape.num_experts, "expert_counts must have num_experts entries");
    check_group(shape, workspace);
    TORCH_CHECK(header.size() == ds_comet::kHeaderWords, "header must have ", ds_comet::kHeaderWords, " words");
    ds_comet::ExchangeHeader words{};
    for (size_t w = 0; w < header.size(); ++w) {
        TORCH_CHECK(header[w] >= 0 && header[w] <= INT32_MAX, "header words must lie in [0, 2**31)");
        words.words[w] = static_cast<int32_t>(header[w]);
    }
    const c10::cuda::CUDAGuard device_guard(one_device("exchange", {expert_counts, rank_counts, workspace.layout}));
    check_launch(
        ds_comet::launch_exchange(shape, words, expert_counts.data_ptr<int64_t>(), rank_counts.data_ptr<int64_t>(),
                                  workspace.meta.data_ptr<int32_t>(), workspace.peer_meta.data_ptr<int64_t>(),
                                  workspace.layout.data_ptr<int32_t>(), as_record(workspace.error_record),
                                  at::cuda::getCurrentCUDAStream()),
        "exchange");
}

void plan(const torch::Tensor& indices, int64_t num_experts, torch::Tensor& route_order, torch::Tensor& route_position,
          torch::Tensor& expert_counts) {
    check_cuda(indices, "indices", at::kInt);
    check_cuda(route_order, "route_order", at::kLong);
    check_cuda(route_position, "route_position", at::kLong);
    check_cuda(expert_counts, "expert_counts", at::kLong);
    TORCH_CHECK(route_order.numel() == indices.numel() && route_position.numel() == indices.numel(),
                "route_order and route_position must have one entry per route");
    TORCH_CHECK(expert_counts.numel() == num_experts, "expert_counts must have num_experts entries");
    const c10::cuda::CUDAGuard device_guard(one_device("plan", {indices, route_order, route_position, expert_counts}));
    check_launch(ds_comet::launch_plan(indices.data_ptr<int32_t>(), indices.numel(), static_cast<int>(num_experts),
                                       route_order.data_ptr<int64_t>(), route_position.data_ptr<int64_t>(),
                                       expert_counts.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()),
                 "plan");
}

void rank_tokens(const torch::Tensor& indices, int64_t top_k, int64_t num_experts, int64_t ep_size,
                 torch::Tensor& tokens_of_rank, torch::Tensor& rank_counts) {
    check_cuda(indices, "indices", at::kInt);
    check_cuda(tokens_of_rank, "rank_tokens", at::kInt);
    check_cuda(rank_counts, "rank_counts", at::kLong);
    TORCH_CHECK(top_k > 0 && indices.numel() % top_k == 0, "indices must hold top_k routes per token");
    TORCH_CHECK(ep_size > 0 && num_experts % ep_size == 0, "num_experts must be a multiple of ep_size");
    TORCH_CHECK(tokens_of_rank.numel() == ep_size * (indices.numel() / top_k), "rank_tokens must be [ep_size, tokens]");
    TORCH_CHECK(rank_counts.numel() == ep_size, "rank_counts must have ep_size entries");
    const c10::cuda::CUDAGuard device_guard(one_device("rank_tokens", {indices, tokens_of_rank, rank_counts}));
    check_launch(ds_comet::launch_rank_tokens(indices.data_ptr<int32_t>(), indices.numel() / top_k,
                                              static_cast<int>(top_k), static_cast<int>(num_experts),
                                              static_cast<int>(ep_size), tokens_of_rank.data_ptr<int32_t>(),
                                              rank_counts.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()),
                 "rank_tokens");
}

void check_sizes(const torch::Tensor& t, const char* name, at::IntArrayRef sizes) {
    TORCH_CHECK(t.sizes() == sizes, name, " must be ", sizes, ", got ", t.sizes());
}

void top2_routes(const torch::Tensor& gates, const torch::Tensor& logits, const torch::Tensor& uniform,
                 int64_t capacity, torch::Tensor& routes, torch::Tensor& masks, torch::Tensor& expert_counts) {
    check_cuda(gates, "gates", at::kFloat);
    TORCH_CHECK(gates.dim() == 2, "gates must be [tokens, experts]");
    const int64_t num_tokens = gates.size(0), num_experts = gates.size(1);
    // Autocast makes the logits bf16 or fp16; the kernel rounds their noisy sum as stock does.
    TORCH_CHECK(logits.is_cuda() && logits.is_contiguous(), "logits must be a contiguous CUDA tensor");
    const at::ScalarType logits_type = logits.scalar_type();
    TORCH_CHECK(logits_type == at::kFloat || logits_type == at::kBFloat16 || logits_type == at::kHalf,
                "logits must be fp32, bf16 or fp16, got ", logits_type);
    const int logits_code = logits_type == at::kBFloat16 ? 0 : logits_type == at::kHalf ? 1 : 2;
    check_sizes(logits, "logits", gates.sizes());
    if (uniform.numel() > 0) {
        check_cuda(uniform, "uniform", at::kFloat);
        check_sizes(uniform, "uniform", gates.sizes());
    }
    check_cuda(routes, "routes", at::kInt);
    check_sizes(routes, "routes", {2, num_tokens});
    check_cuda(masks, "masks", at::kFloat);
    check_sizes(masks, "masks", {capacity >= 0 ? 3 : 2, num_tokens, num_experts});
    check_cuda(expert_counts, "expert_counts", at::kLong);
    check_sizes(expert_counts, "expert_counts", {num_experts});
    TORCH_CHECK(num_experts >= 2 && num_tokens < (int64_t{1} << 31),
                "top-2 needs at least 2 experts and < 2^31 tokens");
    const c10::cuda::CUDAGuard device_guard(
        one_device("top2_routes", {gates, logits, uniform, routes, masks, expert_counts}));
    auto choices = torch::empty({2, num_tokens}, routes.options());
    check_launch(ds_comet::launch_top2_routes(gates.data_ptr<float>(), logits.data_ptr(), logits_code,
                                              uniform.numel() > 0 ? uniform.data_ptr<float>() : nullptr, num_tokens,
                                              static_cast<int>(num_experts), capacity, choices.data_ptr<int32_t>(),
                                              routes.data_ptr<int32_t>(), masks.data_ptr<float>(),
                                              expert_counts.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()),
                 "top2_routes");
}

void gumbel_noise(const torch::Tensor& uniform, torch::Tensor& noise) {
    check_cuda(uniform, "uniform", at::kFloat);
    check_cuda(noise, "noise", at::kFloat);
    check_sizes(noise, "noise", uniform.sizes());
    const c10::cuda::CUDAGuard device_guard(one_device("gumbel_noise", {uniform, noise}));
    check_launch(ds_comet::launch_gumbel_noise(uniform.data_ptr<float>(), uniform.numel(), noise.data_ptr<float>(),
                                               at::cuda::getCurrentCUDAStream()),
                 "gumbel_noise");
}

void topk_masks(const torch::Tensor& top_idx, const torch::Tensor& top_gate, bool drop, torch::Tensor& mask,
                torch::Tensor& kept, torch::Tensor& ranked, torch::Tensor& indices, torch::Tensor& expert_counts) {
    check_cuda(top_idx, "top_idx", at::kLong);
    TORCH_CHECK(top_idx.dim() == 2, "top_idx must be [tokens, k]");
    const int64_t num_tokens = top_idx.size(0), top_k = top_idx.size(1);
    check_cuda(top_gate, "top_gate", at::kFloat);
    check_sizes(top_gate, "top_gate", top_idx.sizes());
    check_cuda(mask, "mask", at::kFloat);
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == num_tokens, "mask must be [tokens, experts]");
    const int64_t num_experts = mask.size(1);
    if (drop) {
        check_cuda(kept, "kept", at::kFloat);
        check_sizes(kept, "kept", mask.sizes());
        check_cuda(ranked, "ranked", at::kFloat);
        check_sizes(ranked, "ranked", mask.sizes());
    }
    check_cuda(indices, "indices", at::kInt);
    check_sizes(indices, "indices", {top_k, num_tokens});
    check_cuda(expert_counts, "expert_counts", at::kLong);
    check_sizes(expert_counts, "expert_counts", {num_experts});
    TORCH_CHECK(top_k <= num_experts, "k must not exceed the number of experts");
    const c10::cuda::CUDAGuard device_guard(
        one_device("topk_masks", {top_idx, top_gate, mask, kept, ranked, indices, expert_counts}));
    check_launch(ds_comet::launch_topk_masks(top_idx.data_ptr<int64_t>(), top_gate.data_ptr<float>(), num_tokens,
                                             static_cast<int>(top_k), static_cast<int>(num_experts), drop,
                                             mask.data_ptr<float>(), drop ? kept.data_ptr<float>() : nullptr,
                                             drop ? ranked.data_ptr<float>() : nullptr, indices.data_ptr<int32_t>(),
                                             expert_counts.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()),
                 "topk_masks");
}

void topk_keep(const torch::Tensor& capacity_idx, const torch::Tensor& top_idx, const torch::Tensor& mask,
               torch::Tensor& kept, torch::Tensor& indices) {
    check_cuda(top_idx, "top_idx", at::kLong);
    check_cuda(mask, "mask", at::kFloat);
    TORCH_CHECK(top_idx.dim() == 2 && mask.dim() == 2 && mask.size(0) == top_idx.size(0),
                "top_idx must be [tokens, k] and mask [tokens, experts]");
    const int64_t num_tokens = top_idx.size(0), top_k = top_idx.size(1), num_experts = mask.size(1);
    check_cuda(capacity_idx, "capacity_idx", at::kLong);
    TORCH_CHECK(capacity_idx.dim() == 2 && capacity_idx.size(1) == num_experts, "capacity_idx must be [C, experts]");
    check_cuda(kept, "kept", at::kFloat);
    check_sizes(kept, "kept", mask.sizes());
    check_cuda(indices, "indices", at::kInt);
    check_sizes(indices, "indices", {top_k, num_tokens});
    const c10::cuda::CUDAGuard device_guard(one_device("topk_keep", {capacity_idx, top_idx, mask, kept, indices}));
    check_launch(ds_comet::launch_topk_keep(
                     capacity_idx.data_ptr<int64_t>(), capacity_idx.numel(), top_idx.data_ptr<int64_t>(), num_tokens,
                     static_cast<int>(top_k), static_cast<int>(num_experts), mask.data_ptr<float>(),
                     kept.data_ptr<float>(), indices.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream()),
                 "topk_keep");
}

int dtype_code_of(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, name, " must be bf16 or fp16, got ",
                t.scalar_type());
    return t.scalar_type() == at::kBFloat16 ? 0 : 1;
}

// An empty fp32 tensor stands for "no per-route weights".
const float* optional_weights(const torch::Tensor& t, const char* name, int64_t routes) {
    if (t.numel() == 0) return nullptr;
    check_cuda(t, name, at::kFloat);
    TORCH_CHECK(t.numel() == routes, name, " must have one entry per route (", routes, "), got ", t.numel());
    return t.data_ptr<float>();
}

// The forward's expert outputs the backward's dispatch takes its dot products with: [rows, hidden]
// in the rows' dtype (bf16 for packed FP8 rows), or empty for none; the workspace's row_dot then has
// a float per row.
const void* optional_outputs(const torch::Tensor& outputs, const torch::Tensor& row_dot, at::ScalarType dtype,
                             int64_t hidden) {
    if (outputs.numel() == 0) return nullptr;
    check_cuda(outputs, "outputs", dtype);
    TORCH_CHECK(outputs.dim() == 2 && outputs.size(1) == hidden, "outputs must be [rows, hidden]");
    check_aligned(outputs, "outputs");
    TORCH_CHECK(row_dot.numel() >= outputs.size(0), "the workspace's row_dot must have an entry per row of outputs");
    return outputs.data_ptr();
}

// The values a packed FP8 row of row_bytes bytes holds (ds_comet/kernels/fp8_rows.py's
// packed_row_bytes: the values, a byte each, then a fp32 scale per 128-value tile, padded to 16 bytes).
int64_t packed_row_values(int64_t row_bytes) {
    const int64_t tile = ds_comet::kFp8TileElements;
    for (int64_t hidden = tile; hidden < row_bytes; hidden += tile) {
        const int64_t scale_bytes = hidden / tile * static_cast<int64_t>(sizeof(float));
        if (hidden + (scale_bytes + 15) / 16 * 16 == row_bytes) return hidden;
    }
    TORCH_CHECK(false, "packed FP8 rows of ", row_bytes, " bytes hold no whole number of ", tile, "-value tiles");
}

void dispatch(const GroupShape& shape, const Workspace& workspace, const torch::Tensor& tokens,
              const torch::Tensor& route_order, const torch::Tensor& route_position, const torch::Tensor& rank_tokens,
              const torch::Tensor& rank_counts, const torch::Tensor& route_scale, bool scaled,
              const torch::Tensor& outputs, const std::string& packed_format, int64_t top_k, int64_t blocks) {
    TORCH_CHECK(tokens.is_cuda() && tokens.is_contiguous() && tokens.dim() == 2,
                "tokens must be a contiguous 2-D CUDA tensor");
    // uint8 tokens are packed FP8 rows (ds_comet/kernels/fp8_rows.py) whose values are in packed_format.
    const bool packed = tokens.scalar_type() == at::kByte;
    TORCH_CHECK(packed == !packed_format.empty(),
                "packed_format names the values' format of packed FP8 rows (uint8 tokens), and only theirs");
    TORCH_CHECK(!packed || packed_format == "e4m3" || packed_format == "e5m2",
                "packed_format must be \"e4m3\" or \"e5m2\", got \"", packed_format, "\"");
    const int dtype_code = !packed                   ? dtype_code_of(tokens, "tokens")
                           : packed_format == "e4m3" ? ds_comet::kPackedE4m3Code
                                                     : ds_comet::kPackedE5m2Code;
    TORCH_CHECK(tokens.size(1) * tokens.element_size() % 16 == 0, "a token row must be a multiple of 16 bytes");
    const int64_t hidden = packed ? packed_row_values(tokens.size(1)) : tokens.size(1);
    check_aligned(tokens, "tokens");
    check_cuda(route_order, "route_order", at::kLong);
    check_cuda(route_position, "route_position", at::kLong);
    check_cuda(rank_tokens, "rank_tokens", at::kInt);
    check_cuda(rank_counts, "rank_counts", at::kLong);
    check_group(shape, workspace);
    TORCH_CHECK(
        workspace.route_row.numel() >= route_order.numel() && workspace.route_stage.numel() >= route_order.numel(),
        "the workspace's route_row and route_stage must have an entry per route");
    TORCH_CHECK(route_position.numel() == route_order.numel(), "route_position must have an entry per route");
    // top_k is also the stride of every rank's stage_routes, so it is passed in: a rank with no
    // tokens (which still receives staged rows) could not infer it from its routes.
    TORCH_CHECK(top_k > 0 && route_order.numel() == top_k * tokens.size(0),
                "route_order must hold top_k routes per token");
    TORCH_CHECK(rank_tokens.numel() == shape.ep_size * tokens.size(0), "rank_tokens must be [ep_size, tokens]");
    TORCH_CHECK(rank_counts.numel() == shape.ep_size, "rank_counts must have ep_size entries");
    // Whether rows are scaled must not depend on this rank's routes: with none, it has no scales,
    // yet unstages its peers' scaled rows.
    const float* scale = optional_weights(route_scale, "route_scale", route_order.numel());
    TORCH_CHECK(!scaled || scale != nullptr || route_order.numel() == 0, "scaled rows need a route_scale");
    const void* kept_outputs =
        optional_outputs(outputs, workspace.row_dot, packed ? at::kBFloat16 : tokens.scalar_type(), hidden);
    const c10::cuda::CUDAGuard device_guard(one_device(
        "dispatch",
        {tokens, route_order, route_position, rank_tokens, rank_counts, route_scale, outputs, workspace.layout}));
    ds_comet::DispatchTables tables{route_order.data_ptr<int64_t>(),
                                    route_position.data_ptr<int64_t>(),
                                    rank_tokens.data_ptr<int32_t>(),
                                    rank_counts.data_ptr<int64_t>(),
                                    workspace.peer_recv.data_ptr<int64_t>(),
                                    workspace.peer_origin.data_ptr<int64_t>(),
                                    workspace.peer_stage.data_ptr<int64_t>(),
                                    workspace.peer_stage_routes.data_ptr<int64_t>(),
                                    workspace.peer_stage_scale.data_ptr<int64_t>(),
                                    workspace.peer_meta.data_ptr<int64_t>(),
                                    workspace.route_stage.data_ptr<int32_t>(),
                                    kept_outputs,
                                    kept_outputs == nullptr ? nullptr : workspace.row_dot.data_ptr<float>()};
    check_launch(ds_comet::launch_dispatch(shape, tokens.data_ptr(), tokens.size(0),
                                           tokens.size(1) * tokens.element_size(), hidden, static_cast<int>(top_k),
                                           dtype_code, scaled, scale, workspace.layout.data_ptr<int32_t>(), tables,
                                           workspace.route_row.data_ptr<int64_t>(), as_record(workspace.error_record),
                                           static_cast<int>(blocks), at::cuda::getCurrentCUDAStream()),
                 "dispatch");
}

void combine(const GroupShape& shape, const Workspace& workspace, const torch::Tensor& expert_out,
             const torch::Tensor& route_position, bool weighted, const torch::Tensor& gates, torch::Tensor& out,
             torch::Tensor& route_grad, int64_t top_k, int64_t chunk_cols, int64_t tile_n, int64_t num_chunks,
             int64_t blocks) {
    TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() == 2, "out must be a contiguous 2-D CUDA tensor");
    const int dtype_code = dtype_code_of(out, "out");
    check_aligned(out, "out");
    // GEMM2's rows of this call; a rank that received none may pass an empty tensor.
    TORCH_CHECK(expert_out.is_cuda() && expert_out.is_contiguous() && expert_out.dim() == 2 &&
                    expert_out.scalar_type() == out.scalar_type() && expert_out.size(1) == out.size(1),
                "expert_out must be a contiguous 2-D CUDA tensor of out's dtype and width");
    check_aligned(expert_out, "expert_out");
    check_group(shape, workspace);
    check_cuda(route_position, "route_position", at::kLong);
    TORCH_CHECK(out.size(0) == 0 ? route_position.numel() == 0 : route_position.numel() % out.size(0) == 0,
                "route_position must hold k routes per token");
    TORCH_CHECK(workspace.route_row.numel() >= route_position.numel() &&
                    workspace.route_stage.numel() >= route_position.numel(),
                "the workspace's route_row and route_stage must have an entry per route");
    // The kernel keeps tokens and send positions in int32, as the layout keeps its counts.
    TORCH_CHECK(std::max(out.size(0), route_position.numel()) < (int64_t{1} << 31),
                "at most 2^31 - 1 tokens and routes per call");
    // top_k is also the stride of stage_routes, so it is passed in: a rank with no tokens (which
    // still reduces the rows its peers staged here) could not infer it from its routes.
    TORCH_CHECK(top_k > 0 && route_position.numel() == top_k * out.size(0),
                "route_position must hold top_k routes per token");
    TORCH_CHECK(top_k <= ds_comet::kMaxCombineTopK, "the fused combine takes at most ", ds_comet::kMaxCombineTopK,
                " routes per token, got ", top_k);
    TORCH_CHECK(workspace.stage_routes.numel() % top_k == 0,
                "the workspace's stage_routes and stage_scale must have top_k entries per staged row");
    // Whether routes are weighted must not depend on this rank's routes: with none, it has no gates,
    // yet sums its peers' staged routes with theirs.
    const float* weights = optional_weights(gates, "gates", route_position.numel());
    TORCH_CHECK(!weighted || weights != nullptr || route_position.numel() == 0, "weighted sums need gates");
    TORCH_CHECK(weighted || gates.numel() == 0, "gates are given, but weighted is false");
    float* grads = nullptr;
    if (route_grad.numel() != 0) {
        check_cuda(route_grad, "route_grad", at::kFloat);
        TORCH_CHECK(route_grad.numel() == route_position.numel(), "route_grad must have one entry per route");
        grads = route_grad.data_ptr<float>();
    }
    TORCH_CHECK(out.size(1) % 8 == 0 && chunk_cols % 8 == 0, "hidden size and chunk width must be multiples of 8");
    const c10::cuda::CUDAGuard device_guard(
        one_device("combine", {out, expert_out, route_position, gates, route_grad, workspace.layout}));
    ds_comet::CombineTables tables{expert_out.data_ptr(),
                                   workspace.peer_reduced.data_ptr<int64_t>(),
                                   workspace.peer_row_dot.data_ptr<int64_t>(),
                                   workspace.peer_meta.data_ptr<int64_t>(),
                                   workspace.route_row.data_ptr<int64_t>(),
                                   workspace.route_stage.data_ptr<int32_t>(),
                                   route_position.data_ptr<int64_t>(),
                                   workspace.stage_routes.data_ptr<int64_t>(),
                                   workspace.stage_scale.data_ptr<float>(),
                                   grads};
    check_launch(ds_comet::launch_combine(shape, tables, weighted, weights, out.data_ptr(), top_k, out.size(0),
                                          out.size(1), dtype_code, chunk_cols, tile_n, num_chunks,
                                          workspace.layout.data_ptr<int32_t>(), as_record(workspace.error_record),
                                          static_cast<int>(blocks), at::cuda::getCurrentCUDAStream()),
                 "combine");
}

// The constants of comet.h as compiled, by name, for the op loader to check against the header.
py::dict codes() {
    py::dict d;
#define DS_COMET_EXPORT_CONSTANT(name, value) d[#name] = ds_comet::k##name;
    DS_COMET_CONSTANTS(DS_COMET_EXPORT_CONSTANT)
#undef DS_COMET_EXPORT_CONSTANT
    return d;
}

// The kernels' shape and offsets (comet.h), which ds_comet/kernels/workspace.py fills once a workspace.
void bind_group_shape(py::module_& m) {
    py::class_<GroupShape>(m, "GroupShape")
        .def(py::init<>())
        .def_readwrite("rank", &GroupShape::rank)
        .def_readwrite("ep_size", &GroupShape::ep_size)
        .def_readwrite("num_experts", &GroupShape::num_experts)
        .def_readwrite("tile_m", &GroupShape::tile_m)
        .def_readwrite("max_recv_rows", &GroupShape::max_recv_rows)
        .def_readwrite("max_tiles", &GroupShape::max_tiles)
        .def_readwrite("max_chunks", &GroupShape::max_chunks)
        .def_readwrite("max_stage_pieces", &GroupShape::max_stage_pieces)
        .def_readwrite("timeout_ns", &GroupShape::timeout_ns)
        .def_readwrite("meta", &GroupShape::meta)
        .def_readwrite("layout", &GroupShape::layout);
    py::class_<ds_comet::MetaOffsets>(m, "MetaOffsets")
        .def(py::init<>())
        .def_readwrite("counts", &ds_comet::MetaOffsets::counts)
        .def_readwrite("exchange_flag", &ds_comet::MetaOffsets::exchange_flag)
        .def_readwrite("tile_counter", &ds_comet::MetaOffsets::tile_counter)
        .def_readwrite("chunk_counter", &ds_comet::MetaOffsets::chunk_counter)
        .def_readwrite("stage_counter", &ds_comet::MetaOffsets::stage_counter)
        .def_readwrite("reduce_counter", &ds_comet::MetaOffsets::reduce_counter)
        .def_readwrite("generation", &ds_comet::MetaOffsets::generation)
        .def_readwrite("header", &ds_comet::MetaOffsets::header);
    py::class_<ds_comet::LayoutOffsets>(m, "LayoutOffsets")
        .def(py::init<>())
        .def_readwrite("expert_start", &ds_comet::LayoutOffsets::expert_start)
        .def_readwrite("tile_start", &ds_comet::LayoutOffsets::tile_start)
        .def_readwrite("local_tiles", &ds_comet::LayoutOffsets::local_tiles)
        .def_readwrite("remote_tiles", &ds_comet::LayoutOffsets::remote_tiles)
        .def_readwrite("send_offset", &ds_comet::LayoutOffsets::send_offset)
        .def_readwrite("dest_row", &ds_comet::LayoutOffsets::dest_row)
        .def_readwrite("dest_rel", &ds_comet::LayoutOffsets::dest_rel)
        .def_readwrite("dest_tile", &ds_comet::LayoutOffsets::dest_tile)
        .def_readwrite("send_order", &ds_comet::LayoutOffsets::send_order)
        .def_readwrite("piece_start", &ds_comet::LayoutOffsets::piece_start)
        .def_readwrite("stage_send", &ds_comet::LayoutOffsets::stage_send)
        .def_readwrite("stage_dest_row", &ds_comet::LayoutOffsets::stage_dest_row)
        .def_readwrite("stage_dest_piece", &ds_comet::LayoutOffsets::stage_dest_piece)
        .def_readwrite("stage_recv_row", &ds_comet::LayoutOffsets::stage_recv_row)
        .def_readwrite("stage_recv_piece", &ds_comet::LayoutOffsets::stage_recv_piece)
        .def_readwrite("totals", &ds_comet::LayoutOffsets::totals);
}

// The Workspace: built from keywords (workspace_of), its tensors readable by name.
void bind_workspace(py::module_& m) {
    py::class_<Workspace> workspace(m, "Workspace",
                                    "One workspace's peer tables, this rank's parts and arrays the kernels address, "
                                    "and its error record, as every exchange, dispatch and combine of its group takes "
                                    "them");
    workspace.def(py::init(&workspace_of), "Every tensor by name (the properties), and error_record (an address)");
    for (const WorkspaceTensor& t : kWorkspaceTensors) {
        workspace.def_property_readonly(t.name, [member = t.member](const Workspace& w) { return w.*member; });
    }
    workspace.def_readonly("error_record", &Workspace::error_record);
    workspace.def("with_peer_recv", &with_peer_recv, py::arg("peer_recv"),
                  "This workspace with the recv table replaced (a rank alone in its group, dispatching into a tensor "
                  "of its own)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    bind_group_shape(m);
    bind_workspace(m);
    m.def("codes", &codes, "The constants of comet.h as compiled, by name");
    m.def("plan", &plan,
          "The routing plan (route order by expert, its inverse, kept routes per expert) of the gate's indices",
          py::arg("indices"), py::arg("num_experts"), py::arg("route_order"), py::arg("route_position"),
          py::arg("expert_counts"));
    m.def("top2_routes", &top2_routes, "The top-2 gate's choices, capacity drop, one-hot masks and expert counts",
          py::arg("gates"), py::arg("logits"), py::arg("uniform"), py::arg("capacity"), py::arg("routes"),
          py::arg("masks"), py::arg("expert_counts"));
    m.def("gumbel_noise", &gumbel_noise, "The Gumbel noise top2_routes adds for each uniform draw (tests)",
          py::arg("uniform"), py::arg("noise"));
    m.def("topk_masks", &topk_masks, "The top-k gate's one-hot masks, expert counts and (dropping) ranked gates",
          py::arg("top_idx"), py::arg("top_gate"), py::arg("drop"), py::arg("mask"), py::arg("kept"), py::arg("ranked"),
          py::arg("indices"), py::arg("expert_counts"));
    m.def("topk_keep", &topk_keep, "The top-k gate's capacity drop from the capacity topk's token indices",
          py::arg("capacity_idx"), py::arg("top_idx"), py::arg("mask"), py::arg("kept"), py::arg("indices"));
    m.def("rank_tokens", &rank_tokens,
          "The tokens each rank of the group gets (those with a kept route to one of its experts), once a token, "
          "and their counts",
          py::arg("indices"), py::arg("top_k"), py::arg("num_experts"), py::arg("ep_size"), py::arg("rank_tokens"),
          py::arg("rank_counts"));
    m.def("exchange", &exchange, "Exchange expert counts with the group and compute the call's layout", py::kw_only(),
          py::arg("shape"), py::arg("workspace"), py::arg("expert_counts"), py::arg("rank_counts"), py::arg("header"));
    m.def("dispatch", &dispatch,
          "Put every kept route's token row (optionally scaled per route) in its destination's recv buffer, each "
          "token's row crossing to another rank once",
          py::kw_only(), py::arg("shape"), py::arg("workspace"), py::arg("tokens"), py::arg("route_order"),
          py::arg("route_position"), py::arg("rank_tokens"), py::arg("rank_counts"), py::arg("route_scale"),
          py::arg("scaled"), py::arg("outputs"), py::arg("packed_format"), py::arg("top_k"), py::arg("blocks"));
    m.def("combine", &combine,
          "Top-k sum of the routes' expert outputs (weighted by the gates when weighted is true), a token's routes "
          "on one rank summed there first, chunk by chunk; optionally each route's gate gradient",
          py::kw_only(), py::arg("shape"), py::arg("workspace"), py::arg("expert_out"), py::arg("route_position"),
          py::arg("weighted"), py::arg("gates"), py::arg("out"), py::arg("route_grad"), py::arg("top_k"),
          py::arg("chunk_cols"), py::arg("tile_n"), py::arg("num_chunks"), py::arg("blocks"));
}
