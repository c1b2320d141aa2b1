#!/usr/bin/env python3
"""The routing plan's ``plan`` kernel alone: 50 calls captured in a CUDA graph, replayed.

    python3 scripts/plan_probe.py LABEL

One GPU. Prints microseconds per call for a few (tokens, k, experts) and whether the plan equals
``routing.plan_routes`` (torch's sort) on the same indices, some of them dropped.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_comet.ops import load_op  # noqa: E402
from ds_comet.routing import plan_routes  # noqa: E402
from graph_timing import us_per_call  # noqa: E402


def main():
    op, label = load_op(), sys.argv[1] if len(sys.argv) > 1 else ""
    for tokens, k, experts in [(8192, 2, 8), (8192, 4, 64), (4096, 8, 32), (16384, 8, 256)]:
        generator = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.rand(tokens, experts, device="cuda", generator=generator)
        indices = scores.topk(k, dim=1).indices.t().contiguous().int()
        indices[torch.rand(indices.shape, device="cuda", generator=generator) < 0.1] = -1
        flat = indices.reshape(-1)
        order = torch.empty(flat.numel(), dtype=torch.int64, device="cuda")
        position = torch.empty_like(order)
        counts = torch.empty(experts, dtype=torch.int64, device="cuda")

        def call():
            op.plan(flat, experts, order, position, counts)

        us = us_per_call(call)
        want = plan_routes(indices, experts)
        ok = (torch.equal(order, want.route_order) and torch.equal(position, want.route_position)
              and torch.equal(counts, want.expert_counts))
        print(f"{label} T{tokens} k{k} E{experts}: {us:.1f} us per call, equals plan_routes {ok}", flush=True)


if __name__ == "__main__":
    main()
