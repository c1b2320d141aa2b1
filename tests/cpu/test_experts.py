"""Users' own expert classes: register_expert, the check of their forward, and the refusals."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ds_comet
from ds_comet.experts import forward_mismatch, fused_expert, register_expert
from ds_comet.pipelines.expert_weights import ModuleExperts
from ds_comet.pipelines.policy import structure_reason
from tests.support.moe_helpers import MixtralStyleMLP


class NestedMLP(nn.Module):
    """fc_out(relu(proj.fc_in(x))): the Linears one level down, with biases."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.proj = nn.Module()
        self.proj.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc_out(F.relu(self.proj.fc_in(x)))


class ScaledMLP(MixtralStyleMLP):
    """Computes something the layout does not say: half the SwiGLU."""

    def forward(self, x):
        return 0.5 * super().forward(x)


class TrainingOnlyScale(MixtralStyleMLP):
    """The SwiGLU in eval mode, something else in training mode (as a noise or a dropout would be)."""

    def forward(self, x):
        return super().forward(x) * (1.5 if self.training else 1.0)


class ClampedMLP(MixtralStyleMLP):
    """The SwiGLU with its gate's activation clamped at 7 (as gpt-oss clamps its SwiGLU): the same
    on rows of scale 1, where the activation stays far below 7, and not on larger rows."""

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)).clamp(max=7.0) * self.w3(x))


class NoisyMLP(MixtralStyleMLP):
    """The SwiGLU with a little noise in training mode, drawn from the global generator (within
    the check's tolerance, so that the check runs the forward in both modes)."""

    def forward(self, x):
        out = super().forward(x)
        return out + 1e-4 * out.abs().mean() * torch.rand_like(out) if self.training else out


class DroppingMLP(MixtralStyleMLP):
    """The SwiGLU with dropout on its output."""

    def __init__(self, hidden, ffn, p):
        super().__init__(hidden, ffn)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(super().forward(x))


@pytest.fixture(autouse=True)
def _registry(monkeypatch):
    # Each test registers what it needs; the registry is left as it was.
    import ds_comet.experts as experts

    monkeypatch.setattr(experts, "_LAYOUTS", dict(experts._LAYOUTS))


def test_a_registered_class_runs_on_its_own_parameter_names():
    register_expert(MixtralStyleMLP, first="w1", up="w3", second="w2", activation="silu")
    expert = MixtralStyleMLP(16, 24)
    spec = fused_expert(expert)
    assert (spec.first, spec.gate, spec.second, spec.activation) == (expert.w1, expert.w3, expert.w2, "silu")
    assert forward_mismatch(spec, 16) is None
    x = torch.randn(5, 16)
    torch.testing.assert_close(spec.compute(x), expert(x), rtol=0, atol=0)
    register_expert(NestedMLP, first="proj.fc_in", second="fc_out", activation="relu")
    nested = fused_expert(NestedMLP(16, 24))
    assert nested.gate is None and forward_mismatch(nested, 16) is None


def test_a_registered_class_whose_forward_computes_something_else_is_refused():
    register_expert(ScaledMLP, first="w1", up="w3", second="w2", activation="silu")
    reason = forward_mismatch(fused_expert(ScaledMLP(16, 24)), 16)
    assert reason is not None and "ScaledMLP's forward in training mode differs from its registered layout" in reason
    register_expert(MixtralStyleMLP, first="w1", up="w3", second="w2", activation="gelu")  # the wrong activation
    reason = structure_reason(ModuleExperts(nn.ModuleList(), [MixtralStyleMLP(16, 24)]), 16, 2)
    assert isinstance(reason, str) and "differs from its registered layout" in reason


def test_a_clamp_that_rows_of_scale_one_never_reach_is_caught_on_larger_rows():
    register_expert(ClampedMLP, first="w1", up="w3", second="w2", activation="silu")
    expert = ClampedMLP(16, 24)
    x = torch.randn(16, 16)
    torch.testing.assert_close(expert(x), fused_expert(expert).compute(x))  # unit rows pass
    reason = forward_mismatch(fused_expert(expert), 16)
    assert reason is not None and "ClampedMLP's forward in training mode differs from its registered layout" in reason
    assert "on random rows of standard deviation 10" in reason and "a clamp or a saturation" in reason, reason


