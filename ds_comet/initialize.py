"""What the ds_config's ``"moe"`` section does to a DeepSpeed engine, and ``ds_comet.initialize``.

DeepSpeed ignores top-level keys it does not know, so DeepSpeed alone never reads ``"moe"``.
``import ds_comet`` makes every engine DeepSpeed builds in the process honour it
(``engine_hook``: the user's own ``deepspeed.initialize``, the Hugging Face ``Trainer``, Accelerate,
TRL): once DeepSpeed has built the engine (and AutoEP, under ``"expert_parallel"``, has converted
the model's MoE blocks), ``apply_moe_section`` turns every MoE layer of the model into its comet
version in place when the section says ``"backend": "comet"``:

- stock ``deepspeed.moe.layer.MoE``'s inner ``MOELayer`` becomes ``CometMOELayer`` (layers built
  with ``ds_comet.MoE`` / ``build_moe`` already are);
- AutoEP's ``AutoEPMoELayer`` becomes ``CometAutoEPMoELayer``;

as the integrations' table says (``integrations/layer_classes.py``), which also gives what to tell
the user once they are converted. ``ds_comet.initialize`` is ``deepspeed.initialize`` with the same
arguments and results; it remains for scripts that call it (and a script that rebinds
``deepspeed.initialize`` to it gets DeepSpeed's own function underneath, not itself).

Modules, parameters, optimizer state and checkpoints stay what DeepSpeed made; each comet layer is
named after its module path in what it logs. A config that asks for comet on a model without MoE
layers is a warning (an error under ``"overlap": "fused"``). Layers built as comet layers keep the
settings they were built with; where the ds_config has a ``"moe"`` section that asks for other
ones (another backend, or other values), that is an error naming the layers and the keys, not a
section silently ignored. The section is validated before DeepSpeed builds the engine, so that a
mistyped key fails at once, as are (where the process group is already started) the ``ep_size`` of
the model's MoE layers on every rank, which DeepSpeed would otherwise make groups from with calls
that wait forever when the ranks disagree. Once every converted layer has chosen its pipeline (at its first
call), rank 0 says in one WARNING line (the level the ``Trainer`` leaves DeepSpeed's logger at) how
many layers run the comet backend, on which pipeline, and why not the fused one.
"""

import functools
import logging

import deepspeed
import torch.distributed as torch_dist
from deepspeed.utils import log_dist, logger
from torch import nn

from .config import MOE_SECTION, CometMoEConfig, moe_config_from
from .integrations.layer_classes import absent_layers, comet_replacements, conversion_notes, moe_layers

# DeepSpeed's own function, as it was when ds_comet was imported: a script that rebinds
# ``deepspeed.initialize = ds_comet.initialize`` must not make this call itself.
_deepspeed_initialize = deepspeed.initialize


@functools.wraps(_deepspeed_initialize)
def initialize(*args, **kwargs):
    given = kwargs.get("config") or kwargs.get("config_params")
    if given is None:  # deepspeed.initialize(args=...) reads args.deepspeed_config (or its older name)
        namespace = kwargs.get("args", args[0] if args else None)
        given = getattr(namespace, "deepspeed_config", None) or getattr(namespace, "deepscale_config", None)
    if given is not None:
        # A bad "moe" section fails before DeepSpeed starts anything (the process group included);
        # the engine DeepSpeed builds applies the section itself (engine_hook).
        moe_config_from(given)
    return _deepspeed_initialize(*args, **kwargs)


def apply_moe_section(engine) -> list[str]:
    """What the ds_config's ``"moe"`` section does to ``engine`` (a ``DeepSpeedEngine`` just built):
    refuse comet layers built with other settings, convert the model's MoE layers, say what the
    user should know of the conversion, and arrange the summary of the pipelines chosen.

    Returns:
        The converted layers' module paths ([] under ``"backend": "deepspeed"``).
    """
    # The engine's DeepSpeedConfig holds the parsed ds_config however it was given (dict, path, args).
    config = moe_config_from(engine._config)
    param_dict = getattr(engine._config, "_param_dict", None) or {}
    if MOE_SECTION in param_dict:
        refuse_other_settings(engine.module, config)
    converted = convert_moe_layers(engine.module, config)
    if converted:
        for message in conversion_notes(param_dict, config):
            log_dist(message, ranks=[0], level=logging.WARNING)
        PipelineSummary(engine.module)
    return converted


