"""ds_comet under stock DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``).

``ds_comet.MoE`` is stock ``MoE`` whose inner ``MOELayer`` is replaced by ``CometMOELayer``: the
gate (``TopKGate``) and the experts (``Experts``, one module per expert) stay stock DeepSpeed's own
modules, so routing, capacity, the aux loss, parameter names, expert attributes and checkpoints are
exactly stock's; the dispatch, the experts' computation and the combine run on ds_comet's pipelines.
"""

import deepspeed.moe.layer
from deepspeed import comm as dist
from deepspeed.moe.sharded_moe import MOE_TIMER, MOELayer
from deepspeed.utils import groups, log_dist
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
from torch import Tensor

from ...config import CometMoEConfig, moe_config_from
from ...experts import expert_width_reason, row_mixing_reason
from ...pipelines.collective_waits import CollectiveWaits, failures_noted, gather_objects, process_group_timeout_s
from ...pipelines.expert_weights import ModuleExperts
from ...pipelines.parameters import max_received_rows
from ...pipelines.selection import LayerSpec, PipelineSelection, refuse_meta
from .gate import gate_routes, hooks_now, record_group_hooks
from .gate_graph import GateGraphs


def _layer_spec(moe: MOELayer) -> LayerSpec:
    gate, num_experts = moe.gate, moe.num_local_experts * moe.ep_size

    def row_bound(max_tokens: int, train: bool) -> int:
        # The gate's capacity in the mode's factor; read at the choice, as the gate holds it.
        factor = gate.capacity_factor if train else gate.eval_capacity_factor
        return max_received_rows(
            max_tokens, gate.k, num_experts, moe.ep_size, gate.drop_tokens, factor, factor, gate.min_capacity
        )

    def settings():  # read at every call: the row bound follows a change of the capacity factors
        return (
            ("integration", "deepspeed.moe.layer.MoE"),
            ("capacity_factor", gate.capacity_factor),
            ("eval_capacity_factor", gate.eval_capacity_factor),
            ("min_capacity", gate.min_capacity),
            ("drop_tokens", gate.drop_tokens),
            ("use_rts", gate.use_rts),
            ("noisy_gate_policy", gate.noisy_gate_policy),
        )

    return LayerSpec(
        num_experts=num_experts,
        ep_size=moe.ep_size,
        top_k=gate.k,
        row_bound=row_bound,
        settings=settings,
        router_hooked=lambda: hooks_now(gate),
        router_agreed=lambda hooked_anywhere: record_group_hooks(gate, hooked_anywhere),
    )


