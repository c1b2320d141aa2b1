"""The GEMM phases of a fused call, and the interface of an implementation of them.

A call of the fused pipeline runs five GEMM phases (``Phase``). An implementation
(``GemmImplementation``) is a named way to launch some of them; for each phase it runs, it declares
what it needs of the call (``Needs``): the row and weight dtypes it takes, the GPUs it runs on, the
torch functions it calls, conditions on the call such as a rank alone in its group, and whether it
computes in FP8. A call is described by its ``GemmFacts``, which include what the layer's FP8
recipe asks of it (``Fp8Facts``): a phase the recipe puts in FP8 runs only on an implementation that
runs it in FP8, and any other phase only on one that does not. ``gemm_table`` lists the
implementations and gives each phase the first one whose needs the facts meet; the launch code
(``launch.FusedKernels``) asks that implementation to run the phase and what dtype it stores its
outputs in.
"""

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..fp8 import BLOCK as FP8_BLOCK

if TYPE_CHECKING:
    from .launch import FusedKernels

# The first layer's products before the activation, as an implementation keeps them for the
# backward: one [R, F] tensor (ungated), the two halves of one [R, 2F] tensor (gated), or a pair
# of [R, F] tensors (gated).
Products = Tensor | tuple[Tensor, Tensor]


class Phase(enum.Enum):
    """The GEMM phases of one call (R received rows, H hidden, F FFN columns, L local experts)."""

    FIRST_LAYER = "forward first layer"
    """GEMM1 on the received rows and the activation: h ([R, F])."""
    GEMM2 = "forward GEMM2"
    """h @ W2^T: the experts' output rows ([R, H]), for the combine."""
    FIRST_LAYER_BACKWARD = "backward first layer"
    """dY @ W2 on the received output gradients, and the elementwise backward: the gradients of the
    first layer's products ([R, F], gated [R, 2F])."""
    GEMM2_BACKWARD = "backward GEMM2"
    """dA @ W1 (+ dA_up @ W3): the rows' input gradients ([R, H]), for the combine."""
    WEIGHT_GRADIENTS = "weight gradients"
    """Per local expert, A_l^T @ B_l over its rows ([L, M, N])."""


@dataclass(frozen=True)
class Fp8Facts:
    """What a layer's ``"fp8"`` recipe asks of its calls' GEMMs (``config.Fp8Recipe``, as it applies here)."""

    phases: frozenset[Phase]
    """The phases it runs in FP8: the forward's two GEMMs with ``"forward"``, the backward's two
    input-gradient GEMMs with ``"input_gradients"``, each pass's GEMM2 only with ``"gemm2"``, the
    weight gradients with ``"weight_gradients"``."""
    scaling: str
    """``"blockwise"`` (1x128 tiles of rows, 128x128 blocks of weights) or ``"rowwise"``."""
    gradient_format: str
    """The gradients' rows' FP8 format in the backward's GEMMs: ``"e4m3"`` or ``"e5m2"``."""
    hidden: int
    ffn: int
    """The layer's H and F: the GEMMs' reduction sizes, which blockwise scaling tiles by 128."""
    rows_in_fp8: bool = False
    """``"dispatch": "fp8"``: the forward's rows cross the exchange packed in FP8 (``fp8_rows``), and
    the forward's first layer takes them so (only an implementation that runs it in FP8 can)."""
    gradients_in_fp8: bool = False
    """``"gradient_dispatch": "fp8"``: the backward's output gradients cross the exchange packed in
    ``gradient_format``, each route's gate in its row's scales, and the backward's first layer takes
    them so (only an implementation that runs it in FP8 can)."""


