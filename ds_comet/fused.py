"""The fused COMET pipeline: layer0 = dispatch + GEMM1, layer1 = GEMM2 + combine, both ways.

Forward: the dispatch sends token rows, GEMM1 (with the activation) runs per row tile as rows
arrive, GEMM2 stores its output rows locally chunk by chunk and counts each finished chunk on the
rows' source ranks, and each source's combine reads its routes' rows from the expert ranks over
NVLink and sums them, weighted, as chunks finish.

Backward, through the same two primitives: the gradient of the combine is a dispatch (each route's
gate-scaled output gradient travels to its expert's rank), overlapped with the GEMM for the
gradient of the activation input (dY @ W2, times act'); the gradient of the dispatch is a combine
(the rows' input gradients dA @ W1, stored chunk by chunk on the expert ranks, are read by the
source ranks and summed per token). The weight gradients are grouped GEMMs that run while the
combine moves data.

Reuse across calls: a rank's next call writes ``recv`` and ``expert_out`` only after its next
exchange, which waits until every rank has published that call's counts, which each rank does only
after its previous call joined its combine; so no rank overwrites what a peer still reads.

Streams: the exchange and the GEMMs run on the caller's stream; the dispatch and then the combine
run on the buffer's communication stream, the dispatch on ``comm_blocks`` thread blocks beside GEMM1
and the combine on ``combine_blocks`` beside GEMM2, and the GEMMs take every other multiprocessor.
In the forward the combine is launched a second time on the caller's stream, after GEMM2, with
GEMM2's grid; both launches claim the same work units, so every SM reduces what is left once GEMM2
is done. No step reads anything back to the host.

Progress: the dispatch waits for nothing; GEMM1 tiles wait only for dispatches, GEMM2 waits for
nothing, and the combine waits only for GEMM2s. Every rank launches in the order exchange,
dispatch, GEMM1, GEMM2, combine, so each spinning kernel's producers are launched on every rank
before anything that could block a host behind it. GEMM1's grid leaves ``comm_blocks``
multiprocessors free, so a spinning GEMM1 tile can never keep a dispatch from being scheduled. The
communication stream's combine starts only after the dispatch and holds at most ``combine_blocks``
<= ``comm_blocks`` SMs (selection.py), so it and GEMM1 fit on the GPU together. The forward's
second combine starts only after this rank's GEMM2, when the only work peers may still need from
this GPU is its dispatch; it takes ``num_sms - combine_blocks`` SMs, and the SMs of the other
combine, which cannot start before the dispatch ends, stay for the dispatch. A unit is claimed only
by a running block, so no unit waits on a block that is not scheduled.
"""

import contextvars
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .experts import FusedExpert, expert_tensors_reason
from .layout import TOTAL_COMBINE_CLAIM, TOTAL_TILES
from .routing import RoutingPlan
from .workspace import CometBuffer

TILE_K = 64
GROUP_M = 8


@dataclass(frozen=True)
class FusedParameters:
    comm_blocks: int  # thread blocks of the dispatch, beside GEMM1
    combine_blocks: int  # thread blocks of the combine, beside GEMM2
    tile_m: int
    tile_n: int  # GEMM2's column tile, and the granularity of the combine's chunk counters
    n_chunks: int
    gemm1_tile_n: int = 128


TABLE_NAMES = ("w1", "b1", "w3", "b3", "w2", "b2")  # FusedExpert.tensors() order


class ExpertTables:
    """Device tables of the local experts' weight pointers, rebuilt only when a pointer moves."""

    def __init__(self):
        self._key: Optional[Tuple[int, ...]] = None
        self._tables = None

    def get(self, experts: List[FusedExpert], tokens: Tensor) -> dict:
        per_expert = [e.tensors() for e in experts]
        key = tuple(0 if t is None else t.data_ptr() for ts in per_expert for t in ts)
        if key != self._key:
            # New storage: a parameter was replaced or converted since the layer chose the fused path.
            reason = expert_tensors_reason(experts, tokens.shape[-1], tokens.dtype, tokens.device)
            if reason is not None:
                raise ValueError(f"the fused MoE kernels cannot read the experts' weights: {reason} "
                                 "(use \"overlap\": \"none\")")
            misaligned = sorted({TABLE_NAMES[i] for ts in per_expert for i, t in enumerate(ts)
                                 if t is not None and t.data_ptr() % 16})
            if misaligned:
                raise ValueError(f"expert weights {misaligned} are not 16-byte aligned; the fused "
                                 "kernels need aligned weights (use \"overlap\": \"none\")")
            pointers = torch.tensor(key, dtype=torch.int64).view(len(experts), len(TABLE_NAMES)).t().contiguous()
            stacked = pointers.to(tokens.device)
            self._tables = {name: stacked[i] for i, name in enumerate(TABLE_NAMES)}
            self._key = key
        return self._tables


