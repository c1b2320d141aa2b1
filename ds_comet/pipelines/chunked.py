"""The reference pipeline's exchange in chunks: the experts of one chunk beside the exchange of the next.

For a group that spans nodes the fused kernels cannot run (they need peer memory inside one node),
and the link between nodes, not the GEMMs, bounds the layer (docs/design.md, "Groups that span
nodes"). Sent whole, the dispatch, the experts and the return run one after the other. Split into
C chunks, as Tutel's overlap degree does, every chunk's dispatch is posted at once on the process
group's stream; the experts run on each chunk as soon as it has arrived, and each chunk's return
is posted as soon as its experts are done, so the link and the GEMMs work at the same time. The
backward is the same three steps mirrored, chunk by chunk.

Chunk c takes rows ``[c B / C, (c + 1) B / C)`` of every block of B rows a rank sends to one
destination. Both ends compute it from the counts they already exchanged, so every rank posts the
same C collectives each way and nothing more is exchanged. Rows keep their expert-major order
inside a chunk, so each expert runs on its rows of the chunk; experts compute rows independently,
so the outputs are the whole exchange's (up to the GEMM's rounding for other row counts).

The bookkeeping (which rows go in which chunk) is made on the host from the counts the call reads
back anyway, and copied to the device once through pinned memory: no further host sync, which
would stall the host until the device caught up and serialise the chunks again.

The experts are called once per chunk, so hooks on them (which keep a layer off the fused
pipeline) fire once per chunk, each time on part of the rows; gradients reach the parameters the
experts hold (``LocalExperts.parameters``), not tensors an expert reads from elsewhere.
"""

from typing import List, Optional, Sequence

import torch
from deepspeed import comm as dist
from torch import Tensor

from .expert_weights import LocalExperts
from .routing import expert_major_order, host_to_device, runs


def chunk_bounds_of(rows: Tensor, chunks: int) -> Tensor:
    """[blocks, chunks + 1]: where each chunk of each block of ``rows[b]`` rows starts, and the end."""
    return rows[:, None] * torch.arange(chunks + 1) // chunks


class ChunkPlan:
    """Which rows travel in which chunk, for one call.

    ``send_counts`` and ``recv_counts`` are host ``[ep_size][num_local]`` lists: the rows this rank
    sends to each rank's local experts, and the rows each rank sends to this rank's local experts.
    Device index tensors per chunk: ``send_index[c]`` (positions in the sent rows, destination by
    destination), ``by_expert[c]`` (the received rows of the chunk in expert-major order) and
    ``by_source[c]`` (its inverse); host lists: ``send_splits[c]``, ``recv_splits[c]`` and
    ``expert_rows[c]`` (the chunk's rows per local expert).
    """

    def __init__(self, send_counts: Sequence[Sequence[int]], recv_counts: Sequence[Sequence[int]], chunks: int,
                 device: torch.device):
        # Vectorised over ranks and experts: the host builds this every call, for groups of up to
        # hundreds of ranks.
        send, recv = torch.tensor(send_counts, dtype=torch.int64), torch.tensor(recv_counts, dtype=torch.int64)
        ep_size, num_local = send.shape
        self.chunks = chunks
        send_bounds = chunk_bounds_of(send.sum(1), chunks)  # [ep_size, chunks + 1], within each block
        recv_bounds = chunk_bounds_of(recv.sum(1), chunks)
        send_sizes = send_bounds[:, 1:] - send_bounds[:, :-1]  # [ep_size, chunks]
        self.send_splits: List[List[int]] = send_sizes.t().tolist()
        self.recv_splits: List[List[int]] = (recv_bounds[:, 1:] - recv_bounds[:, :-1]).t().tolist()
        # Rows of each (source, chunk, local expert): a source's block is in local-expert order.
        expert_bounds = torch.cat([torch.zeros(ep_size, 1, dtype=torch.int64), recv.cumsum(1)], dim=1)
        per_expert = (torch.minimum(recv_bounds[:, 1:, None], expert_bounds[:, None, 1:]) -
                      torch.maximum(recv_bounds[:, :-1, None], expert_bounds[:, None, :-1])).clamp_min(0)
        self.expert_rows: List[List[int]] = per_expert.sum(0).tolist()
        block_starts = send.sum(1).cumsum(0) - send.sum(1)
        host = []
        for c in range(chunks):
            host.append(runs(block_starts + send_bounds[:, c], send_sizes[:, c]))
            host += expert_major_order(per_expert[:, c, :])  # the chunk's rows, arrived and by expert
        parts = host_to_device(torch.cat(host).to(torch.int64), device).split([t.numel() for t in host])
        self.send_index = list(parts[0::3])
        self.by_expert = list(parts[1::3])
        self.by_source = list(parts[2::3])


def _post(output: Tensor, rows: Tensor, output_splits: List[int], input_splits: List[int], group):
    """One uneven all-to-all, posted and not waited for."""
    return dist.all_to_all_single(output, rows, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                  group=group, async_op=True)


