"""Whether the fused pipeline can run a layer's call, and if not, why (with the fix); likewise
whether an ``"fp8"`` recipe applies to a layer, and whether FP8 GEMMs can run it.

Each check returns None when it passes and otherwise a sentence that names what stands in the way
and what to do about it; ``pipelines.selection`` logs it (or, under ``"overlap": "fused"``,
raises it). The checks come in three kinds: per rank, before the group agrees (``local_reason``);
over the group's gathered facts (``group_reason``; for a group that spans nodes, ``hybrid_layout``);
and per call, for what can change between calls (``hooks_reason``).
"""

import functools
import importlib.util
import inspect
import os
import socket
import types
from collections.abc import Sequence

import torch

from ..config import Fp8Recipe
from ..fp8 import BLOCK as FP8_BLOCK
from ..kernels.constants import MAX_COMBINE_TOP_K
from ..kernels.fused_experts import FusedExperts
from ..kernels.gemm_phases import Fp8Facts, Phase
from ..kernels.workspace import allocator_ipc_refusal
from .expert_weights import LocalExperts

FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Module-level hooks make nn.Module.__call__ take its slow path; a direct call would skip them.
GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


RANKS_PER_NODE_VAR = "DS_COMET_RANKS_PER_NODE"


def node_name(rank: int) -> str:
    """The node a rank runs on: its host, or with DS_COMET_RANKS_PER_NODE=n set, its block of n
    ranks on that host, so that one machine can test what a group spanning nodes does."""
    value = os.environ.get(RANKS_PER_NODE_VAR, "").strip()
    if not value:
        return socket.gethostname()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RANKS_PER_NODE_VAR} must be a positive integer (ranks a node holds), got {value!r}")
    return f"{socket.gethostname()}/node {rank // int(value)}"


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (non-reentrant checkpointing, offloading) see what autograd saves."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown: assume they are


def tokens_reason(tokens: torch.Tensor) -> str | None:
    """Why the fused kernels cannot take these tokens, or None."""
    if tokens.device.type != "cuda":
        return f"the tokens are on {tokens.device.type}; the fused kernels need CUDA"
    current = torch.cuda.current_device()
    if tokens.device.index is not None and tokens.device.index != current:
        return (
            f"the tokens are on {tokens.device} but the current CUDA device is cuda:{current}, where the fused "
            f"workspace is built (call torch.cuda.set_device({tokens.device.index}) first, as DeepSpeed's "
            "launcher does for each rank)"
        )
    if tokens.dtype not in FUSED_DTYPES:
        return (
            f'the tokens are {tokens.dtype}; the fused kernels run bf16 and fp16 (enable "bf16" or "fp16" '
            "in the ds_config)"
        )
    return None


def runtime_reason() -> str | None:
    """Why this machine's software cannot run the fused kernels (Triton, the CUDA op), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'ds_comet[triton]')"
    import triton

    if not hasattr(triton.language, "make_tensor_descriptor"):  # the GEMMs' TMA weight tiles
        return f"triton {triton.__version__} is older than 3.4 (pip install 'triton>=3.4')"
    from ..kernels.ops import op_unavailable_reason

    return op_unavailable_reason()


def structure_reason(experts: LocalExperts, hidden: int, top_k: int, scale_before: bool = False) -> FusedExperts | str:
    """The experts as the kernels read them, or why the kernels cannot compute this layer (no device needed)."""
    fused = experts.fused(hidden)
    if isinstance(fused, str):
        return fused
    if hidden % 8 or fused.ffn % 8:
        return f"hidden ({hidden}) and FFN ({fused.ffn}) sizes must be multiples of 8 for the fused kernels"
    if top_k > MAX_COMBINE_TOP_K:
        return f"k = {top_k}: the fused combine takes at most {MAX_COMBINE_TOP_K} routes per token"
    if scale_before:
        return (
            'the router\'s scores are applied before the experts ("score_apply": "pre"), which the fused '
            'kernels do not do; use "post" (every AutoEP preset\'s default)'
        )
    return fused


def fp8_fused_reason(why: str) -> str:
    """Why a layer under an enabled ``"fp8"`` recipe does not run the fused pipeline, where nothing
    else stands in its way: ``why`` (``fp8_reason``'s or the GEMM table's answer), with the fixes."""
    return (
        f'the "fp8" recipe is enabled, and {why}: the reference pipeline emulates the recipe ("overlap": "auto" '
        'or "none"); under "overlap": "fused", "fp8": {"fallback": "bf16"} runs the fused kernels in bf16, and '
        '"fp8": {"enabled": false} runs them without the recipe'
    )


def fp8_shape_reason(recipe: Fp8Recipe, hidden: int, ffn: int) -> str | None:
    """Why ``recipe`` cannot scale the GEMMs of experts of these sizes, or None:
    blockwise scaling tiles every GEMM's reduction dimension (H and F, both ways) by 128."""
    if recipe.scaling == "blockwise" and (hidden % FP8_BLOCK or ffn % FP8_BLOCK):
        return (
            f"blockwise FP8 scaling quantises rows in 1x{FP8_BLOCK} tiles along each GEMM's reduction dimension, "
            f"which needs hidden ({hidden}) and FFN ({ffn}) sizes that are multiples of {FP8_BLOCK}; use "
            '"scaling": "rowwise"'
        )
    return None


