"""The routing plan against a brute-force reading of the gate's sparse routes."""

import pytest
import torch

from ds_comet.routing import expert_major_order, plan_routes


def random_routes(generator, top_k, num_tokens, num_experts, drop_fraction):
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    indices = scores.topk(top_k, dim=1).indices.t().contiguous().int()
    dropped = torch.rand(indices.shape, generator=generator) < drop_fraction
    return torch.where(dropped, torch.full_like(indices, -1), indices)


@pytest.mark.parametrize("top_k,num_tokens,num_experts,drop_fraction", [(1, 37, 4, 0.0), (2, 64, 8, 0.3),
                                                                         (4, 19, 6, 0.5), (3, 5, 3, 1.0)])
def test_plan_matches_brute_force(top_k, num_tokens, num_experts, drop_fraction):
    generator = torch.Generator().manual_seed(top_k * 100 + num_tokens)
    indices = random_routes(generator, top_k, num_tokens, num_experts, drop_fraction)
    plan = plan_routes(indices, num_experts)

    routes = [(j * num_tokens + s, int(indices[j, s])) for j in range(top_k) for s in range(num_tokens)]
    kept = sorted((e, r) for r, e in routes if e >= 0)
    num_kept = len(kept)
    assert plan.route_order[:num_kept].tolist() == [r for _, r in kept]
    assert sorted(plan.route_order[num_kept:].tolist()) == sorted(r for r, e in routes if e < 0)
    assert plan.expert_counts.tolist() == [sum(1 for e, _ in kept if e == x) for x in range(num_experts)]
    assert torch.equal(plan.route_order[plan.route_position], torch.arange(top_k * num_tokens))
    assert plan.source_token[:num_kept].tolist() == [r % num_tokens for _, r in kept]
    if num_experts % 2 == 0:
        assert plan.rank_counts(2).tolist() == [plan.expert_counts[:num_experts // 2].sum().item(),
                                                plan.expert_counts[num_experts // 2:].sum().item()]


def test_expert_major_order():
    # Two source ranks, three local experts; rows arrive rank-major.
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    arrival = [(0, 0), (0, 0), (0, 2), (1, 0), (1, 1), (1, 1), (1, 1)]
    order = expert_major_order(counts)
    assert [arrival[i] for i in order.tolist()] == sorted(arrival, key=lambda row: row[1])
    assert order.tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_plan_rejects_flat_indices():
    with pytest.raises(ValueError, match=r"\[k, tokens\]"):
        plan_routes(torch.zeros(8, dtype=torch.int32), 4)
