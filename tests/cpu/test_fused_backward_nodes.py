"""The fused call's backward as a chain of autograd nodes (``pipelines.fused.fused_call_under_autograd``), on
CPU with a dense stand-in for the kernels: each projection's weight gradient reaches its parameter's
accumulator (where ZeRO's hook frees it) before the next projection's is computed, the call's
communication is joined exactly once by whichever node runs last, and the gradients are autograd's own.
"""

import pytest
import torch
from torch import nn

from ds_comet.pipelines.expert_weights import StackedFusedExperts
from ds_comet.pipelines.fused import fused_call_under_autograd

EXPERTS, HIDDEN, FFN, TOKENS = 3, 8, 12, 10


class Grouped(nn.Module):
    """Stacked gated experts as AutoEP holds them: w1, w3 [L, F, H] and w2 [L, H, F]."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN, dtype=torch.float64))
        self.w3 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN, dtype=torch.float64))


def dense_moe(tokens, weights, experts, w1, w3, w2):
    """Top-1 gated experts: token t goes to ``experts[t]``, its output weighted by ``weights[0, t]``."""
    a, b, c = w1[experts], w3[experts], w2[experts]
    h = torch.nn.functional.silu(torch.einsum("tfh,th->tf", a, tokens)) * torch.einsum("tfh,th->tf", b, tokens)
    return weights[0, :, None] * torch.einsum("thf,tf->th", c, h)


class Pending:
    """The stand-in's ``PendingBackward``: the gradients autograd gave the dense layer, handed out on request."""

    def __init__(self, log, grads):
        self.log, self.grads = log, grads

    def projection_gradients(self, projection):
        self.log.append(f"compute {projection}")
        return [self.grads[projection]]

    def finish(self):
        self.log.append("finish")
        return self.grads["tokens"], self.grads["weights"]


class DensePipeline:
    """What ``fused_call_under_autograd`` calls on a ``FusedPipeline``, computed densely in float64."""

    def __init__(self, grouped, experts, log):
        self.experts = StackedFusedExperts(grouped, "silu")
        self.grouped, self.routes, self.log = grouped, experts, log

    def run_forward(self, tokens, plan, weights, max_rows, header, saved):
        saved.update(rows=tokens.detach(), weights=weights.detach())
        params = (self.grouped.w1, self.grouped.w3, self.grouped.w2)
        return dense_moe(tokens, weights, self.routes, *(p.detach() for p in params))

    def run_backward(self, grad_out, plan, weights, saved, header, need_second, need_weights):
        self.log.append("collective backward")
        leaves = [saved.pop("rows").requires_grad_(), saved.pop("weights").requires_grad_()]
        leaves += [p.detach().requires_grad_() for p in (self.grouped.w1, self.grouped.w3, self.grouped.w2)]
        with torch.enable_grad():
            out = dense_moe(leaves[0], leaves[1], self.routes, *leaves[2:])
        grads = dict(zip(("tokens", "weights", "w1", "w3", "w2"), torch.autograd.grad(out, leaves, grad_out)))
        self.log.append("compute w2" if need_second else "no w2")
        return ([grads["w2"]] if need_second else []), Pending(self.log, grads)


def call(frozen=()):
    """A call through the node chain with the named inputs frozen: (output, its dense twin, inputs and
    parameters (tokens, weights, w1, w3, w2), log)."""
    torch.manual_seed(len(frozen))
    grouped = Grouped()
    tokens = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, requires_grad="tokens" not in frozen)
    weights = torch.rand(1, TOKENS, dtype=torch.float64, requires_grad="weights" not in frozen)
    for name in ("w1", "w3", "w2"):
        getattr(grouped, name).requires_grad_(name not in frozen)
    log = []
    for name, param in grouped.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p, name=name: log.append(f"accumulated {name}"))
    routes = torch.randint(0, EXPERTS, (TOKENS,))
    out = fused_call_under_autograd(DensePipeline(grouped, routes, log), None, TOKENS, None, tokens, weights)
    leaves = [t.detach().requires_grad_() for t in (tokens, weights, grouped.w1, grouped.w3, grouped.w2)]
    twin = dense_moe(leaves[0], leaves[1], routes, *leaves[2:])
    inputs = (tokens, weights, grouped.w1, grouped.w3, grouped.w2)
    return out, (twin, leaves), inputs, log


def test_each_weight_gradient_is_accumulated_before_the_next_is_computed():
    out, (twin, leaves), inputs, log = call()
    dy = torch.randn_like(out)
    out.backward(dy)
    assert log == [
        "collective backward",
        "compute w2",
        "accumulated w2",
        "compute w3",
        "accumulated w3",
        "compute w1",
        "finish",
        "accumulated w1",
    ]
    for got, expected in zip(inputs, torch.autograd.grad(twin, leaves, dy)):
        torch.testing.assert_close(got.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "frozen",
    [
        ("w1",),  # the tokens' node still runs, last
        ("tokens", "weights", "w1"),  # the up projection's node runs last
        ("tokens", "weights", "w1", "w3"),  # the fused node alone
        ("tokens", "w3", "w2"),
    ],
)
def test_the_last_node_joins_once_after_every_gradient_and_frozen_inputs_get_none(frozen):
    out, (twin, leaves), inputs, log = call(frozen)
    dy = torch.randn_like(out)
    out.backward(dy)
    computed = [entry.split()[1] for entry in log if entry.startswith("compute")]
    assert computed == [name for name in ("w2", "w3", "w1") if name not in frozen]
    assert log.count("finish") == 1 and all(log.index("finish") > log.index(f"compute {name}") for name in computed)
    expected = dict(zip(("tokens", "weights", "w1", "w3", "w2"), torch.autograd.grad(twin, leaves, dy)))
    for name, tensor in zip(("tokens", "weights", "w1", "w3", "w2"), inputs):
        if name in frozen:
            assert tensor.grad is None, name
        else:
            torch.testing.assert_close(tensor.grad, expected[name], rtol=1e-12, atol=1e-12)


def test_a_second_backward_through_the_chain_is_refused():
    out, _, _, _ = call()
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        out.sum().backward()
