"""The "library_fp8" GEMM implementation without a GPU: where the GEMM table gives it the rowwise
recipe's phases and why it refuses the others, its weights and operands against ``fp8.py`` and the
emulation (``torch._scaled_grouped_mm`` emulated on the CPU after its own shape checks on the meta
device), and the selection of the fused pipeline for a rowwise recipe at EP=1."""

from types import SimpleNamespace

import pytest
import torch

from ds_comet import fp8
from ds_comet.config import Fp8Recipe
from ds_comet.kernels import gemm_table
from ds_comet.kernels.fp8_weights import Fp8WeightCache
from ds_comet.kernels.gemm_phases import Fp8Facts, GemmFacts, Phase
from ds_comet.kernels.library_fp8_phases import (
    EXPERT_COLUMNS_RUN,
    LibraryFp8Gemm,
    expert_column_parts,
    rowwise_grouped_mm,
    rowwise_operands,
)
from ds_comet.pipelines.expert_weights import StackedFusedExperts
from ds_comet.pipelines.fp8_emulation import RecipeOperands
from ds_comet.pipelines.policy import fp8_facts
from tests.cpu.test_fp8_weights import Stacked

BF16 = torch.bfloat16
FIRST_LAYERS = frozenset({Phase.FIRST_LAYER, Phase.FIRST_LAYER_BACKWARD})
ALL = FIRST_LAYERS | {Phase.GEMM2, Phase.GEMM2_BACKWARD}
SCALED_GROUPED_MM = torch._scaled_grouped_mm  # torch's, whose meta kernel checks the operands


def rowwise(phases=FIRST_LAYERS, hidden=256, ffn=384, **more) -> Fp8Facts:
    return Fp8Facts(phases, "rowwise", more.pop("gradient_format", "e4m3"), hidden, ffn, **more)


def facts(fp8_facts=None, capability=(9, 0), alone=True, gated=True, stacked=True) -> GemmFacts:
    return GemmFacts(BF16, BF16, capability, alone, gated, stacked, rowwise() if fp8_facts is None else fp8_facts)


def chosen(call_facts: GemmFacts) -> list[str]:
    return [gemm_table.choose(phase, call_facts).name for phase in Phase]


def test_the_rowwise_recipes_gemms_run_on_library_fp8_alone_with_stacked_gated_experts():
    assert chosen(facts(rowwise(ALL))) == ["library_fp8"] * 4 + ["library"]
    with_weight_gradients = ALL | {Phase.WEIGHT_GRADIENTS}
    assert chosen(facts(rowwise(with_weight_gradients))) == ["library_fp8"] * 5
    # The weight gradients wait for nothing: at EP > 1 and for experts as modules too.
    weight_gradients_only = rowwise(frozenset({Phase.WEIGHT_GRADIENTS}))
    for call_facts in (facts(weight_gradients_only, alone=False), facts(weight_gradients_only, stacked=False)):
        assert chosen(call_facts) == ["triton"] * 4 + ["library_fp8"]
        assert gemm_table.fp8_refusal(call_facts) is None
    assert gemm_table.fp8_refusal(facts(rowwise(ALL))) is None
    assert chosen(facts()) == ["library_fp8", "triton", "library_fp8", "triton", "library"]
    assert gemm_table.fp8_refusal(facts()) is None
    forward_only = facts(rowwise(frozenset({Phase.FIRST_LAYER})))
    assert chosen(forward_only) == ["library_fp8", "triton", "library", "triton", "library"]


def test_the_recipe_puts_gemm2_in_fp8_only_with_its_gemm2_key():
    assert fp8_facts(Fp8Recipe(enabled=True, scaling="rowwise", gemm2=False), 256, 384).phases == FIRST_LAYERS
    assert fp8_facts(Fp8Recipe(enabled=True, scaling="rowwise"), 256, 384).phases == ALL
    recipe = Fp8Recipe(enabled=True, scaling="rowwise", weight_gradients=True)
    assert fp8_facts(recipe, 256, 384).phases == ALL | {Phase.WEIGHT_GRADIENTS}
    assert fp8_facts(Fp8Recipe(enabled=True, forward=False, dispatch="bf16", gemm2=False), 256, 384).phases == {
        Phase.FIRST_LAYER_BACKWARD
    }


