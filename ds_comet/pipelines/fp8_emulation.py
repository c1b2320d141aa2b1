"""The ``"fp8"`` recipe emulated in float: the reference pipeline's experts and exchanged rows.

Under an enabled recipe the reference pipeline runs the experts through ``Fp8EmulatedExperts``
and quantises the rows it exchanges with ``Fp8Exchange``. Every operand the recipe puts in FP8 is
quantised and dequantised (``ds_comet/fp8.py``, the numbers the fused FP8 kernels must reproduce),
and each GEMM is computed in fp32 from the dequantised operands, so the emulation is the fused
kernels' ground truth and the CPU suite can hold it to float64.

One expert, rows ``x`` ``[n, H]`` of dtype D (bf16 or fp32; under autocast, autocast's dtype, to
which the rows are cast as a Linear's input would be, the products staying fp32), with ``W13`` the
first layer's weight (``W1`` ``[F, H]``, or ``[W1; W3]`` ``[2F, H]`` for a gated expert: one GEMM,
as the kernels run it) and Q the recipe's quantisation (e4m3; tiles along each GEMM's reduction
dimension, or rows):

- forward (``"forward"``): ``pre = round_D(Q(x) @ Q(W13)^T + b13)``;
  ``h = round_D(act(pre[:, :F]) [* pre[:, F:]])``; ``y = round_D(Q(h) @ Q(W2)^T + b2)``;
- input gradients (``"input_gradients"``), from the output gradient ``dy`` ``[n, H]``:
  ``g = round_D(Qg(dy) @ Q'(W2))``; ``dpre = round_D(the activation's gradient from g and pre)``;
  ``dx = round_D(Qg(dpre) @ Q'(W13))``, where Qg quantises in ``"gradient_format"`` and Q' is Q
  along the weight's other axis under rowwise scaling (the same blocks under blockwise);
- weight gradients from the operands as the expert's rank holds them: ``dW2 = Qc_g(dy)^T Qc(h)``,
  ``dW13 = Qc_g(dpre)^T Qc(x)`` with ``"weight_gradients"`` (rowwise scaling only), where Qc
  quantises per column over the expert's rows (``Qc_g`` in ``"gradient_format"``), else in high
  precision (torchao's "rowwise_with_gw_hp"): ``dW2 = dy^T h``, ``dW13 = dpre^T x``; the biases'
  gradients the columns' sums; in fp32, rounded to the parameters' dtype.

A GEMM the recipe leaves out takes its operands unquantised, in fp32 (with ``"gemm2": false``, the
products that give ``y`` and ``dx`` above). The exchange: with
``"dispatch": "fp8"`` the rows cross as their quantised values (what the first GEMM takes, so it
changes no product, but ``x`` above is then the quantised rows); with ``"gradient_dispatch":
"fp8"`` the output gradient crosses quantised and each route's ``dy`` is its gate times that row,
rounded to D, which the GEMM by W2 takes without quantising it again (the kernels fold the gate
into the row's scales, which differs from the emulation by that rounding). A quantisation's own
gradient is the identity (straight through).
"""

import torch
from torch import Tensor

from ..config import Fp8Recipe
from ..experts import ACTIVATIONS
from ..fp8 import E4M3, FORMATS, Fp8Format, quantise_blocks, quantise_columns, quantise_rows, quantise_tiles
from ..kernels.fused_experts import FusedExperts
from .expert_weights import LocalExperts


