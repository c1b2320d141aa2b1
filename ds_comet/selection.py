"""Which pipeline a Comet layer runs, and with which fused parameters.

The fused pipeline runs when the op builds, the expert-parallel group lies inside one node, the
experts are FFNs the kernels know, and the tokens are bf16/fp16 on the GPU; otherwise the layer
runs the reference pipeline and says once, through DeepSpeed's logger, why. With
``"overlap": "fused"`` a reason is an error instead.

The one-time checks (op, experts, topology, workspace size) are agreed on by the whole group in one
collective at the first call, and again whenever the tokens' dtype, width or device changes, so
every rank takes the same path; the per-call checks (device, dtype, hooks on the experts) depend
only on what every rank of an SPMD job has alike.
"""

import importlib.util
import math
import socket
from typing import List, Optional

import torch
import torch.distributed as torch_dist
from deepspeed.utils import log_dist

from .config import CometMoEConfig
from .experts import FusedExpert, expert_tensors_reason, fused_expert
from .fused import ExpertTables, FusedCall, FusedParameters, expert_parameters, fused_forward, fused_moe
from .gate import _GLOBAL_HOOKS, _MODULE_HOOKS
from .layout import MAX_COMBINE_TOP_K
from .routing import plan_routes_cuda
from .workspace import BufferShape, allocator_ipc_refusal, get_buffer

FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Rates for the split rule (2 x H200, see shared/device/README.md and docs/performance.md).
GEMM_FLOPS_PER_S = 600e12
LINK_BYTES_PER_S = 300e9
COMBINE_BYTES_PER_SM_S = 24e9  # the combine kernel on its own blocks, bytes read and written per SM
COMBINE_SHARE_OF_GEMM2 = 0.8  # the combine's blocks aim to finish in this share of GEMM2's time


