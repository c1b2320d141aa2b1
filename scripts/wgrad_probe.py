#!/usr/bin/env python3
"""Weight-gradient GEMMs on one GPU: ds_comet's Triton wgrad_kernel against torch._grouped_mm (cuBLAS/CUTLASS).

    python3 scripts/wgrad_probe.py [--grids 110,123,128,132] [--every-expert] [--out DIR]

For each default shape (EP=2, the rows one rank receives, mildly uneven, one expert empty) it times
dW2 = dY_l^T h_l ([L, H, F]) and dW1 = dA_l^T x_l ([L, F, H]) both ways, checks both against an fp32
per-expert reference, and prints TFLOP/s. It decides which grouped weight-gradient GEMM the fused
backward should use. With --grids it times the fused backward's configuration on each of those
numbers of programs instead (inside a training step it was slow on one grid: docs/performance.md).
--every-expert gives every expert rows, as a training step's routing does.
"""

import argparse
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds_comet.shapes import SHAPES  # noqa: E402
from ds_comet.triton_gemm import wgrad_kernel  # noqa: E402

FUSED_CONFIG = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)  # what fused.py launches
CONFIGS = [dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3), dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
           dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4), dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4),
           dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=4)]


def counts_for(rows, experts, generator, every_expert):
    weights = torch.rand(experts, generator=generator) + 0.5
    if not every_expert:
        weights[experts // 2] = 0  # one expert without rows
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    return counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--grids", type=lambda text: [int(v) for v in text.split(",")], default=None)
    parser.add_argument("--every-expert", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = {}
    for name, (H, F, E, k, T) in SHAPES.items():
        L = E // 2
        g = torch.Generator().manual_seed(0)
        counts = counts_for(2 * T * k // 2, L, g, args.every_expert)
        rows = int(counts.sum())
        starts = torch.zeros(L + 1, dtype=torch.int32)
        starts[1:] = counts.cumsum(0)
        layout = starts.to(dev)
        offs = layout[1:]
        entry = {}
        for what, M, N in (("dW2", H, F), ("dW1", F, H)):
            a = torch.randn(rows + 64, M, device=dev, dtype=torch.bfloat16)
            b = torch.randn(rows + 64, N, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * rows * M * N
            ref = torch.stack([a[s:e].float().t() @ b[s:e].float() for s, e in zip(starts[:-1].tolist(), starts[1:].tolist())])

            def rel(x):
                return ((x.float() - ref).norm() / ref.norm()).item()

            out = torch.empty(L, M, N, device=dev, dtype=torch.bfloat16)
            bias = torch.empty(L, M, device=dev, dtype=torch.bfloat16)
            runs = [(FUSED_CONFIG, grid) for grid in args.grids] if args.grids else [(cfg, sms - 16) for cfg in CONFIGS]
            for cfg, grid in runs:
                c = dict(cfg)
                bm, bn, bk = c.pop("BM"), c.pop("BN"), c.pop("BK")

                def run():
                    wgrad_kernel[(grid, )](a, M, b, N, out, bias, layout, 0, M, N, L, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                                           NUM_PROGS=grid, HAS_BIAS=False, **c)
                try:
                    run()
                    err = rel(out)
                    ms = triton.testing.do_bench(run, warmup=10, rep=60)
                    entry[f"{what} triton {cfg} grid {grid}"] = dict(ms=ms, tflops=flops / ms / 1e9, err=err)
                except Exception as error:  # a config that does not fit
                    entry[f"{what} triton {cfg} grid {grid}"] = dict(error=str(error)[:200])
            if args.grids:
                continue
            try:
                def grouped():
                    return torch._grouped_mm(a[:rows].t(), b[:rows], offs=offs)
                got = grouped()
                err = rel(got)
                ms = triton.testing.do_bench(grouped, warmup=10, rep=60)
                entry[f"{what} grouped_mm"] = dict(ms=ms, tflops=flops / ms / 1e9, err=err)
                if not args.every_expert:
                    entry[f"{what} grouped_mm"]["empty_group_zero"] = bool((got[L // 2] == 0).all())
            except Exception as error:
                entry[f"{what} grouped_mm"] = dict(error=str(error)[:300])
        results[name] = entry
        for key, value in entry.items():
            print(name, key, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in value.items()}, flush=True)
    if args.out:
        with open(os.path.join(args.out, "wgrad_probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
