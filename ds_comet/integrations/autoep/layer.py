"""ds_comet under DeepSpeed AutoEP (``"expert_parallel"`` in the ds_config).

AutoEP replaces a Hugging Face model's MoE blocks with ``AutoEPMoELayer`` inside
``deepspeed.initialize``: its own router, ``GroupedExperts`` (stacked ``w1``, ``w3``, ``w2``) and a
blocking all-to-all. ``CometAutoEPMoELayer`` is that layer with the dispatch, the experts'
computation and the combine on ds_comet's pipelines. It keeps everything else of AutoEP's: the
router and what it computes (scores, group-limited top-k, route normalisation and scaling, score
correction bias, the expert bias), the parameters with their names, 3-D storage, ZeRO and expert
attributes, the checkpoint format, shared experts and the router-logits outputs. ``ds_comet.initialize``
turns every ``AutoEPMoELayer`` of the model into one when the ``"moe"`` section says ``"comet"``.
"""

from collections.abc import Mapping

import torch
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer, RouterOutput
from torch import Tensor

from ...config import CometMoEConfig
from ...pipelines.collective_waits import failures_noted
from ...pipelines.expert_weights import StackedExperts
from ...pipelines.selection import LayerSpec, PipelineSelection, refuse_meta

# "expert_parallel" keys that choose how AutoEP itself exchanges rows or combines: the comet backend
# replaces those parts, so they do nothing under it. What stands in for each. The keys that choose
# how GroupedExperts computes (use_grouped_mm, disable_triton_grouped_mm, gate_up_impl) are not
# here: the reference pipeline calls GroupedExperts, which follows them.
REPLACED_KEYS = {
    "combine_impl": "the combine",
    "row_weighting_impl": "the combine",
    "async_split_plan": "the exchange",
    "comm_qp_margin": "the exchange",
    "comm_num_sm": 'the exchange ("moe": {"comm_blocks"} sets the fused dispatch\'s SMs)',
    "comm_max_tokens_per_rank": 'the exchange ("moe": {"max_tokens_per_rank"} sizes the fused workspace)',
}


def replaced_keys_message(section: dict) -> str | None:
    """What to tell a user whose "expert_parallel" section sets keys the comet backend makes moot
    to values other than AutoEP's defaults."""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    defaults = parse_autoep_config({"enabled": True})
    found = [
        f"{key} ({REPLACED_KEYS[key]})"
        for key in REPLACED_KEYS
        if key in section and section[key] != getattr(defaults, key, None)
    ]
    if not found:
        return None
    return (
        'ds_comet: these "expert_parallel" keys choose parts of AutoEP\'s layer that the comet backend '
        "replaces, so they take no effect: " + "; ".join(found)
    )


def moe_keys_message(config: CometMoEConfig) -> str | None:
    """What to tell a user whose "moe" section sets keys that AutoEP's layers do not use."""
    if not config.cuda_graph_gate:
        return None
    return (
        'ds_comet: "moe": {"cuda_graph_gate": true} replays DeepSpeed\'s TopKGate from CUDA graphs; '
        "AutoEP's layers route with their own router, which runs as it is"
    )


def conversion_notes(ds_config: Mapping, config: CometMoEConfig) -> list[str]:
    """What to tell a user whose model's layers ``ds_comet.initialize`` converted, where the
    ds_config (a dict) enables AutoEP: the keys of either section that do nothing under the comet
    backend (``replaced_keys_message``, ``moe_keys_message``). Read through the integrations table
    (``integrations/layer_classes.py``)."""
    section = ds_config.get("expert_parallel") or {}
    if not section.get("enabled"):
        return []
    messages = (replaced_keys_message(section), moe_keys_message(config))
    return [message for message in messages if message is not None]


