"""The fused pipeline's kernel parameters for a layer's shape, and the workspace's bounds.

Every value can be pinned in the ``"moe"`` section; otherwise a rule on the shape picks it. The
rates below are H200 figures (docs/benchmarks.md); the rule uses their ratios, not their values.
"""

import math

from ..config import CometMoEConfig
from ..kernels.launch import FusedParameters

GEMM_FLOPS_PER_S = 600e12
LINK_BYTES_PER_S = 300e9
COMBINE_BYTES_PER_SM_S = 24e9  # the combine kernel on its own blocks, bytes read and written per SM
COMBINE_SHARE_OF_GEMM2 = 0.8  # the combine's blocks aim to finish in this share of GEMM2's time


def rule_n_chunks(hidden: int, ffn: int, tile_n: int, ep_size: int) -> int:
    """GEMM2's column chunks when the config leaves them open: 4 for wide FFNs, else 8, and at least
    two column tiles a chunk. A one-column chunk rereads every row of the activations with nothing
    for GEMM2's GROUP_M swizzle to share: that cost H2048's GEMM2 15 % alone, and its fused step
    0.1 ms of device time on 2 x H200 (docs/decisions.md).

    One chunk at EP=1: chunks exist so that the combine of one overlaps GEMM2 of the next, but
    alone in the group the combine runs after GEMM2, and each further chunk only rereads the rows.
    """
    if ep_size == 1:
        return 1
    return min(4 if ffn >= 8192 else 8, max(math.ceil(hidden / tile_n) // 2, 1))


def choose_parameters(
    config: CometMoEConfig,
    hidden: int,
    ffn: int,
    gated: bool,
    top_k: int,
    ep_size: int,
    max_tokens: int,
    elem_bytes: int,
    num_sms: int,
) -> FusedParameters:
    """The per-shape rule; every value can be pinned in the "moe" section. ``max_tokens`` >= 1: the
    group agrees on a workspace only at a call where some rank has tokens (selection.py)."""
    comm_blocks = config.comm_blocks
    if comm_blocks is None:
        routes = top_k * max_tokens
        flops = 2 * routes * hidden * ffn * (3 if gated else 2)
        link_bytes = 2 * routes * hidden * elem_bytes * (ep_size - 1) / ep_size
        share = (link_bytes / LINK_BYTES_PER_S) / (link_bytes / LINK_BYTES_PER_S + flops / GEMM_FLOPS_PER_S)
        comm_blocks = min(max(round(num_sms * share), 8), max(num_sms // 6, 1))
    comm_blocks = min(comm_blocks, max(num_sms - 1, 1))
    combine_blocks = config.combine_blocks
    if combine_blocks is None:
        # Enough blocks for the combine to keep pace with GEMM2 on the other SMs, and no more: what
        # they leave is reduced by every SM once GEMM2 ends, and each block held is a GEMM2 SM lost.
        # With b blocks: bytes / (b rate) = share x gemm2_s x n / (n - b), solved for b.
        routes = top_k * max_tokens
        combine_bytes = (routes + max_tokens) * hidden * elem_bytes
        gemm2_s = 2 * routes * hidden * ffn / GEMM_FLOPS_PER_S
        ratio = combine_bytes / (COMBINE_SHARE_OF_GEMM2 * gemm2_s * COMBINE_BYTES_PER_SM_S * num_sms)
        combine_blocks = math.ceil(num_sms * ratio / (1 + ratio))
    # Never more than the dispatch's: the combine's blocks can start as soon as the dispatch ends and
    # spin until GEMM2s finish, so with more of them than the dispatch frees, they could take SMs that
    # GEMM1's programs still need (the progress argument in pipelines/fused.py).
    combine_blocks = min(combine_blocks, comm_blocks)
    # Measured on H200 (docs/decisions.md): both GEMMs are fastest with 256-column tiles (GEMM2
    # since it stores rows locally). A gated GEMM1 holds two accumulators: at 256 columns they fit
    # neither the registers nor, with 128 rows and three stages, a Hopper SM's shared memory (240
    # KB of at most 227 KB), so its tile is at most 128 columns, pinned or not.
    tile_n = config.tile_n or 256
    gemm1_tile_n = min(tile_n, 128) if gated else tile_n
    if config.n_chunks is not None:
        n_chunks = min(config.n_chunks, math.ceil(hidden / tile_n))
    else:
        n_chunks = rule_n_chunks(hidden, ffn, tile_n, ep_size)
    return FusedParameters(
        comm_blocks=comm_blocks,
        combine_blocks=combine_blocks,
        tile_m=config.tile_m,
        tile_n=tile_n,
        n_chunks=n_chunks,
        gemm1_tile_n=gemm1_tile_n,
    )


def max_received_rows(
    max_tokens, top_k, num_experts, ep_size, drop_tokens, capacity_factor, eval_capacity_factor, min_capacity
) -> int:
    """Most rows one rank can receive in a call, from the gate's own capacity rule (without dropping:
    every rank's tokens sent to this rank's experts, each at most once per local expert)."""
    num_local = num_experts // ep_size
    rows = ep_size * min(top_k, num_local) * max_tokens
    if drop_tokens:
        factor = max(capacity_factor, eval_capacity_factor) * top_k
        capacity = max(math.ceil(max_tokens / num_experts * factor) + 1, min_capacity)
        rows = min(rows, num_experts * min(capacity, max_tokens))
    return max(rows, 1)


def offsets_overflow(recv_rows: int, routes: int, hidden: int, ffn: int, gated: bool) -> str | None:
    """Why the kernels' 32-bit row offsets cannot address this workspace, or None."""
    widest = max(hidden, ffn * (2 if gated else 1))
    if max(recv_rows, routes) * widest >= 2**31:
        return (
            f"{max(recv_rows, routes)} rows of up to {widest} elements exceed the fused kernels' 32-bit "
            'offsets; lower "moe": {"max_tokens_per_rank"} or the tokens per micro-batch'
        )
    return None
