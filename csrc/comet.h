// ds_comet: communication kernels of the fused COMET pipeline.
//
// This header is plain CUDA C++ (no torch): the kernels, one file a stage (routing, exchange,
// dispatch, combine, gate: csrc/<stage>_kernels.cu), build with nvcc alone, and the torch binding
// (comet_binding.cpp) calls the launchers below with raw pointers and a stream.
//
// Per expert-parallel group every rank owns the same symmetric buffers, addressable by all ranks:
//   recv       [max_recv_rows, H]  rows dispatched to this rank, grouped by local expert
//   origin     [max_recv_rows]     int64 (source rank << 32 | position in the source's send list)
//   stage      [max_staged_rows, H] the dispatch's rows from other ranks, each token once (see
//                                  launch_dispatch), which this rank's dispatch copies to their routes' rows
//   stage_routes [max_staged_rows * top_k] int64 (recv row << 32 | send position) of each staged row's
//                                  routes here, top_k slots a staged row, -1 past its last route
//   stage_scale  [max_staged_rows * top_k] fp32 each such route's gate
//   reduced    [max_staged_rows, H] by staged row: the sum of that token's routes here (gate-weighted
//                                  in the forward), which its source's combine pulls, one row a token
//   row_dot    [max_recv_rows] fp32 the backward's dot product of each recv row's saved expert output
//                                  with its token's output gradient (the gate's gradient), pulled by
//                                  the row's source
//   meta       int32               exchanged counts, flags and arrival counters (MetaOffsets)
// and local arrays: the int32 layout the exchange kernel fills each call (LayoutOffsets; the
// combine also counts its claimed work units in one of its words); route_row [max_routes] int64
// (destination rank << 32 | recv row there) per send position, which the dispatch writes and the
// combine reads to find each route's output on its expert's rank; route_stage [max_routes] int32,
// for a route to another rank, its token's staged row there if it is the token's first route to
// that rank, else -1 (the token's other routes there are summed into that row's reduced row).
// max_staged_rows = min(max_recv_rows, (P - 1) x max tokens a rank): a staged row has a route
// here and is a token of another rank. GEMM2's output rows are not symmetric: each call writes them
// into a tensor of its own, by recv row, which only this rank's combine reads.
// recv and stage are sized for rows of the tokens' dtype; a dispatch of packed FP8 rows (fewer
// bytes a row, launch_dispatch) lays its rows in them at its own row stride.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace ds_comet {