class RecipeOperands:
    """The operands of the experts' GEMMs as ``recipe`` quantises them, dequantised to fp32."""

    def __init__(self, recipe: Fp8Recipe):
        self.forward = recipe.forward
        self.input_gradients = recipe.input_gradients
        self.gemm2 = recipe.gemm2
        self.weight_gradients = recipe.weight_gradients
        self.blockwise = recipe.scaling == "blockwise"
        self.gradient_format = FORMATS[recipe.gradient_format]
        # Where the output gradient crossed in FP8 (Fp8Exchange) it arrives quantised, times the gate.
        self.quantise_output_gradient = recipe.gradient_dispatch == "bf16"

    def rows(self, x: Tensor, fmt: Fp8Format = E4M3) -> Tensor:
        """Rows ``x`` ``[M, K]`` of a GEMM that reduces over K, quantised and dequantised: ``[M, K]`` fp32."""
        return (quantise_tiles(x, fmt) if self.blockwise else quantise_rows(x, fmt)).dequantise()

    def weight(self, w: Tensor, reduced_axis: int) -> Tensor:
        """A weight ``w`` ``[N, K]`` quantised and dequantised for a GEMM that reduces over its axis
        ``reduced_axis`` (1: ``x @ w^T``, the forward; 0: ``g @ w``, the backward): ``[N, K]`` fp32."""
        if self.blockwise:
            return quantise_blocks(w).dequantise()
        # Rowwise: one scale per channel the GEMM does not reduce over.
        return (quantise_rows(w) if reduced_axis == 1 else quantise_columns(w)).dequantise()

    def forward_product(self, x: Tensor, w: Tensor, bias: Tensor | None, gemm2: bool = False) -> Tensor:
        """``x @ w^T + bias`` (``[M, K]`` by ``[N, K]``) in fp32, in FP8 where the recipe's forward is
        (``gemm2``: the product is GEMM2's, in FP8 only where the recipe's ``"gemm2"`` is too)."""
        if self.forward and (self.gemm2 or not gemm2):
            x, w = self.rows(x), self.weight(w, reduced_axis=1)
        out = x.float() @ w.float().t()
        return out if bias is None else out + bias.float()

    def gradient_product(self, grad: Tensor, w: Tensor, quantise_grad: bool = True, gemm2: bool = False) -> Tensor:
        """``grad @ w`` (``[M, N]`` by ``[N, K]``) in fp32, in FP8 where the recipe's input gradients
        are (``quantise_grad`` False: ``grad`` is quantised already; ``gemm2``: as ``forward_product``)."""
        if self.input_gradients and (self.gemm2 or not gemm2):
            if quantise_grad:
                grad = self.rows(grad, self.gradient_format)
            w = self.weight(w, reduced_axis=0)
        return grad.float() @ w.float()

    def weight_gradient_product(self, grad: Tensor, x: Tensor) -> Tensor:
        """``grad^T @ x`` (``[n, M]`` by ``[n, N]``, one expert's rows) in fp32, in FP8 where the
        recipe's weight gradients are: each operand quantised per column over the n rows (``grad``
        in the gradient format), the channels the product does not reduce over."""
        if self.weight_gradients and grad.shape[0]:
            grad, x = quantise_columns(grad, self.gradient_format).dequantise(), quantise_columns(x).dequantise()
        return grad.float().t() @ x.float()


def _first_layer(tensors: tuple) -> tuple[Tensor, Tensor | None]:
    """The first layer's weight and bias as one GEMM: ``W1`` ``[F, H]``, or ``[W1; W3]`` ``[2F, H]``."""
    w1, b1, w3, b3, _, _ = tensors
    if w3 is None:
        return w1, b1
    return torch.cat([w1, w3]), (None if b1 is None else torch.cat([b1, b3]))


def _activate(pre: Tensor, activation: str, ffn: int) -> Tensor:
    """The activations of the first layer's products ``pre`` (``[n, F]``, gated ``[n, 2F]``), fp32 ``[n, F]``."""
    pre = pre.float()
    out = ACTIVATIONS[activation](pre[:, :ffn])
    return out if pre.shape[1] == ffn else out * pre[:, ffn:]


