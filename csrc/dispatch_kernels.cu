// ds_comet dispatch: every kept route's token row to its destination's recv buffer. See comet.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "bounded_wait.cuh"
#include "comet.h"
#include "kernel_helpers.cuh"

namespace ds_comet {
namespace {

// The row type of packed FP8 rows whose values are in kFormat (e4m3 or e5m2): `hidden` value bytes,
// then the fp32 scales of their kFp8TileElements-element tiles, then padding to the row's bytes
// (ds_comet/kernels/fp8_rows.py). The dispatch's other row types are the element types bf16 and fp16.
template <__nv_fp8_interpretation_t kFormat>
struct PackedFp8 {
    static constexpr __nv_fp8_interpretation_t format = kFormat;
};
template <typename T>
struct IsPackedFp8 : std::false_type {};
template <__nv_fp8_interpretation_t kFormat>
struct IsPackedFp8<PackedFp8<kFormat>> : std::true_type {};

template <typename T>
__device__ __forceinline__ int4 scaled(int4 raw, float scale) {
    float values[8];
    Vec8<T>::to_float(raw, values);
#pragma unroll
    for (int i = 0; i < 8; ++i) values[i] *= scale;
    return Vec8<T>::from_float(values);
}

// Loads a 16-byte vector; FRESH: written by another GPU during this kernel, so read past L1, which
// does not see such stores.
template <bool FRESH>
__device__ __forceinline__ int4 load_vector(const int4* at) {
    return FRESH ? __ldcg(at) : *at;
}

// One warp copies `vectors` 16-byte vectors as they are, four loads in flight per lane (one at a
// time ran the backward's dispatch at a third of the forward's rate).
template <bool FRESH>
__device__ __forceinline__ void copy_vectors(const int4* src, int4* dst, int64_t vectors, int lane) {
    int64_t v = lane;
    for (; v + 3 * kWarp < vectors; v += 4 * kWarp) {
        int4 raw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) raw[j] = load_vector<FRESH>(src + v + j * kWarp);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[v + j * kWarp] = raw[j];
    }
    for (; v < vectors; v += kWarp) dst[v] = load_vector<FRESH>(src + v);
}

// One warp copies a row of `vectors` 16-byte vectors of T's elements. With scale_it, each element
// is multiplied by `scale` in fp32 and rounded once.
template <typename T, bool FRESH>
__device__ __forceinline__ void copy_row(const int4* src, int4* dst, int64_t vectors, int lane, bool scale_it,
                                         float scale) {
    if (!scale_it) {
        copy_vectors<FRESH>(src, dst, vectors, lane);
        return;
    }
    int64_t v = lane;
    for (; v + 3 * kWarp < vectors; v += 4 * kWarp) {
        int4 raw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) raw[j] = load_vector<FRESH>(src + v + j * kWarp);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[v + j * kWarp] = scaled<T>(raw[j], scale);
    }
    for (; v < vectors; v += kWarp) dst[v] = scaled<T>(load_vector<FRESH>(src + v), scale);
}

// One warp copies a packed FP8 row of `vectors` 16-byte vectors and `hidden` values: the value bytes
// as they are, each tile's scale times `gate` (exact: the scales are powers of two), so that the row
// dequantises to the gate times the unscaled row's values (the padding is copied as it is).
template <bool FRESH>
__device__ __forceinline__ void copy_packed_row_scaled(const int4* src, int4* dst, int64_t vectors, int64_t hidden,
                                                       int lane, float gate) {
    const int64_t value_vectors = hidden / sizeof(int4), tiles = hidden / kFp8TileElements;
    copy_vectors<FRESH>(src, dst, value_vectors, lane);
    for (int64_t v = value_vectors + lane; v < vectors; v += kWarp) {
        int4 raw = load_vector<FRESH>(src + v);
        float* scales = reinterpret_cast<float*>(&raw);
        const int64_t first = (v - value_vectors) * static_cast<int64_t>(sizeof(int4) / sizeof(float));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (first + i < tiles) scales[i] *= gate;
        }
        dst[v] = raw;
    }
}

