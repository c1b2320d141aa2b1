"""Where a training step's time goes: the MoE layers, the optimizer step, and the rest of the model.

An end-to-end speed-up says little about a MoE backend unless one knows how much of the step the
MoE layers were. ``StepShares`` times, on the device's own clock, each MoE layer's forward and
backward and the optimizer step of the steps it is told to measure::

    shares = StepShares(engine.module, device)
    with shares.step(measure=step > warmup):
        loss = engine(batch)
        engine.backward(loss)
        with shares.optimizer():
            engine.step()
    ...
    print(shares.read().describe())

On CUDA it records events on the current stream (no host sync while a step runs; ``read``
waits for them); elsewhere it reads the host clock, which is right where the device runs
synchronously (CPU).

What counts as what:

- a MoE layer's forward: from entering its ``forward`` to leaving it;
- its backward: from the moment the gradient of its output is ready to the moment the gradient
  of its input is complete, including whatever runs in between (ZeRO's gradient hooks on its
  parameters; and the backward of any other consumer of its input, which runs before that
  gradient is complete: normally none, the input being a norm's output);
- a layer recomputed under activation checkpointing: its recomputation counts as backward, once
  (reentrant checkpointing recomputes it before its backward; non-reentrant, inside it);
- the optimizer: ``engine.step()`` as a whole (with ZeRO: the last gradient reduction, the update,
  the parameters' gather);
- the rest: the step's time less both.

MoE layers are those of the classes in the integrations' table (``integrations/layer_classes.py``:
DeepSpeed's stock ``MOELayer`` and AutoEP's ``AutoEPMoELayer``), and ds_comet's layers, which
derive from them. The backward is timed through hooks on the gradients of the layer's first input
and first output that require one (tensor hooks: the caller may still change the output in place);
a call without both is timed in the forward only.
"""

import contextlib
import time
from dataclasses import dataclass

import torch

from .integrations.layer_classes import moe_layers


@dataclass
class ShareTotals:
    """Milliseconds summed over ``steps`` measured steps."""

    steps: int = 0
    step_ms: float = 0.0
    moe_forward_ms: float = 0.0
    moe_backward_ms: float = 0.0
    optimizer_ms: float = 0.0

    @property
    def rest_ms(self) -> float:
        return self.step_ms - self.moe_forward_ms - self.moe_backward_ms - self.optimizer_ms

    def per_step(self) -> dict:
        """Each part's mean milliseconds a step, and its share of the step (0-1)."""
        steps = max(self.steps, 1)
        parts = {
            "moe_forward": self.moe_forward_ms,
            "moe_backward": self.moe_backward_ms,
            "optimizer": self.optimizer_ms,
            "rest": self.rest_ms,
        }
        result = {"steps": self.steps, "step_ms": self.step_ms / steps}
        for name, total in parts.items():
            result[f"{name}_ms"] = total / steps
            result[f"{name}_share"] = total / self.step_ms if self.step_ms > 0 else 0.0
        return result

    def describe(self) -> str:
        if self.steps == 0:
            return "step shares: no step was measured"
        p = self.per_step()
        moe_ms, moe_share = p["moe_forward_ms"] + p["moe_backward_ms"], p["moe_forward_share"] + p["moe_backward_share"]
        return (
            f"step shares over {self.steps} steps ({p['step_ms']:.2f} ms/step): MoE layers {moe_ms:.2f} ms "
            f"({100 * moe_share:.1f}%: forward {p['moe_forward_ms']:.2f}, backward {p['moe_backward_ms']:.2f}), "
            f"optimizer step {p['optimizer_ms']:.2f} ms ({100 * p['optimizer_share']:.1f}%), rest of the model "
            f"{p['rest_ms']:.2f} ms ({100 * p['rest_share']:.1f}%)"
        )


