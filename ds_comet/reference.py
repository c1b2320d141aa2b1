"""The reference pipeline: dispatch, local experts and combine in plain torch.

It runs on any torch.distributed backend (gloo on CPU, NCCL on GPU) and is the numerical ground
truth for the fused kernels. Unlike stock DeepSpeed it sends only the routes the gate kept, with
uneven all-to-all splits, instead of a zero-padded ``[E, C, M]`` capacity buffer; the arithmetic
per token is the same, so outputs and gradients match stock's.
"""

from typing import List, Sequence

import torch
from deepspeed import comm as dist
from torch import Tensor, nn

from .routing import RoutingPlan, expert_major_order


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the same exchange reversed."""

    @staticmethod
    def forward(ctx, rows: Tensor, send_splits: List[int], recv_splits: List[int], group) -> Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        received = rows.new_empty((sum(recv_splits), ) + tuple(rows.shape[1:]))
        dist.all_to_all_single(received,
                               rows.contiguous(),
                               output_split_sizes=recv_splits,
                               input_split_sizes=send_splits,
                               group=group)
        return received

    @staticmethod
    def backward(ctx, grad_received: Tensor):
        grad_rows = _AllToAllV.apply(grad_received, ctx.recv_splits, ctx.send_splits, ctx.group)
        return grad_rows, None, None, None


# Run eagerly under torch.compile, behind a graph break. Traced, this autograd.Function (a collective
# with its process group kept for the backward, the pattern of pytorch#129942) compiled on torch
# 2.11 to a backward that exchanged the wrong rows: gradients off by as much as themselves, or a
# gloo size mismatch. Stock DeepSpeed's _AllToAll compiles to the same wrong gradients there.
@torch.compiler.disable
def exchange(rows: Tensor, send_splits: List[int], recv_splits: List[int], group, ep_size: int) -> Tensor:
    if ep_size == 1:
        return rows
    return _AllToAllV.apply(rows, send_splits, recv_splits, group)


def inverse_permutation(permutation: Tensor) -> Tensor:
    inverse = torch.empty_like(permutation)
    inverse.scatter_(0, permutation, torch.arange(permutation.numel(), device=permutation.device))
    return inverse


def run_expert(expert: nn.Module, rows: Tensor) -> Tensor:
    out = expert(rows)
    # DeepSpeed's Experts drops a returned bias term the same way.
    return out[0] if isinstance(out, tuple) else out


def combine_routes(route_outputs: Tensor, plan: RoutingPlan, gates: Tensor) -> Tensor:
    """Weighted top-k sum of each token's expert outputs.

    ``route_outputs`` holds one row per entry of ``plan.route_order`` (rows of dropped routes are
    zero). The product with the fp32 gates and the sum over routes run in fp32, as in stock
    DeepSpeed, and the result is cast back to the experts' dtype.
    """
    hidden = route_outputs.shape[-1]
    routed = route_outputs.index_select(0, plan.route_position).view(plan.top_k, plan.num_tokens, hidden)
    return (routed * gates.unsqueeze(-1)).sum(dim=0).to(route_outputs.dtype)


def reference_moe(tokens: Tensor, plan: RoutingPlan, gates: Tensor, experts: Sequence[nn.Module], group,
                  ep_size: int) -> Tensor:
    """The MoE layer's expert part for ``tokens`` ([S, M]) routed by ``plan`` with ``gates`` ([k, S])."""
    num_local = len(experts)
    send_counts = plan.expert_counts
    if ep_size > 1:
        received_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(received_counts, send_counts, group=group)
    else:
        received_counts = send_counts
    received_counts = received_counts.view(ep_size, num_local)
    # The uneven splits must be host integers for all_to_all_single: one small copy for all three.
    host = torch.cat([send_counts.view(ep_size, num_local).sum(1),
                      received_counts.sum(1),
                      received_counts.sum(0)]).tolist()
    send_splits, recv_splits, rows_per_expert = host[:ep_size], host[ep_size:2 * ep_size], host[2 * ep_size:]

    num_sent = sum(send_splits)
    sent = tokens.index_select(0, plan.source_token[:num_sent])
    received = exchange(sent, send_splits, recv_splits, group, ep_size)

    by_expert = expert_major_order(received_counts)
    expert_inputs = received.index_select(0, by_expert).split(rows_per_expert)
    # Every expert runs, on no rows if it got none, so every expert parameter gets a (zero)
    # gradient as it does in stock DeepSpeed; ZeRO expects gradients for all of them.
    expert_outputs = torch.cat([run_expert(expert, rows) for expert, rows in zip(experts, expert_inputs)])
    returned = expert_outputs.index_select(0, inverse_permutation(by_expert))

    outputs = exchange(returned, recv_splits, send_splits, group, ep_size)
    dropped = plan.route_order.numel() - num_sent
    outputs = torch.cat([outputs, outputs.new_zeros((dropped, outputs.shape[-1]))])
    return combine_routes(outputs, plan, gates)
