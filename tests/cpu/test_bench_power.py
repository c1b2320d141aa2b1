"""The power benchmark's reading of nvidia-smi's samples (the sampling itself needs a GPU)."""

import pytest

from ds_comet.bench.power import summarize


def test_samples_are_summarized_skipping_unreadable_fields():
    lines = ["1455, 669.50, Active", "1500, 661.00, Active", "1980, [N/A], Not Active", "", "garbled line",
             "1470, 670.50, Active"]
    summary = summarize(lines)
    assert summary["sm_mhz"] == 1485  # the median of four clocks
    assert summary["watts"] == pytest.approx((669.5 + 661.0 + 670.5) / 3)
    assert summary["power_capped"] == 0.75 and summary["samples"] == 4


def test_no_samples_is_an_error_quoting_what_came():
    with pytest.raises(RuntimeError, match="no clock and power samples.*Failed to initialize NVML"):
        summarize(["Failed to initialize NVML: Driver/library version mismatch"])
