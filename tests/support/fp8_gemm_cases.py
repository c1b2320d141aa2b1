"""The FP8 GEMM kernels (``ds_comet/kernels/triton_fp8_gemm.py``) against ``ds_comet/fp8.py`` and the
reference pipeline's emulation (``pipelines/fp8_emulation.py``), on one device: Triton's interpreter
on CPU (tests/cpu/test_fp8_gemm.py) or a GPU (tests/gpu/test_fp8.py).

``quantisation_case``: the kernels' in-register quantisation, through a kernel that stores what it
computes, bit for bit against ``fp8.quantise_tiles``; ``packed_rows_case``: the rows ``"dispatch":
"fp8"`` sends (``kernels/fp8_rows.py``), quantised and dequantised, against ``fp8.py`` and the
emulation's exchange; ``weight_quantisation_case``: the weights' quantisation kernel against
``fp8.quantise_blocks``; ``rowwise_quantisation_case``: the rowwise recipe's row quantisation kernel
(``library_fp8_phases.quantised_rows_by_triton``) against ``fp8.quantise_rows``, and
``rowwise_weights_case`` the rowwise weight copies' kernels against ``fp8.quantise_rows`` and
``fp8.quantise_columns``; ``expert_columns_case``: the weight gradients' operands
(``library_fp8_phases.quantised_expert_columns_by_triton``) against ``fp8.quantise_columns`` of each
expert's rows; ``row_count_case``:
the row count after library_fp8's GEMM2 against what the combine waits for.

``GemmCase``: one rank's rows laid out as the exchange lays them out (tests/support/layout_reference.py,
every row tile marked as arrived), experts with skewed row counts (one with none, odd ones), weights
from ``Fp8WeightCache``, and each of the four FP8 GEMMs launched as ``TritonFp8Gemm`` launches it
(smaller tiles), each on the same bf16 operands as the emulation's GEMM. The bound, per element of a
GEMM's output: both the kernel and the emulation compute ``P = Q(a) @ Q(w)^T (+ bias)`` from the same
quantised operands, exactly representable, and each product of two FP8 values is exact in fp32. They
differ only in how the K products are summed: the emulation in one fp32 GEMM, the kernel per 128 in
the tensor cores, promoted into an fp32 accumulator. Summed in fp32, each result is within
``K * 2**-24 * S`` of P (S = |Q(a)| @ |Q(w)|^T, the sum of the products' magnitudes); the tensor
cores' FP8 accumulation keeps fewer bits than fp32 (DeepSeek-V3 measured about 14 on Hopper),
which ``mma_error`` adds per unit of S. Both are then rounded to bf16, one rounding each: they may
differ by one bf16 step of P (2**-7 |P| at most; also where Triton's interpreter truncates to bf16,
as it does, where the GPU and torch round to nearest). So ``|kernel - emulation| <= 2**-7 |P| + 2 (K
2**-24 + mma_error) S``, checked against P computed in float64.
"""

import torch
import triton
import triton.language as tl

from ds_comet import fp8
from ds_comet.config import Fp8Recipe
from ds_comet.experts import FeedForward, GatedFeedForward, fused_expert
from ds_comet.kernels import constants as C
from ds_comet.kernels import fp8_rows
from ds_comet.kernels import layout as L
from ds_comet.kernels.fp8_weights import (
    Fp8WeightCache,
    QuantisedWeight,
    quantised_by_torch,
    quantised_by_triton,
    rowwise_copy_by_triton,
    rowwise_transposed_copy_by_triton,
)
from ds_comet.kernels.gemm_phases import Phase
from ds_comet.kernels.launch import PointerTables
from ds_comet.kernels.library_fp8_phases import (
    QUANTISE_COLUMNS,
    padded_expert_ends,
    quantised_expert_columns,
    quantised_expert_columns_by_triton,
    quantised_rows_by_triton,
)
from ds_comet.kernels.triton_fp8_gemm import gemm1_fp8_kernel, gemm2_fp8_kernel
from ds_comet.kernels.triton_fp8_quantise import _quantise_tile
from ds_comet.kernels.triton_gemm import ACTIVATION_CODES, count_received_rows_kernel
from ds_comet.kernels.triton_phases import next_power_of_2, with_descriptor_scratch
from ds_comet.pipelines.expert_weights import ModuleFusedExperts
from ds_comet.pipelines.fp8_emulation import Fp8Exchange, RecipeOperands, _activate, _first_layer
from tests.support.layout_reference import layout_array, reference_layout

BF16_STEP = 2.0**-7  # bf16's largest step relative to the value it rounds (8 significant bits)


