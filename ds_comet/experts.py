"""Expert modules, and where the fused kernels find an expert's weights.

Any row-wise module works as an expert on the reference pipeline, which calls it. The fused
kernels compute every local expert from its weights without calling it:

    act(x W1^T + b1) [* (x W3^T + b3)] W2^T + b2

so they need to know which ``nn.Linear`` holds W1 (the activation's input), which holds W3 (the
factor of a gated expert, often called "up"), which holds W2 (the down projection), and which
activation sits between them. ``FeedForward``, ``GatedFeedForward`` and ``nn.Sequential(Linear,
GELU|ReLU|SiLU, Linear)`` are known; any other class says it with ``register_expert``, keeping its
own parameter names (and so its checkpoints)::

    ds_comet.register_expert(SwiGLUExpert, first="w1", up="w3", second="w2", activation="silu")

(``SwiGLUExpert`` standing for a class of one's own with ``nn.Linear`` members w1, w3 and w2.)

A registered class's own ``forward`` is then compared with that formula on a few random rows at
several scales (large ones show a clamp or a saturation), in training and in eval mode, when a
layer first chooses the fused pipeline: an expert that computes something else (another
activation, a scale, a clamp) or holds a dropout runs the reference pipeline, with the difference
as the reason.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


# Modules whose output for one row depends on the other rows of the batch. ds_comet gives each
# expert exactly its routed rows; stock DeepSpeed gives it a capacity buffer padded with zero rows;
# so an expert holding one of these would compute something else under each, with no error.
ROW_MIXING_MODULES = (
    nn.modules.batchnorm._BatchNorm,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.Transformer,
)


def row_mixing_reason(expert: nn.Module) -> str | None:
    """Why ``expert`` is not row-wise, as far as its submodules tell, or None.

    Only the modules above are recognised; a custom ``forward`` that mixes rows cannot be seen
    here, and stays the user's contract (docs/configuration.md)."""
    for name, module in expert.named_modules():
        if isinstance(module, ROW_MIXING_MODULES):
            where = f"its submodule {name!r}" if name else "it"
            return (
                f"the expert {type(expert).__name__} is not row-wise: {where} ({type(module).__name__}) makes "
                "a row's output depend on the other rows of the batch. ds_comet's pipelines give each expert "
                "only its routed rows and stock DeepSpeed a zero-padded capacity buffer, so the two would "
                "compute different numbers; use a row-wise module (LayerNorm rather than BatchNorm), or "
                '"moe": {"backend": "deepspeed"} to keep stock\'s behaviour'
            )
    return None


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
class ExpertLayout:
    """Where an expert class keeps its weights, as attribute paths of ``nn.Linear`` submodules.

    ``activation`` is a name in ``ACTIVATIONS`` or a function of the module that returns one (for
    classes that keep it per instance). ``checked``: whether the class's ``forward`` is compared
    with the formula before the fused kernels replace it (every class registered by a user is).
    """

    first: str
    second: str
    up: str | None = None
    activation: str | Callable[[nn.Module], str] = "gelu"
    checked: bool = True


_LAYOUTS: dict[type, ExpertLayout] = {}


def register_expert(
    cls: type, *, first: str, second: str, up: str | None = None, activation: str | Callable[[nn.Module], str]
) -> None:
    """Tell the fused kernels where instances of ``cls`` keep their weights.

    ``first``, ``up`` and ``second`` name the ``nn.Linear`` submodules holding W1, W3 (gated experts
    only) and W2, by attribute path ("mlp.w1" is fine); ``activation`` is one of ``ACTIVATIONS``
    (or a function of the module returning one). Only instances of exactly ``cls`` are covered: a
    subclass may compute something else. Registering a class again replaces its layout.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_expert takes an nn.Module class, got {cls!r}")
    if isinstance(activation, str):
        _activation(activation)
    elif not callable(activation):
        raise TypeError(
            f"activation must be a name in {list(ACTIVATIONS)} or a function of the module, got {activation!r}"
        )
    _LAYOUTS[cls] = ExpertLayout(first=first, second=second, up=up, activation=activation)


_LAYOUTS[FeedForward] = ExpertLayout("fc1", "fc2", None, lambda m: m.activation, checked=False)
_LAYOUTS[GatedFeedForward] = ExpertLayout("gate_proj", "down_proj", "up_proj", lambda m: m.activation, checked=False)


@dataclass(frozen=True)
class FusedExpert:
    """One expert's weights as the fused kernels read them: act(x W1^T + b1) [* (x W3^T + b3)] W2^T + b2."""

    first: nn.Linear
    gate: nn.Linear | None  # the multiplying projection of a gated expert (its "up" projection)
    second: nn.Linear
    activation: str
    module: nn.Module | None = None  # the expert itself, when its forward is to be checked

    def tensors(self) -> tuple:
        """``(w1, b1, w3, b3, w2, b2)``, None where the expert has none.

        Read from the modules' parameter dicts on every call, so a replaced parameter is seen:
        nn.Module's attribute lookup made these reads cost ~140 us a call at 32 local experts.
        """
        first, second = self.first._parameters, self.second._parameters
        gate = self.gate._parameters if self.gate is not None else {}
        return (
            first["weight"],
            first.get("bias"),
            gate.get("weight"),
            gate.get("bias"),
            second["weight"],
            second.get("bias"),
        )

    def linears(self) -> list[nn.Linear]:
        return [self.first, self.second] + ([self.gate] if self.gate is not None else [])

    def compute(self, x: Tensor) -> Tensor:
        """What the fused kernels compute for rows ``x``, in plain torch (the formula above)."""
        h = ACTIVATIONS[self.activation](F.linear(x, self.first.weight, self.first.bias))
        if self.gate is not None:
            h = h * F.linear(x, self.gate.weight, self.gate.bias)
        return F.linear(h, self.second.weight, self.second.bias)


