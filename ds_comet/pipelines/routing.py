"""Routing plans of the gate's routes, built in plain torch.

``plan_routes`` sorts the routes by global expert into a ``kernels.routing_plan.RoutingPlan``, the
plan the fused dispatch builds on the device (``plan_routes_cuda``). ``plan_rank_rows`` pairs each
token with each rank that holds one of its kept routes: the reference pipeline sends a token's row
once per such rank. Everything stays on the device: building a plan needs no host sync and no
dense ``[S, E, C]`` tensor.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.routing_plan import RoutingPlan, routes_shape


def plan_routes(indices: Tensor, num_experts: int) -> RoutingPlan:
    """Build the plan from the gate's ``indices`` ([k, S], global expert id, or -1 when dropped; an id
    of ``num_experts`` or more counts as dropped too, as in the plan kernel)."""
    top_k, num_tokens = routes_shape(indices)
    flat = indices.reshape(-1).long()
    # Dropped routes take the sentinel expert id num_experts so that they sort after every kept one.
    dropped = (flat < 0) | (flat >= num_experts)
    expert_of_route = torch.where(dropped, torch.full_like(flat, num_experts), flat)
    route_order = torch.argsort(expert_of_route, stable=True)
    route_position = torch.empty_like(route_order)
    route_position.scatter_(0, route_order, torch.arange(flat.numel(), device=flat.device))
    # scatter_add rather than bincount: on CUDA, bincount reads the largest id back to the host.
    expert_counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    expert_counts.scatter_add_(0, expert_of_route, torch.ones_like(expert_of_route))
    expert_counts = expert_counts[:num_experts]
    return RoutingPlan(route_order, route_position, expert_counts, num_tokens, top_k)


@dataclass(frozen=True)
class RankPlan:
    """Each token sent once to each rank that holds one of its kept routes.

    A *pair* is (destination rank d, token s); pairs are sorted by destination, then token, and
    only the first ``rank_rows.sum()`` are real. The rows a rank sends to one destination may travel
    in chunks: chunk c of a block of B rows is its rows ``[c B / C, (c + 1) B / C)`` (``chunk_bounds``).
    Built on the device with no host sync.
    """

    pair_token: Tensor
    """[ep*S] int64: the token of each pair."""
    pair_slot: Tensor
    """[ep*S] int64: the pair's place among its token's pairs (0 for its lowest rank, and so on)."""
    local_experts: Tensor
    """[ep*S, k] int64: for each of the token's k routes, its local expert on the pair's rank, or -1
    where the route goes elsewhere or was dropped."""
    rank_rows: Tensor
    """[ep] int64: pairs per destination rank."""
    route_counts: Tensor
    """[ep, C, L] int64: kept routes per destination rank, chunk of its rows and local expert."""


def chunk_bounds(rows: Tensor, chunks: int) -> Tensor:
    """[..., chunks + 1]: where each chunk of a block of ``rows`` rows starts, and the block's end."""
    return rows.unsqueeze(-1) * torch.arange(chunks + 1, device=rows.device) // chunks


def chunk_of_row(position: Tensor, rows: Tensor, chunks: int) -> Tensor:
    """The chunk (``chunk_bounds``) that holds row ``position`` of a block of ``rows`` rows: the
    largest c with c * rows // chunks <= position."""
    return ((position + 1) * chunks + rows - 1) // rows.clamp_min(1) - 1


def plan_rank_rows(indices: Tensor, num_experts: int, ep_size: int, chunks: int = 1) -> RankPlan:
    """The pairs of the gate's ``indices`` ([k, S], as for ``plan_routes``) over ``ep_size`` ranks of
    ``num_experts // ep_size`` experts each, their rows to travel in ``chunks`` chunks."""
    top_k, num_tokens = routes_shape(indices)
    num_local = num_experts // ep_size
    flat = indices.long()
    kept = (flat >= 0) & (flat < num_experts)
    dest = torch.where(kept, flat // num_local, torch.full_like(flat, ep_size))  # [k, S]; ep_size: nowhere
    hit = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=flat.device)
    hit.scatter_(1, dest.t(), True)
    hit = hit[:, :ep_size]  # [S, ep]
    slot = hit.long().cumsum(dim=1) - 1
    pair_ids = torch.arange(ep_size * num_tokens, device=flat.device).view(ep_size, num_tokens)
    keys = torch.where(hit.t(), pair_ids, torch.full_like(pair_ids, ep_size * num_tokens))
    order = torch.argsort(keys.reshape(-1))  # real pairs first, by destination then token
    pair_dest, pair_token = order // num_tokens, order % num_tokens
    route_dest, route_expert = dest[:, pair_token], flat[:, pair_token]  # [k, ep*S]
    local = torch.where(
        route_dest == pair_dest, route_expert - pair_dest * num_local, torch.full_like(route_expert, -1)
    )
    rank_rows = hit.sum(dim=0)
    # Each real pair's chunk; the other pairs have no local expert and are not counted.
    pair_chunk = 0
    if chunks > 1:
        position = torch.arange(ep_size * num_tokens, device=flat.device) - exclusive_cumsum(rank_rows)[pair_dest]
        pair_chunk = chunk_of_row(position, rank_rows[pair_dest], chunks)
    # scatter_add rather than bincount: on CUDA, bincount reads the largest id back to the host.
    bins = ep_size * chunks * num_local
    where = torch.where(local >= 0, (pair_dest * chunks + pair_chunk) * num_local + local, bins)
    route_counts = torch.zeros(bins + 1, dtype=torch.int64, device=flat.device)
    route_counts.scatter_add_(0, where.reshape(-1), torch.ones_like(where).reshape(-1))
    return RankPlan(
        pair_token,
        slot[pair_token, pair_dest.clamp(max=ep_size - 1)],
        local.t().contiguous(),
        rank_rows,
        route_counts[:bins].view(ep_size, chunks, num_local),
    )


def exclusive_cumsum(values: Tensor) -> Tensor:
    return values.cumsum(0) - values


def runs(starts: Tensor, lengths: Tensor) -> Tensor:
    """The concatenation of ``arange(starts[i], starts[i] + lengths[i])`` over i."""
    return torch.repeat_interleave(starts - exclusive_cumsum(lengths), lengths) + torch.arange(int(lengths.sum()))


def remote_rows(indices: Tensor, num_experts: int, ep_size: int, rank: int) -> tuple[int, int]:
    """Rows this rank's tokens send to other ranks of the group: one per kept route (what an exchange
    route by route sends, as DeepSpeed's stock layer and AutoEP's do), and one per (token, destination
    rank) with a kept route there (what both pipelines' dispatches send and their combines bring back).
    ``indices`` as for ``plan_routes``. Reads the counts back to the host: for benchmarks and
    reports, not for the layer's call."""
    plan = plan_rank_rows(indices, num_experts, ep_size)
    per_rank_routes = plan.route_counts.sum(dim=(1, 2))
    return (int(per_rank_routes.sum() - per_rank_routes[rank]), int(plan.rank_rows.sum() - plan.rank_rows[rank]))
