"""The "fp8" recipe: its quantisation (ds_comet/fp8.py), its emulation on the reference pipeline
(pipelines/fp8_emulation.py) against an independent implementation and against float64, comet
layers that run it on the gloo ranks, and the configurations it refuses.

Fresh random data every run: the seed is in each assertion's message.
"""

import copy
import functools
import math

import pytest
import torch
from deepspeed import comm as dist
from torch import nn
from torch.nn import functional as F

import ds_comet
from ds_comet import fp8
from ds_comet.config import Fp8Recipe, moe_config_from
from ds_comet.experts import ACTIVATIONS, FeedForward, GatedFeedForward
from ds_comet.initialize import PipelineSummary
from ds_comet.kernels.gemm_phases import Phase
from ds_comet.pipelines import policy
from ds_comet.pipelines.expert_weights import ModuleExperts, StackedExperts
from ds_comet.pipelines.fp8_emulation import Fp8EmulatedExperts
from tests.support.dist_pool import cpu_world_size
from tests.support.moe_helpers import make_expert, rel, reset_experts_, run_step

P = cpu_world_size()


def _seed() -> int:
    return torch.randint(1, 10**6, ()).item()


# --- quantisation -------------------------------------------------------------------------------


@functools.cache
def format_grid(name: str) -> torch.Tensor:
    """Every finite non-negative value of the format in code order (ascending), from its definition:
    e4m3fn (bias 7; the top code is NaN, there is no infinity) and e5m2 (bias 15; the top exponent is
    infinity and NaN). Built without torch's float8 casts, which the tests check against it."""
    mantissa_bits, exponent_bits = {"e4m3": (3, 4), "e5m2": (2, 5)}[name]
    bias = 2 ** (exponent_bits - 1) - 1
    values = []
    for exponent in range(2**exponent_bits):
        for mantissa in range(2**mantissa_bits):
            fraction = mantissa / 2**mantissa_bits
            values.append(fraction * 2.0 ** (1 - bias) if exponent == 0 else (1 + fraction) * 2.0 ** (exponent - bias))
    values = values[:-1] if name == "e4m3" else values[: -(2**mantissa_bits)]
    return torch.tensor(values, dtype=torch.float64)


def round_to_grid(values: torch.Tensor, name: str) -> torch.Tensor:
    """``values`` (float64, within the format's range) rounded to the nearest value of the format,
    ties to the even code."""
    grid = format_grid(name)
    magnitude = values.abs()
    upper = torch.searchsorted(grid, magnitude).clamp(1, len(grid) - 1)
    low, high = grid[upper - 1], grid[upper]
    below, above = magnitude - low, high - magnitude
    take_high = (above < below) | ((above == below) & (upper % 2 == 0))
    return torch.where(take_high, high, low) * values.sign()


