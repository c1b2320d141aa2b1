"""What an integration may ask of a pipeline, whichever one the selection hands it.

``PipelineSelection.pipeline_for`` returns the reference pipeline, the fused one or, for a group
that spans nodes, the hybrid of the two, call by call. An integration's layer runs the gate, then
the pipeline's ``forward``; the pipelines take the same call, and say themselves what the gate
before them may do, so the layer never asks which one it holds.
"""

from types import ModuleType
from typing import Protocol

from torch import Tensor


class Pipeline(Protocol):
    """Dispatch, experts and combine of one MoE layer's call on one rank of its expert-parallel group.

    ``ReferencePipeline`` (plain torch, any process group) and ``FusedPipeline`` (the fused COMET
    kernels, GPUs of one node) implement it, and ``HybridPipeline`` (the two composed, for a group
    that spans nodes). Every rank of the group calls ``forward`` for every call of the layer, in
    the same order, as with any collective.

    Attributes:
        name: ``"reference"``, ``"fused"`` or ``"hybrid"``: which pipeline it is, for messages and
            benchmarks.
        layer_name: the layer's name in this pipeline's errors and in the notes its peers read
            when this rank raises (the selection sets it).
        gate_op: the loaded CUDA op (``kernels.ops.load_op``) whose gate kernels may do the
            gate's integer bookkeeping before this pipeline's calls
            (``integrations.legacy.gate.gate_routes``'s ``op``), or None where the gate keeps it
            in torch ops.
        replays_gate: whether the gate before this pipeline may be replayed from CUDA graphs when
            the layer's config asks for it (``"cuda_graph_gate"``, a fused-path option).
    """

    name: str
    layer_name: str

    @property
    def gate_op(self) -> ModuleType | None: ...

    @property
    def replays_gate(self) -> bool: ...

    def forward(
        self, tokens: Tensor, indices: Tensor, weights: Tensor, *, train: bool = True, scale_before: bool = False
    ) -> Tensor:
        """The experts' combined output for one call.

        Args:
            tokens: [S, H], floating: this rank's tokens (the fused pipeline: bf16 or fp16 on this
                rank's GPU).
            indices: [k, S], integer: route j of token s goes to global expert ``indices[j, s]``;
                -1 where the gate dropped the route.
            weights: [k, S], fp32 (a lower precision is taken in fp32): each route's gate value.
            train: whether the call runs in the gate's training capacity (True) or its eval
                capacity (False); it bounds the rows a rank can receive.
            scale_before: scale each route's row by its weight before its expert, and sum the
                routes' outputs unweighted (AutoEP's ``"score_apply": "pre"``); else weight the
                outputs. Only the reference pipeline runs it: the selection never hands such a
                layer the fused one.

        Returns:
            [S, H], in the dtype the experts compute in (the tokens' own, unless autocast
            changes it): each token's weighted sum of its kept routes' expert outputs (a zero row
            for a token with none). Under autograd, differentiable in the tokens, the weights and
            the experts' parameters.
        """
        ...
