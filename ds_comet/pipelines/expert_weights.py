"""A rank's local experts as the pipelines see them, whichever integration holds them.

Two storages exist: one module per expert (stock DeepSpeed's ``Experts`` list, which its
checkpoints require) and AutoEP's ``GroupedExperts``, three stacked parameters ``w1``, ``w3``
``[L, F, H]`` and ``w2`` ``[L, H, F]`` with a gated activation. Both give the reference pipeline
a way to run the experts on rows grouped by local expert, and the fused pipeline a view of their
weights (``FusedExperts``): sizes, one pointer per weight and expert for the kernels' tables, the
parameters autograd accumulates into, and how the grouped weight gradients map onto them.
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..experts import FusedExpert, expert_tensors_reason, forward_mismatch, fused_expert, tensor_reason
from ..kernels.fused_experts import PROJECTIONS, FusedExperts, projection_slots
from ..kernels.host_copies import host_to_device


def full_shape(param: Tensor) -> torch.Size:
    """A parameter's whole shape, also where ZeRO-3 partitions it (between its module's own forward
    hooks its data is then an empty placeholder, and ``ds_shape`` keeps the shape)."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 partitions ``module``'s own parameters (whole only inside its calls)."""
    return any(hasattr(param, "ds_id") for param in module.parameters(recurse=False))


def call_through_hooks(module: nn.Module, function, *tensors: Tensor):
    """``function(*tensors)`` called as ``module``'s forward, through ``module``'s hooks: under ZeRO-3,
    those gather its parameters before and release them after, wrap the outputs so that the
    backward gathers them again before it reaches ``function``'s backward, and the inputs so that
    they are released once it has passed."""
    own = module.__dict__.get("forward")
    module.forward = function  # an instance attribute: nn.Module.__call__ runs it between the hooks
    try:
        return module(*tensors)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


class ModuleFusedExperts(FusedExperts):
    """One module per expert, each read through its ``FusedExpert`` spec."""

    def __init__(self, specs: list[FusedExpert]):
        first = specs[0]
        self.specs = specs
        self.num_local = len(specs)
        self.ffn = first.first.out_features
        self.gated = first.gate is not None
        self.has_bias = first.first.bias is not None
        self.activation = first.activation

    def pointers(self) -> list[tuple[int, ...]]:
        return [tuple(0 if t is None else t.data_ptr() for t in spec.tensors()) for spec in self.specs]

    def expert_tensors(self) -> list[tuple[Tensor | None, ...]]:
        return [spec.tensors() for spec in self.specs]

    def tensors_reason(self, hidden, dtype, device):
        return expert_tensors_reason(self.specs, hidden, dtype, device)

    def weight_dtype(self) -> torch.dtype:
        return self.specs[0].first._parameters["weight"].dtype

    def parameters(self) -> list[Tensor]:
        return [t for spec in self.specs for t in spec.tensors() if t is not None]

    def gradients(self, dw1, db1, dw3, db3, dw2, db2) -> list[Tensor]:
        def per_expert(grads):  # one view per local expert, unbound in one call (indexing costs ~3 us a view)
            return [None] * self.num_local if grads is None else grads.unbind(0)

        columns = [per_expert(g) for g in (dw1, db1, dw3, db3, dw2, db2)]  # FusedExpert.tensors() order
        grads = []
        for spec, candidates in zip(self.specs, zip(*columns)):
            grads += [grad for param, grad in zip(spec.tensors(), candidates) if param is not None]
        return grads

    def projection_parameters(self):
        groups = {projection: [] for projection in PROJECTIONS}
        slots = {projection: projection_slots(projection) for projection in PROJECTIONS}
        for spec in self.specs:  # one read of each expert's tensors (a per-expert read costs microseconds)
            tensors = spec.tensors()
            for projection, group in groups.items():
                group += [tensors[i] for i in slots[projection] if tensors[i] is not None]
        return groups

    def projection_gradients(self, projection, dw, db):
        # The experts are alike (the kernels read them so), so the first says which tensors each has.
        weight_slot, bias_slot = projection_slots(projection)
        first = self.specs[0].tensors()
        kept = (first[weight_slot] is not None, first[bias_slot] is not None)
        biases = [None] * self.num_local if db is None else db.unbind(0)
        return [grad for pair in zip(dw.unbind(0), biases) for grad, keep in zip(pair, kept) if keep]


