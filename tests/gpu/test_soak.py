"""A short soak of the fused pipeline: random layers and calls, each against float64 and the
reference pipeline (tests/support/soak.py; ``python -m tests.support.soak`` runs thousands)."""

import torch

from tests.support.soak import soak_rank, summarize


def test_random_fused_calls_match_float64_and_the_reference(gpu_pool):
    seed = torch.randint(1, 10**6, ()).item()
    report = summarize(gpu_pool.run(soak_rank, seed=seed, calls=40, timeout=900))
    assert report["calls"] == 40, (seed, report)
    assert report["fused_calls"] == report["calls"], (
        f"some calls did not run the fused pipeline (seed {seed}): {report}"
    )
    assert report["mismatches"] == 0 and report["hangs"] == 0, (seed, report)
