"""The fused pipeline's first and second grouped GEMMs in FP8, blockwise scaled (DeepSeek-V3's recipe).

``gemm1_fp8_kernel`` and ``gemm2_fp8_kernel`` are ``triton_gemm``'s ``gemm1_kernel`` and
``gemm2_kernel`` with an FP8 mainloop: the same tile order, row-tile waits, epilogues, stores and
chunk counters (the same helpers), so that they run beside the dispatch and the combine as the
bf16 kernels do. Each reads its rows in bf16 as those do (the received rows, the activations, the
output gradients, the first layer's gradients), or, GEMM1 on rows that crossed the exchange in FP8
(``ROWS_FP8``: the forward's rows under ``"dispatch": "fp8"``, the backward's output gradients under
``"gradient_dispatch": "fp8"``), those rows as they arrive packed (``fp8_rows``), and walks K in
steps of ``fp8.BLOCK`` (128):

- it quantises the step's ``[rows, 128]`` tile of rows where it loads it, each row's 1x128 tile as
  ``fp8.quantise_tiles`` does, bit for bit (``triton_fp8_quantise._quantise_tile``): activations
  to e4m3, the backward's gradients to the recipe's ``gradient_format``. Nothing quantised is
  stored;
- it takes the expert's weight tile in e4m3 through a TMA descriptor, from the layer's quantised
  copies (``kernels/fp8_weights.py``), each stored ``[N, K]``: Hopper's FP8 tensor cores take both
  operands K-major;
- it adds the step's fp32 product, times each row's scale and each column's weight-block scale, to
  the fp32 accumulator (DeepSeek-V3's promotion: the tensor cores accumulate FP8 products in fewer
  bits than fp32, so each 128-deep partial product is promoted at once).

The sum over K differs from ``pipelines/fp8_emulation.py``'s one fp32 GEMM of the dequantised
operands only in the order and precision of its additions (docs/design.md, "FP8 GEMMs"). K and N
must be multiples of 128 (``TritonFp8Gemm``'s needs).
"""

import triton
import triton.language as tl

from .triton_fp8_quantise import FP8_BLOCK, _quantise_tile
from .triton_gemm import (
    _chunk_major_tile,
    _count_finished_rows,
    _gemm1_activations,
    _gemm1_row_tile,
    _gemm1_store_products,
    _gemm2_store,
    _weight_tile,
    _weight_tiles,
)


