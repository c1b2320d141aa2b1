"""Where things sit in the fused pipeline's int32 metadata arrays (the one statement of it).

``meta`` is a symmetric buffer every rank of the group can address; ``layout`` is a local array
the exchange kernel fills each call. The CUDA kernels take these offsets as arguments and the
Triton GEMMs read the layout through them. The codes at the bottom mirror ``csrc/comet.h``; the op
loader checks that both sides agree.
"""

from dataclasses import dataclass

# Indexes into layout[totals:], as csrc/comet.h's enum Total.
TOTAL_TILES, TOTAL_KEPT, TOTAL_RECV_ROWS, TOTAL_PIECES, TOTAL_GENERATION, TOTAL_COMBINE_CLAIM = 0, 1, 2, 3, 4, 5
TOTAL_ERROR_CLAIM = 6  # which wait that gave up fills the error record (the first to set it)
TOTALS_WORDS = 8
# What a bounded wait waited for, as csrc/comet.h's enum WaitKind.
WAIT_EXCHANGE_FLAG, WAIT_DISPATCH_TILE, WAIT_COMBINE_CHUNK, WORKSPACE_OVERFLOW = 1, 2, 3, 4
ERROR_RECORD_WORDS = 8
# Most routes per token the combine kernel stages (csrc/comet.h's kMaxCombineTopK).
MAX_COMBINE_TOP_K = 3000


@dataclass(frozen=True)
class MetaOffsets:
    counts: int
    exchange_flag: int
    tile_counter: int
    chunk_counter: int
    generation: int
    total: int


@dataclass(frozen=True)
class LayoutOffsets:
    expert_start: int
    tile_start: int
    local_tiles: int
    remote_tiles: int
    send_offset: int
    dest_row: int
    dest_rel: int
    dest_tile: int
    send_order: int
    piece_start: int
    totals: int
    total: int


def meta_offsets(ep_size: int, num_experts: int, max_tiles: int, max_chunks: int) -> MetaOffsets:
    counts = 0
    exchange_flag = counts + 2 * ep_size * num_experts
    tile_counter = exchange_flag + ep_size
    chunk_counter = tile_counter + max_tiles
    generation = chunk_counter + max_chunks
    return MetaOffsets(counts, exchange_flag, tile_counter, chunk_counter, generation, generation + 1)


def layout_offsets(num_local: int, num_experts: int) -> LayoutOffsets:
    sizes = [("expert_start", num_local + 1), ("tile_start", num_local + 1), ("local_tiles", num_local + 1),
             ("remote_tiles", num_local + 1), ("send_offset", num_experts + 1), ("dest_row", num_experts),
             ("dest_rel", num_experts), ("dest_tile", num_experts), ("send_order", num_experts),
             ("piece_start", num_experts + 1), ("totals", TOTALS_WORDS)]
    offsets, position = {}, 0
    for name, size in sizes:
        offsets[name] = position
        position += size
    return LayoutOffsets(total=position, **offsets)