def independent_qdq(x: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """``x`` ``[M, K]`` quantised in ``block``s and dequantised, fp32, computed as the recipe states it
    in float64: scale = 2**ceil(log2(amax / max)) (exponent at least -126; 1 for a zero block), each
    element x / scale rounded to the nearest value of the format, ties to even."""
    fmt_max = fp8.FORMATS[name].max
    rows, columns = x.shape
    block_rows, block_columns = block
    padded = F.pad(x.double(), (0, -columns % block_columns, 0, -rows % block_rows))
    blocked = padded.view(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_columns, block_columns)
    amax = blocked.abs().amax(dim=(1, 3), keepdim=True)
    exponent = torch.ceil(torch.log2(amax / fmt_max)).clamp(min=-126)
    scale = torch.where(amax > 0, 2.0**exponent, torch.ones_like(amax))
    quantised = round_to_grid(blocked / scale, name) * scale
    return quantised.view(padded.shape)[:rows, :columns].float()


def spread_values(rows: int, columns: int, generator: torch.Generator, octaves: float = 3.0) -> torch.Tensor:
    """Gaussian values whose rows and columns differ in magnitude by up to ``2**±octaves``, so that
    blocks, tiles, rows and columns get different scales."""
    row_scale = 2.0 ** (torch.rand(rows, 1, generator=generator) * 2 * octaves - octaves)
    column_scale = 2.0 ** (torch.rand(1, columns, generator=generator) * 2 * octaves - octaves)
    return torch.randn(rows, columns, generator=generator) * row_scale * column_scale


BLOCKS = {
    "tiles": lambda x, fmt: fp8.quantise_tiles(x, fmt),
    "rows": lambda x, fmt: fp8.quantise_rows(x, fmt),
    "columns": lambda x, fmt: fp8.quantise_columns(x, fmt),
    "blocks": lambda x, fmt: fp8.quantise_blocks(x, fmt),
}


def block_of(kind: str, shape) -> tuple[int, int]:
    return {"tiles": (1, 128), "rows": (1, shape[1]), "columns": (shape[0], 1), "blocks": (128, 128)}[kind]


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_the_cast_rounds_to_nearest_even_on_the_formats_grid(name):
    fmt = fp8.FORMATS[name]
    grid = format_grid(name)
    assert grid[-1] == fmt.max and len(grid) == {"e4m3": 127, "e5m2": 124}[name]
    seed = _seed()
    generator = torch.Generator().manual_seed(seed)
    # Random values over the whole range, every midpoint between neighbours (the ties), and the grid itself.
    spread = torch.exp(torch.empty(20000).uniform_(math.log(2.0**-20), math.log(fmt.max), generator=generator))
    midpoints = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([spread.double(), midpoints, grid])
    values = (values * torch.where(torch.rand(len(values), generator=generator) < 0.5, -1.0, 1.0)).float()
    cast = fp8.quantise_with_scales(values.view(1, -1), torch.ones(1, 1), (1, values.numel()), fmt)
    wanted = round_to_grid(values.double(), name)
    assert torch.equal(cast.double().view(-1), wanted), f"seed {seed}"


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_round_trip_error_within_the_formats_bound(name, kind):
    """In the normal range an element's relative error is at most half a unit in the last place:
    2**-4 with e4m3's 3 mantissa bits, 2**-3 with e5m2's 2; below it (subnormal) its absolute error
    is at most half the subnormal step, 2**(min_normal - mantissa_bits - 1) times the block's scale."""
    fmt = fp8.FORMATS[name]
    seed = _seed()
    x = spread_values(200, 384, torch.Generator().manual_seed(seed), octaves=3)
    quantised = BLOCKS[kind](x, fmt)
    assert quantised.values.dtype == fmt.dtype and quantised.block == block_of(kind, x.shape)
    scale = _expanded(quantised.scales, quantised.block, x.shape)
    error = (quantised.dequantise() - x).abs()
    scaled = x.abs() / scale
    normal = scaled >= 2.0**fmt.min_normal_exponent
    assert normal.float().mean() > 0.9, f"seed {seed}: the data should be mostly in the normal range"
    assert (error[normal] <= fmt.unit_roundoff * x.abs()[normal]).all(), f"seed {seed}"
    subnormal_half_step = 2.0 ** (fmt.min_normal_exponent - fmt.mantissa_bits - 1)
    assert (error[~normal] <= subnormal_half_step * scale[~normal]).all(), f"seed {seed}"
    torch.testing.assert_close(quantised.dequantise(), independent_qdq(x, quantised.block, name), rtol=0, atol=0)


def _expanded(scales: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """Each element's scale, ``[M, K]``."""
    return scales.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_scales_are_the_smallest_powers_of_two_that_fit(name):
    fmt = fp8.FORMATS[name]
    seed = _seed()
    x = spread_values(64, 512, torch.Generator().manual_seed(seed), octaves=20)
    # Blocks whose largest magnitude is exactly max * 2**n: the scale is 2**n, not twice it.
    x[0, :128] = 0.25
    x[0, 5] = fmt.max * 2.0**-7
    quantised = fp8.quantise_tiles(x, fmt)
    mantissa, _ = torch.frexp(quantised.scales)
    assert (mantissa == 0.5).all(), f"seed {seed}: scales that are not powers of two"
    amax = x.abs().view(64, 4, 128).amax(dim=2).double()
    scales = quantised.scales.double()
    assert (amax <= fmt.max * scales).all() and (amax > fmt.max * scales / 2).all(), f"seed {seed}"
    assert quantised.scales[0, 0] == 2.0**-7
    assert quantised.values[0, 5].float() == fmt.max


def test_values_beyond_the_range_saturate():
    for fmt in fp8.FORMATS.values():
        x = torch.tensor([[fmt.max * 4, -fmt.max * 1.01, 3.0, -0.5]])
        values = fp8.quantise_with_scales(x, torch.ones(1, 1), (1, 4), fmt).float()
        assert values.tolist() == [[fmt.max, -fmt.max, 3.0, -0.5]], fmt.name  # not NaN nor infinity


def test_a_zero_block_has_scale_one_and_zero_values():
    x = torch.zeros(3, 256)
    x[1, 130] = 5.0
    quantised = fp8.quantise_tiles(x)
    assert quantised.scales.tolist() == [[1.0, 1.0], [1.0, 2.0**-6], [1.0, 1.0]]
    assert torch.equal(quantised.dequantise(), x)


def test_one_huge_value_takes_its_block_only():
    """A block's scale follows its largest element: beside a huge one the others round to zero or to
    subnormals, while the other blocks keep their precision."""
    seed = _seed()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=generator)
    x[3, 7] = 1e6
    quantised = fp8.quantise_blocks(x)
    out = quantised.dequantise()
    assert quantised.scales[0, 0] == 2.0**12  # 1e6 / 448 = 2232 -> 4096
    assert out[3, 7] == 240 * 2.0**12  # 1e6 / 4096 = 244.1, and e4m3's neighbours there are 240 and 256
    small = torch.cat([out[:3, :128].flatten(), out[4:128, :128].flatten(), out[3, :7], out[3, 8:128]])
    assert (small.abs() < 2.0**6).all() and (small == 0).float().mean() > 0.9  # subnormal (below 2**-6 * 4096) or 0
    others = torch.cat([out[128:].flatten(), out[:128, 128:].flatten()])
    originals = torch.cat([x[128:].flatten(), x[:128, 128:].flatten()])
    assert ((others - originals).abs() <= 2.0**-4 * originals.abs() + 2.0**-10 * 2.0**-6).all(), f"seed {seed}"


def test_representable_values_come_back_exactly_and_requantising_changes_nothing():
    seed = _seed()
    generator = torch.Generator().manual_seed(seed)
    grid = format_grid("e4m3")
    picks = grid[torch.randint(0, len(grid), (96, 256), generator=generator)]
    signs = torch.where(torch.rand(96, 256, generator=generator) < 0.5, -1.0, 1.0)
    block_scales = 2.0 ** torch.randint(-20, 20, (96, 2), generator=generator).double()
    x = (picks * signs * block_scales.repeat_interleave(128, 1)).float()
    x[:, ::128] = (448.0 * block_scales[:, :]).float()  # each tile's largest value at the top of the range
    assert torch.equal(fp8.quantise_tiles(x).dequantise(), x), f"seed {seed}"
    # What crosses the exchange quantised is quantised again for the GEMM: it must come back unchanged.
    y = fp8.quantise_rows(spread_values(96, 256, generator)).dequantise()
    assert torch.equal(fp8.quantise_rows(y).dequantise(), y), f"seed {seed}"


def test_infinity_or_nan_makes_its_block_nan_and_only_its_block():
    x = torch.ones(2, 256)
    x[0, 3] = float("inf")
    x[1, 200] = float("nan")
    out = fp8.quantise_tiles(x).dequantise()
    assert out[0, :128].isnan().all() and out[1, 128:].isnan().all()
    assert (out[0, 128:] == 1).all() and (out[1, :128] == 1).all()


def test_tiles_need_a_multiple_of_128():
    with pytest.raises(ValueError, match=r'1x128 tiles.*got 96: use the recipe\'s "scaling": "rowwise"'):
        fp8.quantise_tiles(torch.randn(4, 96))


def test_partial_edge_blocks_are_scaled_as_blocks_padded_with_zeros():
    seed = _seed()
    x = spread_values(200, 300, torch.Generator().manual_seed(seed))
    padded = F.pad(x, (0, 84, 0, 56))
    assert fp8.quantise_blocks(x).scales.shape == (2, 3)
    assert torch.equal(fp8.quantise_blocks(x).dequantise(), fp8.quantise_blocks(padded).dequantise()[:200, :300])
    # A subnormal fp32 block is scaled at the smallest normal scale, and still within bounds.
    tiny = torch.full((1, 128), 1e-40)
    assert fp8.quantise_tiles(tiny).scales.item() == 2.0**-126


# --- the emulated experts -----------------------------------------------------------------------

HIDDEN, FFN = 256, 384  # two and three 128-tiles: blockwise tiles and blocks line up
COUNTS = [0, 1, 37, 90]  # an expert with no rows, odd and skewed counts


class StackedSwiGLU(nn.Module):
    """AutoEP's ``GroupedExperts`` as ``StackedExperts`` reads it: ``w1``, ``w3`` ``[L, F, H]``,
    ``w2`` ``[L, H, F]``, SwiGLU."""

    activation = "swiglu"

    def __init__(self, num_local: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_local, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_local, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn))

    def forward(self, x, counts):
        parts = x.split(counts.tolist())
        return torch.cat(
            [(F.silu(p @ self.w1[e].t()) * (p @ self.w3[e].t())) @ self.w2[e].t() for e, p in enumerate(parts)]
        )


def make_local_experts(kind: str, dtype: torch.dtype, generator: torch.Generator, octaves: float):
    """(the local experts as the reference pipeline holds them, the module that owns their weights):
    ``len(COUNTS)`` experts of ``kind`` ("gelu": FeedForward with biases, "swiglu": GatedFeedForward,
    "sequential": Sequential(Linear, ReLU, Linear), "stacked": AutoEP's stacked SwiGLU), weights in
    ``dtype`` whose rows and columns differ in magnitude by up to ``2**±octaves``."""
    if kind == "stacked":
        owner = StackedSwiGLU(len(COUNTS), HIDDEN, FFN)
    else:
        owner = nn.ModuleList([make_expert(kind, HIDDEN, FFN) for _ in COUNTS])
    with torch.no_grad():
        for param in owner.parameters():
            if param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            else:
                for matrix in param.view(-1, *param.shape[-2:]):
                    matrix.copy_(spread_values(*matrix.shape, generator, octaves) / matrix.shape[1] ** 0.5)
    owner = owner.to(dtype)
    return local_experts_of(kind, owner), owner


