"""The comet layer (reference pipeline) against stock DeepSpeed MoE on the gloo pool's ranks.

Same weights, same seeds, fresh random tokens: output, aux loss, expert counts, the input gradient
and every parameter gradient must match stock DeepSpeed's in fp32. The cases follow the pool's
size P (DS_COMET_TEST_WORLD_SIZE, default 2): expert parallelism over all P ranks, expert counts
as multiples of P, per-rank token counts as a pattern that repeats over the ranks.
"""

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.experts import reset_expert_
from tests.support.dist_pool import cpu_world_size
from tests.support.moe_helpers import (
    COMET,
    assert_same_step,
    build_pair,
    make_expert,
    per_rank,
    reset_experts_,
    routing_stats,
    run_step,
)

HIDDEN, FFN = 24, 40
# fp32 arithmetic against a float64 evaluation: rounding, not the pipeline, sets this bound.
FP32_VS_FP64 = dict(rtol=1e-4, atol=1e-5)
P = cpu_world_size()
# No expert parallelism, expert-parallel groups of some of the ranks (expert data parallelism
# across the groups; there are such groups from 4 ranks on), and one group of every rank.
EP_SIZES = sorted({1, max([d for d in range(1, P) if P % d == 0], default=1), P})


def parity_case(
    seed,
    ep_size,
    num_experts,
    k,
    drop_tokens=True,
    capacity_factor=1.0,
    eval_capacity_factor=1.0,
    min_capacity=4,
    train=True,
    use_residual=False,
    noisy_gate_policy=None,
    use_rts=True,
    expert_kind="gelu",
    tokens_per_rank=(48, 48),
    skew=0.0,
):
    rank = dist.get_rank()
    moe_kwargs = dict(
        num_experts=num_experts,
        ep_size=ep_size,
        k=k,
        drop_tokens=drop_tokens,
        capacity_factor=capacity_factor,
        eval_capacity_factor=eval_capacity_factor,
        min_capacity=min_capacity,
        use_residual=use_residual,
        noisy_gate_policy=noisy_gate_policy,
        use_rts=use_rts,
    )
    stock, comet = build_pair(seed, HIDDEN, FFN, expert_kind, **moe_kwargs)
    generator = torch.Generator().manual_seed(seed * 17 + rank)
    tokens = torch.randn(per_rank(tokens_per_rank, rank), HIDDEN, generator=generator)
    if skew:
        # Lean every token towards expert 0's gate row: heavy imbalance, overflow and idle experts.
        tokens += skew * stock.deepspeed_moe.gate.wg.weight[0].detach()
        # ... and push the last expert's gate row away, so that it stays empty even under top-2 sampling.
        with torch.no_grad():
            for layer in (stock, comet):
                weight = layer.deepspeed_moe.gate.wg.weight
                weight[-1] = -20 * weight[0]
    tokens = tokens.view(1, -1, HIDDEN)
    loss_weight = torch.randn(tokens.shape, generator=generator)
    noise_seed = seed * 31 + rank
    expected = run_step(stock, tokens, loss_weight, noise_seed, train)
    actual = run_step(comet, tokens, loss_weight, noise_seed, train)
    assert_same_step(expected, actual)
    return routing_stats(comet, tokens, noise_seed, train)


def total(stats, key):
    return sum(rank_stats[key] for rank_stats in stats)


@pytest.mark.parametrize("ep_size", EP_SIZES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_matches_stock(cpu_pool, ep_size, k, drop_tokens):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=ep_size, num_experts=4 * P, k=k, drop_tokens=drop_tokens)


# One local expert (top-1 and top-2), two, three with k above the local count, and no expert parallelism.
@pytest.mark.parametrize("num_experts,ep_size,k", [(P, P, 1), (P, P, 2), (2 * P, P, 2), (3 * P, P, 4), (4, 1, 3)])
def test_expert_counts(cpu_pool, num_experts, ep_size, k):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=ep_size, num_experts=num_experts, k=k, expert_kind="swiglu")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_capacity_overflow_and_empty_experts(cpu_pool, k):
    seed = torch.randint(1, 10**6, ()).item()
    stats = cpu_pool.run(
        parity_case, seed=seed, ep_size=P, num_experts=4 * P, k=k, capacity_factor=0.5, min_capacity=0, skew=6.0
    )
    assert total(stats, "dropped_routes") > 0
    assert total(stats, "empty_experts") > 0


def test_token_routed_to_no_kept_expert(cpu_pool):
    seed = torch.randint(1, 10**6, ()).item()
    stats = cpu_pool.run(
        parity_case, seed=seed, ep_size=P, num_experts=2 * P, k=1, capacity_factor=0.25, min_capacity=0, skew=2.0
    )
    assert total(stats, "tokens_with_no_expert") > 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_eval_mode(cpu_pool, k):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=P, num_experts=4 * P, k=k, train=False, eval_capacity_factor=0.75)


