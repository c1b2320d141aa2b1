"""FP8 quantisation in Triton, as ``ds_comet/fp8.py`` defines it, bit for bit.

``_quantise_tile`` quantises rows in 1x128 tiles in registers (``fp8.quantise_tiles``), where the
FP8 GEMMs (``triton_fp8_gemm``) load them; ``quantise_blocks_kernel`` quantises the experts' weights
in 128x128 blocks (``fp8.quantise_blocks``) into the layer's FP8 copies (``fp8_weights``), in either
orientation or both, in one pass over them; ``quantise_rows_kernel`` packs rows in 1x128 tiles for the
FP8 dispatch (``fp8_rows``), and ``dequantise_rows_kernel`` turns packed rows back into bf16;
``quantise_rowwise_kernel`` quantises whole rows with one scale each (``fp8.quantise_rows``), the
rowwise recipe's operands of the library's FP8 GEMMs (``library_fp8_phases``), and
``quantise_weight_rows_kernel`` and ``quantise_weight_columns_kernel`` the experts' weights into the
rowwise copies those GEMMs read (``fp8_weights``), per row or per column written transposed, and
``expert_column_maxima_kernel`` and ``quantise_expert_columns_kernel`` the weight gradients' operands,
per column over each expert's rows, written transposed (``fp8.quantise_columns`` of each expert's rows).

Both follow ``fp8.block_scales`` from bits rather than through float arithmetic that could round
otherwise: a block's largest magnitude is an integer maximum over the magnitudes' fp32 bits (which
order as the floats do, and which no flushing of subnormals can change); its biased exponent less
126 is frexp's exponent, and its mantissa bits above the format's say frexp's mantissa exceeds the
format's, which gives the scale's exponent; the scale 2**e and its inverse are built from their bits
(a block of zeros: 1; one holding an infinity or a NaN: NaN), so dividing by the scale is an exact
multiplication. Each value is then rounded to the format here, to nearest, ties to even (on the bits
in the format's normal range; by fp32's own rounding of a sum in its subnormal range), so that the
cast to FP8 after it is exact wherever it runs: Triton's interpreter truncates where the GPU rounds.
"""

import math

import triton
import triton.language as tl

from .. import fp8

FP8_BLOCK = tl.constexpr(fp8.BLOCK)
MIN_SCALE_EXPONENT = tl.constexpr(fp8.MIN_SCALE_EXPONENT)
MAX_SCALE_EXPONENT = tl.constexpr(fp8.MAX_SCALE_EXPONENT)
# A magnitude's fp32 bits from 0x7F800000 up are an infinity or a NaN; 0x7FC00000 is a NaN.
INFINITY_BITS = tl.constexpr(0x7F800000)
NAN_BITS = tl.constexpr(0x7FC00000)


def format_constants(fmt: fp8.Fp8Format) -> dict[str, int | float]:
    """What ``_scale_of`` and ``_round_to_format`` need to know of ``fmt``, derived from ``fp8.py``'s definition of it.

    Returns:
        ``dropped``: the fp32 mantissa bits the format lacks; ``rounding_bias`` and ``keep``: what
        rounds a magnitude's bits to the nearest of those with the low ``dropped`` bits clear, ties
        to even (``(bits + rounding_bias + odd) & keep``); ``smallest_normal``: the fp32 bits of the
        format's smallest normal value; ``subnormal_rounder``: 1.5 x 2**(23 + emin - m), which, added
        to a smaller magnitude, puts it in an fp32 binade whose step is the format's subnormal step
        2**(emin - m), so that fp32's own rounding of the sum rounds it; ``max_exponent`` and
        ``max_mantissa``: ``fmt.max = mantissa * 2**max_exponent`` (frexp), the mantissa's fraction
        above 0.5 as fp32 mantissa bits (what ``fp8.block_scales`` compares amax's mantissa with).
    """
    dropped = 23 - fmt.mantissa_bits
    mantissa, exponent = math.frexp(fmt.max)
    return dict(
        dropped=dropped,
        rounding_bias=(1 << (dropped - 1)) - 1,
        keep=-(1 << dropped),
        smallest_normal=(fmt.min_normal_exponent + 127) << 23,
        subnormal_rounder=1.5 * 2.0 ** (23 + fmt.min_normal_exponent - fmt.mantissa_bits),
        max_exponent=exponent,
        max_mantissa=int((2 * mantissa - 1) * 2**23),
    )