// One route's row as it goes to recv: copied, and with scale_it multiplied by `scale` (the route's
// gate): element by element for rows of bf16 or fp16 (T), in each tile's scale for packed FP8 rows.
template <typename T, bool FRESH>
__device__ __forceinline__ void copy_route_row(const int4* src, int4* dst, int64_t vectors, int64_t hidden, int lane,
                                               bool scale_it, float scale) {
    if constexpr (IsPackedFp8<T>::value) {
        if (scale_it) {
            copy_packed_row_scaled<FRESH>(src, dst, vectors, hidden, lane, scale);
        } else {
            copy_vectors<FRESH>(src, dst, vectors, lane);
        }
    } else {
        copy_row<T, FRESH>(src, dst, vectors, lane, scale_it, scale);
    }
}

// The dot product in fp32 of two rows of `vectors` 16-byte vectors, by one warp; every lane gets it.
// FRESH as for load_vector, for `a`.
template <typename T, bool FRESH>
__device__ __forceinline__ float row_dot_product(const int4* a, const int4* b, int64_t vectors, int lane) {
    float sum = 0.f;
    for (int64_t v = lane; v < vectors; v += kWarp) {
        float x[8], y[8];
        Vec8<T>::to_float(load_vector<FRESH>(a + v), x);
        Vec8<T>::to_float(b[v], y);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += x[i] * y[i];
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
    return sum;
}

// One FP8 value in kFormat as fp32, exactly (fp16 holds every e4m3 and every e5m2 value).
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ float fp8_to_float(uint8_t bits) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits), kFormat)));
}

// The dot product in fp32 of a packed FP8 row of `hidden` values in kFormat, dequantised as the
// reference pipeline's emulation holds it (each value times its tile's scale, rounded to bf16:
// fp8_rows.dequantise_rows), with a bf16 row `b` of `hidden` elements, by one warp; every lane gets
// it. FRESH as for load_vector, for the packed row.
template <__nv_fp8_interpretation_t kFormat, bool FRESH>
__device__ __forceinline__ float packed_row_dot_product(const int4* packed, const int4* b, int64_t hidden, int lane) {
    constexpr int kValues = sizeof(int4);                        // FP8 values in a vector of them
    constexpr int kVectorsPerTile = kFp8TileElements / kValues;  // vectors of values a tile's scale covers
    const float* scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(packed) + hidden);
    float sum = 0.f;
    for (int64_t v = lane; v < hidden / kValues; v += kWarp) {
        const int4 raw = load_vector<FRESH>(packed + v);
        const float scale = FRESH ? __ldcg(scales + v / kVectorsPerTile) : scales[v / kVectorsPerTile];
        const uint8_t* values = reinterpret_cast<const uint8_t*>(&raw);
        float y[kValues];
        Vec8<__nv_bfloat16>::to_float(b[2 * v], y);  // two bf16 vectors a vector of FP8 values
        Vec8<__nv_bfloat16>::to_float(b[2 * v + 1], y + 8);
#pragma unroll
        for (int i = 0; i < kValues; ++i) {
            const float x = __bfloat162float(__float2bfloat16_rn(fp8_to_float<kFormat>(values[i]) * scale));
            sum += x * y[i];
        }
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
    return sum;
}

// The backward's gate gradient of one route: the dot product of its token's unscaled row `src` with
// the route's saved expert output, row `row` of `outputs` (rows of T, or of bf16 for packed FP8 rows).
template <typename T, bool FRESH>
__device__ __forceinline__ float route_row_dot(const int4* src, const void* outputs, int64_t row, int64_t row_bytes,
                                               int64_t hidden, int lane) {
    const char* output_rows = static_cast<const char*>(outputs);
    if constexpr (IsPackedFp8<T>::value) {
        const char* output = output_rows + row * hidden * static_cast<int64_t>(sizeof(__nv_bfloat16));
        return packed_row_dot_product<T::format, FRESH>(src, reinterpret_cast<const int4*>(output), hidden, lane);
    } else {
        const char* output = output_rows + row * row_bytes;
        return row_dot_product<T, FRESH>(src, reinterpret_cast<const int4*>(output), row_bytes / sizeof(int4), lane);
    }
}