class CometMOELayer(MOELayer):
    """Stock ``MOELayer`` with the dispatch, experts and combine replaced (see the module's docstring).

    Its forward reads as the named steps: the gate's routes (``gate_routes``: stock's routing
    without the buffer locations only stock's dispatch reads), the pipeline this call runs
    (``pipelines.pipeline_for``), and that pipeline's forward on the routes.
    """

    @classmethod
    def adopt(cls, layer: MOELayer, config: CometMoEConfig) -> "CometMOELayer":
        """Turn stock's ``layer`` (exactly a ``MOELayer``) into this class, in place, and return it: the
        module, its gate, experts, parameters and expert-parallel group stay the same objects."""
        if type(layer) is not MOELayer:
            raise TypeError(f"adopt takes a deepspeed.moe.sharded_moe.MOELayer, got {type(layer).__name__}")
        if layer.ep_group is not None:
            _refuse_tensor_parallel()
        # Everything that can refuse runs before the class changes: a refused layer stays stock's.
        _refuse_top_k(layer.num_local_experts * layer.ep_size, layer.gate.k)
        _refuse_expert_width(layer.experts.deepspeed_experts[0], layer.gate.wg.weight.shape[1])
        reason = row_mixing_reason(layer.experts.deepspeed_experts[0])
        if reason is not None:
            raise ValueError(reason)
        pipelines = PipelineSelection(
            _layer_spec(layer), ModuleExperts(layer.experts, layer.experts.deepspeed_experts), config
        )
        pipelines.check_structure(layer.gate.wg.weight.shape[1])
        if layer.ep_group is not None:
            pipelines.set_group(layer.ep_group)
        layer.__class__ = cls
        layer.pipelines = pipelines
        layer.gate_graphs = GateGraphs() if config.cuda_graph_gate else None
        return layer

    def _set_ep_group(self, ep_group):
        _refuse_tensor_parallel()
        super()._set_ep_group(ep_group)
        self.pipelines.set_group(ep_group)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> Tensor:
        # DeepSpeed's "wall_clock_breakdown" reads the layer's time as stock's forward records it
        # (fwd_moe; with a device sync, as stock's timer makes). The all-to-alls have no time of
        # their own here, overlapped or inside the pipeline: 1st_a2a and 2nd_a2a stay 0.
        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).start()
        output = self._forward(hidden_states, used_token)
        if self.wall_clock_breakdown:
            self.timers(MOE_TIMER).stop()
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)
        return output

    def _forward(self, hidden_states: Tensor, used_token: Tensor | None) -> Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"the MoE layer has ep_size={self.ep_size} but no expert-parallel group: call "
                "deepspeed.initialize(...) or the layer's set_deepspeed_parallelism() first"
            )
        # The steps before the pipeline's exchange: peers wait there for a rank that raised here.
        with failures_noted(self.pipelines.name, self.ep_size):
            refuse_meta(hidden_states, self.pipelines.name)
            hidden = self.gate.wg.weight.shape[1]
            if hidden_states.dim() < 2 or hidden_states.shape[-1] != hidden:
                raise ValueError(
                    f"ds_comet: {self.pipelines.name} takes hidden states [..., {hidden}] (tokens by "
                    f"the model's hidden size), got a tensor of shape {tuple(hidden_states.shape)}"
                )
            tokens = hidden_states.reshape(-1, hidden)
            if used_token is not None:
                self._check_used_token(used_token, tokens.shape[0])
            pipeline = self.pipelines.pipeline_for(tokens, train=self.gate.training)
            # The pipeline says what the gate before it may do: its op's gate kernels may do the
            # integer bookkeeping, and the gate may be replayed from CUDA graphs.
            routes = self.gate_graphs.routes if pipeline.replays_gate and self.gate_graphs is not None else gate_routes
            self.l_aux, _, indices, weights, self.exp_counts = routes(self.gate, tokens, used_token, pipeline.gate_op)
        output = pipeline.forward(tokens, indices, weights, train=self.gate.training)
        return output.reshape(hidden_states.shape)

    def _check_used_token(self, used_token: Tensor, num_tokens: int) -> None:
        # DeepSpeed's gate reads used_token in top-1 routing only; its top-2 and top-k routing
        # take no mask, so stock routes the masked tokens as any other.
        if self.gate.k >= 2:
            raise ValueError(
                f"ds_comet: {self.pipelines.name}: used_token is given, but DeepSpeed's gate applies it only "
                f"with k=1; with k={self.gate.k} stock DeepSpeed ignores it and routes the masked tokens too. "
                "Drop used_token (stock's behaviour), or leave the masked tokens out of the layer's input"
            )
        if used_token.numel() != num_tokens:
            raise ValueError(
                f"ds_comet: {self.pipelines.name}: used_token must hold one entry per token "
                f"({num_tokens}), got shape {tuple(used_token.shape)}"
            )


class MoE(deepspeed.moe.layer.MoE):
    """``deepspeed.moe.layer.MoE`` with the Comet backend; same arguments plus ``config``.

    ``config`` is the job's ds_config (a dict, a JSON path, a ``DeepSpeedConfig``, an engine) or a
    ``CometMoEConfig``; its ``"moe"`` section picks the backend. With ``"backend": "deepspeed"``
    the layer is stock DeepSpeed's, unchanged. Without a config the layer uses the comet backend.
    """

    def __init__(
        self,
        hidden_size: int,
        expert,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        config=None,
    ) -> None:
        moe_config = CometMoEConfig(backend="comet") if config is None else moe_config_from(config)
        _refuse_expert_width(expert, hidden_size)
        if moe_config.backend == "comet":
            _refuse_unsupported(num_experts, ep_size, k, use_tutel, enable_expert_tensor_parallelism)
        super().__init__(
            hidden_size,
            expert,
            num_experts,
            ep_size,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            use_residual,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            use_tutel,
            enable_expert_tensor_parallelism,
            top2_2nd_expert_sampling,
        )
        self.moe_config = moe_config
        if moe_config.backend == "comet":
            CometMOELayer.adopt(self.deepspeed_moe, moe_config)
        log_dist(f"MoE backend: {moe_config.backend} (overlap: {moe_config.overlap})", [0])

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.ep_size > world or world % self.ep_size:
            raise ValueError(
                f"ep_size={self.ep_size} does not divide the {world} ranks of this job: each "
                "expert-parallel group takes ep_size ranks; choose an ep_size that divides the world "
                "size (and num_experts)"
            )
        if world > 1:
            pipelines = getattr(self.deepspeed_moe, "pipelines", None)
            name = pipelines.name if pipelines is not None else "an MoE layer"
            agree_on_ep_sizes([(name, self.ep_size)], self.moe_config.wait_timeout_s)
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_)


