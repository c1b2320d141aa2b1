// ds_comet combine: the weighted top-k sum of the routes' expert outputs. See comet.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bounded_wait.cuh"
#include "comet.h"
#include "kernel_helpers.cuh"

namespace ds_comet {
namespace {

constexpr int kCombineThreads = 512;

// The combine's work is claimed in units of one column chunk, in chunk order, through a counter the
// exchange zeroes: the communication blocks start on a chunk as soon as it is finished, and a second
// launch on the GEMM stream (all SMs, once GEMM2 is done) takes whatever is left, so the last chunks
// are not reduced by the few communication blocks alone. A chunk's units are first its reduce units
// (one per staging piece this rank received: the rows other ranks staged here, each summed over its
// token's routes here), then its source units (unit_tokens of this rank's tokens each). A source
// unit waits for reduce units of other ranks, which wait only for their own rank's GEMM2; every rank
// claims a chunk's reduce units before its source units, so a claimed unit never waits on a unit no
// block can claim.
//
// A unit first looks up the rows it sums (per output row, top_k of them) into shared memory, once for
// all its passes: looked up in every pass, that chain of dependent loads came before every read of a
// row and bounded the kernel by latency (about 10 GB/s per SM, docs/decisions.md). Per pass a thread
// then reads ROUTES routes of ITEMS (output row, 8-column) vectors, issuing all ROUTES x ITEMS loads
// before using any: a read over NVLink takes microseconds, and k alone (2 on many models) would leave
// too few in flight.

// out[t][columns of the pass] = sum over j of staged_gate[j][t] x staged_row[j][t] for the n rows
// staged ([route j][row t], stride `stride`; a null row adds nothing), columns [col0, col0 + 8 vectors).
template <typename T, int ROUTES, int ITEMS>
__device__ __forceinline__ void sum_staged_rows(const T* const* staged_row, const float* staged_gate, int64_t n,
                                                int64_t stride, int64_t top_k, int64_t col0, int64_t vectors, T* out,
                                                int64_t hidden) {
    const int64_t work = n * vectors;
    for (int64_t w0 = threadIdx.x; w0 < work; w0 += static_cast<int64_t>(ITEMS) * blockDim.x) {
        int32_t token[ITEMS], col[ITEMS];  // row within the unit (-1: no item); int32: fewer registers
        float acc[ITEMS][8];
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
            const int64_t w = w0 + static_cast<int64_t>(it) * blockDim.x;
            token[it] = w < work ? static_cast<int32_t>(w / vectors) : -1;
            col[it] = static_cast<int32_t>(col0 + (w % vectors) * 8);
#pragma unroll
            for (int v = 0; v < 8; ++v) acc[it][v] = 0.f;
        }
        for (int64_t j0 = 0; j0 < top_k; j0 += ROUTES) {
            int4 raw[ITEMS][ROUTES];
            static_assert(ITEMS * ROUTES <= 32, "one bit per read in `present`");
            uint32_t present = 0;  // bit it * ROUTES + i: that item's route read a row
#pragma unroll
            for (int it = 0; it < ITEMS; ++it) {
#pragma unroll
                for (int i = 0; i < ROUTES; ++i) {
                    const T* row =
                        token[it] >= 0 && j0 + i < top_k ? staged_row[(j0 + i) * stride + token[it]] : nullptr;
                    if (row != nullptr) {
                        // Written by another GPU, or by GEMM2 beside this kernel: read past L1, which
                        // does not see such stores.
                        raw[it][i] = __ldcg(reinterpret_cast<const int4*>(row + col[it]));
                        present |= 1u << (it * ROUTES + i);
                    }
                }
            }
#pragma unroll
            for (int it = 0; it < ITEMS; ++it) {
#pragma unroll
                for (int i = 0; i < ROUTES; ++i) {
                    if (!(present & (1u << (it * ROUTES + i)))) continue;
                    float values[8];
                    Vec8<T>::to_float(raw[it][i], values);
                    const float gate = staged_gate[(j0 + i) * stride + token[it]];
#pragma unroll
                    for (int v = 0; v < 8; ++v) acc[it][v] += gate * values[v];
                }
            }
        }
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
            if (token[it] >= 0) {
                *reinterpret_cast<int4*>(out + token[it] * hidden + col[it]) = Vec8<T>::from_float(acc[it]);
            }
        }
    }
}

