"""DeepSpeed's ``TopKGate`` routing, minus the work the sparse dispatch throws away.

``gate_routes(gate, tokens, used_token)`` returns what ``gate(tokens, used_token, True)`` returns in
the positions the comet layer reads (aux loss, number of experts, route indices, route gates,
expert counts), bit for bit and with the same autograd graph and the same draws from torch's RNG.

Stock's sparse path still builds the per-expert buffer locations with ``torch.cumsum(mask, dim=0)``
over an [S, E] int64 mask. On CUDA that is an outer-dimension scan with one serial thread per
column, about 1.4 ms each at S=8192, E=8, and it runs once per route choice. The comet dispatch
places tokens itself, so the locations matter only where they decide which routes the capacity
drops, which is top-2 with ``drop_tokens``; there one innermost-dimension scan over both choices
gives them exactly. Stock also computes a capacity for ``drop_tokens=False`` only to return it (a
max, an all-reduce over the expert-parallel group); that is skipped for top-2 and top-k.

Every floating-point op that shapes ``l_aux`` or the gates is the op stock runs, on equal inputs and
in stock's order, so forward values and gradients are equal on any device. Only exact work is done
differently: integer bookkeeping (counts, positions, indices) and 0/1 masks or copied values that
feed those ops, which have one right answer however they are built.

On the fused path (``op`` given) that bookkeeping runs in the op's gate kernels, one or two calls
of the op in place of a dozen to thirty torch ops: the device finishes each op in microseconds, so the
gate's time is its launches. The top-2 kernel also computes the second choice's Gumbel noise from
torch's own uniform draw, repeating each fp32 op of ``torch.distributions.Gumbel`` with its
rounding; the GPU tests compare every output bit for bit with stock's gate.
"""

import weakref

import torch
import torch.nn.functional as F
from deepspeed.moe import sharded_moe as ds
from deepspeed.moe.sharded_moe import TopKGate
from deepspeed.utils import logger
from torch import Tensor
from torch.nn.modules import module as nn_module

from ...pipelines.policy import GLOBAL_HOOKS, MODULE_HOOKS

_capacities: dict[tuple, int] = {}
_warned_hooks = weakref.WeakSet()  # gates whose skipped hooks were reported
# gate -> in a layer, whether any rank of its group's gate had hooks when the group last agreed
# (record_group_hooks); for a gate called on its own, whether it had them at its first call
_hooked_when_agreed = weakref.WeakKeyDictionary()
_expert_ids: dict[tuple, Tensor] = {}
# The top-2 kernel repeats this function's arithmetic; a replaced one is called as it is.
_STOCK_GUMBEL = ds.gumbel_rsample
# Stock's forward looks these up at every call: a replaced one changes stock's answer.
_STOCK_GATINGS = (ds.top1gating, ds.top2gating, ds.topkgating)


def gate_routes(
    gate: TopKGate, tokens: Tensor, used_token: Tensor | None = None, op=None
) -> tuple[Tensor, int, Tensor, Tensor, Tensor]:
    """``(l_aux, num_experts, indices, gates, exp_counts)`` exactly as ``gate(tokens, used_token, True)``.

    ``indices`` is [k, S] int32 with -1 for a route the capacity dropped, ``gates`` [k, S] fp32.
    Gates this module cannot vouch for are called as they are. With ``op`` (the loaded ds_comet
    op) and CUDA tokens, the top-2 and top-k gates' integer bookkeeping runs in its gate kernels.
    """
    if not _reproducible(gate, tokens):
        l_aux, _, num_experts, indices, _, gates, exp_counts = gate(tokens, used_token, True)
        return l_aux, num_experts, indices, gates, exp_counts

    training = gate.training
    # The prelude of TopKGate.forward: the jitter draws from the RNG before any routing does.
    features = tokens.float()
    if gate.noisy_gate_policy == "Jitter" and training:
        features = ds.multiplicative_jitter(features, device=tokens.device)
    logits = F.linear(features, weight=gate.wg.weight.float(), bias=None)
    factor = gate.capacity_factor if training else gate.eval_capacity_factor

    if gate.k == 1:
        rsample = training and gate.noisy_gate_policy == "RSample"
        return _top1(logits, factor, gate.min_capacity, used_token, rsample, gate.use_rts)
    op = op if logits.is_cuda else None
    if gate.k == 2:
        return _top2(logits, factor, gate.min_capacity, gate.drop_tokens, gate.top2_2nd_expert_sampling, op)
    return _topk(logits, gate.k, factor, gate.min_capacity, gate.drop_tokens, op)


