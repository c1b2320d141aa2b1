"""Where DeepSpeed builds an engine, the ``"moe"`` section takes effect: the hook ``import ds_comet`` sets.

Most Hugging Face users never call ``deepspeed.initialize`` themselves: the ``Trainer`` does, through
Accelerate, which looks the function up on the ``deepspeed`` module when it prepares the model, and
TRL's trainers do the same through the ``Trainer``. AutoEP converts a model's MoE blocks inside the
engine's constructor. So the one place every such job passes, whoever calls what, is
``DeepSpeedEngine.__init__`` (the pipeline and hybrid engines derive from it), and ``import ds_comet``
wraps it once per process:

- before DeepSpeed builds anything, the ds_config's ``"moe"`` section is validated, so that a
  mistyped key fails at once, and, where the process group is already up, the ranks' MoE layers
  are checked to agree on ``ep_size`` (DeepSpeed would wait forever making their groups);
- once the engine is built, ``initialize.apply_moe_section`` runs on it: with ``"backend": "comet"``
  the model's MoE layers become comet layers in place, and a job without a ``"moe"`` section, or
  with ``"backend": "deepspeed"``, stays exactly DeepSpeed's.

The wrapper keeps the constructor's signature, name and docstring, and is installed at most once,
however often the module is imported or reloaded.
"""

import functools
import inspect

from deepspeed.runtime.engine import DeepSpeedEngine

from .config import moe_config_from

# Set on the wrapper, so that a second install (a reload of ds_comet) sees the first one.
HOOK_MARK = "_ds_comet_moe_section"


def install() -> None:
    """Wraps ``DeepSpeedEngine.__init__`` (see the module's docstring); does nothing the second time."""
    original = DeepSpeedEngine.__init__
    if getattr(original, HOOK_MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_with_moe_section(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        given = bound.get("config_class") or bound.get("config")
        config = moe_config_from(given)  # a bad "moe" section fails before the engine is built
        from .integrations.legacy.layer import check_model_ep_sizes

        # Ranks whose MoE layers differ in ep_size would wait forever in DeepSpeed's new_group.
        check_model_ep_sizes(bound.get("model"), config.wait_timeout_s)
        original(self, *args, **kwargs)
        from .initialize import apply_moe_section  # initialize imports the integrations, which import torch ops

        apply_moe_section(self)

    setattr(init_with_moe_section, HOOK_MARK, True)
    DeepSpeedEngine.__init__ = init_with_moe_section
