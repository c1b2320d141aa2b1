"""python -m ds_comet.bench.sent_bytes: the bytes one rank sends per exchange, by shape and EP size.

No GPU and no process group: each shape's tokens are routed by a top-k over random logits (a
balanced router), and ``routing.remote_rows`` (what ``python -m ds_comet.bench`` counts from a real
gate on the GPU) counts the rows that leave rank 0. Three ways of sending them are compared, in MB
per exchange:

- route by route: one row per route to another rank (what DeepSpeed's stock layer and AutoEP's
  all-to-all send);
- once per (token, rank): one row per token and destination rank holding any of its routes (both
  ds_comet pipelines, every exchange, in the tokens' dtype: bf16 here);
- FP8 rows: the same rows packed in FP8 with their 1x128 tiles' scales (``"dispatch": "fp8"`` and
  ``"gradient_dispatch": "fp8"``; shapes whose hidden size is a multiple of 128).

    python -m ds_comet.bench.sent_bytes [--ep 2 4 8] [--shape NAME ...] [--seed N]
"""

import argparse

import torch

from ..fp8 import BLOCK as FP8_BLOCK
from ..kernels.fp8_rows import packed_row_bytes
from ..pipelines.routing import remote_rows
from .shapes import SHAPES

BF16_BYTES = 2


def exchange_mb(
    indices: torch.Tensor, num_experts: int, ep_size: int, rank: int, hidden: int, element_size: int
) -> dict[str, float]:
    """MB ``rank`` sends per exchange for the gate's ``indices`` ([k, S], as ``routing.remote_rows``
    takes them), rows of ``hidden`` elements of ``element_size`` bytes: ``route`` (route by route),
    ``once`` (once per (token, rank)), and ``fp8`` (those rows packed in FP8, where ``hidden`` is a
    multiple of 128)."""
    route_rows, once_rows = remote_rows(indices, num_experts, ep_size, rank)
    sent = {"route": route_rows * hidden * element_size / 1e6, "once": once_rows * hidden * element_size / 1e6}
    if hidden % FP8_BLOCK == 0:
        sent["fp8"] = once_rows * packed_row_bytes(hidden) / 1e6
    return sent


def sent_mb(hidden: int, num_experts: int, top_k: int, tokens: int, ep_size: int, seed: int) -> dict[str, float]:
    """``exchange_mb`` of rank 0 under a balanced router (a top-k over random logits), bf16 rows."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randn(tokens, num_experts, generator=generator).topk(top_k, dim=1).indices
    return exchange_mb(indices.t().contiguous(), num_experts, ep_size, 0, hidden, BF16_BYTES)


def table(names: list[str], ep_sizes: list[int], seed: int) -> str:
    """A Markdown table: per shape and EP size, route by route / once per (token, rank) (their
    ratio) / FP8 rows."""
    lines = ["| shape | " + " | ".join(f"EP={p}: route / once (ratio) / FP8" for p in ep_sizes) + " |"]
    lines.append("| --- " * (len(ep_sizes) + 1) + "|")
    for name in names:
        hidden, _, num_experts, top_k, tokens = SHAPES[name]
        cells = []
        for ep_size in ep_sizes:
            if num_experts % ep_size:
                cells.append(f"({num_experts} experts over {ep_size} ranks: uneven)")
                continue
            sent = sent_mb(hidden, num_experts, top_k, tokens, ep_size, seed)
            fp8 = f"{sent['fp8']:.1f}" if "fp8" in sent else "-"
            cells.append(f"{sent['route']:.1f} / {sent['once']:.1f} ({sent['once'] / sent['route']:.2f}) / {fp8}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8], help="expert-parallel sizes")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if any(ep < 2 for ep in args.ep):
        parser.error("--ep: each size must be 2 or more (one rank sends nothing)")
    print(table(args.shape or sorted(SHAPES), args.ep, args.seed))


if __name__ == "__main__":
    main()
