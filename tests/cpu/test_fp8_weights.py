"""The FP8 GEMMs' quantised weights (``kernels/fp8_weights.py``): what they hold, when they are
quantised again, and how the fused pipeline hands them to its launches. On CPU tensors: the cache
quantises with torch, on whatever device the weights are."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_comet import fp8
from ds_comet.experts import GatedFeedForward, fused_expert
from ds_comet.kernels import fp8_weights
from ds_comet.kernels.fp8_weights import Fp8WeightCache, weights_changed
from ds_comet.kernels.gemm_phases import Fp8Facts, Phase
from ds_comet.pipelines.expert_weights import ModuleFusedExperts, StackedFusedExperts
from ds_comet.pipelines.fused import FusedPipeline

HIDDEN, FFN, NUM_LOCAL = 256, 128, 3
CPU = torch.device("cpu")
ALL = frozenset({Phase.FIRST_LAYER, Phase.GEMM2, Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD})


def module_experts(seed: int = 0) -> tuple[ModuleFusedExperts, list[GatedFeedForward]]:
    torch.manual_seed(seed)
    modules = [GatedFeedForward(HIDDEN, FFN).bfloat16() for _ in range(NUM_LOCAL)]
    return ModuleFusedExperts([fused_expert(module) for module in modules]), modules


class Stacked(nn.Module):
    """AutoEP's GroupedExperts as StackedFusedExperts reads it."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(NUM_LOCAL, FFN, HIDDEN, dtype=torch.bfloat16))
        self.w3 = nn.Parameter(torch.randn(NUM_LOCAL, FFN, HIDDEN, dtype=torch.bfloat16))
        self.w2 = nn.Parameter(torch.randn(NUM_LOCAL, HIDDEN, FFN, dtype=torch.bfloat16))


def expected(weight: torch.Tensor, transposed: bool) -> fp8.Quantised:
    quantised = fp8.quantise_blocks(weight.detach())
    if not transposed:
        return quantised
    return fp8.Quantised(quantised.values.t(), quantised.scales.t(), quantised.block)


@pytest.mark.parametrize("storage", ["modules", "stacked"])
def test_each_weight_in_each_orientation_is_fp8_pys_blocks_with_a_table_pointing_at_it(storage):
    """Bit for bit ``fp8.quantise_blocks`` of every expert's weight, transposed where the backward reads
    it; the tables hold each expert's address in the quantised values and scales."""
    experts = module_experts()[0] if storage == "modules" else StackedFusedExperts(Stacked(), "silu")
    cache = Fp8WeightCache(ALL)
    tables = cache.tables(experts, CPU)
    sources = {"w1": 0, "w3": 2, "w2": 4, "w2t": 4, "w1t": 0, "w3t": 2}
    assert set(tables) == set(sources) | {name + "_scales" for name in sources}
    for name, column in sources.items():
        quantised = cache.quantised(name)
        for e, tensors in enumerate(experts.expert_tensors()):
            want = expected(tensors[column], name.endswith("t"))
            assert torch.equal(quantised.values[e].view(torch.uint8), want.values.view(torch.uint8)), (name, e)
            assert torch.equal(quantised.scales[e], want.scales), (name, e)
            assert tables[name][e].item() == quantised.values[e].data_ptr()
            assert tables[name + "_scales"][e].item() == quantised.scales[e].data_ptr()
        assert quantised.values.is_contiguous() and quantised.scales.is_contiguous()
    # Two one-byte copies of every weight, the bf16 weights' size, and a 128x128th of it in fp32 scales.
    weight_bytes = sum(t.nbytes for row in experts.expert_tensors() for t in row if t is not None)
    assert cache.nbytes == weight_bytes + 2 * weight_bytes // 2 // (128 * 128) * 4


def test_only_the_weights_of_the_phases_in_fp8_are_kept_and_quantised_a_few_experts_at_a_time(monkeypatch):
    experts, _ = module_experts()
    forward = Fp8WeightCache(frozenset({Phase.FIRST_LAYER, Phase.GEMM2}))
    assert set(forward.tables(experts, CPU)) == {"w1", "w3", "w2", "w1_scales", "w3_scales", "w2_scales"}
    backward = Fp8WeightCache(frozenset({Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD}))
    assert set(backward.tables(experts, CPU)) == {"w2t", "w1t", "w3t", "w2t_scales", "w1t_scales", "w3t_scales"}
    # One expert a chunk gives the same copies as all at once.
    monkeypatch.setattr(fp8_weights, "CHUNK_ELEMENTS", 1)
    chunked = Fp8WeightCache(frozenset({Phase.FIRST_LAYER, Phase.GEMM2}))
    chunked.tables(experts, CPU)
    for name in ("w1", "w3", "w2"):
        assert torch.equal(
            chunked.quantised(name).values.view(torch.uint8), forward.quantised(name).values.view(torch.uint8)
        )
        assert torch.equal(chunked.quantised(name).scales, forward.quantised(name).scales)


