"""Per layer: which pipeline each call runs, and why not the fused one.

The fused pipeline runs when the CUDA op builds, the expert-parallel group lies inside one node,
the kernels know the experts' structure, the tokens are bf16/fp16 on the GPU, and an enabled
``"fp8"`` recipe is one its FP8 GEMMs run (blockwise scaling on sm_90, rows and output gradients
crossing the exchange in FP8 or in bf16: the GEMM table's ``fp8_refusal``; otherwise the reference
pipeline emulates the recipe). A group that
spans nodes, its ranks filling them in order, two or more each, runs the hybrid pipeline under the
same conditions (``hybrid.py``: the fused pipeline among each node's ranks, the reference
pipeline's exchange between nodes) unless ``"internode_hybrid"`` is false. Otherwise the layer runs
the reference pipeline and says once why, with the fix, naming the layer (a WARNING on a GPU, where
the user expects the fused one; INFO on CPU). With ``"overlap": "fused"`` a reason is an
error instead, and the experts' structure is checked when the layer is built.

The ranks of the group agree in one collective at the first call, and again whenever the tokens'
dtype, width or device or the layer's settings (the gate's capacity factors, say) change: on the
layer's settings (a difference is an error on every rank
naming the field, the values and the ranks, before any exchange could misread rows), on every rank's
answer to the local checks, and on the hosts and GPUs; the fused workspace is then built by all of
them at once, so every rank takes the same path. Hooks on the experts (or global module hooks)
present at that agreement keep the group on the reference pipeline, which runs them. Hooks that
appear later cannot move one rank alone to another pipeline (its peers would wait in the other
exchange): they are skipped on the fused path, with a warning naming them. DeepSpeed's flops
profiler is such a case: it hooks rank 0's modules for its profile step only. A router whose own
forward runs collectives and whose hooks only that forward runs (stock's top-2 and top-k gates
without dropping) is agreed on the same way: if any rank's has hooks, every rank calls that forward.
"""

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from deepspeed.utils import log_dist, log_dist_once, logger

from ..config import CometMoEConfig
from ..kernels.gemm_phases import Fp8Facts, Phase
from ..kernels.gemm_table import fp8_refusal
from ..kernels.launch import gemm_facts
from ..kernels.workspace import BufferShape, get_buffer
from .chunked import rule_chunks
from .collective_waits import gather_objects, group_ranks
from .exchange_header import GroupDisagreement, LayerHeaders, check_header, setting_differences
from .expert_weights import LocalExperts
from .fp8_emulation import Fp8EmulatedExperts, Fp8Exchange
from .fused import FusedPipeline
from .hybrid import HybridPipeline, NodeSplit, node_group, node_groups_reason
from .interface import Pipeline
from .parameters import choose_parameters, offsets_overflow
from .policy import (
    device_capability,
    fp8_facts,
    fp8_fused_reason,
    fp8_layer_reason,
    fp8_reason,
    group_reason,
    hooks_reason,
    hybrid_layout,
    local_reason,
    module_hooks,
    node_blocks,
    node_name,
    structure_reason,
)
from .reference import ReferencePipeline

# Activations sized by the row bound warn from this multiple of a balanced router's rows a rank:
# without dropping, EP 4 and up (ep_size x min(k, local experts) x tokens against k x tokens).
BOUND_ROWS_WARN = 4

_LAYER_NUMBERS = itertools.count()

# Why a call on which no rank of the group has tokens runs the reference pipeline without an agreement:
# the agreement sizes the fused workspace and the reference pipeline's internode chunks by the most
# tokens a rank feeds (unless "max_tokens_per_rank" fixes it); sized by such a call, the workspace
# would refuse the next call that has any, and the chunks would stay at the rule's fewest.
NO_TOKENS_YET = (
    "no rank of the group has tokens in this call, and the group's agreement (the fused workspace, the "
    'internode chunks) is sized by the first call that has some (or by "moe": '
    '{"max_tokens_per_rank"})'
)


