"""The activations and their gradients, elementwise, after GEMMs that store plain products.

Where ``torch._grouped_mm`` runs gated experts' first layer (``library_phases.LibraryGemm``),
it returns ``z = x W1^T`` and ``u = x W3^T``; for a GELU, ReLU or SiLU expert ``gemm1_kernel``
returns ``z = x W1^T + b1`` alone (into ``h`` itself when nothing is kept for the backward, which
``activation_kernel`` then activates in place); in every backward, the library
or ``gemm1_kernel`` returns ``g = dY W2`` alone (``FusedKernels.first_layer_backward``). These
kernels compute the rest:

- ``activation_kernel``: ``h = act(z)``, gated ``h = act(z) * u``.
- ``activation_backward_kernel``: from ``g = dY W2`` and the forward's products, the gradient of
  the first layer's products (gated: ``dz = g * u * act'(z)`` and ``du = g * act(z)`` side by side
  in ``[R, 2F]``, the layout GEMM2's backward reads; else ``dz = g * act'(z)``) and, for W2's
  gradient, ``h`` again.

Both compute in fp32 and round once, and touch only the first ``*total`` rows (a device word: the
rows of the call, which the host does not know without a sync). ``z`` and ``u`` are read with a row
stride of their own, ``zu_stride``: separate [R, N] tensors (N), or the halves of one [R, 2N] (2N).
"""

import triton
import triton.language as tl

from .triton_gemm import _activation


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """d act(x) / dx."""
    if ACTIVATION == 0:  # Phi(x) + x phi(x)
        return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif ACTIVATION == 2:
        return (x > 0.0).to(tl.float32)
    else:
        s = 1.0 / (1.0 + tl.exp(-x))
        return s * (1.0 + x * (1.0 - s))


@triton.jit
def _block(total_ptr, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows, columns and mask over the first ``*total_ptr`` rows of an [R, N] grid."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    total = tl.load(total_ptr)
    return rows, cols, (rows < total)[:, None] & (cols < N)[None, :]


@triton.jit
def activation_kernel(
    z, u, zu_stride, h, total_ptr, N, ACTIVATION: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr
):
    """GATED: h = act(z) * u; else h = act(z) (u unused). [R, N] each, h row-major, z and u of row
    stride zu_stride."""
    rows, cols, mask = _block(total_ptr, N, BM, BN)
    at_zu = rows[:, None].to(tl.int64) * zu_stride + cols[None, :]
    act = _activation(tl.load(z + at_zu, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
    if GATED:
        act = act * tl.load(u + at_zu, mask=mask, other=0.0).to(tl.float32)
    tl.store(h + rows[:, None].to(tl.int64) * N + cols[None, :], act.to(h.dtype.element_ty), mask=mask)


@triton.jit
def activation_backward_kernel(
    g,
    z,
    u,
    zu_stride,
    grad_pre,
    h,
    total_ptr,
    N,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    STORE_ACT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """GATED: grad_pre[:, :N] = g * u * act'(z), grad_pre[:, N:] = g * act(z) ([R, 2N]), and with
    STORE_ACT h = act(z) * u. Else (u unused): grad_pre = g * act'(z) ([R, N]), and with STORE_ACT
    h = act(z). g and h are [R, N] row-major, z and u [R, N] of row stride zu_stride. h may be g: each
    program loads its block of g before it stores that block of h, both through ``at`` (one layout, so
    each element is loaded and stored by the same thread)."""
    rows, cols, mask = _block(total_ptr, N, BM, BN)
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    at_zu = rows[:, None].to(tl.int64) * zu_stride + cols[None, :]
    gv = tl.load(g + at, mask=mask, other=0.0).to(tl.float32)
    zv = tl.load(z + at_zu, mask=mask, other=0.0).to(tl.float32)
    act = _activation(zv, ACTIVATION)
    out_dtype = grad_pre.dtype.element_ty
    if GATED:
        uv = tl.load(u + at_zu, mask=mask, other=0.0).to(tl.float32)
        wide = rows[:, None].to(tl.int64) * (2 * N) + cols[None, :]
        tl.store(grad_pre + wide, (gv * uv * _activation_grad(zv, ACTIVATION)).to(out_dtype), mask=mask)
        tl.store(grad_pre + wide + N, (gv * act).to(out_dtype), mask=mask)
        act = act * uv
    else:
        tl.store(grad_pre + at, (gv * _activation_grad(zv, ACTIVATION)).to(out_dtype), mask=mask)
    if STORE_ACT:
        tl.store(h + at, act.to(h.dtype.element_ty), mask=mask)
