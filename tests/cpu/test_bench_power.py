"""The power benchmark's reading of nvidia-smi's samples and its step count (the sampling itself
needs a GPU)."""

import time

import pytest
import torch
from deepspeed import comm as dist

from ds_comet.bench.power import agreed_steps, summarize


def test_samples_are_summarized_skipping_unreadable_fields():
    lines = [
        "1455, 669.50, Active",
        "1500, 661.00, Active",
        "1980, [N/A], Not Active",
        "",
        "garbled line",
        "1470, 670.50, Active",
    ]
    summary = summarize(lines)
    assert summary["sm_mhz"] == 1485  # the median of four clocks
    assert summary["watts"] == pytest.approx((669.5 + 661.0 + 670.5) / 3)
    assert summary["power_capped"] == 0.75 and summary["samples"] == 4


def test_no_samples_is_an_error_quoting_what_came():
    with pytest.raises(RuntimeError, match="no clock and power samples.*Failed to initialize NVML"):
        summarize(["Failed to initialize NVML: Driver/library version mismatch"])


def agreed_steps_case():
    """Rank 0's steps take a tenth of the others'; every rank returns the count it would run."""
    pause = 0.002 if dist.get_rank() == 0 else 0.02
    return agreed_steps(lambda: time.sleep(pause), 0.2, torch.device("cpu"))


def test_every_rank_runs_the_fastest_ranks_count_of_steps(cpu_pool):
    counts = cpu_pool.run(agreed_steps_case)
    assert len(set(counts)) == 1, counts  # a rank with fewer steps would leave its peers in a collective
    assert counts[0] >= 30, counts  # set by rank 0's 2 ms steps (about 100), not the others' 20 ms (10)
