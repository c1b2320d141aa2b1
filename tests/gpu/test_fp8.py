"""The fused pipeline's FP8 GEMMs on the GPU (skipped without CUDA; AutoEP cases also without
transformers): the kernels against ``ds_comet/fp8.py`` and the emulation, and FP8 layers (stock-style
MoE and AutoEP) against the reference pipeline's emulation of the same recipe and against float64.

The expert-parallel size is the pool's (tests/support/dist_pool.py): run once with one GPU (EP=1) and
once with DS_COMET_TEST_RANKS_PER_GPU=2 (EP=2, two ranks sharing it) or two GPUs.

The bounds, from the formats. U = 2**-4 is e4m3's unit roundoff.

- Kernels (tests/support/fp8_gemm_cases.py): bit for bit on every scale and quantised value, and each
  GEMM within one bf16 step and the summation's error of the emulation; the tensor cores' FP8
  accumulation within a 128-deep step adds ``MMA_ERROR`` per unit of the products' summed magnitudes
  (DeepSeek-V3 measured about 14 bits kept on Hopper: 2**-9 leaves a margin over a sum of 128
  products rounded at 2**-14 each, as random errors grow, not as their worst case).
- Layers against the emulation of the same recipe: the fused GEMMs differ from the emulation's by
  their summation and, in a gated expert's forward, by activating the fp32 products where the
  emulation activates their bf16 roundings, so an intermediate (h, g, the products' gradients) may
  differ by a bf16 step or two. Its quantisation then takes the other e4m3 value where that step
  crosses a rounding boundary: for about 2**-9 / 2**-3.5, some 2 %, of its elements, each off by
  an e4m3 step (2**-3.5 relative on average). That is a relative (Frobenius) difference of about
  sqrt(0.02) x 2**-3.5 = 1.2 % passed on to the outputs and gradients: ``EMULATION_BOUND`` = U / 2
  = 3.1 % leaves room for correlated flips.
- Layers against float64 (the bf16 weights evaluated exactly, no recipe): as the CPU suite holds the
  emulation to the run without the recipe, ``LAYER_BOUND`` = 4 U; and the recipe must have run: the
  output and input gradient differ from the fused bf16 run's by at least ``LAYER_FLOOR`` = U / 8,
  which bf16's own rounding (2**-8) does not reach.
"""

import os
import subprocess
import sys

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet import fp8
from tests.support.autoep_models import FUSED_PRESETS, fp8_fused_case, fp8_training_case
from tests.support.moe_helpers import make_expert, rel, reset_experts_

U = fp8.E4M3.unit_roundoff
EMULATION_BOUND, LAYER_BOUND, LAYER_FLOOR = U / 2, 4 * U, U / 8
MMA_ERROR = 2.0**-9
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Rows cross the exchange in bf16 unless a case says otherwise (FP8_ROWS: packed in FP8, the default).
RECIPE = {"enabled": True, "dispatch": "bf16"}
FP8_ROWS = {"dispatch": "fp8"}
# Output gradients crossing packed in FP8, each route's gate in its row's scales.
FP8_GRADIENTS = {"gradient_dispatch": "fp8"}
# The weight gradients alone in FP8 (rowwise scaling, on torch._scaled_grouped_mm), the other GEMMs in bf16.
WEIGHT_GRADIENTS_ONLY = {"scaling": "rowwise", "forward": False, "input_gradients": False, "weight_gradients": True}


def _seed():
    return torch.randint(1, 10**6, ()).item()