// Own rows, route by route. A piece is the part of one own expert's segment that falls in one row
// tile: copy its rows, then publish them with one release on that tile's counter.
template <typename T>
__device__ void copy_own_piece(const GroupShape& shape, int64_t piece, const char* tokens, int64_t num_tokens,
                               int64_t row_bytes, int64_t hidden, bool scaled, const float* route_scale,
                               const int32_t* layout, const DispatchTables& tables, int64_t* route_row) {
    const int E = shape.num_experts, d = shape.rank;
    const int64_t tile_m = shape.tile_m;
    const LayoutOffsets& lo = shape.layout;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
    const int32_t* piece_start = layout + lo.piece_start;
    const int i = part_of(piece_start, E, piece);
    const int e = layout[lo.send_order + i];
    const int64_t rel = layout[lo.dest_rel + e];
    const int64_t first_pos = layout[lo.send_offset + e];
    const int64_t count = layout[lo.send_offset + e + 1] - first_pos;
    const int64_t tile = rel / tile_m + (piece - piece_start[i]);
    const int64_t r0 = max(rel, tile * tile_m), r1 = min(rel + count, (tile + 1) * tile_m);
    const int64_t region_row = layout[lo.dest_row + e] - rel;  // recv row of the region's start
    char* recv = reinterpret_cast<char*>(tables.peer_recv[d]);
    int64_t* origin = reinterpret_cast<int64_t*>(tables.peer_origin[d]);

    for (int64_t r = r0 + warp; r < r1; r += num_warps) {
        const int64_t pos = first_pos + (r - rel);
        const int64_t route = tables.route_order[pos];
        const int64_t token = route % num_tokens;
        // The backward: each route carries its gate times the gradient.
        const int4* src = reinterpret_cast<const int4*>(tokens + token * row_bytes);
        copy_route_row<T, false>(src, reinterpret_cast<int4*>(recv + (region_row + r) * row_bytes),
                                 row_bytes / sizeof(int4), hidden, lane, scaled, scaled ? route_scale[route] : 1.f);
        if (tables.outputs != nullptr) {  // read before the tile count below (see DispatchTables)
            const float dot = route_row_dot<T, false>(src, tables.outputs, region_row + r, row_bytes, hidden, lane);
            if (lane == 0) tables.row_dot[region_row + r] = dot;
        }
        if (lane == 0) {
            origin[region_row + r] = (static_cast<int64_t>(shape.rank) << 32) | pos;
            route_row[pos] = (static_cast<int64_t>(d) << 32) | (region_row + r);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        int32_t* counter =
            reinterpret_cast<int32_t*>(tables.peer_meta[d]) + shape.meta.tile_counter + layout[lo.dest_tile + e] + tile;
        atomicAdd_system(counter, static_cast<int32_t>(r1 - r0));
    }
}

// Staging piece `piece` of this rank's rows for another rank: each token's row once, unscaled, with
// the recv rows (and gates) of its routes there; then one release on the piece's counter there. The
// token's first route there gets the staged row in route_stage, the others -1.
template <typename T>
__device__ void send_staged_piece(const GroupShape& shape, int64_t piece_item, const char* tokens, int64_t num_tokens,
                                  int64_t row_bytes, int top_k, const float* route_scale, const int32_t* layout,
                                  const DispatchTables& tables, int64_t* route_row) {
    const int P = shape.ep_size, E = shape.num_experts, L = E / P, rank = shape.rank;
    const LayoutOffsets& lo = shape.layout;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
    const int r = part_of(layout + lo.stage_send, P - 1, piece_item);
    const int d = (rank + 1 + r) % P;
    const int64_t piece = piece_item - layout[lo.stage_send + r];
    const int64_t first = piece * kStagePieceRows, last = min(tables.rank_counts[d], first + kStagePieceRows);
    const int64_t base = layout[lo.stage_dest_row + d];
    const int64_t kept = layout[lo.totals + kTotalKept];
    char* stage = reinterpret_cast<char*>(tables.peer_stage[d]);
    int64_t* stage_routes = reinterpret_cast<int64_t*>(tables.peer_stage_routes[d]);
    float* stage_scale = reinterpret_cast<float*>(tables.peer_stage_scale[d]);

    for (int64_t slot = first + warp; slot < last; slot += num_warps) {
        const int64_t token = tables.rank_tokens[d * num_tokens + slot];
        const int64_t at = base + slot;
        copy_vectors<false>(reinterpret_cast<const int4*>(tokens + token * row_bytes),
                            reinterpret_cast<int4*>(stage + at * row_bytes), row_bytes / sizeof(int4), lane);
        // The token's routes to d, a lane each, listed in top-k order.
        int64_t found = 0;
        for (int j0 = 0; j0 < top_k; j0 += kWarp) {
            const int64_t route = static_cast<int64_t>(j0 + lane) * num_tokens + token;
            const int64_t pos = j0 + lane < top_k ? tables.route_position[route] : kept;
            const int e = pos < kept ? part_of(layout + lo.send_offset, E, pos) : -1;
            const bool here = e >= 0 && e / L == d;
            const unsigned ballot = __ballot_sync(kFullMask, here);
            if (here) {
                const int before = __popc(ballot & ((1u << lane) - 1u));
                const int64_t entry = at * top_k + found + before;
                const int64_t recv_row = layout[lo.dest_row + e] + (pos - layout[lo.send_offset + e]);
                stage_routes[entry] = (recv_row << 32) | pos;
                if (route_scale != nullptr) stage_scale[entry] = route_scale[route];
                route_row[pos] = (static_cast<int64_t>(d) << 32) | recv_row;
                tables.route_stage[pos] = found + before == 0 ? static_cast<int32_t>(at) : -1;
            }
            found += __popc(ballot);
        }
        for (int64_t j = found + lane; j < top_k; j += kWarp) stage_routes[at * top_k + j] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        int32_t* counter = reinterpret_cast<int32_t*>(tables.peer_meta[d]) + shape.meta.stage_counter +
                           layout[lo.stage_dest_piece + d] + piece;
        atomicAdd_system(counter, static_cast<int32_t>(last - first));
    }
}

// Staging piece `piece_item` of those this rank receives: waits for it, then copies each staged row
// to its routes' recv rows (scaled per route in the backward), records their origins, keeps each
// route's dot product with the saved outputs (the backward, with tables.outputs) and counts each row
// on its GEMM1 row tile.
template <typename T>
__device__ void unstage_piece(const GroupShape& shape, int64_t piece_item, int64_t row_bytes, int64_t hidden, int top_k,
                              bool scale_rows, int32_t* layout, const DispatchTables& tables, int64_t* error_record) {
    const int P = shape.ep_size, L = shape.num_experts / P, rank = shape.rank;
    const int64_t tile_m = shape.tile_m;
    const LayoutOffsets& lo = shape.layout;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
    const int q = part_of(layout + lo.stage_recv_piece, P, piece_item);  // the source rank
    const int64_t piece = piece_item - layout[lo.stage_recv_piece + q];
    const int64_t rows = layout[lo.stage_recv_row + q + 1] - layout[lo.stage_recv_row + q];
    const int64_t first = piece * kStagePieceRows, last = min(rows, first + kStagePieceRows);
    int32_t* meta = reinterpret_cast<int32_t*>(tables.peer_meta[rank]);
    if (threadIdx.x == 0) {
        wait_at_least(meta + shape.meta.stage_counter + piece_item, static_cast<int32_t>(last - first), shape,
                      kWaitDispatchStage, q, layout, error_record);
    }
    __syncthreads();
    const char* stage = reinterpret_cast<const char*>(tables.peer_stage[rank]);
    const int64_t* stage_routes = reinterpret_cast<const int64_t*>(tables.peer_stage_routes[rank]);
    const float* stage_scale = reinterpret_cast<const float*>(tables.peer_stage_scale[rank]);
    char* recv = reinterpret_cast<char*>(tables.peer_recv[rank]);
    int64_t* origin = reinterpret_cast<int64_t*>(tables.peer_origin[rank]);

    for (int64_t r = first + warp; r < last; r += num_warps) {
        const int64_t at = layout[lo.stage_recv_row + q] + r;
        const int4* src = reinterpret_cast<const int4*>(stage + at * row_bytes);
        for (int j = 0; j < top_k; ++j) {
            const int64_t entry = __ldcg(stage_routes + at * top_k + j);  // the same in every lane
            if (entry < 0) break;
            const int64_t row = entry >> 32, pos = entry & 0xFFFFFFFF;
            copy_route_row<T, true>(src, reinterpret_cast<int4*>(recv + row * row_bytes), row_bytes / sizeof(int4),
                                    hidden, lane, scale_rows, scale_rows ? __ldcg(stage_scale + at * top_k + j) : 1.f);
            if (tables.outputs != nullptr) {  // read before the tile count below (see DispatchTables)
                const float dot = route_row_dot<T, true>(src, tables.outputs, row, row_bytes, hidden, lane);
                if (lane == 0) tables.row_dot[row] = dot;
            }
            if (lane == 0) origin[row] = (static_cast<int64_t>(q) << 32) | pos;
            // Release, as the route-by-route path does with its block barrier: the warp barrier
            // orders every lane's stores before lane 0's fence, and the fence before its count.
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                const int l = part_of(layout + lo.expert_start, L, row);
                const int64_t tile = layout[lo.tile_start + l] + (row - layout[lo.expert_start + l]) / tile_m;
                atomicAdd_system(meta + shape.meta.tile_counter + tile, 1);
            }
        }
    }
}

