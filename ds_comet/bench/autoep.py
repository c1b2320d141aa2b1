"""One MoE block of a Hugging Face model, converted by DeepSpeed AutoEP, for the benchmarks.

``autoep_layer`` builds a one-layer model of a family from a config (random weights, no download),
lets AutoEP find and convert its MoE block as ``deepspeed.initialize`` would, and returns the
converted block: AutoEP's own ``AutoEPMoELayer``, or with a ``"moe"`` section asking for comet, the
same block turned into ``CometAutoEPMoELayer``. The same seed gives both the same weights.
"""

import os

import deepspeed
import torch
from deepspeed import comm as dist
from torch import nn

from .common import run_shapes
from .shapes import SHAPES, SWIGLU

FAMILIES = ("mixtral", "qwen3_moe")


def unavailable_reason() -> str | None:
    """Why AutoEP layers cannot be built here, or None."""
    try:
        import transformers  # noqa: F401
        from deepspeed.module_inject.auto_ep import AutoEP  # noqa: F401
    except ImportError as error:
        return f"AutoEP needs Hugging Face transformers 5.16.1 (pip install 'ds_comet[hf]'): {error}"
    return None


def model_for(family: str, hidden: int, ffn: int, experts: int, k: int) -> nn.Module:
    """A one-layer Hugging Face model of ``family`` (random weights from a config) whose MoE block AutoEP converts."""
    heads = max(hidden // 128, 1)
    common = dict(
        vocab_size=128,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=128,
        num_experts_per_tok=k,
    )
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(intermediate_size=ffn, num_local_experts=experts, **common))
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                intermediate_size=ffn,
                moe_intermediate_size=ffn,
                num_experts=experts,
                norm_topk_prob=True,
                head_dim=128,
                **common,
            )
        )
    raise ValueError(f"family {family!r}: the benchmark builds {', '.join(FAMILIES)}")


def autoep_layer(
    family: str,
    hidden: int,
    ffn: int,
    experts: int,
    k: int,
    ep_size: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    moe_section: dict | None = None,
) -> nn.Module:
    """The converted MoE block (see the module's docstring), its expert-parallel group set."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    from ..config import moe_config_from
    from ..initialize import convert_moe_layers

    torch.manual_seed(seed)
    with torch.device(device):
        model = model_for(family, hidden, ffn, experts, k)
    model.to(dtype)
    config = parse_autoep_config(
        {"enabled": True, "autoep_size": ep_size, "preset_model": family, "use_grouped_mm": device.type == "cuda"}
    )
    auto_ep = AutoEP(model, config)
    specs = auto_ep.ep_parser()
    ep_rank = dist.get_rank() % ep_size if dist.is_initialized() else 0
    auto_ep.replace_moe_layers(specs, ep_size=ep_size, ep_rank=ep_rank)
    layer = next(module for module in model.modules() if isinstance(module, AutoEPMoELayer))
    layer.set_deepspeed_parallelism()
    if moe_section is not None:
        convert_moe_layers(layer, moe_config_from({"moe": moe_section}))
    return layer


def run_blocks(selected, bench_block, report):
    """Every rank, on its local GPU, benchmarks AutoEP's block of each shape in ``selected`` (names of
    ``shapes.SWIGLU``; all of them when empty) with ``bench_block(name, family, hidden, ffn, experts,
    k, tokens, device)``, and rank 0 reports as ``common.run_shapes`` does."""
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = {name: SHAPES[name] for name in (selected or SWIGLU)}
    run_shapes(shapes, lambda name, shape: bench_block(name, SWIGLU[name], *shape, device), report, None)
