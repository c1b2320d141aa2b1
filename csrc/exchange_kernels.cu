// ds_comet count exchange: every rank's counts to every peer, and the call's layout. See comet.h.
#include "bounded_wait.cuh"
#include "comet.h"
#include "kernel_helpers.cuh"

namespace ds_comet {
namespace {

// Row tiles that a run of `count` rows touches, starting `rel_start` rows into a region (32-bit: the
// exchange kernel computes it per expert, and a region's rows fit int32).
__device__ __forceinline__ int32_t pieces_of(int32_t rel_start, int32_t count, int32_t tile_m) {
    return count == 0 ? 0 : (rel_start + count - 1) / tile_m - rel_start / tile_m + 1;
}

// The exchange kernel's shared memory, as offsets in int32 words into one dynamic allocation; the
// launch sizes it from `words` and the kernel carves it from the same offsets.
struct ExchangeSharedLayout {
    int64_t routes_in;       // [E] rows every source sends to expert e
    int64_t rows_before;     // [E] of those, the rows of sources ahead of this rank
    int64_t own_routes_of;   // [E] this rank's routes per expert
    int64_t tiles_of;        // [E] row tiles of expert e's region
    int64_t pieces_of;       // [E] dispatch pieces of this rank's own rows to expert e
    int64_t staged_of;       // [P * P] rows source q stages on destination d
    int64_t own_tile_start;  // [L + 1] this rank's row tiles before local expert l
    int64_t full_local_of;   // [L] tiles holding only this rank's own rows, per local expert
    int64_t words;
};

__host__ __device__ inline ExchangeSharedLayout exchange_shared_layout(const GroupShape& shape) {
    const int64_t P = shape.ep_size, E = shape.num_experts, L = E / P;
    ExchangeSharedLayout s{};
    int64_t at = 0;
    s.routes_in = at, at += E;
    s.rows_before = at, at += E;
    s.own_routes_of = at, at += E;
    s.tiles_of = at, at += E;
    s.pieces_of = at, at += E;
    s.staged_of = at, at += P * P;
    s.own_tile_start = at, at += L + 1;
    s.full_local_of = at, at += L;
    s.words = at;
    return s;
}

__global__ void exchange_kernel(GroupShape shape, ExchangeHeader header, const int64_t* expert_counts,
                                const int64_t* rank_counts, int32_t* meta, const int64_t* peer_meta, int32_t* layout,
                                int64_t* error_record) {
    const int P = shape.ep_size, E = shape.num_experts, L = E / P, rank = shape.rank, tid = threadIdx.x;
    const int W = E + P;  // a source's counts: its routes per expert, then its staged rows per destination
    const int64_t tile_m = shape.tile_m;
    const MetaOffsets& mo = shape.meta;
    const LayoutOffsets& lo = shape.layout;

    __shared__ int32_t generation;
    if (tid == 0) {
        generation = meta[mo.generation] + 1;
        meta[mo.generation] = generation;
    }
    // Counters first: peers add to them as soon as they see this call's counts.
    // (The tile, chunk, staging and reduce counters are one run of meta.)
    for (int64_t i = tid; i < shape.max_tiles + 2 * shape.max_chunks + shape.max_stage_pieces; i += blockDim.x) {
        meta[mo.tile_counter + i] = 0;
    }
    __syncthreads();
    const int parity = generation & 1;
    for (int i = tid; i < P * W; i += blockDim.x) {
        int32_t* peer = reinterpret_cast<int32_t*>(peer_meta[i / W]);
        const int j = i % W;
        // Nothing is staged on the own rank: its rows are copied route by route.
        const int64_t value = j < E ? expert_counts[j] : (j - E == rank ? 0 : rank_counts[j - E]);
        peer[mo.counts + (parity * P + rank) * W + j] = static_cast<int32_t>(value);
    }
    // The header goes with the counts, under the same flag.
    for (int i = tid; i < P * kHeaderWords; i += blockDim.x) {
        int32_t* peer = reinterpret_cast<int32_t*>(peer_meta[i / kHeaderWords]);
        peer[mo.header + (parity * P + rank) * kHeaderWords + i % kHeaderWords] = header.words[i % kHeaderWords];
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        for (int p = 0; p < P; ++p) {
            atomicExch_system(reinterpret_cast<int32_t*>(peer_meta[p]) + mo.exchange_flag + rank, generation);
        }
        __threadfence_system();  // the flags written, not only issued, before a thread may stop below
    }
    // Every peer has this rank's flag before any thread may stop the kernel on a peer's header below:
    // a peer then finds the mismatch in this rank's header itself, instead of waiting out its bound
    // for a flag that a stopped kernel never raised.
    __syncthreads();
    if (tid < P) {
        wait_at_least(meta + mo.exchange_flag + tid, generation, shape, kWaitExchangeFlag, tid, layout, error_record);
        // Read after the flag's acquire, as the counts are: a source in another exchange (another
        // layer sharing this workspace, another call, the other direction, other settings) stops
        // the call here, before any row moves.
        const volatile int32_t* theirs = meta + mo.header + (parity * P + tid) * kHeaderWords;
        for (int w = 0; w < kHeaderWords; ++w) {
            const int32_t seen = theirs[w];
            if (seen != header.words[w]) {
                fail(shape, layout, error_record, kHeaderMismatch, tid * kHeaderWords + w, header.words[w], seen, 0);
            }
        }
    }
    __syncthreads();

    const volatile int32_t* counts = meta + mo.counts + parity * P * W;  // counts[source * W + expert]
    // Every count is read from global memory once, by all threads at a time, into shared memory
    // (ExchangeSharedLayout): the loops below, one thread each, then read only shared memory. Read
    // from global memory inside those loops, each iteration waited on its loads (docs/decisions.md).
    extern __shared__ int32_t exchange_shared[];
    const ExchangeSharedLayout sl = exchange_shared_layout(shape);
    int32_t* routes_in = exchange_shared + sl.routes_in;
    int32_t* rows_before = exchange_shared + sl.rows_before;
    int32_t* own_routes_of = exchange_shared + sl.own_routes_of;
    int32_t* tiles_of = exchange_shared + sl.tiles_of;
    int32_t* pieces_of_e = exchange_shared + sl.pieces_of;
    int32_t* staged_of = exchange_shared + sl.staged_of;
    int32_t* own_tile_start = exchange_shared + sl.own_tile_start;
    int32_t* full_local_of = exchange_shared + sl.full_local_of;
    const int32_t tm = static_cast<int32_t>(tile_m);
    // The per-expert arithmetic (32-bit divisions among it) on every thread; the prefix loops below
    // then only add.
    for (int e = tid; e < E; e += blockDim.x) {
        const int d = e / L;
        const int steps = (d - rank + P) % P;  // sources fill a region in the order d, d-1, d-2, ...
        int32_t rows = 0, before_me = 0;
        for (int j = 0; j < P; ++j) {
            const int32_t c = counts[((d - j + P) % P) * W + e];
            rows += c;
            if (j < steps) before_me += c;
        }
        const int32_t own = static_cast<int32_t>(expert_counts[e]);
        routes_in[e] = rows;
        rows_before[e] = before_me;
        own_routes_of[e] = own;
        tiles_of[e] = (rows + tm - 1) / tm;
        pieces_of_e[e] = d == rank ? pieces_of(before_me, own, tm) : 0;
        if (d == rank) full_local_of[e - rank * L] = own / tm;  // own rows open each region
    }
    for (int i = tid; i < P * P; i += blockDim.x) staged_of[i] = counts[(i / P) * W + E + i % P];
    __syncthreads();

    // One thread per destination d: where this rank's rows for each of d's experts land, and where
    // its staged rows go on d (after those of the lower source ranks).
    if (tid < P) {
        const int d = tid;
        int64_t region_start = 0, tiles_before = 0;
        for (int l = 0; l < L; ++l) {
            const int e = d * L + l;
            layout[lo.dest_row + e] = static_cast<int32_t>(region_start + rows_before[e]);
            layout[lo.dest_rel + e] = rows_before[e];
            layout[lo.dest_tile + e] = static_cast<int32_t>(tiles_before);
            if (d == rank) {
                layout[lo.expert_start + l] = static_cast<int32_t>(region_start);
                layout[lo.tile_start + l] = static_cast<int32_t>(tiles_before);
                own_tile_start[l] = static_cast<int32_t>(tiles_before);
            }
            region_start += routes_in[e];
            tiles_before += tiles_of[e];
        }
        if (d == rank) {
            layout[lo.expert_start + L] = static_cast<int32_t>(region_start);
            layout[lo.tile_start + L] = static_cast<int32_t>(tiles_before);
            layout[lo.totals + kTotalTiles] = static_cast<int32_t>(tiles_before);
            layout[lo.totals + kTotalRecvRows] = static_cast<int32_t>(region_start);
            own_tile_start[L] = static_cast<int32_t>(tiles_before);
        }
        int64_t row = 0, piece = 0;
        for (int q = 0; q < rank; ++q) {
            row += staged_of[q * P + d];
            piece += ceil_div(staged_of[q * P + d], kStagePieceRows);
        }
        layout[lo.stage_dest_row + d] = static_cast<int32_t>(row);
        layout[lo.stage_dest_piece + d] = static_cast<int32_t>(piece);
    }
    __syncthreads();

    // Four independent prefix loops, each on the first thread of its own warp so that they run at
    // once; the last also checks the workspace's bounds.
    if (tid == 0) {
        // Tile schedule: tiles holding only this rank's own rows (they arrive first) go first.
        int64_t local_tiles = 0, remote_tiles = 0;
        layout[lo.local_tiles] = 0;
        layout[lo.remote_tiles] = 0;
        for (int l = 0; l < L; ++l) {
            local_tiles += full_local_of[l];
            remote_tiles += own_tile_start[l + 1] - own_tile_start[l] - full_local_of[l];
            layout[lo.local_tiles + l + 1] = static_cast<int32_t>(local_tiles);
            layout[lo.remote_tiles + l + 1] = static_cast<int32_t>(remote_tiles);
        }
    } else if (tid == kWarp) {
        int64_t kept = 0, own_routes = 0;
        for (int e = 0; e < E; ++e) {
            layout[lo.send_offset + e] = static_cast<int32_t>(kept);
            kept += own_routes_of[e];
            if (e / L == rank) own_routes += own_routes_of[e];
        }
        layout[lo.send_offset + E] = static_cast<int32_t>(kept);
        layout[lo.totals + kTotalKept] = static_cast<int32_t>(kept);
        layout[lo.totals + kTotalOwnRoutes] = static_cast<int32_t>(own_routes);
    } else if (tid == 2 * kWarp) {
        // The sending order: own rank first, then each rank in turn; pieces only of the own rows.
        int64_t pieces = 0, i = 0;
        for (int r = 0; r < P; ++r) {
            const int d = (rank + r) % P;
            for (int l = 0; l < L; ++l, ++i) {
                const int e = d * L + l;
                layout[lo.send_order + i] = e;
                layout[lo.piece_start + i] = static_cast<int32_t>(pieces);
                pieces += pieces_of_e[e];
            }
        }
        layout[lo.piece_start + E] = static_cast<int32_t>(pieces);
        layout[lo.totals + kTotalPieces] = static_cast<int32_t>(pieces);
    }
    if (tid != 3 * kWarp) return;

    // Staging. Each source's rows on a destination follow those of the lower source ranks; a
    // source sends to the next ranks in turn (rank + 1 first), so that the sources start on
    // different destinations.
    int64_t sent = 0, staged_sent = 0;
    for (int r = 0; r + 1 < P; ++r) {
        layout[lo.stage_send + r] = static_cast<int32_t>(sent);
        const int64_t rows = staged_of[rank * P + (rank + 1 + r) % P];
        sent += ceil_div(rows, kStagePieceRows);
        staged_sent += rows;
    }
    layout[lo.stage_send + P - 1] = static_cast<int32_t>(sent);
    int64_t staged_rows = 0, staged_pieces = 0;
    for (int q = 0; q < P; ++q) {
        layout[lo.stage_recv_row + q] = static_cast<int32_t>(staged_rows);
        layout[lo.stage_recv_piece + q] = static_cast<int32_t>(staged_pieces);
        staged_rows += staged_of[q * P + rank];
        staged_pieces += ceil_div(staged_of[q * P + rank], kStagePieceRows);
    }
    layout[lo.stage_recv_row + P] = static_cast<int32_t>(staged_rows);
    layout[lo.stage_recv_piece + P] = static_cast<int32_t>(staged_pieces);
    layout[lo.totals + kTotalGeneration] = generation;
    layout[lo.totals + kTotalCombineClaim] = 0;
    layout[lo.totals + kTotalStagedSent] = static_cast<int32_t>(staged_sent);

    const int64_t recv_rows = layout[lo.totals + kTotalRecvRows];
    const int64_t tiles = layout[lo.totals + kTotalTiles];
    if (recv_rows > shape.max_recv_rows) {
        fail(shape, layout, error_record, kWorkspaceOverflow, 0, shape.max_recv_rows, recv_rows, 0);
    }
    if (tiles > shape.max_tiles) fail(shape, layout, error_record, kWorkspaceOverflow, 1, shape.max_tiles, tiles, 0);
    // Every staged row has a route here and is a token of another rank (each rank checks its tokens
    // against the workspace's bound), so the staged rows fit `stage` whenever the routes fit recv;
    // their pieces get their own check.
    if (staged_pieces > shape.max_stage_pieces) {
        fail(shape, layout, error_record, kWorkspaceOverflow, 2, shape.max_stage_pieces, staged_pieces, 0);
    }
}

}  // namespace

cudaError_t launch_exchange(const GroupShape& shape, const ExchangeHeader& header, const int64_t* expert_counts,
                            const int64_t* rank_counts, int32_t* meta, const int64_t* peer_meta, int32_t* layout,
                            int64_t* error_record, cudaStream_t stream) {
    const size_t shared = static_cast<size_t>(exchange_shared_layout(shape).words) * sizeof(int32_t);
    // Past 48 KiB, static words included, a kernel must opt in (thousands of experts); the margin
    // covers the kernel's own static shared words.
    if (shared > 46 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(shared));
        if (err != cudaSuccess) return err;
    }
    exchange_kernel<<<1, 256, shared, stream>>>(shape, header, expert_counts, rank_counts, meta, peer_meta, layout,
                                                error_record);
    return cudaGetLastError();
}

}  // namespace ds_comet
