"""Where an MoE layer's forward (and training step) spends its time, host against device, by kernel.

    torchrun --nproc_per_node 2 -m ds_comet.bench.profile [--shape NAME ...] [--custom H,F,E,K,T ...]
        [--step | --step-only] [--timeline]

For the gate alone (stock's call and gate_routes), the routing plan (torch and kernel), and the
stock and fused layers (eval and train mode), rank 0 prints the host time of one call (no sync),
the CUDA-event time of one call started from an idle device, whether the call synchronised with
the host, and the device kernels of one call, largest first. A call whose host time is close to
its event time is bound by launches, not by the GPU. With --step it does the same for one training
step of each layer (forward and backward, as the benchmark times it), listing more kernels; with
--timeline also the fused layer's kernels in the order they ran, with launch times, on every rank,
and what the host ran in the longest stretch without a launch.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import deepspeed
import torch
from deepspeed import comm as dist
from torch.profiler import ProfilerActivity, profile

from ds_comet.bench.common import build, train_step
from ds_comet.bench.shapes import SHAPES, selected_shapes
from ds_comet.integrations.legacy.gate import gate_routes
from ds_comet.kernels.ops import load_op
from ds_comet.kernels.routing_plan import plan_routes_cuda
from ds_comet.pipelines.routing import plan_routes


def host_and_device_ms(fn, iters=10):
    host, device = [], []
    for _ in range(3):
        fn()
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        stop.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(stop))
    return statistics.median(host), statistics.median(device)


def syncs(fn):
    """Number of host synchronisations torch reports during one call."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def kernels(fn, top=12):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    count = sum(e.count for e in events)
    lines = [f"    {count} kernels, {total / 1e3:.3f} ms of kernel time"]
    for e in events[:top]:
        lines.append(f"    {e.device_time_total / 1e3:8.3f} ms x{e.count:<3d} {e.key[:110]}")
    return "\n".join(lines)


def timeline(fn, min_us=4.0):
    """One call's device work in start order: when each kernel was launched and ran, in ms from the
    first launch, and on which stream. A kernel that starts as soon as it is launched waited on the
    host; one whose start matches another's end waited on that kernel (or on a flag it spins on)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle)["traceEvents"]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not work:
        return "    (no device work recorded)"
    work.sort(key=lambda e: e["ts"])
    origin = min([launches.get(e["args"].get("correlation"), e["ts"]) for e in work] + [work[0]["ts"]])
    busy_until, lines, small = origin, [], 0
    for e in work:
        end = e["ts"] + e["dur"]
        if e["dur"] < min_us:
            small += 1
            busy_until = max(busy_until, end)
            continue
        idle = max(0.0, e["ts"] - busy_until)
        launched = launches.get(e["args"].get("correlation"))
        launch = f"{(launched - origin) / 1e3:7.3f}" if launched is not None else "      ?"
        lines.append(
            f"    launch {launch}  start {(e['ts'] - origin) / 1e3:7.3f}  end {(end - origin) / 1e3:7.3f}"
            f"  ({e['dur'] / 1e3:6.3f})  idle before {idle / 1e3:6.3f}  s{e.get('tid')}  {e['name'][:70]}"
        )
        busy_until = max(busy_until, end)
    lines.append(
        f"    (+{small} items under {min_us:.0f} us; last end {(busy_until - origin) / 1e3:.3f} ms after the "
        f"first launch)"
    )
    lines += host_in_longest_gap(events, sorted(launches.values()), origin)
    return "\n".join(lines)


def host_in_longest_gap(events, launches, origin, min_us=20.0, most=25):
    """What the host ran between the two launches (sorted times) furthest apart: the outermost
    profiled ops (and autograd nodes) that started in that gap, in order. A launch-bound step is as
    long as its host work, so its longest launch gap says where that work goes."""
    if len(launches) < 2:
        return []
    gap, start = max((b - a, a) for a, b in zip(launches, launches[1:]))
    end = start + gap
    ops = sorted(
        (
            e
            for e in events
            if e.get("cat") in ("cpu_op", "user_annotation") and start <= e["ts"] < end and e.get("dur", 0) >= min_us
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    lines = [
        f"    host between launches at {(start - origin) / 1e3:.3f} and {(end - origin) / 1e3:.3f} ms "
        f"(ops of {min_us:.0f} us or more, outermost first):"
    ]
    outer_end = None
    for e in ops:
        if outer_end is not None and e["ts"] + e["dur"] <= outer_end:
            continue  # inside an op already listed
        outer_end = e["ts"] + e["dur"]
        lines.append(f"      at {(e['ts'] - origin) / 1e3:7.3f}  ({e['dur'] / 1e3:6.3f})  {e['name'][:90]}")
        if len(lines) > most:
            break
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--custom", action="append", default=[])
    parser.add_argument("--step", action="store_true", help="also profile one training step (fwd+bwd) per layer")
    parser.add_argument("--step-only", action="store_true", help="only the training step (implies --step)")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="with --step, also each kernel's launch, start and end for the fused layer (both ranks)",
    )
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank0 = dist.get_rank() == 0
    op = load_op()
    for name, (hidden, ffn, experts, k, tokens) in selected_shapes(args.shape, args.custom).items():
        layers = build(hidden, ffn, experts, k, dist.get_world_size(), False, 1.0, {})
        x = torch.randn(1, tokens, hidden, device="cuda").to(torch.bfloat16)
        gate = layers["fused"].deepspeed_moe.gate
        if rank0:
            print(f"== {name}", flush=True)
        for mode in () if args.step_only else ("eval", "train"):
            for layer in layers.values():
                layer.train(mode == "train")
            indices = gate(x[0], None, True)[3]
            calls = {
                "stock gate": lambda: gate(x[0], None, True),
                "gate_routes (torch)": lambda: gate_routes(gate, x[0]),
                "gate_routes (kernels)": lambda: gate_routes(gate, x[0], op=op),
                "plan (torch)": lambda: plan_routes(indices, experts),
                "plan (kernel)": lambda: plan_routes_cuda(op, indices, experts, dist.get_world_size()),
                "stock layer": lambda: layers["stock"](x),
                "fused layer": lambda: layers["fused"](x),
            }
            with torch.no_grad():
                for what, fn in calls.items():
                    host, device = host_and_device_ms(fn)
                    count = syncs(fn)
                    table = kernels(fn)
                    if rank0:
                        print(
                            f"  [{mode}] {what}: host {host:.3f} ms, device {device:.3f} ms, host syncs {count}\n"
                            f"{table}",
                            flush=True,
                        )
        if args.step or args.step_only:
            leaf = x.detach().clone().requires_grad_()
            dy = torch.randn_like(leaf)
            for what in ("stock", "fused"):
                layer = layers[what].train()
                step = lambda: train_step(layer, leaf, dy)  # noqa: E731
                host, device = host_and_device_ms(step)
                table = kernels(step, top=24)
                if rank0:
                    print(
                        f"  [step] {what} layer fwd+bwd: host {host:.3f} ms, device {device:.3f} ms\n{table}",
                        flush=True,
                    )
                if args.timeline and what == "fused":
                    for forward_only in (True, False):
                        fn = (lambda: layer(leaf)) if forward_only else step
                        dist.barrier()
                        text = timeline(fn)
                        for rank in range(dist.get_world_size()):
                            if dist.get_rank() == rank:
                                label = "forward (train mode)" if forward_only else "fwd+bwd"
                                print(f"  [timeline] fused {label}, rank {rank}:\n{text}", flush=True)
                            dist.barrier()
        layers.clear()  # frees the shape's layers before the next shape is built
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
