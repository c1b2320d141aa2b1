"""python -m ds_comet.bench.sent_bytes: the bytes per exchange, against a count by hand."""

import pytest
import torch

from ds_comet.bench import sent_bytes
from ds_comet.kernels.fp8_rows import packed_row_bytes


@pytest.mark.parametrize("ep_size", [2, 4])
def test_the_rows_are_counted_as_by_hand(ep_size):
    hidden, experts, top_k, tokens, seed = 256, 8, 3, 97, 5
    sent = sent_bytes.sent_mb(hidden, experts, top_k, tokens, ep_size, seed)
    # The same routing, counted route by route and token by token: rank 0 holds experts [0, E/P).
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randn(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    ranks = indices // (experts // ep_size)
    route_rows = int((ranks != 0).sum())
    once_rows = sum(len(set(row.tolist()) - {0}) for row in ranks)
    assert once_rows < route_rows  # k = 3 over few ranks: tokens share destinations
    assert sent["route"] == pytest.approx(route_rows * hidden * 2 / 1e6)
    assert sent["once"] == pytest.approx(once_rows * hidden * 2 / 1e6)
    assert sent["fp8"] == pytest.approx(once_rows * packed_row_bytes(hidden) / 1e6)
    assert 0.5 < sent["fp8"] / sent["once"] < 0.6


def test_the_table_names_uneven_groups_and_hidden_sizes_without_fp8(capsys):
    sent_bytes.main(["--ep", "2", "3", "--shape", "gpt-oss-H2880-F2880-E32-k4-T8192"])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| gpt-oss-H2880-F2880-E32-k4-T8192 |") and "(32 experts over 3 ranks: uneven)" in row
    assert row.split("|")[2].strip().endswith("/ -")  # H2880: no FP8 rows
    with pytest.raises(SystemExit):
        sent_bytes.main(["--ep", "1"])