def local_experts_of(kind: str, owner: nn.Module):
    """The local experts whose weights ``owner`` holds, as the reference pipeline holds them."""
    return StackedExperts(owner) if kind == "stacked" else ModuleExperts(owner, list(owner))


RECIPES = {
    "blockwise": {},
    "rowwise": {"scaling": "rowwise"},
    "e5m2 gradients": {"gradient_format": "e5m2"},
    "forward only": {"input_gradients": False},
    "input gradients only": {"forward": False, "dispatch": "bf16"},
    "gradient dispatch": {"gradient_dispatch": "fp8"},
    "weight gradients": {"scaling": "rowwise", "weight_gradients": True},
    "weight gradients only": {
        "scaling": "rowwise",
        "forward": False,
        "input_gradients": False,
        "dispatch": "bf16",
        "weight_gradients": True,
    },
    "e5m2 weight gradients": {"scaling": "rowwise", "weight_gradients": True, "gradient_format": "e5m2"},
}


def emulated_step(kind, dtype, recipe, seed, octaves):
    """The emulated experts' outputs and gradients on fresh rows, with what produced them; rows,
    columns and weights differ in magnitude by up to ``2**±octaves``."""
    generator = torch.Generator().manual_seed(seed)
    experts, owner = make_local_experts(kind, dtype, generator, octaves)
    x = spread_values(sum(COUNTS), HIDDEN, generator, octaves).to(dtype)
    dy = spread_values(sum(COUNTS), HIDDEN, generator, octaves).to(dtype)
    weights = experts.fused(HIDDEN)
    emulated = Fp8EmulatedExperts(experts, weights, Fp8Recipe(enabled=True, **recipe))
    inputs = x.clone().requires_grad_()
    y = emulated.run(inputs, COUNTS)
    y.backward(dy)
    grads = [p.grad for p in weights.parameters()]
    return dict(experts=experts, owner=owner, weights=weights, x=x, dy=dy, y=y.detach(), dx=inputs.grad, grads=grads)


def test_under_autocast_the_emulation_computes_in_autocasts_dtype_as_the_experts_would():
    """The rows are taken in autocast's dtype, as the experts' Linears would take them, and the
    emulation's fp32 products are not lowered: the same numbers as the rows cast beforehand, and the
    same output dtype as the experts without the recipe."""
    generator = torch.Generator().manual_seed(_seed())
    experts, _ = make_local_experts("swiglu", torch.float32, generator, octaves=2.0)
    emulated = Fp8EmulatedExperts(experts, experts.fused(HIDDEN), Fp8Recipe(enabled=True))
    x = spread_values(sum(COUNTS), HIDDEN, generator, 2.0)
    dy = spread_values(sum(COUNTS), HIDDEN, generator, 2.0).bfloat16()
    inputs = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = emulated.run(inputs, COUNTS)
        plain = experts.run(x, torch.tensor(COUNTS))
    assert y.dtype == plain.dtype == torch.bfloat16
    y.backward(dy)
    cast = x.bfloat16().requires_grad_()
    want = emulated.run(cast, COUNTS)
    want.backward(dy)
    assert torch.equal(y, want)
    assert inputs.grad.dtype == torch.float32 and torch.equal(inputs.grad, cast.grad.float())


def independent_expert(x, tensors, activation, dy, recipe: Fp8Recipe):
    """One expert's forward and gradients as the recipe states them (ds_comet/pipelines/fp8_emulation.py's
    docstring), with the test's own quantisation: (y, dx, [dW1, db1, dW3, db3, dW2, db2])."""
    blockwise, dtype = recipe.scaling == "blockwise", x.dtype
    ffn = tensors[4].shape[1]

    def rows(t, name="e4m3"):
        return independent_qdq(t, (1, 128) if blockwise else (1, t.shape[1]), name)

    def weight(w, reduced_axis):
        block = (128, 128) if blockwise else ((1, w.shape[1]) if reduced_axis == 1 else (w.shape[0], 1))
        return independent_qdq(w, block, "e4m3")

    def product(a, w, bias):
        out = a @ w.t()
        return out if bias is None else out + bias.float()

    def columns(t, name="e4m3"):  # a weight gradient's operand: per column over the expert's rows
        return independent_qdq(t, (t.shape[0], 1), name) if recipe.weight_gradients and t.shape[0] else t.float()

    w1, b1, w3, b3, w2, b2 = tensors
    w13 = w1 if w3 is None else torch.cat([w1, w3])
    b13 = b1 if w3 is None or b1 is None else torch.cat([b1, b3])
    fwd, bwd = recipe.forward, recipe.input_gradients
    pre = product(rows(x) if fwd else x.float(), weight(w13, 1) if fwd else w13.float(), b13).to(dtype)
    first = pre[:, :ffn].float()
    act = ACTIVATIONS[activation](first)
    h = (act if w3 is None else act * pre[:, ffn:].float()).to(dtype)
    y = product(rows(h) if fwd else h.float(), weight(w2, 1) if fwd else w2.float(), b2).to(dtype)

    dy_operand = rows(dy, recipe.gradient_format) if bwd and recipe.gradient_dispatch == "bf16" else dy.float()
    grad_h = (dy_operand @ (weight(w2, 0) if bwd else w2.float())).to(dtype).float()
    with torch.enable_grad():
        z = first.clone().requires_grad_()
        a = ACTIVATIONS[activation](z)
    if w3 is None:
        grad_pre = torch.autograd.grad(a, z, grad_h)[0]
    else:
        up = pre[:, ffn:].float()
        grad_pre = torch.cat([torch.autograd.grad(a, z, grad_h * up)[0], grad_h * a.detach()], dim=1)
    grad_pre = grad_pre.to(dtype)
    pre_operand = rows(grad_pre, recipe.gradient_format) if bwd else grad_pre.float()
    dx = (pre_operand @ (weight(w13, 0) if bwd else w13.float())).to(dtype)

    fmt = recipe.gradient_format
    dw13, db13 = columns(grad_pre, fmt).t() @ columns(x), grad_pre.float().sum(0)
    dw2, db2 = columns(dy, fmt).t() @ columns(h), dy.float().sum(0)
    grads = [dw13[:ffn], db13[:ffn], dw13[ffn:], db13[ffn:], dw2, db2]
    present = [w1, b1, w3, b3, w2, b2]
    return y, dx, [None if p is None else g.to(p.dtype) for g, p in zip(grads, present)]


def _grouped(per_expert: list[list], weights) -> list:
    """Per-expert gradients ([L] lists of the six roles) in ``weights.parameters()``'s order."""
    columns = [None if column[0] is None else torch.stack(column) for column in zip(*per_expert)]
    return weights.gradients(*columns)


