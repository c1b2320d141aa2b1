"""The fused COMET forward: layer0 = dispatch + GEMM1, layer1 = GEMM2 + combine.

Streams: the exchange, GEMM1 and GEMM2 run on the caller's stream; the dispatch and then the
combine run on the buffer's communication stream on ``comm_blocks`` thread blocks, and the GEMMs
take every other multiprocessor. No step reads anything back to the host.

Progress: the dispatch waits for nothing; GEMM1 tiles wait only for dispatches, GEMM2 waits for
nothing, and the combine waits only for GEMM2s. Every rank launches in the order exchange,
dispatch, GEMM1, GEMM2, combine, so each spinning kernel's producers are launched on every rank
before anything that could block a host behind it. The GEMM grids leave ``comm_blocks``
multiprocessors free, so a spinning GEMM1 tile can never keep a dispatch from being scheduled.
"""

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .experts import FusedExpert
from .layout import TOTAL_TILES
from .routing import RoutingPlan
from .workspace import CometBuffer

TILE_K = 64
GROUP_M = 8


@dataclass(frozen=True)
class FusedParameters:
    comm_blocks: int
    tile_m: int
    tile_n: int
    n_chunks: int


class ExpertTables:
    """Device tables of the local experts' weight pointers, rebuilt only when a pointer moves."""

    def __init__(self):
        self._key: Optional[Tuple[int, ...]] = None
        self._tables = None

    def get(self, experts: List[FusedExpert], device) -> dict:
        linears = {
            "w1": [e.first.weight for e in experts],
            "b1": [e.first.bias for e in experts],
            "w3": [e.gate.weight if e.gate is not None else None for e in experts],
            "b3": [e.gate.bias if e.gate is not None else None for e in experts],
            "w2": [e.second.weight for e in experts],
            "b2": [e.second.bias for e in experts],
        }
        key = tuple(0 if t is None else t.data_ptr() for ts in linears.values() for t in ts)
        if key != self._key:
            misaligned = [name for name, ts in linears.items() for t in ts if t is not None and t.data_ptr() % 16]
            if misaligned:
                raise ValueError(f"expert weights {sorted(set(misaligned))} are not 16-byte aligned; the fused "
                                 "kernels need aligned weights (use \"overlap\": \"none\")")
            pointers = torch.tensor(key, dtype=torch.int64).view(len(linears), len(experts))
            stacked = pointers.to(device)
            self._tables = {name: stacked[i] for i, name in enumerate(linears)}
            self._key = key
        return self._tables


def _grid(buffer: CometBuffer, params: FusedParameters) -> int:
    return max(1, buffer.num_sms - params.comm_blocks)


def fused_forward(buffer: CometBuffer, tokens: Tensor, plan: RoutingPlan, gates: Tensor, experts: List[FusedExpert],
                  tables: ExpertTables, params: FusedParameters, out: Optional[Tensor] = None,
                  profile: Optional[dict] = None) -> Tensor:
    """The experts' combined output for ``tokens`` ([S, H]); ``out`` ([S, H]) receives it if given.

    ``profile``, if given, receives callables that relaunch GEMM1 and GEMM2 alone (benchmarks).
    """
    from .triton_gemm import ACTIVATION_CODES, gemm1_kernel, gemm2_kernel

    num_tokens, hidden = tokens.shape
    buffer.check_tokens(num_tokens)
    buffer.raise_if_failed()
    shape, lo, op = buffer.shape, buffer.layout_offsets, buffer.op
    first = experts[0]
    ffn = first.first.out_features
    num_local = len(experts)
    gated = first.gate is not None
    has_bias = first.first.bias is not None
    weight_tables = tables.get(experts, tokens.device)
    tokens = tokens.contiguous()
    gates = gates.contiguous()
    main = torch.cuda.current_stream(tokens.device)
    comm = buffer.comm_stream
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    l_pow2 = next_power_of_2(num_local + 1)
    grid = _grid(buffer, params)
    n_col_tiles = -(-hidden // params.tile_n)
    chunk_tiles = -(-n_col_tiles // params.n_chunks)
    num_chunks = -(-n_col_tiles // chunk_tiles)

    h = torch.empty((shape.max_recv_rows, ffn), dtype=tokens.dtype, device=tokens.device)
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=tokens.dtype, device=tokens.device)

    op.exchange(buffer.kernel_shape, plan.expert_counts, buffer.meta, buffer.peer_meta, buffer.layout,
                buffer.error_address)
    comm.wait_stream(main)
    with torch.cuda.stream(comm):
        op.dispatch(buffer.kernel_shape, tokens, plan.route_order, buffer.layout, buffer.peer_recv,
                    buffer.peer_origin, buffer.peer_meta, params.comm_blocks)
    if not torch.cuda.is_current_stream_capturing():  # a graph's private pool outlives its streams anyway
        for tensor in (tokens, plan.route_order, plan.route_position, gates, out):
            tensor.record_stream(comm)

    def run_gemm1():
        gemm1_kernel[(grid, )](
            buffer.recv, h, weight_tables["w1"], weight_tables["b1"], weight_tables["w3"], weight_tables["b3"],
            buffer.layout, buffer.tile_counters, buffer.error_address, buffer.kernel_shape.timeout_ns, buffer.rank,
            hidden, ffn, num_local, lo.expert_start, lo.tile_start, lo.local_tiles, lo.remote_tiles,
            lo.totals + TOTAL_TILES, L_POW2=l_pow2, BM=params.tile_m, BN=params.tile_n, BK=TILE_K, GROUP_M=GROUP_M,
            NUM_PROGS=grid, HAS_BIAS=has_bias, GATED=gated, ACTIVATION=ACTIVATION_CODES[first.activation],
            WAIT=True, INTERPRET=interpret, num_warps=8, num_stages=3)

    def run_gemm2():
        gemm2_kernel[(grid, )](
            h, weight_tables["w2"], weight_tables["b2"], buffer.origin, buffer.peer_ret, buffer.peer_chunk_counters,
            buffer.layout, hidden, ffn, num_local, lo.expert_start, lo.tile_start, lo.totals + TOTAL_TILES,
            EP_SIZE=shape.ep_size, L_POW2=l_pow2, BM=params.tile_m, BN=params.tile_n, BK=TILE_K, GROUP_M=GROUP_M,
            CHUNK_TILES=chunk_tiles, NUM_PROGS=grid, HAS_BIAS=has_bias, num_warps=8, num_stages=3)

    run_gemm1()
    run_gemm2()
    if profile is not None:
        # Relaunching the GEMMs alone is safe until the next call's exchange resets the counters.
        profile.update(gemm1=run_gemm1, gemm2=run_gemm2)
    # The combine spins until peers' GEMM2s deliver, so it is launched last: a launch that blocks the
    # host (a lazily loaded module waits for the device) must never wait behind a spinning kernel
    # whose producers this rank has not launched yet.
    with torch.cuda.stream(comm):
        op.combine(buffer.kernel_shape, buffer.ret, plan.route_position, gates, out, chunk_tiles * params.tile_n,
                   params.tile_n, num_chunks, buffer.meta, buffer.layout, buffer.error_address, params.comm_blocks)
    main.wait_stream(comm)
    return out


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