// Every constant that the Python side needs too, stated once: DS_COMET_CONSTANTS(X) calls
// X(name, value) for each. Below it declares ds_comet::k<name>; ds_comet/kernels/constants.py reads
// these lines from this file, and the binding's codes() exports the compiled values, which the op
// loader checks against them (a build older than this header is refused).
#define DS_COMET_CONSTANTS(X)                                                                           \
    /* What a bounded wait waited for (the error record's kind word). */                                \
    X(WaitExchangeFlag, 1)  /* a peer's expert counts for this call */                                  \
    X(WaitDispatchTile, 2)  /* the rows of a GEMM1 row tile (waited on in the Triton GEMM) */           \
    X(WaitCombineChunk, 3)  /* expert outputs of a column chunk finished for this rank */               \
    X(WorkspaceOverflow, 4) /* more rows or tiles than the workspace holds */                           \
    X(WaitDispatchStage, 5) /* a peer's staged rows for this rank (one staging piece) */                \
    X(WaitCombineReduce, 6) /* this rank's GEMM2 rows of other ranks' tokens in a column chunk */       \
    X(HeaderMismatch, 7)    /* a peer's exchange header differs (index: source * HeaderWords + word) */ \
    /* Words of an exchange's header: the layer, the call, the direction, the settings' digest */       \
    /* (ds_comet/pipelines/exchange_header.py), each below 2**31. */                                    \
    X(HeaderWords, 4)                                                                                   \
    /* Rows of one staging piece: what a peer's dispatch publishes with one release. */                 \
    X(StagePieceRows, 32)                                                                               \
    /* The int64 error record in host memory the device can write (pinned, mapped through UVA), */      \
    /* and the word that holds each of its fields. */                                                   \
    X(ErrorRecordWords, 8)                                                                              \
    X(ErrorFilled, 0)   /* 1 once the fields below are written */                                       \
    X(ErrorRank, 1)     /* the rank that gave up */                                                     \
    X(ErrorKind, 2)     /* what it waited for: a Wait* kind, or WorkspaceOverflow */                    \
    X(ErrorIndex, 3)    /* which one of them (peer, tile, chunk) */                                     \
    X(ErrorTarget, 4)   /* the count it waited to reach */                                              \
    X(ErrorObserved, 5) /* the count it saw last */                                                     \
    X(ErrorWaitedNs, 6) /* how long it waited */                                                        \
    /* Longest a wait that gave up waits for another one to finish filling the error record. */         \
    X(ErrorRecordWaitNs, 1000000000)                                                                    \
    /* The combine stages each unit's routes in shared memory (16 bytes a route, within the 48 KB */    \
    /* a launch takes without opting in to more): a token can have at most this many. */                \
    X(MaxCombineTopK, 3000)                                                                             \
    /* Words of layout[totals:], and what each holds. */                                                \
    X(TotalsWords, 9)                                                                                   \
    X(TotalTiles, 0)        /* GEMM1 row tiles on this rank */                                          \
    X(TotalKept, 1)         /* routes this rank sends (kept by the gate) */                             \
    X(TotalRecvRows, 2)     /* rows this rank receives */                                               \
    X(TotalPieces, 3)       /* dispatch pieces this rank sends */                                       \
    X(TotalGeneration, 4)   /* the call generation */                                                   \
    X(TotalCombineClaim, 5) /* combine work units claimed so far (zeroed by the exchange) */            \
    /* 1 once a wait that gave up owns the error record (never reset: its trap ends the process's */    \
    /* CUDA context). */                                                                                \
    X(TotalErrorClaim, 6)                                                                               \
    X(TotalOwnRoutes, 7)  /* routes this rank sends to its own experts */                               \
    X(TotalStagedSent, 8) /* rows this rank stages on other ranks (a token once a rank) */

#define DS_COMET_DECLARE_CONSTANT(name, value) constexpr int64_t k##name = value;
DS_COMET_CONSTANTS(DS_COMET_DECLARE_CONSTANT)
#undef DS_COMET_DECLARE_CONSTANT

// Offsets (in int32 words) of the parts of the symmetric meta buffer. ds_comet/kernels/layout.py computes
// them (the one statement of the layout) and the binding passes them in.
struct MetaOffsets {
    int64_t counts;          // [2][P][E + P] every source's expert counts, then its staged rows per
                             // destination; double-buffered by call parity
    int64_t exchange_flag;   // [P] call generation each source published its counts for
    int64_t tile_counter;    // [max_tiles] rows arrived per GEMM1 row tile
    int64_t chunk_counter;   // [max_chunks] per column chunk: (row, column tile) pairs of this rank's routes to
                             // itself finished, plus rows of its tokens reduced on other ranks
    int64_t stage_counter;   // [max_stage_pieces] rows staged here per staging piece (by source, then piece)
    int64_t reduce_counter;  // [max_chunks] (row, column tile) pairs of other ranks' rows GEMM2 finished here,
                             // per column chunk; the chunk counters then count this rank's own routes and
                             // its tokens' reduced rows on other ranks
    int64_t generation;      // [1] this rank's call counter (only the owner touches it)
    int64_t header;          // [2][P][kHeaderWords] every source's exchange header, by call parity, beside
                             // its counts; the exchange kernel compares each with its own
};

// One exchange's header, by value: what every rank of the group must agree on (kHeaderWords words).
struct ExchangeHeader {
    int32_t words[kHeaderWords];
};