def _reproducible(gate, tokens: Tensor) -> bool:
    """Whether the fast path is known to match this gate's own forward."""
    if type(gate) is not TopKGate or "forward" in vars(gate) or gate.wall_clock_breakdown:
        return False
    hooked, agreed_hooked = _hooks_now_and_when_agreed(gate)
    # Hooks need not be alike on every rank (DeepSpeed's flops profiler hooks rank 0's modules at
    # one step). Stock's forward runs them, but for top-2 and top-k without dropping it also
    # all-reduces a capacity the fast path skips: there every rank of the group must take the same
    # path, or one falling back would pair its peers' next collectives wrongly. Hooks the gate had
    # when the group agreed (the layer's first call), on any rank of the group, send every rank
    # to stock's forward; hooks that appear later are skipped there, with a warning.
    collective = gate.k >= 2 and not gate.drop_tokens
    if collective and agreed_hooked:
        return False
    hooks_skipped = hooked and collective
    if hooked and not hooks_skipped:
        return False
    if (ds.top1gating, ds.top2gating, ds.topkgating) != _STOCK_GATINGS:
        return False
    # Tracing records stock's trace-friendly ops; the layer passes [S, M].
    if torch.jit.is_tracing() or tokens.dim() != 2:
        return False
    # Every other reason above is alike on every rank of an SPMD job. The token count is not, so an empty
    # batch may fall back only where stock runs no collective (a rank skipping the capacity
    # all-reduce its peers run would pair their next collectives wrongly): top-1, whose dropping
    # path has none and which stock's min_capacity assert should judge.
    if gate.k == 1 and tokens.shape[0] == 0:
        return False
    # Top-1 without dropping selects tokens with the capacity all-reduced over the expert group,
    # a collective and a host read that only stock's own code should decide on.
    if gate.k == 1 and not gate.drop_tokens:
        return False
    if hooks_skipped:
        _warn_skipped_hooks(gate)
    return True


# Host bookkeeping in a weak dictionary, which torch.compile cannot trace: it runs outside the graph.
@torch._disable_dynamo
def _hooks_now_and_when_agreed(gate) -> tuple[bool, bool]:
    """Whether the gate (or every module) has hooks now, and the answer that stands for the group
    (``_hooked_when_agreed``; the gate's own at its first call where no group recorded one)."""
    hooked = hooks_now(gate)
    return hooked, _hooked_when_agreed.setdefault(gate, hooked)


def hooks_now(gate) -> bool:
    """Whether the gate (or every module) has hooks, which only stock's forward runs."""
    return any(getattr(gate, name, None) for name in MODULE_HOOKS) or any(
        getattr(nn_module, name, None) for name in GLOBAL_HOOKS
    )


@torch._disable_dynamo
def record_group_hooks(gate, hooked_anywhere: bool) -> None:
    """What the layer's group agreed: whether any of its ranks' gates had hooks (``hooks_now``) at
    the agreement. It stands on every rank until the next agreement, so that all of them take
    stock's forward, or none."""
    _hooked_when_agreed[gate] = hooked_anywhere


@torch._disable_dynamo
def _warn_skipped_hooks(gate) -> None:
    if gate in _warned_hooks:
        return
    _warned_hooks.add(gate)
    logger.warning(
        "ds_comet: hooks that appeared on a top-%d gate without dropping (or global module hooks) "
        "after its layer's group agreed (at the layer's first call) are skipped: stock's forward, which "
        "would run them, all-reduces a capacity over the expert-parallel group that ranks without the "
        "hooks do not, so calling it on this rank alone would mismatch their next collectives. Register "
        'them before the first call, or set "moe": {"backend": "deepspeed"}, to run them',
        gate.k,
    )