// Work items, in this order: the own rank's pieces, the staging pieces this rank sends, those it
// receives. A block takes its items in increasing order, so every block has sent all it sends
// before it waits for anything: a rank's dispatch never waits on a peer's that is itself waiting.
template <typename T>
__global__ void dispatch_kernel(GroupShape shape, const char* tokens, int64_t num_tokens, int64_t row_bytes,
                                int64_t hidden, int top_k, bool scaled, const float* route_scale, int32_t* layout,
                                DispatchTables tables, int64_t* route_row, int64_t* error_record) {
    const LayoutOffsets& lo = shape.layout;
    const int64_t own_pieces = layout[lo.totals + kTotalPieces];
    const int64_t sent_pieces = layout[lo.stage_send + shape.ep_size - 1];
    const int64_t items = own_pieces + sent_pieces + layout[lo.stage_recv_piece + shape.ep_size];
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        if (item < own_pieces) {
            copy_own_piece<T>(shape, item, tokens, num_tokens, row_bytes, hidden, scaled, route_scale, layout, tables,
                              route_row);
        } else if (item < own_pieces + sent_pieces) {
            send_staged_piece<T>(shape, item - own_pieces, tokens, num_tokens, row_bytes, top_k, route_scale, layout,
                                 tables, route_row);
        } else {
            // `scaled`, not route_scale: a rank without routes has no scales but unstages scaled rows.
            unstage_piece<T>(shape, item - own_pieces - sent_pieces, row_bytes, hidden, top_k, scaled, layout, tables,
                             error_record);
        }
        __syncthreads();  // every thread is done with this item before the next one's waits and copies
    }
}