// Offsets (in int32 words) of the per-call layout the exchange kernel computes.
struct LayoutOffsets {
    // This rank as a destination (L = local experts).
    int64_t expert_start;  // [L+1] first recv row of each local expert's region
    int64_t tile_start;    // [L+1] first GEMM1 row tile of each local expert
    int64_t local_tiles;   // [L+1] prefix of the tiles holding only this rank's own rows
    int64_t remote_tiles;  // [L+1] prefix of the other tiles
    // This rank as a source (E = global experts).
    int64_t send_offset;       // [E+1] first entry of each expert's routes in the send list
    int64_t dest_row;          // [E] recv row of the destination where this rank's rows for e start
    int64_t dest_rel;          // [E] the same row relative to the start of e's region there
    int64_t dest_tile;         // [E] the destination's first row tile of e's region
    int64_t send_order;        // [E] experts in sending order: own rank first, then the next ranks
    int64_t piece_start;       // [E+1] prefix of dispatch pieces (one per own row tile touched; other ranks
                               // get their rows through staging)
    int64_t stage_send;        // [P] prefix of the staging pieces this rank sends, over the other ranks in
                               // sending order (rank + 1 first); the last entry is their total
    int64_t stage_dest_row;    // [P] first staging row of this rank's on each destination
    int64_t stage_dest_piece;  // [P] its first staging piece there
    int64_t stage_recv_row;    // [P+1] prefix of the staging rows this rank receives, by source rank
    int64_t stage_recv_piece;  // [P+1] prefix of the staging pieces this rank receives, by source rank
    int64_t totals;            // [kTotalsWords] indexed by kTotal*
};

struct GroupShape {
    int rank;         // this rank in the expert-parallel group
    int ep_size;      // P
    int num_experts;  // E (global)
    int tile_m;       // GEMM1 row tile
    int64_t max_recv_rows;
    int64_t max_tiles;
    int64_t max_chunks;
    int64_t max_stage_pieces;
    int64_t timeout_ns;  // bound of every wait
    MetaOffsets meta;
    LayoutOffsets layout;
};

// The routing kernels (routing_kernels.cu).
//
// The routing plan of ds_comet/pipelines/routing.py::plan_routes in one launch (no sort): indices holds k*S
// global expert ids (-1: dropped; an id >= E counts as dropped too) by flat route id; route_order
// lists the route ids by expert, each expert's in route-id order, dropped routes last;
// route_position is its inverse; expert_counts[E] counts the kept routes per expert.
cudaError_t launch_plan(const int32_t* indices, int64_t routes, int num_experts, int64_t* route_order,
                        int64_t* route_position, int64_t* expert_counts, cudaStream_t stream);

// Which tokens go to each rank, once a token: rank_tokens [P][S] int32 lists, for each rank d, the
// tokens with at least one kept route to one of d's experts, in token order (the rest of the row is
// not written); rank_counts [P] int64 counts them. indices as for launch_plan ([k][S]).
cudaError_t launch_rank_tokens(const int32_t* indices, int64_t num_tokens, int top_k, int num_experts, int ep_size,
                               int32_t* rank_tokens, int64_t* rank_counts, cudaStream_t stream);

// The count exchange (exchange_kernels.cu).
//
// Publishes this rank's expert counts and its staged rows per destination (rank_counts of
// launch_rank_tokens; its own entry is ignored) to every peer, waits for theirs, and computes the
// layout. One block. Zeroes this rank's arrival counters first: peers only write them after they saw
// this call's counts. Publishes `header` beside the counts and compares every source's with it once
// the source's flag is up: a difference stops the kernel (HeaderMismatch in the error record).
cudaError_t launch_exchange(const GroupShape& shape, const ExchangeHeader& header, const int64_t* expert_counts,
                            const int64_t* rank_counts, int32_t* meta, const int64_t* peer_meta, int32_t* layout,
                            int64_t* error_record, cudaStream_t stream);

