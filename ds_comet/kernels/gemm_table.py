"""The GEMM implementations, in one table, and the choice of one for each phase of a call.

``IMPLEMENTATIONS`` lists them in order of preference. Each phase of a call runs on the first
that admits the call's facts (``choose``); what each one admits is its own declaration
(``GemmImplementation.needs``), so registering an implementation is adding it here, at its
place in the order.
"""

from .gemm_phases import GemmFacts, GemmImplementation, Phase
from .library_fp8_phases import LibraryFp8Gemm
from .library_phases import LibraryGemm
from .triton_fp8_phases import TritonFp8Gemm
from .triton_phases import TritonGemm

IMPLEMENTATIONS: tuple[GemmImplementation, ...] = (
    TritonFp8Gemm(),  # only the phases a layer's FP8 recipe puts in FP8 (blockwise), which no other one runs
    LibraryFp8Gemm(),  # the rowwise recipe's FP8 phases where nothing waits (alone in the group; weight gradients: any)
    LibraryGemm(),  # where it runs at all (bf16, sm_90, nothing waiting), it was the faster
    TritonGemm(),  # every phase, for every call the fused pipeline takes
)


def refusals(phase: Phase, facts: GemmFacts) -> dict[str, str | None]:
    """Each registered implementation's reason not to run ``phase`` for a call with ``facts``.

    Args:
        phase: the GEMM phase.
        facts: the call's facts.

    Returns:
        By implementation name, in the table's order: why it does not run the phase for this call
        (a phrase such as "needs gated experts"), or None where it would.
    """
    return {implementation.name: implementation.refusal(phase, facts) for implementation in IMPLEMENTATIONS}


def choose(phase: Phase, facts: GemmFacts) -> GemmImplementation:
    """The implementation that runs ``phase`` for a call with ``facts``.

    Args:
        phase: the GEMM phase.
        facts: the call's facts.

    Returns:
        The first implementation in the table whose needs for ``phase`` the facts meet.

    Raises:
        RuntimeError: none does; the message gives every implementation's reason.
    """
    for implementation in IMPLEMENTATIONS:
        if implementation.refusal(phase, facts) is None:
            return implementation
    reasons = "; ".join(f"{name} {reason}" for name, reason in refusals(phase, facts).items())
    raise RuntimeError(f"ds_comet: no GEMM implementation runs the {phase.value} of this call: {reasons}")


def fp8_refusal(facts: GemmFacts) -> str | None:
    """Why a call's FP8 recipe cannot run on the fused pipeline's GEMMs, or None.

    Args:
        facts: the call's facts, with the layer's recipe (``GemmFacts.fp8``).

    Returns:
        None where every phase the recipe puts in FP8 has an implementation (or the facts hold no
        recipe); else, for the first phase that has none, a sentence naming it with each FP8
        implementation's reason ("the fused pipeline has no FP8 GEMM for its forward first layer
        here (triton_fp8 runs blockwise FP8 scaling, not rowwise; library_fp8 needs a rank alone in
        its group ...)").
    """
    if facts.fp8 is None:
        return None
    for phase in Phase:
        if phase not in facts.fp8.phases:
            continue
        reasons = refusals(phase, facts)
        if None in reasons.values():
            continue
        fp8_reasons = [
            f"{implementation.name} {reasons[implementation.name]}"
            for implementation in IMPLEMENTATIONS
            if implementation.runs_fp8(phase)
        ]
        return f"the fused pipeline has no FP8 GEMM for its {phase.value} here ({'; '.join(fp8_reasons)})"
    return None
