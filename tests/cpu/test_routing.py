"""The routing plan against a brute-force reading of the gate's sparse routes."""

import pytest
import torch

from ds_comet.pipelines.routing import chunk_bounds, chunk_of_row, plan_rank_rows, plan_routes, remote_rows


def random_routes(generator, top_k, num_tokens, num_experts, drop_fraction):
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    indices = scores.topk(top_k, dim=1).indices.t().contiguous().int()
    dropped = torch.rand(indices.shape, generator=generator) < drop_fraction
    return torch.where(dropped, torch.full_like(indices, -1), indices)


@pytest.mark.parametrize(
    "top_k,num_tokens,num_experts,drop_fraction", [(1, 37, 4, 0.0), (2, 64, 8, 0.3), (4, 19, 6, 0.5), (3, 5, 3, 1.0)]
)
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
    # Every expert-parallel size the experts split evenly over: rank r gets experts [r * L, (r + 1) * L).
    for ep_size in (p for p in range(2, num_experts + 1) if num_experts % p == 0):
        num_local = num_experts // ep_size
        assert plan.rank_counts(ep_size).tolist() == [
            sum(plan.expert_counts[r * num_local : (r + 1) * num_local].tolist()) for r in range(ep_size)
        ], ep_size


def test_plan_rejects_flat_indices():
    with pytest.raises(ValueError, match=r"\[k, tokens\]"):
        plan_routes(torch.zeros(8, dtype=torch.int32), 4)


@pytest.mark.parametrize("past_the_end", [0, 1, 7])
def test_plan_drops_ids_past_the_last_expert(past_the_end):
    # The plan kernel counts any id >= E as dropped (csrc/comet.h); the torch plan must agree.
    generator = torch.Generator().manual_seed(past_the_end)
    num_experts = 6
    indices = random_routes(generator, 2, 50, num_experts, 0.2)
    bad = torch.rand(indices.shape, generator=generator) < 0.3
    as_dropped = plan_routes(torch.where(bad, torch.full_like(indices, -1), indices), num_experts)
    got = plan_routes(torch.where(bad, torch.full_like(indices, num_experts + past_the_end), indices), num_experts)
    for field in ("route_order", "route_position", "expert_counts"):
        assert torch.equal(getattr(got, field), getattr(as_dropped, field)), field


def test_remote_rows_count_routes_and_token_rank_pairs():
    # 4 experts on 2 ranks (2 each), this rank is 0; columns are tokens, rows the top-k slots.
    indices = torch.tensor([[0, 2, 3, -1, 1], [2, 3, 1, 2, 4]])  # 4 is past the last expert: dropped
    route_rows, once_rows = remote_rows(indices, num_experts=4, ep_size=2, rank=0)
    # Remote routes: token 0 -> 2; token 1 -> 2 and 3; token 2 -> 3; token 3 -> 2.
    assert route_rows == 5
    # Once per (token, rank 1): tokens 0, 1, 2, 3.
    assert once_rows == 4


@pytest.mark.parametrize(
    "top_k,num_tokens,num_experts,ep_size,drop_fraction,chunks",
    [
        (1, 37, 4, 2, 0.0, 1),
        (2, 64, 8, 4, 0.3, 3),
        (4, 19, 8, 2, 0.5, 2),
        (8, 23, 16, 4, 0.1, 5),
        (3, 5, 6, 3, 1.0, 2),
        (4, 0, 8, 2, 0.0, 4),
        (2, 6, 4, 2, 0.0, 8),
    ],
)
def test_rank_plan_matches_brute_force(top_k, num_tokens, num_experts, ep_size, drop_fraction, chunks):
    generator = torch.Generator().manual_seed(top_k * 100 + num_tokens + ep_size)
    indices = random_routes(generator, top_k, num_tokens, num_experts, drop_fraction)
    indices[0, : num_tokens // 4] = num_experts  # past the last expert: dropped, as in the plan kernel
    plan = plan_rank_rows(indices, num_experts, ep_size, chunks)

    num_local = num_experts // ep_size
    kept = [[int(e) if 0 <= e < num_experts else -1 for e in indices[:, s]] for s in range(num_tokens)]
    pairs = [
        (d, s) for d in range(ep_size) for s in range(num_tokens) if any(e // num_local == d for e in kept[s] if e >= 0)
    ]
    num_pairs = len(pairs)
    rank_rows = [sum(1 for d, _ in pairs if d == rank) for rank in range(ep_size)]
    assert plan.rank_rows.tolist() == rank_rows
    assert plan.pair_token[:num_pairs].tolist() == [s for _, s in pairs]
    route_counts = [[[0] * num_local for _ in range(chunks)] for _ in range(ep_size)]
    for p, (d, s) in enumerate(pairs):
        assert plan.local_experts[p].tolist() == [
            e - d * num_local if e >= 0 and e // num_local == d else -1 for e in kept[s]
        ], (d, s)
        ranks_of_token = sorted({e // num_local for e in kept[s] if e >= 0})
        assert plan.pair_slot[p] == ranks_of_token.index(d), (d, s)
        # The pair's chunk: the one whose rows of its destination's block hold it.
        position, rows = p - sum(rank_rows[:d]), rank_rows[d]
        chunk = [c for c in range(chunks) if c * rows // chunks <= position < (c + 1) * rows // chunks]
        assert len(chunk) == 1, (d, s, chunk)
        for e in kept[s]:
            if e >= 0 and e // num_local == d:
                route_counts[d][chunk[0]][e - d * num_local] += 1
    assert plan.route_counts.tolist() == route_counts
    # The bench's count of rows sent once per (token, rank) is this plan's, less the rank's own.
    for rank in range(ep_size):
        assert remote_rows(indices, num_experts, ep_size, rank)[1] == num_pairs - plan.rank_rows[rank]


@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 8])
def test_chunk_of_row_is_the_chunk_whose_bounds_hold_it(chunks):
    rows = torch.arange(0, 40)
    bounds = chunk_bounds(rows, chunks)  # [40, chunks + 1]
    assert torch.equal(bounds[:, 0], torch.zeros_like(rows)) and torch.equal(bounds[:, -1], rows)
    for block in range(1, 40):
        position = torch.arange(block)
        chunk = chunk_of_row(position, torch.full_like(position, block), chunks)
        assert torch.all((bounds[block, chunk] <= position) & (position < bounds[block, chunk + 1])), block