def _activation_gradient(pre: Tensor, grad_h: Tensor, activation: str, ffn: int) -> Tensor:
    """The gradient of the products ``pre`` from the activations' gradient ``grad_h`` ``[n, F]``: fp32
    ``[n, F]`` (gated: ``[n, 2F]``, the gate's then the up projection's)."""
    grad_h = grad_h.float()
    with torch.enable_grad():
        first = pre[:, :ffn].float().requires_grad_()
        act = ACTIVATIONS[activation](first)
    if pre.shape[1] == ffn:
        return torch.autograd.grad(act, first, grad_h)[0]
    up = pre[:, ffn:].float()
    (grad_first,) = torch.autograd.grad(act, first, grad_h * up)
    return torch.cat([grad_first, grad_h * act.detach()], dim=1)


def expert_forward(operands: RecipeOperands, x: Tensor, tensors: tuple, activation: str) -> tuple[Tensor, ...]:
    """One expert on its rows ``x`` ``[n, H]`` (the module's docstring): ``(y [n, H], pre [n, F or 2F],
    h [n, F])``, all of ``x``'s dtype. ``tensors``: ``FusedExperts.expert_tensors()``'s row."""
    w13, b13 = _first_layer(tensors)
    _, _, _, _, w2, b2 = tensors
    pre = operands.forward_product(x, w13, b13).to(x.dtype)
    h = _activate(pre, activation, w2.shape[1]).to(x.dtype)
    return operands.forward_product(h, w2, b2, gemm2=True).to(x.dtype), pre, h


def expert_backward(
    operands: RecipeOperands, saved: tuple[Tensor, Tensor, Tensor], grad_y: Tensor, tensors: tuple, activation: str
) -> tuple[Tensor, list[Tensor | None]]:
    """One expert's gradients from its output gradient ``grad_y`` ``[n, H]``, with ``saved`` = (its
    rows ``x``, ``pre`` and ``h`` from ``expert_forward``): ``(dx [n, H] of x's dtype, [dW1, db1, dW3,
    db3, dW2, db2])`` in fp32, None where the expert has no such parameter."""
    x, pre, h = saved
    w13, b13 = _first_layer(tensors)
    w1, b1, w3, _, w2, b2 = tensors
    ffn = w2.shape[1]
    grad_h = operands.gradient_product(grad_y, w2, operands.quantise_output_gradient).to(x.dtype)
    grad_pre = _activation_gradient(pre, grad_h, activation, ffn).to(x.dtype)
    grad_x = operands.gradient_product(grad_pre, w13, gemm2=True).to(x.dtype)
    # The weight gradients, from the operands as this rank holds them.
    grad_w13 = operands.weight_gradient_product(grad_pre, x)
    grad_y, grad_pre = grad_y.float(), grad_pre.float()
    grad_b13 = grad_pre.sum(dim=0) if b13 is not None else None
    grads = [grad_w13[:ffn], None if b1 is None else grad_b13[:ffn], None, None]
    if w3 is not None:
        grads[2:] = [grad_w13[ffn:], None if b1 is None else grad_b13[ffn:]]
    grads += [operands.weight_gradient_product(grad_y, h), grad_y.sum(dim=0) if b2 is not None else None]
    return grad_x, grads


class _Fp8Experts(torch.autograd.Function):
    """The local experts under the recipe on rows grouped by expert (``counts``); differentiable in
    the rows and in ``experts.parameters()`` (passed as ``params``, in that order)."""

    @staticmethod
    def forward(ctx, rows: Tensor, counts: list[int], experts: FusedExperts, operands: RecipeOperands, *params):
        outputs, pres, hs = [], [], []
        for part, tensors in zip(rows.split(counts), experts.expert_tensors()):
            y, pre, h = expert_forward(operands, part, tensors, experts.activation)
            outputs.append(y)
            pres.append(pre)
            hs.append(h)
        ctx.save_for_backward(rows, torch.cat(pres), torch.cat(hs), *params)  # params: autograd's version check
        ctx.counts, ctx.experts, ctx.operands = counts, experts, operands
        return torch.cat(outputs)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_out: Tensor):
        rows, pre, h = ctx.saved_tensors[:3]
        experts, counts = ctx.experts, ctx.counts
        saved = zip(rows.split(counts), pre.split(counts), h.split(counts))
        grad_rows, columns = [], []
        for part_saved, grad, tensors in zip(saved, grad_out.split(counts), experts.expert_tensors()):
            grad_x, grads = expert_backward(ctx.operands, part_saved, grad, tensors, experts.activation)
            grad_rows.append(grad_x)
            columns.append([None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)])
        stacked = [None if column[0] is None else torch.stack(column) for column in zip(*columns)]
        return (torch.cat(grad_rows), None, None, None, *experts.gradients(*stacked))


