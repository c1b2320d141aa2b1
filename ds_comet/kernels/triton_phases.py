"""The "triton" GEMM implementation: every phase on this package's Triton kernels.

GEMM1 (``triton_gemm.gemm1_kernel``) waits per row tile for the dispatch, so it runs beside the
dispatch with peers in the group; GEMM2 (``gemm2_kernel``) counts its finished rows chunk by
chunk for the combine; the weight gradients are ``wgrad_kernel``. Where GEMM1 stores plain
products, the call's elementwise steps (``FusedKernels.activations`` and
``activations_backward``, on ``triton_activation``'s kernels) compute the rest. Triton is an
extra: it is imported where a phase launches.
"""

import contextvars
import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .constants import TOTAL_TILES
from .gemm_phases import GemmFacts, GemmImplementation, Needs, Phase, Products

if TYPE_CHECKING:
    from .launch import FusedKernels

TILE_K = 64
GROUP_M = 8
# Rows and weights of one dtype, which the kernels read both as (rows.dtype): the fused path's.
SAME_DTYPE = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16))


class TritonGemm(GemmImplementation):
    """Every phase, on any GPU the fused pipeline runs on, for bf16 or fp16 rows and weights."""

    name = "triton"
    needs = {phase: Needs(dtypes=SAME_DTYPE) for phase in Phase}

    def stored_dtype(self, phase: Phase, facts: GemmFacts) -> torch.dtype:
        return facts.row_dtype

    def first_layer(self, call: "FusedKernels", rows: Tensor, h: Tensor, keep_pre: bool) -> Tensor | None:
        """Gated experts: GEMM1 with the activations in its epilogue; returns the products ([R, 2F],
        first then up) with ``keep_pre``. Ungated experts: GEMM1 stores the products ([R, F]), then
        the elementwise step activates them."""
        if call.gated:
            # Split like the ungated experts', the two products would cross memory twice more: the
            # training phase was mixed (0.96-1.08x) and the eval forward 2-5 % slower (docs/decisions.md).
            pre = torch.empty((h.shape[0], 2 * call.ffn), dtype=h.dtype, device=h.device) if keep_pre else None
            self.gemm1(call, rows, h, backward=False, pre=pre)
            return pre
        # Both outputs from the epilogue held up the MMAs: the products alone and the activation
        # after them ran 1.03-1.11x faster (docs/decisions.md). Without grad the same two kernels
        # run, the activation in place, so a forward under no_grad (a reentrant checkpoint's first
        # pass) gives the training forward's numbers bit for bit.
        products = torch.empty((h.shape[0], call.ffn), dtype=h.dtype, device=h.device) if keep_pre else h
        self.gemm1(call, rows, products, backward=False, activate=False)
        call.activations(products, h)
        return products if keep_pre else None

    def first_layer_backward(
        self, call: "FusedKernels", rows: Tensor, grad_pre: Tensor, pre: Products, want_act: bool
    ) -> Tensor | None:
        """GEMM1 stores ``g = rows @ W2`` ([R, F]), then the elementwise step computes the rest (the
        activations over g)."""
        grad_h = torch.empty((grad_pre.shape[0], call.ffn), dtype=grad_pre.dtype, device=grad_pre.device)
        self.gemm1(call, rows, grad_h, backward=True)
        return call.activations_backward(grad_h, pre, grad_pre, want_act)

    def gemm2(self, call: "FusedKernels", rows: Tensor, out: Tensor):
        self.launch_gemm2(call, rows, out, backward=False)

    def gemm2_backward(self, call: "FusedKernels", rows: Tensor, out: Tensor):
        self.launch_gemm2(call, rows, out, backward=True)

    def weight_gradients(self, call: "FusedKernels", a: Tensor, b: Tensor) -> Tensor:
        """``wgrad_kernel``, stored in ``a``'s dtype."""
        from .triton_gemm import wgrad_kernel

        M, N = a.shape[1], b.shape[1]
        weight = torch.empty((call.num_local, M, N), dtype=a.dtype, device=a.device)
        # GEMM1's grid, not GEMM2's: beside the combine's tail either would do, but in shape 1's
        # training step dW1 took 8.4 ms on GEMM2's 128 programs against 3.3 on 123 (docs/decisions.md).
        wgrad_kernel[(call.grid,)](
            a,
            a.stride(0),
            b,
            b.stride(0),
            weight,
            call.buffer.layout,
            call.buffer.layout_offsets.expert_start,
            M,
            N,
            call.num_local,
            BM=128,
            BN=256,
            BK=64,
            GROUP_M=GROUP_M,
            NUM_PROGS=call.grid,
            num_warps=8,
            num_stages=3,
        )
        return weight

    def gemm1(
        self,
        call: "FusedKernels",
        rows: Tensor,
        out: Tensor,
        backward: bool,
        pre: Tensor | None = None,
        activate: bool = True,
    ):
        """GEMM1 on ``rows`` (``gemm1_kernel``): forward, the activations into ``out`` ([R, F]) and,
        if ``pre`` is given, the products before them into it ([R, F], gated [R, 2F]); forward
        without ``activate`` (ungated experts), the products ``rows @ W1^T + b1`` into ``out``
        ([R, F]); backward, ``rows @ W2`` into ``out`` ([R, F])."""
        from .triton_gemm import ACTIVATION_CODES, gemm1_kernel

        b, lo, t, params = call.buffer, call.buffer.layout_offsets, call.tables, call.params
        # A gated forward holds two accumulators, so its tile is at most 128 columns wide; the
        # backward holds one and takes GEMM2's width (2x faster on gated shapes, docs/decisions.md).
        tile_n = params.tile_n if backward else params.gemm1_tile_n
        # The backward reads none of the epilogue's switches, a forward without ``activate`` not the
        # activation: fixed there, every expert kind shares one compile instead of identical ones.
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
        with_descriptor_scratch(
            lambda: gemm1_kernel[(call.grid,)](
                rows,
                out,
                out if pre is None else pre,
                t["w2"] if backward else t["w1"],
                t["w3"],
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
                BM=params.tile_m,
                BN=tile_n,
                BK=TILE_K,
                GROUP_M=GROUP_M,
                NUM_PROGS=call.grid,
                BACKWARD=backward,
                ACTIVATE=activate,
                STORE_PRE=pre is not None,
                WAIT=True,
                INTERPRET=_interpreting(),
                num_warps=8,
                num_stages=3,
                **epilogue,
            )
        )

    def launch_gemm2(self, call: "FusedKernels", rows: Tensor, out: Tensor, backward: bool):
        """GEMM2 on ``rows`` (the activations [R, F], or the backward's first-layer gradients [R, F] or
        [R, 2F]) into ``out`` ([R, H], by recv row), column chunk by column chunk, each finished row
        counted for the combine (here for this rank's routes, on a reduce counter for the others')."""
        from .triton_gemm import gemm2_kernel

        b, lo, t, params = call.buffer, call.buffer.layout_offsets, call.tables, call.params
        chunk_tiles, _ = call.chunking
        if backward:  # rows = dA ([R, F] or [R, 2F]) @ W1 (+ up part @ W3); W1 is [F, H], i.e. [K, N]
            w, w3, bias, lda, second = t["w1"], t["w3"], t["b2"], rows.shape[1], call.gated
        else:  # rows = h @ W2^T; W2 is [H, F], i.e. [N, K]
            w, w3, bias, lda, second = t["w2"], t["w2"], t["b2"], call.ffn, False
        with_descriptor_scratch(
            lambda: gemm2_kernel[(call.gemm2_grid,)](
                rows,
                lda,
                w,
                w3,
                bias,
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
                BK=TILE_K,
                GROUP_M=GROUP_M,
                CHUNK_TILES=chunk_tiles,
                NUM_PROGS=call.gemm2_grid,
                HAS_BIAS=call.has_bias and not backward,
                SECOND=second,
                W_NK=not backward,
                num_warps=8 if params.tile_n >= 256 else 4,
                num_stages=3,
            )
        )


def with_descriptor_scratch(launch):
    """``launch()`` with Triton's allocator set for the GEMMs' device-side TMA descriptors.

    Triton keeps its allocator in a context variable, which autograd's backward threads do not
    inherit; setting it in a copy of the caller's context gives every launch one and leaves the
    caller's own allocator (if any) as it was.
    """
    import triton  # an extra: imported where the fused path runs

    def run():
        triton.set_allocator(_scratch)
        return launch()

    return contextvars.copy_context().run(run)


def _scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    # On the device and stream Triton launches on: the launch uses it before anything queued after
    # it can reuse it. The caching allocator's blocks are 512-byte aligned, more than TMA asks.
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
