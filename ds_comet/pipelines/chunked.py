"""The reference pipeline's exchange in chunks: the experts of one chunk beside the exchange of the next.

For a group that spans nodes the fused kernels cannot run (they need peer memory inside one node),
and the link between nodes, not the GEMMs, bounds the layer (docs/design.md, "Groups that span
nodes"). Sent whole, the dispatch, the experts and the return run one after the other. Split into
C chunks, as Tutel's overlap degree does, every chunk's dispatch is posted at once on the process
group's stream; the experts run on each chunk as soon as it has arrived, and each chunk's return
is posted as soon as its experts are done, so the link and the GEMMs work at the same time. The
backward is the same three steps mirrored, chunk by chunk.

The rows are the whole exchange's: each token once to each rank that holds one of its routes, with
its routes' local experts and gates beside it (``routing.RankPlan``), and one row back per token and
rank. Chunk c takes rows ``[c B / C, (c + 1) B / C)`` of every block of B rows a rank sends to one
destination (``routing.chunk_bounds``). Both ends compute it from the counts they already
exchanged, so every rank posts the same collectives (per chunk: rows and routes out, one row back;
mirrored in the backward) and nothing more is exchanged. What
runs on a chunk's rows is the whole exchange's work on fewer rows; experts compute rows
independently, so the outputs are the whole exchange's (up to the GEMMs' rounding for other row
counts).

The bookkeeping (which rows go in which chunk) is made on the host from the counts the call reads
back anyway, and copied to the device once through pinned memory: no further host sync, which
would stall the host until the device caught up and serialise the chunks again.

The experts are called once per chunk, so hooks on them (which keep a layer off the fused
pipeline) fire once per chunk, each time on part of the rows; gradients reach the parameters the
experts hold (``LocalExperts.parameters``), not tensors an expert reads from elsewhere.
"""

from collections.abc import Callable, Sequence

import torch
from deepspeed import comm as dist
from torch import Tensor

from ..kernels.host_copies import host_to_device
from .collective_waits import CollectiveWaits
from .routing import chunk_bounds, exclusive_cumsum, runs

# (received rows [R, H], their routes [R, 2k], chunk) -> one row per received row [R, H]
ChunkWork = Callable[[Tensor, Tensor, int], Tensor]


class ChunkPlan:
    """Which rows travel in which chunk, for one call.

    ``send_rows`` and ``recv_rows`` are host ``[ep_size]`` lists: the rows this rank sends to each
    rank and the rows each rank sends to it. Device index tensors per chunk: ``send_index[c]``
    (positions in the sent rows, destination by destination); host lists: ``send_splits[c]`` and
    ``recv_splits[c]``.
    """

    def __init__(self, send_rows: Sequence[int], recv_rows: Sequence[int], chunks: int, device: torch.device):
        # Vectorised over ranks: the host builds this every call, for groups of up to hundreds of ranks.
        send, recv = torch.tensor(send_rows, dtype=torch.int64), torch.tensor(recv_rows, dtype=torch.int64)
        self.chunks = chunks
        send_bounds, recv_bounds = chunk_bounds(send, chunks), chunk_bounds(recv, chunks)  # [ep_size, chunks + 1]
        send_sizes = send_bounds[:, 1:] - send_bounds[:, :-1]  # [ep_size, chunks]
        self.send_splits: list[list[int]] = send_sizes.t().tolist()
        self.recv_splits: list[list[int]] = (recv_bounds[:, 1:] - recv_bounds[:, :-1]).t().tolist()
        block_starts = exclusive_cumsum(send)
        host = [runs(block_starts + send_bounds[:, c], send_sizes[:, c]) for c in range(chunks)]
        self.send_index = list(host_to_device(torch.cat(host), device).split([t.numel() for t in host]))


def _post(output: Tensor, rows: Tensor, output_splits: list[int], input_splits: list[int], group):
    """One uneven all-to-all, posted and not waited for."""
    return dist.all_to_all_single(
        output, rows, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group, async_op=True
    )


