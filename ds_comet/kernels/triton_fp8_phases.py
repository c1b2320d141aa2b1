"""The "triton_fp8" GEMM implementation: the four phases an FP8 recipe puts in FP8, on sm_90.

It runs the phases as the "triton" implementation does (``triton_phases.TritonGemm``: the same
outputs, the same elementwise steps after GEMM1) on the FP8 kernels of ``triton_fp8_gemm``, which
read the layer's quantised weights (``FusedKernels.fp8_tables``, from ``fp8_weights.Fp8WeightCache``)
and quantise the bf16 rows where they load them; under ``"dispatch": "fp8"`` the forward's GEMM1
takes the received rows already quantised (``fp8_rows``), and under ``"gradient_dispatch": "fp8"``
the backward's GEMM1 the received output gradients. It admits a phase only where the call's recipe
puts it in FP8 with blockwise scaling (``GemmFacts.fp8``), on sm_90, for bf16 rows and weights with
hidden and FFN sizes that are multiples of 128; the weight gradients stay with the others.
"""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import fp8
from .constants import TOTAL_TILES
from .fp8_rows import PACKED_DTYPE, packed_parts
from .gemm_phases import Needs, Phase
from .triton_phases import GROUP_M, TritonGemm, _interpreting, next_power_of_2, with_descriptor_scratch

if TYPE_CHECKING:
    from .launch import FusedKernels

FP8_NEEDS = Needs(dtypes=((torch.bfloat16, torch.bfloat16),), capabilities=((9, 0),), fp8_scalings=("blockwise",))
# GEMM1's column tiles: its tile order does not depend on them (the dispatch's waits are per row
# tile). Each accumulator takes a second one for the 128-deep FP8 product beside it, so a gated
# forward, with two of each, takes 64 columns, where one 128-column accumulator pair fills 128
# registers a thread at 8 warps.
GEMM1_TILE_N = 128
GATED_GEMM1_TILE_N = 64
# GEMM2's tile is the call's (its columns are the combine's chunks); it runs in row parts of at most
# this many fp32 elements, for the same reason.
ACCUMULATOR_ELEMENTS = 128 * 128


class TritonFp8Gemm(TritonGemm):
    """``TritonGemm``'s first layer and GEMM2, both ways, on the FP8 kernels (the module's docstring)."""

    name = "triton_fp8"
    needs = {
        phase: FP8_NEEDS for phase in (Phase.FIRST_LAYER, Phase.GEMM2, Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD)
    }

    def gemm1(
        self,
        call: "FusedKernels",
        rows: Tensor,
        out: Tensor,
        backward: bool,
        pre: Tensor | None = None,
        activate: bool = True,
    ):
        """``TritonGemm.gemm1``'s outputs from ``gemm1_fp8_kernel``: forward on W1 (and W3), backward on
        W2^T ("w2t"), the rows quantised to e4m3 forward and to the recipe's gradient format backward.
        ``rows`` may be packed FP8 rows ([R, ``fp8_rows.packed_row_bytes(H)``] uint8), which the kernel
        takes as they are: forward as ``"dispatch": "fp8"`` delivers them (e4m3), backward as
        ``"gradient_dispatch": "fp8"`` does (the gradient format, each route's gate in its scales)."""
        from .triton_fp8_gemm import gemm1_fp8_kernel
        from .triton_gemm import ACTIVATION_CODES

        rows_fp8 = rows.dtype == PACKED_DTYPE
        e5m2 = backward and call.fp8.gradient_format == "e5m2"
        if rows_fp8:
            rows, row_scales = packed_parts(rows, call.hidden, fp8.E5M2 if e5m2 else fp8.E4M3)
            lda = rows.stride(0)
        else:
            row_scales, lda = rows, call.hidden

        b, lo, t, q = call.buffer, call.buffer.layout_offsets, call.tables, call.fp8_tables
        activate = activate and not backward
        epilogue = (
            dict(HAS_BIAS=False, GATED=False, ACTIVATION=0)
            if backward
            else dict(
                HAS_BIAS=call.has_bias,
                GATED=call.gated,
                ACTIVATION=ACTIVATION_CODES[call.activation] if activate else 0,
            )
        )
        weight, second = ("w2t", "w2t") if backward else ("w1", "w3" if call.gated else "w1")
        with_descriptor_scratch(
            lambda: gemm1_fp8_kernel[(call.grid,)](
                rows,
                row_scales,
                lda,
                out,
                out if pre is None else pre,
                q[weight],
                q[second],
                q[weight + "_scales"],
                q[second + "_scales"],
                t["b1"],
                t["b3"],
                b.layout,
                b.tile_counters,
                b.error_address,
                b.kernel_shape.timeout_ns,
                b.rank,
                call.hidden,
                call.ffn,
                call.num_local,
                lo.expert_start,
                lo.tile_start,
                lo.local_tiles,
                lo.remote_tiles,
                lo.totals + TOTAL_TILES,
                L_POW2=next_power_of_2(call.num_local + 1),
                BM=call.params.tile_m,
                BN=GATED_GEMM1_TILE_N if call.gated and not backward else GEMM1_TILE_N,
                GROUP_M=GROUP_M,
                NUM_PROGS=call.grid,
                BACKWARD=backward,
                ACTIVATE=activate,
                STORE_PRE=pre is not None,
                WAIT=True,
                INTERPRET=_interpreting(),
                E5M2=e5m2,
                ROWS_FP8=rows_fp8,
                num_warps=8,
                num_stages=3,
                **epilogue,
            )
        )

    def launch_gemm2(self, call: "FusedKernels", rows: Tensor, out: Tensor, backward: bool):
        """``TritonGemm.launch_gemm2``'s outputs from ``gemm2_fp8_kernel``: forward on W2, backward on
        W1^T and W3^T ("w1t", "w3t"), the rows quantised as in ``gemm1``."""
        from .triton_fp8_gemm import gemm2_fp8_kernel

        b, lo, t, q, params = call.buffer, call.buffer.layout_offsets, call.tables, call.fp8_tables, call.params
        chunk_tiles, _ = call.chunking
        if backward:  # rows = dA ([R, F] or [R, 2F]) @ W1 (+ up part @ W3), read as W1^T [H, F]
            weight, second, lda = "w1t", "w3t" if call.gated else "w1t", rows.shape[1]
        else:  # rows = h @ W2^T; W2 is [H, F]
            weight, second, lda = "w2", "w2", call.ffn
        with_descriptor_scratch(
            lambda: gemm2_fp8_kernel[(call.gemm2_grid,)](
                rows,
                lda,
                q[weight],
                q[second],
                q[weight + "_scales"],
                q[second + "_scales"],
                t["b2"],
                b.origin,
                out,
                b.gemm2_counters,
                b.layout,
                call.ffn,
                call.hidden,
                call.num_local,
                lo.expert_start,
                lo.tile_start,
                lo.totals + TOTAL_TILES,
                EP_SIZE=b.shape.ep_size,
                L_POW2=next_power_of_2(call.num_local + 1),
                BM=params.tile_m,
                BN=params.tile_n,
                SUB_M=min(params.tile_m, ACCUMULATOR_ELEMENTS // params.tile_n),
                GROUP_M=GROUP_M,
                CHUNK_TILES=chunk_tiles,
                NUM_PROGS=call.gemm2_grid,
                HAS_BIAS=call.has_bias and not backward,
                SECOND=backward and call.gated,
                E5M2=backward and call.fp8.gradient_format == "e5m2",
                num_warps=8,
                num_stages=3,
            )
        )
