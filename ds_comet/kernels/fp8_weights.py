"""The local experts' weights quantised for the FP8 GEMMs (``Fp8WeightCache``), once per weight version.

The FP8 GEMMs (``triton_fp8_gemm``) read each weight in e4m3 with ``ds_comet/fp8.py``'s 128x128 block
scales, ``[N, K]`` for a GEMM that reduces over K (Hopper's FP8 tensor cores take both operands
K-major), so each weight a GEMM reads is kept in the orientation that GEMM needs (``QUANTISED``):

- forward: W1 and W3 as stored, ``[F, H]`` (GEMM1, K = H), and W2 as stored, ``[H, F]`` (GEMM2, K = F);
- input gradients: W2^T ``[F, H]`` (``dY @ W2``, K = H), W1^T and W3^T ``[H, F]`` (``dA @ W1``, K = F).

A block's scale does not depend on the orientation (the blocks are square), so a transposed copy is
the transposed values with the transposed grid of scales. The copies live as long as the layer, about
the bf16 weights' size when the recipe runs both the forward and the input gradients in FP8 (two
one-byte copies of each weight, a 4,096th of that in scales); the bf16 (or fp32) weights stay what
ZeRO, the optimizer and checkpoints see.

A layer quantises its weights again only when they may have changed: it keys them on each weight's
storage and version counter (a replaced parameter, weights converted or moved, an in-place update
under autograd's eye) and on the process's count of optimizer steps (``weights_changed``), because
DeepSpeed's optimizers write the weights through ``.data`` (ZeRO's partition copies, ``FusedAdam``),
which moves no version counter. Micro-batches between two steps, and a forward and its backward,
share one quantisation. Under ZeRO-3 the weights are gathered anew for each call, usually at new
addresses: the cache then quantises them at each gather.

The copies are ``fp8.quantise_blocks``'s (``quantised_by_torch``); the fused pipeline's bf16 weights
on the GPU are quantised by a Triton kernel in one pass (``quantised_by_triton``), which gives the
same bits (tests/cpu/test_fp8_weights.py holds it to ``fp8.py`` in Triton's interpreter).

Under the recipe's rowwise scaling (the library's FP8 GEMMs, ``library_fp8_phases``) each copy is
``fp8.quantise_rows`` of the same ``[N, K]`` orientation instead: one scale per row, the output
channel of the GEMM that reads it (``quantised_rowwise``). W2^T's rows are W2's columns, so its copy
is ``fp8.quantise_columns(W2)`` transposed, bit for bit. The backward GEMM2 is there one GEMM over
``[W1; W3]`` (K = 2F), as in the emulation, whose copy ``[W1; W3]^T`` takes one scale per input
channel across W1 and W3 together (``ROWWISE_QUANTISED``). On the GPU each rowwise copy is one
Triton pass over the weights where they lie (``rowwise_copy_by_triton``,
``rowwise_transposed_copy_by_triton``).
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import fp8
from .fused_experts import POINTER_NAMES, FusedExperts
from .gemm_phases import Phase
from .host_copies import host_to_device
from .library_fp8_phases import QUANTISE_COLUMNS, quantised_rows


@dataclass(frozen=True)
class QuantisedWeight:
    """One weight as an FP8 GEMM reads it: ``name`` in the cache's tables, the expert weights it
    quantises (``sources``, of ``POINTER_NAMES``: one, or several stacked along N, those an expert
    has) and whether it is their stack transposed."""

    name: str
    sources: tuple[str, ...]
    transposed: bool


# The weights each phase's FP8 GEMM reads, [N, K] each (W3's only for gated experts).
QUANTISED = {
    Phase.FIRST_LAYER: (QuantisedWeight("w1", ("w1",), False), QuantisedWeight("w3", ("w3",), False)),
    Phase.GEMM2: (QuantisedWeight("w2", ("w2",), False),),
    Phase.FIRST_LAYER_BACKWARD: (QuantisedWeight("w2t", ("w2",), True),),
    Phase.GEMM2_BACKWARD: (QuantisedWeight("w1t", ("w1",), True), QuantisedWeight("w3t", ("w3",), True)),
}
# Under rowwise scaling (the module's docstring): the backward GEMM2 reads [W1; W3]^T, [H, 2F].
ROWWISE_QUANTISED = {**QUANTISED, Phase.GEMM2_BACKWARD: (QuantisedWeight("w13t", ("w1", "w3"), True),)}
# quantised_by_torch's experts at once hold at most this many weight elements: fp8.quantise works in
# fp32 and holds a few copies of its input, so a Mixtral-sized layer's w1 at once would take gigabytes.
CHUNK_ELEMENTS = 1 << 25
# quantise_weight_columns_kernel's tile of a weight: rows per pass, columns per program (4,096
# elements over its 4 warps, 32 a thread).
WEIGHT_TILE = (64, 64)

_optimizer_steps = 0
_step_hook = None


def weights_changed() -> None:
    """Tells every layer's cache that its weights may have changed where their version counters do not
    show it: the next call quantises them again. Every torch optimizer's ``step`` calls it (a global
    step hook, installed with the first cache); a script that writes expert weights through ``.data``
    outside an optimizer step (a checkpoint loaded into ZeRO's partitions) calls it after."""
    global _optimizer_steps
    _optimizer_steps += 1


def _count_step(optimizer, args, kwargs) -> None:
    weights_changed()


class Fp8WeightCache:
    """One layer's local expert weights quantised for its FP8 GEMMs, and their device pointer tables.

    Args:
        phases: the GEMM phases the layer's recipe runs in FP8 (``Fp8Facts.phases``): the weights
            they read are kept (``QUANTISED``).
        scaling: the recipe's ``"blockwise"`` (128x128 blocks) or ``"rowwise"`` (a scale per row of
            each copy, ``ROWWISE_QUANTISED``).

    Attributes:
        quantisations: how many times the weights were quantised (a cache miss each).
    """

    def __init__(self, phases: frozenset[Phase], scaling: str = "blockwise"):
        global _step_hook
        self.scaling = scaling
        if _step_hook is None:
            _step_hook = register_optimizer_step_post_hook(_count_step)
        copies = ROWWISE_QUANTISED if scaling == "rowwise" else QUANTISED
        self.wanted = [weight for phase in Phase if phase in phases for weight in copies.get(phase, ())]
        self.quantisations = 0
        self._key = None
        self._weights: dict[str, fp8.Quantised] = {}
        self._tables: dict[str, Tensor] = {}

    def tables(self, experts: FusedExperts, device: torch.device) -> dict[str, Tensor]:
        """The quantised weights' device pointer tables for this call, quantising them first where the
        weights may have changed since the last call (the module's docstring); no host sync.

        Args:
            experts: the local experts' weights (each expert's ``[F, H]`` W1 and W3, ``[H, F]`` W2).
            device: where the kernels run.

        Returns:
            By quantised weight name (``QUANTISED``: "w1", "w3", "w2", "w2t", "w1t", "w3t", or
            rowwise "w13t" for the last two, those the phases read and the experts have): ``[L]``
            int64 pointers to each local expert's e4m3 ``[N, K]`` matrix, and under ``name +
            "_scales"`` to its fp32 scales, contiguous: ``[N / 128, K / 128]`` blocks, or rowwise
            ``[N, 1]``.
        """
        key = (_optimizer_steps, experts.weight_key())
        if key != self._key:
            self._quantise(experts.expert_tensors(), device)
            self._key = key
        return self._tables

    def quantised(self, name: str) -> fp8.Quantised:
        """The quantised weight ``name`` as the last call's tables point at it: values ``[L, N, K]``
        e4m3, scales ``[L, N / 128, K / 128]`` fp32 with block ``(128, 128)``, or rowwise ``[L, N, 1]``
        with block ``(1, K)``."""
        return self._weights[name]

    @property
    def nbytes(self) -> int:
        """The bytes the quantised weights and their scales take."""
        return sum(q.values.nbytes + q.scales.nbytes for q in self._weights.values())

    @torch.no_grad()
    def _quantise(self, tensors: list[tuple[Tensor | None, ...]], device: torch.device) -> None:
        self._weights = {}
        if self.scaling == "rowwise":
            for weight in self.wanted:
                quantised = quantised_rowwise(tensors, weight)
                if quantised is not None:
                    self._weights[weight.name] = quantised
        else:
            # Blockwise copies have one source each (QUANTISED); the Triton pass writes a source's
            # plain and transposed copies at once.
            for (source,) in dict.fromkeys(weight.sources for weight in self.wanted):
                matrices = [row[POINTER_NAMES.index(source)] for row in tensors]
                if matrices[0] is None:
                    continue  # W3 of an ungated expert
                wanted = [weight for weight in self.wanted if weight.sources == (source,)]
                by_triton = matrices[0].is_cuda and matrices[0].dtype == torch.bfloat16  # the fused FP8 path's
                self._weights.update((quantised_by_triton if by_triton else quantised_by_torch)(matrices, wanted))
        self._tables = _pointer_tables(self._weights, device)
        self.quantisations += 1


def quantised_by_torch(matrices: list[Tensor], wanted: list[QuantisedWeight]) -> dict[str, fp8.Quantised]:
    """Each of ``wanted`` (one source) from the local experts' ``matrices`` (``[N, K]`` each, N and K
    multiples of 128): ``fp8.quantise_blocks`` of each expert's matrix, transposed where asked, stacked
    over the experts (``Fp8WeightCache.quantised``'s layout). ``fp8.py`` itself, a few experts at a time."""
    out = _empty_copies(matrices, wanted)
    num_local, (rows, columns) = len(matrices), matrices[0].shape
    step = max(1, CHUNK_ELEMENTS // (rows * columns))
    for first in range(0, num_local, step):
        last = min(first + step, num_local)
        # Experts stacked along N, whole blocks each: the same blocks as each expert's own.
        quantised = fp8.quantise_blocks(torch.cat(matrices[first:last]))
        values = quantised.values.view(last - first, rows, columns)
        scales = quantised.scales.view(last - first, rows // fp8.BLOCK, -1)
        for weight in wanted:
            copy = out[weight.name]
            copy.values[first:last] = values.transpose(1, 2) if weight.transposed else values
            copy.scales[first:last] = scales.transpose(1, 2) if weight.transposed else scales
    return out


def quantised_by_triton(matrices: list[Tensor], wanted: list[QuantisedWeight]) -> dict[str, fp8.Quantised]:
    """``quantised_by_torch``'s copies of bf16 ``matrices``, bit for bit, in one pass over them
    (``triton_fp8_quantise.quantise_blocks_kernel``: a read of each weight and a write of each copy,
    where ``fp8.py``'s torch operations make several passes in fp32)."""
    from .triton_fp8_quantise import quantise_blocks_kernel  # triton is an extra

    out = _empty_copies(matrices, wanted)
    num_local, (rows, columns) = len(matrices), matrices[0].shape
    plain = next((out[w.name] for w in wanted if not w.transposed), None)
    transposed = next((out[w.name] for w in wanted if w.transposed), None)
    table = host_to_device(torch.tensor([m.data_ptr() for m in matrices], dtype=torch.int64), matrices[0].device)
    either = plain or transposed
    quantise_blocks_kernel[(rows // fp8.BLOCK, columns // fp8.BLOCK, num_local)](
        table,
        either.values,
        (transposed or plain).values,
        either.scales,
        (transposed or plain).scales,
        rows,
        columns,
        STORE=plain is not None,
        STORE_T=transposed is not None,
        num_warps=8,  # a [128, 128] block and its transpose: 4 warps spilled 760 bytes a thread
    )
    return out


def quantised_rowwise(tensors: list[tuple[Tensor | None, ...]], weight: QuantisedWeight) -> fp8.Quantised | None:
    """``fp8.quantise_rows`` of each local expert's ``weight`` (its sources that the experts have,
    stacked along N; transposed first where asked), stacked over the experts: values
    ``[L, N, K]`` e4m3, scales ``[L, N, 1]`` fp32, block ``(1, K)``; None where the experts have none
    of its sources. ``tensors``: ``FusedExperts.expert_tensors()``. The fused FP8 path's bf16 weights
    on a GPU are read where they lie by a Triton pass (``rowwise_copy_by_triton``,
    ``rowwise_transposed_copy_by_triton``); any others go through ``rowwise_copy_by_torch``."""
    present = [POINTER_NAMES.index(source) for source in weight.sources]
    present = [column for column in present if tensors[0][column] is not None]
    if not present:
        return None
    sources = [[row[column] for row in tensors] for column in present]
    first = sources[0][0]
    rows, columns = sum(source[0].shape[0] for source in sources), first.shape[1]
    if weight.transposed:
        rows, columns = columns, rows
    values = torch.empty((len(tensors), rows, columns), dtype=fp8.E4M3.dtype, device=first.device)
    scales = torch.empty((len(tensors), rows, 1), dtype=torch.float32, device=first.device)
    by_triton = first.is_cuda and first.dtype == torch.bfloat16  # the fused FP8 path's weights
    if by_triton and all(m.is_contiguous() for source in sources for m in source):
        if weight.transposed:
            rowwise_transposed_copy_by_triton(sources, values, scales)
            return fp8.Quantised(values, scales, (1, columns))
        if len(sources) == 1:
            rowwise_copy_by_triton(sources[0], values, scales)
            return fp8.Quantised(values, scales, (1, columns))
    rowwise_copy_by_torch(sources, weight.transposed, values, scales)
    return fp8.Quantised(values, scales, (1, columns))


def rowwise_copy_by_torch(sources: list[list[Tensor]], transposed: bool, values: Tensor, scales: Tensor) -> None:
    """``quantised_rowwise``'s copy of the sources' matrices (``sources[s][e]``: expert e's ``[N_s, K]``,
    stacked along N; transposed first where asked) into ``values`` and ``scales``: a few experts at a
    time, copied once into a buffer of the chunk's (a row's scale is its own, so experts stacked along
    N keep theirs), then quantised by ``library_fp8_phases.quantised_rows``."""
    num_local, rows, columns = values.shape
    step = max(1, CHUNK_ELEMENTS // (rows * columns))
    for first in range(0, num_local, step):
        last = min(first + step, num_local)
        part = torch.empty((last - first, rows, columns), dtype=sources[0][0].dtype, device=values.device)
        for expert in range(first, last):
            start = 0
            for source in sources:
                matrix, size = source[expert], source[expert].shape[0]
                if transposed:
                    part[expert - first, :, start : start + size].copy_(matrix.t())
                else:
                    part[expert - first, start : start + size].copy_(matrix)
                start += size
        quantised = quantised_rows(part.view(-1, columns))
        values[first:last] = quantised.values.view(last - first, rows, columns)
        scales[first:last] = quantised.scales.view(last - first, rows, 1)


def rowwise_copy_by_triton(matrices: list[Tensor], values: Tensor, scales: Tensor) -> None:
    """``quantised_rowwise``'s untransposed copy of one source's bf16 ``matrices`` (``[N, K]`` each,
    contiguous) into ``values`` ([L, N, K] e4m3) and ``scales`` ([L, N, 1]), read where they lie: one
    Triton program a row (``triton_fp8_quantise.quantise_weight_rows_kernel``), bit for bit
    ``fp8.quantise_rows``, with no bf16 copy first."""
    from .triton_fp8_quantise import quantise_weight_rows_kernel  # triton is an extra

    rows, columns = matrices[0].shape
    table = host_to_device(torch.tensor([m.data_ptr() for m in matrices], dtype=torch.int64), values.device)
    quantise_weight_rows_kernel[(rows, len(matrices))](
        table, values, scales, rows, columns, BK=QUANTISE_COLUMNS, num_warps=4
    )


def rowwise_transposed_copy_by_triton(sources: list[list[Tensor]], values: Tensor, scales: Tensor) -> None:
    """``quantised_rowwise``'s transposed copy of one or two sources' bf16 matrices (``sources[s][e]``:
    expert e's ``[N, K]``, contiguous; two: W1 and W3, stacked along N) into ``values`` ([L, K, N or
    2N] e4m3) and ``scales`` ([L, K, 1]), read where they lie: ``WEIGHT_TILE``'s columns a Triton
    program (``triton_fp8_quantise.quantise_weight_columns_kernel``), bit for bit
    ``fp8.quantise_columns`` transposed, with no bf16 copy first."""
    from .triton_fp8_quantise import quantise_weight_columns_kernel  # triton is an extra

    rows, columns = sources[0][0].shape
    tables = host_to_device(
        torch.tensor([[m.data_ptr() for m in source] for source in sources], dtype=torch.int64), values.device
    )
    block_rows, block_columns = WEIGHT_TILE
    quantise_weight_columns_kernel[(-(-columns // block_columns), len(sources[0]))](
        tables[0],
        tables[-1],
        values,
        scales,
        rows,
        columns,
        TWO=len(sources) == 2,
        BN=block_rows,
        BC=block_columns,
        num_warps=4,
    )


def _empty_copies(matrices: list[Tensor], wanted: list[QuantisedWeight]) -> dict[str, fp8.Quantised]:
    """The stacked copies ``wanted`` of ``matrices`` (``[N, K]`` each) take, not yet written."""
    rows, columns = matrices[0].shape
    if rows % fp8.BLOCK or columns % fp8.BLOCK:
        # Stacked along N, a block of an edge that is not whole would take rows of the next expert.
        raise ValueError(f"FP8 weights are quantised in {fp8.BLOCK}x{fp8.BLOCK} blocks, got [{rows}, {columns}]")
    out = {}
    for weight in wanted:
        shape = (len(matrices), columns, rows) if weight.transposed else (len(matrices), rows, columns)
        values = torch.empty(shape, dtype=fp8.E4M3.dtype, device=matrices[0].device)
        scales = torch.empty((shape[0], shape[1] // fp8.BLOCK, shape[2] // fp8.BLOCK), device=values.device)
        out[weight.name] = fp8.Quantised(values, scales, fp8.WEIGHT_BLOCK)
    return out


def _pointer_tables(weights: dict[str, fp8.Quantised], device: torch.device) -> dict[str, Tensor]:
    """Device tables of each expert's pointer into each quantised weight and its scales, in one transfer."""
    names, pointers = [], []
    for name, quantised in weights.items():
        for suffix, tensor in (("", quantised.values), ("_scales", quantised.scales)):
            stride = tensor.stride(0) * tensor.element_size()
            names.append(name + suffix)
            pointers.append([tensor.data_ptr() + expert * stride for expert in range(tensor.shape[0])])
    if not names:
        return {}
    stacked = host_to_device(torch.tensor(pointers, dtype=torch.int64), device)
    return {name: stacked[i] for i, name in enumerate(names)}