# Every recipe on the module experts with and without biases in bf16; the scalings on the others and in fp32.
CASES = (
    [(kind, torch.bfloat16, recipe) for kind in ("gelu", "swiglu") for recipe in RECIPES]
    + [(kind, torch.bfloat16, recipe) for kind in ("sequential", "stacked") for recipe in ("blockwise", "rowwise")]
    + [(kind, torch.float32, recipe) for kind in ("gelu", "stacked") for recipe in ("blockwise", "rowwise")]
)


def _case_id(case) -> str:
    kind, dtype, recipe = case
    return f"{kind}-{'bf16' if dtype == torch.bfloat16 else 'fp32'}-{recipe.replace(' ', '_')}"


@pytest.mark.parametrize("kind,dtype,recipe", CASES, ids=[_case_id(case) for case in CASES])
def test_emulation_is_the_recipe_computed_independently(recipe, kind, dtype):
    """Bit for bit: the same quantised operands (the test's own quantisation), the same fp32 products.
    Magnitudes spread over 2**±6 along rows and columns, so that the scales of tiles and rows, and
    of blocks and channels, differ, and some elements are subnormal under one and not the other."""
    seed = _seed()
    step = emulated_step(kind, dtype, RECIPES[recipe], seed, octaves=6)
    full = Fp8Recipe(enabled=True, **RECIPES[recipe])
    ys, dxs, per_expert = [], [], []
    parts = zip(step["x"].split(COUNTS), step["dy"].split(COUNTS), step["weights"].expert_tensors())
    for x, dy, tensors in parts:
        y, dx, grads = independent_expert(
            x, [t.detach() if t is not None else None for t in tensors], step["weights"].activation, dy, full
        )
        ys.append(y)
        dxs.append(dx)
        per_expert.append(grads)
    assert torch.equal(step["y"], torch.cat(ys)), f"seed {seed}: output"
    assert torch.equal(step["dx"], torch.cat(dxs)), f"seed {seed}: input gradient"
    for index, (got, want) in enumerate(zip(step["grads"], _grouped(per_expert, step["weights"]))):
        assert torch.equal(got, want), f"seed {seed}: gradient of parameter {index}"