@pytest.mark.parametrize(
    "call_facts, phase, why",
    [
        (facts(rowwise(frozenset({Phase.GEMM2})), alone=False), Phase.GEMM2, "forward GEMM2 here (triton_fp8 runs "
                                                                           "blockwise FP8 scaling, not rowwise"),
        (facts(alone=False), Phase.FIRST_LAYER, "library_fp8 needs a rank alone in its group"),
        (facts(stacked=False), Phase.FIRST_LAYER, "library_fp8 needs stacked expert weights"),
        (facts(gated=False), Phase.FIRST_LAYER, "library_fp8 needs gated experts"),
        (facts(capability=(8, 9)), Phase.FIRST_LAYER, "library_fp8 runs on sm_90, not sm_89"),
        (facts(rowwise(hidden=200)), Phase.FIRST_LAYER, "library_fp8 needs hidden and FFN sizes that are multiples "
                                                        "of 16 (torch._scaled_grouped_mm's), not 200 and 384"),
        (facts(rowwise(rows_in_fp8=True)), Phase.FIRST_LAYER, 'library_fp8 takes the rows in bf16, not packed in '
                                                              'FP8 (set "dispatch": "bf16")'),
        (facts(rowwise(gradients_in_fp8=True)), Phase.FIRST_LAYER_BACKWARD, 'library_fp8 takes the output '
                                                                            'gradients in bf16'),
        (facts(rowwise(gradient_format="e5m2")), Phase.FIRST_LAYER_BACKWARD, "library_fp8 takes e4m3 gradients "
                                                                             "(torch._scaled_grouped_mm), not e5m2"),
        (facts(rowwise(frozenset({Phase.GEMM2_BACKWARD}), gradient_format="e5m2")), Phase.GEMM2_BACKWARD,
         "library_fp8 takes e4m3 gradients (torch._scaled_grouped_mm), not e5m2"),
        (facts(rowwise(frozenset({Phase.WEIGHT_GRADIENTS}), gradient_format="e5m2")), Phase.WEIGHT_GRADIENTS,
         "library_fp8 takes e4m3 gradients (torch._scaled_grouped_mm), not e5m2"),
        (facts(rowwise(frozenset({Phase.WEIGHT_GRADIENTS})), capability=(8, 9)), Phase.WEIGHT_GRADIENTS,
         "library_fp8 runs on sm_90, not sm_89"),
    ],
    ids=["gemm2", "ep2", "modules", "ungated", "sm89", "hidden", "fp8-dispatch", "fp8-gradient-dispatch", "e5m2",
         "e5m2-gemm2", "e5m2-weight-gradients", "sm89-weight-gradients"],
)  # fmt: skip
def test_a_rowwise_phase_library_fp8_cannot_run_is_refused_by_name(call_facts, phase, why):
    """Never in bf16 instead: the recipe is refused, naming the phase and library_fp8's reason."""
    refusal = gemm_table.fp8_refusal(call_facts)
    assert refusal.startswith(f"the fused pipeline has no FP8 GEMM for its {phase.value} here"), refusal
    assert why in refusal, refusal


def test_without_a_rowwise_recipe_library_fp8_runs_nothing():
    blockwise = Fp8Facts(ALL, "blockwise", "e4m3", 256, 384)
    implementation = LibraryFp8Gemm()
    for phase in FIRST_LAYERS:
        assert implementation.refusal(phase, facts(blockwise)) == "runs rowwise FP8 scaling, not blockwise"
        plain = GemmFacts(BF16, BF16, (9, 0), True, True, True)
        assert implementation.refusal(phase, plain) == "runs only phases an FP8 recipe puts in FP8"


