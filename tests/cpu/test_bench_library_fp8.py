"""``ds_comet.bench.library_fp8`` without a GPU: its products are the rowwise recipe's training step,
their groups are what the library takes, and their operands pass torch's own checks (meta device)."""

import pytest
import torch

from ds_comet import fp8
from ds_comet.bench import library_fp8
from ds_comet.kernels.library_fp8_phases import ALIGNMENT


@pytest.mark.parametrize("shape", [(4096, 14336, 8, 2, 8192), (48, 80, 5, 3, 37)])
def test_the_products_are_a_gated_training_steps(shape):
    hidden, ffn, experts, k, tokens = shape
    rows = k * tokens
    found = {p.name: p for p in library_fp8.products(hidden, ffn, experts, k, tokens)}
    # Forward: two projections and GEMM2; backward: dY @ W2 and one GEMM over [W1; W3]; three weight
    # gradients, W1's and W3's alike, over the padded rows: eight products, nine times 2 H F a row (the
    # backward's GEMM2 reduces over 2F).
    step = 2 * found["gemm1_fwd"].flops + found["gemm2_fwd"].flops + found["gemm1_bwd"].flops
    step += found["gemm2_bwd"].flops + 2 * found["wgrad_w1"].flops + found["wgrad_w2"].flops
    padded = found["wgrad_w1"].k
    assert step == 2 * hidden * ffn * (6 * rows + 3 * padded)
    assert padded >= rows and padded % ALIGNMENT == 0


def test_the_groups_are_balanced_and_padded_as_the_library_takes_them():
    assert library_fp8.group_ends(37, 5, pad=False) == [8, 16, 23, 30, 37]
    assert library_fp8.group_ends(37, 5, pad=True) == [16, 32, 48, 64, 80]
    assert library_fp8.group_ends(3, 4, pad=True) == [16, 32, 48, 64]  # an empty group: 16 rows of zeros
    assert library_fp8.group_ends(16384, 8, pad=True)[-1] == 16384


def test_each_implementation_passes_torchs_checks_on_the_meta_device():
    hidden, ffn, experts, k, tokens = 64, 96, 4, 2, 40
    meta = torch.device("meta")
    for product in library_fp8.products(hidden, ffn, experts, k, tokens):
        want = [experts, product.m, product.n] if product.two_d else [product.m, product.n]
        for name, call in library_fp8.calls(product, experts, meta).items():
            out = call()
            assert list(out.shape) == want and out.dtype == torch.bfloat16, (product.name, name, out.shape)


def test_without_a_hopper_gpu_it_says_what_it_needs(monkeypatch):
    monkeypatch.setattr("sys.argv", ["library_fp8"])
    with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
        library_fp8.main()


