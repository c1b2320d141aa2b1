#!/usr/bin/env python3
"""The top-k gate's ``topk_masks`` kernel alone: 50 calls captured in a CUDA graph, replayed.

    python3 scripts/topk_masks_probe.py LABEL

One GPU. Prints microseconds per call for a few (tokens, experts, k), with and without the
capacity drop, and whether the expert counts equal ``torch.bincount`` of the choices.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_comet.ops import load_op  # noqa: E402
from graph_timing import us_per_call  # noqa: E402


def main():
    op, label = load_op(), sys.argv[1] if len(sys.argv) > 1 else ""
    for tokens, experts, k in [(8192, 64, 4), (4096, 32, 8), (3001, 64, 4), (8192, 64, 8)]:
        generator = torch.Generator(device="cuda").manual_seed(0)
        gates = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=generator), 1)
        top_gate, top_idx = torch.topk(gates, k, 1)
        for drop in (True, False):
            mask = torch.empty(tokens, experts, device="cuda")
            kept, ranked = torch.empty_like(mask), torch.empty_like(mask)
            indices = torch.empty(k, tokens, dtype=torch.int32, device="cuda")
            counts = torch.empty(experts, dtype=torch.int64, device="cuda")

            def call():
                op.topk_masks(top_idx, top_gate, drop, mask, kept, ranked, indices, counts)

            us = us_per_call(call)
            ok = torch.equal(counts, torch.bincount(top_idx.flatten(), minlength=experts))
            print(f"{label} T{tokens} E{experts} k{k} drop={drop}: {us:.1f} us per call, counts ok {ok}", flush=True)


if __name__ == "__main__":
    main()