_SEQUENTIAL_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu"}
_SUPPORTED = (
    "ds_comet.experts.FeedForward, GatedFeedForward, nn.Sequential(Linear, GELU|ReLU|SiLU, Linear), or a "
    "class registered with ds_comet.register_expert, as they are (not subclasses, not parametrized)"
)


def fused_expert(expert: nn.Module) -> FusedExpert | str:
    """The expert's weights for the fused kernels, or why the fused kernels cannot run it.

    The kernels compute what these modules compute without calling them, so the types must be exactly
    the known or registered ones: a subclass may override ``forward``, and a parametrized Linear
    computes its weight.
    """
    spec = _spec(expert)
    if isinstance(spec, str):
        return spec
    for linear in spec.linears():
        if type(linear) is not nn.Linear:  # a parametrized Linear is of a subclass too
            return f"the expert's layer is a {type(linear).__name__}; the fused kernels run {_SUPPORTED}"
    return spec


def _spec(expert: nn.Module) -> FusedExpert | str:
    layout = _LAYOUTS.get(type(expert))
    if layout is not None:
        return _from_layout(expert, layout)
    if type(expert) is nn.Sequential and len(expert) == 3:
        first, act, second = expert
        if type(act) is nn.GELU:
            return FusedExpert(first, None, second, "gelu" if act.approximate == "none" else "gelu_tanh")
        if type(act) in _SEQUENTIAL_ACTIVATIONS:
            return FusedExpert(first, None, second, _SEQUENTIAL_ACTIVATIONS[type(act)])
    return f"the expert is a {type(expert).__name__}; the fused kernels run {_SUPPORTED}"


def _from_layout(expert: nn.Module, layout: ExpertLayout) -> FusedExpert | str:
    name = type(expert).__name__
    linears = {}
    for role in ("first", "up", "second"):
        path = getattr(layout, role)
        if path is None:
            continue
        try:
            linears[role] = expert.get_submodule(path)
        except AttributeError:
            return f"the expert {name} has no submodule {path!r}, which register_expert named as its {role} layer"
        if not isinstance(linears[role], nn.Linear):
            return (
                f"the expert {name}'s {path!r} is a {type(linears[role]).__name__}, not the nn.Linear that "
                "register_expert needs"
            )
    activation = layout.activation(expert) if callable(layout.activation) else layout.activation
    if activation not in ACTIVATIONS:
        return f"the expert {name}'s activation {activation!r} is not one of {', '.join(ACTIVATIONS)}"
    return FusedExpert(
        linears["first"], linears.get("up"), linears["second"], activation, expert if layout.checked else None
    )


def expert_width_reason(expert: nn.Module, hidden: int) -> str | None:
    """Why ``expert`` cannot map rows of ``hidden`` features to rows of ``hidden`` features, as far
    as its layers tell, or None.

    The known and registered kinds are read through their layout: the first (and up) layer's input
    and the second layer's output. Another class is refused only when it holds ``nn.Linear`` layers
    and none takes ``hidden`` features (a class of uninitialised lazy layers is not judged).
    """
    name = type(expert).__name__
    spec = _spec(expert)
    if not isinstance(spec, str):
        inputs = [spec.first] + ([spec.gate] if spec.gate is not None else [])
        takes = [linear.in_features for linear in inputs if linear.in_features != hidden]
        if takes:
            return f"the expert {name} takes rows of {takes[0]} features, the layer's hidden_size is {hidden}"
        if spec.second.out_features != hidden:
            return (
                f"the expert {name} returns rows of {spec.second.out_features} features, the layer's hidden_size "
                f"is {hidden}"
            )
        return None
    linears = [module for module in expert.modules() if isinstance(module, nn.Linear)]
    if not linears or any(isinstance(module, nn.modules.lazy.LazyModuleMixin) for module in linears):
        return None
    widths = sorted({linear.in_features for linear in linears})
    if hidden in widths:
        return None
    return (
        f"the expert {name}'s nn.Linear layers take rows of {', '.join(map(str, widths))} features, none of "
        f"them the layer's hidden_size {hidden}"
    )


