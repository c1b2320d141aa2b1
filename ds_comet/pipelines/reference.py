"""The reference pipeline: dispatch, local experts and combine in plain torch.

It runs on any torch.distributed backend (gloo on CPU, NCCL on GPU) and is the numerical ground
truth for the fused kernels. Unlike stock DeepSpeed, which sends a zero-padded ``[E, C, M]``
capacity buffer, it sends each token once to each rank that holds one of its kept routes, with
uneven all-to-all splits; the expert's rank sums the token's routes there before one row returns.
The arithmetic per route is stock's, so outputs and gradients match stock's (and AutoEP's) within
the rounding of those partial sums. Where the group spans nodes the same rows travel in chunks
(chunked.py).
"""

import torch
from deepspeed import comm as dist
from torch import Tensor

from .chunked import chunked_exchange
from .collective_waits import CollectiveWaits, failures_noted
from .exchange_header import ExchangeHeader, LayerHeaders, check_header
from .expert_weights import LocalExperts
from .interface import Pipeline
from .policy import saved_tensor_hooks_active
from .routing import RankPlan, plan_rank_rows


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single with uneven splits, its wait bounded (``waits``; ``what`` names the rows in
    the error); its gradient is the same exchange reversed."""

    @staticmethod
    def forward(
        ctx, rows: Tensor, send_splits: list[int], recv_splits: list[int], waits: CollectiveWaits, what: str
    ) -> Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.waits, ctx.what = send_splits, recv_splits, waits, what
        received = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
        work = dist.all_to_all_single(
            received,
            rows.contiguous(),
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=waits.group,
            async_op=True,
        )
        waits.wait(work, what, rows.is_cuda)
        return received

    @staticmethod
    def backward(ctx, grad_received: Tensor):
        grad_rows = _AllToAllV.apply(
            grad_received, ctx.recv_splits, ctx.send_splits, ctx.waits, f"the gradients of {ctx.what}"
        )
        return grad_rows, None, None, None, None


# Run eagerly under torch.compile, behind a graph break. Traced, this autograd.Function (a collective
# with its process group kept for the backward, the pattern of pytorch#129942) compiled on torch
# 2.11 to a backward that exchanged the wrong rows: gradients off by as much as themselves, or a
# gloo size mismatch. Stock DeepSpeed's _AllToAll compiles to the same wrong gradients there.
@torch.compiler.disable
def exchange(rows: Tensor, send_splits: list[int], recv_splits: list[int], waits: CollectiveWaits, what: str) -> Tensor:
    """``rows`` ([R, ...], grouped by destination rank as ``send_splits`` says) exchanged over
    ``waits.group``: the rows every rank sends this one, by source rank."""
    return _AllToAllV.apply(rows, send_splits, recv_splits, waits, what)


# Eager under torch.compile, as the exchanges are: the hook makes a collective.
@torch.compiler.disable
def check_before_backward(output: Tensor, header: ExchangeHeader, waits: CollectiveWaits) -> None:
    """Compares ``header`` (a call's backward) with every rank's when ``output``'s gradient arrives:
    before the backward of anything that made ``output``, so before any of the call's gradient
    exchanges. A hook on the tensor, not a function around it: the output stays the tensor the
    pipeline made (a view made by a custom function could not be modified in place)."""

    def check(grad: Tensor) -> Tensor:
        check_header(header, waits, "the exchanges of its gradients")
        return grad

    output.register_hook(check)


def pack_routes(local_experts: Tensor, gates: Tensor) -> Tensor:
    """``[R, 2k]`` fp32: each row's routes' local experts ([R, k] int, as fp32 values, exact below
    2**24) beside their gates ([R, k]), so that one exchange carries both; differentiable in the
    gates."""
    return torch.cat([local_experts.float(), gates.float()], dim=1)


def unpack_routes(routes: Tensor) -> tuple[Tensor, Tensor]:
    """``pack_routes``'s inverse: (local experts [R, k] int64, gates [R, k] fp32)."""
    top_k = routes.shape[1] // 2
    return routes.detach()[:, :top_k].long(), routes[:, top_k:]


def sum_rows(values: Tensor, row: Tensor, slot: Tensor, num_rows: int, slots: int) -> Tensor:
    """``[num_rows, H]`` fp32: the sum of ``values`` ([n, H]) by ``row``, where ``slot`` (below
    ``slots``) tells apart the values of one row. Gathered, not scattered: no atomics (a
    deterministic sum), and autograd keeps the indices rather than the values."""
    width = values.shape[-1]
    lookup = torch.full((num_rows * slots,), values.shape[0], dtype=torch.int64, device=values.device)
    lookup[row * slots + slot] = torch.arange(values.shape[0], device=values.device)
    padded = torch.cat([values, values.new_zeros((1, width))])  # the last row: a place with no value
    return padded.index_select(0, lookup).view(num_rows, slots, width).float().sum(dim=1)


class ReferencePipeline(Pipeline):
    """Dispatch, experts and combine of one MoE layer in plain torch, over any process group.

    Runs every layer the comet backend takes, on CPU or GPU, in any floating dtype, with any expert
    module; it defines the numbers the fused pipeline is held to. Its call is ``Pipeline.forward``;
    the gate before it keeps its bookkeeping in torch (``gate_op`` None) and runs eagerly
    (``replays_gate`` False).

    Args:
        experts: this rank's local experts (``num_experts / ep_size`` of them).
        num_experts: the layer's experts over the group.
        ep_size: the ranks of the expert-parallel group.
        group: the expert-parallel process group (None when ``ep_size`` is 1).
        wait_timeout_s: bounds each wait on the group (the exchange of counts that starts every
            call, then the rows, their routes and their return, whole or in chunks, and their
            gradients; on NCCL the host waits only for the counts): a rank whose peers stopped
            calling the layer gets ``CometWaitTimeout`` naming ``layer_name`` and the ranks that
            stalled, instead of waiting out the process group's timeout.
        layer_name: the layer's name in errors (``PipelineSelection.name`` sets it).
    """

    name = "reference"
    gate_op = None
    replays_gate = False

    def __init__(
        self,
        experts: LocalExperts,
        num_experts: int,
        ep_size: int,
        group=None,
        wait_timeout_s: float = 60.0,
        layer_name: str = "MoE layer",
    ):
        self.experts = experts
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.group = group
        self.wait_timeout_s = wait_timeout_s
        self.layer_name = layer_name
        self.chunks = 1  # the exchange's chunks: more than 1 only where the group spans nodes (selection.py)
        # Ranks a node holds, where a group that spans nodes forwards each token inside the
        # destination node ("internode_forwarding", selection.py); None: straight to each rank.
        self.ranks_per_node = None
        # Under an "fp8" recipe (selection.py), the rows as they cross in FP8 (fp8_emulation.py); None: as they are.
        self.fp8_exchange = None
        # The layer's exchange headers (exchange_header.py), which the selection keeps; None: no header.
        self.headers: LayerHeaders | None = None

    def forward(
        self, tokens: Tensor, indices: Tensor, weights: Tensor, *, train: bool = True, scale_before: bool = False
    ) -> Tensor:
        """The experts' combined output for ``tokens``: ``Pipeline.forward``'s arguments and result.

        ``train`` changes nothing here: the gate has already dropped what its capacity drops, and
        the rows this call exchanges are sized by what each rank sends, not by a bound.

        Each token goes once to each rank that holds one of its routes, with its k routes' local
        experts there (-1: not on that rank) and gates. The receiving rank runs each route's expert
        on the row and sums the weighted outputs of the routes it holds (in fp32, then the experts'
        dtype); one row per (token, rank) comes back, and the token's rows are summed in fp32. A
        token whose routes meet four experts of one rank crosses to it once, not four times.
        """
        with failures_noted(self.layer_name, self.ep_size):  # its peers will wait for it: tell them why
            output = self._forward(tokens, indices, weights, scale_before)
        if self.ep_size > 1 and self.headers is not None and self.headers.current is not None and output.requires_grad:
            check_before_backward(output, self.headers.current.backward(), self.waits())
        return output

    def _forward(self, tokens: Tensor, indices: Tensor, weights: Tensor, scale_before: bool) -> Tensor:
        # Under saved-tensor hooks (non-reentrant checkpointing) the rows go whole: the chunks keep
        # their graphs themselves, out of those hooks' sight. The counts are laid out by chunk
        # either way, so that every rank exchanges as many and can check that they all agree.
        planned = self.chunks if self.ep_size > 1 else 1
        chunks = 1 if saved_tensor_hooks_active() else planned
        if self.ranks_per_node is not None:
            return self._forward_by_node(tokens, indices, weights, scale_before, planned, chunks)
        return self._forward_by_rank(tokens, indices, weights, scale_before, planned, chunks)

    def _forward_by_rank(
        self, tokens: Tensor, indices: Tensor, weights: Tensor, scale_before: bool, planned: int, chunks: int
    ) -> Tensor:
        """Each token once to each rank that holds one of its routes (``forward``)."""
        plan = plan_rank_rows(indices, self.num_experts, self.ep_size, planned)
        send_rows, recv_rows, routes_per_expert = self._splits(plan.route_counts, plan.rank_rows, chunks)
        if self.fp8_exchange is not None:
            tokens = self.fp8_exchange.outgoing(tokens)
        rows, routes = self._pair_rows(plan, sum(send_rows), tokens, weights)

        def work(received_rows: Tensor, received_routes: Tensor, chunk: int) -> Tensor:
            return self._local_routes(received_rows, received_routes, routes_per_expert[chunk], scale_before)

        if self.ep_size == 1:
            returned = work(rows, routes, 0)
        else:
            returned = self._there_and_back(rows, routes, send_rows, recv_rows, chunks, work, "ranks")
        if self.fp8_exchange is not None:
            returned = self.fp8_exchange.returning(returned)
        return self._sum_pairs(returned, plan, tokens.shape[0], min(weights.shape[0], self.ep_size))

    def _forward_by_node(
        self, tokens: Tensor, indices: Tensor, weights: Tensor, scale_before: bool, planned: int, chunks: int
    ) -> Tensor:
        """Each token once to each node that holds one of its routes, then inside that node once to
        each rank that holds one (``"internode_forwarding"``).

        The group's ranks fill its nodes in order, ``ranks_per_node`` each: group rank ``r`` is rank
        ``r % ranks_per_node`` (its lane) of node ``r // ranks_per_node``. A token crosses to node m
        once, to the rank of node m in its sender's lane, with its routes' experts on node m (-1
        elsewhere) and gates; that rank passes it on inside node m as ``_forward_by_rank`` passes a
        token to ranks, and returns the node's sum of the token's routes, one row a node.
        """
        per_node = self.ranks_per_node
        nodes = self.ep_size // per_node
        node, lane = divmod(dist.get_rank(group=self.group), per_node)
        plan = plan_rank_rows(indices, self.num_experts, nodes, planned)  # destinations: nodes
        send_rows, recv_rows = self._lane_splits(plan.rank_rows, lane, chunks)
        rows, routes = self._pair_rows(plan, sum(send_rows), tokens, weights)
        first_expert = node * (self.num_experts // nodes)

        def work(received_rows: Tensor, received_routes: Tensor, chunk: int) -> Tensor:
            node_experts, gates = unpack_routes(received_routes)
            experts = torch.where(node_experts >= 0, node_experts + first_expert, node_experts)
            return self._forward_by_rank(received_rows, experts.t(), gates.t(), scale_before, 1, 1)

        returned = self._there_and_back(rows, routes, send_rows, recv_rows, chunks, work, "nodes")
        return self._sum_pairs(returned, plan, tokens.shape[0], min(weights.shape[0], nodes))

    @staticmethod
    def _pair_rows(plan: RankPlan, num_sent: int, tokens: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """The first ``num_sent`` pairs of ``plan`` as they travel: their tokens' rows, and their
        routes (``pack_routes``: the destination's experts and the gates)."""
        pair_token = plan.pair_token[:num_sent]
        return (
            tokens.index_select(0, pair_token),
            pack_routes(plan.local_experts[:num_sent], weights.t().index_select(0, pair_token)),
        )

    @staticmethod
    def _sum_pairs(returned: Tensor, plan: RankPlan, num_tokens: int, slots: int) -> Tensor:
        """Each token's returned rows ([pairs sent, H], at most ``slots`` a token) summed in fp32, in
        their dtype."""
        pairs = returned.shape[0]
        return sum_rows(returned, plan.pair_token[:pairs], plan.pair_slot[:pairs], num_tokens, slots).to(returned.dtype)

    def _there_and_back(
        self, rows: Tensor, routes: Tensor, send_rows: list[int], recv_rows: list[int], chunks: int, work, peers: str
    ) -> Tensor:
        """``work``'s rows for ``rows`` and their ``routes`` (grouped by destination rank as
        ``send_rows`` says), exchanged over the group there and back, whole or in ``chunks``;
        ``peers`` ("ranks" or "nodes") names the destinations in the errors of the whole exchange."""
        if chunks > 1:
            return chunked_exchange(
                rows, routes, send_rows, recv_rows, chunks, work, self.experts.parameters(), self.waits()
            )
        waits = self.waits()
        received_rows = exchange(rows, send_rows, recv_rows, waits, f"the rows the other {peers} send it")
        received_routes = exchange(routes, send_rows, recv_rows, waits, "the routes of those rows")
        return exchange(
            work(received_rows, received_routes, 0),
            recv_rows,
            send_rows,
            waits,
            f"its rows, back from their experts' {peers}",
        )

    def _lane_splits(self, node_rows: Tensor, lane: int, chunks: int) -> tuple[list[int], list[int]]:
        """The host splits of the exchange between nodes: ``node_rows`` ([nodes]) rows go to the rank
        of each node in this rank's ``lane``, none to the others; and the rows each rank sends here."""
        rows_to_rank = torch.zeros(self.ep_size, dtype=node_rows.dtype, device=node_rows.device)
        rows_to_rank[torch.arange(lane, self.ep_size, self.ranks_per_node, device=node_rows.device)] = node_rows
        sends = torch.stack([rows_to_rank, torch.full_like(rows_to_rank, chunks)], dim=1).view(-1)
        sent, received = torch.cat([sends, self.exchange_counts(sends)]).view(2, self.ep_size, 2).cpu()
        self._check_chunks_agree(received[:, 1].tolist())
        return sent[:, 0].tolist(), received[:, 0].tolist()

    def _splits(
        self, route_counts: Tensor, rank_rows: Tensor, chunks: int
    ) -> tuple[list[int], list[int], list[list[int]]]:
        """The exchange's host splits from this call's plan (``route_counts`` [ep, C, L],
        ``rank_rows`` [ep]) and the counts the other ranks send: (rows sent to each rank, rows
        received from each rank, routes for each local expert in each of the ``chunks`` the rows
        travel in: C, or 1 for the whole exchange)."""
        ep_size, planned, num_local = route_counts.shape
        sends = torch.cat(
            [
                route_counts.view(ep_size, -1),
                rank_rows.view(ep_size, 1),
                torch.full((ep_size, 1), chunks, dtype=rank_rows.dtype, device=rank_rows.device),
            ],
            dim=1,
        )
        received_counts = self.exchange_counts(sends.view(-1)) if ep_size > 1 else sends.view(-1)
        # The uneven splits must be host integers for all_to_all_single: one small copy of the counts.
        sent, received = torch.cat([sends.view(-1), received_counts]).view(2, ep_size, planned * num_local + 2).cpu()
        self._check_chunks_agree(received[:, -1].tolist())
        routes = received[:, :-2].sum(dim=0).view(planned, num_local)
        if chunks != planned:
            routes = routes.sum(dim=0, keepdim=True)
        return sent[:, -2].tolist(), received[:, -2].tolist(), routes.tolist()

    def _check_chunks_agree(self, chunks_of_ranks: list[int]) -> None:
        """Every rank of the group must send its rows in as many chunks (the same collectives);
        ``chunks_of_ranks`` holds each rank's count for this call. Every rank sees them all and
        raises alike, before any row moves."""
        if len(set(chunks_of_ranks)) == 1:
            return
        whole = [rank for rank, chunks in enumerate(chunks_of_ranks) if chunks == 1]
        raise RuntimeError(
            f"ds_comet: {self.layer_name}: the ranks of its expert-parallel group would exchange this call's rows "
            f"in different numbers of chunks ({chunks_of_ranks}, by rank of the group): ranks {whole} run it under "
            f"saved-tensor hooks (non-reentrant activation checkpointing, or torch.autograd.graph.saved_tensors_hooks)"
            f" and send the rows whole, the others do not. Checkpoint the MoE layers alike on every rank"
        )

    def _local_routes(self, rows: Tensor, routes: Tensor, routes_per_expert: list[int], scale_before: bool) -> Tensor:
        """For each received row ([R, H], with its ``routes``, [R, 2k] as ``pack_routes`` makes them),
        the weighted sum of its routes' expert outputs, in the experts' output dtype."""
        local, gates = unpack_routes(routes)
        num_rows, top_k = local.shape
        flat = local.reshape(-1)
        # Routes sorted by local expert (stable: by source rank, token, then slot); others last.
        keys = torch.where(flat < 0, torch.full_like(flat, self.experts.num_local), flat)
        order = torch.argsort(keys, stable=True)[: sum(routes_per_expert)]
        route_row = order // top_k
        # Each route's place among its row's routes on this rank (fewer than min(k, local experts)).
        route_slot = ((local >= 0).long().cumsum(dim=1) - 1).reshape(-1).index_select(0, order)
        route_rows = rows.index_select(0, route_row)
        route_gates = gates.reshape(-1).index_select(0, order).unsqueeze(-1)
        if scale_before:
            route_rows = (route_rows.float() * route_gates).to(rows.dtype)
        outputs = self.experts.run(route_rows, routes_per_expert)
        weighted = outputs if scale_before else outputs * route_gates  # fp32: the gates are
        summed = sum_rows(weighted, route_row, route_slot, num_rows, min(top_k, self.experts.num_local))
        return summed.to(outputs.dtype)

    def waits(self) -> CollectiveWaits:
        """This call's bounded waits on the group (``collective_waits.py``)."""
        return CollectiveWaits(self.group, self.wait_timeout_s, self.layer_name)

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        """What every rank sends this one (``send_counts``: [ep * n] int64, n per rank: the routes for
        each local expert in each chunk, the rows, and the chunks they travel in; between nodes
        (``_lane_splits``), the rows and the chunks), waiting at most ``wait_timeout_s`` for the group.

        Every rank reaches this exchange at least once per call, so a peer that stopped calling the layer
        (it raised, returned early or was stopped) is noticed here. The call already reads the
        counts back to the host, so the bounded wait adds no host sync. On CUDA the wait also
        covers the work queued before the exchange, as that read-back does.
        """
        received = torch.empty_like(send_counts)
        work = dist.all_to_all_single(received, send_counts, group=self.group, async_op=True)
        self.waits().wait(
            work,
            "the expert counts of the other ranks (the reference pipeline's first exchange of a call)",
            received.is_cuda,
            read_back=True,
        )
        return received