def _capacity(gates: Tensor, factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity`` as a Python int, remembered per shape.

    It is a handful of host-side tensor ops on scalars, rerun by stock on every call for the same
    answer; its fp32 rounding of ``S / E * factor`` is why this asks it rather than redoing the math.
    """
    # The factor's type is part of the answer: stock makes it a tensor, fp64 from a numpy float.
    key = (gates.shape[0], gates.shape[1], factor, type(factor), min_capacity, torch.get_default_dtype())
    capacity = _capacities.get(key)
    if capacity is None:
        if len(_capacities) > 4096:  # varying token counts must not grow this without bound
            _capacities.clear()
        capacity = int(ds._capacity(gates, torch.tensor(factor), torch.tensor(min_capacity)))
        _capacities[key] = capacity
    return capacity


def _experts(num_experts: int, device: torch.device) -> Tensor:
    """``arange(num_experts)`` on ``device``, made once: comparing against it builds one-hot masks."""
    key = (num_experts, device)
    ids = _expert_ids.get(key)
    if ids is None:
        with torch.inference_mode(False):  # a normal tensor even when first asked for under inference
            ids = torch.arange(num_experts, device=device)
        _expert_ids[key] = ids
    return ids


def _rts_sampler(device: torch.device):
    """The sampler stock's random token selection draws from, shared through DeepSpeed's own map."""
    sampler = ds.exp_selection_uniform_map.get(device)
    if sampler is None:
        unit = torch.distributions.uniform.Uniform(
            low=torch.tensor(0.0, device=device), high=torch.tensor(1.0, device=device)
        )
        sampler = ds.exp_selection_uniform_map[device] = unit.rsample
    return sampler


def _top1(logits: Tensor, factor: float, min_capacity: int, used_token: Tensor | None, rsample: bool, use_rts: bool):
    """Top-1 with ``drop_tokens``: stock's selection, without the location scan it only returns."""
    if rsample:
        # Only argmax reads the noisy logits, so they need no graph.
        noisy = logits.detach() + ds.gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(gates, factor, min_capacity)

    choice = torch.argmax(noisy if rsample else gates, dim=1)
    # F.one_hot's int64 mask in one op (one_hot is a fill and a scatter, and on CPU two host checks).
    mask = torch.eq(
        choice.unsqueeze(1),
        _experts(num_experts, logits.device),
        out=torch.empty((num_tokens, num_experts), dtype=torch.int64, device=logits.device),
    )
    if used_token is not None:
        mask = ds.einsum("s,se->se", used_token, mask)
    exp_counts = torch.sum(mask, dim=0).detach()

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    # Which routes survive is decided by topk over the tokens of each expert; its tie-breaking is
    # part of the answer, so it sees exactly stock's input.
    ranked = mask * _rts_sampler(logits.device)(mask.shape) if use_rts else mask
    assert num_tokens >= min_capacity, (
        "No. of tokens (batch-size) should be greater than min_capacity. "
        "Either set min_capacity to 0 or increase your batch size."
    )
    survivors = torch.topk(ranked, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, survivors, 1)

    if used_token is None:
        # A 0/1 mask: the route stays iff its row kept its one entry.
        indices = torch.where(mask.any(dim=1), choice, -1)
    else:
        # used_token may weight the mask with any value; stock's arithmetic decides what comes out.
        indices = torch.min(choice, mask.sum(dim=1) * num_experts - 1)
    route_gates = (gates * mask).sum(dim=1)
    return l_aux, num_experts, indices.to(torch.int32).unsqueeze(0), route_gates.unsqueeze(0), exp_counts


def _top2(logits: Tensor, factor: float, min_capacity: int, drop_tokens: bool, sampling: bool, op):
    """Top-2 with the capacity drop decided by one innermost-dimension scan instead of two outer ones."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(gates, factor * 2, min_capacity) if drop_tokens else None
    if capacity is not None:
        # Queue positions run from 1 to 2S, so a larger capacity drops nothing either and a negative
        # one everything; kept in [0, 2S], it fits the int32 positions it is compared with.
        capacity = max(0, min(capacity, 2 * num_tokens))
    if op is not None and num_experts >= 2 and (not sampling or _stock_gumbel_is_fp32(logits.device)):
        routes, masks, exp_counts = _top2_kernels(op, logits, gates, capacity, sampling)
    else:
        routes, masks, exp_counts = _top2_ops(logits, gates, capacity, sampling)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(masks[0], dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    gates1_s = ds.einsum("se,se->s", gates, masks[-2])
    gates2_s = ds.einsum("se,se->s", gates, masks[-1])
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    return l_aux, num_experts, routes, torch.stack([gates1_s, gates2_s]), exp_counts


def _stock_gumbel_is_fp32(device: torch.device) -> bool:
    """Whether stock's second-choice noise on ``device`` is the fp32 Gumbel(0, 1) the top-2 kernel
    repeats: stock makes its sampler on first use in the default dtype, and a replaced function or
    sampler may compute anything."""
    if ds.gumbel_rsample is not _STOCK_GUMBEL:
        return False
    sampler = ds.gumbel_map.get(device)
    if sampler is None:  # made as stock makes it, so that both share it from here on
        one, zero = torch.tensor(1.0, device=device), torch.tensor(0.0, device=device)
        sampler = ds.gumbel_map[device] = torch.distributions.gumbel.Gumbel(zero, one).rsample
    owner = getattr(sampler, "__self__", None)
    return (
        type(owner) is torch.distributions.gumbel.Gumbel
        and owner.loc.dtype == torch.float32
        and owner.scale.dtype == torch.float32
    )


def _top2_ops(logits: Tensor, gates: Tensor, capacity: int | None, sampling: bool):
    """(routes [2, S] int32, one-hot masks, expert counts) of top-2 in torch ops.

    ``masks`` is fp32 [3, S, E] with dropping (the first choices before the drop, then both choices
    after it), [2, S, E] without (both choices): stock's masks, equal in value.
    """
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)

    # The second choice ranks the (optionally Gumbel-perturbed) logits with the first ruled out.
    # Nothing differentiable reads them, so work on a detached copy and rule out in place.
    if sampling:
        # Stock adds the noise in place: rounded to the logits' dtype (bf16 under autocast).
        scores = logits.detach().clone()
        scores += ds.gumbel_rsample(logits.shape, device=logits.device)
        scores.scatter_(1, first.unsqueeze(1), float("-inf"))
    else:
        scores = logits.detach().scatter(1, first.unsqueeze(1), float("-inf"))
    second = torch.argmax(scores, dim=1)

    experts = _experts(num_experts, logits.device)
    if capacity is not None:
        # Row 0 keeps the undropped first choices for the aux loss; rows 1-2 become the routes.
        picks = torch.stack([first, first, second])
        routes = picks[1:].view(1, 2 * num_tokens)
        # Per expert, scan its first-choice tokens and then its second-choice ones: the running
        # count is stock's location + 1 for both choices, second choices queueing behind every
        # first choice of the expert, as stock's offset by the first mask's column sums does.
        # int32 halves the scan's traffic and is exact for any token count a [E, 2S] mask can hold.
        queue = (routes == experts.unsqueeze(1)).cumsum(dim=1, dtype=torch.int32)
        position = queue.gather(0, routes)
        # Stock's counts are before the drop, as these are (an empty batch has no last column).
        exp_counts = queue[:, -1].to(torch.int64) if num_tokens else experts.new_zeros(num_experts)
        routes.masked_fill_(position > capacity, -1)
    else:
        # Nothing is dropped, and the capacity stock would all-reduce is only returned.
        picks = torch.stack([first, second])
    # One-hot rows as fp32 in one op: the masks stock multiplies and averages, equal in value (fp32
    # even where CPU autocast leaves the gates bf16, as stock's .float() masks are).
    masks = torch.eq(
        picks.unsqueeze(2), experts, out=gates.new_empty((picks.shape[0], num_tokens, num_experts), dtype=torch.float32)
    )
    if capacity is None:
        exp_counts = masks.sum(dim=(0, 1), dtype=torch.int64)
    return picks[-2:].to(torch.int32), masks, exp_counts


def _top2_kernels(op, logits: Tensor, gates: Tensor, capacity: int | None, sampling: bool):
    """``_top2_ops`` in one call of the op, after the one draw from the RNG that stock's Gumbel noise makes."""
    num_tokens, num_experts = gates.shape
    # Gumbel(0, 1).rsample's only random op; the kernel repeats the rest of its arithmetic.
    uniform = torch.rand(logits.shape, dtype=torch.float32, device=logits.device) if sampling else logits.new_empty(0)
    routes = torch.empty((2, num_tokens), dtype=torch.int32, device=logits.device)
    masks = gates.new_empty((2 if capacity is None else 3, num_tokens, num_experts))
    exp_counts = torch.empty(num_experts, dtype=torch.int64, device=logits.device)
    # Under autocast the logits are bf16 or fp16: the kernel reads them in their dtype and rounds
    # their noisy sum to it, as stock's in-place add does.
    op.top2_routes(
        gates.detach(), logits.detach(), uniform, -1 if capacity is None else capacity, routes, masks, exp_counts
    )
    return routes, masks, exp_counts


def _topk(logits: Tensor, k: int, factor: float, min_capacity: int, drop_tokens: bool, op):
    """Top-k (k > 2, drop policy "probs"): the capacity drop needs no locations at all."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    capacity = _capacity(gates, factor * k, min_capacity) if drop_tokens else None
    if op is not None:
        mask, kept, indices, exp_counts = _topk_kernels(op, top_gate, top_idx, num_experts, capacity)
    else:
        mask, kept, indices, exp_counts = _topk_ops(gates, top_gate, top_idx, capacity)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask, dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k

    gates_masked = gates * kept
    gates_s = torch.sum(gates_masked, dim=-1, keepdim=True)
    denom_s = torch.clamp(gates_s, min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom_s
    route_gates = gates_masked.gather(1, top_idx)
    return l_aux, num_experts, indices, ds._stack_routes(route_gates), exp_counts


def _topk_ops(gates: Tensor, top_gate: Tensor, top_idx: Tensor, capacity: int | None):
    """(mask, kept, indices [k, S] int32, expert counts) of top-k in torch ops: the one-hot mask of
    the choices as fp32, the choices the capacity keeps (bool), the routes with -1 where dropped."""
    num_tokens = gates.shape[0]
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach()
    kept = mask
    if capacity is not None:
        # Each expert keeps its `capacity` most probable routes. Stock's graph through these values
        # ends in topk indices, so no gradient flows here: build them detached.
        ranked = torch.zeros_like(gates).scatter_(1, top_idx, top_gate.detach())
        best = torch.topk(ranked, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
        kept = mask & torch.zeros_like(mask).scatter_(0, best, True)
    indices = torch.where(kept.gather(1, top_idx), top_idx, -1)
    # Transpose and narrow in one copy; stock transposes, copies, then casts.
    indices = indices.t().to(torch.int32, memory_format=torch.contiguous_format)
    return mask.float(), kept, indices, exp_counts


def _topk_kernels(op, top_gate: Tensor, top_idx: Tensor, num_experts: int, capacity: int | None):
    """``_topk_ops`` in two calls of the op around stock's capacity topk (kept is fp32 here)."""
    num_tokens, k = top_idx.shape
    device = top_idx.device
    mask = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=device)
    kept = torch.empty_like(mask) if capacity is not None else mask
    ranked = torch.empty_like(mask) if capacity is not None else mask
    indices = torch.empty((k, num_tokens), dtype=torch.int32, device=device)
    exp_counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    op.topk_masks(top_idx, top_gate.detach(), capacity is not None, mask, kept, ranked, indices, exp_counts)
    if capacity is not None:
        # Which routes survive is torch.topk's answer over stock's very input, ties and all.
        best = torch.topk(ranked, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
        op.topk_keep(best, top_idx, mask, kept, indices)
    return mask, kept, indices, exp_counts