# Scales of the random rows (standard deviations) the formula check runs on: a clamp or a saturation
# in an expert's forward (gpt-oss clamps its SwiGLU at 7) changes nothing on rows of scale 1 and
# much on larger ones, which trained models feed their experts.
CHECK_SCALES = (1.0, 10.0, 100.0)


def forward_mismatch(spec: FusedExpert, hidden: int, rows: int = 16, tolerance: float = 2e-2) -> str | None:
    """Why a registered expert's own ``forward`` is not the formula the fused kernels compute, or None.

    Both run on the same random rows in the weights' dtype, at each scale of ``CHECK_SCALES`` (a
    scale where the formula itself overflows the dtype is skipped), with the module in training
    mode and in eval mode (the choice holds for every later call, whichever mode the first one
    had); a relative difference past ``tolerance`` (a few bf16 roundings) is a different
    computation, not rounding. Dropout is refused outright, since a small rate could pass for
    rounding. The modules' modes and the random number generators are left as they were.
    """
    module = spec.module
    if module is None:
        return None
    name = type(module).__name__
    dropouts = sorted(
        {
            f"{type(m).__name__}(p={m.p})"
            for m in module.modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        }
    )
    if dropouts:
        return (
            f"the expert {name} holds {', '.join(dropouts)}, which the fused kernels do not apply; drop it from "
            'the expert, or run the reference pipeline ("overlap": "none")'
        )
    weight = spec.first.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)
    unit_rows = torch.randn(rows, hidden, generator=generator, device=weight.device)
    modes = [(m, m.training) for m in module.modules()]
    try:
        for scale in CHECK_SCALES:
            x = (unit_rows * scale).to(weight.dtype)
            with torch.no_grad():
                want = spec.compute(x)
            if not torch.isfinite(want).all():
                continue  # the dtype's range, not the expert, ends the check here
            for training in (True, False):
                reason = _mismatch_in_mode(spec, x, want, training, tolerance, scale)
                if reason is not None:
                    return f"the expert {name}'s forward {reason}"
    finally:
        for m, training in modes:
            m.training = training
    return None


def _mismatch_in_mode(
    spec: FusedExpert, x: Tensor, want: Tensor, training: bool, tolerance: float, scale: float
) -> str | None:
    """How the expert's forward on rows ``x`` (random, of standard deviation ``scale``) in
    ``training`` mode differs from ``want`` (the formula's output), past ``tolerance``; None where
    it does not (``forward_mismatch``)."""
    module = spec.module
    devices = [x.device] if x.device.type == "cuda" else []
    module.train(training)
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        got = module(x)
    got = got[0] if isinstance(got, tuple) else got
    if got.shape != want.shape:
        return f"returns {tuple(got.shape)} for {tuple(x.shape)} rows, the registered layout gives {tuple(want.shape)}"
    error = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if error <= tolerance:
        return None
    return (
        f"in {'training' if training else 'eval'} mode differs from its registered layout by {error:.3g} "
        f"(relative) on random rows of standard deviation {scale:g}: the fused kernels would compute something "
        "else (a clamp or a saturation shows on large rows); check register_expert's first/up/second/activation"
    )


def expert_tensors_reason(
    experts: list[FusedExpert], hidden: int, dtype: torch.dtype, device: torch.device
) -> str | None:
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
            return (
                f"expert {index} maps {inputs[0].in_features} -> {spec.second.out_features} features, the tokens "
                f"have {hidden}"
            )
        if any(linear.out_features != ffn for linear in inputs) or spec.second.in_features != ffn:
            return f"expert {index}'s FFN width differs from expert 0's ({ffn}) or between its layers"
        linears = spec.linears()
        if len({linear.bias is None for linear in linears}) > 1 or (spec.first.bias is None) != (
            first.first.bias is None
        ):
            return "the expert's linear layers differ in having a bias; the fused kernels need all or none"
        for linear in linears:
            for name, tensor in linear._parameters.items():
                if tensor is None:
                    continue
                reason = tensor_reason(f"expert {index}'s {name}", tensor, dtype, device)
                if reason is not None:
                    return reason
    return None


def tensor_reason(what: str, tensor: Tensor, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernels cannot read ``tensor`` as dense rows of ``dtype`` on ``device``, or None."""
    if tensor.dtype != dtype or tensor.device != device:
        return f"{what} is {tensor.dtype} on {tensor.device}, the tokens {dtype} on {device}"
    if not tensor.is_contiguous():
        return f"{what} is not contiguous; the fused kernels read dense rows"
    return None