class StackedFusedExperts(FusedExperts):
    """AutoEP's stacked weights: ``w1``, ``w3`` ``[L, F, H]`` and ``w2`` ``[L, H, F]``, no biases."""

    def __init__(self, grouped: nn.Module, activation: str):
        self.grouped = grouped
        self.num_local, self.ffn, _ = full_shape(grouped.w1)
        self.gated, self.has_bias, self.activation = True, False, activation

    def _weights(self) -> tuple[Tensor, Tensor, Tensor]:
        params = self.grouped._parameters
        return params["w1"], params["w3"], params["w2"]

    def pointers(self) -> list[tuple[int, ...]]:
        w1, w3, w2 = self._weights()
        rows = []
        for expert in range(self.num_local):
            starts = [t.data_ptr() + expert * t.stride(0) * t.element_size() for t in (w1, w3, w2)]
            rows.append((starts[0], 0, starts[1], 0, starts[2], 0))
        return rows

    def expert_tensors(self) -> list[tuple[Tensor | None, ...]]:
        w1, w3, w2 = self._weights()
        return [(w1[expert], None, w3[expert], None, w2[expert], None) for expert in range(self.num_local)]

    def weight_key(self) -> tuple[tuple[int, int], ...]:
        # The stacked tensors themselves: an expert's view shares their version counter, and its address
        # follows theirs (one view per expert would cost a select each).
        return tuple((t.data_ptr(), t._version) for t in self._weights())

    def tensors_reason(self, hidden, dtype, device):
        w1, w3, w2 = self._weights()
        for name, tensor, shape in (
            ("w1", w1, (self.num_local, self.ffn, hidden)),
            ("w3", w3, (self.num_local, self.ffn, hidden)),
            ("w2", w2, (self.num_local, hidden, self.ffn)),
        ):
            if tuple(full_shape(tensor)) != shape:
                return f"the grouped experts' {name} is {tuple(full_shape(tensor))}, the tokens need {shape}"
            reason = tensor_reason(f"the grouped experts' {name}", tensor, dtype, device)
            if reason is not None:
                return reason
        return None

    def weight_dtype(self) -> torch.dtype:
        return self._weights()[0].dtype

    def parameters(self) -> list[Tensor]:
        return list(self._weights())

    def with_whole_weights(self, function, *tensors: Tensor):
        # Under ZeRO-3 (AutoEP's layers run it) the weights are whole only inside GroupedExperts' own
        # calls: the fused call runs as one, so ZeRO-3 gathers, prefetches and releases them as for
        # AutoEP's own call of the module, and no copy of them is kept beyond ZeRO-3's own.
        if not zero3_partitioned(self.grouped):
            return function(*tensors)
        return call_through_hooks(self.grouped, function, *tensors)

    def stacked(self) -> tuple[Tensor, Tensor, Tensor]:
        return self._weights()

    def gradients(self, dw1, db1, dw3, db3, dw2, db2) -> list[Tensor]:
        return [dw1, dw3, dw2]

    def projection_parameters(self):
        return {projection: [self.grouped._parameters[projection]] for projection in PROJECTIONS}

    def projection_gradients(self, projection, dw, db):
        return [dw]


class LocalExperts:
    """The experts a rank holds: run on rows (the reference pipeline) or read by the kernels (fused)."""

    num_local: int

    def run(self, rows: Tensor, counts: Sequence[int]) -> Tensor:
        """The experts' outputs for ``rows`` ([R, H], grouped by local expert, ``counts[l]`` rows each)."""
        raise NotImplementedError

    def parameters(self) -> list[Tensor]:
        """Every parameter of the local experts (whether or not it needs a gradient)."""
        raise NotImplementedError

    def fused(self, hidden: int) -> FusedExperts | str:
        """The weights as the fused kernels read them, or why they cannot compute these experts."""
        raise NotImplementedError

    def hookable_modules(self) -> list[nn.Module]:
        """The modules whose hooks the reference pipeline runs and the fused kernels would skip."""
        raise NotImplementedError

    def uncalled_modules(self) -> list[nn.Module]:
        """Modules of the experts that neither pipeline calls, so that hooks on them never run."""
        return []

    def structure(self) -> tuple:
        """What must be alike on every rank of the group for the exchange to line up (checked by the
        group's agreement): the kind and sizes of the experts."""
        raise NotImplementedError