class Fp8EmulatedExperts(LocalExperts):
    """``experts`` computed under an FP8 recipe, emulated in float: the reference pipeline's experts
    when the recipe is enabled. ``fused``: their weights as the kernels read them
    (``experts.fused(hidden)``), from which the emulation computes them, without calling the modules
    (as the kernels do): their hooks do not run."""

    def __init__(self, experts: LocalExperts, fused: FusedExperts, recipe: Fp8Recipe):
        self.experts = experts
        self.weights = fused
        self.operands = RecipeOperands(recipe)
        self.num_local = experts.num_local

    def run(self, rows: Tensor, counts) -> Tensor:
        device = rows.device.type
        if torch.is_autocast_enabled(device):
            # As autocast casts a Linear's input: the experts then compute in its dtype, as without the
            # recipe. The emulation's own products stay fp32, so autocast must not lower them.
            rows = rows.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return _Fp8Experts.apply(rows, list(counts), self.weights, self.operands, *self.weights.parameters())

    def parameters(self) -> list[Tensor]:
        return self.experts.parameters()

    def fused(self, hidden: int) -> FusedExperts | str:
        return self.experts.fused(hidden)

    def hookable_modules(self):
        return self.experts.hookable_modules()

    def uncalled_modules(self):
        return self.experts.uncalled_modules()

    def structure(self) -> tuple:
        return self.experts.structure()


class _QuantisedRows(torch.autograd.Function):
    """Rows as they cross in FP8: their quantised values, in their dtype; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, rows: Tensor, operands: RecipeOperands) -> Tensor:
        return operands.rows(rows).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _QuantisedGradient(torch.autograd.Function):
    """The identity, whose gradient crosses back in FP8: quantised in the recipe's gradient format."""

    @staticmethod
    def forward(ctx, rows: Tensor, operands: RecipeOperands) -> Tensor:
        ctx.operands = operands
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.operands.rows(grad, ctx.operands.gradient_format).to(grad.dtype), None


class Fp8Exchange:
    """The reference pipeline's exchanged rows under an FP8 recipe: ``outgoing(tokens)`` gives the
    token rows ``[S, H]`` as they cross to the experts (quantised under ``"dispatch": "fp8"``), and
    ``returning(rows)`` the rows that come back from them (``[P, H]``, unchanged), whose gradient,
    which crosses the other way, is quantised under ``"gradient_dispatch": "fp8"``. A row is quantised
    alike on every hop, so a token that crosses twice (between nodes, then inside one) gets the same
    values: quantising quantised values again gives them back."""

    def __init__(self, recipe: Fp8Recipe):
        self.operands = RecipeOperands(recipe)
        self.rows_in_fp8 = recipe.dispatch == "fp8"
        self.gradients_in_fp8 = recipe.gradient_dispatch == "fp8"

    def outgoing(self, tokens: Tensor) -> Tensor:
        return _QuantisedRows.apply(tokens, self.operands) if self.rows_in_fp8 else tokens

    def returning(self, rows: Tensor) -> Tensor:
        return _QuantisedGradient.apply(rows, self.operands) if self.gradients_in_fp8 else rows
