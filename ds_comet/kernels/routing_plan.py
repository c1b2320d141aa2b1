"""Routing plans: DeepSpeed's sparse gate routes in the order tokens travel to the experts.

A *route* is one (top-k slot j, token s) pair of the gate's ``[k, S]`` outputs; its flat id is
``j * S + s``. A plan sorts routes by global expert, which is also by destination rank and then
by local expert, so every destination and every expert owns one contiguous run of the send buffer.
Routes the gate dropped (expert index -1) sort last and are never sent. Everything stays on the
device: building a plan needs no host sync and no dense ``[S, E, C]`` tensor. ``plan_routes_cuda``
builds the fused dispatch's plan with the op's kernels; ``pipelines.routing.plan_routes`` builds
the same plan in plain torch.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RoutingPlan:
    route_order: Tensor
    """[k*S] int64: flat route ids sorted by global expert; kept routes first, in route-id order."""
    route_position: Tensor
    """[k*S] int64: where each flat route id sits in ``route_order`` (the inverse permutation)."""
    expert_counts: Tensor
    """[E] int64: kept routes of this rank's tokens per global expert."""
    num_tokens: int
    top_k: int
    rank_tokens: Tensor | None = None
    """[ep, S] int32 (``plan_routes_cuda``, for the fused dispatch): row d lists, in token order, the
    tokens with a kept route to one of rank d's experts; only its first ``rank_token_counts[d]`` are set."""
    rank_token_counts: Tensor | None = None
    """[ep] int64: how many tokens each rank gets, once a token."""

    def rank_counts(self, ep_size: int) -> Tensor:
        """[ep_size] int64: kept routes sent to each rank of the expert-parallel group."""
        return self.expert_counts.view(ep_size, -1).sum(dim=1)


def routes_shape(indices: Tensor) -> tuple[int, int]:
    """(k, tokens) of the gate's ``indices``."""
    if indices.dim() != 2:
        raise ValueError(f"gate indices must be [k, tokens], got shape {tuple(indices.shape)}")
    return indices.shape


def plan_routes_cuda(op, indices: Tensor, num_experts: int, ep_size: int) -> RoutingPlan:
    """``pipelines.routing.plan_routes`` in one launch of the fused op's plan kernel (a stable
    counting sort per expert): the same plan, without the ~30 small kernels a radix sort and its
    scatters launch; and, in a second launch, the tokens each of the ``ep_size`` ranks gets once
    (``rank_tokens``)."""
    top_k, num_tokens = routes_shape(indices)
    flat = indices.reshape(-1).to(torch.int32).contiguous()
    route_order = torch.empty(flat.numel(), dtype=torch.int64, device=flat.device)
    route_position = torch.empty_like(route_order)
    expert_counts = torch.empty(num_experts, dtype=torch.int64, device=flat.device)
    op.plan(flat, num_experts, route_order, route_position, expert_counts)
    rank_tokens = torch.empty((ep_size, num_tokens), dtype=torch.int32, device=flat.device)
    rank_token_counts = torch.empty(ep_size, dtype=torch.int64, device=flat.device)
    op.rank_tokens(flat, top_k, num_experts, ep_size, rank_tokens, rank_token_counts)
    return RoutingPlan(route_order, route_position, expert_counts, num_tokens, top_k, rank_tokens, rank_token_counts)
