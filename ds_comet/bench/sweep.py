"""Time the fused layer alone under several parameter settings, and where its host time goes.

    torchrun --nproc_per_node 2 -m ds_comet.bench.sweep --shape NAME [--custom H,F,E,K,T ...]
        --comm-blocks 8,12,16,22 [--combine-blocks auto,22] [--n-chunks 4,8] [--gate-ops kernels,torch,graph]
        [--dtype bf16,fp16] [--host-profile] [--host-split] [--out DIR]

The benchmark times one setting per run, next to stock DeepSpeed and the bounds; this times only
the fused layer, once per setting (every combination of the lists; "auto" is the selection rule),
so a split of the SMs can be chosen from one run. Same weights, inputs and timing as the
benchmark: the forward under no_grad and one training step, each the median of CUDA-event
timings started from an idle device, the maximum over ranks. --gate-ops torch runs the layer's
gate in torch ops instead of the op's gate kernels (the layer's own choice), and --gate-ops graph
replays the kernels' routing from CUDA graphs ("cuda_graph_gate"), for an A/B in one run. With
--host-profile, rank 0 also prints cProfile's busiest functions over a few training steps of the
rule's setting: the host work that an idle device waits for; with --host-split (one rank), the
host time of a training step split into its parts, without a profiler's overhead.

Each setting is also timed back to back (--iters calls queued with no sync between them, as a
training loop queues them), with the host's own time to queue them: where the host's time is the
larger, the layer is bound by launches even in a loop. Last, the device's own time per call: the
same calls queued behind a sleeping kernel long enough for the host to queue them all, so that
the device never waits for the host (nan where the host could not get that far ahead).
"""

import argparse
import collections
import contextlib
import cProfile
import itertools
import json
import os
import pstats
import time

import deepspeed
import torch
from deepspeed import comm as dist

