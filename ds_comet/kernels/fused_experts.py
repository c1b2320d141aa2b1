"""The local experts' weights as the kernels read them (``FusedExperts``).

Expert weights stay where the integration keeps them (one module per expert, or AutoEP's stacked
tensors; ``pipelines.expert_weights`` implements this view for both). The kernels read them
through device tables of per-expert pointers, one table a weight or bias (``POINTER_NAMES``;
``launch.PointerTables`` builds them).
"""

import torch
from torch import Tensor

POINTER_NAMES = ("w1", "b1", "w3", "b3", "w2", "b2")  # each expert's row of the pointer tables
# The projections, each a weight and its bias in POINTER_NAMES: the first ("w1"), the gated experts'
# up projection ("w3") and the second layer ("w2").
PROJECTIONS = ("w1", "w3", "w2")


def projection_slots(projection: str) -> tuple[int, int]:
    """The positions of ``projection``'s weight and bias in ``POINTER_NAMES``."""
    weight = POINTER_NAMES.index(projection)
    return weight, weight + 1


class FusedExperts:
    """What the fused kernels need to know about the local experts.

    ``hidden``, ``ffn``, ``gated``, ``has_bias``, ``activation`` describe them all (they are alike);
    ``pointers()`` gives one row of ``POINTER_NAMES`` data pointers per expert (0 where absent);
    ``parameters()`` the tensors whose gradients the fused backward returns, in its order;
    ``gradients(dw1, db1, dw3, db3, dw2, db2)`` those gradients from the grouped results (``dw1`` the
    first projection's ``[L, F, H]``, ``dw3`` the up projection's (None unless gated), ``dw2``
    ``[L, H, F]``; biases ``[L, F]`` and ``[L, H]`` likewise, None without biases).
    """

    num_local: int
    ffn: int
    gated: bool
    has_bias: bool
    activation: str

    def pointers(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def expert_tensors(self) -> list[tuple[Tensor | None, ...]]:
        """Each local expert's ``POINTER_NAMES`` tensors, None where absent: ``w1`` ``[F, H]``, ``b1``
        ``[F]``, ``w3`` ``[F, H]``, ``b3`` ``[F]``, ``w2`` ``[H, F]``, ``b2`` ``[H]`` (the FP8 emulation's
        view of the weights the pointers point at)."""
        raise NotImplementedError

    def weight_key(self) -> tuple[tuple[int, int], ...]:
        """Each stored weight and bias tensor's ``(data_ptr(), _version)``: what changes when one is
        replaced, moved or updated in place under autograd's eye (``Fp8WeightCache``'s key)."""
        return tuple((t.data_ptr(), t._version) for row in self.expert_tensors() for t in row if t is not None)

    def tensors_reason(self, hidden: int, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why the kernels cannot read these weights for [S, hidden] tokens of dtype on device, or None."""
        raise NotImplementedError

    def weight_dtype(self) -> torch.dtype:
        """The dtype the weights are stored in now (a model may convert them between calls)."""
        raise NotImplementedError

    def parameters(self) -> list[Tensor]:
        raise NotImplementedError

    def with_whole_weights(self, function, *tensors: Tensor):
        """``function(*tensors)`` (a fused call, which reads the weights through their pointers, and
        whose backward reads them again) where the weights are whole while it and its backward run.
        Here they always are; a view of ZeRO-3 partitioned weights runs it inside their module's call."""
        return function(*tensors)

    def stacked(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(w1, w3, w2)`` as ``[L, F, H]``, ``[L, F, H]`` and ``[L, H, F]`` tensors where the experts
        are stored so (what ``torch._grouped_mm`` takes), else None."""
        return None

    def gradients(
        self, dw1: Tensor, db1: Tensor | None, dw3: Tensor | None, db3: Tensor | None, dw2: Tensor, db2: Tensor | None
    ) -> list[Tensor]:
        raise NotImplementedError

    def projection_parameters(self) -> dict[str, list[Tensor]]:
        """By each of ``PROJECTIONS``, its parameters (weights and biases; none for ``"w3"`` unless
        gated), in the order ``projection_gradients`` gives their gradients."""
        raise NotImplementedError

    def projection_gradients(self, projection: str, dw: Tensor, db: Tensor | None) -> list[Tensor]:
        """The gradients of ``projection_parameters(projection)`` from the projection's grouped weight
        gradient ``dw`` (``[L, F, H]``, or ``[L, H, F]`` for ``"w2"``) and bias gradient ``db``
        (``[L, F]`` or ``[L, H]``; None without biases)."""
        raise NotImplementedError
