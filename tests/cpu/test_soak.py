"""The soak harness on CPU: random layers and calls on the reference pipeline, each against float64.

The same harness runs the fused pipeline on a GPU (tests/gpu/test_soak.py, and thousands of calls
from ``python -m tests.support.soak``); here it checks the reference pipeline, which defines the
numbers, over random shapes, k, skew, drops, empty ranks, train and eval.
"""

import torch

from tests.support.dist_pool import cpu_world_size
from tests.support.soak import _compare, draw_call, draw_case, replay_rank, soak_rank, summarize


def test_random_reference_calls_match_float64(cpu_pool):
    seed = torch.randint(1, 10**6, ()).item()
    report = summarize(cpu_pool.run(soak_rank, seed=seed, calls=15))
    assert report["calls"] == 15 and report["cases"] >= 3, (seed, report)
    assert report["mismatches"] == 0 and report["hangs"] == 0, (seed, report)
    assert report["worst"]["output vs float64"] < 1e-5, (seed, report)


def test_the_soak_rule_flags_a_wrong_tensor_and_allows_what_the_dtype_cannot_do():
    torch.manual_seed(0)
    exact = {
        "output": torch.randn(16, 8, dtype=torch.float64),
        "grad w": torch.randn(8, 8, dtype=torch.float64),
        "grad deepspeed_moe.gate.wg.weight": torch.randn(4, 8, dtype=torch.float64),
    }
    near = {name: (value * (1 + 1e-3 * torch.randn_like(value))).to(torch.bfloat16) for name, value in exact.items()}

    def judged(tested_changes, reference_changes=None):
        tested, reference = dict(near), dict(near)
        tested.update(tested_changes)
        reference.update(reference_changes or {})
        return _compare(dict(exact=exact, tested=tested, reference=reference), torch.bfloat16)["failed"]

    assert judged({}) == []
    # A wrong gradient, an output off by a few percent, a swapped gate gradient, a non-finite value.
    assert len(judged({"grad w": near["grad w"].flip(0)})) == 1
    assert len(judged({"output": near["output"] * 1.05})) == 1
    assert len(judged({"grad deepspeed_moe.gate.wg.weight": -near["grad deepspeed_moe.gate.wg.weight"]})) == 1
    assert "not finite" in judged({"grad w": near["grad w"] * float("inf")})[0]
    # On a rank of too few tokens for the rule, the gate gradient is reported and not judged; the
    # rest is judged as ever.
    swapped_gate = {"grad deepspeed_moe.gate.wg.weight": -near["grad deepspeed_moe.gate.wg.weight"]}
    few = _compare(dict(exact=exact, tested=dict(near, **swapped_gate), reference=near), torch.bfloat16, num_tokens=1)
    assert few["failed"] == [] and few["worst"]["gate gradient vs float64"] > 1.0
    flipped = dict(near, **{"grad w": near["grad w"].flip(0)})
    assert len(_compare(dict(exact=exact, tested=flipped, reference=near), torch.bfloat16, num_tokens=1)["failed"]) == 1

    # Where the dtype itself is far from float64 (the reference pipeline is 30% off), the tested
    # pipeline may be as far, and not three times as far.
    def noisy(scale):
        noise = torch.randn_like(exact["grad w"])
        return (exact["grad w"] + scale * noise * exact["grad w"].norm() / noise.norm()).to(torch.bfloat16)

    reference_noise = {"grad w": noisy(0.3)}
    assert judged({"grad w": noisy(0.3)}, reference_noise) == []
    assert len(judged({"grad w": noisy(0.9)}, reference_noise)) == 1


def test_a_recorded_call_replays_alike(cpu_pool):
    # A record as the soak writes one (its case with the case's seed, and the call), replayed twice:
    # the same distances both times, every tensor reported, on every rank.
    import random

    rng = random.Random(torch.randint(1, 10**6, ()).item())
    world = cpu_world_size()
    case = dict(draw_case(rng, world, on_gpu=False), seed=rng.randint(1, 10**6))
    call = dict(draw_call(rng, world, case), train=True)
    first, second = (cpu_pool.run(replay_rank, case=case, call=call) for _ in range(2))
    assert first == second, (case, call)
    for rank, answer in enumerate(first):
        assert answer["tokens"] == call["tokens"][rank] and answer["failed"] == [], (case, call, answer)
        if answer["tokens"]:
            assert answer["distances"]["output"][0] < 1e-5, (case, call, answer)
        assert any(name.startswith("grad ") for name in answer["distances"]), answer
