// ds_comet communication kernels: count exchange, dispatch, combine. See comet.h.
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "block_scan.cuh"
#include "comet.h"

namespace ds_comet {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kCombineThreads = 512;

__device__ __forceinline__ int32_t load_acquire_sys(const int32_t* ptr) {
    int32_t value;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Writes the error record the host turns into an exception, prints it, and stops the kernel:
// a wait that never completes must not leave wrong numbers behind or hang the job. When a peer
// stops, every waiting block gives up at about the same time; the claim in device memory lets
// exactly one of them (in these kernels or the Triton GEMM) fill the record, so that its fields
// describe one wait. The others wait (boundedly) until it is filled: a trap ends every block of the
// context, the filling one included.
__device__ void fail(const GroupShape& shape, int32_t* layout, int64_t* error_record, int64_t kind, int64_t index,
                     int64_t target, int64_t observed, uint64_t waited_ns) {
    volatile int64_t* record = error_record;
    if (atomicCAS(layout + shape.layout.totals + kTotalErrorClaim, 0, 1) == 0) {
        record[kErrorRank] = shape.rank;
        record[kErrorKind] = kind;
        record[kErrorIndex] = index;
        record[kErrorTarget] = target;
        record[kErrorObserved] = observed;
        record[kErrorWaitedNs] = static_cast<int64_t>(waited_ns);
        __threadfence_system();
        record[kErrorFilled] = 1;
        __threadfence_system();
    } else {
        const uint64_t start = global_timer_ns();
        const uint64_t limit = static_cast<uint64_t>(kErrorRecordWaitNs);
        while (record[kErrorFilled] == 0 && global_timer_ns() - start < limit) __nanosleep(1000);
    }
    // The Python exception (ds_comet/kernels/ops.py) names what the wait was for; this line is for
    // a process that dies before it can raise it.
    printf("ds_comet: rank %d gave up after %.1f s on wait kind %lld, index %lld: target %lld, saw %lld\n", shape.rank,
           waited_ns * 1e-9, static_cast<long long>(kind), static_cast<long long>(index),
           static_cast<long long>(target), static_cast<long long>(observed));
    __trap();
}

// Spins until *ptr >= target (acquire, system scope), bounded by shape.timeout_ns.
__device__ void wait_at_least(const int32_t* ptr, int32_t target, const GroupShape& shape, int64_t kind,
                              int64_t index, int32_t* layout, int64_t* error_record) {
    int32_t seen = load_acquire_sys(ptr);
    if (seen >= target) return;
    const uint64_t start = global_timer_ns();
    while (seen < target) {
        __nanosleep(100);
        seen = load_acquire_sys(ptr);
        const uint64_t waited = global_timer_ns() - start;
        if (seen < target && waited > static_cast<uint64_t>(shape.timeout_ns)) {
            fail(shape, layout, error_record, kind, index, target, seen, waited);
        }
    }
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Row tiles that a run of `count` rows touches, starting `rel_start` rows into a region (32-bit: the
// exchange kernel computes it per expert, and a region's rows fit int32).
__device__ __forceinline__ int32_t pieces_of(int32_t rel_start, int32_t count, int32_t tile_m) {
    return count == 0 ? 0 : (rel_start + count - 1) / tile_m - rel_start / tile_m + 1;
}

// The largest i in [0, n) with prefix[i] <= value, for a non-decreasing prefix[0..n] with
// prefix[0] <= value < prefix[n]: the part of a prefix-summed list that item `value` falls in
// (empty parts, whose prefixes repeat, are skipped).
__device__ __forceinline__ int part_of(const int32_t* prefix, int n, int64_t value) {
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (prefix[mid] <= value) lo = mid; else hi = mid;
    }
    return lo;
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

__global__ void exchange_kernel(GroupShape shape, const int64_t* expert_counts, const int64_t* rank_counts,
                                int32_t* meta, const int64_t* peer_meta, int32_t* layout, int64_t* error_record) {
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
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        for (int p = 0; p < P; ++p) {
            atomicExch_system(reinterpret_cast<int32_t*>(peer_meta[p]) + mo.exchange_flag + rank, generation);
        }
    }
    if (tid < P) {
        wait_at_least(meta + mo.exchange_flag + tid, generation, shape, kWaitExchangeFlag, tid, layout, error_record);
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

// The sort key of a route: its expert, or num_experts for a dropped one. An id past the last
// expert (no gate makes one) counts as dropped, so that every route still gets a place.
__device__ __forceinline__ int key_of(int32_t id, int num_experts) {
    return id < 0 || id >= num_experts ? num_experts : id;
}

// A stable counting sort with no pass between blocks. Keys are the experts and num_experts (the
// dropped routes). Each block takes KEYS consecutive keys: more than one only where one key a block
// would need more blocks than the GPU runs at once, since every block reads every route. Each warp
// owns a segment of consecutive route ids and walks it 32 routes at a time, lane l reading route
// base + l (coalesced): ballots count each key's routes in route-id order, block-wide prefixes over
// the warps' counts give each warp its first place per key, and a second walk places the routes.
constexpr int kPlanThreads = 1024;

template <int KEYS>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_kernel(const int32_t* indices, int64_t routes, int num_experts, int64_t* route_order,
                int64_t* route_position, int64_t* expert_counts) {
    constexpr unsigned kAll = 0xFFFFFFFFu;
    // With one key a block, the grid has one block per key: no block is short of keys.
    const int first_key = blockIdx.x * KEYS, keys = KEYS == 1 ? 1 : min(KEYS, num_experts + 1 - first_key);
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
    const int64_t segment = ceil_div(ceil_div(routes, num_warps), kWarp) * kWarp;
    const int64_t first = min(routes, warp * segment), last = min(routes, first + segment);
    int64_t mine[KEYS], smaller = 0, any = 0;  // the same in every lane of the warp
#pragma unroll
    for (int j = 0; j < KEYS; ++j) mine[j] = 0;
#pragma unroll 4
    for (int64_t base = first; base < last; base += kWarp) {
        const int64_t r = base + lane;
        // Past the segment: a key no block has.
        const int offset = (r < last ? key_of(indices[r], num_experts) : num_experts + 1) - first_key;
        smaller += __popc(__ballot_sync(kAll, offset < 0));
#pragma unroll
        for (int j = 0; j < KEYS; ++j) mine[j] += __popc(__ballot_sync(kAll, offset == j && j < keys));
    }
    int64_t place[KEYS];
    int64_t start;  // the first place of this block's first key
    block_inclusive_sum(lane == 0 ? smaller : 0, &start);
#pragma unroll
    for (int j = 0; j < KEYS; ++j) {
        // Lane 0 carries its warp's count into the block-wide sums: thread order is warp order.
        const int64_t warp_mine = lane == 0 ? mine[j] : 0;
        int64_t key_total;
        place[j] = __shfl_sync(kAll, start + block_inclusive_sum(warp_mine, &key_total) - warp_mine, 0);
        if (threadIdx.x == 0 && j < keys && first_key + j < num_experts) expert_counts[first_key + j] = key_total;
        start += key_total;
        any += mine[j];
    }
    for (int64_t base = first; base < last && any > 0; base += kWarp) {
        const int64_t r = base + lane;
        const int offset = (r < last ? key_of(indices[r], num_experts) : num_experts + 1) - first_key;
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const bool match = offset == j && j < keys;
            const unsigned matches = __ballot_sync(kAll, match);
            if (match) {
                const int64_t at = place[j] + __popc(matches & ((1u << lane) - 1u));
                route_order[at] = r;
                route_position[r] = at;
            }
            place[j] += __popc(matches);
        }
    }
}

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

// One warp copies a row of `vectors` 16-byte vectors, four loads in flight per lane (one at a time
// ran the backward's dispatch at a third of the forward's rate). With scale_it, each element is
// multiplied by `scale` in fp32 and rounded once.
template <typename T, bool FRESH>
__device__ __forceinline__ void copy_row(const int4* src, int4* dst, int64_t vectors, int lane, bool scale_it,
                                         float scale) {
    int64_t v = lane;
    if (scale_it) {
        for (; v + 3 * kWarp < vectors; v += 4 * kWarp) {
            int4 raw[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) raw[j] = load_vector<FRESH>(src + v + j * kWarp);
#pragma unroll
            for (int j = 0; j < 4; ++j) dst[v + j * kWarp] = scaled<T>(raw[j], scale);
        }
        for (; v < vectors; v += kWarp) dst[v] = scaled<T>(load_vector<FRESH>(src + v), scale);
        return;
    }
    for (; v + 3 * kWarp < vectors; v += 4 * kWarp) {
        int4 raw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) raw[j] = load_vector<FRESH>(src + v + j * kWarp);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[v + j * kWarp] = raw[j];
    }
    for (; v < vectors; v += kWarp) dst[v] = load_vector<FRESH>(src + v);
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

// Own rows, route by route. A piece is the part of one own expert's segment that falls in one row
// tile: copy its rows, then publish them with one release on that tile's counter.
template <typename T>
__device__ void copy_own_piece(const GroupShape& shape, int64_t piece, const char* tokens, int64_t num_tokens,
                               int64_t row_bytes, bool scaled, const float* route_scale, const int32_t* layout,
                               const DispatchTables& tables, int64_t* route_row) {
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
        copy_row<T, false>(src, reinterpret_cast<int4*>(recv + (region_row + r) * row_bytes), row_bytes / sizeof(int4),
                           lane, scaled, scaled ? route_scale[route] : 1.f);
        if (tables.outputs != nullptr) {  // read before the tile count below (see DispatchTables)
            const char* output = static_cast<const char*>(tables.outputs) + (region_row + r) * row_bytes;
            const float dot = row_dot_product<T, false>(src, reinterpret_cast<const int4*>(output),
                                                        row_bytes / sizeof(int4), lane);
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
        int32_t* counter = reinterpret_cast<int32_t*>(tables.peer_meta[d]) + shape.meta.tile_counter +
                           layout[lo.dest_tile + e] + tile;
        atomicAdd_system(counter, static_cast<int32_t>(r1 - r0));
    }
}

// Staging piece `piece` of this rank's rows for another rank: each token's row once, unscaled, with
// the recv rows (and gates) of its routes there; then one release on the piece's counter there. The
// token's first route there gets the staged row in route_stage, the others -1.
template <typename T>
__device__ void send_staged_piece(const GroupShape& shape, int64_t piece_item, const char* tokens, int64_t num_tokens,
                                  int64_t row_bytes, int top_k, const float* route_scale,
                                  const int32_t* layout, const DispatchTables& tables, int64_t* route_row) {
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
        copy_row<T, false>(reinterpret_cast<const int4*>(tokens + token * row_bytes),
                           reinterpret_cast<int4*>(stage + at * row_bytes), row_bytes / sizeof(int4), lane, false,
                           1.f);
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
__device__ void unstage_piece(const GroupShape& shape, int64_t piece_item, int64_t row_bytes, int top_k,
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
            copy_row<T, true>(src, reinterpret_cast<int4*>(recv + row * row_bytes), row_bytes / sizeof(int4), lane,
                              scale_rows, scale_rows ? __ldcg(stage_scale + at * top_k + j) : 1.f);
            if (tables.outputs != nullptr) {  // read before the tile count below (see DispatchTables)
                const char* output = static_cast<const char*>(tables.outputs) + row * row_bytes;
                const float dot = row_dot_product<T, true>(src, reinterpret_cast<const int4*>(output),
                                                           row_bytes / sizeof(int4), lane);
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
                                int top_k, bool scaled, const float* route_scale, int32_t* layout,
                                DispatchTables tables, int64_t* route_row, int64_t* error_record) {
    const LayoutOffsets& lo = shape.layout;
    const int64_t own_pieces = layout[lo.totals + kTotalPieces];
    const int64_t sent_pieces = layout[lo.stage_send + shape.ep_size - 1];
    const int64_t items = own_pieces + sent_pieces + layout[lo.stage_recv_piece + shape.ep_size];
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        if (item < own_pieces) {
            copy_own_piece<T>(shape, item, tokens, num_tokens, row_bytes, scaled, route_scale, layout, tables,
                              route_row);
        } else if (item < own_pieces + sent_pieces) {
            send_staged_piece<T>(shape, item - own_pieces, tokens, num_tokens, row_bytes, top_k, route_scale, layout,
                                 tables, route_row);
        } else {
            // `scaled`, not route_scale: a rank without routes has no scales but unstages scaled rows.
            unstage_piece<T>(shape, item - own_pieces - sent_pieces, row_bytes, top_k, scaled, layout, tables,
                             error_record);
        }
        __syncthreads();  // every thread is done with this item before the next one's waits and copies
    }
}

// Which tokens each rank gets (launch_rank_tokens): block d lists, in token order, the tokens with a
// kept route to one of d's experts.
__global__ void rank_tokens_kernel(const int32_t* indices, int64_t num_tokens, int top_k, int num_experts,
                                   int ep_size, int32_t* rank_tokens, int64_t* rank_counts) {
    const int d = blockIdx.x, L = num_experts / ep_size;
    int64_t listed = 0;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += blockDim.x) {
        const int64_t t = t0 + threadIdx.x;
        int64_t here = 0;
        for (int j = 0; t < num_tokens && j < top_k && !here; ++j) {
            const int e = indices[j * num_tokens + t];
            here = e >= 0 && e < num_experts && e / L == d;
        }
        int64_t total;
        const int64_t place = listed + block_inclusive_sum(here, &total) - here;
        if (here) rank_tokens[d * num_tokens + place] = static_cast<int32_t>(t);
        listed += total;
    }
    if (threadIdx.x == 0) rank_counts[d] = listed;
}

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
    const int64_t unit_tokens = max(int64_t{1}, min(unit_vectors / max(int64_t{1}, chunk_cols / 8),
                                                    kMaxCombineTopK / routes_per_token));
    const size_t staging = static_cast<size_t>(routes_per_token * unit_tokens) * 16;
    // A reduce unit's rows fit the same staging: the most that divide a staging piece.
    int64_t reduce_rows = kStagePieceRows;
    while (reduce_rows > unit_tokens) reduce_rows /= 2;
    combine_kernel<T, ROUTES, ITEMS><<<blocks, kCombineThreads, staging, stream>>>(
        shape, tables, weighted, gates, static_cast<T*>(out), top_k, num_tokens, hidden, chunk_cols, tile_n,
        num_chunks, unit_tokens, reduce_rows, layout, error_record);
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

cudaError_t launch_plan(const int32_t* indices, int64_t routes, int num_experts, int64_t* route_order,
                        int64_t* route_position, int64_t* expert_counts, cudaStream_t stream) {
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    const int keys = num_experts + 1;
    if (keys <= sms) {
        plan_kernel<1><<<keys, kPlanThreads, 0, stream>>>(indices, routes, num_experts, route_order,
                                                           route_position, expert_counts);
    } else if (keys <= 2 * sms) {
        plan_kernel<2><<<ceil_div(keys, 2), kPlanThreads, 0, stream>>>(indices, routes, num_experts, route_order,
                                                                        route_position, expert_counts);
    } else {  // past 4 keys a block, the counts' registers spill (1024 threads: 64 a thread at most)
        plan_kernel<4><<<ceil_div(keys, 4), kPlanThreads, 0, stream>>>(indices, routes, num_experts, route_order,
                                                                        route_position, expert_counts);
    }
    return cudaGetLastError();
}

cudaError_t launch_rank_tokens(const int32_t* indices, int64_t num_tokens, int top_k, int num_experts, int ep_size,
                               int32_t* rank_tokens, int64_t* rank_counts, cudaStream_t stream) {
    rank_tokens_kernel<<<ep_size, 1024, 0, stream>>>(indices, num_tokens, top_k, num_experts, ep_size, rank_tokens,
                                                     rank_counts);
    return cudaGetLastError();
}

cudaError_t launch_exchange(const GroupShape& shape, const int64_t* expert_counts, const int64_t* rank_counts,
                            int32_t* meta, const int64_t* peer_meta, int32_t* layout, int64_t* error_record,
                            cudaStream_t stream) {
    const size_t shared = static_cast<size_t>(exchange_shared_layout(shape).words) * sizeof(int32_t);
    // Past 48 KiB, static words included, a kernel must opt in (thousands of experts); the margin
    // covers the kernel's own static shared words.
    if (shared > 46 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(shared));
        if (err != cudaSuccess) return err;
    }
    exchange_kernel<<<1, 256, shared, stream>>>(shape, expert_counts, rank_counts, meta, peer_meta, layout,
                                                 error_record);
    return cudaGetLastError();
}

cudaError_t launch_dispatch(const GroupShape& shape, const void* tokens, int64_t num_tokens, int64_t hidden,
                            int top_k, int dtype_code, bool scaled, const float* route_scale, int32_t* layout,
                            const DispatchTables& tables, int64_t* route_row, int64_t* error_record, int blocks,
                            cudaStream_t stream) {
    const int64_t row_bytes = hidden * 2;  // bf16 and fp16 alike
    const char* rows = static_cast<const char*>(tokens);
    if (dtype_code == 0) {
        dispatch_kernel<__nv_bfloat16><<<blocks, 512, 0, stream>>>(shape, rows, num_tokens, row_bytes, top_k, scaled,
                                                                    route_scale, layout, tables, route_row,
                                                                    error_record);
    } else {
        dispatch_kernel<__half><<<blocks, 512, 0, stream>>>(shape, rows, num_tokens, row_bytes, top_k, scaled,
                                                             route_scale, layout, tables, route_row, error_record);
    }
    return cudaGetLastError();
}

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