def test_the_rowwise_weights_are_fp8_pys_rows_of_each_orientation():
    """W1, W3 and W2 per output channel (``quantise_rows``); W2^T's rows per input channel of W2
    (``quantise_columns`` of W2, transposed) and [W1; W3]^T's per input channel of W1 and W3 together,
    as the emulation's one backward GEMM2 takes them; bit for bit, a few experts at a time."""
    experts = StackedFusedExperts(Stacked(), "silu")
    cache = Fp8WeightCache(ALL, "rowwise")
    cache.tables(experts, torch.device("cpu"))
    assert sorted(cache._weights) == ["w1", "w13t", "w2", "w2t", "w3"]
    for e, (w1, _, w3, _, w2, _) in enumerate(experts.expert_tensors()):
        for name, want, transposed in (
            ("w1", fp8.quantise_rows(w1), False),
            ("w3", fp8.quantise_rows(w3), False),
            ("w2", fp8.quantise_rows(w2), False),
            ("w2t", fp8.quantise_columns(w2), True),
            ("w13t", fp8.quantise_columns(torch.cat([w1, w3])), True),
        ):
            got = cache.quantised(name)
            values = want.values.t() if transposed else want.values
            scales = want.scales.t() if transposed else want.scales
            assert torch.equal(got.values[e].view(torch.uint8), values.contiguous().view(torch.uint8)), (name, e)
            assert torch.equal(got.scales[e], scales), (name, e)


