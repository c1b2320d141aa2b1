"""Time the fused layer alone under several parameter settings, and where its host time goes.

    torchrun --nproc_per_node 2 scripts/sweep_fused.py --shape NAME [--custom H,F,E,K,T ...]
        --comm-blocks 8,12,16,22 [--combine-blocks auto,22] [--n-chunks 4,8] [--gate-ops kernels,torch,graph]
        [--host-profile] [--out DIR]

The benchmark times one setting per run, next to stock DeepSpeed and the bounds; this times only
the fused layer, once per setting (every combination of the lists; "auto" is the selection rule),
so a split of the SMs can be chosen from one run. Same weights, inputs and timing as the
benchmark: the forward under no_grad and one training step, each the median of CUDA-event
timings started from an idle device, the maximum over ranks. --gate-ops torch runs the layer's
gate in torch ops instead of the op's gate kernels (the layer's own choice), and --gate-ops graph
replays the kernels' routing from CUDA graphs ("cuda_graph_gate"), for an A/B in one run. With --host-profile, rank 0 also
prints cProfile's busiest functions over a few training steps of the rule's setting: the host
work that an idle device waits for.
"""

import argparse
import contextlib
import cProfile
import itertools
import json
import os
import pstats

import deepspeed
import torch
from deepspeed import comm as dist

import ds_comet
import ds_comet.layer
from ds_comet.bench import timed, train_step
from ds_comet.gate import gate_routes
from ds_comet.experts import FeedForward, reset_expert_
from ds_comet.shapes import selected_shapes


def settings(text):
    return [None if v == "auto" else int(v) for v in text.split(",")]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens per rank)")
    parser.add_argument("--comm-blocks", type=settings, default=[None])
    parser.add_argument("--combine-blocks", type=settings, default=[None])
    parser.add_argument("--n-chunks", type=settings, default=[None])
    parser.add_argument("--gate-ops", type=lambda text: text.split(","), default=["kernels"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--out", default="sweep_out")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


def fused_layer(hidden, ffn, experts, k, overrides, device):
    torch.manual_seed(0)
    ep_size = dist.get_world_size()
    section = {"backend": "comet", "overlap": "fused", **overrides}
    layer = ds_comet.MoE(hidden, FeedForward(hidden, ffn), num_experts=experts, ep_size=ep_size, k=k,
                         min_capacity=4, config={"moe": section})
    layer.set_deepspeed_parallelism()
    local = layer.deepspeed_moe.experts.deepspeed_experts
    rank = dist.get_rank()
    for i, expert in enumerate(local):  # the benchmark's weights
        reset_expert_(expert, 1000 + rank * len(local) + i)
    return layer.to(device=device, dtype=torch.bfloat16)


@contextlib.contextmanager
def gate_ops(kind):
    """The layer's gate as it runs it ("kernels") or in torch ops alone ("torch")."""
    if kind not in ("kernels", "torch", "graph"):
        raise SystemExit(f"--gate-ops takes kernels, torch and/or graph, got {kind!r}")
    if kind == "torch":
        ds_comet.layer.gate_routes = lambda gate, tokens, used_token=None, op=None: gate_routes(gate, tokens, used_token)
    try:
        yield
    finally:
        ds_comet.layer.gate_routes = gate_routes


def host_profile(layer, x, dy, steps=10):
    for _ in range(3):
        train_step(layer, x, dy)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        torch.cuda.synchronize()
        train_step(layer, x, dy)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for name, (hidden, ffn, experts, k, tokens) in selected_shapes(args.shape, args.custom).items():
        x = torch.randn(1, tokens, hidden, device=device).to(torch.bfloat16)
        xg = x.detach().clone().requires_grad_()
        dy = torch.randn_like(x)
        for comm_blocks, combine_blocks, n_chunks, gate in itertools.product(args.comm_blocks, args.combine_blocks,
                                                                             args.n_chunks, args.gate_ops):
            overrides = {key: v for key, v in (("comm_blocks", comm_blocks), ("combine_blocks", combine_blocks),
                                               ("n_chunks", n_chunks)) if v is not None}
            graphed = {"cuda_graph_gate": True} if gate == "graph" else {}
            layer = fused_layer(hidden, ffn, experts, k, {**overrides, **graphed}, device)
            with gate_ops(gate):
                with torch.no_grad():
                    layer.eval()
                    forward = timed(lambda: layer(x), args.iters, args.warmup)
                layer.train()
                step = timed(lambda: train_step(layer, xg, dy), args.iters, args.warmup)
            times = torch.tensor([forward, step], device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            params = layer.deepspeed_moe.selector._params
            key = (f"{name} comm_blocks={params.comm_blocks} combine_blocks={params.combine_blocks} "
                   f"n_chunks={params.n_chunks} gate={gate}")
            results[key] = {"forward": times[0].item(), "fwd_bwd": times[1].item(), "rule": not overrides}
            if dist.get_rank() == 0:
                print(f"{key:94s} forward {times[0].item():7.3f} ms  fwd+bwd {times[1].item():7.3f} ms"
                      f"{'  (rule)' if not overrides else ''}", flush=True)
            profiled = args.host_profile and not overrides and gate == args.gate_ops[0]
            if profiled and dist.get_rank() == 0:
                print(f"== host profile: {key}", flush=True)
            if profiled:
                # Every rank steps (the layer's collectives pair up); rank 0 prints.
                if dist.get_rank() == 0:
                    host_profile(layer, xg, dy)
                else:
                    for _ in range(13):
                        torch.cuda.synchronize()
                        train_step(layer, xg, dy)
            layer = None  # freed before the next setting builds its own
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as handle:
            json.dump(results, handle, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