def expert_parameters(experts: List[FusedExpert]) -> List[Tensor]:
    """The local experts' parameters in the order the fused autograd function takes them."""
    return [t for e in experts for t in e.tensors() if t is not None]


@dataclass
class _Launch:
    """What every kernel launch of one call shares."""
    buffer: CometBuffer
    experts: List[FusedExpert]
    params: FusedParameters
    tables: Dict[str, Tensor]
    hidden: int
    ffn: int
    gated: bool
    has_bias: bool
    activation: str

    @classmethod
    def of(cls, buffer, tokens, experts, tables: ExpertTables, params):
        first = experts[0]
        return cls(buffer, experts, params, tables.get(experts, tokens), tokens.shape[1],
                   first.first.out_features, first.gate is not None, first.first.bias is not None, first.activation)

    @property
    def grid(self) -> int:
        """Programs of GEMM1 (beside the dispatch) and of the weight gradients."""
        return max(1, self.buffer.num_sms - self.params.comm_blocks)

    @property
    def gemm2_grid(self) -> int:
        """Programs of GEMM2, beside the combine."""
        return max(1, self.buffer.num_sms - self.params.combine_blocks)

    @property
    def l_pow2(self) -> int:
        return next_power_of_2(len(self.experts) + 1)

    @property
    def chunking(self) -> Tuple[int, int]:
        """(column tiles per chunk, number of chunks) of the hidden dimension."""
        n_col_tiles = -(-self.hidden // self.params.tile_n)
        chunk_tiles = -(-n_col_tiles // self.params.n_chunks)
        return chunk_tiles, -(-n_col_tiles // chunk_tiles)

    def exchange(self, plan: RoutingPlan, row_limit: int):
        """Shares the counts and lays out the call; more than row_limit received rows stops the kernel."""
        b = self.buffer
        b.kernel_shape.max_recv_rows = row_limit  # what the exchange checks; the other kernels ignore it
        b.op.exchange(b.kernel_shape, plan.expert_counts, b.meta, b.peer_meta, b.layout, b.error_address)

    def dispatch(self, rows: Tensor, plan: RoutingPlan, scale: Tensor):
        """Sends rows[route token] (times scale[route], if scale is not empty) for every kept route."""
        main = torch.cuda.current_stream(rows.device)
        self.buffer.comm_stream.wait_stream(main)
        with torch.cuda.stream(self.buffer.comm_stream):
            self.send(rows, plan, scale, self.params.comm_blocks)

    def send(self, rows: Tensor, plan: RoutingPlan, scale: Tensor, blocks: int):
        """One launch of the dispatch kernel, on the current stream, over ``blocks`` thread blocks."""
        b = self.buffer
        b.op.dispatch(b.kernel_shape, rows, plan.route_order, b.layout, b.peer_recv, b.peer_origin, b.peer_meta,
                      b.route_row, scale, blocks)

    def combine(self, plan: RoutingPlan, gates: Tensor, out: Tensor, returned: Tensor, finish_on_main: bool):
        """out[token] = sum over its kept routes of gate (1 if gates is empty) x the route's expert output;
        each route's output row also goes to returned[send position] unless returned is empty.

        With ``finish_on_main`` a second launch on the current stream, queued after GEMM2, shares the
        work with the communication blocks: what they have not reduced when GEMM2 ends is reduced by
        every SM instead of by them alone.
        """
        with torch.cuda.stream(self.buffer.comm_stream):
            self.reduce(plan, gates, out, returned, self.params.combine_blocks)
        if finish_on_main:
            self.reduce(plan, gates, out, returned, self.gemm2_grid)

    def reduce(self, plan: RoutingPlan, gates: Tensor, out: Tensor, returned: Tensor, blocks: int):
        """One launch of the combine kernel, on the current stream, over ``blocks`` thread blocks."""
        b = self.buffer
        chunk_tiles, num_chunks = self.chunking
        b.op.combine(b.kernel_shape, b.peer_expert_out, b.route_row, plan.route_position, gates, out, returned,
                     chunk_tiles * self.params.tile_n, self.params.tile_n, num_chunks, b.meta, b.layout,
                     b.error_address, blocks)

    def join(self, device, *used_on_comm: Tensor):
        main = torch.cuda.current_stream(device)
        if not torch.cuda.is_current_stream_capturing():  # a graph's private pool outlives its streams anyway
            for tensor in used_on_comm:
                tensor.record_stream(self.buffer.comm_stream)
        main.wait_stream(self.buffer.comm_stream)

    def gemm1(self, rows: Tensor, out: Tensor, pre: Tensor, backward: bool, store_pre: bool,
              act: Optional[Tensor] = None):
        from .triton_gemm import ACTIVATION_CODES, gemm1_kernel
        b, lo, t = self.buffer, self.buffer.layout_offsets, self.tables
        with_descriptor_scratch(lambda: gemm1_kernel[(self.grid, )](
            rows, out, pre, out if act is None else act, t["w2"] if backward else t["w1"], t["w3"], t["b1"],
            t["b3"], b.layout, b.tile_counters, b.error_address, b.kernel_shape.timeout_ns, b.rank, self.hidden,
            self.ffn, len(self.experts), lo.expert_start, lo.tile_start, lo.local_tiles, lo.remote_tiles,
            lo.totals + TOTAL_TILES, L_POW2=self.l_pow2, BM=self.params.tile_m, BN=self.params.gemm1_tile_n,
            BK=TILE_K, GROUP_M=GROUP_M, NUM_PROGS=self.grid, HAS_BIAS=self.has_bias, GATED=self.gated,
            ACTIVATION=ACTIVATION_CODES[self.activation], BACKWARD=backward, STORE_PRE=store_pre,
            STORE_ACT=act is not None, WAIT=True, INTERPRET=_interpreting(), num_warps=8, num_stages=3))

    def gemm2(self, rows: Tensor, backward: bool):
        from .triton_gemm import gemm2_kernel
        b, lo, t = self.buffer, self.buffer.layout_offsets, self.tables
        chunk_tiles, _ = self.chunking
        if backward:  # rows = dA ([R, F] or [R, 2F]) @ W1 (+ up part @ W3); W1 is [F, H], i.e. [K, N]
            w, w3, bias, lda, second = t["w1"], t["w3"], t["b2"], rows.shape[1], self.gated
        else:  # rows = h @ W2^T; W2 is [H, F], i.e. [N, K]
            w, w3, bias, lda, second = t["w2"], t["w2"], t["b2"], self.ffn, False
        with_descriptor_scratch(lambda: gemm2_kernel[(self.gemm2_grid, )](
            rows, lda, w, w3, bias, b.origin, b.expert_out, b.peer_chunk_counters, b.layout, self.ffn, self.hidden,
            len(self.experts), lo.expert_start, lo.tile_start, lo.totals + TOTAL_TILES,
            EP_SIZE=b.shape.ep_size, L_POW2=self.l_pow2, BM=self.params.tile_m, BN=self.params.tile_n, BK=TILE_K,
            GROUP_M=GROUP_M, CHUNK_TILES=chunk_tiles, NUM_PROGS=self.gemm2_grid,
            HAS_BIAS=self.has_bias and not backward, SECOND=second, W_NK=not backward,
            num_warps=8 if self.params.tile_n >= 256 else 4, num_stages=3))

    def wgrad(self, a: Tensor, b: Tensor, M: int, N: int, dtype) -> Tuple[Tensor, Optional[Tensor]]:
        """Per local expert l: a[rows of l, :M]^T @ b[rows of l, :N] and a's column sums (bias)."""
        from .triton_gemm import wgrad_kernel
        num_local = len(self.experts)
        out = torch.empty((num_local, M, N), dtype=dtype, device=a.device)
        bias = torch.empty((num_local, M), dtype=dtype, device=a.device) if self.has_bias else out
        # GEMM1's grid, not GEMM2's: beside the combine's tail either would do, but in shape 1's
        # training step dW1 took 8.4 ms on GEMM2's 128 programs against 3.3 on 123 (not reproduced
        # alone: docs/performance.md, eighth session).
        wgrad_kernel[(self.grid, )](a, a.shape[1], b, b.shape[1], out, bias, self.buffer.layout,
                                    self.buffer.layout_offsets.expert_start, M, N, num_local, BM=128, BN=256, BK=64,
                                    GROUP_M=GROUP_M, NUM_PROGS=self.grid, HAS_BIAS=self.has_bias, num_warps=8,
                                    num_stages=3)  # within 4-10 % of torch._grouped_mm (scripts/wgrad_probe.py)
        return out, (bias if self.has_bias else None)


def with_descriptor_scratch(launch):
    """``launch()`` with Triton's allocator set for the GEMMs' device-side TMA descriptors.

    Triton keeps its allocator in a context variable, which autograd's backward threads do not
    inherit; setting it in a copy of the caller's context gives every launch one and leaves the
    caller's own allocator (if any) as it was.
    """
    import triton  # an extra: imported where the fused path runs

    def run():
        triton.set_allocator(_scratch)
        return launch()

    return contextvars.copy_context().run(run)


def _scratch(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    # On the device and stream Triton launches on: the launch uses it before anything queued after
    # it can reuse it. The caching allocator's blocks are 512-byte aligned, more than TMA asks.
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fused_forward(buffer: CometBuffer, tokens: Tensor, plan: RoutingPlan, gates: Tensor, experts: List[FusedExpert],
                  tables: ExpertTables, params: FusedParameters, out: Optional[Tensor] = None,
                  profile: Optional[dict] = None, saved: Optional[dict] = None, max_rows: Optional[int] = None) -> Tensor:
    """The experts' combined output for ``tokens`` ([S, H]); ``out`` ([S, H]) receives it if given.

    ``max_rows`` bounds the rows this rank can receive in this call (the gate's capacity in its
    current mode; default: the workspace's bound): the activations are sized by it, and the
    exchange kernel stops with an error rather than let a call exceed it.

    ``profile``, if given, receives callables that relaunch GEMM1, GEMM2, the combine and the dispatch
    alone (the last two on every SM, and on the communication blocks only): benchmarks.
    ``saved``, if given, receives what ``fused_backward`` needs: a copy of the received rows (the
    workspace is reused by the next call), each route's expert output (the combine writes them) and
    the products before the activation. Not the activations: the backward's GEMM1 recomputes them
    from those products as it reads them: a layer holds half the FFN-wide memory it did (a third
    less for gated experts, whose products are twice as wide).
    """
    num_tokens, hidden = tokens.shape
    buffer.check_tokens(num_tokens)
    buffer.raise_if_failed()
    launch = _Launch.of(buffer, tokens, experts, tables, params)
    tokens, gates = rows_for_kernels(tokens), gates.contiguous()
    rows = min(max_rows or buffer.shape.max_recv_rows, buffer.shape.max_recv_rows)
    h = torch.empty((rows, launch.ffn), dtype=tokens.dtype, device=tokens.device)
    pre = h
    if saved is not None:
        pre = torch.empty((rows, launch.ffn * (2 if launch.gated else 1)), dtype=tokens.dtype, device=tokens.device)
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=tokens.dtype, device=tokens.device)
    # Allocated before the dispatch orders the communication stream after the main one, as
    # everything the combine writes there must be: memory freed on the main stream before that
    # point may still be read by kernels queued before it.
    returned = _no_rows(tokens)
    if saved is not None:
        returned = saved["returned"] = torch.empty((plan.route_order.numel(), hidden), dtype=tokens.dtype,
                                                   device=tokens.device)

    launch.exchange(plan, rows)
    launch.dispatch(tokens, plan, _no_scale(tokens.device))

    def run_gemm1():
        launch.gemm1(buffer.recv, h, pre, backward=False, store_pre=saved is not None)

    def run_gemm2():
        launch.gemm2(h, backward=False)

    run_gemm1()
    run_gemm2()
    if saved is not None:
        # GEMM1 waited for every received row; keep them before the next call overwrites them.
        saved.update(rows=buffer.recv[:rows].clone(), pre=pre)
    if profile is not None:
        # Tiles and chunks stay counted, so each part relaunched alone measures its own rate. Every
        # rank's relaunches must be done before any rank's next exchange zeroes its counters (a late
        # dispatch would count rows of the old call); the bench synchronises and meets its peers
        # between parts.
        def rerun_combine(blocks):
            claim = buffer.layout_offsets.totals + TOTAL_COMBINE_CLAIM
            buffer.layout[claim:claim + 1].zero_()
            launch.reduce(plan, gates, out, _no_rows(tokens), blocks)

        def rerun_dispatch(blocks):  # the same rows to the same places; the tile counts only grow
            launch.send(tokens, plan, _no_scale(tokens.device), blocks)

        profile.update(gemm1=run_gemm1, gemm2=run_gemm2, combine=lambda: rerun_combine(buffer.num_sms),
                       combine_comm=lambda: rerun_combine(params.combine_blocks),
                       dispatch=lambda: rerun_dispatch(buffer.num_sms),
                       dispatch_comm=lambda: rerun_dispatch(params.comm_blocks))
    # The combine spins until peers' GEMM2s deliver, so it is launched last: a launch that blocks the
    # host (a lazily loaded module waits for the device) must never wait behind a spinning kernel
    # whose producers this rank has not launched yet.
    launch.combine(plan, gates, out, returned, finish_on_main=True)
    launch.join(tokens.device, tokens, plan.route_order, plan.route_position, gates, out, returned)
    return out


def fused_backward(buffer: CometBuffer, grad_out: Tensor, plan: RoutingPlan, gates: Tensor,
                   experts: List[FusedExpert], tables: ExpertTables, params: FusedParameters, saved: dict,
                   need_tokens: bool, need_gates: bool,
                   need_weights: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[List[Tensor]]]:
    """Gradients of ``fused_forward``'s output with respect to the tokens, the gates ([k, S], fp32) and
    ``expert_parameters(experts)``, from the output gradient ``grad_out`` ([S, H])."""
    from .triton_gemm import route_dot_kernel
    buffer.raise_if_failed()
    num_tokens, hidden = grad_out.shape
    grad_out = rows_for_kernels(grad_out)
    launch = _Launch.of(buffer, grad_out, experts, tables, params)
    device, dtype = grad_out.device, grad_out.dtype
    grad_tokens = grad_gates = weight_grads = None

    # The collective part runs whatever this rank needs, so that every rank of the group launches the
    # same kernels (a rank whose tokens need no gradient must still return its peers' rows).
    gates = gates.detach().contiguous()
    width = launch.ffn * (2 if launch.gated else 1)
    rows = saved["pre"].shape[0]
    grad_pre = torch.empty((rows, width), dtype=dtype, device=device)
    h = torch.empty((rows, launch.ffn), dtype=dtype, device=device) if need_weights else None
    # Allocated before the dispatch, which orders the communication stream after everything queued
    # so far: the combine writes it there, and a block freed later (``pre``) may still be read by
    # GEMM1 when the combine runs.
    grad_tokens = torch.empty_like(grad_out)
    launch.exchange(plan, rows)
    # The combine weighted each route by its gate, so each route's output gradient is the gate
    # times the token's gradient (rounded like stock's fp32 combine rounds it).
    launch.dispatch(grad_out, plan, gates)
    # Each saved tensor is dropped as soon as its last kernel is queued: the caching allocator
    # reuses its memory only for work queued after it on this stream, so the peak stays low.
    launch.gemm1(buffer.recv, grad_pre, saved.pop("pre"), backward=True, store_pre=False, act=h)
    launch.gemm2(grad_pre, backward=True)
    # Not finished on the main stream: the weight gradients queued there next hide its tail.
    launch.combine(plan, _no_scale(device), grad_tokens, _no_rows(grad_out), finish_on_main=False)
    if need_weights:
        # While the combine brings the input gradients home: dW2 = dY_l^T h_l, dW1 = dA_l^T x_l.
        dw2, db2 = launch.wgrad(buffer.recv, h, hidden, launch.ffn, dtype)
        del h
        dw1, db1 = launch.wgrad(grad_pre, saved.pop("rows"), width, hidden, dtype)
        weight_grads = _split_weight_grads(experts, launch.ffn, dw1, db1, dw2, db2)
    del grad_pre
    launch.join(device, grad_out, gates, plan.route_order, plan.route_position, grad_tokens)
    if not need_tokens:
        grad_tokens = None
    if need_gates:
        top_k = plan.top_k
        grad_gates = torch.empty((top_k * num_tokens, ), dtype=torch.float32, device=device)
        num_experts = plan.expert_counts.numel()
        route_dot_kernel[(top_k * num_tokens, )](saved["returned"], grad_out, plan.route_position,
                                                 plan.expert_counts, grad_gates, num_tokens, num_experts, hidden,
                                                 E_POW2=next_power_of_2(num_experts),
                                                 BLOCK=min(1024, next_power_of_2(hidden)), num_warps=4)
        grad_gates = grad_gates.view(top_k, num_tokens)
    saved.clear()
    return grad_tokens, grad_gates, weight_grads


def _split_weight_grads(experts, ffn, dw1, db1, dw2, db2) -> List[Tensor]:
    """Per-expert gradients in ``expert_parameters`` order, as views of the grouped results."""
    def per_expert(grads):  # one view per local expert, unbound in one call (indexing costs ~3 us a view)
        return [None] * len(experts) if grads is None else grads.unbind(0)

    # The local experts are alike (selection checks); a gated one's dw1 rows are the first
    # projection's, then the up projection's.
    gated = experts[0].gate is not None
    first_w, up_w = (dw1[:, :ffn], dw1[:, ffn:]) if gated else (dw1, None)
    first_b, up_b = (db1[:, :ffn], db1[:, ffn:]) if gated and db1 is not None else (db1, None)
    columns = [per_expert(g) for g in (first_w, first_b, up_w, up_b, dw2, db2)]  # FusedExpert.tensors() order
    grads = []
    for e, candidates in zip(experts, zip(*columns)):
        grads += [grad for param, grad in zip(e.tensors(), candidates) if param is not None]
    return grads


def rows_for_kernels(rows: Tensor) -> Tensor:
    """``rows`` contiguous and 16-byte aligned (the kernels move rows as 16-byte vectors): as it is
    when it already is, else a copy (a view starting mid-vector would fault on the device)."""
    rows = rows.contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def _no_rows(like: Tensor) -> Tensor:
    """An empty tensor: 'do not keep the routes' outputs' for the combine."""
    return like.new_empty((0, like.shape[1]))


def _no_scale(device) -> Tensor:
    """An empty fp32 tensor: 'no per-route scale' for the dispatch and the combine."""
    return torch.empty(0, dtype=torch.float32, device=device)


class FusedMoEFunction(torch.autograd.Function):
    """The fused forward with the fused backward: (call, tokens, gates, *expert parameters) -> output.

    ``call`` carries the workspace, the plan, the experts, their pointer tables and the parameters.
    The expert parameters are inputs so that autograd accumulates their gradients into each
    expert module's own ``.grad`` and DeepSpeed's hooks see them as they would with stock.
    """

    @staticmethod
    def forward(ctx, call: "FusedCall", tokens: Tensor, gates: Tensor, *expert_params: Tensor) -> Tensor:
        saved = {}
        out = fused_forward(call.buffer, tokens, call.plan, gates, call.experts, call.tables, call.params,
                            saved=saved, max_rows=call.max_rows)
        ctx.call, ctx.saved = call, saved
        ctx.save_for_backward(gates)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if ctx.saved is None:
            raise RuntimeError("the fused MoE backward runs once per forward: its saved activations are freed as "
                               "it goes (retain_graph=True needs \"moe\": {\"overlap\": \"none\"})")
        call, (gates, ) = ctx.call, ctx.saved_tensors
        need = ctx.needs_input_grad
        try:
            grad_tokens, grad_gates, weight_grads = fused_backward(
                call.buffer, grad_out, call.plan, gates, call.experts, call.tables, call.params, ctx.saved,
                need_tokens=need[1], need_gates=need[2], need_weights=any(need[3:]))
        except RuntimeError:
            call.buffer.raise_if_failed()
            raise
        ctx.saved = None
        if weight_grads is None:
            weight_grads = [None] * (len(need) - 3)
        return (None, grad_tokens, grad_gates, *weight_grads)


@dataclass(frozen=True)
class FusedCall:
    buffer: CometBuffer
    plan: RoutingPlan
    experts: List[FusedExpert]
    tables: ExpertTables
    params: FusedParameters
    max_rows: Optional[int] = None


def fused_moe(call: FusedCall, tokens: Tensor, gates: Tensor, params: List[Tensor]) -> Tensor:
    """The fused pipeline under autograd: forward now, ``fused_backward`` when gradients flow.
    ``params`` is ``expert_parameters(call.experts)``."""
    return FusedMoEFunction.apply(call, tokens, gates, *params)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
