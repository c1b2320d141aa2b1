"""FP8 quantisation: the one definition of the numbers the ``"fp8"`` recipe computes with.

The reference pipeline's emulation of the recipe (``pipelines/fp8_emulation.py``) quantises with
these functions, and the fused pipeline's FP8 kernels must produce the same quantised values and
scales bit for bit, so that the emulation is their ground truth.

A tensor ``[M, K]`` is quantised in blocks of ``(rows, columns)`` elements; each block shares one
scale ``s``, a power of two (the UE8M0 scales of DeepSeek-V3's DeepGEMM, the power-of-two scales of
Transformer Engine): the smallest ``s = 2**e`` with ``amax <= fmt.max * s``, where ``amax`` is the
block's largest magnitude, and 1 for a block of zeros. In exact arithmetic that is
``2**ceil(log2(amax / fmt.max))``; it is computed from amax's exponent and mantissa, not through a
rounded division, so that every implementation gets the same ``e``. ``e`` is held to [-126, 127]
(normal fp32 numbers; no fp32 amax reaches either end but for subnormal blocks), so ``x / s`` and
``q * s`` are exact in fp32. Each element becomes ``x / s`` rounded to the nearest value of the
format, ties to even, saturated to ``±fmt.max``; it dequantises to ``q * s``. A block holding an
infinity or a NaN gets a NaN scale: its values come out NaN (e4m3 has no infinity), so an overflow
stays visible (DeepSpeed's fp16 loss scaler skips such a step).

The recipe's blocks, for a GEMM ``A @ B`` that reduces over K:

- rows (activations and gradients, ``[M, K]``): 1x128 tiles along K (``quantise_tiles``: K must be
  a multiple of 128), or one scale per row (``quantise_rows``);
- weights: 128x128 blocks (``quantise_blocks``), which serve a weight in both orientations, or one
  scale per row or per column (``quantise_rows`` / ``quantise_columns``), whichever axis is not K.

Imports only torch: the kernels' tests and the pipelines read it alike.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

BLOCK = 128  # the side of a weight block and the length of a row tile
# The scales' exponents: normal fp32 numbers, so that dividing by a scale and multiplying by it are exact.
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126, 127


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 format: ``dtype``, its largest finite value ``max``, its stored mantissa bits, and
    the exponent of its smallest normal value (below it the format is subnormal, with steps of
    ``2**(min_normal_exponent - mantissa_bits)``)."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exponent: int

    @property
    def unit_roundoff(self) -> float:
        """The largest relative error of rounding a value of the normal range: half a unit in the last place."""
        return 2.0 ** -(self.mantissa_bits + 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14)
FORMATS = {fmt.name: fmt for fmt in (E4M3, E5M2)}

TILE = (1, BLOCK)
WEIGHT_BLOCK = (BLOCK, BLOCK)


@dataclass(frozen=True)
class Quantised:
    """A quantised ``[M, K]`` tensor: ``values`` ``[M, K]`` of the format's dtype and ``scales``
    ``[ceil(M / block[0]), ceil(K / block[1])]`` fp32 (powers of two), one per ``block``."""

    values: Tensor
    scales: Tensor
    block: tuple[int, int]

    def dequantise(self) -> Tensor:
        """``values * scales`` as ``[M, K]`` fp32 (exact)."""
        blocked = _blocked(self.values.float(), self.block)
        return _unblocked(blocked * self.scales[:, None, :, None], self.values.shape)


def block_scales(x: Tensor, block: tuple[int, int], fmt: Fp8Format) -> Tensor:
    """The scales of ``x`` (``[M, K]``, any float dtype) in ``block``s: ``[ceil(M / block[0]),
    ceil(K / block[1])]`` fp32 powers of two (the module's docstring). An edge block that ``x``
    does not fill is scaled by the elements it holds, as the block padded with zeros would be
    (DeepSeek-V3 pads weights to whole blocks)."""
    amax = _blocked(x.float(), block).abs().amax(dim=(1, 3))
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    fmt_mantissa, fmt_exponent = math.frexp(fmt.max)
    # The smallest e with amax <= fmt.max * 2**e, exactly: comparing mantissas, with no division.
    exponent = exponent - fmt_exponent + (mantissa > fmt_mantissa).to(exponent.dtype)
    exponent = exponent.to(torch.int32).clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
    scales = torch.bitwise_left_shift(exponent + 127, 23).view(torch.float32)  # 2**e from its bits
    scales = torch.where(amax > 0, scales, torch.ones_like(scales))
    return torch.where(torch.isfinite(amax), scales, torch.full_like(scales, math.nan))


def quantise_with_scales(x: Tensor, scales: Tensor, block: tuple[int, int], fmt: Fp8Format) -> Tensor:
    """``x`` (``[M, K]``) divided by its ``block``s' ``scales`` and rounded to ``fmt`` (to nearest,
    ties to even), saturated to ``±fmt.max``: ``[M, K]`` of ``fmt.dtype``. With the scales of
    ``block_scales`` nothing saturates; a value beyond the range of other scales becomes
    ``±fmt.max`` (torch's cast alone would make it NaN or infinite)."""
    scaled = _blocked(x.float(), block) / scales[:, None, :, None]
    return _unblocked(scaled.clamp(-fmt.max, fmt.max), x.shape).to(fmt.dtype)


def quantise(x: Tensor, block: tuple[int, int], fmt: Fp8Format = E4M3) -> Quantised:
    """``x`` (``[M, K]``) quantised in ``block``s with the scales of ``block_scales``."""
    if x.dim() != 2:
        raise ValueError(f"FP8 quantisation takes [M, K] tensors, got shape {tuple(x.shape)}")
    scales = block_scales(x, block, fmt)
    return Quantised(quantise_with_scales(x, scales, block, fmt), scales, block)


def quantise_tiles(x: Tensor, fmt: Fp8Format = E4M3) -> Quantised:
    """Rows ``x`` (``[M, K]``) in 1x128 tiles along K: scales ``[M, K / 128]``. K must be a
    multiple of 128 (a GEMM's tiles must line up with its weights' 128x128 blocks)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(
            f"blockwise FP8 scaling quantises rows in 1x{BLOCK} tiles along the reduction dimension, which "
            f'needs a multiple of {BLOCK}, got {x.shape[-1]}: use the recipe\'s "scaling": "rowwise"'
        )
    return quantise(x, TILE, fmt)


def quantise_rows(x: Tensor, fmt: Fp8Format = E4M3) -> Quantised:
    """``x`` (``[M, K]``) with one scale per row: scales ``[M, 1]``. Rows of activations and
    gradients under rowwise scaling, and a weight ``[N, K]`` per output channel."""
    return quantise(x, (1, max(x.shape[-1], 1)), fmt)


def quantise_columns(x: Tensor, fmt: Fp8Format = E4M3) -> Quantised:
    """``x`` (``[M, K]``) with one scale per column: scales ``[1, K]``. A weight ``[N, K]`` that a
    GEMM reduces over N (the backward's products), per input channel."""
    return quantise(x, (max(x.shape[0], 1), 1), fmt)


def quantise_blocks(x: Tensor, fmt: Fp8Format = E4M3) -> Quantised:
    """A weight ``x`` (``[N, K]``) in 128x128 blocks: scales ``[ceil(N / 128), ceil(K / 128)]``;
    the same blocks serve a GEMM that reduces over K and one that reduces over N."""
    return quantise(x, WEIGHT_BLOCK, fmt)


def _blocked(x: Tensor, block: tuple[int, int]) -> Tensor:
    """``x`` ``[M, K]`` as ``[M / bm, bm, K / bk, bk]``, padded with zeros to whole blocks."""
    rows, columns = x.shape
    block_rows, block_columns = block
    pad_rows, pad_columns = -rows % block_rows, -columns % block_columns
    if pad_rows or pad_columns:
        x = F.pad(x, (0, pad_columns, 0, pad_rows))
    return x.reshape(x.shape[0] // block_rows, block_rows, x.shape[1] // block_columns, block_columns)


def _unblocked(blocked: Tensor, shape: torch.Size) -> Tensor:
    """``_blocked``'s inverse: the ``[M, K]`` of ``shape`` without the padding."""
    rows, columns = blocked.shape[0] * blocked.shape[1], blocked.shape[2] * blocked.shape[3]
    return blocked.reshape(rows, columns)[: shape[0], : shape[1]]