def _constexprs(fmt: fp8.Fp8Format) -> tuple[tl.constexpr, ...]:
    return tuple(tl.constexpr(value) for value in format_constants(fmt).values())


E4M3_DROPPED, E4M3_BIAS, E4M3_KEEP, E4M3_SMALLEST_NORMAL, E4M3_ROUNDER, E4M3_MAX_EXPONENT, E4M3_MAX_MANTISSA = (
    _constexprs(fp8.E4M3)
)
E5M2_DROPPED, E5M2_BIAS, E5M2_KEEP, E5M2_SMALLEST_NORMAL, E5M2_ROUNDER, E5M2_MAX_EXPONENT, E5M2_MAX_MANTISSA = (
    _constexprs(fp8.E5M2)
)


@triton.jit
def _quantise_tile(x, E5M2: tl.constexpr):
    """Rows ``x`` ([BM, 128], any float dtype) quantised as ``fp8.quantise_tiles`` quantises them, each
    row one tile: ``(values [BM, 128] e4m3, or e5m2 with E5M2; scales [BM] fp32)``, the values times the
    scales being the dequantised tile."""
    values = _as_fp32(x)
    amax = tl.max(values.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    scale, inverse = _scale_in_format(amax, E5M2)
    return _in_format(values * inverse[:, None], E5M2), scale


@triton.jit
def _quantise_block(x):
    """A weight's block ``x`` ([128, 128], any float dtype) quantised as ``fp8.quantise_blocks`` quantises
    it: ``(values [128, 128] e4m3, its scale, an fp32 scalar)``."""
    values = _as_fp32(x)
    amax = tl.max(tl.max(values.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
    scale, inverse = _scale_of(amax, E4M3_MAX_EXPONENT, E4M3_MAX_MANTISSA)
    rounded = _round_to_format(values * inverse, E4M3_DROPPED, E4M3_BIAS, E4M3_KEEP, E4M3_SMALLEST_NORMAL, E4M3_ROUNDER)
    return rounded.to(tl.float8e4nv), scale


@triton.jit
def _as_fp32(x):
    """``x`` in fp32, exactly."""
    if x.dtype == tl.bfloat16:
        # A bf16's bits are its fp32 bits' upper half: exact for subnormals too, which Triton's
        # interpreter converts wrongly.
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _scale_of(amax, MAX_EXPONENT: tl.constexpr, MAX_MANTISSA: tl.constexpr):
    """(scale, its inverse), fp32, of blocks whose largest magnitudes' fp32 bits are ``amax`` (int32, any
    shape), in the format of ``MAX_EXPONENT`` and ``MAX_MANTISSA`` (``format_constants``): the module's
    docstring."""
    exponent = (amax >> 23) - 126 - MAX_EXPONENT + ((amax & 0x7FFFFF) > MAX_MANTISSA).to(tl.int32)
    exponent = tl.minimum(tl.maximum(exponent, MIN_SCALE_EXPONENT), MAX_SCALE_EXPONENT)
    nan = tl.full(amax.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0, 1.0, tl.where(amax < INFINITY_BITS, scale, nan))
    inverse = tl.where(amax == 0, 1.0, tl.where(amax < INFINITY_BITS, inverse, nan))
    return scale, inverse


@triton.jit
def _scale_in_format(amax, E5M2: tl.constexpr):
    """``_scale_of`` in e5m2 with E5M2, else in e4m3."""
    if E5M2:
        return _scale_of(amax, E5M2_MAX_EXPONENT, E5M2_MAX_MANTISSA)
    else:
        return _scale_of(amax, E4M3_MAX_EXPONENT, E4M3_MAX_MANTISSA)


@triton.jit
def _in_format(scaled, E5M2: tl.constexpr):
    """``scaled`` (fp32, within the format's range, or NaN) rounded (``_round_to_format``) and cast to
    e5m2 with E5M2, else to e4m3."""
    if E5M2:
        return _round_to_format(scaled, E5M2_DROPPED, E5M2_BIAS, E5M2_KEEP, E5M2_SMALLEST_NORMAL, E5M2_ROUNDER).to(
            tl.float8e5
        )
    else:
        return _round_to_format(scaled, E4M3_DROPPED, E4M3_BIAS, E4M3_KEEP, E4M3_SMALLEST_NORMAL, E4M3_ROUNDER).to(
            tl.float8e4nv
        )


@triton.jit
def _round_to_format(
    scaled,
    DROPPED: tl.constexpr,
    BIAS: tl.constexpr,
    KEEP: tl.constexpr,
    SMALLEST_NORMAL: tl.constexpr,
    ROUNDER: tl.constexpr,
):
    """``scaled`` (fp32, within the format's range, or NaN) rounded to the nearest value of the format whose
    constants (``format_constants``) the others are, ties to even, as fp32 (NaN stays NaN)."""
    bits = scaled.to(tl.int32, bitcast=True)
    magnitudes = bits & 0x7FFFFFFF
    sign = bits ^ magnitudes
    normal = (magnitudes + BIAS + ((magnitudes >> DROPPED) & 1)) & KEEP
    subnormal = ((magnitudes.to(tl.float32, bitcast=True) + ROUNDER) - ROUNDER).to(tl.int32, bitcast=True)
    rounded = (tl.where(magnitudes < SMALLEST_NORMAL, subnormal, normal) | sign).to(tl.float32, bitcast=True)
    return tl.where(magnitudes < INFINITY_BITS, rounded, scaled)


@triton.jit
def quantise_blocks_kernel(
    source_table, values, values_t, scales, scales_t, N, K, STORE: tl.constexpr, STORE_T: tl.constexpr
):
    """``fp8.quantise_blocks`` of each local expert's bf16 ``[N, K]`` weight (``source_table``: [L] int64
    pointers), one 128x128 block a program (grid: N / 128, K / 128, L; N and K multiples of 128).

    With STORE the e4m3 values go to ``values`` ([L, N, K]) and the scales to ``scales``
    ([L, N / 128, K / 128] fp32); with STORE_T the transposed ones to ``values_t`` ([L, K, N]) and
    ``scales_t`` ([L, K / 128, N / 128]): a block's scale does not depend on the orientation.
    """
    block_n, block_k, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = block_n * FP8_BLOCK + tl.arange(0, FP8_BLOCK)
    columns = block_k * FP8_BLOCK + tl.arange(0, FP8_BLOCK)
    weight = tl.load(source_table + expert).to(tl.pointer_type(tl.bfloat16))
    quantised, scale = _quantise_block(tl.load(weight + rows.to(tl.int64)[:, None] * K + columns[None, :]))
    first = expert.to(tl.int64) * N * K
    n_blocks, k_blocks = N // FP8_BLOCK, K // FP8_BLOCK
    if STORE:
        tl.store(values + first + rows.to(tl.int64)[:, None] * K + columns[None, :], quantised)
        tl.store(scales + (expert * n_blocks + block_n) * k_blocks + block_k, scale)
    if STORE_T:
        tl.store(values_t + first + columns.to(tl.int64)[:, None] * N + rows[None, :], tl.trans(quantised))
        tl.store(scales_t + (expert * k_blocks + block_k) * n_blocks + block_n, scale)


@triton.jit
def quantise_rows_kernel(tokens, values, scales, num_rows, K, row_bytes, E5M2: tl.constexpr, BM: tl.constexpr):
    """``fp8.quantise_tiles`` of the rows ``tokens`` ([S, K] bf16, contiguous) into packed FP8 rows
    (``fp8_rows``), one [BM, 128] tile of rows a program (grid: ceil(S / BM), K / 128): the values
    (e5m2 with E5M2, else e4m3) into ``values`` (row stride ``row_bytes``) and each tile's fp32 scale
    into ``scales`` (row stride ``row_bytes // 4``)."""
    k = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    columns = k * FP8_BLOCK + tl.arange(0, FP8_BLOCK)
    in_range = rows < num_rows
    x = tl.load(tokens + rows[:, None] * K + columns[None, :], mask=in_range[:, None], other=0.0)
    quantised, scale = _quantise_tile(x, E5M2)
    tl.store(values + rows[:, None] * row_bytes + columns[None, :], quantised, mask=in_range[:, None])
    tl.store(scales + rows * (row_bytes // 4) + k, scale, mask=in_range)


@triton.jit
def dequantise_rows_kernel(values, scales, out, num_rows, K, row_bytes, BM: tl.constexpr):
    """Packed FP8 rows (``values``, e4m3 or e5m2, and ``scales`` as ``quantise_rows_kernel`` writes them)
    dequantised into ``out`` ([R, K] bf16, contiguous): each value times its tile's scale, in fp32 (exact: the scale
    is a power of two), rounded once to bf16 as the emulation's cast rounds it (``_round_to_bf16``).
    One [BM, 128] tile a program (grid: ceil(R / BM), K / 128)."""
    k = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    columns = k * FP8_BLOCK + tl.arange(0, FP8_BLOCK)
    in_range = rows < num_rows
    quantised = tl.load(values + rows[:, None] * row_bytes + columns[None, :], mask=in_range[:, None], other=0.0)
    scale = tl.load(scales + rows * (row_bytes // 4) + k, mask=in_range, other=1.0)
    dequantised = _round_to_bf16(quantised.to(tl.float32) * scale[:, None])
    tl.store(out + rows[:, None] * K + columns[None, :], dequantised, mask=in_range[:, None])


@triton.jit
def _round_to_bf16(x):
    """fp32 ``x`` rounded to bf16, to nearest, ties to even, on its bits (the upper half of fp32's):
    exact in bf16's subnormal range too, where Triton's interpreter truncates. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    magnitudes = bits & 0x7FFFFFFF
    upper = (magnitudes + 0x7FFF + ((magnitudes >> 16) & 1)) >> 16
    upper = tl.where(magnitudes < INFINITY_BITS, upper, magnitudes >> 16)  # an infinity or a NaN as it is
    return (upper | ((bits >> 16) & 0x8000)).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def quantise_rowwise_kernel(x, stride, values, scales, K, E5M2: tl.constexpr, BK: tl.constexpr):
    """``fp8.quantise_rows`` of ``x`` ([M, K] bf16, row stride ``stride``), one row a program (grid: M):
    the values (e5m2 with E5M2, else e4m3) into ``values`` ([M, K], contiguous) and each row's fp32 scale
    into ``scales`` ([M])."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(scales + row, _quantise_row(x + row * stride, values + row * K, K, E5M2, BK))


@triton.jit
def quantise_weight_rows_kernel(source_table, values, scales, N, K, BK: tl.constexpr):
    """``fp8.quantise_rows`` of each local expert's bf16 ``[N, K]`` weight (``source_table``: [L] int64
    pointers, each matrix contiguous), read where it lies, one row a program (grid: N, L): e4m3 values
    into ``values`` ([L, N, K]) and scales into ``scales`` ([L, N])."""
    row, expert = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    weight = tl.load(source_table + expert).to(tl.pointer_type(tl.bfloat16))
    first = (expert * N + row) * K
    tl.store(scales + expert * N + row, _quantise_row(weight + row * K, values + first, K, False, BK))


@triton.jit
def _quantise_row(source, target, K, E5M2: tl.constexpr, BK: tl.constexpr):
    """One row of K bf16 values at ``source`` quantised with one scale into ``target`` (K values, e5m2
    with E5M2, else e4m3); returns the scale. Two reads of the row, BK columns at a time: its largest
    magnitude, then its values divided by the scale."""
    largest = tl.zeros((BK,), dtype=tl.int32)
    for first in range(0, K, BK):
        columns = first + tl.arange(0, BK)
        chunk = _as_fp32(tl.load(source + columns, mask=columns < K, other=0.0))
        largest = tl.maximum(largest, chunk.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    amax = tl.max(largest, axis=0)
    scale, inverse = _scale_in_format(amax, E5M2)
    for first in range(0, K, BK):
        columns = first + tl.arange(0, BK)
        scaled = _as_fp32(tl.load(source + columns, mask=columns < K, other=0.0)) * inverse
        rounded = _in_format(scaled, E5M2)
        tl.store(target + columns, rounded, mask=columns < K)
    return scale


@triton.jit
def quantise_weight_columns_kernel(
    first_table, second_table, values_t, scales_t, N, K, TWO: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr
):
    """``fp8.quantise_columns`` of each local expert's bf16 ``[N, K]`` weight, or with TWO of the two
    weights ``[first; second]`` ``[2N, K]`` stacked along N (W1 and W3: one scale per column across
    both), read where they lie (``first_table``, ``second_table``: [L] int64 pointers, each matrix
    contiguous) and written transposed: e4m3 values into ``values_t`` ([L, K, N or 2N]) and each
    column's scale into ``scales_t`` ([L, K]). BC columns a program (grid: ceil(K / BC), L), two reads
    of them, BN rows at a time: their largest magnitudes, then their values divided by the scales."""
    block, expert = tl.program_id(0), tl.program_id(1).to(tl.int64)
    columns = block * BC + tl.arange(0, BC)
    in_range = columns < K
    first = tl.load(first_table + expert).to(tl.pointer_type(tl.bfloat16))
    second = tl.load(second_table + expert).to(tl.pointer_type(tl.bfloat16))
    rows_out = 2 * N if TWO else N
    largest = tl.zeros((BC,), dtype=tl.int32)
    for part in tl.static_range(2 if TWO else 1):
        weight = first if part == 0 else second
        for row0 in range(0, N, BN):
            tile, _ = _column_tile(weight, row0 + tl.arange(0, BN), columns, in_range, N, K)
            largest = tl.maximum(largest, tl.max(tile.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))
    scale, inverse = _scale_of(largest, E4M3_MAX_EXPONENT, E4M3_MAX_MANTISSA)
    target = values_t + expert * K * rows_out
    for part in tl.static_range(2 if TWO else 1):
        weight = first if part == 0 else second
        for row0 in range(0, N, BN):
            rows = row0 + tl.arange(0, BN)
            tile, mask = _column_tile(weight, rows, columns, in_range, N, K)
            rounded = _round_to_format(
                tile * inverse[None, :], E4M3_DROPPED, E4M3_BIAS, E4M3_KEEP, E4M3_SMALLEST_NORMAL, E4M3_ROUNDER
            ).to(tl.float8e4nv)
            out_rows = part * N + rows  # stored transposed, consecutive rows of the weight side by side
            addresses = target + columns.to(tl.int64)[:, None] * rows_out + out_rows[None, :]
            tl.store(addresses, tl.trans(rounded), mask=tl.trans(mask))
    tl.store(scales_t + expert * K + columns, scale, mask=in_range)


@triton.jit
def _column_tile(weight, rows, columns, in_range, N, K):
    """The ``rows`` x ``columns`` tile of a bf16 ``[N, K]`` weight in fp32 (0 outside it; ``in_range``:
    the columns below K), and the mask of its elements inside the weight."""
    mask = (rows < N)[:, None] & in_range[None, :]
    tile = tl.load(weight + rows.to(tl.int64)[:, None] * K + columns[None, :], mask=mask, other=0.0)
    return _as_fp32(tile), mask


@triton.jit
def expert_column_maxima_kernel(
    x, stride, maxima, layout, off_expert_start, K, parts, BR: tl.constexpr, BC: tl.constexpr
):
    """Each local expert's largest magnitude per column of ``x`` ([R, K] bf16, row stride ``stride``; expert
    l's rows are ``layout[off_expert_start + l]`` up to the next word), as fp32 bits, into ``maxima``
    ([L, K] int32, zeros before the launch) by atomic maxima. Each expert's rows are split into ``parts``
    runs of whole ``BR`` rows (grid: ceil(K / BC), L, parts), so that the programs are many whatever the
    experts' sizes; BC columns of one run a program, read once."""
    block, expert, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    columns = block * BC + tl.arange(0, BC)
    in_range = columns < K
    first = tl.load(layout + off_expert_start + expert)
    end = tl.load(layout + off_expert_start + expert + 1)
    start, stop = _run_of_part(end - first, parts, part, BR)
    largest = tl.zeros((BC,), dtype=tl.int32)
    for row0 in range(first + start, first + stop, BR):
        tile = _expert_tile(x, stride, row0 + tl.arange(0, BR), first + stop, columns, in_range)
        largest = tl.maximum(largest, tl.max(tile.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))
    tl.atomic_max(maxima + expert.to(tl.int64) * K + columns, largest, mask=in_range & (stop > start), sem="relaxed")


@triton.jit
def quantise_expert_columns_kernel(
    x,
    stride,
    values_t,
    row_stride_t,
    scales,
    maxima,
    layout,
    off_expert_start,
    padded_ends,
    K,
    parts,
    E5M2: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """``fp8.quantise_columns`` of each local expert's rows of ``x`` (as ``expert_column_maxima_kernel``
    reads them), from the columns' largest magnitudes that kernel left in ``maxima``, written transposed
    with each expert's rows padded to its ``padded_ends`` ([L] int32,
    ``library_fp8_phases.padded_expert_ends``): the values (e5m2 with E5M2, else e4m3) into ``values_t``
    ([K, row_stride_t]; expert l's at columns ``padded_ends[l - 1]`` (0 for the first) up to
    ``padded_ends[l]``, zero past its rows) and each column's scale into ``scales`` ([L, K] fp32). Each
    expert's padded rows are split into ``parts`` runs of whole ``BR`` rows (grid: ceil(K / BC), L, parts);
    BC columns of one run a program, read once."""
    block, expert, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    columns = block * BC + tl.arange(0, BC)
    in_range = columns < K
    first = tl.load(layout + off_expert_start + expert)
    end = tl.load(layout + off_expert_start + expert + 1)
    padded_end = tl.load(padded_ends + expert)
    padded_first = tl.load(padded_ends + expert - 1, mask=expert > 0, other=0)
    largest = tl.load(maxima + expert.to(tl.int64) * K + columns, mask=in_range, other=0)
    scale, inverse = _scale_in_format(largest, E5M2)
    start, stop = _run_of_part(padded_end - padded_first, parts, part, BR)
    for offset in range(start, stop, BR):
        rows = offset + tl.arange(0, BR)
        scaled = _expert_tile(x, stride, first + rows, end, columns, in_range) * inverse[None, :]
        rounded = _in_format(scaled, E5M2)
        addresses = values_t + columns.to(tl.int64)[:, None] * row_stride_t + (padded_first + rows)[None, :]
        tl.store(addresses, tl.trans(rounded), mask=in_range[:, None] & (rows < stop)[None, :])
    tl.store(scales + expert.to(tl.int64) * K + columns, scale, mask=in_range & (part == 0))


@triton.jit
def _run_of_part(count, parts, part, BR: tl.constexpr):
    """Rows ``[start, stop)`` of ``count`` that run ``part`` of ``parts`` takes: whole ``BR``s each, the last
    run shorter, runs past ``count`` empty."""
    share = tl.cdiv(tl.cdiv(count, parts), BR) * BR
    start = tl.minimum(part * share, count)
    return start, tl.minimum(start + share, count)


@triton.jit
def _expert_tile(x, stride, rows, end, columns, in_range):
    """The ``rows`` x ``columns`` tile of bf16 rows ``x`` (row stride ``stride``) in fp32, 0 at rows from
    ``end`` on and at columns outside ``in_range``."""
    mask = (rows < end)[:, None] & in_range[None, :]
    return _as_fp32(tl.load(x + rows.to(tl.int64)[:, None] * stride + columns[None, :], mask=mask, other=0.0))