@dataclass(frozen=True)
class GemmFacts:
    """What the choice of a phase's implementation reads about a call."""

    row_dtype: torch.dtype
    """The dtype the rows arrive in (the tokens', which the dispatch and the combine move)."""
    weight_dtype: torch.dtype
    """The dtype the experts' weights are stored in."""
    capability: tuple[int, int]
    """The GPU's compute capability, (9, 0) for sm_90."""
    alone: bool
    """One rank in the group: no first-layer tile waits for a dispatch."""
    gated: bool
    """Gated experts: act(x W1^T) * (x W3^T)."""
    stacked: bool
    """The weights are stacked tensors, ``[L, F, H]`` and ``[L, H, F]`` (what a grouped-GEMM library
    call takes), not one module per expert."""
    fp8: Fp8Facts | None = None
    """The layer's FP8 recipe, where the fused pipeline runs one; None: every phase in the rows' dtype."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Needs:
    """What an implementation needs of a call to run one phase."""

    dtypes: tuple[tuple[torch.dtype, torch.dtype], ...]
    """The (row dtype, weight dtype) pairs it takes."""
    capabilities: tuple[tuple[int, int], ...] | None = None
    """The compute capabilities it runs on; None: every GPU the fused pipeline runs on."""
    torch_functions: tuple[str, ...] = ()
    """Functions of the ``torch`` module it calls that not every torch has."""
    alone: bool = False
    """Only for a rank alone in its group (no tile may wait for a dispatch)."""
    gated: bool = False
    """Only for gated experts."""
    stacked: bool = False
    """Only for stacked weights."""
    fp8_scalings: tuple[str, ...] = ()
    """The FP8 scalings it runs the phase in (``"blockwise"``, ``"rowwise"``): then it runs the phase
    only where the layer's recipe puts it in FP8 with one of them (blockwise: with hidden and FFN
    sizes that are multiples of ``FP8_BLOCK``). Empty: it computes in the rows' dtype, and runs the
    phase only where no recipe puts it in FP8."""

    def refusal(self, facts: GemmFacts, in_fp8: bool = False) -> str | None:
        """Whether a call meets these needs.

        Args:
            facts: the call's facts.
            in_fp8: the layer's FP8 recipe puts the phase in FP8 in this call.

        Returns:
            None where the call meets them, else the first that it does not, as a phrase
            ("takes bfloat16 rows with bfloat16 weights, not ...", "runs on sm_90, not sm_80",
            "needs gated experts", ...).
        """
        reason = self.fp8_refusal(facts, in_fp8)
        if reason is not None:
            return reason
        if (facts.row_dtype, facts.weight_dtype) not in self.dtypes:
            taken = " or ".join(f"{dtype_name(r)} rows with {dtype_name(w)} weights" for r, w in self.dtypes)
            given = f"{dtype_name(facts.row_dtype)} rows with {dtype_name(facts.weight_dtype)} weights"
            return f"takes {taken}, not {given}"
        if self.capabilities is not None and facts.capability not in self.capabilities:
            wanted = " or ".join(f"sm_{major}{minor}" for major, minor in self.capabilities)
            return f"runs on {wanted}, not sm_{facts.capability[0]}{facts.capability[1]}"
        missing = [name for name in self.torch_functions if not hasattr(torch, name)]
        if missing:
            return f"needs torch.{missing[0]}, which torch {torch.__version__} lacks"
        if self.alone and not facts.alone:
            return "needs a rank alone in its group (here a tile may wait for a dispatch)"
        if self.gated and not facts.gated:
            return "needs gated experts"
        if self.stacked and not facts.stacked:
            return "needs stacked expert weights (here one module per expert)"
        return None

    def fp8_refusal(self, facts: GemmFacts, in_fp8: bool) -> str | None:
        """``refusal``'s answer on FP8 alone: whether an FP8 phase (``in_fp8``) meets ``fp8_scalings``."""
        if not in_fp8:
            return "runs only phases an FP8 recipe puts in FP8" if self.fp8_scalings else None
        if not self.fp8_scalings:
            return "does not compute in FP8, which the layer's recipe asks for here"
        recipe = facts.fp8
        if recipe.scaling not in self.fp8_scalings:
            return f"runs {' or '.join(self.fp8_scalings)} FP8 scaling, not {recipe.scaling}"
        if recipe.scaling == "blockwise" and (recipe.hidden % FP8_BLOCK or recipe.ffn % FP8_BLOCK):
            return (
                f"needs hidden and FFN sizes that are multiples of {FP8_BLOCK} (blockwise scaling's tiles), "
                f"not {recipe.hidden} and {recipe.ffn}"
            )
        return None