def test_accumulation_errors_are_relative_to_the_magnitudes_sum_and_the_products_norm():
    a = torch.tensor([[1.0, -1.0], [2.0, 2.0]], dtype=torch.float64)
    b = torch.tensor([[3.0, 3.0]], dtype=torch.float64)
    exact = a @ b.t()  # [[0], [12]]: the first cancels, sum_k |a b| = 6 and 12
    assert library_fp8.accumulation_errors(exact, a, b) == (0.0, 0.0)
    # The same error on both: relative to each element's own sum, 0.6 / 6 is the largest, not 0.6 / 12.
    largest, normwise = library_fp8.accumulation_errors(exact + 0.6, a, b)
    assert largest == pytest.approx(0.1) and normwise == pytest.approx((2 * 0.6**2) ** 0.5 / 12)
    # An element whose sum is 0 counts only if it has an error.
    zero = torch.zeros(1, 2, dtype=torch.float64)
    assert library_fp8.accumulation_errors(torch.zeros(1, 1), zero, b)[0] == 0.0
    assert library_fp8.accumulation_errors(torch.ones(1, 1), zero, b)[0] == float("inf")


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """``torch._scaled_grouped_mm`` of one group's rowwise operands in float32."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and list(offs) == [a.shape[0]]
    product = (a.float() * scale_a[:, None]) @ (b[0].float() * scale_b[0][None, :])
    return product.to(out_dtype)


def test_an_accumulation_case_feeds_the_library_the_recipes_operands(monkeypatch):
    """With the library's product emulated in float32 (the dequantised operands' product, as the GPU's
    accumulation in fp32 gives), both settings come out at bf16's rounding: the values, their scales
    and the weight's layout reach torch._scaled_grouped_mm as the recipe's ``fp8.quantise_rows`` made them."""

    quantised_signs = []
    quantise_rows = library_fp8.fp8.quantise_rows

    def recording(x, *args, **kwargs):
        quantised_signs.append(bool((x >= 0).all()))
        return quantise_rows(x, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    monkeypatch.setattr(library_fp8.fp8, "quantise_rows", recording)
    monkeypatch.setattr(library_fp8, "ACCUMULATION_MN", (16, 24))
    for operands in library_fp8.ACCUMULATION_OPERANDS:
        quantised_signs.clear()
        errors = library_fp8.accumulation_case(256, operands, torch.device("cpu"))
        rounding = errors["bf16 rounding"]
        for name in ("fp8", "fp8_fast"):
            assert errors[name][0] <= 2 * max(rounding[0], 2.0**-9), (operands, name, errors)
            assert errors[name][1] <= 2 * max(rounding[1], 2.0**-9), (operands, name, errors)
        # Both operands are quantised from what the case names: magnitudes only, or signed values (which
        # 256 normal draws per row are, but for a chance of 2^-255).
        assert quantised_signs == [operands == "same-signed"] * 2, (operands, quantised_signs)


def test_deepgemms_layout_starts_each_group_on_its_alignment():
    rows, groups = library_fp8.deepgemm_layout([3, 3, 10], 4, torch.device("cpu"))  # the middle group empty
    assert rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert groups.dtype == torch.int32
    assert groups.tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, 2, 2, -1]


class EmulatedDeepGemm:
    """DeepGEMM's m-grouped contiguous GEMMs as its source states them (v2.6.1, csrc/apis/gemm.hpp), in
    float64 on the CPU: the operand layouts, dtypes and group alignment it asserts on Hopper are
    asserted here too, and the arguments after the groups must come by name; padding rows stay
    untouched. The products are exact, so the tests against it check what reaches the kernel, not
    DeepGEMM's own accuracy (its FP8 products accumulate in fp32 every 128 of K)."""

    ALIGNMENT = 32

    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return EmulatedDeepGemm.ALIGNMENT

    @staticmethod
    def get_mn_major_tma_aligned_tensor(scales):
        """``scales`` [M, K / 128] stored column-major with M padded to 16 bytes, as the kernel reads them."""
        rows, columns = scales.shape
        storage = scales.new_zeros(columns, -(-rows // 4) * 4)
        storage[:, :rows] = scales.t()
        return storage[:, :rows].t()

    @classmethod
    def check_groups(cls, groups, rows, experts):
        assert groups.dtype == torch.int32 and groups.is_contiguous() and groups.shape == (rows,)
        assert int(groups.max()) < experts and int(groups.min()) >= -1
        # The kernel takes a block's group from its first row: a block holds one group's rows, then padding.
        blocks = groups.view(-1, cls.ALIGNMENT)
        real = blocks >= 0
        assert ((blocks == blocks[:, :1]) | ~real).all() and (real[:, :-1] >= real[:, 1:]).all()

    @classmethod
    def m_grouped_fp8_gemm_nt_contiguous(
        cls, a, b, d, grouped_layout, *, recipe=None, recipe_a=None, recipe_b=None, disable_ue8m0_cast=False
    ):
        (values, tile_scales), (weights, block_scales) = a, b
        rows, width = values.shape
        experts, n, _ = weights.shape
        assert recipe is recipe_a is recipe_b is None  # the default: (1, 128, 128) for fp32 scales
        assert values.dtype == weights.dtype == torch.float8_e4m3fn and values.stride(-1) == weights.stride(-1) == 1
        assert tile_scales.dtype == block_scales.dtype == torch.float32
        assert tile_scales.shape == (rows, width // 128) and tile_scales.stride(0) == 1
        assert tile_scales.stride(1) % 4 == 0
        assert block_scales.shape == (experts, -(-n // 128), width // 128) and block_scales.is_contiguous()
        assert d.dtype == torch.bfloat16 and d.shape == (rows, n) and d.is_contiguous()
        cls.check_groups(grouped_layout, rows, experts)
        x = fp8.Quantised(values, tile_scales.contiguous(), fp8.TILE).dequantise().double()
        for expert in range(experts):
            w = fp8.Quantised(weights[expert], block_scales[expert], fp8.WEIGHT_BLOCK).dequantise().double()
            mine = grouped_layout == expert
            d[mine] = (x[mine] @ w.t()).bfloat16()

    @classmethod
    def m_grouped_bf16_gemm_nt_contiguous(cls, a, b, d, grouped_layout):
        assert a.dtype == b.dtype == d.dtype == torch.bfloat16 and a.stride(-1) == b.stride(-1) == 1
        assert a.shape[1] % 64 == 0  # Hopper's bf16 kernel's K block
        assert d.shape == (a.shape[0], b.shape[1]) and d.is_contiguous()
        cls.check_groups(grouped_layout, a.shape[0], b.shape[0])
        for expert in range(b.shape[0]):
            mine = grouped_layout == expert
            d[mine] = (a[mine].double() @ b[expert].double().t()).bfloat16()


def test_deepgemms_products_are_the_groups_products_of_the_blockwise_operands():
    ends, width, n = [5, 5, 40], 256, 136  # an empty group; N not a whole weight block
    a, b = torch.randn(ends[-1], width), torch.randn(len(ends), n, width)
    found = library_fp8.deepgemm_calls(EmulatedDeepGemm, a, b, ends)
    rows, groups = library_fp8.deepgemm_layout(ends, EmulatedDeepGemm.ALIGNMENT, a.device)
    x = fp8.quantise_tiles(a).dequantise().double()
    group = torch.repeat_interleave(torch.arange(len(ends)), torch.diff(torch.tensor([0, *ends])))
    want_fp8, want_bf16 = torch.empty(ends[-1], n, dtype=torch.float64), torch.empty(ends[-1], n, dtype=torch.float64)
    for expert in range(len(ends)):
        mine = group == expert
        want_fp8[mine] = x[mine] @ fp8.quantise_blocks(b[expert]).dequantise().double().t()
        want_bf16[mine] = a[mine].bfloat16().double() @ b[expert].bfloat16().double().t()
    for name, want in (("deepgemm_fp8", want_fp8), ("deepgemm_bf16", want_bf16)):
        out = found[name]()
        assert out.shape == (groups.numel(), n)
        torch.testing.assert_close(out[rows].double(), want, rtol=2**-8, atol=1e-6, msg=name)


def test_only_the_products_that_group_their_rows_run_on_deepgemm():
    for product in library_fp8.products(256, 384, 3, 2, 37):
        names = set(library_fp8.calls(product, 3, torch.device("cpu"), EmulatedDeepGemm))
        grouped = {"deepgemm_fp8", "deepgemm_bf16"}
        assert names == {"bf16", "fp8", "fp8_fast"} | (set() if product.two_d else grouped), product.name


def test_deepgemms_accumulation_case_compares_it_with_its_own_operands(monkeypatch):
    monkeypatch.setattr(library_fp8, "ACCUMULATION_MN", (16, 24))
    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    for operands in library_fp8.ACCUMULATION_OPERANDS:
        errors = library_fp8.accumulation_case(256, operands, torch.device("cpu"), EmulatedDeepGemm)
        rounding = errors["bf16 rounding"]
        assert errors["deepgemm_fp8"][0] <= 2 * max(rounding[0], 2.0**-9), (operands, errors)


def test_deepgemm_not_importable_names_its_build(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "deep_gemm", None)
    with pytest.raises(SystemExit, match="scripts/build_deepgemm.sh"):
        library_fp8.import_deepgemm()
