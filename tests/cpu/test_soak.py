"""The soak harness on CPU: random layers and calls on the reference pipeline, each against float64.

The same harness runs the fused pipeline on a GPU (tests/gpu/test_soak.py, and thousands of calls
from ``python -m tests.support.soak``); here it checks the reference pipeline, which defines the
numbers, over random shapes, k, skew, drops, empty ranks, train and eval.
"""

import torch

from tests.support.soak import soak_rank, summarize


def test_random_reference_calls_match_float64(cpu_pool):
    seed = torch.randint(1, 10**6, ()).item()
    report = summarize(cpu_pool.run(soak_rank, seed=seed, calls=15))
    assert report["calls"] == 15 and report["cases"] >= 3, (seed, report)
    assert report["mismatches"] == 0 and report["hangs"] == 0, (seed, report)
    assert report["worst"]["output vs float64"] < 1e-5, (seed, report)