def test_the_check_covers_both_modes_whichever_the_first_call_had():
    """A class that matches its layout in eval mode only is refused even when checked in eval mode
    (the choice holds for later training calls); the check leaves the modes and the RNG as they were."""
    register_expert(TrainingOnlyScale, first="w1", up="w3", second="w2", activation="silu")
    expert = TrainingOnlyScale(16, 24).eval()
    expert.w1.train()  # a mixed mode, which the check must give back as it was
    state = torch.random.get_rng_state()
    reason = forward_mismatch(fused_expert(expert), 16)
    assert reason is not None and "forward in training mode differs from its registered layout" in reason, reason
    assert not expert.training and expert.w1.training and not expert.w2.training
    register_expert(NoisyMLP, first="w1", up="w3", second="w2", activation="silu")
    noisy = fused_expert(NoisyMLP(16, 24))
    state = torch.random.get_rng_state()
    assert forward_mismatch(noisy, 16) is None
    assert torch.equal(torch.random.get_rng_state(), state)  # the training-mode draws were given back
    register_expert(DroppingMLP, first="w1", up="w3", second="w2", activation="silu")
    for p in (0.1, 1e-4):  # a tiny rate would pass for rounding: dropout is refused as such
        reason = forward_mismatch(fused_expert(DroppingMLP(16, 24, p).eval()), 16)
        assert reason is not None and f"holds Dropout(p={p}), which the fused kernels do not apply" in reason, reason
    assert forward_mismatch(fused_expert(DroppingMLP(16, 24, 0.0)), 16) is None  # p = 0 computes the layout


def test_layouts_that_do_not_fit_the_class_are_refused():
    register_expert(MixtralStyleMLP, first="w1", up="w4", second="w2", activation="silu")
    assert "has no submodule 'w4'" in fused_expert(MixtralStyleMLP(8, 8))
    register_expert(NestedMLP, first="proj", second="fc_out", activation="relu")
    assert "'proj' is a Module, not the nn.Linear" in fused_expert(NestedMLP(8, 8))
    with pytest.raises(ValueError, match="activation 'swish' is not supported"):
        register_expert(MixtralStyleMLP, first="w1", second="w2", activation="swish")
    with pytest.raises(TypeError, match="takes an nn.Module class"):
        register_expert(MixtralStyleMLP(8, 8), first="w1", second="w2", activation="silu")
    # A subclass of a registered class is not covered: it may compute something else.
    register_expert(MixtralStyleMLP, first="w1", up="w3", second="w2", activation="silu")
    assert "the expert is a ScaledMLP" in fused_expert(ScaledMLP(8, 8))


def test_fused_asked_for_checks_the_experts_when_the_layer_is_built():
    fused = {"moe": {"backend": "comet", "overlap": "fused"}}
    with pytest.raises(
        ValueError, match=r"\"fused\" was asked for, but the expert is a MixtralStyleMLP.*register_expert"
    ):
        ds_comet.MoE(16, MixtralStyleMLP(16, 24), num_experts=4, k=2, config=fused)
    register_expert(MixtralStyleMLP, first="w1", up="w3", second="w2", activation="silu")
    layer = ds_comet.MoE(16, MixtralStyleMLP(16, 24), num_experts=4, k=2, config=fused)
    assert isinstance(layer.deepspeed_moe.pipelines.experts, ModuleExperts)
    # "auto" builds it and says why at the first call instead.
    ds_comet.MoE(16, ScaledMLP(16, 24), num_experts=4, k=2, config={"moe": {"backend": "comet"}})


class WrongWidth(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden - 3)

    def forward(self, x):
        return self.fc(x)


def test_an_expert_whose_output_width_is_wrong_is_named():
    layer = ds_comet.MoE(16, WrongWidth(16), num_experts=2, k=1, config={"moe": {"backend": "comet"}})
    with pytest.raises(ValueError, match="an expert maps rows of 16 features to \\[13\\]"):
        layer(torch.randn(1, 8, 16))


class _NormalisedExpert(torch.nn.Module):
    def __init__(self, hidden, norm):
        super().__init__()
        self.norm = norm
        self.fc = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.fc(self.norm(x))


@pytest.mark.parametrize(
    "norm,refused", [(torch.nn.BatchNorm1d(16), True), (torch.nn.LayerNorm(16), False)], ids=["batchnorm", "layernorm"]
)
def test_an_expert_that_mixes_rows_is_refused_by_name(norm, refused):
    # BatchNorm in training makes a row's output depend on the batch: ds_comet gives an expert its
    # routed rows, stock its zero-padded capacity buffer; the two would differ without a word.
    expert = _NormalisedExpert(16, norm)

    def build():
        return ds_comet.MoE(16, expert, num_experts=2, k=1, config={"moe": {"backend": "comet"}})

    if refused:
        with pytest.raises(ValueError, match=r"not row-wise: its submodule 'norm' \(BatchNorm1d\).*LayerNorm"):
            build()
    else:
        build()