@dataclass
class LayerSpec:
    """What the pipelines need to know of a layer besides its experts; each integration makes one.

    Attributes:
        num_experts: the layer's experts over the expert-parallel group.
        ep_size: the ranks of the group.
        top_k: routes a token (k).
        row_bound: ``row_bound(max_tokens, train)`` -> int: the most rows one rank can receive
            when every rank feeds at most ``max_tokens`` tokens, in the gate's training capacity
            (``train`` True) or its eval capacity; sizes the fused workspace.
        settings: ``settings()`` -> tuple of (name, value) pairs every rank of the group must
            share (k, capacity, ...), read at every call: the group agrees again when they change
            (the row bound, for one, follows the gate's capacity factors).
        scale_before: the routes' weights scale the rows before the experts (AutoEP's
            ``"score_apply": "pre"``); such a layer runs the reference pipeline (under
            ``"overlap": "fused"``, an error).
        router_hooked: ``router_hooked()`` -> bool: whether this rank's router has hooks that only
            its own forward runs, a forward that holds collectives.
        router_agreed: ``router_agreed(hooked_anywhere)``: told, at the group's agreement, whether
            any rank's ``router_hooked()`` was True, so that every rank takes that forward, or none.
    """

    num_experts: int
    ep_size: int
    top_k: int
    row_bound: Callable[[int, bool], int]
    settings: Callable[[], tuple[tuple[str, object], ...]] = tuple
    scale_before: bool = False
    router_hooked: Callable[[], bool] = bool
    router_agreed: Callable[[bool], None] = bool


@dataclass(frozen=True)
class FusedGroup:
    """The ranks the fused kernels run among: the whole expert-parallel group, or, where the group
    spans nodes, the ranks of this rank's node (the hybrid pipeline's fused part).

    Attributes:
        group: their process group.
        ep_size: how many they are.
        num_experts: the experts they hold (numbered from 0 there).
        row_bound: ``row_bound(max_tokens, train)`` -> int: the most rows one of them can receive from
            the others (``LayerSpec.row_bound``'s arguments).
        described: the pipeline as the log line that says the layer runs it names it.
    """

    group: object
    ep_size: int
    num_experts: int
    row_bound: Callable[[int, bool], int]
    described: str


class RankFailure(str):
    """An exception one rank met while checking the fused pipeline, carried to every rank."""


