"""Expert modules whose structure the fused pipeline understands.

Any row-wise module works as an expert on the reference pipeline. The fused kernels run two
grouped GEMMs with an activation between them, so they need to know where the weights are:
these two modules (and ``nn.Sequential(Linear, activation, Linear)``) say it.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class FeedForward(nn.Module):
    """``fc2(act(fc1(x)))``: the classic transformer FFN."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        self.activation = activation
        self._act = _activation(activation)
        self.fc1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self._act(self.fc1(x)))


class GatedFeedForward(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with ``activation="silu"``, GeGLU with ``"gelu"``."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        self._act = _activation(activation)
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


def reset_expert_(expert: nn.Module, seed: int) -> None:
    """Give ``expert`` fresh weights drawn from ``seed`` alone (fan-in scaled normal).

    DeepSpeed builds every local expert as a deep copy of one module, so all start identical; tests
    and benchmarks that must tell experts apart draw each one's weights from its global id.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in expert.parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else param.numel()
            values = torch.randn(param.shape, generator=generator, dtype=torch.float64) / fan_in**0.5
            param.copy_(values.to(param.dtype))


@dataclass(frozen=True)
class FusedExpert:
    """Where the fused kernels find one expert's weights: act(x W1^T + b1) [* (x W3^T + b3)] W2^T + b2."""
    first: nn.Linear
    gate: Optional[nn.Linear]  # the multiplying projection of a gated expert (its "up" projection)
    second: nn.Linear
    activation: str

    def tensors(self) -> tuple:
        """``(w1, b1, w3, b3, w2, b2)``, None where the expert has none.

        Read from the modules' parameter dicts on every call, so a replaced parameter is seen:
        nn.Module's attribute lookup made these reads cost ~140 us a call at 32 local experts.
        """
        first, second = self.first._parameters, self.second._parameters
        gate = self.gate._parameters if self.gate is not None else {}
        return (first["weight"], first.get("bias"), gate.get("weight"), gate.get("bias"), second["weight"],
                second.get("bias"))

    def linears(self) -> List[nn.Linear]:
        return [self.first, self.second] + ([self.gate] if self.gate is not None else [])


_SEQUENTIAL_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu"}
_SUPPORTED = ("ds_comet.experts.FeedForward, GatedFeedForward, or nn.Sequential(Linear, GELU|ReLU|SiLU, Linear), "
              "as they are (not subclasses, not parametrized)")


def fused_expert(expert: nn.Module) -> Union[FusedExpert, str]:
    """The expert's weights for the fused kernels, or why the fused kernels cannot run it.

    The kernels compute what these modules compute without calling them, so the types must be exactly
    these: a subclass may override ``forward``, and a parametrized Linear computes its weight.
    """
    spec = _spec(expert)
    if spec is None:
        return f"the expert is a {type(expert).__name__}; the fused kernels run {_SUPPORTED}"
    for linear in spec.linears():
        if type(linear) is not nn.Linear:  # a parametrized Linear is of a subclass too
            return f"the expert's layer is a {type(linear).__name__}; the fused kernels run {_SUPPORTED}"
    return spec


def _spec(expert: nn.Module) -> Optional[FusedExpert]:
    if type(expert) is FeedForward:
        return FusedExpert(expert.fc1, None, expert.fc2, expert.activation)
    if type(expert) is GatedFeedForward:
        return FusedExpert(expert.gate_proj, expert.up_proj, expert.down_proj, expert.activation)
    if type(expert) is nn.Sequential and len(expert) == 3:
        first, act, second = expert
        if type(act) is nn.GELU:
            return FusedExpert(first, None, second, "gelu" if act.approximate == "none" else "gelu_tanh")
        if type(act) in _SEQUENTIAL_ACTIVATIONS:
            return FusedExpert(first, None, second, _SEQUENTIAL_ACTIVATIONS[type(act)])
    return None


def expert_tensors_reason(experts: List[FusedExpert], hidden: int, dtype: torch.dtype,
                          device: torch.device) -> Optional[str]:
    """Why the kernels cannot read these experts' weights for [S, hidden] tokens of dtype on device, or None.

    The kernels take every size from the tokens and the first expert, and read every weight and bias
    as dense rows of the tokens' dtype: anything else would be read wrong, not refused.
    """
    first = experts[0]
    ffn = first.first.out_features
    for index, spec in enumerate(experts):
        if (spec.activation, spec.gate is None) != (first.activation, first.gate is None):
            return "the local experts differ in structure"
        inputs = [spec.first] + ([spec.gate] if spec.gate is not None else [])
        if any(linear.in_features != hidden for linear in inputs) or spec.second.out_features != hidden:
            return (f"expert {index} maps {inputs[0].in_features} -> {spec.second.out_features} features, the tokens "
                    f"have {hidden}")
        if any(linear.out_features != ffn for linear in inputs) or spec.second.in_features != ffn:
            return f"expert {index}'s FFN width differs from expert 0's ({ffn}) or between its layers"
        linears = spec.linears()
        if len({linear.bias is None for linear in linears}) > 1 or (spec.first.bias is None) != (
                first.first.bias is None):
            return "the expert's linear layers differ in having a bias; the fused kernels need all or none"
        for linear in linears:
            for name, tensor in linear._parameters.items():
                if tensor is None:
                    continue
                if tensor.dtype != dtype or tensor.device != device:
                    return (f"expert {index}'s {name} is {tensor.dtype} on {tensor.device}, the tokens "
                            f"{dtype} on {device}")
                if not tensor.is_contiguous():
                    return f"expert {index}'s {name} is not contiguous; the fused kernels read dense rows"
    return None
