"""A plain-Python statement of the fused pipeline's per-call layout (what the exchange kernel computes).

counts[q][e]: routes source rank q sends to global expert e. Each destination d holds, per local
expert l, one region of rows filled by the sources in the order d, d-1, d-2, ... (own rows first).
staged[q][d]: tokens of source rank q with a kept route to rank d, which q stages on d once a
token (nothing is staged on the own rank); each source's staged rows on d follow those of the lower
source ranks, in pieces of STAGE_PIECE_ROWS.
"""

from math import ceil

from ds_comet.kernels.constants import STAGE_PIECE_ROWS

STAGE_KEYS = ("stage_send", "stage_dest_row", "stage_dest_piece", "stage_recv_row", "stage_recv_piece")


def reference_layout(counts, rank, tile_m, staged=None):
    ep_size, num_experts = len(counts), len(counts[0])
    num_local = num_experts // ep_size
    out = {
        k: []
        for k in (
            "expert_start",
            "tile_start",
            "local_tiles",
            "remote_tiles",
            "send_offset",
            "dest_row",
            "dest_rel",
            "dest_tile",
            "send_order",
            "piece_start",
        )
    }
    dest_row, dest_rel, dest_tile = [0] * num_experts, [0] * num_experts, [0] * num_experts
    for d in range(ep_size):
        order = [(d - j) % ep_size for j in range(ep_size)]
        start = tiles = 0
        for l in range(num_local):
            e = d * num_local + l
            before_me = sum(counts[q][e] for q in order[: order.index(rank)])
            dest_row[e], dest_rel[e], dest_tile[e] = start + before_me, before_me, tiles
            if d == rank:
                out["expert_start"].append(start)
                out["tile_start"].append(tiles)
            rows = sum(counts[q][e] for q in range(ep_size))
            start += rows
            tiles += ceil(rows / tile_m)
        if d == rank:
            out["expert_start"].append(start)
            out["tile_start"].append(tiles)
    out["dest_row"], out["dest_rel"], out["dest_tile"] = dest_row, dest_rel, dest_tile

    local, remote = [0], [0]
    for l in range(num_local):
        full = counts[rank][rank * num_local + l] // tile_m
        tiles = out["tile_start"][l + 1] - out["tile_start"][l]
        local.append(local[-1] + full)
        remote.append(remote[-1] + tiles - full)
    out["local_tiles"], out["remote_tiles"] = local, remote

    offset = 0
    for e in range(num_experts):
        out["send_offset"].append(offset)
        offset += counts[rank][e]
    out["send_offset"].append(offset)
    pieces = 0
    for r in range(ep_size):
        d = (rank + r) % ep_size
        for l in range(num_local):
            e = d * num_local + l
            out["send_order"].append(e)
            out["piece_start"].append(pieces)
            c, o = counts[rank][e], dest_rel[e]
            if d == rank:  # rows for other ranks travel through staging
                pieces += 0 if c == 0 else (o + c - 1) // tile_m - o // tile_m + 1
    out["piece_start"].append(pieces)

    staged = [[0 if q == d or staged is None else staged[q][d] for d in range(ep_size)] for q in range(ep_size)]
    pieces_of = [[ceil(rows / STAGE_PIECE_ROWS) for rows in row] for row in staged]
    sent, out["stage_send"] = 0, []
    for r in range(ep_size - 1):
        out["stage_send"].append(sent)
        sent += pieces_of[rank][(rank + 1 + r) % ep_size]
    out["stage_send"].append(sent)
    out["stage_dest_row"] = [sum(staged[q][d] for q in range(rank)) for d in range(ep_size)]
    out["stage_dest_piece"] = [sum(pieces_of[q][d] for q in range(rank)) for d in range(ep_size)]
    out["stage_recv_row"] = [sum(staged[q][rank] for q in range(p)) for p in range(ep_size + 1)]
    out["stage_recv_piece"] = [sum(pieces_of[q][rank] for q in range(p)) for p in range(ep_size + 1)]
    out["totals"] = dict(
        tiles=out["tile_start"][-1],
        kept=offset,
        recv_rows=out["expert_start"][-1],
        pieces=pieces,
        own_routes=sum(counts[rank][rank * num_local + l] for l in range(num_local)),
        staged_sent=sum(staged[rank]),
    )
    return out


def layout_array(layout, offsets):
    """The int32 layout array the kernels read, laid out by the op's offsets."""
    import torch

    array = torch.zeros(offsets["layout_total"], dtype=torch.int32)
    for key in (
        "expert_start",
        "tile_start",
        "local_tiles",
        "remote_tiles",
        "send_offset",
        "dest_row",
        "dest_rel",
        "dest_tile",
        "send_order",
        "piece_start",
    ):
        values = torch.tensor(layout[key], dtype=torch.int32)
        array[offsets[key] : offsets[key] + len(values)] = values
    totals = layout["totals"]
    array[offsets["totals"] + offsets["total_tiles"]] = totals["tiles"]
    array[offsets["totals"] + offsets["total_kept"]] = totals["kept"]
    array[offsets["totals"] + offsets["total_recv_rows"]] = totals["recv_rows"]
    array[offsets["totals"] + offsets["total_pieces"]] = totals["pieces"]
    return array