class PipelineSelection:
    """The pipelines of one layer and the choice between them, call by call.

    An integration's layer holds one as ``pipelines`` and, at each call, runs the ``Pipeline``
    that ``pipeline_for`` hands it.

    Args:
        spec: the layer as the pipelines see it (``LayerSpec``).
        experts: this rank's local experts.
        config: the ``"moe"`` section.
        name: the layer in messages (``ds_comet.initialize`` sets it to the module's path; by
            default ``MoE layer <n>``).

    Attributes:
        reference: the ``ReferencePipeline``, always built.
        fused: the ``FusedPipeline``, built by the group's agreement where every rank can run it
            (on the whole group, or where the group spans nodes on this rank's node, inside
            ``hybrid``); else None.
        hybrid: the ``HybridPipeline`` of a group that spans nodes where its agreement built one
            (``fused`` on each node, ``reference`` between nodes); else None.
        reason: why the last call did not run the fused pipeline (None when it did).
        on_agreed: called with this selection whenever its group has agreed on a pipeline (its
            ``reason`` then says which), or None; ``ds_comet.initialize.PipelineSummary`` sets it.
    """

    def __init__(self, spec: LayerSpec, experts: LocalExperts, config: CometMoEConfig, name: str | None = None):
        self.spec = spec
        self.experts = experts
        self.config = config
        self.group = None
        self.reference = ReferencePipeline(
            experts, spec.num_experts, spec.ep_size, wait_timeout_s=config.wait_timeout_s
        )
        self.fused: FusedPipeline | None = None
        self.hybrid: HybridPipeline | None = None
        self.name = name or f"MoE layer {next(_LAYER_NUMBERS)}"
        self.reason: str | None = None
        self.on_agreed: Callable[[PipelineSelection], None] | None = None
        self._agreed_key = None  # what the agreement was made for: the tokens' dtype, width, device, settings
        self._agreed_reason: str | None = None
        self._hooked: list[torch.nn.Module] | None = None
        self._said = set()
        self._fp8_layers: dict[int, object] = {}  # fp8_layer_reason's answer, by hidden size
        self._fp8_facts: Fp8Facts | None = None  # what the fused pipeline's FP8 GEMMs run, where they run the recipe
        self._fp8_applies = False  # whether the last agreement applied the layer's "fp8" recipe
        self.headers = LayerHeaders()  # the header of each call's exchanges (exchange_header.py)
        self.reference.headers = self.headers

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value
        for pipeline in (self.reference, self.fused, self.hybrid):  # their errors name the layer
            if pipeline is not None:
                pipeline.layer_name = value

    def set_group(self, group) -> None:
        """Sets the expert-parallel process group (None for a layer with ep_size 1 and no group); the
        group agrees again at the next call."""
        self.group = group
        self.reference.group = group
        self._agreed_key = None

    def check_structure(self, hidden: int) -> None:
        """Under ``"overlap": "fused"``: raise now if the kernels cannot compute these experts; under
        an ``"fp8"`` recipe with ``"fallback": "error"``, if the recipe cannot apply to the layer."""
        recipe = self.config.fp8
        if recipe.enabled and recipe.fallback == "error" and isinstance(self._fp8_layer(hidden), str):
            self._set_up_fp8(hidden)  # raises
        if self.config.overlap != "fused":
            return
        fused = structure_reason(self.experts, hidden, self.spec.top_k, self.spec.scale_before)
        if isinstance(fused, str):
            raise ValueError(f'"overlap": "fused" was asked for, but {fused}')

    def pipeline_for(self, tokens: torch.Tensor, train: bool = True) -> Pipeline:
        """The pipeline that runs a call on ``tokens``, and the call's exchange header (``headers``).

        The first call (and one on tokens of another dtype, width or device, or with other layer
        settings) makes the group agree, collectively: every rank of the group must call it. A call
        whose collectives the host makes (the agreement, the reference pipeline) first compares its
        header with every rank's (``exchange_header.check_header``).

        Args:
            tokens: [S, H], the call's tokens (only their dtype, width, device and count are read).
            train: whether the layer runs in training mode (the gate's); part of the header.

        Returns:
            ``reference``, ``fused``, or for a group that spans nodes ``hybrid``; ``reason`` then says
            why not the fused kernels (None for ``fused`` and ``hybrid``). Raises ``RuntimeError``
            instead where ``"overlap": "fused"`` was asked for and it cannot run, and
            ``ExchangeMismatch`` where the ranks of the group are not in the same exchange.
        """
        key = (tokens.dtype, tokens.shape[-1], tokens.device, self.spec.settings())
        header = self.headers.begin_call(self.name, train, key, lambda: self._settings(tokens))
        host_exchange = self._agreed_reason is not None or self.hybrid is not None
        if self.spec.ep_size > 1 and (key != self._agreed_key or host_exchange):
            # Before any collective whose size the ranks could disagree on (the fused pipeline's
            # kernels compare the header themselves, with no host sync; the hybrid's fused part
            # compares it only inside its node, and its exchange between nodes is the reference
            # pipeline's, so it is checked here).
            before = (
                _why_agree(self._agreed_key, key) if key != self._agreed_key else "the reference pipeline's exchange"
            )
            check_header(header, self.reference.waits(), before)
        if key != self._agreed_key:
            agreed = self._agree(tokens, _why_agree(self._agreed_key, key))
            if agreed is NO_TOKENS_YET:
                # Nothing to size the workspace by: this call (nothing to compute) runs the reference
                # pipeline, and the group agrees again at the next call. The last agreement stands.
                self.reason = NO_TOKENS_YET
                return self.reference
            self._agreed_reason, self._agreed_key = agreed, key
            self._warn_uncalled_hooks()
            self.reason = agreed
            if self.on_agreed is not None:
                self.on_agreed(self)
        reason = self._agreed_reason
        self.reason = reason
        if reason is None:
            hooks = hooks_reason(self._hookable())
            if hooks is not None:
                self._warn_skipped_hooks(hooks)
            return self.fused if self.hybrid is None else self.hybrid
        if self.config.overlap == "fused":
            raise RuntimeError(f'ds_comet: {self.name}: "overlap": "fused" was asked for, but {reason}')
        self._say_once(reason, tokens)
        return self.reference

    def _hookable(self) -> list[torch.nn.Module]:
        if self._hooked is None:  # walked once: it costs more than checking the hooks on every call
            self._hooked = self.experts.hookable_modules()
        return self._hooked

    def _warn_uncalled_hooks(self) -> None:
        """Hooks on modules that no comet pipeline calls (stock's ``Experts`` container) never run:
        said once, on the rank that has them, with where to put them instead."""
        for module in self.experts.uncalled_modules():
            hooked = module_hooks(module)
            if not hooked:
                continue
            message = (
                f"ds_comet: {self.name}: its {type(module).__name__} container has {' and '.join(hooked)}, "
                "which never run under the comet backend: stock calls the container on its capacity buffer, "
                "which comet does not build. Register them on the expert modules (deepspeed_experts[i]), "
                "which the reference pipeline calls: hooks there at the layer's first call keep it on that "
                "pipeline"
            )
            if message not in self._said:
                self._said.add(message)
                logger.warning(message)

    def _warn_skipped_hooks(self, hooks: str) -> None:
        """Hooks that appeared after the group agreed on the fused pipeline are skipped, with a warning:
        one rank cannot change pipelines alone (its peers would wait in the fused exchange while it
        waited in the reference one), and a per-call agreement would cost a host sync every call.
        DeepSpeed's flops profiler, for one, hooks rank 0's modules at its profile step only."""
        if hooks in self._said:
            return
        self._said.add(hooks)
        logger.warning(
            f"ds_comet: {self.name}: {hooks}. They are skipped on this rank: the expert-parallel group "
            "chose the fused pipeline at the layer's first call, and one rank cannot change pipelines "
            "alone (DeepSpeed's flops profiler will not count the experts). Register such hooks before "
            'the layer\'s first call, or set "moe": {"overlap": "none"}, for them to run'
        )

    def _say_once(self, reason: str, tokens: torch.Tensor) -> None:
        if reason in self._said:
            return
        self._said.add(reason)
        message = f"ds_comet: {self.name} runs the reference pipeline: {reason}"
        if tokens.device.type == "cuda" and self.config.overlap != "none":
            if torch_dist.is_initialized() and torch_dist.get_rank() != 0:
                return
            logger.warning(message)
        else:
            log_dist(message, ranks=[0])

    def _settings(self, tokens: torch.Tensor) -> tuple[tuple[str, object], ...]:
        return (
            (
                ("overlap", self.config.overlap),
                ("num_experts", self.spec.num_experts),
                ("ep_size", self.spec.ep_size),
                ("k", self.spec.top_k),
                ("internode_chunks", self.config.internode_chunks),
                ("internode_forwarding", self.config.internode_forwarding),
                ("internode_hybrid", self.config.internode_hybrid),
            )
            + self.spec.settings()
            + (("hidden size", tokens.shape[-1]), ("dtype", str(tokens.dtype)), ("experts", self.experts.structure()))
            + (("fp8", tuple(self.config.fp8.model_dump().items())),)
        )

    # Under torch.compile this runs as written, not traced: a collective on Python objects, the op's
    # build, the symmetric-memory rendezvous and new CUDA streams, once per layer.
    @torch._disable_dynamo
    def _agree(self, tokens: torch.Tensor, why: str) -> str | None:
        """One collective: every rank's settings, local answer, host, GPU and token count; then, if every
        rank can run the fused pipeline, its workspace. Returns why not fused, or None. ``why`` says
        why this rank asks for the agreement, in the error of a wait that times out."""
        self._fp8_facts = None
        fp8 = self._fp8_applies = self._set_up_fp8(tokens.shape[-1])
        if self.config.overlap == "none":
            fused = '"overlap" is "none"'
        else:
            try:
                fused = local_reason(self.experts, tokens, self.spec.top_k, self.spec.scale_before)
                if not isinstance(fused, str):
                    # Hooks present now keep the whole group on the reference pipeline, which runs them.
                    fused = hooks_reason(self._hookable()) or fused
                if fp8 and not isinstance(fused, str):
                    fused = self._fp8_fused(fused, tokens)
            except Exception as error:  # raised on every rank below, after the collective, not here alone
                fused = RankFailure(f"{type(error).__name__}: {error}")
            if not isinstance(fused, str) and self.group is None:
                fused = "the layer has no expert-parallel group yet (deepspeed.initialize or set_deepspeed_parallelism)"
        reason = fused if isinstance(fused, str) else None
        gpu = None if reason is not None else str(torch.cuda.get_device_properties(tokens.device).uuid)
        rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
        local = (self._settings(tokens), reason, node_name(rank), gpu, tokens.shape[0], self.spec.router_hooked())
        if self.group is None and self.spec.ep_size == 1:
            everyone = [local]
        else:
            everyone = gather_objects(
                local, self.reference.waits(), f"the other ranks' settings for this layer ({why})"
            )
        self._check_settings([entry[0] for entry in everyone])
        self.spec.router_agreed(any(entry[5] for entry in everyone))
        failures = [(rank, entry[1]) for rank, entry in enumerate(everyone) if isinstance(entry[1], RankFailure)]
        if failures:
            raise RuntimeError(
                f"ds_comet: {self.name}: checking the fused pipeline failed on "
                + "; ".join(f"rank {rank}: {failure}" for rank, failure in failures)
            )
        most_tokens = max(entry[4] for entry in everyone)
        if self.config.max_tokens_per_rank is None and most_tokens == 0:
            return NO_TOKENS_YET  # before anything is sized: the standing agreement, if any, keeps its sizes
        self.reference.chunks = self._internode_chunks({entry[2] for entry in everyone}, most_tokens)
        self.reference.ranks_per_node = self._forwarding_ranks([entry[2] for entry in everyone])
        self.hybrid = None
        for rank, (_, rank_reason, _, _, _, _) in enumerate(everyone):
            if rank_reason is not None:
                return rank_reason if len(everyone) == 1 else f"rank {rank}: {rank_reason}"
        nodes, gpus = [entry[2] for entry in everyone], [entry[3] for entry in everyone]
        if len(set(nodes)) > 1:
            return self._build_hybrid(tokens, fused, most_tokens, nodes, gpus)
        reason = group_reason(gpus)
        if reason is not None:
            return reason
        return self._build_fused(tokens, fused, most_tokens, shared_device=len(set(gpus)) < len(gpus))

    def _internode_chunks(self, nodes: set, most_tokens: int) -> int:
        """The reference pipeline's chunks: 1 inside a node; across nodes the config's, else the rule's."""
        if len(nodes) == 1:
            return 1
        if self.config.internode_chunks is not None:
            return self.config.internode_chunks
        return rule_chunks(self.spec.top_k, self.config.max_tokens_per_rank or most_tokens)

    def _forwarding_ranks(self, nodes: list[str]) -> int | None:
        """Ranks a node holds, where the reference pipeline forwards tokens inside nodes
        (``"internode_forwarding"`` on a group that spans nodes); else None."""
        if not self.config.internode_forwarding or len(set(nodes)) == 1:
            return None
        if nodes.count(nodes[0]) == 1:
            return None  # one rank a node: forwarding inside it would send the same rows
        per_node = node_blocks(nodes)
        if per_node is not None:
            return per_node
        message = (
            f'ds_comet: {self.name}: "internode_forwarding" needs the expert-parallel group\'s ranks to fill '
            f"its nodes in order, the same number each; its ranks' nodes are {nodes}: each token goes to each "
            "rank instead"
        )
        # Said by the group's first rank: global rank 0 may be in another group.
        if message not in self._said and torch_dist.get_rank(self.group) == 0:
            self._said.add(message)
            logger.warning(message)
        return None

    def _check_settings(self, settings: list[tuple[tuple[str, object], ...]]) -> None:
        differences = setting_differences(settings)
        if differences:
            raise GroupDisagreement(
                f"ds_comet: {self.name}: the ranks of the expert-parallel group disagree on "
                f"{differences[0]}; every rank must build and call the layer alike"
            )

    def _build_hybrid(self, tokens: torch.Tensor, experts, most_tokens: int, nodes: list, gpus: list) -> str | None:
        """For a group that spans nodes (``nodes``, ``gpus``: each rank's, by rank of the group): the
        hybrid pipeline, its fused part built on this rank's node by that node's ranks; or why the
        layer runs the reference pipeline instead. Decided from what every rank gathered, so that
        every rank of every node decides alike before any node's ranks make their group."""
        per_node = hybrid_layout(nodes, self.config.internode_hybrid)
        if isinstance(per_node, str):
            return per_node
        if self._fp8_applies:
            # The reference pipeline's part would emulate the recipe in float: one layer with two numerics.
            return (
                'the "fp8" recipe has no FP8 exchange between nodes (the reference pipeline emulates it there), '
                'and the hybrid pipeline would run it two ways in one layer; "fp8": {"enabled": false} runs the '
                "hybrid pipeline in bf16"
            )
        reason = node_groups_reason()
        if reason is not None:
            return reason
        starts = range(0, len(nodes), per_node)
        for start in starts:  # every node's ranks, on every rank
            reason = group_reason(gpus[start : start + per_node])
            if reason is not None:
                return reason
        split = NodeSplit(self.spec.num_experts, len(starts), torch_dist.get_rank(self.group) // per_node)
        first = split.node * per_node
        spec, local = self.spec, self.spec.num_experts // self.spec.ep_size

        def row_bound(max_tokens: int, train: bool) -> int:
            # Only the node's ranks send to this workspace: each of their tokens once per local expert
            # it picks, at most; and never more than the whole group could send.
            return min(spec.row_bound(max_tokens, train), max(per_node * min(spec.top_k, local) * max_tokens, 1))

        on = FusedGroup(
            node_group(tuple(group_ranks(self.group)[first : first + per_node])),
            per_node,
            split.node_experts,
            row_bound,
            f"the hybrid pipeline (the fused pipeline among the {per_node} ranks of each of its {split.nodes} nodes, "
            f"the reference pipeline's exchange between them in {self.reference.chunks} chunk(s)); its fused part",
        )
        node_gpus = gpus[first : first + per_node]
        reason = self._build_fused(tokens, experts, most_tokens, len(set(node_gpus)) < per_node, on)
        if reason is not None:
            return reason
        self.hybrid = HybridPipeline(self.fused, self.reference, split)
        self.hybrid.layer_name = self.name
        return None

    def _build_fused(
        self, tokens: torch.Tensor, experts, most_tokens: int, shared_device: bool, on: "FusedGroup | None" = None
    ) -> str | None:
        """The fused pipeline among the ranks ``on`` names (by default the whole group), or why it
        cannot run (its workspace past the kernels' 32-bit offsets)."""
        spec, config = self.spec, self.config
        if on is None:
            on = FusedGroup(self.group, spec.ep_size, spec.num_experts, spec.row_bound, "the fused pipeline")
        max_tokens = config.max_tokens_per_rank or most_tokens
        hidden = tokens.shape[-1]
        num_sms = torch.cuda.get_device_properties(tokens.device).multi_processor_count
        params = choose_parameters(
            config,
            hidden,
            experts.ffn,
            experts.gated,
            spec.top_k,
            on.ep_size,
            max_tokens,
            tokens.element_size(),
            num_sms,
        )
        # Per mode, as the gate's capacity follows it; the workspace holds the larger.
        row_bounds = {train: on.row_bound(max_tokens, train) for train in (True, False)}
        rows = max(row_bounds.values())
        reason = offsets_overflow(rows, max_tokens * spec.top_k, hidden, experts.ffn, experts.gated)
        if reason is not None:
            return reason
        shape = BufferShape(
            ep_size=on.ep_size,
            num_experts=on.num_experts,
            hidden=hidden,
            dtype=tokens.dtype,
            max_tokens=max_tokens,
            max_recv_rows=rows,
            top_k=spec.top_k,
            tile_m=params.tile_m,
        )
        workspace = get_buffer(on.group, shape, config.wait_timeout_s, shared_device)
        by_received = config.activation_rows == "received"
        fp8 = self._fp8_facts
        self.fused = FusedPipeline(workspace, experts, params, on.num_experts, row_bounds, by_received, fp8=fp8)
        self.fused.layer_name = self.name
        self.fused.headers = self.headers
        if not by_received:
            row_bytes = (2 * hidden + experts.ffn * (2 if experts.gated else 1)) * tokens.element_size()
            message = bound_rows_warning(row_bounds[True], spec.top_k * max_tokens, row_bytes)
            if message is not None:
                log_dist_once(message, ranks=[0], level=logging.WARNING)  # once a job, not once a layer
        in_fp8 = "" if fp8 is None else f", FP8 GEMMs: {', '.join(p.value for p in Phase if p in fp8.phases)}"
        log_dist(
            f"ds_comet: {self.name} runs {on.described} ({params}, workspace for {max_tokens} tokens per rank{in_fp8})",
            ranks=[0],
        )
        return None

    def _fp8_layer(self, hidden: int):
        """``fp8_layer_reason`` for this layer (the experts' weights, or why the recipe cannot apply), once."""
        if hidden not in self._fp8_layers:
            self._fp8_layers[hidden] = fp8_layer_reason(
                self.experts, hidden, self.spec.top_k, self.spec.scale_before, self.config.fp8
            )
        return self._fp8_layers[hidden]

    @property
    def fp8_runs(self) -> str | None:
        """Where the layer runs its ``"fp8"`` recipe since its group last agreed: ``"kernels"`` (the
        fused pipeline's FP8 GEMMs and dispatch), ``"emulated"`` (the reference pipeline, in float),
        or None (no recipe, or the layer runs without it: ``"fallback": "bf16"``)."""
        if not self._fp8_applies:
            return None
        if self.reason is None:
            return "kernels" if self._fp8_facts is not None else None
        return "emulated"

    def _set_up_fp8(self, hidden: int) -> bool:
        """Whether the layer runs its ``"fp8"`` recipe: then the reference pipeline emulates it, with
        the experts and the exchanged rows quantised as it says. Where the recipe cannot apply to the
        layer: an error under ``"fallback": "error"``, else a warning, and the layer runs without it."""
        recipe = self.config.fp8
        if not recipe.enabled:
            return False
        fused = self._fp8_layer(hidden)
        if isinstance(fused, str):
            if recipe.fallback == "error":
                raise ValueError(
                    f'ds_comet: {self.name}: its "moe": {{"fp8"}} recipe cannot run: {fused}. Or set "fp8": '
                    '{"fallback": "bf16"} to run the layer without it'
                )
            self.reference.experts, self.reference.fp8_exchange = self.experts, None
            self._warn_once(f'ds_comet: {self.name} runs without its "fp8" recipe ("fallback": "bf16"): {fused}')
            return False
        if not isinstance(self.reference.experts, Fp8EmulatedExperts):
            self.reference.experts = Fp8EmulatedExperts(self.experts, fused, recipe)
            self.reference.fp8_exchange = Fp8Exchange(recipe)
        hooks = hooks_reason(self._hookable())
        if hooks is not None:
            self._warn_once(
                f'ds_comet: {self.name}: under its "fp8" recipe the experts are computed from their weights, '
                f"emulated or by the kernels, without calling their modules: {hooks}"
            )
        return True

    def _fp8_fused(self, fused, tokens: torch.Tensor):
        """Where the fused pipeline could run this call in bf16 under an applied ``"fp8"`` recipe:
        ``fused`` itself where its FP8 GEMMs run the recipe (``_fp8_facts`` then says what they run);
        else why it does not run the recipe (the reason the selection logs, or raises under
        ``"overlap": "fused"``), or, under ``"overlap": "fused"`` with ``"fallback": "bf16"``,
        ``fused`` itself in bf16, with a warning."""
        recipe, hidden = self.config.fp8, tokens.shape[-1]
        capability = device_capability(tokens.device)
        why = fp8_reason(tokens.device, capability, tokens.dtype, hidden, fused.ffn, recipe)
        if why is None:
            facts = fp8_facts(recipe, hidden, fused.ffn)
            alone = self.spec.ep_size == 1
            why = fp8_refusal(gemm_facts(tokens.dtype, fused, capability, alone, facts))
            if why is None:
                self._fp8_facts = facts
                if recipe.scaling == "blockwise":  # the Triton FP8 GEMMs, measured slower than bf16
                    log_dist_once(FP8_KERNELS_SLOWER, ranks=[0], level=logging.WARNING)  # once a job
                return fused
        if self.config.overlap == "fused" and recipe.fallback == "bf16":
            self._warn_once(
                f'ds_comet: {self.name} runs the fused pipeline in bf16, without its "fp8" recipe ("fallback": '
                f'"bf16"): {why}'
            )
            return fused
        return fp8_fused_reason(why)

    def _warn_once(self, message: str) -> None:
        if message in self._said:
            return
        self._said.add(message)
        if not torch_dist.is_initialized() or torch_dist.get_rank() == 0:
            logger.warning(message)


# Said once a job where a layer runs its recipe on the Triton FP8 GEMMs: measured, they do not yet pay
# for themselves (docs/benchmarks.md, "FP8"), and a user who turned FP8 on for speed must know.
FP8_KERNELS_SLOWER = (
    'ds_comet: the "fp8" recipe runs on the fused pipeline\'s FP8 GEMMs, which are not yet tuned: on an '
    "H100 they run at a quarter to a third of the bf16 GEMMs' rate, and the layer is about half as fast as "
    'in bf16 (docs/benchmarks.md, "FP8"). Its numbers are the recipe\'s. For speed, leave "fp8" off or, alone in '
    'the group (EP=1) with AutoEP\'s experts, set "scaling": "rowwise" and "dispatch": "bf16", which runs on '
    "the library's FP8 GEMMs"
)


def _why_agree(agreed_key, key) -> str:
    """Why a rank asks its group to agree: the layer's first call (``agreed_key`` None), or what
    changed on this rank since the last agreement (``agreed_key``) in ``key``: the tokens' dtype,
    width or device, or a setting.

    Only this rank's own change is known here: its peers, whose settings did not change, are not
    in the agreement but in the call's exchange, and the roll call of a wait that times out shows
    each rank this text as where the changed rank waits.
    """
    if agreed_key is None:
        return "the group's agreement at its first call"
    changes = [
        f"{name} changed from {before} to {after}"
        for name, before, after in zip(
            ("the tokens' dtype", "the tokens' width", "the tokens' device"), agreed_key, key
        )
        if before != after
    ]
    before_settings, after_settings = dict(agreed_key[3]), dict(key[3])
    changes += [
        f"{name} changed from {before_settings.get(name)!r} to {value!r}"
        for name, value in after_settings.items()
        if before_settings.get(name) != value
    ]
    if not changes:
        return "the group's agreement again"
    return f"the group's agreement again: on this rank {', '.join(changes)} since the last one"


def refuse_meta(tokens: torch.Tensor, layer_name: str) -> None:
    """Raises ValueError for tokens on the meta device: they hold no values, and the router picks
    each token's experts, and so the rows every rank exchanges, from the values."""
    if tokens.device.type == "meta":
        raise ValueError(
            f"ds_comet: {layer_name} got hidden states on the meta device, which hold no values: the router "
            "picks each token's experts from the values, and the exchange between ranks is sized by those "
            "picks. Call the layer on tensors with values, on the CPU or a GPU"
        )


def bound_rows_warning(rows: int, balanced: int, row_bytes: int) -> str | None:
    """What to tell a user whose layer keeps activations for ``rows`` received rows a training call
    (``"activation_rows": "bound"``), where a balanced router sends a rank ``balanced``, each row
    keeping ``row_bytes`` (its input, its output and the products before the activation); None
    below BOUND_ROWS_WARN times."""
    if rows < BOUND_ROWS_WARN * balanced:
        return None
    return (
        f"ds_comet: a training call of an MoE layer of this shape keeps activations for up to {rows} received "
        f"rows ({rows * row_bytes / 2**30:.2f} GiB a layer), {rows / balanced:.0f}x the {balanced} a balanced "
        'router sends a rank; "moe": {"activation_rows": "received"} sizes them by the rows each call '
        "receives (one host sync a layer call)"
    )