@pytest.mark.parametrize("k", [1, 2])
def test_use_residual(cpu_pool, k):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=P, num_experts=2 * P, k=k, use_residual=True, expert_kind="sequential")


@pytest.mark.parametrize("policy", ["Jitter", "RSample"])
def test_noisy_gate(cpu_pool, policy):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=P, num_experts=2 * P, k=1, noisy_gate_policy=policy)


def test_no_random_token_selection(cpu_pool):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=P, num_experts=2 * P, k=1, use_rts=False, capacity_factor=0.5)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_uneven_tokens_without_drops(cpu_pool, k):
    # Stock DeepSpeed runs uneven token counts only without drops: its capacity is then agreed
    # across the group, so its equal all-to-all splits line up.
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(parity_case, seed=seed, ep_size=P, num_experts=4 * P, k=k, drop_tokens=False, tokens_per_rank=(37, 61))


def float64_case(seed, num_experts, k, tokens_per_rank, capacity_factor, expert_kind="gelu"):
    """The comet layer against a float64 evaluation of the same routes, every expert on every rank."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    layer = ds_comet.MoE(
        HIDDEN,
        make_expert(expert_kind, HIDDEN, FFN),
        num_experts,
        ep_size,
        k,
        capacity_factor=capacity_factor,
        min_capacity=0,
        config=COMET,
    )
    layer.set_deepspeed_parallelism()
    reset_experts_(layer, seed)
    experts64 = []
    for global_id in range(num_experts):
        expert = make_expert(expert_kind, HIDDEN, FFN)
        reset_expert_(expert, seed * 1000 + global_id)
        experts64.append(expert.double())

    generator = torch.Generator().manual_seed(seed * 17 + rank)
    tokens = torch.randn(1, per_rank(tokens_per_rank, rank), HIDDEN, generator=generator)
    loss_weight = torch.randn(tokens.shape, generator=generator)
    noise_seed = seed * 31 + rank
    actual = run_step(layer, tokens, loss_weight, noise_seed)

    layer.zero_grad(set_to_none=True)
    inputs = tokens[0].clone().requires_grad_()
    torch.manual_seed(noise_seed)
    l_aux, _, _, indices, _, gates, _ = layer.deepspeed_moe.gate(inputs, None, True)
    expected = torch.zeros(inputs.shape, dtype=torch.float64)
    for j in range(k):
        for global_id, expert in enumerate(experts64):
            rows = (indices[j] == global_id).nonzero().flatten()
            contribution = gates[j, rows].double().unsqueeze(1) * expert(inputs[rows].double())
            expected = expected.index_add(0, rows, contribution)
    ((expected * loss_weight[0].double()).sum() + l_aux.double()).backward()

    torch.testing.assert_close(actual["output"][0], expected.float(), **FP32_VS_FP64)
    torch.testing.assert_close(actual["input_grad"][0], inputs.grad, **FP32_VS_FP64)
    gate_weight = "deepspeed_moe.gate.wg.weight"
    torch.testing.assert_close(actual["grads"][gate_weight], layer.deepspeed_moe.gate.wg.weight.grad, **FP32_VS_FP64)
    # An expert's gradient gathers every rank's tokens: sum the float64 contributions over ranks.
    num_local = num_experts // ep_size
    for global_id, expert in enumerate(experts64):
        for name, param in expert.named_parameters():
            total_grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(total_grad)
            if global_id // num_local == rank:
                ours = actual["grads"][f"deepspeed_moe.experts.deepspeed_experts.{global_id % num_local}.{name}"]
                torch.testing.assert_close(ours, total_grad.float(), **FP32_VS_FP64)
    return int((indices < 0).sum())


@pytest.mark.parametrize(
    "k,tokens_per_rank,capacity_factor", [(1, (29, 70), 1.0), (2, (64, 9), 0.5), (4, (50, 33), 0.75), (2, (0, 40), 0.5)]
)
def test_float64_uneven_tokens_with_drops(cpu_pool, k, tokens_per_rank, capacity_factor):
    # Stock DeepSpeed cannot run this: with drops its capacity follows each rank's token count.
    seed = torch.randint(1, 10**6, ()).item()
    dropped = cpu_pool.run(
        float64_case,
        seed=seed,
        num_experts=4 * P,
        k=k,
        tokens_per_rank=tokens_per_rank,
        capacity_factor=capacity_factor,
        expert_kind="swiglu" if k == 2 else "gelu",
    )
    assert sum(dropped) > 0
