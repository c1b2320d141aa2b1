"""The benchmarks' FP8 additions that run without a GPU (the library's rowwise operands are
tests/cpu/test_library_fp8.py's): the FP8 layer's refusal of a shape it cannot scale, the
FP8 table's ratios and lines, and the bytes the forward's dispatch sends in FP8."""

import torch

from ds_comet.bench.common import comet_layer, expert_template, moe_kwargs
from ds_comet.bench.layer import FP8_RECIPES, add_fp8_ratios, print_fp8_table, print_sent_table
from ds_comet.config import Fp8Recipe
from ds_comet.kernels.fp8_rows import packed_row_bytes


def test_a_shape_the_recipe_cannot_scale_is_refused_by_name():
    """gpt-oss's H2880 in small: the FP8 layer's constructor raises the recipe's reason, which the layer
    bench prints in place of the shape's FP8 rows."""
    stock = torch.nn.Module()
    section = {"backend": "comet", "overlap": "fused", "fp8": FP8_RECIPES["fused_fp8"]}
    try:
        comet_layer(96, expert_template(96, 96, True), moe_kwargs(4, 1, 2, 1.0), section, stock)
    except ValueError as refusal:
        assert "needs hidden (96) and FFN (96) sizes that are multiples of 128" in str(refusal), str(refusal)
    else:
        raise AssertionError("the recipe ran a hidden size of 96")


def test_the_layer_bench_times_the_default_recipe_and_bf16_dispatch():
    """The "fused_fp8" layer runs the recipe as a user gets it (rows crossing as packed FP8 rows), and
    "fused_fp8_bf16_dispatch" the same GEMMs with the rows crossing in bf16."""
    assert Fp8Recipe(**FP8_RECIPES["fused_fp8"]).dispatch == "fp8"
    assert Fp8Recipe(**FP8_RECIPES["fused_fp8_bf16_dispatch"]).dispatch == "bf16"
    assert Fp8Recipe(**FP8_RECIPES["fused_fp8"]).gradient_dispatch == Fp8Recipe().gradient_dispatch


def test_the_fp8_table_gives_each_layers_time_over_the_fp8_layers(capsys):
    results = dict(fused=2.0, fused_fp8=1.0, fused_fwd_bwd=6.0, fused_fp8_fwd_bwd=4.0)
    results.update(fused_fp8_bf16_dispatch=1.25, fused_fp8_bf16_dispatch_fwd_bwd=5.0)
    results.update(autoep=3.0, autoep_comet=2.5, autoep_comet_fp8=1.5, autoep_fwd_bwd=9.0)
    results.update(autoep_comet_fwd_bwd=7.0, autoep_comet_fp8_fwd_bwd=5.0)
    add_fp8_ratios(results, backward=True)
    assert results["fused_over_fused_fp8"] == 2.0 and results["fused_over_fused_fp8_fwd_bwd"] == 1.5
    assert results["fused_over_fused_fp8_bf16_dispatch"] == 1.6
    assert results["fused_over_fused_fp8_bf16_dispatch_fwd_bwd"] == 1.2
    assert results["autoep_over_comet_fp8"] == 2.0 and results["autoep_over_fused_fp8_fwd_bwd"] == 2.25
    assert results["autoep_over_fused_fp8_bf16_dispatch_fwd_bwd"] == 1.8
    assert results["autoep_comet_over_comet_fp8_fwd_bwd"] == 1.4
    # gpt-oss-like: blockwise refuses H2880, the rowwise library recipe runs it.
    rowwise = dict(fused=1.0, autoep=3.0, autoep_comet=2.0, autoep_comet_fp8_rowwise=1.6)
    rowwise.update(
        fused_fwd_bwd=3.0, autoep_fwd_bwd=8.0, autoep_comet_fwd_bwd=6.0, autoep_comet_fp8_rowwise_fwd_bwd=4.0
    )
    add_fp8_ratios(rowwise, backward=True)
    assert (
        rowwise["autoep_over_comet_fp8_rowwise_fwd_bwd"] == 2.0
        and rowwise["autoep_comet_over_comet_fp8_rowwise"] == 1.25
    )
    assert "fused_over_fused_fp8" not in rowwise
    rowwise.update(autoep_comet_fp8_rowwise_wgrad=1.0, autoep_comet_fp8_rowwise_wgrad_fwd_bwd=3.2)
    add_fp8_ratios(rowwise, backward=True)
    assert rowwise["autoep_over_comet_fp8_rowwise_wgrad_fwd_bwd"] == 2.5
    assert rowwise["autoep_comet_over_comet_fp8_rowwise_wgrad_fwd_bwd"] == 1.875
    print_fp8_table({"mixtral-like": results, "gpt-oss-like": rowwise, "qwen3-like": {"fused": 1.0}})
    out = capsys.readouterr().out
    assert "mixtral-like" in out and "qwen3-like" not in out and "2.250" in out and "1.800" in out, out
    gpt_oss = [line for line in out.splitlines() if line.startswith("gpt-oss-like")]
    assert len(gpt_oss) == 2 and "-" in gpt_oss[0].split() and "2.000" in gpt_oss[1], gpt_oss
    header = next(line for line in out.splitlines() if line.startswith("shape"))
    assert "comet FP8 bd" in header and "comet/FP8 bd fb" in header, header


def test_the_sent_table_shows_the_fp8_dispatchs_bytes_at_about_half_bf16s(capsys):
    """A packed FP8 row is H FP8 bytes and H / 32 bytes of scales (padded to 16): 0.516 of a bf16 row at
    H = 7168; a training step with both dispatches in FP8 (forward rows, backward output gradients) and
    both combines in bf16 sends (0.516 + 1) / 2 of the bf16 step; a shape whose H blockwise scaling
    cannot tile shows no FP8 columns."""
    assert packed_row_bytes(7168) == 7168 + 224 and packed_row_bytes(128) == 128 + 16
    rows = 1000
    results = {
        "dsv3": dict(
            sent_mb_per_route=rows * 2 * 7168 * 2 / 1e6,
            sent_mb_once_per_rank=rows * 7168 * 2 / 1e6,
            sent_mb_fp8_rows=rows * packed_row_bytes(7168) / 1e6,
            sent_mb_fp8_step=2 * rows * (packed_row_bytes(7168) + 7168 * 2) / 1e6,
        ),
        "gpt-oss": dict(sent_mb_per_route=2.0, sent_mb_once_per_rank=1.0),
    }
    print_sent_table(results)
    lines = capsys.readouterr().out.splitlines()
    dsv3 = next(line for line in lines if line.startswith("dsv3")).split()
    assert dsv3[-4:] == [f"{rows * 7392 / 1e6:.1f}", "0.516", f"{2 * rows * (7392 + 14336) / 1e6:.1f}", "0.758"], dsv3
    assert len(next(line for line in lines if line.startswith("gpt-oss")).split()) == 4
