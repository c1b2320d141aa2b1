"""The fused call's backward as a chain of autograd nodes (``pipelines.fused.fused_call_under_autograd``), on
CPU with a dense float64 stand-in for the kernels: each projection's weight gradient reaches its
parameters' accumulators (where ZeRO's hook frees it) before the next projection's is computed, the
call's communication is joined exactly once, by whichever node runs last, also in a backward
restricted to some inputs, and every gradient is autograd's own, for AutoEP's stacked experts and
for expert modules with biases, gated or not.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_comet.experts import ACTIVATIONS, FeedForward, GatedFeedForward
from ds_comet.kernels.fused_experts import POINTER_NAMES, PROJECTIONS
from ds_comet.pipelines.expert_weights import ModuleExperts, StackedFusedExperts
from ds_comet.pipelines.fused import PendingBackward, fused_call_under_autograd

EXPERTS, HIDDEN, FFN, TOKENS = 3, 8, 12, 10


class Grouped(nn.Module):
    """Stacked gated experts as AutoEP holds them: w1, w3 [L, F, H] and w2 [L, H, F]."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN, dtype=torch.float64))
        self.w3 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN, dtype=torch.float64))


def fused_experts(kind):
    """``FusedExperts`` of ``kind``: "stacked" (AutoEP's), "modules" (ungated, biases) or "gated modules"."""
    if kind == "stacked":
        return StackedFusedExperts(Grouped(), "silu")
    make = FeedForward if kind == "modules" else lambda h, f: GatedFeedForward(h, f, bias=True)
    modules = nn.ModuleList(make(HIDDEN, FFN) for _ in range(EXPERTS)).double()
    return ModuleExperts(modules, list(modules)).fused(HIDDEN)


def stacked(experts, tensor):
    """Each ``POINTER_NAMES`` tensor of every expert stacked [L, ...] (None where absent), each expert
    tensor first passed through ``tensor``."""
    columns = zip(*experts.expert_tensors())
    return {
        name: None if col[0] is None else torch.stack([tensor(t) for t in col])
        for name, col in zip(POINTER_NAMES, columns)
    }


def dense_moe(tokens, weights, routes, w, gated, activation):
    """Top-1 experts on stacked weights ``w``: token t goes to ``routes[t]``, weighted by ``weights[0, t]``."""

    def linear(name, rows):
        out = torch.einsum("tij,tj->ti", w[name][routes], rows)
        bias = w[POINTER_NAMES[POINTER_NAMES.index(name) + 1]]
        return out if bias is None else out + bias[routes]

    h = ACTIVATIONS[activation](linear("w1", tokens))
    if gated:
        h = h * linear("w3", tokens)
    return weights[0, :, None] * linear("w2", h)


class Pending:
    """The stand-in's ``PendingBackward``: the gradients autograd gave the dense layer, handed out on request."""

    def __init__(self, log, experts, grads):
        self.log, self.experts, self.grads = log, experts, grads

    def projection_gradients(self, projection):
        self.log.append(f"compute {projection}")
        bias = POINTER_NAMES[POINTER_NAMES.index(projection) + 1]
        return self.experts.projection_gradients(projection, self.grads[projection], self.grads[bias])

    def finish(self):
        self.log.append("finish")
        return self.grads["tokens"], self.grads["weights"]


class DensePipeline:
    """What ``fused_call_under_autograd`` calls on a ``FusedPipeline``, computed densely in float64."""

    def __init__(self, experts, routes, log):
        self.experts, self.routes, self.log = experts, routes, log

    def dense(self, tokens, weights, w):
        return dense_moe(tokens, weights, self.routes, w, self.experts.gated, self.experts.activation)

    def run_forward(self, tokens, plan, weights, max_rows, header, saved):
        saved.update(rows=tokens.detach(), weights=weights.detach())
        return self.dense(tokens, weights, stacked(self.experts, torch.Tensor.detach))

    def run_backward(self, grad_out, plan, weights, saved, header, need_second, need_weights):
        self.log.append("collective backward")
        tokens, weights = saved.pop("rows").requires_grad_(), saved.pop("weights").requires_grad_()
        w = stacked(self.experts, torch.Tensor.detach)
        leaves = {name: t.requires_grad_() for name, t in w.items() if t is not None}
        with torch.enable_grad():
            out = self.dense(tokens, weights, w)
        grads = torch.autograd.grad(out, [tokens, weights, *leaves.values()], grad_out)
        grads = dict(zip(["tokens", "weights", *leaves], grads))
        grads.update({name: None for name in POINTER_NAMES if name not in grads})
        self.log.append("compute w2" if need_second else "no w2")
        second = self.experts.projection_gradients("w2", grads["w2"], grads["b2"]) if need_second else []
        return second, Pending(self.log, self.experts, grads)


