"""StepShares (ds_comet/step_shares.py): what each part of a step is charged, on a stand-in clock.

The layer below advances a fake clock by fixed amounts in its forward and its backward, so the
totals are exact, not timings: forward 20, backward 30, the optimizer 5, the rest of the step 7.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ds_comet.step_shares as step_shares
from ds_comet.step_shares import StepShares

FORWARD, BACKWARD, OPTIMIZER, REST = 20.0, 30.0, 5.0, 7.0


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now / 1000.0  # read as seconds; the totals come back in ms


class Charged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        ctx.save_for_backward(x)  # what non-reentrant checkpointing recomputes the layer for
        clock.now += FORWARD
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        _ = ctx.saved_tensors  # unpacking is what makes a non-reentrant checkpoint recompute
        ctx.clock.now += BACKWARD
        return grad * 3, None


class Layer(torch.nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def forward(self, x):
        return Charged.apply(x, self.clock)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(step_shares.time, "perf_counter", fake)
    return fake


def train_step(shares, layer, clock, call, measure=True):
    x = torch.randn(4, 8, requires_grad=True)
    with shares.step(measure=measure):
        h = x * 2  # the layer's input is not a leaf, as a norm's output is not
        y = call(layer, h)
        y += h  # a residual added in place to the layer's output
        y.sum().backward()
        clock.now += REST
        with shares.optimizer():
            clock.now += OPTIMIZER
    return x


@pytest.mark.parametrize(
    "call, recomputed",
    [
        (lambda layer, h: layer(h), 0.0),
        (lambda layer, h: checkpoint(layer, h, use_reentrant=True), FORWARD),
        (lambda layer, h: checkpoint(layer, h, use_reentrant=False), FORWARD),
    ],
    ids=["plain", "reentrant_checkpoint", "non_reentrant_checkpoint"],
)
def test_each_part_is_charged_once(clock, call, recomputed):
    layer = Layer(clock)
    shares = StepShares(torch.nn.Sequential(layer), torch.device("cpu"), layers=[layer])
    x = train_step(shares, layer, clock, call)
    assert torch.equal(x.grad, torch.full_like(x, 2 * 3 + 2))  # the hooks changed no gradient
    train_step(shares, layer, clock, call, measure=False)  # not measured: charged nowhere
    totals = shares.read()
    # A recomputation is charged to the backward, once, before or inside it.
    assert totals.steps == 1
    assert (totals.moe_forward_ms, totals.moe_backward_ms) == pytest.approx((FORWARD, BACKWARD + recomputed))
    assert (totals.optimizer_ms, totals.rest_ms) == pytest.approx((OPTIMIZER, REST))
    assert totals.step_ms == pytest.approx(FORWARD + BACKWARD + recomputed + OPTIMIZER + REST)
    per_step = totals.per_step()
    assert abs(per_step["moe_forward_share"] - FORWARD / totals.step_ms) < 1e-12
    shares.remove()
    train_step(shares, layer, clock, call)
    assert shares.read().moe_forward_ms == pytest.approx(FORWARD)  # no hooks after remove(): nothing more charged


def test_a_layer_without_gradients_is_timed_in_its_forward_only(clock):
    layer = Layer(clock)
    shares = StepShares(torch.nn.Sequential(layer), torch.device("cpu"), layers=[layer])
    with shares.step():
        with torch.no_grad():
            layer(torch.randn(2, 3))
    totals = shares.read()
    assert (totals.moe_forward_ms, totals.moe_backward_ms, totals.rest_ms) == pytest.approx((FORWARD, 0.0, 0.0))
    assert "MoE layers 20.00 ms (100.0%: forward 20.00, backward 0.00)" in totals.describe()