def fp8_facts(recipe: Fp8Recipe, hidden: int, ffn: int) -> Fp8Facts:
    """What ``recipe`` asks of the GEMMs of a layer of these sizes (H, F), as the GEMM table reads it."""
    phases = set()
    if recipe.forward:
        phases |= {Phase.FIRST_LAYER, Phase.GEMM2} if recipe.gemm2 else {Phase.FIRST_LAYER}
    if recipe.input_gradients:
        phases |= {Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD} if recipe.gemm2 else {Phase.FIRST_LAYER_BACKWARD}
    if recipe.weight_gradients:
        phases.add(Phase.WEIGHT_GRADIENTS)
    return Fp8Facts(
        frozenset(phases),
        recipe.scaling,
        recipe.gradient_format,
        hidden,
        ffn,
        rows_in_fp8=recipe.dispatch == "fp8",
        gradients_in_fp8=recipe.gradient_dispatch == "fp8",
    )


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device``'s GPU, None off CUDA."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def fp8_layer_reason(
    experts: LocalExperts, hidden: int, top_k: int, scale_before: bool, recipe: Fp8Recipe
) -> FusedExperts | str:
    """The experts' weights as the ``"fp8"`` ``recipe`` quantises them, or why it
    cannot apply to this layer, emulated or not: it computes what the fused kernels compute, in FP8."""
    fused = structure_reason(experts, hidden, top_k, scale_before)
    if isinstance(fused, str):
        return f"the FP8 recipe computes the experts as the fused kernels do, and {fused}"
    return fp8_shape_reason(recipe, hidden, fused.ffn) or fused


def fp8_reason(
    device: torch.device,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    hidden: int,
    ffn: int,
    recipe: Fp8Recipe,
) -> str | None:
    """Why FP8 GEMMs cannot run ``recipe`` for [S, hidden] tokens of ``dtype`` on
    ``device`` (a GPU of compute ``capability``), experts of FFN size ``ffn``; None where they can.
    What the fused pipeline's FP8 GEMMs need beyond it, the GEMM table says
    (``gemm_table.fp8_refusal``); on CPU the reference pipeline emulates the recipe instead."""
    if device.type != "cuda":
        return f"the tokens are on {device.type}; FP8 GEMMs need a CUDA GPU"
    if capability is None or tuple(capability) < (8, 9):
        shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return f"FP8 tensor cores need compute capability 8.9 or newer (Ada, Hopper); this GPU has {shown}"
    if dtype != torch.bfloat16:
        return f'the FP8 recipe runs bf16 tokens, these are {dtype} (enable "bf16" in the ds_config)'
    return fp8_shape_reason(recipe, hidden, ffn)


def local_reason(
    experts: LocalExperts, tokens: torch.Tensor, top_k: int, scale_before: bool = False
) -> FusedExperts | str:
    """This rank's answer for these tokens: the experts as the kernels read them, or why not."""
    reason = tokens_reason(tokens)
    if reason is not None:
        return reason
    fused = structure_reason(experts, tokens.shape[-1], top_k, scale_before)
    if isinstance(fused, str):
        return fused
    reason = fused.tensors_reason(tokens.shape[-1], tokens.dtype, tokens.device)
    if reason is not None:
        return reason
    return runtime_reason() or fused