template <typename T>
void launch_dispatch_kernel(const GroupShape& shape, const char* rows, int64_t num_tokens, int64_t row_bytes,
                            int64_t hidden, int top_k, bool scaled, const float* route_scale, int32_t* layout,
                            const DispatchTables& tables, int64_t* route_row, int64_t* error_record, int blocks,
                            cudaStream_t stream) {
    dispatch_kernel<T><<<blocks, 512, 0, stream>>>(shape, rows, num_tokens, row_bytes, hidden, top_k, scaled,
                                                   route_scale, layout, tables, route_row, error_record);
}

}  // namespace

cudaError_t launch_dispatch(const GroupShape& shape, const void* tokens, int64_t num_tokens, int64_t row_bytes,
                            int64_t hidden, int top_k, int dtype_code, bool scaled, const float* route_scale,
                            int32_t* layout, const DispatchTables& tables, int64_t* route_row, int64_t* error_record,
                            int blocks, cudaStream_t stream) {
    const char* rows = static_cast<const char*>(tokens);
    switch (dtype_code) {
        case 0:
            launch_dispatch_kernel<__nv_bfloat16>(shape, rows, num_tokens, row_bytes, hidden, top_k, scaled,
                                                  route_scale, layout, tables, route_row, error_record, blocks, stream);
            break;
        case 1:
            launch_dispatch_kernel<__half>(shape, rows, num_tokens, row_bytes, hidden, top_k, scaled, route_scale,
                                           layout, tables, route_row, error_record, blocks, stream);
            break;
        case kPackedE4m3Code:
            launch_dispatch_kernel<PackedFp8<__NV_E4M3>>(shape, rows, num_tokens, row_bytes, hidden, top_k, scaled,
                                                         route_scale, layout, tables, route_row, error_record, blocks,
                                                         stream);
            break;
        case kPackedE5m2Code:
            launch_dispatch_kernel<PackedFp8<__NV_E5M2>>(shape, rows, num_tokens, row_bytes, hidden, top_k, scaled,
                                                         route_scale, layout, tables, route_row, error_record, blocks,
                                                         stream);
            break;
        default:
            return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace ds_comet