@triton.jit
def _fp8_dot_rows(
    acc,
    acc2,
    a,
    a_scales,
    lda,
    offs_m,
    m_mask,
    w,
    w2,
    w_scales,
    w2_scales,
    offs_n,
    n_mask,
    n0,
    K,
    E5M2: tl.constexpr,
    SECOND: tl.constexpr,
    ROWS_FP8: tl.constexpr,
):
    """acc + A[offs_m, :K] @ W[offs_n, :K]^T in FP8 (the module's docstring), W a descriptor from
    ``_weight_tiles`` of an e4m3 ``[N, K]`` matrix and ``w_scales`` its ``[N / 128, K / 128]`` fp32
    block scales; the rows A (row stride ``lda``) are quantised here, to e5m2 with E5M2, else e4m3.

    ROWS_FP8: A holds the rows' e4m3 values already, and ``a_scales`` (row stride ``lda // 4``) their
    tiles' fp32 scales: packed FP8 rows as the dispatch delivers them (``fp8_rows``), taken as they
    are. Else ``a_scales`` is not read.

    With SECOND, acc2 also gets the same rows times W2 (descriptor w2, scales w2_scales): both
    products of a gated expert's first layer share each quantised tile of A.
    """
    offs_k = tl.arange(0, FP8_BLOCK)
    a_ptrs = a + offs_m[:, None] * lda + offs_k[None, :]
    scale_columns = K // FP8_BLOCK
    scale_rows = (offs_n // FP8_BLOCK) * scale_columns
    for k in range(0, scale_columns):
        if ROWS_FP8:
            xq = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            x_scale = tl.load(a_scales + offs_m * (lda // 4) + k, mask=m_mask, other=1.0)
        else:
            xq, x_scale = _quantise_tile(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), E5M2)
        w_scale = tl.load(w_scales + scale_rows + k, mask=n_mask, other=1.0)
        partial = tl.dot(xq, _weight_tile(w, k * FP8_BLOCK, n0, True))
        acc += partial * (x_scale[:, None] * w_scale[None, :])
        if SECOND:
            w2_scale = tl.load(w2_scales + scale_rows + k, mask=n_mask, other=1.0)
            partial2 = tl.dot(xq, _weight_tile(w2, k * FP8_BLOCK, n0, True))
            acc2 += partial2 * (x_scale[:, None] * w2_scale[None, :])
        a_ptrs += FP8_BLOCK
    return acc, acc2


@triton.jit
def _fp8_weights(table, scale_table, expert, K, N, BN: tl.constexpr):
    """(TMA descriptor of ``expert``'s e4m3 ``[N, K]`` weight, of [BN, 128] tiles; pointer to its fp32
    ``[N / 128, K / 128]`` block scales), from the quantised weights' pointer tables."""
    w = _weight_tiles(table, expert, tl.float8e4nv, K, N, FP8_BLOCK, BN, True)
    scales = tl.load(scale_table + expert).to(tl.pointer_type(tl.float32))
    return w, scales


# Not specialised: a rank of 1 would otherwise become a constant, and each rank its own compile.
@triton.jit(do_not_specialize=["error_addr", "timeout_ns", "rank"])
def gemm1_fp8_kernel(
    rows,
    row_scales,
    lda,
    out,
    pre,
    w_table,
    w3_table,
    w_scale_table,
    w3_scale_table,
    b1_table,
    b3_table,
    layout,
    tile_counters,
    error_addr,
    timeout_ns,
    rank,
    K,
    N,
    num_local,
    off_expert_start,
    off_tile_start,
    off_local_tiles,
    off_remote_tiles,
    off_total_tiles,
    L_POW2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BACKWARD: tl.constexpr,
    ACTIVATE: tl.constexpr,
    STORE_PRE: tl.constexpr,
    WAIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    E5M2: tl.constexpr,
    ROWS_FP8: tl.constexpr,
):
    """``gemm1_kernel`` in FP8: the same tiles, waits and outputs from the same bf16 ``rows`` ([R, K],
    row stride ``lda``), the products as the module's docstring says, BK 128. The weights are quantised
    copies, [N, K] with block scales: forward W1 (and W3) [F, H]; backward W2^T [F, H]
    (``Fp8WeightCache``'s "w2t"), read K-major. E5M2: the rows (the backward's output gradients) go
    to e5m2, else e4m3.

    ROWS_FP8 (the forward under ``"dispatch": "fp8"``, the backward under ``"gradient_dispatch": "fp8"``):
    ``rows`` are the received rows' FP8 values (the backward's in the gradient format) and ``row_scales``
    their tiles' fp32 scales (``fp8_rows.packed_parts``), taken as they are, with no quantisation here;
    forward, the outputs are the same, bit for bit, as from the bf16 rows they quantise; backward, the
    dispatch has folded each route's gate into its row's scales, so that g is the gate times the product
    of the quantised gradient. Else ``row_scales`` is not read."""
    tl.static_assert(not (BACKWARD and (STORE_PRE or ACTIVATE)), "gemm1_fp8_kernel: the backward stores g alone")
    tl.static_assert(ACTIVATE or not STORE_PRE, "gemm1_fp8_kernel: without ACTIVATE, out holds the products")
    tl.static_assert(ACTIVATE or BACKWARD or not GATED, "gemm1_fp8_kernel: a gated forward activates in its epilogue")
    dtype = out.dtype.element_ty  # the rows' (bf16) where they are not in FP8
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    local_prefix = tl.load(layout + off_local_tiles + lanes, mask=lanes <= num_local, other=1 << 30)
    remote_prefix = tl.load(layout + off_remote_tiles + lanes, mask=lanes <= num_local, other=1 << 30)
    local_total = tl.load(layout + off_local_tiles + num_local)
    two_products: tl.constexpr = GATED and not BACKWARD
    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        expert, tile_row, row_end, pid_n = _gemm1_row_tile(
            tile, total_m, n_tiles, local_prefix, remote_prefix, local_total, layout, tile_counters, error_addr,
            timeout_ns, rank, off_expert_start, off_tile_start, off_local_tiles, off_remote_tiles, off_total_tiles,
            BM, GROUP_M, WAIT, INTERPRET,
        )  # fmt: skip
        offs_m = tile_row + tl.arange(0, BM)
        m_mask = offs_m < row_end
        offs_n = pid_n * BN + tl.arange(0, BN)
        w, w_scales = _fp8_weights(w_table, w_scale_table, expert, K, N, BN)
        w3, w3_scales = w, w_scales
        if two_products:
            w3, w3_scales = _fp8_weights(w3_table, w3_scale_table, expert, K, N, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc, acc3 = _fp8_dot_rows(
            acc, acc, rows, row_scales, lda, offs_m, m_mask, w, w3, w_scales, w3_scales, offs_n, offs_n < N,
            pid_n * BN, K, E5M2, two_products, ROWS_FP8,
        )  # fmt: skip
        if ACTIVATE:
            _gemm1_activations(
                acc, acc3, out, pre, b1_table, b3_table, expert, offs_m, m_mask, pid_n, N, dtype, BM, BN,
                HAS_BIAS, GATED, ACTIVATION, STORE_PRE,
            )  # fmt: skip
        else:
            _gemm1_store_products(
                acc, out, b1_table, expert, offs_m, m_mask, pid_n, N, dtype, BN, HAS_BIAS and not BACKWARD
            )


@triton.jit
def gemm2_fp8_kernel(
    rows,
    lda,
    w_table,
    w3_table,
    w_scale_table,
    w3_scale_table,
    b2_table,
    origin,
    out,
    chunk_counter_table,
    layout,
    K,
    N,
    num_local,
    off_expert_start,
    off_tile_start,
    off_total_tiles,
    EP_SIZE: tl.constexpr,
    L_POW2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SUB_M: tl.constexpr,
    GROUP_M: tl.constexpr,
    CHUNK_TILES: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SECOND: tl.constexpr,
    E5M2: tl.constexpr,
):
    """``gemm2_kernel`` in FP8: out = rows[:, :K] @ W^T + b2 (+ rows[:, K:2K] @ W3^T with SECOND), row for
    row ([R, N]), in the same tiles, column chunks, stores and counts, with the products of the module's
    docstring. W is a quantised copy, [N, K] with its block scales: forward W2 [H, F]; backward W1^T
    (and W3^T) [H, F] (``Fp8WeightCache``'s "w1t", "w3t"). E5M2: the rows (the backward's first-layer
    gradients) are quantised to e5m2, else e4m3.

    A [BM, BN] tile runs as BM / SUB_M parts of SUB_M rows, each with its own accumulator beside its
    128-deep product (two [128, 256] fp32 tiles would take every register); each part is stored as it
    is done, and the tile's rows are counted once all of them are.
    """
    dtype = rows.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    tile_prefix = tl.load(layout + off_tile_start + lanes, mask=lanes <= num_local, other=1 << 30)

    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        chunk, expert, row0, row_end, n0 = _chunk_major_tile(
            tile, total_m, n_tiles, tile_prefix, layout, off_expert_start, off_tile_start, BM, BN, GROUP_M, CHUNK_TILES
        )
        offs_n = n0 + tl.arange(0, BN)
        n_mask = offs_n < N
        w, w_scales = _fp8_weights(w_table, w_scale_table, expert, K, N, BN)
        w3, w3_scales = w, w_scales
        if SECOND:
            w3, w3_scales = _fp8_weights(w3_table, w3_scale_table, expert, K, N, BN)
        for part in tl.static_range(BM // SUB_M):
            offs_m = row0 + part * SUB_M + tl.arange(0, SUB_M)
            m_mask = offs_m < row_end
            acc = tl.zeros((SUB_M, BN), dtype=tl.float32)
            acc, _ = _fp8_dot_rows(
                acc, acc, rows, rows, lda, offs_m, m_mask, w, w, w_scales, w_scales, offs_n, n_mask, n0, K, E5M2,
                False, False,
            )  # fmt: skip
            if SECOND:
                acc, _ = _fp8_dot_rows(
                    acc, acc, rows + K, rows, lda, offs_m, m_mask, w3, w3, w3_scales, w3_scales, offs_n, n_mask, n0,
                    K, E5M2, False, False,
                )  # fmt: skip
            _gemm2_store(acc, out, b2_table, expert, offs_m, m_mask, offs_n, n_mask, N, dtype, HAS_BIAS)
        offs_m = row0 + tl.arange(0, BM)
        _count_finished_rows(origin, offs_m, offs_m < row_end, chunk_counter_table, chunk, EP_SIZE)