class _Clock:
    """Timestamps on the device's clock: CUDA events on the current stream, or the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        if not self.cuda:
            return 1000.0 * (end - start)
        return start.elapsed_time(end)


class StepShares:
    """Times the MoE layers, the optimizer step and the whole of the steps it is told to measure.

    Holds hooks on every MoE layer of ``module`` (or on ``layers``, for MoE layers of another
    class) until ``remove()``. Timestamps of measured steps
    wait, unread, until ``read()``, which synchronizes with them and returns the totals so far.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, layers: list[torch.nn.Module] | None = None):
        self.layers = moe_layers(module) if layers is None else list(layers)
        self._clock = _Clock(device)
        self._measuring = False
        # (kind, start, end) of the measured steps not yet read; kind is step, moe_forward,
        # moe_backward or optimizer.
        self._pending: list[tuple[str, object, object]] = []
        # (id(layer), "forward") -> (kind, start) of a call under way; (id(layer), "backward") ->
        # start of a backward under way.
        self._open = {}
        self._totals = ShareTotals()
        self._handles = []
        for layer in self.layers:
            self._handles += [
                layer.register_forward_pre_hook(self._forward_begins),
                layer.register_forward_hook(self._forward_ends),
            ]

    def _forward_begins(self, layer, inputs):
        if not self._measuring:
            return
        kind = "moe_forward"
        if torch._C._current_graph_task_id() != -1:  # called from inside a backward: recomputed
            if (id(layer), "backward") in self._open:
                return  # inside its own backward (non-reentrant checkpointing), which counts it
            kind = "moe_backward"  # before its backward (reentrant checkpointing)
        self._open[id(layer), "forward"] = (kind, self._clock.now())

    def _forward_ends(self, layer, inputs, output):
        if not self._measuring:
            return
        opened = self._open.pop((id(layer), "forward"), None)
        if opened is not None:
            self._pending.append((opened[0], opened[1], self._clock.now()))
        key = (id(layer), "backward")
        first_in, first_out = _first_needing_grad(inputs), _first_needing_grad(output)
        if first_in is None or first_out is None or key in self._open:
            return  # nothing to time, or a recomputation inside the layer's own backward

        def backward_begins(grad):
            if self._measuring:
                self._open[key] = self._clock.now()

        def backward_ends(grad):
            start = self._open.pop(key, None)
            if self._measuring and start is not None:
                self._pending.append(("moe_backward", start, self._clock.now()))

        first_out.register_hook(backward_begins)
        first_in.register_hook(backward_ends)

    @contextlib.contextmanager
    def step(self, measure: bool = True):
        """One training step (forward, backward, optimizer); timed when ``measure``."""
        self._measuring = measure
        start = self._clock.now() if measure else None
        try:
            yield
        finally:
            if measure:
                self._pending.append(("step", start, self._clock.now()))
            self._measuring = False
            self._open.clear()

    @contextlib.contextmanager
    def optimizer(self):
        """The optimizer step (``engine.step()``) inside a measured step."""
        start = self._clock.now() if self._measuring else None
        try:
            yield
        finally:
            if start is not None:
                self._pending.append(("optimizer", start, self._clock.now()))

    def read(self) -> ShareTotals:
        """The totals over every measured step so far (waits for the device's timestamps)."""
        if self._pending and self._clock.cuda:
            self._pending[-1][2].synchronize()
        field = {
            "step": "step_ms",
            "moe_forward": "moe_forward_ms",
            "moe_backward": "moe_backward_ms",
            "optimizer": "optimizer_ms",
        }
        for kind, start, end in self._pending:
            name = field[kind]
            setattr(self._totals, name, getattr(self._totals, name) + self._clock.elapsed_ms(start, end))
            self._totals.steps += kind == "step"
        self._pending.clear()
        return ShareTotals(**vars(self._totals))

    def remove(self):
        """Takes the hooks off the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _first_needing_grad(values):
    """The first tensor in ``values`` (a tensor, or a tuple or list of values) that requires grad."""
    if isinstance(values, torch.Tensor):
        return values if values.requires_grad else None
    if isinstance(values, (tuple, list)):
        for value in values:
            found = _first_needing_grad(value)
            if found is not None:
                return found
    return None