def _run_module(expert: nn.Module, rows: Tensor) -> Tensor:
    out = expert(rows)
    # DeepSpeed's Experts drops a returned bias term the same way.
    return out[0] if isinstance(out, tuple) else out


class ModuleExperts(LocalExperts):
    """Stock DeepSpeed's ``Experts``: one module per local expert."""

    def __init__(self, container: nn.Module, modules: Sequence[nn.Module]):
        self.container = container
        self.modules = list(modules)
        self.num_local = len(self.modules)

    def run(self, rows, counts):
        # Every expert runs, on no rows if it got none, so every expert parameter gets a (zero)
        # gradient as it does in stock DeepSpeed; ZeRO expects gradients for all of them.
        parts = rows.split(list(counts))
        outputs = [_run_module(expert, part) for expert, part in zip(self.modules, parts)]
        widths = {out.shape[-1] for out in outputs}
        if widths != {rows.shape[-1]} or any(out.shape[:-1] != part.shape[:-1] for out, part in zip(outputs, parts)):
            raise ValueError(
                f"an expert maps rows of {rows.shape[-1]} features to {sorted(widths)}; MoE experts "
                "must return one row of the hidden size per input row"
            )
        return torch.cat(outputs)

    def parameters(self):
        return list(self.container.parameters())

    def fused(self, hidden):
        specs = []
        for module in self.modules:
            spec = fused_expert(module)
            if isinstance(spec, str):
                return spec
            specs.append(spec)
        reason = forward_mismatch(specs[0], hidden)
        return reason if reason is not None else ModuleFusedExperts(specs)

    def hookable_modules(self):
        return [m for expert in self.modules for m in expert.modules()]

    def uncalled_modules(self):
        # Stock calls its Experts container on the [ep, L, C, M] capacity buffer, which ds_comet never
        # builds (it sends uneven rows): each expert is called on its own rows instead.
        return [self.container]

    def structure(self):
        first = self.modules[0]
        return (
            "modules",
            type(first).__qualname__,
            self.num_local,
            tuple((name, tuple(p.shape), str(p.dtype)) for name, p in first.named_parameters()),
        )


class StackedExperts(LocalExperts):
    """AutoEP's ``GroupedExperts``: ``w1``, ``w3`` ``[L, F, H]`` and ``w2`` ``[L, H, F]``."""

    # AutoEP's activations that the kernels compute, by the names ds_comet.experts uses.
    KERNEL_ACTIVATIONS = {"swiglu": "silu", "geglu_tanh": "gelu_tanh"}

    def __init__(self, grouped: nn.Module):
        self.grouped = grouped
        self.num_local = full_shape(grouped.w1)[0]

    def run(self, rows, counts):
        return self.grouped(rows, host_to_device(torch.tensor(list(counts), dtype=torch.int64), rows.device))

    def parameters(self):
        return list(self.grouped.parameters())

    def fused(self, hidden):
        activation = self.KERNEL_ACTIVATIONS.get(self.grouped.activation)
        if activation is None:
            return (
                f"the experts' activation {self.grouped.activation!r} is not one the fused kernels compute "
                f"({', '.join(self.KERNEL_ACTIVATIONS)})"
            )
        return StackedFusedExperts(self.grouped, activation)

    def hookable_modules(self):
        return [self.grouped]

    def structure(self):
        return (
            "stacked",
            self.grouped.activation,
            tuple(full_shape(self.grouped.w1)),
            tuple(full_shape(self.grouped.w2)),
            str(self.grouped.w1.dtype),
        )