// The dispatch (dispatch_kernels.cu).
//
// Where each route's row goes, and the peers' tables the dispatch writes through.
struct DispatchTables {
    const int64_t* route_order;        // [k S] of the routing plan
    const int64_t* route_position;     // [k S] its inverse
    const int32_t* rank_tokens;        // [P][S] of launch_rank_tokens
    const int64_t* rank_counts;        // [P] of launch_rank_tokens
    const int64_t* peer_recv;          // [P] each rank's recv
    const int64_t* peer_origin;        // [P] each rank's origin
    const int64_t* peer_stage;         // [P] each rank's stage
    const int64_t* peer_stage_routes;  // [P] each rank's stage_routes
    const int64_t* peer_stage_scale;   // [P] each rank's stage_scale
    const int64_t* peer_meta;          // [P] each rank's meta
    int32_t* route_stage;              // [k S] this rank's route_stage
    // The backward's gate gradient, or both null: the forward's expert outputs by recv row ([recv
    // rows, H] in the rows' dtype, bf16 for packed FP8 rows; kept by the caller), and this rank's
    // row_dot, which receives each route's dot product of its token's (unscaled) row with them. A row of outputs is
    // read only before the row's count on its GEMM1 tile: the backward's GEMM2, queued after GEMM1, writes over them.
    const void* outputs;
    float* row_dot;
};

// Puts every kept route's token row in its destination's recv buffer, records its origin (there) and
// its route_row (here), and bumps the destination's row-tile counter as rows land. Rows for this rank
// are copied route by route, one release per piece. A token's rows for another rank cross the link
// once: its row goes to that rank's staging rows with the list of its routes there, one release a
// staging piece; each rank's dispatch then copies the rows staged for it to its routes' recv rows
// (waiting, boundedly, for each piece). route_scale (indexed by flat route id; null only on a rank
// without routes) is each route's gate: it goes with the staged routes, for the combine's sums there.
// With `scaled` (the backward; the same on every rank of the group) each route's row is also
// multiplied by it where it is written to recv.
// A row is row_bytes bytes (a multiple of 16), recv and stage rows too, and holds `hidden` values.
// dtype_code: 0 = bf16, 1 = fp16, kPackedE4m3Code or kPackedE5m2Code = packed FP8 rows in that
// format (ds_comet/kernels/fp8_rows.py: `hidden` value bytes, then the fp32 scales of their
// kFp8TileElements-element tiles, then padding): the forward's under "dispatch": "fp8" (moved as
// bytes) and the backward's output gradients under "gradient_dispatch": "fp8", where `scaled`
// multiplies each tile's scale by the gate (exact: the scales are powers of two) and the value bytes
// go as they are, and the dot products with the (bf16) outputs take each value times its tile's
// scale, rounded to bf16, as the reference pipeline's emulation holds the row.
constexpr int kPackedE4m3Code = 2;
constexpr int kPackedE5m2Code = 3;
constexpr int kFp8TileElements = 128;
cudaError_t launch_dispatch(const GroupShape& shape, const void* tokens, int64_t num_tokens, int64_t row_bytes,
                            int64_t hidden, int top_k, int dtype_code, bool scaled, const float* route_scale,
                            int32_t* layout, const DispatchTables& tables, int64_t* route_row, int64_t* error_record,
                            int blocks, cudaStream_t stream);

// The combine (combine_kernels.cu).
//
// Where the combine reads each route's output, and what it writes besides the sums.
struct CombineTables {
    const void* expert_out;         // [recv rows, H] this call's GEMM2 output rows here, by recv row
    const int64_t* peer_reduced;    // [P] each rank's reduced
    const int64_t* peer_row_dot;    // [P] each rank's row_dot (read only with route_grad)
    const int64_t* peer_meta;       // [P] each rank's meta
    const int64_t* route_row;       // [max_routes] of the dispatch
    const int32_t* route_stage;     // [max_routes] of the dispatch
    const int64_t* route_position;  // [k S] of the routing plan
    const int64_t* stage_routes;    // this rank's stage_routes
    const float* stage_scale;       // this rank's stage_scale
    float* route_grad;              // [k S] by flat route id, or null: each route's row_dot (0 if dropped)
};