@triton.jit
def quantise_tiles_kernel(x, values, scales, K, E5M2: tl.constexpr, BM: tl.constexpr):
    """``_quantise_tile`` over ``x`` ([M, K], K a multiple of 128), each program one [BM, 128] tile: the
    quantised values into ``values`` ([M, K]) and the scales into ``scales`` ([M, K / 128])."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * 128 + tl.arange(0, 128)
    quantised, scale = _quantise_tile(tl.load(x + offs_m[:, None] * K + offs_k[None, :]), E5M2)
    tl.store(values + offs_m[:, None] * K + offs_k[None, :], quantised)
    tl.store(scales + offs_m * (K // 128) + tl.program_id(1), scale)


def special_rows(fmt: fp8.Fp8Format) -> torch.Tensor:
    """[16, 256] bf16 rows that reach every case of the definition: ties between two values of the
    format (normal and subnormal) at scale 1, a tile at its scale's limit (amax = fmt.max x 2**e), a
    tile of zeros, signed zeros, a tile of bf16 subnormals (scale 2**-126) and values quantised there,
    and tiles holding an infinity or a NaN (scale NaN)."""
    rows = torch.zeros(16, 256)
    step = 2.0**-fmt.mantissa_bits  # the format's step on [1, 2)
    sub = 2.0 ** (fmt.min_normal_exponent - fmt.mantissa_bits)  # its subnormal step
    ties = torch.tensor([1 + step / 2, 1 + 3 * step / 2, -(1 + step / 2), sub / 2, 3 * sub / 2, -sub / 2])
    rows[0, : len(ties)] = ties
    rows[0, 127] = fmt.max  # scale 1: amax equals fmt.max x 2**0
    rows[0, 128:] = torch.linspace(-3.0, 3.0, 128) * 2.0**-20
    rows[1, :128] = torch.linspace(-1.0, 1.0, 128) * fmt.max * 2.0**5  # amax = fmt.max x 2**5 exactly
    rows[2, 5] = -0.0
    rows[3, :128] = torch.linspace(-1.0, 1.0, 128) * 2.0**-127  # bf16 subnormals
    rows[3, 128:] = torch.linspace(-1.0, 1.0, 128) * 2.0**-120  # amax below fmt.max x 2**-126: scale 2**-126
    rows[4, 7] = float("inf")
    rows[5, 200] = float("nan")
    rows[6, 0] = -float("inf")
    return rows.to(torch.bfloat16)


def quantisation_case(device: torch.device, seed: int) -> int:
    """Every quantised value and scale of the kernels' quantisation, in both formats, equal to
    ``fp8.quantise_tiles``'s bit for bit: random rows whose tiles span 2**±40 (so that their scales
    differ) and ``special_rows``. Where a tile's scale is NaN its values are NaN too on the GPU (the
    GEMM's product is NaN through the scale either way; Triton's interpreter casts NaN to e4m3 as a
    number). Returns the number of tiles checked."""
    generator = torch.Generator().manual_seed(seed)
    checked = 0
    for fmt in (fp8.E4M3, fp8.E5M2):
        rows, columns = 64, 512
        magnitude = 2.0 ** (torch.rand(rows, columns // 128, generator=generator) * 80 - 40)
        x = torch.randn(rows, columns, generator=generator) * magnitude.repeat_interleave(128, dim=1)
        x = torch.cat([x.to(torch.bfloat16), torch.cat([special_rows(fmt)] * 2, dim=1)]).to(device)
        values = torch.empty(x.shape, dtype=fmt.dtype, device=device)
        scales = torch.empty((x.shape[0], x.shape[1] // 128), device=device)
        quantise_tiles_kernel[(x.shape[0] // 16, x.shape[1] // 128)](
            x, values, scales, x.shape[1], E5M2=fmt is fp8.E5M2, BM=16
        )
        want = fp8.quantise_tiles(x.cpu(), fmt)
        got_scales, got_values = scales.cpu(), values.cpu()
        nan_tiles = want.scales.isnan()
        assert torch.equal(got_scales.isnan(), nan_tiles), f"{fmt.name}: NaN scales differ"
        assert torch.equal(got_scales[~nan_tiles], want.scales[~nan_tiles]), f"{fmt.name}: scales differ"
        finite = ~nan_tiles.repeat_interleave(128, dim=1)
        got_bits, want_bits = got_values.view(torch.uint8), want.values.view(torch.uint8)
        wrong = (got_bits != want_bits) & finite
        assert not wrong.any(), f"{fmt.name}: {int(wrong.sum())} values differ, first at {wrong.nonzero()[0].tolist()}"
        if device.type == "cuda":
            assert torch.equal(got_values.float().isnan(), ~finite), f"{fmt.name}: NaN tiles' values"
        checked += want.scales.numel()
    return checked


def rowwise_quantisation_case(device: torch.device, seed: int) -> int:
    """``quantised_rows_by_triton`` against ``fp8.quantise_rows`` bit for bit, in both formats: rows
    wider than the kernel's pass and not a multiple of it, whose magnitudes span 2**±40, read through
    a row stride wider than the row (a column slice), and ``special_rows`` padded with zeros (one
    scale a row here). Rows whose scale is NaN (an infinity or a NaN in the row) must have NaN scales
    only. Returns the number of rows checked."""
    generator = torch.Generator().manual_seed(seed)
    columns = QUANTISE_COLUMNS + 272  # two passes, the second partial; a multiple of 16
    checked = 0
    for fmt in (fp8.E4M3, fp8.E5M2):
        magnitude = 2.0 ** (torch.rand(37, 1, generator=generator) * 80 - 40)
        wide = (torch.randn(37, columns + 48, generator=generator) * magnitude).to(torch.bfloat16)
        special = torch.zeros(16, columns + 48, dtype=torch.bfloat16)
        special[:, :256] = special_rows(fmt)
        x = torch.cat([wide, special]).to(device)[:, 48:]  # row stride columns + 48
        got = quantised_rows_by_triton(x, fmt)
        want = fp8.quantise_rows(x.cpu(), fmt)
        got_scales, got_values = got.scales.cpu(), got.values.cpu()
        assert got.values.shape == x.shape and got_scales.shape == (x.shape[0], 1)
        nan_rows = want.scales.isnan()
        assert torch.equal(got_scales.isnan(), nan_rows), f"{fmt.name}: NaN scales differ"
        assert torch.equal(got_scales[~nan_rows], want.scales[~nan_rows]), f"{fmt.name}: scales differ"
        finite = ~nan_rows.expand_as(x.cpu())
        wrong = (got_values.view(torch.uint8) != want.values.view(torch.uint8)) & finite
        assert not wrong.any(), f"{fmt.name}: {int(wrong.sum())} values differ, first at {wrong.nonzero()[0].tolist()}"
        checked += x.shape[0]
    return checked


def rowwise_weights_case(device: torch.device) -> int:
    """The rowwise recipe's weight copies as ``Fp8WeightCache`` makes them on a GPU, read where the
    weights lie, bit for bit against ``fp8.py``: each expert's [N, K] per row (W1, W3, W2), per column
    written transposed (W2^T), and W1 and W3 stacked along N per column, one scale across both
    ([W1; W3]^T). Sizes that the kernels' passes and tiles do not divide; rows and columns at a
    scale's limit, ties, bf16 subnormals, zeros, an infinity and a NaN (whose row's or column's scale
    is NaN: only the scale is compared there). Returns the number of scales checked."""
    generator = torch.Generator().manual_seed(11)
    num_local, rows, columns = 3, 200, 1100
    magnitude = 2.0 ** (torch.rand(num_local, rows, 1, generator=generator) * 60 - 30)
    weights = (torch.randn(num_local, rows, columns, generator=generator) * magnitude).to(torch.bfloat16)
    weights[0, 3, :] = 0.0
    weights[0, 4, :8] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, 2.0**-130, -(2.0**-131), 0.0, -0.0])
    weights[1, 7, 9] = float("inf")
    weights[2, 150, 1000] = float("nan")
    weights[1, :, 20] = 2.0**-128  # a column of bf16 subnormals
    second = (torch.randn(num_local, rows, columns, generator=generator) * 3.0).to(torch.bfloat16)
    first_list = [w.to(device) for w in weights]
    second_list = [w.to(device) for w in second]
    checked = 0

    def compare(name, values, scales, want):
        nonlocal checked
        got_scales, got_values = scales.cpu().view(want.scales.shape), values.cpu()
        nan = want.scales.isnan()
        assert torch.equal(got_scales.isnan(), nan), f"{name}: NaN scales differ"
        assert torch.equal(got_scales[~nan], want.scales[~nan]), f"{name}: scales differ"
        finite = ~nan.expand_as(want.values)
        wrong = (got_values.view(torch.uint8) != want.values.view(torch.uint8)) & finite
        assert not wrong.any(), f"{name}: {int(wrong.sum())} values differ, first at {wrong.nonzero()[0].tolist()}"
        checked += want.scales.numel()

    values = torch.empty(num_local, rows, columns, dtype=fp8.E4M3.dtype, device=device)
    scales = torch.empty(num_local, rows, 1, device=device)
    rowwise_copy_by_triton(first_list, values, scales)
    for e in range(num_local):
        compare(f"rows of expert {e}", values[e], scales[e], fp8.quantise_rows(weights[e]))
    for sources, stacked in (([first_list], weights), ([first_list, second_list], torch.cat([weights, second], 1))):
        values = torch.empty(num_local, columns, stacked.shape[1], dtype=fp8.E4M3.dtype, device=device)
        scales = torch.empty(num_local, columns, 1, device=device)
        rowwise_transposed_copy_by_triton(sources, values, scales)
        for e in range(num_local):
            want = fp8.quantise_columns(stacked[e])
            want = fp8.Quantised(want.values.t(), want.scales.t(), (1, want.values.shape[0]))
            compare(f"{len(sources)} source(s), columns of expert {e}", values[e], scales[e], want)
    return checked


def expert_columns_case(device: torch.device, seed: int) -> int:
    """The weight gradients' operands as library_fp8 quantises them (``quantised_expert_columns_by_triton``,
    and ``quantised_expert_columns`` off the GPU), bit for bit against ``fp8.quantise_columns`` of each
    expert's rows (scale 1 for one with none), transposed, each padded with zeros to whole 16s (at least
    one): in both formats, each expert's rows taken by one program and split into runs;
    experts with no rows, one row, a whole 16 and odd counts, the first starting past row 0 and rows
    past the last expert's end (not read); columns whose magnitudes span 2**±40, more of them than one
    program's and not a multiple of it, read through a row stride wider than the row; and
    ``special_rows`` inside one expert (ties, zeros, subnormals; columns holding an infinity or a NaN,
    whose scale is NaN: only the scale is compared there). Returns the number of scales checked."""
    generator = torch.Generator().manual_seed(seed)
    counts, first_row, expert_start = [5, 0, 70, 16, 1, 33], 2, 3
    columns = 300
    starts = [first_row]
    for count in counts:
        starts.append(starts[-1] + count)
    checked = 0
    for fmt in (fp8.E4M3, fp8.E5M2):
        magnitude = 2.0 ** (torch.rand(1, columns + 40, generator=generator) * 80 - 40)
        wide = torch.randn(starts[-1] + 9, columns + 40, generator=generator) * magnitude
        wide[starts[2] + 20 : starts[2] + 36, 40 : 40 + 256] = special_rows(fmt).float()  # inside expert 2
        x_cpu = wide.to(torch.bfloat16)[:, 40:]  # row stride columns + 40
        layout = torch.zeros(expert_start + len(counts) + 4, dtype=torch.int32)
        layout[expert_start : expert_start + len(counts) + 1] = torch.tensor(starts, dtype=torch.int32)
        layout = layout.to(device)
        ends = padded_expert_ends(layout, expert_start, len(counts))
        want_ends = torch.tensor([max(-(-c // 16) * 16, 16) for c in counts]).cumsum(0)  # none: 16 of zeros
        assert ends.dtype == torch.int32 and ends.cpu().tolist() == want_ends.tolist(), ends
        x = x_cpu.to(device)
        results = {
            f"kernel, {parts} run(s) an expert": quantised_expert_columns_by_triton(
                x, layout, expert_start, ends, fmt, parts
            )
            for parts in (1, 3)  # 3: expert 2's 70 rows in runs of 64, 6 and none
        }
        results["fp8.py"] = quantised_expert_columns(x_cpu, layout.cpu(), expert_start, ends.cpu(), fmt)
        for name, (values_t, scales) in results.items():
            values_t, scales = values_t.cpu(), scales.cpu()
            assert values_t.shape[1] % 16 == 0 and values_t.shape[1] >= int(want_ends[-1]), values_t.shape
            padded_first = 0
            for expert, count in enumerate(counts):
                want = fp8.quantise_columns(x_cpu[starts[expert] : starts[expert + 1]], fmt)
                want_scales = want.scales[0] if count else torch.ones(columns)  # no rows: zeros' scale
                where = f"{fmt.name}, {name}, expert {expert}"
                nan = want_scales.isnan()
                assert torch.equal(scales[expert].isnan(), nan), f"{where}: NaN scales differ"
                assert torch.equal(scales[expert][~nan], want_scales[~nan]), f"{where}: scales differ"
                got = values_t[:, padded_first : padded_first + count].view(torch.uint8)
                wrong = (got != want.values.t().view(torch.uint8)) & ~nan[:, None]
                assert not wrong.any(), f"{where}: {int(wrong.sum())} values differ, first at {wrong.nonzero()[0]}"
                padding = values_t[:, padded_first + count : int(want_ends[expert])].view(torch.uint8)
                assert not padding[~nan].any(), f"{where}: the padding is not zero"
                padded_first = int(want_ends[expert])
                checked += columns
    return checked


def row_count_case(device: torch.device) -> int:
    """``count_received_rows_kernel`` as ``library_fp8_phases.count_received_rows`` launches it, over
    hidden sizes that column tiles and chunks divide and do not: each column chunk's counter gains the
    received rows (the layout's total) times the chunk's column tiles, which is what the combine waits
    for alone in the group (``combine_kernels.cu``: own routes x tiles); counters past the last chunk
    and the layout are left as they were. Returns the number of chunks checked."""
    offset, rows = 5, 1234
    checked = 0
    for hidden in (128, 200, 2880, 4096, 7168):
        for tile_n in (64, 128, 256):
            for n_chunks in (1, 3, 8, 64):
                column_tiles = -(-hidden // tile_n)
                chunk_tiles = -(-column_tiles // n_chunks)
                num_chunks = -(-column_tiles // chunk_tiles)  # FusedKernels.chunking
                layout = torch.zeros(16, dtype=torch.int32, device=device)
                layout[offset] = rows
                counters = torch.full((num_chunks + 2,), 7, dtype=torch.int32, device=device)
                table = torch.tensor([counters.data_ptr()], dtype=torch.int64, device=device)
                count_received_rows_kernel[(num_chunks,)](
                    table, layout, offset, hidden, CHUNK_COLS=chunk_tiles * tile_n, BN=tile_n
                )
                chunk_cols = chunk_tiles * tile_n
                want = [
                    7 + rows * -(-(min(hidden, (c + 1) * chunk_cols) - c * chunk_cols) // tile_n)
                    for c in range(num_chunks)
                ]
                assert counters.tolist() == want + [7, 7], (hidden, tile_n, n_chunks, counters.tolist(), want)
                assert layout[offset] == rows and int(layout.sum()) == rows
                checked += num_chunks
    return checked


def packed_rows_case(device: torch.device, seed: int) -> int:
    """``fp8_rows.quantise_rows`` against ``fp8.quantise_tiles`` bit for bit, and ``fp8_rows.dequantise_rows``
    against the rows as the emulation's exchange holds them (``Fp8Exchange``), bit for bit, in both
    formats: e4m3, the rows ``"dispatch": "fp8"`` sends, and e5m2, the output gradients ``"gradient_dispatch":
    "fp8"`` sends under ``"gradient_format": "e5m2"``. On an odd number of rows whose tiles span 2**±40,
    and the format's ``special_rows`` (bf16 subnormals, ties, zeros; infinities and NaNs, whose tiles come
    back NaN on the GPU). Returns the number of tiles checked."""
    generator = torch.Generator().manual_seed(seed)
    checked = 0
    for fmt in (fp8.E4M3, fp8.E5M2):
        rows, columns = 61, 256
        magnitude = 2.0 ** (torch.rand(rows, columns // 128, generator=generator) * 80 - 40)
        x = (torch.randn(rows, columns, generator=generator) * magnitude.repeat_interleave(128, dim=1)).bfloat16()
        x = torch.cat([x, special_rows(fmt)]).to(device)
        packed = fp8_rows.quantise_rows(x, fmt)
        assert packed.shape == (x.shape[0], fp8_rows.packed_row_bytes(columns))
        values, scales = (part.cpu() for part in fp8_rows.packed_parts(packed, columns, fmt))
        want = fp8.quantise_tiles(x.cpu(), fmt)
        nan_tiles = want.scales.isnan()
        assert torch.equal(scales.isnan(), nan_tiles), f"{fmt.name}: NaN scales differ"
        assert torch.equal(scales[~nan_tiles], want.scales[~nan_tiles]), f"{fmt.name}: scales differ"
        finite = ~nan_tiles.repeat_interleave(128, dim=1)
        wrong = (values.view(torch.uint8) != want.values.view(torch.uint8)) & finite
        assert not wrong.any(), f"{fmt.name}: {int(wrong.sum())} values differ, first at {wrong.nonzero()[0].tolist()}"
        got = fp8_rows.dequantise_rows(packed, columns, fmt).cpu()
        wrong = (got.view(torch.int16) != exchanged(x.cpu(), fmt).view(torch.int16)) & finite
        assert not wrong.any(), (
            f"{fmt.name}: {int(wrong.sum())} dequantised values differ, first at {wrong.nonzero()[0].tolist()}"
        )
        assert got[~finite].isnan().all() or device.type != "cuda", f"{fmt.name}: NaN tiles' dequantised values"
        check_gated_gradient_rows(x, packed, fmt, finite, generator)
        checked += want.scales.numel()
    return checked


def check_gated_gradient_rows(x, packed, fmt, finite, generator) -> None:
    """Packed gradient rows with each route's gate folded into their scales (as the backward's dispatch of
    packed rows delivers them) dequantise to each route's output gradient in the reference pipeline under
    ``"gradient_dispatch": "fp8"``, bit for bit: the returned row's gradient times the gate, in fp32, in
    the experts' dtype (autograd through ``outputs * gates``). Where the unscaled values would be bf16
    subnormals the reference rounds twice: those rows are left out."""
    gates = torch.rand(x.shape[0], generator=generator) * 0.9 + 0.05
    gated = packed.clone()
    fp8_rows.packed_parts(gated, x.shape[1], fmt)[1].mul_(gates[:, None].to(x.device))
    got = fp8_rows.dequantise_rows(gated, x.shape[1], fmt).cpu()
    outputs = torch.zeros(x.shape, dtype=torch.bfloat16, requires_grad=True)
    (outputs * gates[:, None]).backward(exchanged(x.cpu(), fmt).float())
    unscaled = fp8.quantise_tiles(x.cpu(), fmt).dequantise().abs()
    compared = finite & ((unscaled == 0) | (unscaled >= 2.0**-126)).all(dim=1, keepdim=True)
    assert compared.sum() > x.numel() // 2, f"{fmt.name}: too few gated gradients compared"
    wrong = (got.view(torch.int16) != outputs.grad.view(torch.int16)) & compared
    assert not wrong.any(), (
        f"{fmt.name}: {int(wrong.sum())} gated gradients differ, first at {wrong.nonzero()[0].tolist()}"
    )


def exchanged(x: torch.Tensor, fmt: fp8.Fp8Format) -> torch.Tensor:
    """``x`` as the emulation's exchange delivers it in ``fmt``: e4m3, the tokens that cross under
    ``"dispatch": "fp8"`` (``Fp8Exchange.outgoing``); e5m2, an output gradient that crosses back under
    ``"gradient_dispatch": "fp8"`` and ``"gradient_format": "e5m2"`` (the gradient ``Fp8Exchange.returning``
    passes on)."""
    if fmt is fp8.E4M3:
        return Fp8Exchange(Fp8Recipe(enabled=True, dispatch="fp8")).outgoing(x)
    recipe = Fp8Recipe(enabled=True, gradient_dispatch="fp8", gradient_format=fmt.name)
    rows = torch.zeros_like(x, requires_grad=True)
    Fp8Exchange(recipe).returning(rows).backward(x)
    return rows.grad


def weight_quantisation_case(device: torch.device) -> str:
    """``fp8_weights.quantised_by_triton`` against ``quantised_by_torch`` (``fp8.quantise_blocks``), bit
    for bit, in both orientations, one and both at once: blocks spread over 2**±40, a block of zeros,
    bf16 subnormals, ties at a block's scale limit (amax 448), and blocks holding a NaN or an infinity
    (their values NaN on the GPU; Triton's interpreter casts NaN to e4m3 as a number). Returns a line
    saying how many blocks it compared."""
    generator = torch.Generator().manual_seed(3)
    matrices = []
    for _ in range(3):
        rows = 2.0 ** (torch.rand(256, 1, generator=generator) * 60 - 30)
        columns = 2.0 ** (torch.rand(1, 384, generator=generator) * 20 - 10)
        matrices.append((torch.randn(256, 384, generator=generator) * rows * columns).bfloat16())
    matrices[0][:128, :128] = 0  # a block of zeros: scale 1
    matrices[0][128:, :128] = torch.linspace(-1, 1, 128 * 128).view(128, 128) * 2.0**-127  # bf16 subnormals
    matrices[1][:128, 128:256] = 1.0625  # a tie between two e4m3 values at scale 1 (amax 448 below)
    matrices[1][0, 128] = 448.0
    matrices[1][5, 300] = float("nan")
    matrices[2][200, 5] = -float("inf")
    matrices = [m.to(device) for m in matrices]
    compared = 0
    for wanted in (
        [QuantisedWeight("w1", ("w1",), False), QuantisedWeight("w1t", ("w1",), True)],
        [QuantisedWeight("w1t", ("w1",), True)],
        [QuantisedWeight("w1", ("w1",), False)],
    ):
        got, want = quantised_by_triton(matrices, wanted), quantised_by_torch(matrices, wanted)
        for weight in wanted:
            g, w = got[weight.name], want[weight.name]
            nan = w.scales.isnan()
            assert nan.sum() == 2, weight  # the NaN and the infinity blocks
            assert torch.equal(g.scales.isnan(), nan) and torch.equal(g.scales[~nan], w.scales[~nan]), weight
            finite = ~nan.repeat_interleave(128, 1).repeat_interleave(128, 2)
            same = g.values.view(torch.uint8) == w.values.view(torch.uint8)
            assert same[finite].all(), (weight, int((~same & finite).sum()))
            if device.type == "cuda":
                assert g.values.float().isnan()[~finite].all(), weight
            compared += nan.numel()
    return f"{compared} blocks"


def spread(rows: int, columns: int, generator: torch.Generator, octaves: float = 3.0) -> torch.Tensor:
    """Gaussian values whose rows and 128-column tiles differ in magnitude by up to 2**±octaves."""
    row_scale = 2.0 ** (torch.rand(rows, 1, generator=generator) * 2 * octaves - octaves)
    tile_scale = 2.0 ** (torch.rand(1, -(-columns // 128), generator=generator) * 2 * octaves - octaves)
    return (
        torch.randn(rows, columns, generator=generator) * row_scale * tile_scale.repeat_interleave(128, 1)[:, :columns]
    )


def make_experts(num_local: int, hidden: int, ffn: int, gated: bool, generator: torch.Generator, device):
    """``num_local`` experts (SwiGLU without biases, or GELU with them) in bf16 on ``device``, weights
    spread as ``spread``, and the kernels' view of them."""
    experts = [GatedFeedForward(hidden, ffn) if gated else FeedForward(hidden, ffn, "gelu") for _ in range(num_local)]
    with torch.no_grad():
        for expert in experts:
            for param in expert.parameters():
                if param.dim() == 1:
                    param.copy_(0.1 * torch.randn(param.shape, generator=generator))
                else:
                    param.copy_(spread(*param.shape, generator) / param.shape[1] ** 0.5)
    experts = [expert.to(device=device, dtype=torch.bfloat16) for expert in experts]
    return ModuleFusedExperts([fused_expert(expert) for expert in experts])


class Layout:
    """One rank's (P=1) received rows of ``counts`` routes per local expert, as the exchange lays them
    out, with every row tile arrived; ``rows(values)`` puts per-route rows ([kept, W]) into the recv
    buffer ([R + tile_m, W], NaN past the received rows); ``of_expert(buffer, e)`` takes them out."""

    def __init__(self, counts: list[int], tile_m: int, device: torch.device):
        num_local = len(counts)
        self.counts, self.tile_m, self.device = counts, tile_m, device
        self.lay = reference_layout([counts], 0, tile_m)
        self.offsets = L.layout_offsets(num_local, num_local)
        keys = {"layout_total": self.offsets.total, "total_tiles": C.TOTAL_TILES, "total_kept": C.TOTAL_KEPT}
        keys.update(total_recv_rows=C.TOTAL_RECV_ROWS, total_pieces=C.TOTAL_PIECES, **self.offsets.__dict__)
        self.layout = layout_array(self.lay, keys).to(device)
        self.received = self.lay["totals"]["recv_rows"]
        counters = torch.zeros(self.lay["totals"]["tiles"] + 1, dtype=torch.int32)
        for e in range(num_local):
            region = self.lay["expert_start"][e + 1] - self.lay["expert_start"][e]
            for t in range(self.lay["tile_start"][e + 1] - self.lay["tile_start"][e]):
                counters[self.lay["tile_start"][e] + t] = min(tile_m, region - t * tile_m)
        self.counters = counters.to(device)
        self.origin = torch.zeros(self.received + tile_m, dtype=torch.int64, device=device)  # every row rank 0's

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        buffer = torch.full((self.received + self.tile_m, values.shape[1]), float("nan"), dtype=values.dtype)
        for e, count in enumerate(self.counts):
            first = self.lay["send_offset"][e]
            buffer[self.lay["dest_row"][e] : self.lay["dest_row"][e] + count] = values[first : first + count]
        return buffer.to(self.device)

    def of_expert(self, buffer: torch.Tensor, e: int) -> torch.Tensor:
        return buffer[self.lay["dest_row"][e] : self.lay["dest_row"][e] + self.counts[e]]

    def empty(self, columns: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.full((self.received + self.tile_m, columns), float("nan"), dtype=dtype, device=self.device)


def check_product(name, got, a, w, bias, emulated, mma_error):
    """``got`` (the kernel's bf16 rows of one expert) against ``emulated`` (the emulation's fp32 product,
    before its rounding to bf16) within the module docstring's bound; ``a`` and ``w`` are the
    dequantised operands of ``a @ w^T`` (fp32), ``bias`` fp32 or None."""
    if got.shape[0] == 0:
        return
    exact = a.double() @ w.double().t() + (0 if bias is None else bias.double())
    magnitudes = a.double().abs() @ w.double().abs().t()
    bound = BF16_STEP * exact.abs() + 2 * (a.shape[1] * 2.0**-24 + mma_error) * magnitudes
    difference = (got.double() - emulated.to(torch.bfloat16).double()).abs()
    worst = (difference - bound).argmax()
    assert (difference <= bound).all(), (
        f"{name}: {int((difference > bound).sum())} elements beyond the bound; worst "
        f"{difference.flatten()[worst].item():.4g} against {bound.flatten()[worst].item():.4g}"
    )


class GemmCase:
    """The four FP8 GEMMs on one rank's rows against the emulation (the module's docstring), each on
    the same bf16 operands as the emulation's GEMM, with GEMM2's chunk counts and the rows past the
    received ones left untouched.

    Args:
        device: where the kernels run (CPU: Triton's interpreter).
        gated: SwiGLU experts without biases, else GELU ones with biases.
        gradient_format: the recipe's ``"gradient_format"``.
        seed: the data's.
        tiles: (tile_m, GEMM1's tile_n, GEMM2's tile_n, GEMM2's SUB_M).
        mma_error: the tensor cores' accumulation error, per unit of S (the module's docstring).
        sizes: (H, F).
        counts: rows per local expert.
    """

    CHUNK_TILES = 2

    def __init__(self, device, gated, gradient_format, seed, tiles=(16, 32, 32, 16), mma_error=0.0,
                 sizes=(256, 256), counts=(37, 0, 90, 1)):  # fmt: skip
        self.device, self.gated, self.mma_error, self.counts = device, gated, mma_error, counts
        self.generator = torch.Generator().manual_seed(seed)
        self.hidden, self.ffn = sizes
        self.tile_m, self.gemm1_n, self.gemm2_n, self.sub_m = tiles
        self.experts = make_experts(len(counts), self.hidden, self.ffn, gated, self.generator, device)
        tokens = torch.empty(0, self.hidden, dtype=torch.bfloat16, device=device)
        self.tables = PointerTables().get(self.experts, tokens)
        self.cache = Fp8WeightCache(frozenset(Phase))  # owns what the tables point at
        self.quantised = self.cache.tables(self.experts, device)
        self.layout = Layout(list(counts), self.tile_m, device)
        recipe = Fp8Recipe(enabled=True, dispatch="bf16", gradient_format=gradient_format)
        self.operands, self.gradients = RecipeOperands(recipe), fp8.FORMATS[gradient_format]
        self.width = self.ffn * (2 if gated else 1)
        self.activation = "silu" if gated else "gelu"
        self.error = torch.zeros(C.ERROR_RECORD_WORDS, dtype=torch.int64, device=device)
        self.chunk_counters = torch.zeros(64, dtype=torch.int32, device=device)
        self.common = dict(L_POW2=next_power_of_2(len(counts) + 1), BM=self.tile_m, GROUP_M=2, NUM_PROGS=3)

    def run(self) -> str:
        """Every GEMM, forward then backward; returns a line saying what ran."""
        h = self.forward_gemm1()
        self.forward_gemm2(h)
        self.backward_gemm1()
        self.backward_gemm2()
        assert self.error[0].item() == 0
        return (
            f"ok gated={self.gated} gradients={self.gradients.name} rows={self.layout.received} "
            f"counts={list(self.counts)} tiles={(self.tile_m, self.gemm1_n, self.gemm2_n, self.sub_m)}"
        )

    def launch(self, kernel, *args, **constants):
        if self.device.type != "cuda":
            kernel[(3,)](*args, **self.common, **constants)
            return
        # The warps and stages TritonFp8Gemm launches with; Triton's allocator for the TMA descriptors.
        with_descriptor_scratch(lambda: kernel[(3,)](*args, **self.common, **constants, num_warps=8, num_stages=3))

    def gemm1(self, rows, out, pre, weight, second, backward):
        """GEMM1 on ``rows``: bf16 rows, or packed FP8 rows (uint8, ``fp8_rows``), as ``TritonFp8Gemm`` launches it."""
        lo, q = self.layout.offsets, self.quantised
        rows_fp8 = rows.dtype == fp8_rows.PACKED_DTYPE
        fmt = self.gradients if backward else fp8.E4M3
        rows, row_scales = fp8_rows.packed_parts(rows, self.hidden, fmt) if rows_fp8 else (rows, rows)
        self.launch(
            gemm1_fp8_kernel, rows, row_scales, rows.stride(0), out, pre, q[weight], q[second], q[weight + "_scales"],
            q[second + "_scales"],
            self.tables["b1"], self.tables["b3"], self.layout.layout, self.layout.counters, self.error.data_ptr(),
            10**9, 0, self.hidden, self.ffn, len(self.counts), lo.expert_start, lo.tile_start, lo.local_tiles,
            lo.remote_tiles, lo.totals + C.TOTAL_TILES, BN=self.gemm1_n, HAS_BIAS=not (self.gated or backward),
            GATED=self.gated and not backward, ACTIVATION=0 if backward else ACTIVATION_CODES[self.activation],
            BACKWARD=backward, ACTIVATE=self.gated and not backward, STORE_PRE=self.gated and not backward,
            WAIT=True, INTERPRET=self.device.type != "cuda", E5M2=backward and self.gradients is fp8.E5M2,
            ROWS_FP8=rows_fp8,
        )  # fmt: skip
        assert out[self.layout.received :].isnan().all(), "GEMM1 wrote rows past the received ones"

    def gemm2(self, rows, lda, weight, second, out, backward):
        lo, q = self.layout.offsets, self.quantised
        self.chunk_counters.zero_()
        chunk_table = torch.tensor([self.chunk_counters.data_ptr()], dtype=torch.int64, device=self.device)
        self.launch(
            gemm2_fp8_kernel, rows, lda, q[weight], q[second], q[weight + "_scales"], q[second + "_scales"],
            self.tables["b2"], self.layout.origin, out, chunk_table, self.layout.layout, self.ffn, self.hidden,
            len(self.counts), lo.expert_start, lo.tile_start, lo.totals + C.TOTAL_TILES, EP_SIZE=1, BN=self.gemm2_n,
            SUB_M=self.sub_m, CHUNK_TILES=self.CHUNK_TILES, HAS_BIAS=not (self.gated or backward),
            SECOND=backward and self.gated, E5M2=backward and self.gradients is fp8.E5M2,
        )  # fmt: skip
        n_tiles = -(-self.hidden // self.gemm2_n)
        for chunk in range(-(-n_tiles // self.CHUNK_TILES)):
            wanted = sum(self.counts) * min(self.CHUNK_TILES, n_tiles - chunk * self.CHUNK_TILES)
            assert self.chunk_counters[chunk].item() == wanted, (chunk, self.chunk_counters[chunk].item(), wanted)
        assert out[self.layout.received :].isnan().all(), "GEMM2 wrote rows past the received ones"

    def random_rows(self, columns: int) -> torch.Tensor:
        return self.layout.rows(spread(sum(self.counts), columns, self.generator).to(torch.bfloat16))

    def check(self, name, out, rows, products):
        """Each expert's rows of ``out`` against ``products(e, its rows)``: the emulation's fp32
        product, and (a, w, bias) of its ``a @ w^T + bias`` dequantised."""
        for e in range(len(self.counts)):
            emulated, a, w, bias = products(e, self.layout.of_expert(rows, e))
            got = self.layout.of_expert(out, e)
            check_product(f"{name}, expert {e}", got, a, w, bias, emulated, self.mma_error)

    def forward_gemm1(self) -> torch.Tensor:
        """GEMM1 forward: a gated expert's activations with its products, another's products alone; returns
        the activations (for a GELU expert computed from its products, as the elementwise step does).
        Then the same rows as ``"dispatch": "fp8"`` delivers them (packed FP8 rows): the same outputs,
        bit for bit."""
        x, pre, h = self.random_rows(self.hidden), self.layout.empty(self.width), self.layout.empty(self.ffn)
        gated = self.gated
        self.gemm1(x, h if gated else pre, pre, "w1", "w3" if gated else "w1", backward=False)
        self.check_packed_rows_gemm1(x, pre, h)
        tensors = self.experts.expert_tensors()

        def products(e, rows):
            w13, b13 = _first_layer(tensors[e])
            a, w = self.operands.rows(rows), self.operands.weight(w13, reduced_axis=1)
            return self.operands.forward_product(rows, w13, b13), a, w, b13

        self.check("forward GEMM1", pre, x, products)
        if not gated:
            return _activate(pre, self.activation, self.ffn).to(torch.bfloat16)
        for e in range(len(self.counts)):
            # The epilogue activates the fp32 products, the emulation their bf16 roundings: a few bf16 steps.
            want = _activate(products(e, self.layout.of_expert(x, e))[0].to(torch.bfloat16), self.activation, self.ffn)
            got = self.layout.of_expert(h, e).float()
            torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5 * want.abs().mean().nan_to_num().item())
        return h

    def check_packed_rows_gemm1(self, x: torch.Tensor, pre: torch.Tensor, h: torch.Tensor) -> None:
        """GEMM1 forward on ``x`` quantised into packed FP8 rows (``fp8_rows.quantise_rows``, as the dispatch
        sends them) gives ``pre`` and ``h`` (its outputs on the bf16 ``x``) bit for bit: the kernel takes the
        values and scales it would have computed where it loads the rows."""
        packed = fp8_rows.quantise_rows(x)
        pre_fp8, h_fp8 = self.layout.empty(self.width), self.layout.empty(self.ffn)
        gated = self.gated
        self.gemm1(packed, h_fp8 if gated else pre_fp8, pre_fp8, "w1", "w3" if gated else "w1", backward=False)
        received = self.layout.received
        outputs = [(pre, pre_fp8)] + ([(h, h_fp8)] if gated else [])
        for name, (want, got) in zip(("products", "activations"), outputs):
            same = want[:received].view(torch.int16) == got[:received].view(torch.int16)
            assert same.all(), f"GEMM1 on packed FP8 rows: {int((~same).sum())} {name} differ from the bf16 rows'"

    def forward_gemm2(self, h: torch.Tensor) -> None:
        y = self.layout.empty(self.hidden)
        self.gemm2(h, self.ffn, "w2", "w2", y, backward=False)
        tensors = self.experts.expert_tensors()

        def products(e, rows):
            w2, b2 = tensors[e][4], tensors[e][5]
            a, w = self.operands.rows(rows), self.operands.weight(w2, reduced_axis=1)
            return self.operands.forward_product(rows, w2, b2), a, w, b2

        self.check("forward GEMM2", y, h, products)

    def backward_gemm1(self) -> None:
        """g = dY @ W2, on the quantised W2^T; then on dY as ``"gradient_dispatch": "fp8"`` delivers it."""
        dy, g = self.random_rows(self.hidden), self.layout.empty(self.ffn)
        self.gemm1(dy, g, g, "w2t", "w2t", backward=True)
        tensors = self.experts.expert_tensors()

        def products(e, rows):
            w2 = tensors[e][4]
            a, w = self.operands.rows(rows, self.gradients), self.operands.weight(w2, reduced_axis=0).t()
            return self.operands.gradient_product(rows, w2), a, w, None

        self.check("backward GEMM1", g, dy, products)
        self.check_packed_gradients_gemm1(dy)

    def check_packed_gradients_gemm1(self, dy: torch.Tensor) -> None:
        """g from output gradients packed in the gradient format (``fp8_rows.quantise_rows``), each route's
        gate folded into its row's tile scales (as the backward's dispatch of packed rows does): the gate
        times the emulation's product of the quantised gradient by W2, within the same bound."""
        packed = fp8_rows.quantise_rows(dy, self.gradients)
        gates = torch.rand(packed.shape[0], generator=self.generator).to(self.device) * 0.9 + 0.05
        _, scales = fp8_rows.packed_parts(packed, self.hidden, self.gradients)
        scales.mul_(gates[:, None])  # exact: each scale is a power of two
        g = self.layout.empty(self.ffn)
        self.gemm1(packed, g, g, "w2t", "w2t", backward=True)
        tensors = self.experts.expert_tensors()

        def products(e, rows):
            first = self.layout.lay["dest_row"][e]  # the expert's rows' place in the buffer, and their gates'
            gate = gates[first : first + rows.shape[0], None]
            w2 = tensors[e][4]
            a, w = self.operands.rows(rows, self.gradients), self.operands.weight(w2, reduced_axis=0).t()
            return (
                self.operands.gradient_product(a, w2, quantise_grad=False) * gate,
                a.double() * gate.double(),
                w,
                None,
            )

        self.check("backward GEMM1 on packed gradients", g, dy, products)

    def backward_gemm2(self) -> None:
        """dX = dA @ W1 (+ dA_up @ W3), on the quantised W1^T (and W3^T)."""
        da, dx = self.random_rows(self.width), self.layout.empty(self.hidden)
        self.gemm2(da, self.width, "w1t", "w3t" if self.gated else "w1t", dx, backward=True)
        tensors = self.experts.expert_tensors()

        def products(e, rows):
            w13, _ = _first_layer(tensors[e])
            a, w = self.operands.rows(rows, self.gradients), self.operands.weight(w13, reduced_axis=0).t()
            return self.operands.gradient_product(rows, w13), a, w, None

        self.check("backward GEMM2", dx, da, products)
