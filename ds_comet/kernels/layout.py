"""Where things sit in the fused pipeline's int32 metadata arrays (the one statement of it).

``meta`` is a symmetric buffer every rank of the group can address; ``layout`` is a local array
the exchange kernel fills each call. The CUDA kernels take these offsets as arguments and the
Triton GEMMs read the layout through them.
"""

from dataclasses import dataclass

from .constants import HEADER_WORDS, TOTALS_WORDS

# An exchange header's words, in the order the kernels compare them (ds_comet/pipelines/exchange_header.py
# says what each holds).
HEADER_FIELDS = ("layer", "call", "direction", "digest")
assert len(HEADER_FIELDS) == HEADER_WORDS, "csrc/comet.h's HeaderWords and HEADER_FIELDS disagree"


@dataclass(frozen=True)
class MetaOffsets:
    counts: int
    exchange_flag: int
    tile_counter: int
    chunk_counter: int
    stage_counter: int
    reduce_counter: int
    generation: int
    header: int
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
    stage_send: int
    stage_dest_row: int
    stage_dest_piece: int
    stage_recv_row: int
    stage_recv_piece: int
    totals: int
    total: int


def meta_offsets(ep_size: int, num_experts: int, max_tiles: int, max_chunks: int, max_stage_pieces: int) -> MetaOffsets:
    counts = 0  # per call parity and source: its routes per expert, then its staged rows per destination
    exchange_flag = counts + 2 * ep_size * (num_experts + ep_size)
    tile_counter = exchange_flag + ep_size
    # The four arrival counters are one run, which the exchange kernel zeroes in one loop.
    chunk_counter = tile_counter + max_tiles
    stage_counter = chunk_counter + max_chunks
    reduce_counter = stage_counter + max_stage_pieces
    generation = reduce_counter + max_chunks
    header = generation + 1  # per call parity and source: its exchange header
    return MetaOffsets(
        counts,
        exchange_flag,
        tile_counter,
        chunk_counter,
        stage_counter,
        reduce_counter,
        generation,
        header,
        header + 2 * ep_size * HEADER_WORDS,
    )


def layout_offsets(num_local: int, num_experts: int) -> LayoutOffsets:
    ep_size = num_experts // num_local
    sizes = [
        ("expert_start", num_local + 1),
        ("tile_start", num_local + 1),
        ("local_tiles", num_local + 1),
        ("remote_tiles", num_local + 1),
        ("send_offset", num_experts + 1),
        ("dest_row", num_experts),
        ("dest_rel", num_experts),
        ("dest_tile", num_experts),
        ("send_order", num_experts),
        ("piece_start", num_experts + 1),
        ("stage_send", ep_size),
        ("stage_dest_row", ep_size),
        ("stage_dest_piece", ep_size),
        ("stage_recv_row", ep_size + 1),
        ("stage_recv_piece", ep_size + 1),
        ("totals", TOTALS_WORDS),
    ]
    offsets, position = {}, 0
    for name, size in sizes:
        offsets[name] = position
        position += size
    return LayoutOffsets(total=position, **offsets)