def _layer_spec(layer: AutoEPMoELayer) -> LayerSpec:
    ep_size, num_local, top_k = layer.ep_size, layer.num_local_experts, layer.top_k

    def row_bound(max_tokens: int, train: bool) -> int:
        # Dropless: every rank's tokens may all come here, each once per local expert it picks.
        return max(ep_size * min(top_k, num_local) * max_tokens, 1)

    settings = (("integration", "AutoEP"), ("model family", layer.model_family), ("score_apply", layer.score_apply))
    return LayerSpec(
        num_experts=layer.num_experts,
        ep_size=ep_size,
        top_k=top_k,
        row_bound=row_bound,
        settings=lambda: settings,
        scale_before=layer.score_apply == "pre",
    )


class CometAutoEPMoELayer(AutoEPMoELayer):
    """AutoEP's MoE layer with the exchange and the experts on ds_comet's pipelines.

    Made from an ``AutoEPMoELayer`` in place with ``adopt`` (``ds_comet.initialize`` does it), so the
    module, its children and its parameters stay the objects DeepSpeed's engine and optimizer hold.
    Its forward reads as the named steps: AutoEP's router, the pipeline this call runs
    (``pipelines.pipeline_for``), that pipeline's forward on the routes, and AutoEP's output tail
    (shared experts, router logits).
    """

    @classmethod
    def adopt(cls, layer: AutoEPMoELayer, config: CometMoEConfig) -> "CometAutoEPMoELayer":
        """Turn ``layer`` (exactly an ``AutoEPMoELayer``) into this class, in place, and return it."""
        if type(layer) is not AutoEPMoELayer:
            raise TypeError(f"adopt takes an AutoEPMoELayer, got {type(layer).__name__}")
        if layer.comm_backend == "deepep" and layer.ep_size > 1:  # AutoEP uses DeepEP only across ranks
            raise ValueError(
                '"expert_parallel": {"comm_backend": "deepep"} and "moe": {"backend": '
                '"comet"} both replace AutoEP\'s exchange; keep one of them'
            )
        if layer.folding_group_handles is not None and layer.folding_group_handles.spec.tp_size > 1:
            raise NotImplementedError(
                "the comet MoE backend does not run AutoEP's folded tensor parallelism "
                '(tensor_parallel.autotp_size > 1); use "moe": {"backend": "deepspeed"}'
            )
        # Everything that can refuse runs before the class changes: a refused layer stays AutoEP's.
        pipelines = PipelineSelection(_layer_spec(layer), StackedExperts(layer.experts), config)
        pipelines.check_structure(layer.hidden_size)
        if layer.ep_group is not None:
            pipelines.set_group(layer.ep_group)
        layer.__class__ = cls
        layer.pipelines = pipelines
        return layer

    def set_deepspeed_parallelism(
        self, use_data_before_expert_parallel_: bool = False, folding_group_handles=None
    ) -> None:
        if folding_group_handles is not None and folding_group_handles.spec.tp_size > 1:
            raise NotImplementedError(
                "the comet MoE backend does not run AutoEP's folded tensor parallelism "
                '(tensor_parallel.autotp_size > 1); use "moe": {"backend": "deepspeed"}'
            )
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_, folding_group_handles)
        self.pipelines.set_group(self.ep_group)

    def _forward(self, hidden_states: Tensor):
        bsz, seqlen, hdim = hidden_states.shape
        x = hidden_states.reshape(-1, hdim)  # [T, H]
        # The steps before the pipeline's exchange: peers wait there for a rank that raised here.
        with failures_noted(self.pipelines.name, self.ep_size):
            refuse_meta(x, self.pipelines.name)
            routes = RouterOutput(*self.router(x, self.expert_bias))
            with torch.no_grad():
                self.tokens_per_expert.add_(routes.num_tokens_per_expert)
            pipeline = self.pipelines.pipeline_for(x, train=self.training)
        # The pipelines take routes as [k, T]: route j of token t is entry (j, t).
        indices, weights = routes.selected_experts.t(), routes.top_scores.t()
        output = pipeline.forward(x, indices, weights, train=self.training, scale_before=self.score_apply == "pre")
        return self._finalize_output(output.reshape(bsz, seqlen, hdim), x, hidden_states, hdim)