def _smooth_activation(z: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """act(z), act'(z), act''(z) in float64."""
    with torch.enable_grad():
        z = z.detach().requires_grad_()
        act = ACTIVATIONS[activation](z)
        (first,) = torch.autograd.grad(act.sum(), z, create_graph=True)
        (second,) = torch.autograd.grad(first.sum(), z)
    return act.detach(), first.detach(), second


def error_variances(x, dy, tensors, activation, recipe: Fp8Recipe, u_out: float) -> dict:
    """Bounds on the variance of each element's error, one expert: ``y``, ``dx`` and the six
    gradients (None where absent); see ``test_emulation_is_within_the_formats_bound_of_float64``."""
    sq = torch.square
    w1, b1, w3, b3, w2, _ = [None if t is None else t.detach().double() for t in tensors]
    x, dy = x.double(), dy.double()
    u_f = fp8.E4M3.unit_roundoff if recipe.forward else 0.0  # the forward GEMMs' rows and weights
    u_w = fp8.E4M3.unit_roundoff if recipe.input_gradients else 0.0  # the backward GEMMs' weights
    u_g = fp8.FORMATS[recipe.gradient_format].unit_roundoff if recipe.input_gradients else 0.0
    u_dy = u_g if recipe.gradient_dispatch == "bf16" else 0.0  # "fp8": dy arrives quantised
    # The weight gradients' operands, per column: the gradient's format and e4m3, squared and summed.
    u_wg2 = (
        fp8.FORMATS[recipe.gradient_format].unit_roundoff ** 2 + fp8.E4M3.unit_roundoff**2
    ) * recipe.weight_gradients

    def product(a, v_a, u_a, w, u_b, transpose):
        """The variance of a @ w (or a @ w^T) from a's own variance, a's and w's quantisation."""
        w2_ = sq(w).t() if transpose else sq(w)
        return (v_a + u_a**2 * sq(a)) @ w2_ + u_b**2 * (sq(a) @ w2_)

    zero = torch.zeros_like(x)
    z = x @ w1.t() + (0 if b1 is None else b1)
    act, d1, d2 = _smooth_activation(z, activation)
    var_z = product(x, zero, u_f, w1, u_f, True) + u_out**2 * sq(z)
    if w3 is not None:
        up = x @ w3.t() + (0 if b3 is None else b3)
        var_up = product(x, zero, u_f, w3, u_f, True) + u_out**2 * sq(up)
        h = act * up
        var_h = sq(d1 * up) * var_z + sq(act) * var_up + u_out**2 * sq(h)
    else:
        h, var_h = act, sq(d1) * var_z + u_out**2 * sq(act)
    y = h @ w2.t()
    var_y = product(h, var_h, u_f, w2, u_f, True) + u_out**2 * sq(y)

    g = dy @ w2
    var_g = product(dy, torch.zeros_like(dy), u_dy, w2, u_w, False) + u_out**2 * sq(g)
    if w3 is not None:
        dz, dup = g * d1 * up, g * act
        var_dz = sq(d1 * up) * var_g + sq(g * d2 * up) * var_z + sq(g * d1) * var_up + u_out**2 * sq(dz)
        var_dup = sq(act) * var_g + sq(g * d1) * var_z + u_out**2 * sq(dup)
        dx = dz @ w1 + dup @ w3
        var_dx = product(dz, var_dz, u_g, w1, u_w, False) + product(dup, var_dup, u_g, w3, u_w, False)
    else:
        dz = g * d1
        var_dz = sq(d1) * var_g + sq(g * d2) * var_z + u_out**2 * sq(dz)
        dx = dz @ w1
        var_dx = product(dz, var_dz, u_g, w1, u_w, False)
    var_dx = var_dx + u_out**2 * sq(dx)

    def weight_gradient(a, v_a, b, v_b):
        """The variance of a^T b from a's and b's own variances and, with FP8 weight gradients, their quantisation."""
        return v_a.t() @ sq(b) + sq(a).t() @ v_b + u_wg2 * (sq(a).t() @ sq(b)) + u_out**2 * sq(a.t() @ b)

    grads = [weight_gradient(dz, var_dz, x, zero), var_dz.sum(0) + u_out**2 * sq(dz.sum(0))]
    if w3 is not None:
        grads += [weight_gradient(dup, var_dup, x, zero), var_dup.sum(0) + u_out**2 * sq(dup.sum(0))]
    else:
        grads += [None, None]
    grads += [weight_gradient(dy, torch.zeros_like(dy), h, var_h), u_out**2 * sq(dy.sum(0))]
    present = [w1, b1, w3, b3, w2, tensors[5]]
    return dict(y=var_y, dx=var_dx, grads=[None if p is None else v for v, p in zip(grads, present)])


def float64_truth(kind, owner, x, dy):
    """Outputs and gradients of the same experts in float64, by autograd through their own forward."""
    experts64 = local_experts_of(kind, copy.deepcopy(owner).double())
    inputs = x.double().requires_grad_()
    y = experts64.run(inputs, COUNTS)
    y.backward(dy.double())
    return y.detach(), inputs.grad, [p.grad for p in experts64.fused(HIDDEN).parameters()]


BOUND_CASES = (
    [("swiglu", torch.bfloat16, recipe) for recipe in RECIPES]
    + [("gelu", torch.bfloat16, recipe) for recipe in ("blockwise", "rowwise", "e5m2 gradients", "weight gradients")]
    + [("stacked", torch.bfloat16, recipe) for recipe in ("blockwise", "weight gradients")]
    + [(kind, torch.float32, recipe) for kind in ("gelu", "swiglu") for recipe in ("blockwise", "input gradients only")]
)


@pytest.mark.parametrize("kind,dtype,recipe", BOUND_CASES, ids=[_case_id(case) for case in BOUND_CASES])
def test_emulation_is_within_the_formats_bound_of_float64(kind, dtype, recipe):
    """The emulated experts against float64 autograd of the same experts, tensor by tensor.

    The bound, derived from the formats: rounding a value of the normal range to a format with m
    mantissa bits errs by a relative delta with |delta| <= u = 2**-(m+1) (e4m3 2**-4, e5m2 2**-3,
    bf16 2**-8, fp32 2**-24), so its variance over random data is at most u**2 x value**2. For a
    product a @ b of quantised operands, independent errors add their variances: element (i, j)
    varies by at most sum_k (var(a_ik) + u_a**2 a_ik**2) b_kj**2 + u_b**2 a_ik**2 b_kj**2 (first
    order); an elementwise step passes its input's variance on with its derivative squared (the
    activation's first and second derivatives for its value and its gradient), and every rounding
    to the rows' dtype adds u_D**2 x value**2. ``error_variances`` carries that through the expert
    both ways, from the exact float64 intermediates. First order holds on data scaled as a
    normalised layer's (rows and columns within 2**±1 of each other's size, |z| of order one), where a
    product's error is small against the scale over which the activation bends. The squared error
    summed over a tensor must then stay below twice the summed variances: the bound counts each
    rounding at its largest, u**2, where round-to-nearest averages u**2 / 3 x E[1 / m**2] ~ 0.18 u**2
    over mantissas m spread evenly in log scale, and a sum of hundreds of independent squares does
    not reach ten times its mean; plus fp32 accumulation, at most K x 2**-24 <= 2**-14 of a tensor
    for K <= 768. Subnormal elements, whose absolute error is at most 2**-10 of their block's scale,
    weigh nothing next to that. Where a GEMM runs in FP8 its output's squared error must also reach
    a twentieth of the summed variances (about 0.18 of it is expected): the quantisation
    demonstrably ran.
    """
    seed = _seed()
    step = emulated_step(kind, dtype, RECIPES[recipe], seed, octaves=1)
    full = Fp8Recipe(enabled=True, **RECIPES[recipe])
    y64, dx64, grads64 = float64_truth(kind, step["owner"], step["x"], step["dy"])
    u_out = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    ys, dxs, per_expert = [], [], []
    parts = zip(step["x"].split(COUNTS), step["dy"].split(COUNTS), step["weights"].expert_tensors())
    for x, dy, tensors in parts:
        variances = error_variances(x, dy, tensors, step["weights"].activation, full, u_out)
        ys.append(variances["y"])
        dxs.append(variances["dx"])
        per_expert.append(variances["grads"])

    def check(name, got, want, variance, quantised):
        error = (got.double() - want).square().sum().item()
        bound = variance.sum().item()
        allowed = 2 * bound + (2.0**-14 * want.norm().item()) ** 2
        assert error <= allowed, f"seed {seed}: {name}: squared error {error:.3g} above the bound {allowed:.3g}"
        if quantised:
            assert error >= bound / 20, f"seed {seed}: {name}: squared error {error:.3g}, bound {bound:.3g}"

    check("output", step["y"], y64, torch.cat(ys), full.forward)
    check("input gradient", step["dx"], dx64, torch.cat(dxs), full.input_gradients)
    for index, (got, want, variance) in enumerate(zip(step["grads"], grads64, _grouped(per_expert, step["weights"]))):
        weight = got.dim() >= 2  # a weight's gradient (a stacked one: 3-D), not a bias's
        check(f"gradient of parameter {index}", got, want, variance, full.weight_gradients and weight)


# --- comet layers under the recipe, on the gloo ranks -------------------------------------------

LAYER_HIDDEN, LAYER_FFN = 128, 256
U = fp8.E4M3.unit_roundoff
# The expert-level tests hold the emulation to its bound; a layer sums gate-weighted expert outputs,
# which does not raise their relative error (about u for this data by the expert-level model: each
# GEMM's two quantised operands, the first's error passed on by the activation). Outputs and
# gradients may differ from the run without the recipe by at most 4u (relative, Frobenius), and must
# differ by at least u/8, which neither bf16's rounding (2**-8) nor fp32's reaches: the recipe ran.
LAYER_BOUND, LAYER_FLOOR = 4 * U, U / 8

LAYER_RECIPES = {
    "plain": None,
    "fp8": {"enabled": True},
    "bf16 dispatch": {"enabled": True, "dispatch": "bf16"},
    "fp8 gradient dispatch": {"enabled": True, "gradient_dispatch": "fp8"},
}


def layer_case(seed: int, dtype_name: str) -> dict:
    """The stock-layer comet MoE (SwiGLU experts, EP over every rank) without the recipe and with it
    in three variants, same weights, tokens and routes: each run's relative differences from the
    run without it, whether the exchange variants change what they should, and what ran."""
    rank, dtype = dist.get_rank(), {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    generator = torch.Generator().manual_seed(seed * 17 + rank)
    tokens = torch.randn(1, 48 + 13 * rank, LAYER_HIDDEN, generator=generator).to(dtype)
    loss_weight = torch.randn(tokens.shape, generator=generator).to(dtype)
    steps, pipelines = {}, {}
    for name, recipe in LAYER_RECIPES.items():
        torch.manual_seed(seed)
        moe = {"backend": "comet", "overlap": "none", **({"fp8": recipe} if recipe else {})}
        layer = ds_comet.MoE(
            LAYER_HIDDEN,
            GatedFeedForward(LAYER_HIDDEN, LAYER_FFN),
            2 * P,
            P,
            k=2,
            drop_tokens=False,
            config={"moe": moe},
        )
        layer.set_deepspeed_parallelism()
        reset_experts_(layer, seed)
        steps[name] = run_step(layer.to(dtype), tokens, loss_weight, seed * 31 + rank)
        pipelines[name] = layer.deepspeed_moe.pipelines
    plain = steps["plain"]
    expert = "deepspeed_moe.experts.deepspeed_experts.0"

    def differences(step):
        found = {"output": rel(step["output"], plain["output"]), "input": rel(step["input_grad"], plain["input_grad"])}
        for name, grad in plain["grads"].items():
            if ".experts." in name:
                found[name] = rel(step["grads"][name], grad)
        return found

    fp8_run, bf16_rows, fp8_gradients = steps["fp8"], steps["bf16 dispatch"], steps["fp8 gradient dispatch"]
    return dict(
        differences={name: differences(step) for name, step in steps.items() if name != "plain"},
        experts={name: type(p.reference.experts).__name__ for name, p in pipelines.items()},
        reasons={p.reason for p in pipelines.values()},
        fp8_runs={name: p.fp8_runs for name, p in pipelines.items()},
        summary=summary_line(pipelines.values()),
        # Rows that cross quantised are what the first GEMM quantises: the same products, and only
        # the first layer's weight gradients (taken from the rows the expert's rank holds) differ.
        rows_same_output=torch.equal(fp8_run["output"], bf16_rows["output"])
        and torch.equal(fp8_run["input_grad"], bf16_rows["input_grad"])
        and torch.equal(
            fp8_run["grads"][f"{expert}.down_proj.weight"], bf16_rows["grads"][f"{expert}.down_proj.weight"]
        ),
        rows_change_w1=not torch.equal(
            fp8_run["grads"][f"{expert}.gate_proj.weight"], bf16_rows["grads"][f"{expert}.gate_proj.weight"]
        ),
        # An output gradient that crosses quantised changes the backward only.
        gradients_same_output=torch.equal(fp8_run["output"], fp8_gradients["output"]),
        gradients_change_input=not torch.equal(fp8_run["input_grad"], fp8_gradients["input_grad"]),
    )


def summary_line(selections) -> str:
    """The line ``PipelineSummary`` logs once ``selections`` (which have agreed) have told it."""
    summary = PipelineSummary(torch.nn.Module())
    for selection in selections:
        summary.waiting[id(selection)] = selection
        summary.total += 1
    for selection in selections:
        summary.agreed(selection)
    return summary.line()


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_a_comet_layer_runs_the_recipe_emulated(cpu_pool, dtype_name):
    seed = _seed()
    for result in cpu_pool.run(layer_case, seed=seed, dtype_name=dtype_name):
        assert result["experts"] == {
            "plain": "ModuleExperts",
            "fp8": "Fp8EmulatedExperts",
            "bf16 dispatch": "Fp8EmulatedExperts",
            "fp8 gradient dispatch": "Fp8EmulatedExperts",
        }
        assert all(reason.endswith('"overlap" is "none"') for reason in result["reasons"]), result["reasons"]
        assert result["fp8_runs"] == {name: None if name == "plain" else "emulated" for name in LAYER_RECIPES}
        # The job's one line says where the recipe runs.
        assert result["summary"].endswith(
            'their "fp8" recipe: 3 emulated in float on the reference pipeline (blockwise: forward, input gradients)'
        )
        for recipe, differences in result["differences"].items():
            for name, difference in differences.items():
                assert difference <= LAYER_BOUND, f"seed {seed}: {recipe}: {name} differs by {difference:.3g}"
            for name in ("output", "input"):
                assert differences[name] >= LAYER_FLOOR, f"seed {seed}: {recipe}: {name} {differences[name]:.3g}"
        assert result["rows_same_output"] and result["rows_change_w1"], f"seed {seed}"
        assert result["gradients_same_output"] and result["gradients_change_input"], f"seed {seed}"


def test_autoep_layers_run_the_recipe_emulated(cpu_pool):
    pytest.importorskip("transformers")
    from tests.support.autoep_models import fp8_case

    seed = _seed()
    # The tiny models' hidden size (64) is not a multiple of 128: rowwise scaling.
    recipe = {"enabled": True, "scaling": "rowwise", "gradient_dispatch": "fp8"}
    for differences, kinds in cpu_pool.run(fp8_case, preset="mixtral", seed=seed, recipe=recipe):
        assert kinds and set(kinds) == {"Fp8EmulatedExperts"}, kinds
        experts = {name: d for name, d in differences.items() if ".experts.w" in name}
        assert len(experts) == 3, sorted(differences)
        for name, difference in differences.items():
            assert difference <= LAYER_BOUND, f"seed {seed}: {name} differs by {difference:.3g}"
        for name, difference in experts.items():
            assert difference >= LAYER_FLOOR, f"seed {seed}: {name} differs by {difference:.3g}"


def disagreement_case() -> str:
    """Ranks whose layers differ in their recipe: every rank raises, naming it."""
    recipe = {"enabled": dist.get_rank() == 0}
    layer = ds_comet.MoE(
        LAYER_HIDDEN,
        FeedForward(LAYER_HIDDEN, LAYER_FFN),
        2 * P,
        P,
        k=1,
        config={"moe": {"backend": "comet", "overlap": "none", "fp8": recipe}},
    )
    layer.set_deepspeed_parallelism()
    with pytest.raises(RuntimeError, match="disagree on fp8") as raised:
        layer(torch.randn(8, LAYER_HIDDEN))
    return str(raised.value)


def test_ranks_that_differ_in_their_recipe_are_refused(cpu_pool):
    cpu_pool.run(disagreement_case)


# --- the configuration and where the recipe runs --------------------------------------------------


@pytest.mark.parametrize(
    "recipe,words",
    [
        (
            {"weight_gradients": True},  # blockwise, the default scaling
            ['"weight_gradients": true runs under "scaling": "rowwise" only', 'or "weight_gradients": false'],
        ),
        (
            {"forward": False},
            ['"dispatch": "fp8" (the default) sends the rows', 'set "dispatch": "bf16", or "forward"'],
        ),
        ({"forward": False, "dispatch": "fp8"}, ['"dispatch": "fp8" sends the rows', 'set "dispatch": "bf16", or']),
        (
            {"input_gradients": False, "gradient_dispatch": "fp8"},
            ['"gradient_dispatch": "fp8"', 'set "gradient_dispatch": "bf16", or "input_gradients": true'],
        ),
        (
            {"enabled": True, "forward": False, "input_gradients": False},  # said before the dispatch's rule
            ["enabled with no GEMM in FP8", 'set "forward", "input_gradients" or "weight_gradients" to true, or'],
        ),
        ({"scaling": "tensorwise"}, ["'moe.fp8.scaling' is 'tensorwise'; allowed values: 'blockwise', 'rowwise'"]),
        ({"gradient_format": "e4m3fn"}, ["'moe.fp8.gradient_format' is 'e4m3fn'; allowed values: 'e4m3', 'e5m2'"]),
        ({"fallback": "auto"}, ["'moe.fp8.fallback' is 'auto'; allowed values: 'error', 'bf16'"]),
        ({"enabled": "true"}, ["'moe.fp8.enabled' is 'true'"]),
        (
            {"enable": True},
            ["unknown key 'moe.fp8.enable'; did you mean 'enabled'?; 'moe.fp8' takes: enabled, scaling,"],
        ),
        (  # settings that could change nothing under this recipe
            {"enabled": True, "input_gradients": False, "gradient_format": "e5m2"},
            ['"gradient_format" is the format of the gradients', "remove it, or set one of them to true"],
        ),
        (
            {
                "scaling": "rowwise",
                "forward": False,
                "input_gradients": False,
                "weight_gradients": True,
                "dispatch": "bf16",
                "gemm2": False,
            },
            ['"gemm2" chooses GEMM2\'s precision within "forward" and "input_gradients", and both are false'],
        ),
        ({"GEMM2": False}, ["unknown key 'moe.fp8.GEMM2'; did you mean 'gemm2'?"]),  # case alone differs
        ({"colour": "red"}, ["unknown key 'moe.fp8.colour'; 'moe.fp8' takes: enabled,"]),  # no close key: no guess
        ([True], ["'moe.fp8' must be a JSON object"]),
    ],
)
def test_a_recipe_that_cannot_run_is_refused_naming_the_fix(recipe, words):
    with pytest.raises(ValueError) as raised:
        moe_config_from({"moe": {"backend": "comet", "fp8": recipe}})
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_the_recipe_is_off_by_default_and_read_as_one_object():
    assert moe_config_from({"moe": {"backend": "comet"}}).fp8 == Fp8Recipe()
    recipe = moe_config_from({"moe": {"backend": "comet", "fp8": {"enabled": True, "scaling": "rowwise"}}}).fp8
    assert (recipe.enabled, recipe.scaling, recipe.forward, recipe.input_gradients) == (True, "rowwise", True, True)
    assert (recipe.weight_gradients, recipe.gradient_format, recipe.dispatch) == (False, "e4m3", "fp8")
    assert (recipe.gradient_dispatch, recipe.fallback) == ("bf16", "error")
    assert not Fp8Recipe().enabled
    alone = {"enabled": True, "scaling": "rowwise", "forward": False, "input_gradients": False, "dispatch": "bf16"}
    recipe = moe_config_from({"moe": {"backend": "comet", "fp8": {**alone, "weight_gradients": True}}}).fp8
    assert recipe.weight_gradients and not (recipe.forward or recipe.input_gradients)


def test_the_recipe_under_the_deepspeed_backend_is_reported_as_ignored(monkeypatch):
    import ds_comet.config as config

    said = []
    monkeypatch.setattr(config.logger, "warning", said.append)
    monkeypatch.setattr(config, "_warned_ignored", set())
    assert moe_config_from({"moe": {"fp8": {"enabled": True}}}).backend == "deepspeed"
    assert len(said) == 1 and "keys fp8 only apply to" in said[0], said


def test_a_recipe_written_without_enabled_is_reported_as_not_running(monkeypatch):
    """A section that sets keys but leaves "enabled" at its default (false) most likely meant to run: one
    warning naming the keys and the fix; an explicit "enabled": false says nothing."""
    import ds_comet.config as config

    said = []
    monkeypatch.setattr(config.logger, "warning", said.append)
    monkeypatch.setattr(config, "_warned_recipe_off", set())
    section = {"scaling": "rowwise", "weight_gradients": True}
    for _ in range(2):  # once a job, not once a layer
        assert not moe_config_from({"moe": {"backend": "comet", "fp8": section}}).fp8.enabled
    assert len(said) == 1, said
    assert "'moe.fp8' sets scaling, weight_gradients but not \"enabled\"" in said[0], said
    assert 'set "enabled": true to run it' in said[0], said
    moe_config_from({"moe": {"backend": "comet", "fp8": {**section, "enabled": False}}})
    moe_config_from({"moe": {"backend": "comet", "fp8": {"enabled": True, "scaling": "rowwise"}}})
    assert len(said) == 1, said


def test_the_job_line_names_the_recipes_scaling_and_its_gemms_in_fp8():
    assert Fp8Recipe(enabled=True).described() == "blockwise: forward, input gradients"
    recipe = Fp8Recipe(enabled=True, scaling="rowwise", dispatch="bf16", weight_gradients=True)
    assert recipe.described() == "rowwise: forward, input gradients, weight gradients"
    alone = Fp8Recipe(
        enabled=True, scaling="rowwise", forward=False, input_gradients=False, dispatch="bf16", weight_gradients=True
    )
    assert alone.described() == "rowwise: weight gradients"
    assert (
        Fp8Recipe(enabled=True, gemm2=False).described()
        == "blockwise: forward, input gradients, GEMM2 in high precision"
    )


def _layer(hidden, expert, recipe, overlap="none"):
    config = {"moe": {"backend": "comet", "overlap": overlap, "fp8": recipe}}
    return ds_comet.MoE(hidden, expert, num_experts=4, k=2, config=config).deepspeed_moe


def test_a_layer_the_recipe_cannot_scale_is_refused_when_built():
    with pytest.raises(
        ValueError,
        match=r"needs hidden \(96\) and FFN \(256\) sizes that are multiples of 128; use "
        r'"scaling": "rowwise". Or set "fp8": \{"fallback": "bf16"\}',
    ):
        _layer(96, FeedForward(96, 256), {"enabled": True})
    moe = _layer(96, FeedForward(96, 256), {"enabled": True, "scaling": "rowwise"})
    assert moe.pipelines.pipeline_for(torch.randn(8, 96)) is moe.pipelines.reference
    assert isinstance(moe.pipelines.reference.experts, Fp8EmulatedExperts)


def test_experts_the_kernels_do_not_compute_are_refused_or_run_without_the_recipe(monkeypatch):
    import ds_comet.pipelines.selection as selection

    tanh = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128))
    with pytest.raises(
        ValueError,
        match=r'"fp8"\}\ recipe cannot run: the FP8 recipe computes the experts as the '
        r"fused kernels do, and the expert is a Sequential",
    ):
        _layer(128, tanh, {"enabled": True})
    said = []
    monkeypatch.setattr(selection.logger, "warning", said.append)
    moe = _layer(128, tanh, {"enabled": True, "fallback": "bf16"})
    assert moe.pipelines.pipeline_for(torch.randn(8, 128)) is moe.pipelines.reference
    assert type(moe.pipelines.reference.experts) is ModuleExperts and moe.pipelines.reference.fp8_exchange is None
    assert len(said) == 1 and 'runs without its "fp8" recipe ("fallback": "bf16"): the FP8 recipe' in said[0]
    # AutoEP's "score_apply": "pre" scales rows before the experts, which the kernels do not do.
    experts = ModuleExperts(nn.ModuleList([FeedForward(128, 128)]), [FeedForward(128, 128)])
    assert "score_apply" in policy.fp8_layer_reason(experts, 128, 2, True, Fp8Recipe(enabled=True))


