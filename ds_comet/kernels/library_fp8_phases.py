"""The "library_fp8" GEMM implementation: the rowwise recipe's GEMMs on ``torch._scaled_grouped_mm``.

On sm_90 torch builds ``torch._scaled_grouped_mm`` from CUTLASS's Hopper grouped GEMM for e4m3
operands with rowwise fp32 scales: the rows ``a`` ([M, K], row-major) with one scale per row, each
group's weight ``b`` ([G, K, N], column-major: each group's ``[N, K]`` matrix as stored, transposed)
with one scale per output channel, grouped by ``offs`` (the groups' row ends, int32); bf16 out.
That is the recipe's ``"scaling": "rowwise"`` (``fp8.quantise_rows``: power-of-two scales), so the
emulation's dequantised operands are the library's, bit for bit (``rowwise_operands``).

Like the bf16 library (``library_phases.LibraryGemm``) it has no tile that waits for a dispatch, so
it runs the four GEMM phases around the exchange only alone in the group, for stacked gated experts,
where the recipe puts them in FP8:

- the forward's first layer, ``rows @ W1^T`` and ``rows @ W3^T``, then the elementwise step;
- the forward's GEMM2, ``h @ W2^T``;
- the backward's first layer, ``dY @ W2`` (W2^T's copy, quantised per row of W2^T: W2's columns,
  as ``fp8.quantise_columns`` does), then the elementwise step;
- the backward's GEMM2, ``[dA, dA_up] @ [W1; W3]``, one GEMM over K = 2F as the emulation's.

With ``"weight_gradients"`` it runs the weight gradients too, ``dA_l^T x_l`` (any experts, any group: nothing
waits in that phase), a 2-D by 2-D product that reduces over each expert's rows (``offs``: the
groups' K ends): both operands quantised per column over those rows and written transposed
(``quantised_expert_columns``), each expert's rows padded with zeros to whole 16s (the library reads
each group's K from a 16-byte-aligned start) and to at least 16: on CUDA nothing zeroes the output of a
group with no K (torch does only on ROCm), where 16 rows of zeros make it zeros.

A GEMM2 here counts no rows as it finishes them: after it, on the same stream, one small kernel
(``triton_gemm.count_received_rows_kernel``) adds every received row to the combine's chunk
counters at once, and the combine, queued after it, finds them complete.

The rows are quantised by ``quantised_rows`` (one Triton pass over each row, ``fp8.quantise_rows``
bit for bit) before each GEMM; the weights come from the layer's ``Fp8WeightCache`` (rowwise
copies, once per weight version).
"""

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import fp8
from .constants import TOTAL_RECV_ROWS
from .gemm_phases import GemmFacts, Needs, Phase
from .library_phases import LibraryGemm

if TYPE_CHECKING:
    from .launch import FusedKernels

# torch._scaled_grouped_mm reads K and N in 16-byte units (TMA): a multiple of 16 e4m3 values each.
ALIGNMENT = 16
# False: CUTLASS's FP8 mainloop promotes the tensor cores' partial sums into fp32 along K, as the
# Triton FP8 kernel does every 128, so both meet one bound against the emulation (docs/design.md,
# "FP8 GEMMs"). With True the tensor cores accumulate all of K in their own fewer bits.
USE_FAST_ACCUM = False
# quantise_rowwise_kernel's columns per pass over a row: 8 for each thread of its 4 warps.
QUANTISE_COLUMNS = 1024
# The expert-column kernels' tile (maxima and values): rows a step, columns a program.
EXPERT_COLUMNS_TILE = (64, 128)
# Rows of an average expert a program of the weight gradients' quantisation takes (expert_column_parts).
EXPERT_COLUMNS_RUN = 256
NEEDS = Needs(
    dtypes=((torch.bfloat16, torch.bfloat16),),
    capabilities=((9, 0),),
    torch_functions=("_scaled_grouped_mm",),
    alone=True,
    gated=True,
    stacked=True,
    fp8_scalings=("rowwise",),
)
# The weight gradients wait for nothing and take each expert's gradient apart: any group, any experts.
WEIGHT_GRADIENT_NEEDS = replace(NEEDS, alone=False, gated=False, stacked=False)


def quantised_rows(x: Tensor, fmt: fp8.Fp8Format = fp8.E4M3) -> fp8.Quantised:
    """``fp8.quantise_rows(x, fmt)`` bit for bit: values ``[M, K]`` of the format, scales ``[M, 1]`` fp32;
    by ``quantised_rows_by_triton`` where ``x`` ([M, K]) is bf16 on a GPU with unit column stride,
    else by ``fp8.py`` itself."""
    if x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1:
        return quantised_rows_by_triton(x, fmt)
    return fp8.quantise_rows(x, fmt)