// Weighted top-k sum of the expert outputs, column chunk by column chunk, a token's routes on one
// rank summed there first. Per chunk, each rank first sums, for every row other ranks staged here,
// that token's routes here (weighted by their gates, unless gates is null) into its reduced row,
// once GEMM2 has finished the chunk's rows from other ranks, and counts them on the token's source;
// then each source, once its chunk counter says every rank is done with its rows, adds its own
// routes' rows (GEMM2's output here) and one reduced row per other rank that holds a route of the
// token (read over NVLink). With `weighted` (the forward; the same on every rank of the group) each
// route weighs its gate: gates ([k S] by flat route id; null only on a rank without routes) here,
// the staged gates on the other ranks; else every weight is 1 (the backward's sum of input
// gradients). With route_grad (the backward), each route's row_dot is
// collected too. dtype_code as above. Launched more than once between two exchanges (on different
// streams, any grid, every other argument the same), the launches share the work: each unit is
// reduced once, by whichever launch claims it first.
cudaError_t launch_combine(const GroupShape& shape, const CombineTables& tables, bool weighted, const float* gates,
                           void* out, int64_t top_k, int64_t num_tokens, int64_t hidden, int dtype_code,
                           int64_t chunk_cols, int64_t tile_n, int64_t num_chunks, int32_t* layout,
                           int64_t* error_record, int blocks, cudaStream_t stream);

// The gate's integer bookkeeping (gate_kernels.cu; ds_comet/integrations/legacy/gate.py says what each replaces).
// Top-2: gates [S, E] fp32; logits [S, E] of logits_code (0 = bf16, 1 = fp16: dtype_code; 2 =
// fp32); uniform [S, E] (torch.rand) or null for no second-choice sampling; capacity < 0 for no
// dropping; choices [2, S] int32 scratch; routes [2, S] int32 (-1: dropped); masks [3 or 2, S, E]
// fp32 one-hot (with dropping: first choices before it, then both choices after it; without: both
// choices); expert_counts [E] int64 before the drop.
cudaError_t launch_top2_routes(const float* gates, const void* logits, int logits_code, const float* uniform,
                               int64_t num_tokens, int num_experts, int64_t capacity, int32_t* choices, int32_t* routes,
                               float* masks, int64_t* expert_counts, cudaStream_t stream);

// The Gumbel noise the top-2 kernel adds to the logits, for each of count uniform draws (tests).
cudaError_t launch_gumbel_noise(const float* uniform, int64_t count, float* noise, cudaStream_t stream);

// Top-k, from torch.topk's top_idx and top_gate [S, k]: mask [S, E] fp32 one-hot of the choices,
// expert_counts [E] int64; with drop also ranked [S, E] (the chosen gate values; what stock's
// capacity topk ranks), kept [S, E] zeroed and indices [k, S] int32 all -1; without, indices =
// top_idx transposed (kept and ranked unused).
cudaError_t launch_topk_masks(const int64_t* top_idx, const float* top_gate, int64_t num_tokens, int top_k,
                              int num_experts, bool drop, float* mask, float* kept, float* ranked, int32_t* indices,
                              int64_t* expert_counts, cudaStream_t stream);

// Top-k dropping, from the capacity topk's token indices [C, E]: kept[s][e] = 1 and indices[j][s] = e
// for every route (s, j -> e) among its expert's C best.
cudaError_t launch_topk_keep(const int64_t* capacity_idx, int64_t entries, const int64_t* top_idx, int64_t num_tokens,
                             int top_k, int num_experts, const float* mask, float* kept, int32_t* indices,
                             cudaStream_t stream);

}  // namespace ds_comet
