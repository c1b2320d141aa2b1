"""The exchange of a group that spans nodes: in chunks against the blocking whole exchange.

    torchrun --nproc_per_node 2 -m ds_comet.bench.internode [--shape NAME ...] [--custom H,F,E,K,T ...]
                                                            [--chunks 1,rule,2,4,8] [--ranks-per-node 1]
                                                            [--forwarding] [--no-backward] [--out DIR]

The group's ranks are declared to sit on nodes of ``--ranks-per-node`` ranks (``DS_COMET_RANKS_PER_NODE``),
so that one host runs the path of a group that spans nodes: the reference pipeline, its rows in
chunks. For each chunk count (1: the whole exchange, blocking; ``rule``: the count the layer picks
itself) the comet layer, with the same weights and tokens, times its forward and, unless
``--no-backward``, its training step (forward and backward of the output and the aux loss): the
median of many calls, every rank starting each call together (CUDA events on a GPU, the host's
clock on CPU). With ``--forwarding`` each count runs a second time with ``"internode_forwarding"``
(each token once to each node, forwarded inside it; its arms are named "<count> fwd"). Rank 0 prints
each arm's times and their ratio to the whole per-rank exchange's, and writes internode.json under
``--out``.

On one host the link between declared nodes is the host's own (NVLink between GPUs, shared memory
for gloo on CPU), not a NIC: the ratios show what the chunks hide at that link's rate. A GPU
machine needs one GPU a rank (NCCL); ranks sharing a GPU time-slice it, and their times mean little.
"""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

import ds_comet
from ds_comet.bench.common import run_shapes, timed, train_step
from ds_comet.bench.shapes import SHAPES, SWIGLU, selected_shapes
from ds_comet.experts import FeedForward, GatedFeedForward, reset_expert_
from ds_comet.pipelines.policy import RANKS_PER_NODE_VAR


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens per rank)")
    parser.add_argument(
        "--chunks",
        type=lambda text: text.split(","),
        default=["1", "rule", "2", "4", "8"],
        help="chunk counts, 1 (the whole exchange) first; rule: the layer's own",
    )
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument(
        "--forwarding",
        action="store_true",
        help='also run each count with "internode_forwarding" (needs 2 or more ranks a node)',
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-backward", dest="backward", action="store_false")
    parser.add_argument("--out", default="internode_out")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args()
    if args.chunks[0] != "1" or not all(c == "rule" or c.isdigit() and int(c) >= 1 for c in args.chunks):
        parser.error(
            f"--chunks takes counts (1 first, the whole exchange the others are compared with) and "
            f"'rule', got {','.join(args.chunks)}"
        )
    return args


def bench_shape(name, hidden, ffn, experts, k, tokens, args, device, dtype):
    """Times of each arm on one shape: {arm: {"forward": ms, "step": ms, "chunks": used, "ranks_per_node":
    the ranks a node forwarding spans, or None}}; an arm is a chunk count, and "<count> fwd" with forwarding."""
    world = dist.get_world_size()
    gated = name in SWIGLU
    torch.manual_seed(0)
    template = GatedFeedForward(hidden, ffn) if gated else FeedForward(hidden, ffn)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(1, tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    dy = torch.randn(1, tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    results, state = {}, None
    arms = [(count, False) for count in args.chunks] + [(count, True) for count in args.chunks if args.forwarding]
    for count, forwarding in arms:
        section = {"backend": "comet", "overlap": "none", "internode_forwarding": forwarding}
        if count != "rule":
            section["internode_chunks"] = int(count)
        layer = ds_comet.MoE(
            hidden, template, num_experts=experts, ep_size=world, k=k, min_capacity=4, config={"moe": section}
        )
        layer.set_deepspeed_parallelism()
        if state is None:
            local = layer.deepspeed_moe.experts.deepspeed_experts
            for i, expert in enumerate(local):
                reset_expert_(expert, 1000 + dist.get_rank() * len(local) + i)
            state = layer.state_dict()
        layer.load_state_dict(state)
        layer.to(device=device, dtype=dtype).eval()
        with torch.no_grad():
            forward = timed(lambda: layer(x), args.iters, args.warmup)
        reference = layer.deepspeed_moe.pipelines.reference
        entry = {"forward": forward, "chunks": reference.chunks, "ranks_per_node": reference.ranks_per_node}
        if args.backward:
            layer.train()
            inputs = x.clone().requires_grad_()
            entry["step"] = timed(lambda: train_step(layer, inputs, dy), args.iters, args.warmup)
        results[f"{count} fwd" if forwarding else count] = entry
    return results


def report(all_results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "internode.json"), "w") as handle:
        json.dump(all_results, handle, indent=1)
    for name, results in all_results.items():
        whole = results["1"]
        print(f"\n{name} (ms; ratio: the whole exchange's time over this one's, above 1 is faster)")
        print(
            f"{'chunks':>10}{'used':>6}{'node':>6}{'forward':>10}{'ratio':>8}{'step':>10}{'ratio':>8}"
            "   (node: the ranks a node forwarding spans; -: each token to each rank)"
        )
        for count, entry in results.items():
            step = entry.get("step")
            node = entry.get("ranks_per_node") or "-"
            print(
                f"{count:>10}{entry['chunks']:>6}{node:>6}{entry['forward']:>10.3f}"
                f"{whole['forward'] / entry['forward']:>8.2f}"
                + (f"{step:>10.3f}{whole['step'] / step:>8.2f}" if step is not None else "")
            )


def main():
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))  # the launcher's
    if world <= args.ranks_per_node:
        raise SystemExit(
            f"{world} ranks at {args.ranks_per_node} a node are one node: nothing crosses between "
            "nodes (lower --ranks-per-node)"
        )
    if args.forwarding and args.ranks_per_node < 2:
        raise SystemExit("--forwarding passes tokens on inside nodes: it needs --ranks-per-node 2 or more")
    os.environ[RANKS_PER_NODE_VAR] = str(args.ranks_per_node)
    deepspeed.init_distributed()
    accelerator = get_accelerator()
    on_gpu = accelerator.device_name() == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device(accelerator.device_name(), accelerator.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    run_shapes(
        selected_shapes(args.shape, args.custom),
        lambda name, shape: bench_shape(name, *shape, args, device, dtype),
        report,
        args.out,
    )


if __name__ == "__main__":
    main()