def agree_on_ep_sizes(layers: list[tuple[str, int]], wait_timeout_s: float) -> None:
    """Raises ValueError unless every rank gives the same ep_size for each of ``layers`` (``(name,
    ep_size)`` in the order the engine sets them up), naming the layer and each rank's value (a
    gather over the default group; collective).

    DeepSpeed makes a layer's expert-parallel groups from its ep_size, with ``new_group`` calls that
    every rank must make alike: ranks that disagree would wait there forever, without a word. The
    gather waits as long as those calls would (the process groups' timeout for ``wait_timeout_s``):
    ranks reach the set-up further apart than a layer's calls (building the model, loading data).
    """
    timeout_s = process_group_timeout_s(wait_timeout_s)
    waits = CollectiveWaits(None, timeout_s, "the MoE layers' ep_size", "the job", "did not come to this collective")
    everyone = gather_objects(list(layers), waits, "the other ranks' ep_size of each MoE layer")
    counts = [len(ranks_layers) for ranks_layers in everyone]
    if len(set(counts)) > 1:
        found = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
        raise ValueError(
            f"ds_comet: the ranks have different numbers of MoE layers ({found}); every rank must build the same model"
        )
    for position, entries in enumerate(zip(*everyone)):
        if len({ep_size for _, ep_size in entries}) > 1:
            values = ", ".join(f"rank {rank}: {name} has ep_size={ep}" for rank, (name, ep) in enumerate(entries))
            raise ValueError(
                f"ds_comet: the ranks build MoE layer {position + 1} of {counts[0]} with different ep_size ({values}); "
                "DeepSpeed makes its expert-parallel groups from ep_size, with calls every rank must make alike: "
                "build each MoE layer with the same ep_size on every rank"
            )


def check_model_ep_sizes(model, wait_timeout_s: float) -> None:
    """``agree_on_ep_sizes`` on the ``deepspeed.moe.layer.MoE`` layers of ``model`` (stock's and
    ds_comet's), named by their paths: collective, before DeepSpeed makes their groups. Nothing
    to check without a process group of several ranks (DeepSpeed then starts it, and
    ``MoE.set_deepspeed_parallelism`` checks ds_comet's layers)."""
    if model is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    layers = [
        (path or type(module).__name__, module.ep_size)
        for path, module in model.named_modules()
        if isinstance(module, deepspeed.moe.layer.MoE)
    ]
    agree_on_ep_sizes(layers, wait_timeout_s)


def _refuse_tensor_parallel():
    if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
        raise NotImplementedError(
            "the comet MoE backend does not support tensor-parallel non-expert layers "
            '(mpu tensor parallel size > 1); use "moe": {"backend": "deepspeed"}'
        )


def _refuse_expert_width(expert, hidden_size: int) -> None:
    reason = expert_width_reason(expert, hidden_size)
    if reason is not None:
        raise ValueError(f"{reason}: build the expert for rows of hidden_size features")


def _refuse_top_k(num_experts: int, k: int) -> None:
    # Stock's top-2 gate with one expert sends both routes to it, which the fused workspace's row
    # bound (a token at most once per local expert) does not admit.
    if not 1 <= k <= num_experts:
        raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")


def _refuse_unsupported(num_experts, ep_size, k, use_tutel, enable_expert_tensor_parallelism):
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size})")
    _refuse_top_k(num_experts, k)
    if use_tutel:
        raise ValueError(
            "use_tutel=True replaces stock DeepSpeed's dispatch; the comet backend has its own. "
            'Drop use_tutel, or use "moe": {"backend": "deepspeed"}'
        )
    if enable_expert_tensor_parallelism:
        raise NotImplementedError(
            "the comet MoE backend does not support expert tensor parallelism; "
            "set enable_expert_tensor_parallelism=False or use "
            '"moe": {"backend": "deepspeed"}'
        )


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
        if "expert" in moe_kwargs and "hidden_size" in moe_kwargs:
            _refuse_expert_width(moe_kwargs["expert"], moe_kwargs["hidden_size"])
        return deepspeed.moe.layer.MoE(**moe_kwargs)
    return MoE(config=moe_config, **moe_kwargs)