def quantised_rows_by_triton(x: Tensor, fmt: fp8.Fp8Format = fp8.E4M3) -> fp8.Quantised:
    """``fp8.quantise_rows(x, fmt)`` of bf16 ``x`` ([M, K], unit column stride) by one Triton program a
    row (``triton_fp8_quantise.quantise_rowwise_kernel``): two reads of the row and one write of its
    values, where ``fp8.py``'s torch operations make several passes in fp32."""
    from .triton_fp8_quantise import quantise_rowwise_kernel  # triton is an extra

    rows, columns = x.shape
    values = torch.empty((rows, columns), dtype=fmt.dtype, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        quantise_rowwise_kernel[(rows,)](
            x, x.stride(0), values, scales, columns, E5M2=fmt is fp8.E5M2, BK=QUANTISE_COLUMNS, num_warps=4
        )
    return fp8.Quantised(values, scales, (1, max(columns, 1)))


def padded_expert_ends(layout: Tensor, expert_start: int, num_local: int) -> Tensor:
    """[L] int32 on ``layout``'s device: where each local expert's rows end once every expert's rows
    (the layout's words from ``expert_start``: L + 1 row offsets) are padded to whole ``ALIGNMENT``s,
    and at least one (the module's docstring: an expert without rows gets ``ALIGNMENT`` rows of zeros)."""
    words = layout[expert_start : expert_start + num_local + 1]
    counts = words[1:] - words[:-1]
    padded = ((counts + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT).clamp_(min=ALIGNMENT)
    return torch.cumsum(padded, 0, dtype=torch.int32)


def quantised_expert_columns(
    x: Tensor, layout: Tensor, expert_start: int, padded_ends: Tensor, fmt: fp8.Fp8Format = fp8.E4M3
) -> tuple[Tensor, Tensor]:
    """``fp8.quantise_columns`` of each local expert's rows of ``x``, transposed, as
    ``torch._scaled_grouped_mm`` takes a 2-D operand that it reduces over rows grouped by expert.

    Args:
        x: [R, K] rows grouped by local expert, any float dtype; bf16 on a GPU with unit column
            stride goes to ``quantised_expert_columns_by_triton``, anything else to ``fp8.py`` (a loop
            over the experts on the host).
        layout, expert_start: the experts' row offsets, ``layout[expert_start:][: L + 1]`` (int32).
        padded_ends: ``padded_expert_ends`` of them ([L] int32).
        fmt: the values' format.

    Returns:
        (values [K, P] of ``fmt``, P a multiple of ``ALIGNMENT``: expert l's rows at columns
        ``padded_ends[l - 1]`` (0 for the first) up to ``padded_ends[l]``, zeros past its own rows;
        scales [L, K] fp32, 1 for an expert without rows).
    """
    if x.is_cuda and x.dtype == torch.bfloat16 and x.stride(1) == 1:
        return quantised_expert_columns_by_triton(x, layout, expert_start, padded_ends, fmt)
    values_t, scales = _expert_columns_out(x, padded_ends, fmt)
    values_t.zero_()  # the padding
    starts = layout[expert_start : expert_start + padded_ends.shape[0] + 1].tolist()
    padded_starts = [0] + padded_ends.tolist()
    for expert in range(padded_ends.shape[0]):
        quantised = fp8.quantise_columns(x[starts[expert] : starts[expert + 1]], fmt)
        scales[expert] = quantised.scales[0] if quantised.values.shape[0] else 1.0  # no rows: a block of zeros
        first = padded_starts[expert]
        values_t[:, first : first + quantised.values.shape[0]] = quantised.values.t()
    return values_t, scales


def quantised_expert_columns_by_triton(
    x: Tensor,
    layout: Tensor,
    expert_start: int,
    padded_ends: Tensor,
    fmt: fp8.Fp8Format = fp8.E4M3,
    parts: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``quantised_expert_columns`` of bf16 ``x`` (unit column stride) by two Triton kernels: each
    column's largest magnitude over each expert's rows (``triton_fp8_quantise.expert_column_maxima_kernel``),
    then the values, written transposed (``quantise_expert_columns_kernel``); each reads the rows once,
    and no host sync (the experts' rows are read from the layout on the device).

    ``parts``: runs each expert's rows are split into, a program a run and ``EXPERT_COLUMNS_TILE[1]``
    columns (None: ``expert_column_parts``)."""
    from .triton_fp8_quantise import expert_column_maxima_kernel, quantise_expert_columns_kernel  # triton is an extra

    values_t, scales = _expert_columns_out(x, padded_ends, fmt)  # the kernel writes the padding's zeros
    num_local, columns = scales.shape
    block_r, block_c = EXPERT_COLUMNS_TILE
    if num_local and columns:
        parts = expert_column_parts(x.shape[0], num_local) if parts is None else parts
        grid = (-(-columns // block_c), num_local, parts)
        maxima = torch.zeros((num_local, columns), dtype=torch.int32, device=x.device)
        expert_column_maxima_kernel[grid](
            x, x.stride(0), maxima, layout, expert_start, columns, parts, BR=block_r, BC=block_c, num_warps=4
        )
        quantise_expert_columns_kernel[grid](
            x, x.stride(0), values_t, values_t.shape[1], scales, maxima, layout, expert_start, padded_ends, columns,
            parts, E5M2=fmt is fp8.E5M2, BR=block_r, BC=block_c, num_warps=4,
        )  # fmt: skip
    return values_t, scales


def expert_column_parts(rows: int, num_local: int) -> int:
    """Runs of rows a program each for ``quantised_expert_columns_by_triton``: about
    ``EXPERT_COLUMNS_RUN`` rows of an expert of average size a run (at least one run an expert), so
    that a hot expert's rows are not all one program's (docs/decisions.md)."""
    return max(1, -(-rows // (num_local * EXPERT_COLUMNS_RUN)))


def _expert_columns_out(x: Tensor, padded_ends: Tensor, fmt: fp8.Fp8Format) -> tuple[Tensor, Tensor]:
    """``quantised_expert_columns``'s outputs, not set: room for every row of ``x`` and ``ALIGNMENT`` more
    an expert, more than the padding adds."""
    rows, columns = x.shape
    num_local = padded_ends.shape[0]
    width = -(-(rows + ALIGNMENT * num_local) // ALIGNMENT) * ALIGNMENT
    values_t = torch.empty((columns, width), dtype=fmt.dtype, device=x.device)
    return values_t, torch.empty((num_local, columns), dtype=torch.float32, device=x.device)


def rowwise_operands(rows: fp8.Quantised, weights: fp8.Quantised) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``torch._scaled_grouped_mm``'s operands for ``rows @ weights[g]^T`` over groups of rows.

    Args:
        rows: ``fp8.quantise_rows`` of [M, K] rows: values [M, K] e4m3, scales [M, 1] fp32.
        weights: each group's [N, K] matrix quantised per row (``Fp8WeightCache.quantised`` under
            rowwise scaling): values [G, N, K] e4m3, scales [G, N, 1] fp32.

    Returns:
        (rows' values [M, K] row-major, the weights' values [G, K, N] column-major (a view), rows'
        scales [M], the weights' scales [G, N]); values times scales are the dequantised operands.
    """
    groups, n = weights.scales.shape[:2]
    return rows.values, weights.values.transpose(-2, -1), rows.scales.view(-1), weights.scales.view(groups, n)


def rowwise_grouped_mm(
    rows: fp8.Quantised, weights: fp8.Quantised, offsets: Tensor, use_fast_accum: bool = USE_FAST_ACCUM
) -> Tensor:
    """Per group g, ``rows[group g] @ weights[g]^T`` in FP8 with rowwise e4m3 scaling.

    Args:
        rows, weights: as ``rowwise_operands`` takes them (``fp8.quantise_rows`` of [M, K] grouped
            rows; [G, N, K] e4m3 with scales [G, N, 1]).
        offsets: [G] int32, where each group's rows end; rows past the last end are not computed.
        use_fast_accum: ``torch._scaled_grouped_mm``'s (``USE_FAST_ACCUM``).

    Returns:
        [M, N] bf16.
    """
    values, b, scales, b_scales = rowwise_operands(rows, weights)
    return torch._scaled_grouped_mm(
        values, b, scales, b_scales, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum
    )


class LibraryFp8Gemm(LibraryGemm):
    """``torch._scaled_grouped_mm`` on sm_90 for the rowwise recipe's four FP8 phases around the exchange
    (alone in the group, stacked gated experts, bf16 rows crossing the exchange) and its FP8 weight
    gradients (any group, any experts); e4m3 gradients, hidden and FFN sizes that are multiples of 16;
    the module's docstring."""

    name = "library_fp8"
    needs = {
        **{
            phase: NEEDS for phase in (Phase.FIRST_LAYER, Phase.GEMM2, Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD)
        },
        Phase.WEIGHT_GRADIENTS: WEIGHT_GRADIENT_NEEDS,
    }

    def refusal(self, phase: Phase, facts: GemmFacts) -> str | None:
        """``GemmImplementation.refusal``, and what the library's operands need beyond ``Needs``."""
        reason = super().refusal(phase, facts)
        if reason is not None:
            return reason
        recipe = facts.fp8
        if recipe.hidden % ALIGNMENT or recipe.ffn % ALIGNMENT:
            return (
                f"needs hidden and FFN sizes that are multiples of {ALIGNMENT} (torch._scaled_grouped_mm's), "
                f"not {recipe.hidden} and {recipe.ffn}"
            )
        if phase == Phase.FIRST_LAYER and recipe.rows_in_fp8:
            return 'takes the rows in bf16, not packed in FP8 (set "dispatch": "bf16")'
        if phase == Phase.FIRST_LAYER_BACKWARD and recipe.gradients_in_fp8:
            return 'takes the output gradients in bf16, not packed in FP8 (set "gradient_dispatch": "bf16")'
        backward = phase in (Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD, Phase.WEIGHT_GRADIENTS)
        if backward and recipe.gradient_format != "e4m3":
            return f"takes e4m3 gradients (torch._scaled_grouped_mm), not {recipe.gradient_format}"
        return None

    @torch.no_grad()
    def gemm2(self, call: "FusedKernels", rows: Tensor, out: Tensor):
        """``h @ W2^T`` (W2's rowwise copy, per output channel) into ``out``, then every row counted. Rows
        past the last expert's end are copied as the library left them (not computed); the combine
        reads only received rows."""
        out.copy_(rowwise_grouped_mm(quantised_rows(rows), call.fp8_weights.quantised("w2"), call.expert_ends))
        count_received_rows(call)

    @torch.no_grad()
    def gemm2_backward(self, call: "FusedKernels", rows: Tensor, out: Tensor):
        """``rows @ [W1; W3]`` (``[dA, dA_up]``, [R, 2F]; [W1; W3]^T's rowwise copy "w13t") into ``out``,
        then every row counted."""
        out.copy_(rowwise_grouped_mm(quantised_rows(rows), call.fp8_weights.quantised("w13t"), call.expert_ends))
        count_received_rows(call)

    @torch.no_grad()
    def weight_gradients(self, call: "FusedKernels", a: Tensor, b: Tensor) -> Tensor:
        """``GemmImplementation.weight_gradients`` in FP8: per local expert l, ``a[rows of l]^T @ b[rows of
        l]`` ([L, M, N] bf16) from both quantised per column over l's rows in e4m3 (``a`` the
        gradients, ``b`` the activations), one 2-D by 2-D ``torch._scaled_grouped_mm``."""
        rows = min(a.shape[0], b.shape[0])  # rows past the last expert's end are not read
        start = call.buffer.layout_offsets.expert_start
        ends = padded_expert_ends(call.buffer.layout, start, call.num_local)
        a_t, a_scales = quantised_expert_columns(a[:rows], call.buffer.layout, start, ends)
        b_t, b_scales = quantised_expert_columns(b[:rows], call.buffer.layout, start, ends)
        return torch._scaled_grouped_mm(
            a_t,
            b_t.t(),
            a_scales.view(-1),
            b_scales.view(-1),
            offs=ends,
            out_dtype=torch.bfloat16,
            use_fast_accum=USE_FAST_ACCUM,
        )

    @torch.no_grad()  # the fused autograd function differentiates the layer, not autograd's graph of it
    def products(self, call: "FusedKernels", rows: Tensor, *names: str) -> tuple[Tensor, ...]:
        """``LibraryGemm.products`` in FP8: per local expert, over its rows, ``rows @ W^T`` for ``w1`` and
        ``w3`` ([R, F]), ``rows @ W2`` for ``w2`` (W2^T's rowwise copy, "w2t"), bf16; the rows are
        quantised once for all of them."""
        copies = {"w1": "w1", "w3": "w3", "w2": "w2t"}
        quantised = quantised_rows(rows)
        return tuple(
            rowwise_grouped_mm(quantised, call.fp8_weights.quantised(copies[name]), call.expert_ends) for name in names
        )


def count_received_rows(call: "FusedKernels") -> None:
    """Every received row counted finished in each column chunk, for the combine queued after a GEMM2
    that counted none (the module's docstring)."""
    from .triton_gemm import count_received_rows_kernel  # triton is an extra

    buffer, tile_n = call.buffer, call.params.tile_n
    chunk_tiles, num_chunks = call.chunking
    count_received_rows_kernel[(num_chunks,)](
        buffer.gemm2_counters,
        buffer.layout,
        buffer.layout_offsets.totals + TOTAL_RECV_ROWS,
        call.hidden,
        CHUNK_COLS=chunk_tiles * tile_n,
        BN=tile_n,
    )
