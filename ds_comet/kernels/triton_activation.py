"""The gated activation and its gradient, elementwise, after GEMMs that store plain products.

Where ``torch._grouped_mm`` runs gated experts' first layer (``FusedKernels.library_first_layer``),
it returns ``z = x W1^T`` and ``u = x W3^T``; in every gated backward, the library or
``gemm1_kernel`` returns ``g = dY W2`` alone (``FusedKernels.first_layer_backward``). These kernels
compute the rest:

- ``gated_activation_kernel``: ``h = act(z) * u``.
- ``gated_activation_backward_kernel``: from ``g = dY W2``, ``dz = g * u * act'(z)`` and
  ``du = g * act(z)`` side by side in ``[R, 2F]`` (the layout GEMM2's backward reads), and, for W2's
  gradient, ``h`` again.

Both compute in fp32 and round once, and touch only the first ``*total`` rows (a device word: the
rows of the call, which the host does not know without a sync). ``z`` and ``u`` are read with a row
stride of their own, ``zu_stride``: separate [R, N] tensors (N), or the halves of one [R, 2N] (2N).
"""

import triton
import triton.language as tl

from .triton_gemm import _activation, _activation_grad


@triton.jit
def _block(total_ptr, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows, columns and mask over the first ``*total_ptr`` rows of an [R, N] grid."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    total = tl.load(total_ptr)
    return rows, cols, (rows < total)[:, None] & (cols < N)[None, :]


@triton.jit
def gated_activation_kernel(z, u, zu_stride, h, total_ptr, N, ACTIVATION: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr):
    """h = act(z) * u, [R, N] each, h row-major."""
    rows, cols, mask = _block(total_ptr, N, BM, BN)
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    at_zu = rows[:, None].to(tl.int64) * zu_stride + cols[None, :]
    zv = tl.load(z + at_zu, mask=mask, other=0.0).to(tl.float32)
    uv = tl.load(u + at_zu, mask=mask, other=0.0).to(tl.float32)
    tl.store(h + at, (_activation(zv, ACTIVATION) * uv).to(h.dtype.element_ty), mask=mask)


@triton.jit
def gated_activation_backward_kernel(g, z, u, zu_stride, grad_pre, h, total_ptr, N, ACTIVATION: tl.constexpr,
                                     STORE_ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """grad_pre[:, :N] = g * u * act'(z), grad_pre[:, N:] = g * act(z) ([R, 2N]); with STORE_ACT,
    h = act(z) * u as well. g and h are [R, N] row-major, z and u [R, N] of row stride zu_stride."""
    rows, cols, mask = _block(total_ptr, N, BM, BN)
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    at_zu = rows[:, None].to(tl.int64) * zu_stride + cols[None, :]
    gv = tl.load(g + at, mask=mask, other=0.0).to(tl.float32)
    zv = tl.load(z + at_zu, mask=mask, other=0.0).to(tl.float32)
    uv = tl.load(u + at_zu, mask=mask, other=0.0).to(tl.float32)
    act = _activation(zv, ACTIVATION)
    wide = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
    out_dtype = grad_pre.dtype.element_ty
    tl.store(grad_pre + wide, (gv * uv * _activation_grad(zv, ACTIVATION)).to(out_dtype), mask=mask)
    tl.store(grad_pre + wide + N, (gv * act).to(out_dtype), mask=mask)
    if STORE_ACT:
        tl.store(h + at, (act * uv).to(h.dtype.element_ty), mask=mask)