import ds_comet
import ds_comet.integrations.legacy.layer as legacy_layer
from ds_comet.bench.common import timed, train_step
from ds_comet.bench.shapes import selected_shapes
from ds_comet.experts import FeedForward, reset_expert_
from ds_comet.integrations.legacy.gate import gate_routes


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
    parser.add_argument(
        "--dtype",
        type=lambda text: text.split(","),
        default=["bf16"],
        help="the layer's and the tokens' dtypes, each timed in turn: bf16 and/or fp16",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--host-split", action="store_true")
    parser.add_argument("--out", default="sweep_out")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fused_layer(hidden, ffn, experts, k, overrides, device, dtype):
    torch.manual_seed(0)
    ep_size = dist.get_world_size()
    section = {"backend": "comet", "overlap": "fused", **overrides}
    layer = ds_comet.MoE(
        hidden,
        FeedForward(hidden, ffn),
        num_experts=experts,
        ep_size=ep_size,
        k=k,
        min_capacity=4,
        config={"moe": section},
    )
    layer.set_deepspeed_parallelism()
    local = layer.deepspeed_moe.experts.deepspeed_experts
    rank = dist.get_rank()
    for i, expert in enumerate(local):  # the benchmark's weights
        reset_expert_(expert, 1000 + rank * len(local) + i)
    return layer.to(device=device, dtype=dtype)


@contextlib.contextmanager
def gate_ops(kind):
    """The layer's gate as it runs it ("kernels") or in torch ops alone ("torch")."""
    if kind not in ("kernels", "torch", "graph"):
        raise SystemExit(f"--gate-ops takes kernels, torch and/or graph, got {kind!r}")
    if kind == "torch":
        legacy_layer.gate_routes = lambda gate, tokens, used_token=None, op=None: gate_routes(gate, tokens, used_token)
    try:
        yield
    finally:
        legacy_layer.gate_routes = gate_routes


def back_to_back(fn, iters):
    """(ms per call with iters calls queued without a sync, ms of host time per call to queue them)."""
    fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    host = (time.perf_counter() - begin) * 1e3 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters, host


def device_only(fn, iters, lead_ms=200.0):
    """ms per call of the device alone: iters calls queued while the device sleeps lead_ms, then run
    back to back; None if the host took longer to queue them than the sleep lasted."""
    fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    before, start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    before.record()
    torch.cuda._sleep(int(lead_ms * 2e6))  # cycles: about lead_ms at 2 GHz (more at lower clocks)
    start.record()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    queued_ms = (time.perf_counter() - begin) * 1e3
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters if queued_ms < before.elapsed_time(start) else None


@contextlib.contextmanager
def timing(spent, *targets):
    """Adds each target's host seconds per call to spent[label]; targets are (owner, name, label),
    an autograd Function's static methods included."""
    originals = []
    for owner, name, label in targets:
        raw = vars(owner).get(name, getattr(owner, name))
        function = raw.__func__ if isinstance(raw, staticmethod) else raw

        def wrapper(*args, _function=function, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - start

        setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)
        originals.append((owner, name, raw))
    try:
        yield
    finally:
        for owner, name, raw in reversed(originals):
            setattr(owner, name, raw)


def host_split(layer, x, dy, steps=20):
    """Host ms per training step of its parts, each step started on an idle device."""
    import ds_comet.integrations.legacy.gate_graph as gate_graph
    import ds_comet.pipelines.expert_weights as expert_weights
    import ds_comet.pipelines.fused as fused

    spent = collections.defaultdict(float)
    targets = [
        (legacy_layer, "gate_routes", "forward: gate (eager)"),
        (gate_graph.GateGraphs, "routes", "forward: gate (graphed)"),
        (fused, "plan_routes_cuda", "forward: plan"),
        (fused.FusedPipeline, "run_forward", "forward: the fused kernels' launches"),
        (fused.FusedMoEFunction, "forward", "forward: the fused Function's forward"),
        (expert_weights.ModuleFusedExperts, "parameters", "forward: the experts' parameters"),
        (fused.FusedMoEFunction, "backward", "backward: the fused Function's backward"),
        (fused.FusedPipeline, "run_backward", "backward: the fused kernels' launches"),
        (fused.ProjectionGradients, "backward", "backward: the first layer's weight gradients"),
        (gate_graph.ReplayRoutes, "backward", "backward: graphed gate"),
    ]
    for _ in range(3):
        train_step(layer, x, dy)
    with timing(spent, *targets):
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            layer.zero_grad(set_to_none=True)
            x.grad = None
            middle = time.perf_counter()
            out, l_aux, _ = layer(x)
            end = time.perf_counter()
            torch.autograd.backward([out, l_aux], [dy, torch.ones_like(l_aux)])
            spent["zero_grad"] += middle - start
            spent["forward"] += end - middle
            spent["backward"] += time.perf_counter() - end
    torch.cuda.synchronize()
    return {label: seconds * 1e3 / steps for label, seconds in spent.items()}


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


def time_setting(layer, x, xg, dy, gate, device, args):
    """One setting's eight times in ms, the maximum over ranks: the forward (no_grad, eval) and the
    training step, each timed, queued back to back, the host's time to queue one, and the device's
    alone (nan where the host could not get far enough ahead)."""
    with gate_ops(gate):
        with torch.no_grad():
            layer.eval()
            forward = timed(lambda: layer(x), args.iters, args.warmup)
            forward_queued, forward_host = back_to_back(lambda: layer(x), args.iters)
            forward_device = device_only(lambda: layer(x), args.iters)
        layer.train()
        step = timed(lambda: train_step(layer, xg, dy), args.iters, args.warmup)
        step_queued, step_host = back_to_back(lambda: train_step(layer, xg, dy), args.iters)
        # Few steps: an eager gate's hundreds of launches a step would fill the launch queue,
        # which blocks the host.
        step_device = device_only(lambda: train_step(layer, xg, dy), min(args.iters, 5))
    times = torch.tensor(
        [
            forward,
            step,
            forward_queued,
            step_queued,
            forward_host,
            step_host,
            forward_device or float("nan"),
            step_device or float("nan"),
        ],
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def setting_results(t, rule):
    """sweep.json's entry for one setting's times ``t`` (``time_setting``); ``rule``: no overrides."""
    return {
        "forward": t[0],
        "fwd_bwd": t[1],
        "forward_queued": t[2],
        "fwd_bwd_queued": t[3],
        "forward_host": t[4],
        "fwd_bwd_host": t[5],
        "forward_device": t[6],
        "fwd_bwd_device": t[7],
        "rule": rule,
    }


def print_setting(key, t, rule):
    print(
        f"{key:94s} forward {t[0]:7.3f} ms  fwd+bwd {t[1]:7.3f} ms{'  (rule)' if rule else ''}"
        f"\n{'':94s} queued: forward {t[2]:7.3f} ms (host {t[4]:.3f})  fwd+bwd {t[3]:7.3f} ms "
        f"(host {t[5]:.3f})\n{'':94s} device alone: forward {t[6]:7.3f} ms  fwd+bwd {t[7]:7.3f} ms",
        flush=True,
    )


def host_times(layer, xg, dy, key, profiled, args):
    """With ``profiled``, rank 0's cProfile of training steps (every rank steps); with --host-split,
    rank 0's host time of a training step by part."""
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
    if args.host_split and dist.get_rank() == 0:
        for label, ms in host_split(layer, xg, dy).items():
            print(f"{'':94s} host split: {label:45s} {ms:7.3f} ms", flush=True)


def sweep_shape(name, shape, dtype_name, device, args):
    """{setting: its results} of one shape in one dtype, every combination of the listed settings."""
    hidden, ffn, experts, k, tokens = shape
    dtype = DTYPES[dtype_name]
    x = torch.randn(1, tokens, hidden, device=device).to(dtype)
    xg = x.detach().clone().requires_grad_()
    dy = torch.randn_like(x)
    results = {}
    for comm_blocks, combine_blocks, n_chunks, gate in itertools.product(
        args.comm_blocks, args.combine_blocks, args.n_chunks, args.gate_ops
    ):
        overrides = {
            key: v
            for key, v in (("comm_blocks", comm_blocks), ("combine_blocks", combine_blocks), ("n_chunks", n_chunks))
            if v is not None
        }
        graphed = {"cuda_graph_gate": True} if gate == "graph" else {}
        layer = fused_layer(hidden, ffn, experts, k, {**overrides, **graphed}, device, dtype)
        t = time_setting(layer, x, xg, dy, gate, device, args)
        params = layer.deepspeed_moe.pipelines.fused.params
        key = (
            f"{name} comm_blocks={params.comm_blocks} combine_blocks={params.combine_blocks} "
            f"n_chunks={params.n_chunks} gate={gate}" + ("" if dtype_name == "bf16" else f" {dtype_name}")
        )
        results[key] = setting_results(t, not overrides)
        if dist.get_rank() == 0:
            print_setting(key, t, not overrides)
        host_times(layer, xg, dy, key, args.host_profile and not overrides and gate == args.gate_ops[0], args)
        layer = None  # freed before the next setting builds its own
        torch.cuda.empty_cache()
    return results


def main():
    args = parse_args()
    if args.host_split and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("--host-split times one rank's steps alone: run it with --nproc_per_node 1")
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    unknown = sorted(set(args.dtype) - set(DTYPES))
    if unknown:
        raise SystemExit(f"--dtype takes bf16 and/or fp16, got {','.join(unknown)}")
    for (name, shape), dtype_name in itertools.product(selected_shapes(args.shape, args.custom).items(), args.dtype):
        results.update(sweep_shape(name, shape, dtype_name, device, args))
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as handle:
            json.dump(results, handle, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
