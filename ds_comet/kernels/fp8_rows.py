"""Rows that cross the exchange in FP8 (the recipe's ``"dispatch": "fp8"``): the one statement of
their layout, and the passes that make them and read them back.

A packed row of H elements is ``packed_row_bytes(H)`` bytes: its H values in one FP8 format (e4m3 for
the tokens; e5m2 is the other format the recipe names, ``"gradient_format"``), then the fp32
scales of its H / 128 tiles (``fp8.quantise_tiles``: powers of two), then padding to a multiple of 16
bytes (the dispatch moves rows as 16-byte vectors; csrc/dispatch_kernels.cu states this layout
again, where the backward's dispatch scales a row's scales and decodes its values). A [R, H] bf16
row is 2H bytes, a packed one H + H / 32 (rounded up to 16): 0.52 of it at H = 7168.

``quantise_rows`` packs the tokens (and, under ``"gradient_dispatch": "fp8"``, the output gradients)
before the dispatch, once a token (the dispatch then stages each token's packed row once per rank
and copies it to each route's row there, in the backward with the route's gate multiplying its
scales); the FP8 GEMM1 reads the values and scales where they arrive (``packed_parts``);
``dequantise_rows`` gives the rows as the reference pipeline's emulation holds them (``q * scale``,
rounded to the tokens' dtype) for what takes them in high precision (the weight gradients). H must
be a multiple of 128.
"""

import torch
from torch import Tensor

from .. import fp8

SCALE_BYTES = 4  # an fp32 scale
VECTOR_BYTES = 16  # the dispatch's unit of copy
PACKED_DTYPE = torch.uint8  # a packed row's bytes, as the dispatch and the buffers hold them
# Rows of one program of the quantise and dequantise passes (a [32, 128] tile of each).
PASS_ROWS = 32


def packed_row_bytes(hidden: int) -> int:
    """Bytes of one packed row of ``hidden`` elements (a multiple of 128): values, scales, padding."""
    _check_hidden(hidden)
    scale_bytes = hidden // fp8.BLOCK * SCALE_BYTES
    return hidden + -(-scale_bytes // VECTOR_BYTES) * VECTOR_BYTES


def packed_parts(packed: Tensor, hidden: int, fmt: fp8.Fp8Format = fp8.E4M3) -> tuple[Tensor, Tensor]:
    """The values and scales of packed rows, as views of their bytes.

    Args:
        packed: [R, packed_row_bytes(hidden)] uint8, row after row (strides (row bytes, 1)).
        hidden: H.
        fmt: the values' FP8 format.

    Returns:
        (values [R, H] of ``fmt.dtype``, scales [R, H / 128] fp32), each with ``packed``'s row stride.
    """
    row_bytes = packed_row_bytes(hidden)
    if packed.dtype != PACKED_DTYPE or packed.dim() != 2 or packed.shape[1] != row_bytes:
        raise ValueError(
            f"packed FP8 rows of {hidden} elements are [R, {row_bytes}] uint8, got {list(packed.shape)} {packed.dtype}"
        )
    if packed.shape[0] > 1 and packed.stride() != (row_bytes, 1):
        raise ValueError(f"packed FP8 rows lie row after row, got strides {packed.stride()}")
    values = packed[:, :hidden].view(fmt.dtype)
    scales = packed[:, hidden : hidden + hidden // fp8.BLOCK * SCALE_BYTES].view(torch.float32)
    return values, scales


def packed_rows_in(buffer: Tensor, rows: int, hidden: int) -> Tensor:
    """The first ``rows`` packed rows of a buffer's bytes: [rows, packed_row_bytes(hidden)] uint8 over
    ``buffer``'s storage (a contiguous tensor of at least that many bytes, such as the workspace's
    ``recv``, sized for rows of the tokens' dtype)."""
    row_bytes = packed_row_bytes(hidden)
    flat = buffer.view(-1).view(PACKED_DTYPE)
    if not buffer.is_contiguous() or flat.numel() < rows * row_bytes:
        raise ValueError(f"{rows} packed rows of {row_bytes} bytes do not fit a buffer of {flat.numel()} bytes")
    return flat[: rows * row_bytes].view(rows, row_bytes)


def quantise_rows(tokens: Tensor, fmt: fp8.Fp8Format = fp8.E4M3) -> Tensor:
    """The tokens as packed FP8 rows: ``fp8.quantise_tiles``'s values and scales in ``fmt``, bit for bit.

    Args:
        tokens: [S, H] bf16, contiguous, on the GPU; H a multiple of 128.
        fmt: the values' FP8 format.

    Returns:
        [S, packed_row_bytes(H)] uint8 (the padding bytes are not written).
    """
    from .triton_fp8_quantise import quantise_rows_kernel  # triton is an extra

    num_rows, hidden = tokens.shape
    row_bytes = packed_row_bytes(hidden)
    packed = torch.empty((num_rows, row_bytes), dtype=PACKED_DTYPE, device=tokens.device)
    if num_rows:
        values, scales = packed_parts(packed, hidden, fmt)
        grid = (-(-num_rows // PASS_ROWS), hidden // fp8.BLOCK)
        quantise_rows_kernel[grid](
            tokens, values, scales, num_rows, hidden, row_bytes, E5M2=fmt is fp8.E5M2, BM=PASS_ROWS, num_warps=4
        )
    return packed


def dequantise_rows(packed: Tensor, hidden: int, fmt: fp8.Fp8Format = fp8.E4M3) -> Tensor:
    """Packed FP8 rows as values: each value times its tile's scale (exact in fp32), rounded once to
    bf16 (the FP8 recipe's tokens' dtype), as the reference pipeline's emulation of ``"dispatch":
    "fp8"`` holds the rows.

    Args:
        packed: [R, packed_row_bytes(hidden)] uint8 (``packed_parts``).
        hidden: H.
        fmt: the values' FP8 format.

    Returns:
        [R, H] bf16, contiguous.
    """
    from .triton_fp8_quantise import dequantise_rows_kernel  # triton is an extra

    values, scales = packed_parts(packed, hidden, fmt)
    num_rows = packed.shape[0]
    out = torch.empty((num_rows, hidden), dtype=torch.bfloat16, device=packed.device)
    if num_rows:
        grid = (-(-num_rows // PASS_ROWS), hidden // fp8.BLOCK)
        dequantise_rows_kernel[grid](values, scales, out, num_rows, hidden, packed.shape[1], BM=PASS_ROWS, num_warps=4)
    return out


def _check_hidden(hidden: int) -> None:
    if hidden <= 0 or hidden % fp8.BLOCK:
        raise ValueError(
            f"packed FP8 rows hold 1x{fp8.BLOCK} tiles: hidden must be a multiple of {fp8.BLOCK}, got {hidden}"
        )
