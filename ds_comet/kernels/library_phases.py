"""The "library" GEMM implementation: torch's grouped GEMM (``torch._grouped_mm``).

On sm_90 torch builds it from CUTLASS's Hopper grouped GEMM, for bf16. It groups rows by the
layout's expert ends (``FusedKernels.expert_ends``) and has no tile that waits for a dispatch or
counts rows for a combine, so it runs only the phases where nothing waits: the weight gradients,
and, alone in the group (the dispatch then runs before GEMM1 on the same stream), the first layer
of stacked experts both ways, each followed by the call's elementwise step.
"""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .gemm_phases import GemmFacts, GemmImplementation, Needs, Phase, Products

if TYPE_CHECKING:
    from .launch import FusedKernels

BF16 = ((torch.bfloat16, torch.bfloat16),)
HOPPER = ((9, 0),)
# The first layer reads the weights as stacked [L, F, H] tensors; the weight gradients read none.
# Alone in the group it made EP=1 training steps of AutoEP's Mixtral- and Qwen3-like blocks 2-4 %
# faster than the Triton GEMM1, whose epilogue holds up its MMAs (docs/decisions.md). With peers,
# GEMM1's tiles must wait for the dispatch, which this GEMM cannot.
FIRST_LAYER_NEEDS = Needs(
    dtypes=BF16, capabilities=HOPPER, torch_functions=("_grouped_mm",), alone=True, gated=True, stacked=True
)


class LibraryGemm(GemmImplementation):
    """``torch._grouped_mm`` for bf16 on sm_90: the first layer both ways (alone in the group,
    stacked gated experts) and the weight gradients."""

    name = "library"
    needs = {
        Phase.FIRST_LAYER: FIRST_LAYER_NEEDS,
        Phase.FIRST_LAYER_BACKWARD: FIRST_LAYER_NEEDS,
        # Nothing waits in this phase, so the library's kernel serves wherever it runs: the Triton
        # one ran at 0.79-1.05x its rate on the SwiGLU shapes (docs/decisions.md).
        Phase.WEIGHT_GRADIENTS: Needs(dtypes=BF16, capabilities=HOPPER, torch_functions=("_grouped_mm",)),
    }

    def stored_dtype(self, phase: Phase, facts: GemmFacts) -> torch.dtype:
        return facts.row_dtype

    def first_layer(self, call: "FusedKernels", rows: Tensor, h: Tensor, keep_pre: bool):
        """The two products ``rows @ W1^T`` and ``rows @ W3^T``, then the elementwise step; returns
        them as a pair of [R, F] tensors with ``keep_pre``."""
        products = self.products(call, rows[: h.shape[0]], "w1", "w3")
        call.activations(products, h)
        return products if keep_pre else None

    def first_layer_backward(
        self, call: "FusedKernels", rows: Tensor, grad_pre: Tensor, pre: Products, want_act: bool
    ) -> Tensor | None:
        """``g = rows @ W2``, then the elementwise step (the activations over g)."""
        (grad_h,) = self.products(call, rows[: grad_pre.shape[0]], "w2")
        return call.activations_backward(grad_h, pre, grad_pre, want_act)

    def weight_gradients(self, call: "FusedKernels", a: Tensor, b: Tensor) -> Tensor:
        # Rows past the last group's end are not read.
        rows = min(a.shape[0], b.shape[0])
        return torch._grouped_mm(a[:rows].t(), b[:rows], offs=call.expert_ends)

    @torch.no_grad()  # the fused autograd function differentiates the layer, not autograd's graph of it
    def products(self, call: "FusedKernels", rows: Tensor, *names: str) -> tuple[Tensor, ...]:
        """Per local expert, over its rows (the layout's expert ends group them): ``rows @ W^T`` for
        ``w1`` and ``w3`` ([L, F, H]), ``rows @ W2`` for ``w2`` ([L, H, F]; the output gradient's product).
        Rows past the last expert's end are not computed."""
        weights = dict(zip(("w1", "w3", "w2"), call.experts.stacked()))
        return tuple(
            torch._grouped_mm(
                rows, weights[name] if name == "w2" else weights[name].transpose(-2, -1), offs=call.expert_ends
            )
            for name in names
        )