def _on_the_gpu(code: str) -> str:
    """``code`` in a child process on the GPU (a kernel that faults must not take the pool's context)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prelude = "import sys, torch\nsys.path.insert(0, sys.argv[1])\nfrom tests.support import fp8_gemm_cases as cases\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", prelude + code, REPO], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def test_the_kernels_quantise_rows_as_fp8_py_does_on_the_gpu():
    """Bit for bit, NaN tiles included (their values NaN, as the GPU's cast makes them)."""
    assert "tiles " in _on_the_gpu(f"print('tiles', cases.quantisation_case(torch.device('cuda'), seed={_seed()}))")


def test_the_dispatched_fp8_rows_are_fp8_pys_and_dequantise_to_the_emulations_on_the_gpu():
    """Bit for bit, NaN tiles included (their values NaN, as the GPU's cast makes them)."""
    assert "tiles " in _on_the_gpu(f"print('tiles', cases.packed_rows_case(torch.device('cuda'), seed={_seed()}))")


def test_the_weights_are_quantised_as_fp8_py_does_on_the_gpu():
    """Bit for bit, both orientations, NaN blocks included."""
    assert "blocks" in _on_the_gpu("print(cases.weight_quantisation_case(torch.device('cuda')))")


def test_the_row_count_after_a_library_gemm2_is_what_the_combine_waits_for_on_the_gpu():
    assert "chunks " in _on_the_gpu("print('chunks', cases.row_count_case(torch.device('cuda')))")


def test_the_rowwise_weight_copies_are_fp8_pys_on_the_gpu():
    assert "scales " in _on_the_gpu("print('scales', cases.rowwise_weights_case(torch.device('cuda')))")


def test_the_weight_gradients_operands_are_fp8_pys_on_the_gpu():
    assert "scales " in _on_the_gpu(f"print('scales', cases.expert_columns_case(torch.device('cuda'), seed={_seed()}))")


def test_the_rowwise_quantisation_kernel_is_fp8_pys_on_the_gpu():
    assert "rows " in _on_the_gpu(
        f"print('rows', cases.rowwise_quantisation_case(torch.device('cuda'), seed={_seed()}))"
    )


@pytest.mark.parametrize(
    "gated, gradient_format, tiles",
    [(True, "e4m3", (128, 64, 256, 64)), (False, "e5m2", (128, 128, 256, 64)), (True, "e5m2", (64, 64, 128, 64))],
    ids=["swiglu-e4m3", "gelu-bias-e5m2", "swiglu-tile64-e5m2"],
)
def test_each_fp8_gemm_gives_the_emulations_numbers_on_the_gpu(gated, gradient_format, tiles):
    """The production tiles (GEMM1 64 columns gated forward, 128 otherwise; GEMM2 256 in two row parts);
    the forward GEMM1 on packed FP8 rows equal to it on the bf16 rows, bit for bit."""
    code = (
        f"print(cases.GemmCase(torch.device('cuda'), {gated}, {gradient_format!r}, seed={_seed()}, tiles={tiles}, "
        f"mma_error={MMA_ERROR}, sizes=(512, 384), counts=(300, 0, 1, 517, 128)).run())"
    )
    assert "ok gated=" in _on_the_gpu(code)


# The layers' shapes and routings, each run with several recipes below.
SKEWED_DROPS = dict(hidden=256, ffn=384, experts_per_rank=4, k=2, tokens_per_rank=(333, 190), skew=4.0)
GELU_BIAS = dict(hidden=512, ffn=256, experts_per_rank=4, k=2, tokens_per_rank=(257, 300), expert_kind="gelu")
# k = 1 under heavy skew, no dropping: some experts get no row.
EMPTY_EXPERTS = dict(
    hidden=256, ffn=512, experts_per_rank=4, k=1, tokens_per_rank=(301, 301), drop_tokens=False, skew=50.0
)
K8_ODD_ROWS = dict(hidden=384, ffn=256, experts_per_rank=8, k=8, tokens_per_rank=(129, 77), drop_tokens=False)
SMALL = dict(hidden=256, ffn=384, experts_per_rank=4, k=2, tokens_per_rank=(200, 150))
LAYER_CASES = [
    SKEWED_DROPS,
    GELU_BIAS,
    EMPTY_EXPERTS,
    K8_ODD_ROWS,
    {**SMALL, "recipe": {"gradient_format": "e5m2"}},
    {**SMALL, "recipe": {"input_gradients": False}},
    # "dispatch": "fp8": the rows cross packed in FP8, GEMM1 takes them so, W1's gradient their dequantised values.
    {**SKEWED_DROPS, "recipe": FP8_ROWS},
    {**GELU_BIAS, "recipe": FP8_ROWS},
    {**EMPTY_EXPERTS, "recipe": FP8_ROWS},
    {**K8_ODD_ROWS, "recipe": FP8_ROWS},
    {**SMALL, "recipe": {**FP8_ROWS, "input_gradients": False}},
    # "gradient_dispatch": "fp8": the output gradients cross packed, the backward's GEMM1 takes them so,
    # W2's gradient their dequantised values, each gate's gradient their dot product with its output.
    {**SKEWED_DROPS, "recipe": FP8_GRADIENTS},
    {**GELU_BIAS, "recipe": {**FP8_GRADIENTS, "gradient_format": "e5m2"}},
    {**EMPTY_EXPERTS, "recipe": FP8_GRADIENTS},
    {**K8_ODD_ROWS, "recipe": {**FP8_ROWS, **FP8_GRADIENTS, "gradient_format": "e5m2"}},
    # "weight_gradients" alone (rowwise): the other GEMMs in bf16, on any EP size; biases, skewed routing,
    # empty experts.
    {**GELU_BIAS, "skew": 4.0, "recipe": WEIGHT_GRADIENTS_ONLY},
    {**EMPTY_EXPERTS, "recipe": WEIGHT_GRADIENTS_ONLY},
]
LAYER_IDS = [
    "swiglu-skewed-drops",
    "gelu-bias",
    "swiglu-empty-experts",
    "k8-odd-rows",
    "e5m2",
    "forward-only",
    "fp8-rows-skewed-drops",
    "fp8-rows-gelu-bias",
    "fp8-rows-empty-experts",
    "fp8-rows-k8-odd-rows",
    "fp8-rows-forward-only",
    "fp8-gradients-skewed-drops",
    "fp8-gradients-e5m2-gelu-bias",
    "fp8-gradients-empty-experts",
    "fp8-rows-and-e5m2-gradients-k8-odd-rows",
    "weight-gradients-only-gelu-bias-skewed",
    "weight-gradients-only-empty-experts",
]


def fp8_layer_case(
    seed,
    hidden,
    ffn,
    experts_per_rank,
    k,
    tokens_per_rank,
    expert_kind="swiglu",
    drop_tokens=True,
    skew=0.0,
    recipe=None,
    micro_batches=2,
):
    """The comet MoE layer (stock's gate and experts) under the recipe on the fused pipeline, on the
    emulating reference pipeline, without the recipe on the fused pipeline, and in float64 without
    it, same weights, tokens and routes, over ``micro_batches`` training micro-batches (gradients
    accumulated): each tensor's relative differences (``rel``) of the fused FP8 run from the others
    (the outputs, the input gradients, the experts' and, where the output gradients cross in FP8, the
    gate's parameter gradients), and how often its layer quantised its weights."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    moe_kwargs = dict(num_experts=experts_per_rank * ep_size, ep_size=ep_size, k=k, drop_tokens=drop_tokens)
    moe_kwargs.update(capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0 if skew else 4)
    full_recipe = {**RECIPE, **(recipe or {})}
    sections = {
        "fused": {"overlap": "fused", "fp8": full_recipe},
        "emulated": {"overlap": "none", "fp8": full_recipe},
        "plain": {"overlap": "fused"},
        "exact": {"overlap": "none"},
    }
    torch.manual_seed(seed)
    template = make_expert(expert_kind, hidden, ffn)
    layers = {}
    for name, section in sections.items():
        layer = ds_comet.MoE(hidden, template, config={"moe": {"backend": "comet", **section}}, **moe_kwargs)
        layer.set_deepspeed_parallelism()
        reset_experts_(layer, seed)
        if layers:
            layer.load_state_dict(layers["fused"].state_dict())
        layers[name] = layer.to(device=device, dtype=torch.float64 if name == "exact" else torch.bfloat16).train()
    outputs = {name: [] for name in layers}
    for step in range(micro_batches):
        generator = torch.Generator(device=device).manual_seed(seed * 100 + step * 10 + rank)
        tokens = torch.randn(tokens_per_rank[rank % len(tokens_per_rank)], hidden, generator=generator, device=device)
        tokens = (tokens + skew * layers["fused"].deepspeed_moe.gate.wg.weight[0].detach().float()).bfloat16()
        grad_out = torch.randn(1, *tokens.shape, generator=generator, device=device).bfloat16()
        for name, layer in layers.items():
            dtype = torch.float64 if name == "exact" else torch.bfloat16
            inputs = tokens.to(dtype).unsqueeze(0).requires_grad_()
            torch.manual_seed(seed * 7 + step)  # the gate's top-2 sampling
            out, l_aux, _ = layer(inputs)
            torch.autograd.backward([out, l_aux], [grad_out.to(dtype), torch.tensor(0.01, device=device)])
            outputs[name] += [out.detach()[0], inputs.grad[0]]
    pipelines = layers["fused"].deepspeed_moe.pipelines
    assert pipelines.reason is None and pipelines.fused.fp8 is not None, f"no fused FP8 GEMMs: {pipelines.reason}"
    assert pipelines.fused.rows_in_fp8 == (full_recipe["dispatch"] == "fp8")
    gradients_in_fp8 = full_recipe.get("gradient_dispatch") == "fp8"
    assert (pipelines.fused.gradient_format is not None) == gradients_in_fp8
    tensors = {f"output/input gradient {i}": {n: outputs[n][i] for n in layers} for i in range(2 * micro_batches)}
    params = {name: dict(layer.named_parameters()) for name, layer in layers.items()}
    for pname in params["fused"]:
        # The gate's weight takes its gradient from the routes' gate gradients, which the backward's
        # dispatch takes from the packed rows under "gradient_dispatch": "fp8".
        if ".experts." in pname or (gradients_in_fp8 and ".gate." in pname):
            tensors[pname] = {name: params[name][pname].grad for name in layers}
    differences = {
        what: {other: rel(by["fused"], by[other]) for other in ("emulated", "plain", "exact")}
        for what, by in tensors.items()
    }
    return differences, pipelines.fused.fp8_weights.quantisations


@pytest.mark.parametrize("case", LAYER_CASES, ids=LAYER_IDS)
def test_the_fused_fp8_layer_gives_the_emulations_numbers(gpu_pool, case):
    if case["k"] > case["experts_per_rank"] * gpu_pool.world_size:
        pytest.skip(f"k = {case['k']} needs more experts than {gpu_pool.world_size} GPU(s) give this case")
    seed = _seed()
    for differences, quantisations in gpu_pool.run(fp8_layer_case, seed=seed, **case):
        assert quantisations == 1, f"seed {seed}: the weights were quantised {quantisations} times, not once"
        for what, d in differences.items():
            assert d["emulated"] <= EMULATION_BOUND, f"seed {seed}: {what}: {d}"
            assert d["exact"] <= LAYER_BOUND, f"seed {seed}: {what}: {d}"
            if what.startswith("output") and case.get("recipe") in (None, FP8_ROWS):
                assert d["plain"] >= LAYER_FLOOR, f"seed {seed}: {what}: the recipe did not run: {d}"


# Rowwise scaling on the library's grouped GEMMs (library_fp8), alone in the group: all four FP8 phases,
# and the first layer alone with GEMM2 kept in bf16 by the recipe.
ROWWISE_RECIPE = {"enabled": True, "scaling": "rowwise", "dispatch": "bf16"}
ROWWISE_FIRST_LAYER_RECIPE = {**ROWWISE_RECIPE, "gemm2": False}
AUTOEP_FP8_CASES = [(preset, None) for preset in FUSED_PRESETS] + [
    ("mixtral", ROWWISE_RECIPE),
    ("mixtral", ROWWISE_FIRST_LAYER_RECIPE),
    ("mixtral", {**ROWWISE_RECIPE, "weight_gradients": True}),
]
AUTOEP_FP8_IDS = [
    *FUSED_PRESETS,
    "mixtral-rowwise-library",
    "mixtral-rowwise-first-layer",
    "mixtral-rowwise-weight-gradients",
]


@pytest.mark.parametrize("preset, recipe", AUTOEP_FP8_CASES, ids=AUTOEP_FP8_IDS)
def test_autoep_layers_run_the_recipe_on_the_fused_fp8_gemms(gpu_pool, preset, recipe):
    pytest.importorskip("transformers")
    if recipe is not None and gpu_pool.world_size > 1:
        pytest.skip("library_fp8 serves a rank alone in its group (EP=1)")
    seed = _seed()
    for differences, ran in gpu_pool.run(fp8_fused_case, preset=preset, seed=seed, recipe=recipe):
        assert ran and all(reason is None and fp8_gemms for reason, fp8_gemms in ran), ran
        experts = {name: d for name, d in differences.items() if ".experts.w" in name}
        assert experts, sorted(differences)
        for name, d in experts.items():
            assert d["emulated"] <= EMULATION_BOUND, f"seed {seed}: {name}: {d}"
            assert d["plain"] >= LAYER_FLOOR, f"seed {seed}: {name}: the recipe did not run: {d}"
        for name, d in differences.items():
            assert d["exact"] <= LAYER_BOUND + d["plain_exact"], f"seed {seed}: {name}: {d}"


def test_fused_fp8_training_quantises_after_every_step_and_follows_the_emulation(gpu_pool):
    """DeepSpeed's ZeRO-2 writes the stepped weights through ``.data``: the layers must see every step."""
    pytest.importorskip("transformers")
    steps = 3
    for losses, emulated, counts in gpu_pool.run(fp8_training_case, preset="mixtral", seed=_seed(), steps=steps):
        assert counts and set(counts) == {steps}, counts
        assert losses == pytest.approx(emulated, rel=2e-2), (losses, emulated)