def test_on_cpu_the_reference_pipeline_emulates_the_recipe(monkeypatch):
    import ds_comet.pipelines.selection as selection

    said = []
    monkeypatch.setattr(selection.logger, "warning", said.append)
    moe = _layer(128, GatedFeedForward(128, 256), {"enabled": True}, overlap="auto")
    assert moe.pipelines.pipeline_for(torch.randn(8, 128)) is moe.pipelines.reference
    assert "the tokens are on cpu" in moe.pipelines.reason
    assert isinstance(moe.pipelines.reference.experts, Fp8EmulatedExperts)
    assert (
        moe.pipelines.reference.fp8_exchange.rows_in_fp8 and not moe.pipelines.reference.fp8_exchange.gradients_in_fp8
    )
    assert not said
    # The emulation computes the experts from their weights: hooks on them are named, not run.
    moe.experts.deepspeed_experts[0].register_forward_hook(lambda *args: None)
    moe.pipelines._agreed_key = None  # as when the group agrees again
    moe.pipelines.pipeline_for(torch.randn(8, 128))
    assert len(said) == 1 and "without calling their modules: an expert's GatedFeedForward has forward_hooks" in said[0]


@pytest.mark.parametrize(
    "overlap,fallback,outcome",
    [
        ("auto", "error", "the reference pipeline emulates"),
        ("auto", "bf16", "the reference pipeline emulates"),
        ("fused", "error", "the reference pipeline emulates"),
        ("fused", "bf16", "fused"),
    ],
)
def test_where_the_fused_pipeline_cannot_run_an_enabled_recipe_it_does_not_run_it_in_bf16(
    monkeypatch, overlap, fallback, outcome
):
    """Where the fused pipeline could run the call in bf16 but cannot run the recipe (here: rowwise
    scaling, which its FP8 GEMMs do not run), an enabled recipe does not let it run silently without
    the recipe: under "auto" the reference pipeline emulates it (a reason logged); under "fused" that
    reason is the error, unless "fallback": "bf16" runs the fused kernels in bf16 with a warning."""
    import ds_comet.pipelines.selection as selection

    said = []
    monkeypatch.setattr(selection.logger, "warning", said.append)
    recipe = {"enabled": True, "scaling": "rowwise", "fallback": fallback}
    moe = _layer(128, FeedForward(128, 128), recipe, overlap=overlap)
    fused = moe.pipelines.experts.fused(128)
    tokens = torch.randn(8, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(selection, "fp8_reason", lambda *args: None)  # a GPU that can run FP8 GEMMs
    monkeypatch.setattr(selection, "device_capability", lambda device: (9, 0))
    answer = moe.pipelines._fp8_fused(fused, tokens)
    refusal = "(triton_fp8 runs blockwise FP8 scaling, not rowwise; library_fp8 "
    assert moe.pipelines._fp8_facts is None
    if outcome == "fused":
        assert answer is fused
        assert len(said) == 1 and 'in bf16, without its "fp8" recipe ("fallback": "bf16"): ' in said[0]
        assert refusal in said[0]
    else:
        assert answer.startswith('the "fp8" recipe is enabled, and ') and refusal in answer
        assert outcome in answer and '"fp8": {"fallback": "bf16"} runs the fused kernels in bf16' in answer
        assert not said


FORWARD_PHASES = frozenset({Phase.FIRST_LAYER, Phase.GEMM2})
# Rowwise scaling runs only on library_fp8, which needs stacked experts (these are one module each).
ROWWISE_ON_MODULES = "(triton_fp8 runs blockwise FP8 scaling, not rowwise; library_fp8 needs stacked expert weights"
BACKWARD_PHASES = frozenset({Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD})


@pytest.mark.parametrize(
    "recipe,capability,outcome",
    [
        ({}, (9, 0), FORWARD_PHASES | BACKWARD_PHASES),
        ({"gradient_format": "e5m2"}, (9, 0), FORWARD_PHASES | BACKWARD_PHASES),
        ({"input_gradients": False}, (9, 0), FORWARD_PHASES),
        ({"forward": False}, (9, 0), BACKWARD_PHASES),
        ({"scaling": "rowwise"}, (9, 0), ROWWISE_ON_MODULES),
        ({}, (8, 9), "(triton_fp8 runs on sm_90, not sm_89; "),
        ({"gradient_dispatch": "fp8"}, (9, 0), FORWARD_PHASES | BACKWARD_PHASES),
        ({"gradient_dispatch": "fp8", "gradient_format": "e5m2"}, (9, 0), FORWARD_PHASES | BACKWARD_PHASES),
        ({"gradient_dispatch": "fp8", "forward": False}, (9, 0), BACKWARD_PHASES),
        (
            {"gradient_dispatch": "fp8", "scaling": "rowwise"},
            (9, 0),
            ROWWISE_ON_MODULES,
        ),
        ({"dispatch": "fp8"}, (9, 0), FORWARD_PHASES | BACKWARD_PHASES),
        ({"dispatch": "fp8", "input_gradients": False}, (9, 0), FORWARD_PHASES),
        ({"dispatch": "fp8", "scaling": "rowwise"}, (9, 0), ROWWISE_ON_MODULES),
    ],
    ids=[
        "blockwise",
        "e5m2",
        "forward",
        "input-gradients",
        "rowwise",
        "sm89",
        "gradient-dispatch",
        "gradient-dispatch-e5m2",
        "gradient-dispatch-backward",
        "gradient-dispatch-rowwise",
        "fp8-dispatch",
        "fp8-dispatch-forward",
        "fp8-dispatch-rowwise",
    ],
)
def test_an_enabled_recipe_runs_on_the_fused_fp8_gemms_where_they_run_it(monkeypatch, recipe, capability, outcome):
    """Blockwise scaling on sm_90 runs on the fused pipeline, rows crossing in bf16 or, with
    ``"dispatch": "fp8"`` (the default), packed in FP8, output gradients likewise with
    ``"gradient_dispatch"``, its FP8 GEMMs taking the phases the recipe puts in FP8; what they do not
    run keeps the emulation, with the reason naming what stands in the way."""
    import ds_comet.pipelines.selection as selection

    monkeypatch.setattr(selection, "fp8_reason", lambda *args: None)
    monkeypatch.setattr(selection, "device_capability", lambda device: capability)
    moe = _layer(128, GatedFeedForward(128, 256), {"enabled": True, "dispatch": "bf16", **recipe}, overlap="auto")
    fused = moe.to(torch.bfloat16).pipelines.experts.fused(128)
    answer = moe.pipelines._fp8_fused(fused, torch.randn(8, 128, dtype=torch.bfloat16))
    if isinstance(outcome, frozenset):
        assert answer is fused
        facts = moe.pipelines._fp8_facts
        assert facts.phases == outcome and (facts.hidden, facts.ffn) == (128, 256)
        assert (facts.scaling, facts.gradient_format) == ("blockwise", recipe.get("gradient_format", "e4m3"))
        assert facts.rows_in_fp8 == (recipe.get("dispatch") == "fp8")
        assert facts.gradients_in_fp8 == (recipe.get("gradient_dispatch") == "fp8")
    else:
        assert moe.pipelines._fp8_facts is None
        assert answer.startswith('the "fp8" recipe is enabled, and ') and outcome in answer, answer
        assert "the reference pipeline emulates the recipe" in answer


def test_where_fp8_gemms_cannot_run():
    recipe, rowwise = Fp8Recipe(enabled=True), Fp8Recipe(enabled=True, scaling="rowwise")
    cuda = torch.device("cuda", 0)
    assert "need a CUDA GPU" in policy.fp8_reason(torch.device("cpu"), None, torch.bfloat16, 128, 256, recipe)
    assert "8.9 or newer (Ada, Hopper); this GPU has 8.0" in policy.fp8_reason(
        cuda, (8, 0), torch.bfloat16, 128, 256, recipe
    )
    assert "bf16 tokens, these are torch.float16" in policy.fp8_reason(cuda, (9, 0), torch.float16, 128, 256, recipe)
    assert "multiples of 128" in policy.fp8_reason(cuda, (9, 0), torch.bfloat16, 128, 200, recipe)
    assert policy.fp8_reason(cuda, (9, 0), torch.bfloat16, 128, 200, rowwise) is None
    assert policy.fp8_reason(cuda, (8, 9), torch.bfloat16, 128, 256, recipe) is None