template <typename T, int ROUTES, int ITEMS>
__global__ void __launch_bounds__(kCombineThreads, 1)
    combine_kernel(GroupShape shape, CombineTables tables, bool weighted, const float* gates, T* out, int64_t top_k,
                   int64_t num_tokens, int64_t hidden, int64_t chunk_cols, int64_t tile_n, int64_t num_chunks,
                   int64_t unit_tokens, int64_t reduce_rows, int32_t* layout, int64_t* error_record) {
    const MetaOffsets& mo = shape.meta;
    const LayoutOffsets& lo = shape.layout;
    const int P = shape.ep_size, rank = shape.rank;
    const int64_t kept = layout[lo.totals + kTotalKept];
    const int64_t chunks = min(num_chunks, ceil_div(hidden, chunk_cols));
    // A reduce unit: reduce_rows (a power of two <= unit_tokens, dividing kStagePieceRows) of one
    // staging piece received (a source's last piece may leave some units empty).
    const int64_t units_per_piece = kStagePieceRows / reduce_rows;
    const int64_t reduce_units = layout[lo.stage_recv_piece + P] * units_per_piece;
    const int64_t units_per_chunk = reduce_units + ceil_div(num_tokens, unit_tokens);
    const int64_t total_units = chunks * units_per_chunk;
    int32_t* claim = layout + lo.totals + kTotalCombineClaim;
    const int32_t* meta = reinterpret_cast<const int32_t*>(tables.peer_meta[rank]);
    const T* expert_out = reinterpret_cast<const T*>(tables.expert_out);
    __shared__ int64_t claimed;
    __shared__ int32_t release_rank, release_rows;  // a reduce unit's count on its source (shared: fewer registers)
    // A unit's rows to sum, [route j][output row of the unit]: the row (null: nothing) and its weight.
    extern __shared__ int64_t staged[];
    const T** staged_row = reinterpret_cast<const T**>(staged);
    float* staged_gate = reinterpret_cast<float*>(staged_row + top_k * unit_tokens);

    for (;;) {
        if (threadIdx.x == 0) {
            const int64_t u = atomicAdd(claim, 1);
            if (u < total_units) {
                const int64_t c = u / units_per_chunk;
                const int64_t tiles = ceil_div(min(hidden, (c + 1) * chunk_cols) - c * chunk_cols, tile_n);
                const int64_t own_routes = layout[lo.totals + kTotalOwnRoutes];
                const int64_t staged_sent = layout[lo.totals + kTotalStagedSent];
                const int64_t others_rows = layout[lo.totals + kTotalRecvRows] - own_routes;  // other ranks' rows here
                if (u % units_per_chunk < reduce_units) {
                    // This rank's GEMM2 has finished the chunk for every row of another rank.
                    wait_at_least(meta + mo.reduce_counter + c, static_cast<int32_t>(others_rows * tiles), shape,
                                  kWaitCombineReduce, c, layout, error_record);
                } else {
                    // The own routes' rows, and every rank's reduced rows of this rank's tokens.
                    wait_at_least(meta + mo.chunk_counter + c, static_cast<int32_t>(own_routes * tiles + staged_sent),
                                  shape, kWaitCombineChunk, c, layout, error_record);
                }
            }
            claimed = u;
        }
        // Also: every thread is done with the previous unit's staging before it is overwritten.
        __syncthreads();
        const int64_t u = claimed;
        __syncthreads();  // every thread has read it before thread 0 claims the next unit
        if (u >= total_units) return;
        const int64_t c = u / units_per_chunk, i = u % units_per_chunk;
        const int64_t col0 = c * chunk_cols, vectors = (min(hidden, col0 + chunk_cols) - col0) / 8;
        int64_t n;
        T* sums;
        if (threadIdx.x == 0) release_rows = 0;
        if (i < reduce_units) {
            // Rows other ranks staged here: each the sum of its token's routes here.
            const int64_t piece_item = i / units_per_piece;
            const int source = part_of(layout + lo.stage_recv_piece, P, piece_item);
            const int64_t base = layout[lo.stage_recv_row + source];
            const int64_t rel = (piece_item - layout[lo.stage_recv_piece + source]) * kStagePieceRows +
                                (i % units_per_piece) * reduce_rows;
            const int64_t first = base + rel;
            n = max(int64_t{0}, min(reduce_rows, layout[lo.stage_recv_row + source + 1] - first));
            for (int64_t e = threadIdx.x; e < top_k * n; e += blockDim.x) {
                const int64_t j = e / n, t = e % n;
                // Written by the source's dispatch: read past L1.
                const int64_t entry = __ldcg(tables.stage_routes + (first + t) * top_k + j);
                staged_row[j * unit_tokens + t] = entry < 0 ? nullptr : expert_out + (entry >> 32) * hidden;
                staged_gate[j * unit_tokens + t] =
                    weighted && entry >= 0 ? __ldcg(tables.stage_scale + (first + t) * top_k + j) : 1.f;
            }
            sums = reinterpret_cast<T*>(tables.peer_reduced[rank]) + first * hidden;
            if (threadIdx.x == 0) {
                release_rank = source;
                release_rows = static_cast<int32_t>(n);
            }
        } else {
            // This rank's tokens: its own routes' rows and one reduced row per other rank.
            const int64_t t0 = (i - reduce_units) * unit_tokens;
            n = min(num_tokens, t0 + unit_tokens) - t0;
            const bool collect_grad = tables.route_grad != nullptr && c == 0;  // once a route
            for (int64_t e = threadIdx.x; e < top_k * n; e += blockDim.x) {
                const int64_t j = e / n, t = e % n;  // consecutive threads, consecutive tokens: coalesced
                const int64_t route = j * num_tokens + t0 + t;
                const int64_t pos = tables.route_position[route];
                const T* row = nullptr;  // a dropped route adds nothing, nor one summed into another's row
                float gate = 1.f, grad = 0.f;
                if (pos < kept) {
                    const int64_t where = tables.route_row[pos];
                    const int d = static_cast<int>(where >> 32);
                    const int64_t recv_row = where & 0xFFFFFFFF;
                    if (d == rank) {
                        row = expert_out + recv_row * hidden;
                        if (weighted) gate = gates[route];
                    } else {
                        const int64_t stage_row = tables.route_stage[pos];
                        if (stage_row >= 0) {
                            row = reinterpret_cast<const T*>(tables.peer_reduced[d]) + stage_row * hidden;
                        }
                    }
                    if (collect_grad) grad = __ldcg(reinterpret_cast<const float*>(tables.peer_row_dot[d]) + recv_row);
                }
                if (collect_grad) tables.route_grad[route] = grad;
                staged_row[j * unit_tokens + t] = row;
                staged_gate[j * unit_tokens + t] = gate;
            }
            sums = out + t0 * hidden;
        }
        __syncthreads();
        sum_staged_rows<T, ROUTES, ITEMS>(staged_row, staged_gate, n, unit_tokens, top_k, col0, vectors, sums, hidden);
        __syncthreads();  // every thread's sums are stored before the release
        if (threadIdx.x == 0 && release_rows > 0) {
            __threadfence_system();
            int32_t* counter = reinterpret_cast<int32_t*>(tables.peer_meta[release_rank]) + mo.chunk_counter + c;
            atomicAdd_system(counter, release_rows);
        }
    }
}