def rule_n_chunks(hidden: int, ffn: int, tile_n: int) -> int:
    """GEMM2's column chunks when the config leaves them open: 4 for wide FFNs, else 8, and at least
    two column tiles a chunk. A one-column chunk rereads every row of the activations with nothing
    for GEMM2's GROUP_M swizzle to share: that cost H2048's GEMM2 15 % alone, and its fused step
    0.1 ms of device time on 2 x H200 (docs/performance.md, thirteenth session)."""
    return min(4 if ffn >= 8192 else 8, max(math.ceil(hidden / tile_n) // 2, 1))


def choose_parameters(config: CometMoEConfig, hidden: int, ffn: int, gated: bool, top_k: int, ep_size: int,
                      max_tokens: int, elem_bytes: int, num_sms: int) -> FusedParameters:
    """The first, simple per-shape rule; every value can be pinned in the "moe" section."""
    max_tokens = max(max_tokens, 1)  # a group whose first call had no tokens still gets a split
    comm_blocks = config.comm_blocks
    if comm_blocks is None:
        routes = top_k * max_tokens
        flops = 2 * routes * hidden * ffn * (3 if gated else 2)
        link_bytes = 2 * routes * hidden * elem_bytes * (ep_size - 1) / ep_size
        share = (link_bytes / LINK_BYTES_PER_S) / (link_bytes / LINK_BYTES_PER_S + flops / GEMM_FLOPS_PER_S)
        comm_blocks = min(max(round(num_sms * share), 8), max(num_sms // 6, 1))
    comm_blocks = min(comm_blocks, max(num_sms - 1, 1))
    combine_blocks = config.combine_blocks
    if combine_blocks is None:
        # Enough blocks for the combine to keep pace with GEMM2 on the other SMs, and no more: what
        # they leave is reduced by every SM once GEMM2 ends, and each block held is a GEMM2 SM lost.
        # With b blocks: bytes / (b rate) = share x gemm2_s x n / (n - b), solved for b.
        routes = top_k * max_tokens
        combine_bytes = (routes + max_tokens) * hidden * elem_bytes
        gemm2_s = 2 * routes * hidden * ffn / GEMM_FLOPS_PER_S
        ratio = combine_bytes / (COMBINE_SHARE_OF_GEMM2 * gemm2_s * COMBINE_BYTES_PER_SM_S * num_sms)
        combine_blocks = math.ceil(num_sms * ratio / (1 + ratio))
    # Never more than the dispatch's: the combine's blocks can start as soon as the dispatch ends and
    # spin until GEMM2s finish, so with more of them than the dispatch frees, they could take SMs that
    # GEMM1's programs still need (fused.py's progress argument).
    combine_blocks = min(combine_blocks, comm_blocks)
    # Measured on H200 (docs/performance.md, scripts/tune_gemm.py): both GEMMs are fastest with
    # 256-column tiles (GEMM2 since it stores rows locally). A gated GEMM1 holds two accumulators:
    # at 256 columns they fit neither the registers nor, with 128 rows and three stages, a Hopper
    # SM's shared memory (240 KB of at most 227 KB), so its tile is at most 128 columns, pinned or not.
    tile_n = config.tile_n or 256
    gemm1_tile_n = min(tile_n, 128) if gated else tile_n
    if config.n_chunks is not None:
        n_chunks = min(config.n_chunks, math.ceil(hidden / tile_n))
    else:
        n_chunks = rule_n_chunks(hidden, ffn, tile_n)
    return FusedParameters(comm_blocks=comm_blocks, combine_blocks=combine_blocks, tile_m=config.tile_m,
                           tile_n=tile_n, n_chunks=n_chunks, gemm1_tile_n=gemm1_tile_n)


def max_received_rows(max_tokens, top_k, num_experts, ep_size, drop_tokens, capacity_factor, eval_capacity_factor,
                      min_capacity) -> int:
    """Most rows one rank can receive in a call, from the gate's own capacity rule."""
    num_local = num_experts // ep_size
    rows = ep_size * min(top_k, num_local) * max_tokens
    if drop_tokens:
        factor = max(capacity_factor, eval_capacity_factor) * top_k
        capacity = max(math.ceil(max_tokens / num_experts * factor) + 1, min_capacity)
        rows = min(rows, num_experts * min(capacity, max_tokens))
    return max(rows, 1)


def offsets_overflow(recv_rows: int, routes: int, hidden: int, ffn: int, gated: bool) -> Optional[str]:
    """Why the kernels' 32-bit row offsets cannot address this workspace, or None."""
    widest = max(hidden, ffn * (2 if gated else 1))
    if max(recv_rows, routes) * widest >= 2**31:
        return (f"{max(recv_rows, routes)} rows of up to {widest} elements exceed the fused kernels' 32-bit "
                "offsets; lower \"moe\": {\"max_tokens_per_rank\"} or the tokens per micro-batch")
    return None


def hooks_reason(modules: List[torch.nn.Module]) -> Optional[str]:
    """Why hooks on the experts (or every module's global hooks) rule out the fused kernels, which
    compute the experts without calling them; checked on every call, as hooks come and go."""
    for name in _GLOBAL_HOOKS:
        if getattr(torch.nn.modules.module, name, None):
            return f"a global module hook is registered ({name[8:]}); the fused kernels do not call the experts"
    for module in modules:
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or \
                module._backward_pre_hooks:
            hooked = [name[1:] for name in _MODULE_HOOKS if getattr(module, name)]
            return (f"an expert's {type(module).__name__} has {' and '.join(hooked)}, which the fused kernels would "
                    "not run: they compute the experts without calling them")
    return None


class PipelineSelector:
    """Per layer: decides reference or fused for each call and owns the fused state."""

    def __init__(self, moe_layer, config: CometMoEConfig):
        self.moe = moe_layer
        self.config = config
        self._said = set()
        self._static_reason: Optional[str] = None
        self._static_key = None  # what the static decision was made for: the tokens' dtype, width and device
        self._hooked: List[torch.nn.Module] = []  # hookable_modules(), once the fused path is chosen
        self._experts: List[FusedExpert] = []
        self._tables = ExpertTables()
        self._buffer = None
        self._params = None
        self._max_rows = {}

    def say_once(self, reason: str):
        if reason not in self._said:
            self._said.add(reason)
            log_dist(f"ds_comet: MoE layer runs the reference pipeline: {reason}", ranks=[0])

    def _per_call_reason(self, tokens: torch.Tensor) -> Optional[str]:
        if self.config.overlap == "none":
            return "\"overlap\" is \"none\""
        if tokens.device.type != "cuda":
            return f"the tokens are on {tokens.device.type}, the fused kernels need CUDA"
        if tokens.dtype not in FUSED_DTYPES:
            return f"the tokens are {tokens.dtype}; the fused kernels run bf16 and fp16"
        if self.moe.ep_group is None:
            return "the layer has no expert-parallel group yet (deepspeed.initialize or set_deepspeed_parallelism)"
        return None

    def _local_static_reason(self, tokens: torch.Tensor) -> Optional[str]:
        experts = []
        for module in self.moe.experts.deepspeed_experts:
            spec = fused_expert(module)
            if isinstance(spec, str):
                return spec
            experts.append(spec)
        first = experts[0]
        hidden = tokens.shape[-1]
        reason = expert_tensors_reason(experts, hidden, tokens.dtype, tokens.device)
        if reason is not None:
            return reason
        if hidden % 8 or first.first.out_features % 8:
            return f"hidden ({hidden}) and FFN ({first.first.out_features}) sizes must be multiples of 8"
        if self.moe.gate.k > MAX_COMBINE_TOP_K:
            return f"k = {self.moe.gate.k}: the fused combine takes at most {MAX_COMBINE_TOP_K} routes per token"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install ds_comet[triton])"
        import triton
        if not hasattr(triton.language, "make_tensor_descriptor"):  # the GEMMs' TMA weight tiles
            return f"triton {triton.__version__} is older than 3.4 (pip install 'triton>=3.4')"
        from .ops import op_unavailable_reason
        reason = op_unavailable_reason()
        if reason is not None:
            return reason
        self._experts = experts
        self._hooked = self.hookable_modules()
        return None

    def hookable_modules(self) -> List[torch.nn.Module]:
        """The modules whose hooks stock would run and the fused kernels skip: kept from the choice
        on, because walking them costs more than checking their hooks on every call."""
        return [self.moe.experts] + [m for expert in self.moe.experts.deepspeed_experts for m in expert.modules()]

    # Under torch.compile this runs as written, not traced (as _run, below): a collective on Python
    # objects, the op's build, the symmetric-memory rendezvous and new CUDA streams, once per layer.
    @torch._disable_dynamo
    def _agree_static(self, tokens: torch.Tensor) -> Optional[str]:
        """One collective: every rank's local reason, host, GPU and token count; then the workspace."""
        group = self.moe.ep_group
        reason = self._local_static_reason(tokens)
        gpu = None if reason is not None else str(torch.cuda.get_device_properties(tokens.device).uuid)
        local = (reason, socket.gethostname(), gpu, tokens.shape[0])
        everyone = [None] * torch_dist.get_world_size(group)
        torch_dist.all_gather_object(everyone, local, group=group)
        for rank, (reason, _, _, _) in enumerate(everyone):
            if reason is not None:
                return reason if len(everyone) == 1 else f"rank {rank}: {reason}"
        if len({host for _, host, _, _ in everyone}) > 1:
            return ("the expert-parallel group spans nodes; the fused kernels need peer memory access inside one "
                    "node")
        shared_device = len({gpu for _, _, gpu, _ in everyone}) < len(everyone)
        refusal = allocator_ipc_refusal() if shared_device else None
        if refusal is not None:
            return (f"ranks of the expert-parallel group share a GPU, so the fused workspace would go through CUDA "
                    f"IPC, which cannot share the caching allocator's blocks with {refusal} (change "
                    "PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF)")
        gate = self.moe.gate
        max_tokens = self.config.max_tokens_per_rank or max(count for _, _, _, count in everyone)
        ffn, gated = self._experts[0].first.out_features, self._experts[0].gate is not None
        elem = tokens.element_size()
        num_sms = torch.cuda.get_device_properties(tokens.device).multi_processor_count
        self._params = choose_parameters(self.config, tokens.shape[-1], ffn, gated, gate.k, self.moe.ep_size,
                                         max_tokens, elem, num_sms)

        def bound(capacity_factor):
            return max_received_rows(max_tokens, gate.k, self.moe.num_local_experts * self.moe.ep_size,
                                     self.moe.ep_size, gate.drop_tokens, capacity_factor, capacity_factor,
                                     gate.min_capacity)

        # Per mode, as the gate's capacity follows it; the workspace holds the larger.
        self._max_rows = {True: bound(gate.capacity_factor), False: bound(gate.eval_capacity_factor)}
        rows = max(self._max_rows.values())
        reason = offsets_overflow(rows, max_tokens * gate.k, tokens.shape[-1], ffn, gated)
        if reason is not None:
            return reason
        shape = BufferShape(ep_size=self.moe.ep_size, num_experts=self.moe.num_local_experts * self.moe.ep_size,
                            hidden=tokens.shape[-1], dtype=tokens.dtype, max_tokens=max_tokens, max_recv_rows=rows,
                            top_k=gate.k, tile_m=self._params.tile_m)
        self._buffer = get_buffer(group, shape, self.config.wait_timeout_s, shared_device)
        log_dist(f"ds_comet: MoE layer runs the fused pipeline ({self._params}, workspace for {max_tokens} tokens "
                 f"per rank)", ranks=[0])
        return None

    @property
    def op(self):
        """The loaded ds_comet op (once the fused path was chosen)."""
        return self._buffer.op

    def fused_runner(self, tokens: torch.Tensor):
        """A callable (tokens, indices, gates) -> output for the fused path, or None for the reference."""
        reason = self._per_call_reason(tokens)
        if reason is None:
            key = (tokens.dtype, tokens.shape[-1], tokens.device)
            if key != self._static_key:  # the first call, or tokens the workspace and checks were not made for
                self._static_reason = self._agree_static(tokens)
                self._static_key = key
            reason = self._static_reason
        if reason is None:
            reason = hooks_reason(self._hooked)
        if reason is None:
            return self._run
        if self.config.overlap == "fused":
            raise RuntimeError(f"\"overlap\": \"fused\" was asked for, but {reason}")
        self.say_once(reason)
        return None

    # Under torch.compile the fused call runs as written, behind one graph break. Dynamo would otherwise
    # trace into the fused autograd function around the op's calls and could put its Triton launches
    # in graphs; a functionalized launch (aot_autograd, inductor) runs on copies of the tensors it
    # writes, while the kernels hand data to peers through raw pointers into the symmetric workspace,
    # which no graph sees. torch._disable_dynamo, not torch.compiler.disable: it imports torch._dynamo
    # at the first call, not at `import ds_comet` (seconds; DeepSpeed's lazy_disable does the same).
    @torch._disable_dynamo
    def _run(self, tokens: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        # The kernels weight routes in fp32; autocast makes the top-2 gate's weights bf16 (exact in fp32).
        gates = gates.float()
        try:
            plan = plan_routes_cuda(self._buffer.op, indices, self.moe.num_local_experts * self.moe.ep_size)
            max_rows = self._max_rows[self.moe.gate.training]
            if torch.is_grad_enabled():  # under no_grad the parameter list is not needed at all
                # The experts' parameters as the fused function takes them (every parameter of the
                # expert kinds it runs), without nn.Module's recursive walk over every local expert.
                params = expert_parameters(self._experts)
                if tokens.requires_grad or gates.requires_grad or any(p.requires_grad for p in params):
                    call = FusedCall(self._buffer, plan, self._experts, self._tables, self._params, max_rows)
                    return fused_moe(call, tokens, gates, params)
            return fused_forward(self._buffer, tokens, plan, gates, self._experts, self._tables, self._params,
                                 max_rows=max_rows)
        except RuntimeError as error:
            # A kernel that gave up on a wait stops the device; name what it waited for if it said so.
            self._buffer.raise_if_failed()
            raise error
