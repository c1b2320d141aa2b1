"""The hybrid pipeline of an expert-parallel group that spans nodes: the fused kernels among each
node's ranks, the reference pipeline's exchange between nodes.

The fused kernels hand rows to peers through peer memory, which exists only among the GPUs of one
node; between nodes the reference pipeline's NCCL all-to-alls carry the rows, in chunks
(``chunked.py``). A group whose ranks fill N nodes in order, G ranks each (G > 1), holds experts
``[m E/N, (m + 1) E/N)`` on node m. Each call splits the gate's routes by where their experts live:

- the routes to this node's experts run on the node's part: a ``FusedPipeline`` on the node's own
  process group (its G ranks, ``node_group``), with their experts renumbered to the node's
  (``global - m E/N``); every other route is -1 there, which the fused plan treats as dropped: it is
  neither sent nor counted against the workspace;
- the routes to other nodes' experts run on the whole group's ``ReferencePipeline``, with this
  node's routes -1: it forms no (token, rank) pair for a rank of this node, so no row goes to one
  and the counts it exchanges for them are zero.

Each kept route is in exactly one part, with its gate, and both parts weight their routes' outputs
by the gates; the output is the two parts' outputs (each already in the tokens' dtype) summed in
fp32 and rounded to the node part's dtype: one rounding more than the whole group's reference
pipeline gives a token with routes on both sides. The
gate has already applied its capacity and dropped what it drops: neither part drops more (the
fused part's workspace is sized by a bound on the rows its node can send a rank). Gradients flow
through both parts' autograd: the tokens' and the gates' are the sums of the parts' (a part gives
zero for a gate it does not hold), and so are this rank's experts' parameters: the node part runs
them on the rows of this node's tokens, the reference part on the rows of other nodes' tokens.

Order: the reference part runs first, then the node part, both on the caller's stream, on every
rank alike; the backward runs them in reverse (autograd takes the later node first), so every rank
posts the two groups' collectives in the same order. The two parts do not overlap each other: the
reference part's exchange of counts reads back to the host, which on NCCL waits for every kernel
queued before it, and its collectives queue behind the caller's stream. Inside the reference part
the experts of one chunk overlap the exchange of the next, and inside the node part the fused
kernels overlap their own dispatch and combine, as each does alone.
"""

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as torch_dist
from torch import Tensor

from .interface import Pipeline

# The node groups made so far, by (default process group, the node's global ranks): layers of one
# node share the group, and so a workspace of one shape (workspace.get_buffer).
_NODE_GROUPS: dict = {}


def node_groups_reason(bound: bool | None = None) -> str | None:
    """Why the node groups cannot be made by a node's ranks alone, or None. ``bound``: whether the
    job's default group is an NCCL group bound to a device (None: read from the job's process group).

    ``node_group`` makes a node's group when a layer first runs, with only that node's ranks
    taking part. On NCCL, once the default group is bound to a device (``deepspeed.init_distributed``
    binds it on GPUs), torch makes every new group at once by splitting the whole job's communicator,
    and each split waits for every rank of the job. Ranks outside the node never take part, for
    example a pipeline stage that waits for its activations, or an expert-parallel group that
    decided otherwise. The members would then wait in NCCL's setup, where no bound of ours reaches.
    """
    if bound is None:
        bound = torch_dist.is_initialized() and torch_dist.get_backend() == "nccl"
        bound = bound and getattr(torch_dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None
    if not bound:
        return None
    return (
        "the hybrid pipeline makes each node's process group when a layer first runs, which NCCL cannot do "
        "for a node's ranks alone once the default group is bound to a device (deepspeed.init_distributed "
        'binds it on GPUs); "internode_hybrid": false says to run the reference pipeline here'
    )


def node_group(ranks: tuple[int, ...]):
    """The process group of one node's ``ranks`` (global ranks, in group order), made the first time
    it is asked for: collectively, by those ranks only (``use_local_synchronization``), so that
    other nodes and other expert-parallel groups need not join (where ``node_groups_reason`` says
    they need not). Every rank of a node asks for the same groups in the same order (the layers'
    agreements, in model order)."""
    key = (torch_dist.group.WORLD, ranks)
    if key not in _NODE_GROUPS:
        _NODE_GROUPS[key] = torch_dist.new_group(list(ranks), use_local_synchronization=True)
    return _NODE_GROUPS[key]


@dataclass(frozen=True)
class NodeSplit:
    """Where a group's experts live: ``nodes`` nodes of ``num_experts // nodes`` experts each, this
    rank on node ``node``."""

    num_experts: int
    nodes: int
    node: int

    @property
    def node_experts(self) -> int:
        return self.num_experts // self.nodes

    def split(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """The gate's ``indices`` ([k, S], global expert or -1 dropped; an id of ``num_experts`` or
        more counts as dropped too) as the two parts take them: (this node's routes, with its
        experts numbered from 0, -1 elsewhere; the other nodes' routes, global ids, -1 elsewhere),
        both [k, S] in ``indices``' dtype."""
        first = self.node * self.node_experts
        kept = (indices >= 0) & (indices < self.num_experts)
        here = kept & (indices >= first) & (indices < first + self.node_experts)
        dropped = torch.full_like(indices, -1)
        return torch.where(here, indices - first, dropped), torch.where(kept & ~here, indices, dropped)


class HybridPipeline(Pipeline):
    """One MoE layer's call on a group that spans nodes: the node's part on ``node_part``, the
    routes to other nodes on ``internode`` (the module's docstring).

    The gate before it may do what the node part allows (``gate_op``, ``replays_gate``: the fused
    pipeline's). Call ``forward`` (``Pipeline.forward``) on every rank of the whole group for every
    call, in the same order.

    Args:
        node_part: the pipeline of this node's ranks over this node's experts (``split.node_experts``
            of them, renumbered from 0): a ``FusedPipeline`` on the node's group (any ``Pipeline`` of
            that group, for tests on CPU).
        internode: the whole group's reference pipeline (its chunks and forwarding as the selection
            set them).
        split: where the group's experts live, and this rank's node.
    """

    name = "hybrid"

    def __init__(self, node_part: Pipeline, internode: Pipeline, split: NodeSplit):
        self.node_part = node_part
        self.internode = internode
        self.split = split

    @property
    def layer_name(self) -> str:
        return self.internode.layer_name

    @layer_name.setter
    def layer_name(self, value: str) -> None:
        self.node_part.layer_name = self.internode.layer_name = value

    @property
    def gate_op(self) -> ModuleType | None:
        return self.node_part.gate_op

    @property
    def replays_gate(self) -> bool:
        return self.node_part.replays_gate

    def forward(
        self, tokens: Tensor, indices: Tensor, weights: Tensor, *, train: bool = True, scale_before: bool = False
    ) -> Tensor:
        """The experts' combined output for ``tokens``: ``Pipeline.forward``'s arguments and result.

        The output is in the node part's dtype (the fused pipeline's: the tokens'). ``scale_before``
        goes to both parts (the fused one refuses it; the selection never hands it such a layer).
        """
        here, elsewhere = self.split.split(indices)
        remote = self.internode.forward(tokens, elsewhere, weights, train=train, scale_before=scale_before)
        local = self.node_part.forward(tokens, here, weights, train=train, scale_before=scale_before)
        return (local.float() + remote.float()).to(local.dtype)