template <typename T, int ROUTES, int ITEMS>
void launch_combine_as(const GroupShape& shape, const CombineTables& tables, bool weighted, const float* gates,
                       void* out, int64_t top_k, int64_t num_tokens, int64_t hidden, int64_t chunk_cols, int64_t tile_n,
                       int64_t num_chunks, int32_t* layout, int64_t* error_record, int blocks, cudaStream_t stream) {
    // About eight passes of a block per unit (fewer where a unit's routes would not fit the staging):
    // long enough to hide the claim and the staging, short enough that the last units spread over
    // every block.
    const int64_t unit_vectors = static_cast<int64_t>(kCombineThreads) * ITEMS * 8;
    const int64_t routes_per_token = max(int64_t{1}, top_k);
    const int64_t unit_tokens =
        max(int64_t{1}, min(unit_vectors / max(int64_t{1}, chunk_cols / 8), kMaxCombineTopK / routes_per_token));
    const size_t staging = static_cast<size_t>(routes_per_token * unit_tokens) * 16;
    // A reduce unit's rows fit the same staging: the most that divide a staging piece.
    int64_t reduce_rows = kStagePieceRows;
    while (reduce_rows > unit_tokens) reduce_rows /= 2;
    combine_kernel<T, ROUTES, ITEMS><<<blocks, kCombineThreads, staging, stream>>>(
        shape, tables, weighted, gates, static_cast<T*>(out), top_k, num_tokens, hidden, chunk_cols, tile_n, num_chunks,
        unit_tokens, reduce_rows, layout, error_record);
}