def _dispatch_experts_return(plan: ChunkPlan, experts: LocalExperts, group, sent: Tensor, track: bool):
    """The forward's three steps, chunk by chunk: (outputs in the sent rows' order, per-chunk
    (expert input rows, expert outputs) with their graph when ``track``)."""
    hidden = sent.shape[1]
    received = [sent.new_empty((sum(plan.recv_splits[c]), hidden)) for c in range(plan.chunks)]
    # Every chunk's dispatch is posted before any expert runs: they queue on the group's stream.
    dispatches = [_post(received[c], sent.index_select(0, plan.send_index[c]), plan.recv_splits[c],
                        plan.send_splits[c], group) for c in range(plan.chunks)]
    returned, returns, graphs = [], [], []
    for c in range(plan.chunks):
        dispatches[c].wait()
        with torch.set_grad_enabled(track):
            rows = received[c].index_select(0, plan.by_expert[c]).requires_grad_(track and sent.requires_grad)
            out = experts.run(rows, plan.expert_rows[c])
        graphs.append((rows, out))
        # In the experts' dtype, which autocast may make other than the rows'.
        returned.append(out.new_empty((sum(plan.send_splits[c]), hidden)))
        returns.append(_post(returned[c], out.detach().index_select(0, plan.by_source[c]), plan.send_splits[c],
                             plan.recv_splits[c], group))
    outputs = returned[0].new_empty(sent.shape)
    for c in range(plan.chunks):
        returns[c].wait()
        outputs.index_copy_(0, plan.send_index[c], returned[c])
    return outputs, graphs


class ChunkedExperts(torch.autograd.Function):
    """(plan, experts, group, sent rows [R, H], *expert parameters) -> the experts' outputs for the
    sent rows, in the sent rows' order, exchanged there and back in ``plan.chunks`` chunks.

    The parameters are inputs so that their gradients flow back through this function: the
    backward runs each chunk's experts' backward (from the graph the forward kept) between the
    chunk's exchanges, as the forward ran them.
    """

    @staticmethod
    def forward(ctx, plan: ChunkPlan, experts: LocalExperts, group, sent: Tensor, *params: Tensor) -> Tensor:
        outputs, ctx.graphs = _dispatch_experts_return(plan, experts, group, sent, track=True)
        ctx.plan, ctx.group, ctx.params, ctx.sent_dtype = plan, group, params, sent.dtype
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs: Tensor):
        if ctx.graphs is None:
            raise RuntimeError("the chunked MoE exchange's backward runs once per forward: its experts' graphs are "
                               "freed as it goes (retain_graph=True needs \"moe\": {\"internode_chunks\": 1})")
        plan, group = ctx.plan, ctx.group
        wanted_params = ctx.needs_input_grad[4:]
        params = [p for p, wanted in zip(ctx.params, wanted_params) if wanted]
        hidden = grad_outputs.shape[1]
        grad_outputs = grad_outputs.contiguous()
        grad_returned = [grad_outputs.new_empty((sum(plan.recv_splits[c]), hidden)) for c in range(plan.chunks)]
        # The return's gradient goes back to the experts' ranks, every chunk posted at once.
        arrivals = [_post(grad_returned[c], grad_outputs.index_select(0, plan.send_index[c]), plan.recv_splits[c],
                          plan.send_splits[c], group) for c in range(plan.chunks)]
        param_grads: List[Optional[Tensor]] = [None] * len(params)
        grad_sent_parts, departures = [], []
        for c in range(plan.chunks):
            arrivals[c].wait()
            rows, out = ctx.graphs[c]
            inputs = ([rows] if rows.requires_grad else []) + params
            grads = list(torch.autograd.grad(out, inputs, grad_returned[c].index_select(0, plan.by_expert[c]),
                                             allow_unused=True)) if inputs else []
            if rows.requires_grad:
                grad_received = grads.pop(0).index_select(0, plan.by_source[c])
            else:
                grad_received = grad_outputs.new_zeros((sum(plan.recv_splits[c]), hidden), dtype=ctx.sent_dtype)
            for i, grad in enumerate(grads):  # summed over the chunks in fp32, rounded once
                if grad is not None:
                    param_grads[i] = grad.float() if param_grads[i] is None else param_grads[i] + grad
            grad_sent_parts.append(grad_outputs.new_empty((sum(plan.send_splits[c]), hidden), dtype=ctx.sent_dtype))
            departures.append(_post(grad_sent_parts[c], grad_received, plan.send_splits[c], plan.recv_splits[c],
                                    group))
        grad_sent = grad_outputs.new_empty(grad_outputs.shape, dtype=ctx.sent_dtype)
        for c in range(plan.chunks):
            departures[c].wait()
            grad_sent.index_copy_(0, plan.send_index[c], grad_sent_parts[c])
        ctx.graphs = None
        found = iter(None if grad is None else grad.to(p.dtype) for grad, p in zip(param_grads, params))
        return (None, None, None, grad_sent, *[next(found) if wanted else None for wanted in wanted_params])


# Eager under torch.compile, as the whole exchange is (reference.py): collectives and host bookkeeping.
@torch.compiler.disable
def chunked_experts(sent: Tensor, send_counts: Sequence[Sequence[int]], recv_counts: Sequence[Sequence[int]],
                    chunks: int, experts: LocalExperts, group) -> Tensor:
    """The experts' outputs for ``sent`` ([R, H], grouped by destination rank, then local expert, as
    ``send_counts`` says), exchanged there and back in ``chunks`` chunks."""
    plan = ChunkPlan(send_counts, recv_counts, chunks, sent.device)
    params = experts.parameters()
    if torch.is_grad_enabled() and (sent.requires_grad or any(p.requires_grad for p in params)):
        return ChunkedExperts.apply(plan, experts, group, sent, *params)
    return _dispatch_experts_return(plan, experts, group, sent, track=False)[0]


def rule_chunks(top_k: int, max_tokens: int) -> int:
    """Chunks when the config leaves them open: one per 4,096 routes a rank sends, from 2 to 8 (a
    chunk of fewer rows makes GEMMs too small to keep the GPU busy; Tutel's degrees stop at 8 too)."""
    return min(8, max(2, top_k * max_tokens // 4096))