def group_reason(gpus: Sequence[str | None]) -> str | None:
    """Why ranks of one node, by GPU, cannot share a fused workspace, or None (a group that spans
    nodes: ``hybrid_layout``)."""
    if len(set(gpus)) < len(gpus):
        refusal = allocator_ipc_refusal()
        if refusal is not None:
            return (
                f"ranks of the expert-parallel group share a GPU, so the fused workspace would go through CUDA "
                f"IPC, which cannot share the caching allocator's blocks with {refusal} (change "
                "PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF)"
            )
    return None


def node_blocks(nodes: Sequence[str]) -> int | None:
    """Ranks a node holds, where a group's ranks (``nodes``: each one's node, by rank of the group)
    fill their nodes in order, the same number each; else None."""
    per_node = nodes.count(nodes[0])
    blocks = list(nodes[::per_node])  # each node's name once, if its ranks come together
    if len(set(blocks)) == len(blocks) and list(nodes) == [name for name in blocks for _ in range(per_node)]:
        return per_node
    return None


def hybrid_layout(nodes: Sequence[str], enabled: bool) -> int | str:
    """Ranks a node holds, where the hybrid pipeline (the fused kernels among each node's ranks) can
    run a group that spans nodes (``nodes``: each rank's node, by rank of the group); else why not.
    ``enabled``: the config's ``"internode_hybrid"``."""
    spans = "the expert-parallel group spans nodes"
    fallback = "the layer runs the reference pipeline's NCCL all-to-alls"
    if not enabled:
        return f'{spans} and "internode_hybrid" is false: {fallback}'
    per_node = node_blocks(nodes)
    if per_node is None:
        return (
            f"{spans}, and its ranks do not fill them in order, the same number each (their nodes, by rank of "
            f"the group: {list(nodes)}), as the fused kernels among each node's ranks need: {fallback}"
        )
    if per_node == 1:
        return (
            f"{spans} with one rank a node; the fused kernels run among the ranks of one node (peer memory), "
            f"which takes two at least: {fallback}"
        )
    return per_node


def hooks_reason(modules: list[torch.nn.Module]) -> str | None:
    """Why hooks on the experts (or every module's global hooks) would not run on the fused kernels,
    which compute the experts without calling them."""
    for name in GLOBAL_HOOKS:
        if getattr(torch.nn.modules.module, name, None):
            return (
                f"a global module hook is registered ({name[8:]}); the fused kernels do not call the experts, "
                "so it would not run"
            )
    for module in modules:
        hooked = module_hooks(module)
        if hooked:
            return (
                f"an expert's {type(module).__name__} has {' and '.join(hooked)}, which the fused kernels would "
                "not run: they compute the experts without calling them"
            )
    return None


def module_hooks(module: torch.nn.Module) -> list[str]:
    """The kinds of hooks registered on ``module`` ("forward_hooks", ...), none when it has none.

    ZeRO-3's own hooks, which gather and release the module's parameters, are not counted: the
    pipelines call a ZeRO-3 module through them (``expert_weights.call_through_hooks``)."""
    return [name[1:] for name in MODULE_HOOKS if any(not zero3_hook(hook) for hook in getattr(module, name).values())]


@functools.cache
def _zero3_hook_codes() -> frozenset:
    """The code objects of the hooks DeepSpeed's ZeRO-3 registers on every module (closures defined
    in ``DeepSpeedZeRoOffload._register_deepspeed_module``, each made anew per module from one code)."""
    try:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    except ImportError:
        return frozenset()
    register = inspect.unwrap(DeepSpeedZeRoOffload._register_deepspeed_module)
    return frozenset(const for const in register.__code__.co_consts if isinstance(const, types.CodeType))


def zero3_hook(hook) -> bool:
    """Whether ``hook`` is one of ZeRO-3's parameter hooks, also behind the decorators DeepSpeed puts
    on them (``torch.compiler.disable``, which keeps ``__wrapped__``; its NVTX ranges, a closure over
    the hook)."""
    codes = _zero3_hook_codes()
    function = inspect.unwrap(hook)
    if getattr(function, "__code__", None) in codes:
        return True
    cells = getattr(function, "__closure__", None) or ()
    return any(
        getattr(inspect.unwrap(cell.cell_contents), "__code__", None) in codes
        for cell in cells
        if callable(cell.cell_contents)
    )