def scaled_grouped_mm_on_cpu(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """``torch._scaled_grouped_mm`` emulated: its checks on the meta device, then per group the
    dequantised operands' fp32 product, rounded to bf16: a 2-D by 3-D product over groups of rows
    (rows past the last end stay zero), or a 2-D by 2-D one over groups of K ([G, M, N]; a group
    with no K is left unwritten, as the library on the GPU may leave it: NaN here)."""
    meta = [t if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in (a, b, scale_a, scale_b, offs)]  # fmt: skip
    SCALED_GROUPED_MM(*meta[:4], offs=meta[4], out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    if b.dim() == 2:
        m, n = a.shape[0], b.shape[1]
        out, start = torch.empty(len(offs), m, n, dtype=out_dtype), 0
        for group, end in enumerate(offs.tolist()):
            a_g = a[:, start:end].float() * scale_a[group * m : (group + 1) * m, None]
            b_g = b[start:end].float() * scale_b[group * n : (group + 1) * n][None, :]
            out[group], start = (a_g @ b_g).to(out_dtype) if end > start else float("nan"), end
        return out
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype)
    start = 0
    for group, end in enumerate(offs.tolist()):
        rows = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = (rows @ (b[group].float() * scale_b[group][None, :])).to(out_dtype)
        start = end
    return out


@pytest.mark.parametrize("counts", [[5, 0, 17], [0, 0, 9], [16, 32, 0]], ids=["odd", "empty", "whole"])
def test_the_products_are_the_emulations_on_the_librarys_operands(monkeypatch, counts):
    """Per expert the library's product of the operands as laid out for it (rows row-major with one
    scale each, each weight column-major with one per output channel) is the emulation's product,
    to a bf16 step (the two sum the same exact products in fp32 in other orders); empty experts,
    odd row counts and rows past the last expert's end included."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_on_cpu)
    experts = StackedFusedExperts(Stacked(), "silu")
    cache = Fp8WeightCache(FIRST_LAYERS, "rowwise")
    cache.tables(experts, torch.device("cpu"))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = torch.randn(int(ends[-1]) + 3, 256).to(BF16)  # three rows past the last end
    call = SimpleNamespace(fp8_weights=cache, expert_ends=ends)
    first, up, grad = LibraryFp8Gemm().products(call, rows, "w1", "w3", "w2")
    operands = RecipeOperands(Fp8Recipe(enabled=True, scaling="rowwise", gemm2=False))
    start = 0
    for (w1, _, w3, _, w2, _), end in zip(experts.expert_tensors(), ends.tolist()):
        part = rows[start:end]
        for got, want in (
            (first, operands.forward_product(part, w1, None)),
            (up, operands.forward_product(part, w3, None)),
            (grad, operands.gradient_product(part, w2)),
        ):
            torch.testing.assert_close(got[start:end].float(), want.to(BF16).float(), rtol=2**-7, atol=1e-6)
        start = end
    assert not first[start:].any()


@pytest.mark.parametrize("counts", [[5, 0, 17], [0, 0, 9]], ids=["odd", "empty"])
def test_both_gemm2s_are_the_emulations_on_the_librarys_operands_and_count_every_row(monkeypatch, counts):
    """GEMM2 forward (``h @ W2^T``) and backward (``[dA, dA_up] @ [W1; W3]``, one GEMM over 2F) write
    the emulation's products into the combine's rows, to a bf16 step, and then count the rows once
    for the combine."""
    import ds_comet.kernels.library_fp8_phases as library_fp8

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_on_cpu)
    counted = []
    monkeypatch.setattr(library_fp8, "count_received_rows", counted.append)
    experts = StackedFusedExperts(Stacked(), "silu")
    cache = Fp8WeightCache(ALL, "rowwise")
    cache.tables(experts, torch.device("cpu"))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(ends[-1]) + 3  # three rows past the last end
    ffn = experts.expert_tensors()[0][0].shape[0]
    h, grad_pre = torch.randn(rows, ffn).to(BF16), (torch.randn(rows, 2 * ffn) * 1e-3).to(BF16)
    call = SimpleNamespace(fp8_weights=cache, expert_ends=ends)
    forward, backward = torch.full((rows, 256), 7.0, dtype=BF16), torch.full((rows, 256), 7.0, dtype=BF16)
    LibraryFp8Gemm().gemm2(call, h, forward)
    LibraryFp8Gemm().gemm2_backward(call, grad_pre, backward)
    assert counted == [call, call]
    operands = RecipeOperands(Fp8Recipe(enabled=True, scaling="rowwise"))
    start = 0
    for (w1, _, w3, _, w2, _), end in zip(experts.expert_tensors(), ends.tolist()):
        for got, want in (
            (forward, operands.forward_product(h[start:end], w2, None, gemm2=True)),
            (backward, operands.gradient_product(grad_pre[start:end], torch.cat([w1, w3]), gemm2=True)),
        ):
            torch.testing.assert_close(got[start:end].float(), want.to(BF16).float(), rtol=2**-7, atol=1e-9)
        start = end


@pytest.mark.parametrize("counts", [[5, 0, 17], [0, 0, 9], [16, 1, 40]], ids=["odd", "empty", "whole"])
def test_the_weight_gradients_are_the_emulations_on_the_librarys_operands(monkeypatch, counts):
    """With ``"weight_gradients"``, per expert the library's 2-D by 2-D product of the operands as
    laid out for it (each quantised per column over the expert's rows, transposed, padded to whole
    16s of rows, and to at least 16: nothing zeroes a group with no K on CUDA) is the emulation's
    ``weight_gradient_product``, to a bf16 step; an expert with no rows gets zeros; rows past the last
    expert's end are not read."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_on_cpu)
    start_word = 2
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    layout = torch.zeros(start_word + len(starts) + 1, dtype=torch.int32)
    layout[start_word : start_word + len(starts)] = torch.tensor(starts, dtype=torch.int32)
    buffer = SimpleNamespace(layout=layout, layout_offsets=SimpleNamespace(expert_start=start_word))
    call = SimpleNamespace(buffer=buffer, num_local=len(counts))
    rows = starts[-1] + 3
    grads, x = (torch.randn(rows, 96) * 1e-3).to(BF16), torch.randn(rows, 64).to(BF16)
    grads[starts[-1] :], x[starts[-1] :] = float("nan"), float("nan")  # past the last end: never read
    got = LibraryFp8Gemm().weight_gradients(call, grads, x)
    assert got.shape == (len(counts), 96, 64) and got.dtype == BF16
    operands = RecipeOperands(Fp8Recipe(enabled=True, scaling="rowwise", weight_gradients=True))
    for expert, (first, end) in enumerate(zip(starts, starts[1:])):
        want = operands.weight_gradient_product(grads[first:end], x[first:end]).to(BF16)
        torch.testing.assert_close(got[expert].float(), want.float(), rtol=2**-7, atol=1e-9)
        assert end > first or not got[expert].any()
    unquantised = RecipeOperands(Fp8Recipe(enabled=True, scaling="rowwise"))
    first, end = starts[-2], starts[-1]  # the product must differ from high precision's: FP8 ran
    assert not torch.equal(got[-1], unquantised.weight_gradient_product(grads[first:end], x[first:end]).to(BF16))


def test_the_operands_dequantise_to_the_emulations_bit_for_bit():
    rows = fp8.quantise_rows(torch.randn(7, 64).to(BF16))
    weight = torch.randn(2, 48, 64).to(BF16)
    weights = fp8.Quantised(
        fp8.quantise_rows(weight.reshape(96, 64)).values.view(2, 48, 64),
        fp8.quantise_rows(weight.reshape(96, 64)).scales.view(2, 48, 1),
        (1, 64),
    )
    values, b, scales, b_scales = rowwise_operands(rows, weights)
    assert b.shape == (2, 64, 48) and b.stride() == (48 * 64, 1, 64)  # column-major [G, K, N]
    assert torch.equal(values.float() * scales[:, None], rows.dequantise())
    for g in range(2):
        assert torch.equal((b[g].float() * b_scales[g][None, :]).t(), fp8.quantise_rows(weight[g]).dequantise())
    assert callable(rowwise_grouped_mm)


@pytest.mark.parametrize(
    "recipe, outcome",
    [
        ({"gemm2": False}, FIRST_LAYERS),
        ({"gemm2": False, "input_gradients": False}, frozenset({Phase.FIRST_LAYER})),
        ({}, ALL),
        ({"gemm2": False, "dispatch": "fp8"}, "library_fp8 takes the rows in bf16, not packed in FP8"),
    ],
    ids=["first-layers", "forward", "all", "fp8-dispatch"],
)
def test_a_rowwise_recipe_at_ep1_on_sm90_with_stacked_experts_selects_the_fused_pipeline(monkeypatch, recipe, outcome):
    """Rowwise scaling runs on the fused pipeline (library_fp8's GEMMs, GEMM2 with ``"gemm2"``); with
    rows crossing in FP8 the emulation keeps it, the reason naming the phase."""
    import ds_comet.pipelines.selection as selection
    from ds_comet.experts import GatedFeedForward
    from tests.cpu.test_fp8 import _layer

    monkeypatch.setattr(selection, "fp8_reason", lambda *args: None)  # a GPU that can run FP8 GEMMs
    monkeypatch.setattr(selection, "device_capability", lambda device: (9, 0))
    section = {"enabled": True, "scaling": "rowwise", "dispatch": "bf16", **recipe}
    moe = _layer(256, GatedFeedForward(256, 128), section, overlap="auto")
    fused = StackedFusedExperts(Stacked(), "silu")  # AutoEP's stacked experts, bf16
    answer = moe.pipelines._fp8_fused(fused, torch.randn(8, 256, dtype=BF16))
    if isinstance(outcome, frozenset):
        assert answer is fused and moe.pipelines._fp8_facts.phases == outcome
        assert moe.pipelines._fp8_facts.scaling == "rowwise"
    else:
        assert moe.pipelines._fp8_facts is None
        assert answer.startswith('the "fp8" recipe is enabled, and ') and outcome in answer, answer
        if "gemm2" in recipe:  # "gemm2": false would not help: the fix is not offered
            assert '"gemm2": false' not in answer, answer


@pytest.mark.parametrize(
    "rows, num_local, parts",
    [(16384, 8, 8), (65536, 128, 2), (10, 4, 1), (0, 4, 1), (2 * EXPERT_COLUMNS_RUN + 1, 1, 3)],
)
def test_the_column_quantisation_splits_an_average_experts_rows_into_runs_of_about_256(rows, num_local, parts):
    """At least one run an expert; a run about ``EXPERT_COLUMNS_RUN`` rows of an average expert, so that the
    Mixtral-like 2,048 rows an expert take 8 programs a column block, not one."""
    assert expert_column_parts(rows, num_local) == parts