def _gather_chunks(parts: list[Tensor], index: list[Tensor], num_rows: int) -> Tensor:
    """The rows of every chunk's part, back in the order ``index`` took them from."""
    whole = parts[0].new_empty((num_rows,) + tuple(parts[0].shape[1:]))
    for part, where in zip(parts, index):
        whole.index_copy_(0, where, part)
    return whole


def _dispatch_work_return(
    plan: ChunkPlan, work: ChunkWork, waits: CollectiveWaits, rows: Tensor, routes: Tensor, track: bool
):
    """The forward's three steps, chunk by chunk: (the returned rows, in the sent rows' order; per
    chunk, the received rows and routes and what ``work`` made of them, with its graph when ``track``)."""

    def received(like: Tensor, c: int) -> Tensor:
        return like.new_empty((sum(plan.recv_splits[c]), like.shape[1]))

    # Every chunk's dispatch is posted before any work runs: they queue on the group's stream.
    arrived, dispatches = [], []
    for c in range(plan.chunks):
        arrived.append((received(rows, c), received(routes, c)))
        dispatches.append(
            [
                _post(
                    arrived[c][i],
                    sent.index_select(0, plan.send_index[c]),
                    plan.recv_splits[c],
                    plan.send_splits[c],
                    waits.group,
                )
                for i, sent in enumerate((rows, routes))
            ]
        )
    returned, returns, graphs = [], [], []
    for c in range(plan.chunks):
        for posted in dispatches[c]:
            waits.wait(posted, f"chunk {c + 1} of {plan.chunks} of the rows the other ranks send it", rows.is_cuda)
        with torch.set_grad_enabled(track):
            chunk_rows = arrived[c][0].requires_grad_(track and rows.requires_grad)
            chunk_routes = arrived[c][1].requires_grad_(track and routes.requires_grad)
            out = work(chunk_rows, chunk_routes, c)
        graphs.append((chunk_rows, chunk_routes, out))
        # In the work's dtype, which autocast may make other than the rows'.
        returned.append(out.new_empty((sum(plan.send_splits[c]), out.shape[1])))
        returns.append(_post(returned[c], out.detach(), plan.send_splits[c], plan.recv_splits[c], waits.group))
    for c, posted in enumerate(returns):
        waits.wait(posted, f"chunk {c + 1} of {plan.chunks} of its rows, back from their experts' ranks", rows.is_cuda)
    return _gather_chunks(returned, plan.send_index, rows.shape[0]), graphs