def convert_moe_layers(model: nn.Module, config: CometMoEConfig) -> list[str]:
    """Turn the model's MoE layers into comet layers in place, as ``config`` says; returns their paths.

    With ``"backend": "deepspeed"`` nothing changes. Layers already comet are only named.
    """
    if config.backend != "comet":
        return []
    replacements = comet_replacements()
    converted = []
    for path, module in model.named_modules():
        comet_class = replacements.get(type(module))
        if comet_class is not None:
            comet_class.adopt(module, config)
        pipelines = getattr(module, "pipelines", None)
        if pipelines is not None and hasattr(pipelines, "pipeline_for"):
            pipelines.name = path or type(module).__name__
            converted.append(path)
    if not converted:
        message = (
            'ds_comet: the ds_config asks for "moe": {"backend": "comet"}, but the model has no MoE layer '
            f"to run it: {absent_layers()}"
        )
        if config.overlap == "fused":
            raise ValueError(message)
        logger.warning(message)
    else:
        log_dist(f"ds_comet: {len(converted)} MoE layer(s) run the comet backend", ranks=[0])
    return converted


def refuse_other_settings(model: nn.Module, config: CometMoEConfig) -> None:
    """Raises if a comet layer of ``model`` was built with settings other than ``config``'s (the
    ds_config's ``"moe"`` section), naming the layers and the keys that differ."""
    wanted = config.model_dump()
    differing = {}
    for path, module in model.named_modules():
        pipelines = getattr(module, "pipelines", None)
        if pipelines is None or not hasattr(pipelines, "pipeline_for"):
            continue
        own = pipelines.config.model_dump()
        keys = [key for key in wanted if key != "backend" and own[key] != wanted[key]]
        if config.backend != "comet":
            keys = ["backend"]
        if keys:
            differing[path or type(module).__name__] = ", ".join(
                f"{key}: {own[key]!r} (the ds_config: {wanted[key]!r})" for key in keys
            )
    if not differing:
        return
    if config.backend != "comet":
        fix = (
            "build them with deepspeed.moe.layer.MoE, or with ds_comet.build_moe(ds_config, ...), which "
            "follows the section"
        )
    else:
        fix = "build them with ds_comet.MoE(..., config=ds_config) or ds_comet.build_moe(ds_config, ...)"
    layers = "; ".join(f"{path} ({keys})" for path, keys in differing.items())
    raise ValueError(
        f'ds_comet: the ds_config\'s "moe" section differs from what these comet layers were built '
        f"with, which they keep: {layers}; {fix}"
    )


class PipelineSummary:
    """The one line a job's rank 0 logs, at WARNING, once every comet layer of a model has chosen its
    pipeline (each chooses with its group at its first call): how many layers run the comet
    backend, on which pipeline, and, for those on the reference pipeline, why.

    Built by ``apply_moe_section``; each layer's ``PipelineSelection`` tells it through ``on_agreed``.
    """

    def __init__(self, model: nn.Module):
        self.waiting = {}
        for module in moe_layers(model):
            pipelines = getattr(module, "pipelines", None)
            if pipelines is not None and hasattr(pipelines, "pipeline_for"):
                self.waiting[id(pipelines)] = pipelines
                pipelines.on_agreed = self.agreed
        self.total = len(self.waiting)
        self.outcomes: list[str | None] = []  # each layer's reason; None: the fused kernels run it
        self.hybrid = 0  # of those, layers whose group spans nodes (the hybrid pipeline)
        # Layers running their "fp8" recipe, by where (PipelineSelection.fp8_runs) and the recipe (described).
        self.fp8: dict[tuple[str, str], int] = {}

    def agreed(self, selection) -> None:
        """``selection`` has agreed with its group; its ``reason`` is None when it runs the fused kernels
        (its ``hybrid`` then says whether among the ranks of each node)."""
        if self.waiting.pop(id(selection), None) is None:
            return  # a later agreement (another dtype, changed settings): the summary is said once
        selection.on_agreed = None
        self.outcomes.append(selection.reason)
        self.hybrid += selection.reason is None and selection.hybrid is not None
        if selection.fp8_runs is not None:
            key = (selection.fp8_runs, selection.config.fp8.described())
            self.fp8[key] = self.fp8.get(key, 0) + 1
        if not self.waiting and (not torch_dist.is_initialized() or torch_dist.get_rank() == 0):
            logger.warning(self.line())

    def line(self) -> str:
        fused = self.outcomes.count(None)
        reasons: dict[str, int] = {}
        for reason in self.outcomes:
            if reason is not None:
                reasons[reason] = reasons.get(reason, 0) + 1
        parts = [f"{fused - self.hybrid} on the fused pipeline"] if fused > self.hybrid else []
        if self.hybrid:
            parts.append(
                f"{self.hybrid} on the hybrid pipeline (the fused kernels inside each node, the reference "
                "pipeline's exchange between nodes)"
            )
        parts += [f"{count} on the reference pipeline ({reason})" for reason, count in reasons.items()]
        fp8 = {"kernels": "in the FP8 kernels", "emulated": "emulated in float on the reference pipeline"}
        in_fp8 = [f"{count} {fp8[where]} ({recipe})" for (where, recipe), count in sorted(self.fp8.items())]
        under = f'; their "fp8" recipe: {", ".join(in_fp8)}' if in_fp8 else ""
        return f"ds_comet: {self.total} MoE layer(s) run the comet backend: " + "; ".join(parts) + under
