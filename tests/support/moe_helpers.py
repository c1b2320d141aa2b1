"""Model builders and comparisons shared by the tests (they run inside the gloo ranks)."""

import deepspeed
import torch
from deepspeed import comm as dist
from torch import nn
from torch.nn import functional as F

import ds_comet
from ds_comet.experts import FeedForward, GatedFeedForward, reset_expert_

COMET = {"moe": {"backend": "comet", "overlap": "none"}}


def per_rank(pattern, rank: int):
    """This rank's entry of a per-rank pattern, e.g. token counts; it repeats for more ranks than entries."""
    return pattern[rank % len(pattern)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius distance of a from b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_expert(kind: str, hidden: int, ffn: int) -> nn.Module:
    if kind == "gelu":
        return FeedForward(hidden, ffn, "gelu")
    if kind == "swiglu":
        return GatedFeedForward(hidden, ffn, "silu")
    if kind == "sequential":
        return nn.Sequential(nn.Linear(hidden, ffn), nn.ReLU(), nn.Linear(ffn, hidden))
    raise ValueError(kind)


class MixtralStyleMLP(nn.Module):
    """A user's SwiGLU expert under its own parameter names, as Mixtral and Megatron-DeepSpeed write it:
    w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def reset_experts_(layer, seed: int, ep_rank: int | None = None) -> None:
    """Distinct weights for every expert, drawn from its global expert id; ``ep_rank`` for a layer
    whose expert-parallel group is not set yet."""
    moe = layer.deepspeed_moe
    if ep_rank is None:
        ep_rank = dist.get_rank(group=moe.ep_group) if moe.ep_size > 1 else 0
    for i, expert in enumerate(moe.experts.deepspeed_experts):
        reset_expert_(expert, seed * 1000 + ep_rank * moe.num_local_experts + i)


def build_pair(seed, hidden, ffn, expert_kind, config=COMET, **moe_kwargs):
    """Stock DeepSpeed MoE and the comet layer with identical weights."""
    torch.manual_seed(seed)
    template = make_expert(expert_kind, hidden, ffn)
    stock = deepspeed.moe.layer.MoE(hidden, template, **moe_kwargs)
    stock.set_deepspeed_parallelism()
    reset_experts_(stock, seed)
    comet = ds_comet.MoE(hidden, template, config=config, **moe_kwargs)
    comet.set_deepspeed_parallelism()
    comet.load_state_dict(stock.state_dict())
    return stock, comet


def run_step(layer, tokens, loss_weight, noise_seed, train=True):
    """Forward and backward; returns everything a backend must reproduce."""
    layer.train(train)
    layer.zero_grad(set_to_none=True)
    inputs = tokens.clone().requires_grad_()
    torch.manual_seed(noise_seed)  # the gate's noise (RSample, Jitter, top-2 sampling, RTS)
    output, l_aux, exp_counts = layer(inputs)
    ((output * loss_weight).sum() + l_aux).backward()
    grads = {name: param.grad for name, param in layer.named_parameters()}
    return dict(
        output=output.detach(), l_aux=l_aux.detach(), exp_counts=exp_counts, input_grad=inputs.grad, grads=grads
    )


def assert_parameter_grad_close(found, wanted, msg, rtol=1e-5, atol=1e-6):
    """A parameter's gradient element by element, allowed 1e-6 of its largest magnitude besides
    ``atol``: it sums every row's product, and summed in another order (rows grouped per rank or
    per chunk) fp32 rounds each element by up to about that, however small the element is."""
    scale = wanted.abs().max().item() if wanted.numel() else 0.0
    torch.testing.assert_close(found, wanted, rtol=rtol, atol=atol + 1e-6 * scale, msg=msg)


def assert_same_step(expected, actual, rtol=1e-5, atol=1e-6):
    """One step of two layers alike, element by element; parameter gradients as
    ``assert_parameter_grad_close`` allows."""
    torch.testing.assert_close(actual["output"], expected["output"], rtol=rtol, atol=atol, msg="output")
    torch.testing.assert_close(actual["l_aux"], expected["l_aux"], rtol=rtol, atol=atol, msg="l_aux")
    assert torch.equal(actual["exp_counts"], expected["exp_counts"]), "exp_counts"
    torch.testing.assert_close(actual["input_grad"], expected["input_grad"], rtol=rtol, atol=atol, msg="input grad")
    assert expected["grads"].keys() == actual["grads"].keys()
    for name, grad in expected["grads"].items():
        other = actual["grads"][name]
        assert (grad is None) == (other is None), f"gradient of {name}: {grad is None=} {other is None=}"
        if grad is not None:
            assert_parameter_grad_close(other, grad, f"gradient of {name}", rtol, atol)


def routing_stats(layer, tokens, noise_seed, train=True):
    """How many routes the gate dropped and how many experts got no token, for this rank."""
    layer.train(train)
    gate = layer.deepspeed_moe.gate
    torch.manual_seed(noise_seed)
    with torch.no_grad():
        _, _, num_experts, indices, _, _, _ = gate(tokens.reshape(-1, tokens.shape[-1]), None, True)
    kept = indices[indices >= 0].long()
    per_expert = torch.bincount(kept, minlength=num_experts)
    return dict(
        dropped_routes=int((indices < 0).sum()),
        tokens_with_no_expert=int((indices < 0).all(dim=0).sum()),
        empty_experts=int((per_expert == 0).sum()),
    )