def test_the_weights_are_quantised_once_per_version():
    """Calls between two weight versions share one quantisation; an in-place update that autograd sees,
    an optimizer step (DeepSpeed's write through ``.data``, which moves no version counter), a
    replaced parameter and ``weights_changed`` each make the next call quantise again."""
    experts, modules = module_experts()
    cache = Fp8WeightCache(ALL)
    tables = cache.tables(experts, CPU)
    assert cache.tables(experts, CPU) is tables and cache.quantisations == 1

    def w1_copy_is_current():
        return torch.equal(
            cache.quantised("w1").scales[0], fp8.quantise_blocks(modules[0].gate_proj.weight.detach()).scales
        )

    with torch.no_grad():
        modules[0].gate_proj.weight.mul_(4)  # version counter moves
    cache.tables(experts, CPU)
    assert cache.quantisations == 2 and w1_copy_is_current()

    modules[1].down_proj.weight.data.mul_(2)  # as DeepSpeed's optimizers write: no version moves...
    cache.tables(experts, CPU)
    assert cache.quantisations == 2
    other = nn.Parameter(torch.zeros(1))
    other.grad = torch.ones(1)
    torch.optim.SGD([other], lr=1.0).step()  # ...and any optimizer's step invalidates every cache
    cache.tables(experts, CPU)
    assert cache.quantisations == 3
    assert torch.equal(
        cache.quantised("w2").scales[1], fp8.quantise_blocks(modules[1].down_proj.weight.detach()).scales
    )

    modules[2].up_proj.weight = nn.Parameter(torch.randn(FFN, HIDDEN, dtype=torch.bfloat16))  # replaced
    cache.tables(experts, CPU)
    assert cache.quantisations == 4
    assert torch.equal(cache.quantised("w3").scales[2], fp8.quantise_blocks(modules[2].up_proj.weight.detach()).scales)

    weights_changed()
    cache.tables(experts, CPU)
    assert cache.quantisations == 5


def test_stacked_weights_are_quantised_once_per_version_of_the_stacked_tensors():
    """AutoEP's stacked weights are keyed on the stacked tensors (not a view per expert): an in-place
    update of one expert's slice, a replaced parameter and an optimizer step each quantise again."""
    grouped = Stacked()
    experts = StackedFusedExperts(grouped, "silu")
    cache = Fp8WeightCache(ALL)
    cache.tables(experts, CPU)
    cache.tables(experts, CPU)
    assert cache.quantisations == 1
    with torch.no_grad():
        grouped.w3[1].mul_(4)  # one expert's slice: the stacked tensor's version moves
    cache.tables(experts, CPU)
    assert cache.quantisations == 2
    assert torch.equal(cache.quantised("w3").scales[1], fp8.quantise_blocks(grouped.w3[1].detach()).scales)
    grouped.w2 = nn.Parameter(torch.randn(NUM_LOCAL, HIDDEN, FFN, dtype=torch.bfloat16))
    cache.tables(experts, CPU)
    assert cache.quantisations == 3
    assert torch.equal(cache.quantised("w2").scales[2], fp8.quantise_blocks(grouped.w2[2].detach()).scales)
    weights_changed()
    cache.tables(experts, CPU)
    assert cache.quantisations == 4


def test_weights_that_are_not_whole_blocks_are_refused():
    experts = ModuleFusedExperts([fused_expert(GatedFeedForward(200, 128).bfloat16())])
    with pytest.raises(ValueError, match=r"quantised in 128x128 blocks, got \[128, 200\]"):
        Fp8WeightCache(ALL).tables(experts, CPU)


def test_the_fused_pipeline_hands_its_fp8_gemms_the_recipe_and_the_quantised_weights():
    """A FusedPipeline built with the recipe's facts gives its launches (``FusedKernels``) the recipe
    and its cache's tables, so that the GEMM table gives the recipe's phases to triton_fp8; without
    them, neither."""
    experts, _ = module_experts()
    facts = Fp8Facts(frozenset({Phase.FIRST_LAYER, Phase.GEMM2}), "blockwise", "e4m3", HIDDEN, FFN)
    workspace = SimpleNamespace(shape=SimpleNamespace(dtype=torch.bfloat16, ep_size=1), capability=(9, 0))
    tokens = torch.empty(4, HIDDEN, dtype=torch.bfloat16)
    pipeline = FusedPipeline(workspace, experts, None, NUM_LOCAL, {True: 8, False: 8}, fp8=facts)
    kernels = pipeline.kernels(tokens)
    assert kernels.fp8 is facts and kernels.fp8_tables is pipeline.fp8_weights.tables(experts, CPU)
    chosen = [kernels.implementation(phase).name for phase in Phase]
    assert chosen[:4] == ["triton_fp8", "triton_fp8", "triton", "triton"]  # one module per expert: no library GEMM1
    pipeline.kernels(tokens)
    assert pipeline.fp8_weights.quantisations == 1
    plain = FusedPipeline(workspace, experts, None, NUM_LOCAL, {True: 8, False: 8})
    assert plain.fp8_weights is None and plain.kernels(tokens).fp8_tables == {}


def test_the_triton_quantisation_of_the_weights_is_fp8_pys_bit_for_bit():
    """``quantised_by_triton`` (the fused FP8 path's, in Triton's interpreter) against ``fp8.py``'s,
    ``tests/support/fp8_gemm_cases.weight_quantisation_case`` (tests/gpu/test_fp8.py runs it on the GPU)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import sys, torch\nsys.path.insert(0, sys.argv[1])\nfrom tests.support import fp8_gemm_cases as cases\n"
        "print(cases.weight_quantisation_case(torch.device('cpu')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, repo],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and "blocks" in result.stdout, result.stdout[-3000:] + result.stderr[-6000:]