def call(kind="stacked", frozen=()):
    """A call through the node chain with the named inputs (tokens, weights, or projections) frozen:
    (output, expected gradients by tensor id, the inputs and parameters, log)."""
    torch.manual_seed(len(frozen))
    experts = fused_experts(kind)
    tokens = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, requires_grad="tokens" not in frozen)
    weights = torch.rand(1, TOKENS, dtype=torch.float64, requires_grad="weights" not in frozen)
    log = []
    for projection, params in experts.projection_parameters().items():
        for param in params:
            param.requires_grad_(projection not in frozen)
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p, name=projection: log.append(f"accumulated {name}"))
    routes = torch.randint(0, EXPERTS, (TOKENS,))
    pipeline = DensePipeline(experts, routes, log)
    params = experts.projection_parameters()
    needs = {projection: any(p.requires_grad for p in group) for projection, group in params.items()}
    out = fused_call_under_autograd(pipeline, None, TOKENS, None, tokens, weights, params, needs)
    # The twin: the same layer on copies, differentiated by autograd alone.
    inputs = [tokens, weights, *experts.parameters()]
    copies = {id(t): t.detach().clone().requires_grad_() for t in inputs}
    if isinstance(experts, StackedFusedExperts):  # its expert tensors are views of the stacked parameters
        w = {name: None for name in POINTER_NAMES}
        w.update({name: copies[id(group[0])] for name, group in experts.projection_parameters().items()})
    else:
        w = stacked(experts, lambda t: copies[id(t)])
    twin = pipeline.dense(copies[id(tokens)], copies[id(weights)], w)
    return out, (twin, copies), inputs, log


def check_gradients(out, twin, copies, inputs, frozen_ids):
    dy = torch.randn_like(out)
    out.backward(dy)
    expected = dict(zip(copies, torch.autograd.grad(twin, list(copies.values()), dy)))
    for tensor in inputs:
        if id(tensor) in frozen_ids:
            assert tensor.grad is None
        else:
            torch.testing.assert_close(tensor.grad, expected[id(tensor)], rtol=1e-12, atol=1e-12)


def test_each_weight_gradient_is_accumulated_before_the_next_is_computed():
    out, (twin, copies), inputs, log = call()
    check_gradients(out, twin, copies, inputs, frozen_ids=set())
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


@pytest.mark.parametrize("kind", ["stacked", "modules", "gated modules"])
@pytest.mark.parametrize(
    "frozen",
    [
        (),
        ("w1",),  # the tokens' node still runs, last
        ("tokens", "weights", "w1"),  # the up projection's node runs last (gated)
        ("tokens", "weights", "w1", "w3"),  # the fused node alone
        ("tokens", "w3", "w2"),
    ],
)
def test_the_last_node_joins_once_after_every_gradient_and_frozen_inputs_get_none(kind, frozen):
    out, (twin, copies), inputs, log = call(kind, frozen)
    experts_params = out.grad_fn.pipeline.experts.projection_parameters()
    frozen_ids = {id(t) for name in frozen if name in experts_params for t in experts_params[name]}
    frozen_ids |= {id(inputs[0])} if "tokens" in frozen else set()
    frozen_ids |= {id(inputs[1])} if "weights" in frozen else set()
    check_gradients(out, twin, copies, inputs, frozen_ids)
    computed = [entry.split()[1] for entry in log if entry.startswith("compute")]
    present = [name for name in ("w2", "w3", "w1") if experts_params[name]]
    assert computed == [name for name in present if name not in frozen]
    assert log.count("finish") == 1 and all(log.index("finish") > log.index(f"compute {name}") for name in computed)
    assert out.grad_fn.staged.pending is None


@pytest.mark.parametrize("kind", ["stacked", "modules"])
@pytest.mark.parametrize("wanted", PROJECTIONS)
def test_a_backward_restricted_to_one_projection_joins_once_and_keeps_nothing(kind, wanted):
    out, (twin, copies), inputs, log = call(kind)
    params = out.grad_fn.pipeline.experts.projection_parameters()[wanted]
    if not params:
        pytest.skip("ungated experts have no up projection")
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, params, dy)
    expected = dict(zip(copies, torch.autograd.grad(twin, list(copies.values()), dy)))
    for param, grad in zip(params, grads):
        torch.testing.assert_close(grad, expected[id(param)], rtol=1e-12, atol=1e-12)
    assert log.count("finish") == 1 and log[-1] == "finish"
    assert out.grad_fn.staged.pending is None  # the saved rows and gradients are let go


def test_a_second_backward_through_the_chain_is_refused():
    out, _, _, _ = call()
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        out.sum().backward()


def test_weight_gradients_after_another_calls_exchange_are_refused():
    """The layout the weight gradients read is the workspace's: another call's exchange in between
    would give them that call's rows, so it is refused with the reason, not computed wrong."""
    kernels = SimpleNamespace(buffer=SimpleNamespace(exchanges=3))
    pending = PendingBackward(kernels, None, None, rows_in_fp8=False, grad_tokens=None, route_grad=None)
    kernels.buffer.exchanges += 1
    with pytest.raises(RuntimeError, match="exchanged between the nodes of one call's fused backward"):
        pending.projection_gradients("w1")
