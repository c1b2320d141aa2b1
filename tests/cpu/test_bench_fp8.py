"""The benchmarks' FP8 additions that run without a GPU: the library's rowwise operands
(``bench.gemm.rowwise_operands``), the FP8 layer's refusal of a shape it cannot scale, and the
FP8 table's ratios and lines."""

import torch

from ds_comet import fp8
from ds_comet.bench.common import comet_layer, expert_template, moe_kwargs
from ds_comet.bench.gemm import rowwise_operands
from ds_comet.bench.layer import FP8_RECIPE, add_fp8_ratios, print_fp8_table


def test_the_librarys_operands_are_fp8_pys_rowwise_quantisation_in_its_layouts():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(37, 256, generator=generator).bfloat16()
    weight = torch.randn(3, 384, 256, generator=generator).bfloat16()
    values, weights, scales, weight_scales = rowwise_operands(a, weight)
    assert values.dtype == weights.dtype == torch.float8_e4m3fn and values.is_contiguous()
    assert weights.shape == (3, 256, 384) and weights.transpose(-2, -1).is_contiguous()  # column-major
    assert scales.shape == (37,) and weight_scales.shape == (3, 384)
    assert torch.equal(values.float() * scales[:, None], fp8.quantise_rows(a).dequantise())
    for g in range(3):
        dequantised = weights[g].float() * weight_scales[g][None, :]
        assert torch.equal(dequantised.t(), fp8.quantise_rows(weight[g]).dequantise())


def test_a_shape_the_recipe_cannot_scale_is_refused_by_name():
    """gpt-oss's H2880 in small: the FP8 layer's constructor raises the recipe's reason, which the layer
    bench prints in place of the shape's FP8 rows."""
    stock = torch.nn.Module()
    section = {"backend": "comet", "overlap": "fused", "fp8": FP8_RECIPE}
    try:
        comet_layer(96, expert_template(96, 96, True), moe_kwargs(4, 1, 2, 1.0), section, stock)
    except ValueError as refusal:
        assert "needs hidden (96) and FFN (96) sizes that are multiples of 128" in str(refusal), str(refusal)
    else:
        raise AssertionError("the recipe ran a hidden size of 96")


def test_the_fp8_table_gives_each_layers_time_over_the_fp8_layers(capsys):
    results = dict(fused=2.0, fused_fp8=1.0, fused_fwd_bwd=6.0, fused_fp8_fwd_bwd=4.0)
    results.update(autoep=3.0, autoep_comet=2.5, autoep_comet_fp8=1.5, autoep_fwd_bwd=9.0)
    results.update(autoep_comet_fwd_bwd=7.0, autoep_comet_fp8_fwd_bwd=5.0)
    add_fp8_ratios(results, backward=True)
    assert results["fused_over_fused_fp8"] == 2.0 and results["fused_over_fused_fp8_fwd_bwd"] == 1.5
    assert results["autoep_over_comet_fp8"] == 2.0 and results["autoep_over_fused_fp8_fwd_bwd"] == 2.25
    assert results["autoep_comet_over_comet_fp8_fwd_bwd"] == 1.4
    print_fp8_table({"mixtral-like": results, "gpt-oss-like": {"fused": 1.0}})
    out = capsys.readouterr().out
    assert "mixtral-like" in out and "gpt-oss-like" not in out and "2.250" in out, out
