"""An MoE training run's metrics, written through DeepSpeed's monitor as ``scripts/plot_losses.py`` reads them.

``TrainingMetrics`` takes each step's losses and the tokens each gate routed to each expert, and
writes, on rank 0, through whichever of the ds_config's ``csv_monitor``, ``tensorboard``, ``wandb``
and ``comet`` sections is enabled (the optimizer step as x):

- every step: ``Train/Steps/loss`` and ``Train/Steps/aux_loss`` (means over the ranks) and ``Train/Steps/lr``;
- at the end of each log window: ``Train/Steps/tokens_per_s`` and, per MoE block L and expert E,
  ``Train/Steps/expert_tokens/layer{L}_expert{E}``: the tokens the block's gate routed to the expert
  during the window, all ranks together;
- at the start step (``write_run_info``): ``Run/start_step``, ``Run/world_size``, ``Run/zero_stage``,
  ``Run/tokens_per_step``, ``Run/params_rank0``;
- at the last step (``write_summary``): ``Summary/final_loss``, ``Summary/steady_tokens_per_s`` (the
  steps after the timing warm-up, time handed to ``leave_out`` not counted), ``Summary/step_ms``,
  ``Summary/timed_steps``, ``Summary/train_seconds``, ``Summary/peak_memory_mib`` (on an accelerator:
  the allocator's peak, the largest rank), what the caller adds (an eval loss) and, with a
  ``StepShares``, rank 0's ``Summary/{moe_forward,moe_backward,optimizer,rest}_ms`` and ``..._share``.

Its sums over the ranks wait at most ``ds_comet.collectives``' bound, and a rank that does not come
is named in the error. A loop uses it as::

    metrics = TrainingMetrics(engine, tokens_per_step, moe_blocks, num_experts, start_step, last_step, warmup)
    metrics.write_run_info(params)
    metrics.start()
    for step in range(start_step + 1, last_step + 1):
        ...  # forward, backward, engine.step()
        metrics.record_step(step, lm_loss, aux_loss, lr, expert_counts)
        if step % interval == 0 or step == last_step:
            window = metrics.end_window(step)  # collective
        metrics.leave_out(seconds_spent_saving)
        metrics.step_done(step)
    summary = metrics.finish()  # collective
    metrics.write_summary(summary, last_step)
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from . import collectives


def sum_over_ranks(values: list[float], device: torch.device, where: str = "the training metrics") -> list[float]:
    """Each value summed over the ranks (one all_reduce, float64; collective), waiting at most
    ``ds_comet.collectives``' bound; ``where`` names the step in the error of a wait that times out."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    collectives.all_reduce(tensor, where, "the values of the other ranks")
    return tensor.tolist()