class ChunkedExchange(torch.autograd.Function):
    """(plan, work, waits, rows [R, H], routes [R, 2k], *parameters) -> ``work``'s rows for the sent
    rows, in their order, exchanged there and back in ``plan.chunks`` chunks.

    The parameters ``work`` reads are inputs so that their gradients flow back through this function:
    the backward runs each chunk's backward (from the graph the forward kept) between the chunk's
    exchanges, as the forward ran them, and sends the rows' and routes' gradients back.
    """

    @staticmethod
    def forward(
        ctx, plan: ChunkPlan, work: ChunkWork, waits: CollectiveWaits, rows: Tensor, routes: Tensor, *params: Tensor
    ) -> Tensor:
        returned, ctx.graphs = _dispatch_work_return(plan, work, waits, rows, routes, track=True)
        ctx.plan, ctx.waits, ctx.params, ctx.sent = plan, waits, params, (rows.shape, rows.dtype, routes.shape)
        return returned

    @staticmethod
    def backward(ctx, grad_returned: Tensor):
        if ctx.graphs is None:
            raise RuntimeError(
                "the chunked MoE exchange's backward runs once per forward: its experts' graphs are "
                'freed as it goes (retain_graph=True needs "moe": {"internode_chunks": 1})'
            )
        plan, waits = ctx.plan, ctx.waits
        (rows_shape, rows_dtype, routes_shape), wanted_params = ctx.sent, ctx.needs_input_grad[5:]
        params = [p for p, wanted in zip(ctx.params, wanted_params) if wanted]
        grad_returned = grad_returned.contiguous()
        arrived = [
            grad_returned.new_empty((sum(plan.recv_splits[c]), grad_returned.shape[1])) for c in range(plan.chunks)
        ]
        # The return's gradient goes back to the ranks that did the work, every chunk posted at once.
        arrivals = [
            _post(
                arrived[c],
                grad_returned.index_select(0, plan.send_index[c]),
                plan.recv_splits[c],
                plan.send_splits[c],
                waits.group,
            )
            for c in range(plan.chunks)
        ]
        param_grads: list[Tensor | None] = [None] * len(params)
        departed, departures = [], []
        for c in range(plan.chunks):
            waits.wait(
                arrivals[c],
                f"the gradients of chunk {c + 1} of {plan.chunks} of the rows it returned",
                grad_returned.is_cuda,
            )
            chunk_rows, chunk_routes, out = ctx.graphs[c]
            sources = [t for t in (chunk_rows, chunk_routes) if t.requires_grad]
            grads = [None] * (len(sources) + len(params))
            if out.requires_grad and sources + params:
                grads = list(torch.autograd.grad(out, sources + params, arrived[c], allow_unused=True))
            found = {id(t): g for t, g in zip(sources, grads)}
            for i, grad in enumerate(grads[len(sources) :]):  # summed over the chunks in fp32, rounded once
                if grad is not None:
                    param_grads[i] = grad.float() if param_grads[i] is None else param_grads[i] + grad
            back = []
            for sent, dtype in ((chunk_rows, rows_dtype), (chunk_routes, torch.float32)):
                grad = found.get(id(sent))
                back.append(sent.new_zeros(sent.shape, dtype=dtype) if grad is None else grad.to(dtype).contiguous())
            departed.append([grad.new_empty((sum(plan.send_splits[c]), grad.shape[1])) for grad in back])
            departures += [
                _post(departed[c][i], back[i], plan.send_splits[c], plan.recv_splits[c], waits.group) for i in range(2)
            ]
        for i, posted in enumerate(departures):
            waits.wait(
                posted,
                f"the gradients of chunk {i // 2 + 1} of {plan.chunks} of the rows it sent",
                grad_returned.is_cuda,
            )
        ctx.graphs = None
        grad_rows = _gather_chunks([part[0] for part in departed], plan.send_index, rows_shape[0])
        grad_routes = _gather_chunks([part[1] for part in departed], plan.send_index, routes_shape[0])
        found = iter(None if grad is None else grad.to(p.dtype) for grad, p in zip(param_grads, params))
        return (
            None,
            None,
            None,
            grad_rows,
            grad_routes,
            *[next(found) if wanted else None for wanted in wanted_params],
        )


# Eager under torch.compile, as the whole exchange is (reference.py): collectives and host bookkeeping.
@torch.compiler.disable
def chunked_exchange(
    rows: Tensor,
    routes: Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    chunks: int,
    work: ChunkWork,
    params: Sequence[Tensor],
    waits: CollectiveWaits,
) -> Tensor:
    """``work``'s rows for ``rows`` ([R, H], grouped by destination rank as ``send_rows`` says) and
    their ``routes`` ([R, 2k] fp32, ``reference.pack_routes``), exchanged there and back in ``chunks``
    chunks; ``params``: the parameters ``work`` reads; ``waits``: the group and the bound on each wait."""
    plan = ChunkPlan(send_rows, recv_rows, chunks, rows.device)
    if torch.is_grad_enabled() and (rows.requires_grad or routes.requires_grad or any(p.requires_grad for p in params)):
        return ChunkedExchange.apply(plan, work, waits, rows, routes, *params)
    return _dispatch_work_return(plan, work, waits, rows, routes, track=False)[0]


def rule_chunks(top_k: int, max_tokens: int) -> int:
    """Chunks when the config leaves them open: one per 4,096 routes a rank sends, from 2 to 8 (a
    chunk of fewer rows makes GEMMs too small to keep the GPU busy; Tutel's degrees stop at 8 too)."""
    return min(8, max(2, top_k * max_tokens // 4096))
