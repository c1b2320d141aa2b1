"""ds_comet: a DeepSpeed MoE backend that overlaps the expert-parallel all-to-all with the experts.

The package in layers, each using only those below it:

- ``ds_comet.integrations``: where DeepSpeed's MoE layers meet the pipelines: stock
  ``deepspeed.moe.layer.MoE`` (``ds_comet.MoE``, ``build_moe``) and AutoEP's layer; and
  ``ds_comet.initialize``, which converts a model's MoE layers as the ds_config's ``"moe"`` section
  says, wherever DeepSpeed builds an engine once ``ds_comet`` is imported (``engine_hook``);
- ``ds_comet.pipelines``: the reference pipeline (plain torch) and the fused COMET pipeline, and
  the per-layer choice between them;
- ``ds_comet.kernels``: the CUDA op and the Triton GEMMs the fused pipeline launches;
- ``ds_comet.config`` (the ``"moe"`` section, and ``read_ds_config``), ``ds_comet.experts`` (expert
  modules, and ``register_expert`` to tell the kernels where a class keeps its weights) and
  ``ds_comet.fp8`` (the FP8 recipe's quantisation).

For training scripts (examples/train_moe.py uses them): ``ds_comet.checkpoints`` (checkpoints with a
checksum manifest and the run's shape, checked before a resume), ``ds_comet.training_metrics`` (the
run's metrics through DeepSpeed's monitor), ``ds_comet.launch`` (torch.distributed under any launcher,
its timeout from ``"wait_timeout_s"``, ranks that exit with their launcher), ``ds_comet.collectives``
(a script's own collectives, bounded, and DeepSpeed's named when they fail) and
``ds_comet.step_shares`` (where a step's time goes).
"""

from . import engine_hook, experts
from .config import CometMoEConfig, moe_config_from, read_ds_config
from .experts import register_expert
from .initialize import convert_moe_layers, initialize
from .integrations.legacy.layer import CometMOELayer, MoE, build_moe

__version__ = "0.1.0"

# From here on every DeepSpeed engine built in this process honours the "moe" section: the user's own
# deepspeed.initialize, the Hugging Face Trainer, Accelerate and TRL (engine_hook's docstring).
engine_hook.install()

__all__ = [
    "experts",
    "CometMoEConfig",
    "CometMOELayer",
    "MoE",
    "build_moe",
    "convert_moe_layers",
    "initialize",
    "moe_config_from",
    "read_ds_config",
    "register_expert",
    "__version__",
]