def values_of_ranks(
    values: list[float], device: torch.device, where: str = "the training metrics"
) -> list[list[float]]:
    """[rank 0's values, rank 1's values, ...] of a list of floats per rank (one all_reduce; collective),
    waiting at most ``ds_comet.collectives``' bound; ``where`` as in ``sum_over_ranks``."""
    tensor = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    tensor[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    collectives.all_reduce(tensor, where, "the values of the other ranks")
    return tensor.tolist()


def peak_memory_mib() -> float | None:
    """Most memory the accelerator's allocator held for tensors on this rank so far, in MiB; None on CPU
    (where DeepSpeed's accelerator reports the process's resident size at the moments it is asked)."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return None
    return accelerator.max_memory_allocated() / 2**20


@dataclass(frozen=True)
class Window:
    """A log window's means over its steps and the ranks, and its throughput."""

    loss: float
    aux_loss: float
    tokens_per_s: float


class TrainingMetrics:
    """One run's metrics (see the module's docstring).

    Args:
        engine: the DeepSpeed engine; its ``monitor`` writes the events, its device holds the sums.
        tokens_per_step: tokens all ranks train on in one optimizer step.
        moe_blocks: the index of each MoE block, in the order of the rows of ``record_step``'s counts.
        num_experts: experts of each MoE block.
        start_step: the step the run starts after (0, or a resumed checkpoint's step).
        last_step: the run's last step.
        timing_warmup: steps after ``start_step`` left out of the steady-state throughput (a run too
            short for them is timed whole).
        step_shares: a ``ds_comet.step_shares.StepShares`` timing the steps after ``timing_from``, or None.
    """

    def __init__(
        self, engine, tokens_per_step, moe_blocks, num_experts, start_step, last_step, timing_warmup, step_shares=None
    ):
        self.engine, self.tokens_per_step = engine, tokens_per_step
        self.moe_blocks, self.num_experts = list(moe_blocks), num_experts
        self.start_step, self.last_step, self.step_shares = start_step, last_step, step_shares
        self.device = torch.device(engine.device)
        # Steady-state throughput: from the end of step `timing_from` to the end of the last step,
        # less the time left out (checkpoint saves).
        self.timing_from = start_step + timing_warmup if last_step - start_step > timing_warmup else start_step
        self._window = []  # (step, lm loss, aux loss, lr) of this rank since the last window ended
        self._window_counts = None  # int64 [MoE blocks, experts]: tokens routed since then
        self._last_loss = None
        self._train_start = self._window_start = self._steady_start = None
        self._left_out = 0.0
        self.peaks = None  # finish(): each rank's peak memory in MiB, on an accelerator
        self.share_totals = None  # finish(): the StepShares totals

    def write(self, events: Iterable[tuple[str, float, int]]):
        """Hands ``[(tag, value, step)]`` (Python numbers) to DeepSpeed's monitor, on rank 0, when one is enabled."""
        if self.engine.monitor.enabled and dist.get_rank() == 0:
            self.engine.monitor.write_events(list(events))

    def write_run_info(self, params_rank0: int):
        """The ``Run/`` events at the start step; ``params_rank0``: the parameters rank 0 holds."""
        info = dict(
            start_step=self.start_step,
            world_size=dist.get_world_size(),
            zero_stage=self.engine.zero_optimization_stage(),
            tokens_per_step=self.tokens_per_step,
            params_rank0=params_rank0,
        )
        self.write((f"Run/{name}", value, self.start_step) for name, value in info.items())

    def start(self):
        """Starts the clocks; call it right before the first step."""
        get_accelerator().synchronize()
        self._train_start = self._window_start = time.perf_counter()
        if self.timing_from == self.start_step:
            self._steady_start = self._train_start

    def record_step(self, step: int, lm_loss: float, aux_loss: float, lr: float, expert_counts: torch.Tensor):
        """This rank's step: its losses, its learning rate, and int64 ``[MoE blocks, experts]`` routed tokens."""
        self._window.append((step, lm_loss, aux_loss, lr))
        self._window_counts = expert_counts if self._window_counts is None else self._window_counts + expert_counts

    def end_window(self, step: int) -> Window:
        """Writes the window's events (one all_reduce for all of them) and starts the next (collective)."""
        window, counts = self._window, self._window_counts
        losses = [value for _, lm, aux, _ in window for value in (lm, aux)]
        sums = sum_over_ranks(losses + counts.flatten().tolist(), self.device, f"the metrics of step {step}")
        means = [value / dist.get_world_size() for value in sums[: len(losses)]]
        expert_tokens = [round(value) for value in sums[len(losses) :]]
        get_accelerator().synchronize()
        tokens_per_s = len(window) * self.tokens_per_step / (time.perf_counter() - self._window_start)
        if self.step_shares is not None:
            self.step_shares.read()  # the window's timestamps into the totals (their events freed)
        self._last_loss = means[-2]
        events = []
        for index, (logged_step, _, _, lr) in enumerate(window):
            events += [
                ("Train/Steps/loss", means[2 * index], logged_step),
                ("Train/Steps/aux_loss", means[2 * index + 1], logged_step),
                ("Train/Steps/lr", lr, logged_step),
            ]
        events.append(("Train/Steps/tokens_per_s", tokens_per_s, step))
        for position, block in enumerate(self.moe_blocks):
            for expert in range(self.num_experts):
                count = expert_tokens[position * self.num_experts + expert]
                events.append((f"Train/Steps/expert_tokens/layer{block}_expert{expert}", count, step))
        self.write(events)
        self._window, self._window_counts = [], None
        self._window_start = time.perf_counter()
        return Window(sum(means[0::2]) / len(window), sum(means[1::2]) / len(window), tokens_per_s)

    def leave_out(self, seconds: float):
        """Leaves ``seconds`` (a checkpoint save) out of the window's and the steady state's time."""
        self._window_start += seconds
        if self._steady_start is not None:
            self._left_out += seconds

    def step_done(self, step: int):
        """Call after each step: the steady-state clock starts at the end of step ``timing_from``."""
        if step == self.timing_from:
            get_accelerator().synchronize()
            self._steady_start, self._left_out = time.perf_counter(), 0.0

    def finish(self) -> dict[str, float]:
        """The run's summary, its names without ``Summary/`` (collective: the peak memory of every rank)."""
        get_accelerator().synchronize()
        now = time.perf_counter()
        timed_steps = self.last_step - self.timing_from
        summary = dict(train_seconds=now - self._train_start, timed_steps=max(timed_steps, 0))
        if self._last_loss is not None:
            summary["final_loss"] = self._last_loss
        if self._steady_start is not None and timed_steps > 0:
            seconds = now - self._steady_start - self._left_out
            summary["steady_tokens_per_s"] = timed_steps * self.tokens_per_step / seconds
            summary["step_ms"] = 1000 * seconds / timed_steps
        peak = peak_memory_mib()
        if peak is not None:
            self.peaks = [row[0] for row in values_of_ranks([peak], self.device, "the run's peak memory")]
        if self.peaks is not None:
            summary["peak_memory_mib"] = max(self.peaks)
        if self.step_shares is not None:
            self.share_totals = self.step_shares.read()
            self.step_shares.remove()
            if self.share_totals.steps:
                shares = self.share_totals.per_step().items()
                summary.update((k, v) for k, v in shares if k.endswith(("_ms", "_share")) and k != "step_ms")
        return summary

    def describe(self, summary: dict[str, float]) -> list[str]:
        """The summary's lines for a person: final loss, throughput, peak memory, the step's shares."""
        lines = []
        if "final_loss" in summary:
            lines.append(f"final loss {summary['final_loss']:.4f}")
        if "steady_tokens_per_s" in summary:
            lines.append(
                f"throughput {summary['steady_tokens_per_s']:.0f} tokens/s over steps {self.timing_from + 1}-"
                f"{self.last_step} ({summary['step_ms']:.1f} ms/step, {self.tokens_per_step} tokens/step)"
            )
        if self.peaks is not None:
            per_rank = ", ".join(f"{p:.0f}" for p in self.peaks)
            lines.append(f"peak memory {max(self.peaks):.0f} MiB (max over ranks; per rank {per_rank})")
        if self.step_shares is not None:
            lines.append(f"{self.share_totals.describe()} (rank 0)")
        return lines

    def write_summary(self, summary: dict[str, float], step: int):
        """The ``Summary/`` events, at ``step``."""
        self.write((f"Summary/{name}", value, step) for name, value in summary.items())