class GemmImplementation:
    """A named way to run GEMM phases.

    A subclass sets ``name`` and ``needs`` (each phase it runs, and what that phase needs), answers
    ``stored_dtype`` and implements the methods of its phases; the table never calls the others.
    Each method takes the call's ``FusedKernels`` (``call``: the workspace, the experts' pointer
    tables and sizes, the kernel parameters, the elementwise steps) and queues its launches on the
    current stream without waiting for the device.
    """

    name: str
    needs: dict[Phase, Needs]

    def refusal(self, phase: Phase, facts: GemmFacts) -> str | None:
        """Why this implementation does not run ``phase`` for a call with ``facts``, or None."""
        needs = self.needs.get(phase)
        if needs is None:
            return f"does not run the {phase.value}"
        return needs.refusal(facts, in_fp8=facts.fp8 is not None and phase in facts.fp8.phases)

    def runs_fp8(self, phase: Phase) -> bool:
        """Whether this implementation runs ``phase`` in FP8 (where it runs it at all)."""
        needs = self.needs.get(phase)
        return needs is not None and bool(needs.fp8_scalings)

    def stored_dtype(self, phase: Phase, facts: GemmFacts) -> torch.dtype:
        """The dtype ``phase`` stores its outputs in (what the caller allocates them as)."""
        raise NotImplementedError

    def first_layer(self, call: "FusedKernels", rows: Tensor, h: Tensor, keep_pre: bool):
        """``Phase.FIRST_LAYER`` on the received ``rows`` ([R, H]): the activations into ``h``
        ([R, F]); returns, with ``keep_pre``, the products before the activation in the form the
        elementwise steps take (``FusedKernels.activations``), else None."""
        raise NotImplementedError

    def gemm2(self, call: "FusedKernels", rows: Tensor, out: Tensor):
        """``Phase.GEMM2``: ``rows`` (the activations, [R, F]) @ W2^T + b2 into ``out`` ([R, H],
        contiguous), each finished row counted for the combine."""
        raise NotImplementedError

    def first_layer_backward(
        self, call: "FusedKernels", rows: Tensor, grad_pre: Tensor, pre: Products, want_act: bool
    ) -> Tensor | None:
        """``Phase.FIRST_LAYER_BACKWARD`` on the received output gradients ``rows`` ([R, H]): the
        gradient of the first layer's products ``pre`` (as ``first_layer`` returned them) into
        ``grad_pre`` ([R, F], gated [R, 2F]); returns, with ``want_act``, the activations again
        ([R, F], ``grad_pre``'s dtype), else None."""
        raise NotImplementedError

    def gemm2_backward(self, call: "FusedKernels", rows: Tensor, out: Tensor):
        """``Phase.GEMM2_BACKWARD``: ``rows`` (the first layer's gradients, [R, F], gated [R, 2F])
        @ W1 (+ the up half @ W3) into ``out`` ([R, H], contiguous), each finished row counted for
        the combine."""
        raise NotImplementedError

    def weight_gradients(self, call: "FusedKernels", a: Tensor, b: Tensor) -> Tensor:
        """``Phase.WEIGHT_GRADIENTS``: per local expert l, ``a[rows of l]^T @ b[rows of l]``
        ([L, M, N]) for row-major ``a`` ([R, M]) and ``b`` ([R, N]), their rows grouped by local
        expert as received (either may be a column slice of a wider tensor)."""
        raise NotImplementedError
