"""Which DeepSpeed MoE layer class each comet layer class replaces: the one table of it.

``ds_comet.initialize`` (``convert_moe_layers``) turns each layer of a table class into its comet
class; ``StepShares`` and the example find a model's MoE layers through it. Classes are named as
``"module:Class"`` and imported when first asked for, so a DeepSpeed without AutoEP leaves AutoEP's
row out rather than failing.

Adding an integration takes a package under ``ds_comet/integrations/`` whose comet class derives
from DeepSpeed's class and has ``adopt(layer, config)`` (turn exactly a DeepSpeed layer into the
comet class in place, with a ``PipelineSelection`` as ``pipelines``), and one row here.
"""

import importlib
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..config import CometMoEConfig


@dataclass(frozen=True)
class Integration:
    """One row of the table.

    Attributes:
        deepspeed_class: ``"module:Class"`` of DeepSpeed's MoE layer class.
        comet_class: ``"module:Class"`` of the comet class that replaces it in place (its
            ``adopt(layer, config)``).
        absent: what a model that has none of these layers lacks, with how one gets them, for the
            warning of ``convert_moe_layers`` on a model without MoE layers.
        notes: ``"module:function"`` or None: ``function(ds_config, config)`` (the ds_config as a
            dict, its ``"moe"`` section) returns what to tell the user, a list of str, once the
            model's layers are converted.
    """

    deepspeed_class: str
    comet_class: str
    absent: str
    notes: str | None = None


INTEGRATIONS = (
    Integration(
        deepspeed_class="deepspeed.moe.sharded_moe:MOELayer",
        comet_class="ds_comet.integrations.legacy.layer:CometMOELayer",
        absent="no deepspeed.moe.layer.MoE",
    ),
    Integration(
        deepspeed_class="deepspeed.module_inject.auto_ep_layer:AutoEPMoELayer",
        comet_class="ds_comet.integrations.autoep.layer:CometAutoEPMoELayer",
        absent='no block AutoEP converted (for a Hugging Face model, enable "expert_parallel")',
        notes="ds_comet.integrations.autoep.layer:conversion_notes",
    ),
)


def _load(name: str):
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _present() -> list[tuple[type, Integration]]:
    """(DeepSpeed's class, its row) for each row whose DeepSpeed class this DeepSpeed has."""
    present = []
    for row in INTEGRATIONS:
        try:
            present.append((_load(row.deepspeed_class), row))
        except ImportError:  # a DeepSpeed without this layer (one without AutoEP)
            continue
    return present


def deepspeed_classes() -> tuple[type, ...]:
    """DeepSpeed's MoE layer classes that this DeepSpeed has; the comet classes derive from them."""
    return tuple(cls for cls, _ in _present())


def comet_replacements() -> dict[type, type]:
    """{DeepSpeed's MoE layer class: the comet class that replaces a layer of exactly that class}."""
    return {cls: _load(row.comet_class) for cls, row in _present()}


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers inside ``model`` (``model`` itself included), in ``modules()`` order:
    DeepSpeed's and the comet layers, which derive from them."""
    classes = deepspeed_classes()
    return [module for module in model.modules() if isinstance(module, classes)]


def absent_layers() -> str:
    """What a model without MoE layers lacks, every row's ``absent`` joined."""
    return " and ".join(row.absent for row in INTEGRATIONS)


def conversion_notes(ds_config: Mapping, config: CometMoEConfig) -> list[str]:
    """What to tell the user once the model's layers are converted: every present row's ``notes``
    on ``ds_config`` (the ds_config as a dict) and ``config`` (its ``"moe"`` section)."""
    messages = []
    for _, row in _present():
        if row.notes is not None:
            messages.extend(_load(row.notes)(ds_config, config))
    return messages
