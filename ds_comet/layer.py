"""The Comet MoE layer and the factory that switches between it and stock DeepSpeed."""

from typing import Optional

import deepspeed.moe.layer
from deepspeed.moe.sharded_moe import MOELayer
from deepspeed.utils import groups, log_dist
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
from torch import Tensor

from .config import CometMoEConfig, moe_config_from
from .gate import gate_routes
from .gate_graph import GateGraphs
from .reference import reference_moe
from .routing import plan_routes
from .selection import PipelineSelector


class CometMOELayer(MOELayer):
    """Stock ``MOELayer`` with the dispatch, experts and combine replaced.

    The gate (``TopKGate``) and the experts (``Experts``) are stock DeepSpeed's own modules, so
    routing, capacity, the aux loss, parameter names, expert attributes and checkpoints are
    exactly stock's; ``gate_routes`` runs the gate's routing without the buffer locations and
    capacity that only stock's dispatch reads.
    """

    def __init__(self, gate, experts, ep_group_name, ep_size, num_local_experts, config: CometMoEConfig):
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts)
        self.selector = PipelineSelector(self, config)
        self.gate_graphs = GateGraphs() if config.cuda_graph_gate else None

    @classmethod
    def from_stock(cls, stock: MOELayer, config: CometMoEConfig) -> "CometMOELayer":
        return cls(stock.gate, stock.experts, stock.ep_group_name, stock.ep_size, stock.num_local_experts, config)

    def _set_ep_group(self, ep_group):
        if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            raise NotImplementedError("the comet MoE backend does not support tensor-parallel non-expert layers "
                                      "(mpu tensor parallel size > 1); use \"moe\": {\"backend\": \"deepspeed\"}")
        super()._set_ep_group(ep_group)

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"the MoE layer has ep_size={self.ep_size} but no expert-parallel group: call "
                               "deepspeed.initialize(...) or the layer's set_deepspeed_parallelism() first")
        hidden = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, hidden)
        fused = self.selector.fused_runner(tokens)
        # Stock's routing without the buffer locations (the dispatch places tokens itself); the
        # fused path's op also does its bookkeeping.
        op = self.selector.op if fused is not None else None
        routes = gate_routes if fused is None or self.gate_graphs is None else self.gate_graphs.routes
        self.l_aux, num_experts, indices, gates, self.exp_counts = routes(self.gate, tokens, used_token, op)
        if fused is not None:
            output = fused(tokens, indices, gates)
        else:
            output = reference_moe(tokens, plan_routes(indices, num_experts), gates, self.experts.deepspeed_experts,
                                   self.ep_group, self.ep_size)
        return output.reshape(hidden_states.shape)


class MoE(deepspeed.moe.layer.MoE):
    """``deepspeed.moe.layer.MoE`` with the Comet backend; same arguments plus ``config``.

    ``config`` is the job's ds_config (a dict, a JSON path, a ``DeepSpeedConfig``, an engine) or a
    ``CometMoEConfig``; its ``"moe"`` section picks the backend. With ``"backend": "deepspeed"``
    the layer is stock DeepSpeed's, unchanged. Without a config the layer uses the comet backend.
    """

    def __init__(self,
                 hidden_size: int,
                 expert,
                 num_experts: int = 1,
                 ep_size: int = 1,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4,
                 use_residual: bool = False,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True,
                 config=None) -> None:
        moe_config = CometMoEConfig(backend="comet") if config is None else moe_config_from(config)
        if moe_config.backend == "comet":
            _refuse_unsupported(num_experts, ep_size, k, use_tutel, enable_expert_tensor_parallelism)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        self.moe_config = moe_config
        if moe_config.backend == "comet":
            self.deepspeed_moe = CometMOELayer.from_stock(self.deepspeed_moe, moe_config)
        log_dist(f"MoE backend: {moe_config.backend} (overlap: {moe_config.overlap})", [0])


def _refuse_unsupported(num_experts, ep_size, k, use_tutel, enable_expert_tensor_parallelism):
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size})")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
    if use_tutel:
        raise ValueError("use_tutel=True replaces stock DeepSpeed's dispatch; the comet backend has its own. "
                         "Drop use_tutel, or use \"moe\": {\"backend\": \"deepspeed\"}")
    if enable_expert_tensor_parallelism:
        raise NotImplementedError("the comet MoE backend does not support expert tensor parallelism; "
                                  "set enable_expert_tensor_parallelism=False or use \"moe\": {\"backend\": \"deepspeed\"}")


def build_moe(ds_config=None, **moe_kwargs) -> deepspeed.moe.layer.MoE:
    """The MoE layer the ds_config's ``"moe"`` section asks for.

    ``moe_kwargs`` are ``deepspeed.moe.layer.MoE``'s arguments. Returns stock
    ``deepspeed.moe.layer.MoE`` for ``"backend": "deepspeed"`` (the default) and ``ds_comet.MoE``
    for ``"backend": "comet"``.
    """
    if "config" in moe_kwargs:
        raise TypeError("build_moe takes the ds_config as its first argument, not as config=")
    moe_config = moe_config_from(ds_config)
    if moe_config.backend == "deepspeed":
        return deepspeed.moe.layer.MoE(**moe_kwargs)
    return MoE(config=moe_config, **moe_kwargs)