template <typename T>
void launch_combine_for_k(const GroupShape& shape, const CombineTables& tables, bool weighted, const float* gates,
                          void* out, int64_t top_k, int64_t num_tokens, int64_t hidden, int64_t chunk_cols,
                          int64_t tile_n, int64_t num_chunks, int32_t* layout, int64_t* error_record, int blocks,
                          cudaStream_t stream) {
    // Eight loads in flight per thread and pass for k = 2, 4 and 8; four for k = 1, six for k = 3, k
    // for k = 5-7; a k above 8 leaves its last pass partly empty.
    if (top_k <= 1) {
        launch_combine_as<T, 1, 4>(shape, tables, weighted, gates, out, top_k, num_tokens, hidden, chunk_cols, tile_n,
                                   num_chunks, layout, error_record, blocks, stream);
    } else if (top_k == 2) {
        launch_combine_as<T, 2, 4>(shape, tables, weighted, gates, out, top_k, num_tokens, hidden, chunk_cols, tile_n,
                                   num_chunks, layout, error_record, blocks, stream);
    } else if (top_k <= 4) {
        launch_combine_as<T, 4, 2>(shape, tables, weighted, gates, out, top_k, num_tokens, hidden, chunk_cols, tile_n,
                                   num_chunks, layout, error_record, blocks, stream);
    } else {
        launch_combine_as<T, 8, 1>(shape, tables, weighted, gates, out, top_k, num_tokens, hidden, chunk_cols, tile_n,
                                   num_chunks, layout, error_record, blocks, stream);
    }
}

}  // namespace

cudaError_t launch_combine(const GroupShape& shape, const CombineTables& tables, bool weighted, const float* gates,
                           void* out, int64_t top_k, int64_t num_tokens, int64_t hidden, int dtype_code,
                           int64_t chunk_cols, int64_t tile_n, int64_t num_chunks, int32_t* layout,
                           int64_t* error_record, int blocks, cudaStream_t stream) {
    if (dtype_code == 0) {
        launch_combine_for_k<__nv_bfloat16>(shape, tables, weighted, gates, out, top_k, num_tokens, hidden, chunk_cols,
                                            tile_n, num_chunks, layout, error_record, blocks, stream);
    } else {
        launch_combine_for_k<__half>(shape, tables, weighted, gates, out, top_k, num_tokens, hidden, chunk_cols, tile_n,
                                     num_chunks, layout, error_record, blocks, stream);
    }
    return cudaGetLastError();
}

}  // namespace ds_comet
