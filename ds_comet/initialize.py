"""``ds_comet.initialize``: ``deepspeed.initialize`` that also honours the ds_config's ``"moe"`` section.

DeepSpeed ignores top-level keys it does not know, so ``deepspeed.initialize`` alone never reads
``"moe"``. ``ds_comet.initialize`` takes the same arguments and returns the same tuple; after
DeepSpeed has built the engine (and AutoEP, under ``"expert_parallel"``, has converted the model's
MoE blocks), it turns every MoE layer of the model into its comet version in place when the
section says ``"backend": "comet"``:

- AutoEP's ``AutoEPMoELayer`` becomes ``CometAutoEPMoELayer``;
- stock ``deepspeed.moe.layer.MoE``'s inner ``MOELayer`` becomes ``CometMOELayer`` (layers built
  with ``ds_comet.MoE`` / ``build_moe`` already are).

Modules, parameters, optimizer state and checkpoints stay what DeepSpeed made; each comet layer is
named after its module path in what it logs. A config that asks for comet on a model without MoE
layers is a warning (an error under ``"overlap": "fused"``).
"""

import functools
import logging
from typing import List

import deepspeed
from deepspeed.moe.sharded_moe import MOELayer
from deepspeed.utils import log_dist, logger
from torch import nn

from .config import CometMoEConfig, moe_config_from
from .integrations.legacy.layer import CometMOELayer


@functools.wraps(deepspeed.initialize)
def initialize(*args, **kwargs):
    engine, *rest = deepspeed.initialize(*args, **kwargs)
    # The engine's DeepSpeedConfig holds the parsed ds_config however it was given (dict, path, args).
    config = moe_config_from(engine._config)
    converted = convert_moe_layers(engine.module, config)
    section = (getattr(engine._config, "_param_dict", None) or {}).get("expert_parallel") or {}
    if converted and section.get("enabled"):
        from .integrations.autoep.layer import moe_keys_message, replaced_keys_message
        for message in (replaced_keys_message(section), moe_keys_message(config)):
            if message is not None:
                log_dist(message, ranks=[0], level=logging.WARNING)
    return (engine, *rest)


def convert_moe_layers(model: nn.Module, config: CometMoEConfig) -> List[str]:
    """Turn the model's MoE layers into comet layers in place, as ``config`` says; returns their paths.

    With ``"backend": "deepspeed"`` nothing changes. Layers already comet are only named.
    """
    if config.backend != "comet":
        return []
    autoep_layer = _autoep_layer_class()
    converted = []
    for path, module in model.named_modules():
        if type(module) is MOELayer:
            CometMOELayer.adopt(module, config)
        elif autoep_layer is not None and type(module) is autoep_layer:
            from .integrations.autoep.layer import CometAutoEPMoELayer
            CometAutoEPMoELayer.adopt(module, config)
        pipelines = getattr(module, "pipelines", None)
        if pipelines is not None and hasattr(pipelines, "pipeline_for"):
            pipelines.name = path or type(module).__name__
            converted.append(path)
    if not converted:
        message = ("ds_comet: the ds_config asks for \"moe\": {\"backend\": \"comet\"}, but the model has no MoE layer "
                   "to run it (no deepspeed.moe.layer.MoE and no block AutoEP converted; for a Hugging Face model, "
                   "enable \"expert_parallel\")")
        if config.overlap == "fused":
            raise ValueError(message)
        logger.warning(message)
    else:
        log_dist(f"ds_comet: {len(converted)} MoE layer(s) run the comet backend", ranks=[0])
    return converted


def _autoep_layer_class():
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:  # a DeepSpeed without AutoEP
        return None
    return AutoEPMoELayer
