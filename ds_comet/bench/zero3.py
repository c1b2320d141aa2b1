"""AutoEP's MoE block under ZeRO stage 3: AutoEP alone against AutoEP on ds_comet, time and peak memory.

    torchrun --nproc_per_node 1 -m ds_comet.bench.zero3 [--shapes NAME ...] [--iters 10]

For each SwiGLU shape (``shapes.SWIGLU``) a one-layer Hugging Face model of the block's family is
built twice from one seed and given to ``deepspeed.initialize`` with ZeRO-3, bf16 and AutoEP, once as
AutoEP alone and once with ``"moe": {"backend": "comet"}``; then the MoE block's training step
(forward and backward through the engine's ZeRO-3 hooks, which gather the expert weights for each
and release them after, and reduce the gradients as they come, then the reduction of what is left
in the bucket, as engine.backward ends) is timed and its peak memory above
what was allocated before it is read. Each line prints both, and comet's speed-up and memory ratio;
the JSON rows also give what one step asked of the caching allocator (``allocator_activity``).
"""

import argparse
import gc

import deepspeed
import torch
from deepspeed import comm as dist

from .autoep import model_for, run_blocks
from .common import autoep_step, peak_mib, timed


def engine_config(family: str, backend: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        # torch's AdamW: DeepSpeed's FusedAdam is JIT-built from TORCH_CUDA_ARCH_LIST, whose arch-specific
        # entries (9.0a) it cannot parse; the step it would run is not timed here.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": family, "use_grouped_mm": True},
        "moe": {"backend": backend, **({"overlap": "fused"} if backend == "comet" else {})},
    }


def block_step(family: str, hidden: int, ffn: int, experts: int, k: int, tokens: int, backend: str, args):
    """(ms, peak MiB) of one training step of the block under a ZeRO-3 engine built for ``backend``."""
    import ds_comet  # noqa: F401  (the engine hook converts the block for "comet")

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    with torch.device(device):  # random weights drawn on the GPU: a Mixtral-like block is 1.4 B of them
        model = model_for(family, hidden, ffn, experts, k).to(torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, config=engine_config(family, backend))
    block = engine.module.model.layers[0].mlp
    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    step = block_training_step(engine, block, x, torch.randn_like(x))
    return timed(step, args.iters, args.warmup), peak_mib(step), allocator_activity(step)


def allocator_activity(step) -> dict:
    """What one call of ``step`` asks of torch's CUDA caching allocator: its reserved memory's peak above
    what was reserved before (MiB), the segments it had to ask the driver for (``cudaMalloc``), and
    the times the driver refused one and it released its cache to retry (each synchronises the device).
    Keys a torch build does not count read 0."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return {
        "peak_reserved_mib": (after.get("reserved_bytes.all.peak", 0) - before.get("reserved_bytes.all.current", 0))
        / 2**20,
        "device_allocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
        "alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
    }


def block_training_step(engine, block, x, dy):
    """One training step of ``block`` (a module of ``engine``'s model under ZeRO-3) on ``x`` ([B, T, H])
    against the output gradient ``dy``, as a function of no arguments: its gradients set to None,
    forward, backward through the engine's hooks, then the reduction of the gradients left in
    ZeRO-3's bucket, as ``engine.backward`` ends with."""

    def step():
        autoep_step(block, x, dy)
        # The gradients left in ZeRO-3's reduction bucket reduced and partitioned: without it the next
        # step's zero_grad leaves the bucket holding parameters without gradients, and DeepSpeed's
        # hook fails on them.
        engine.optimizer.independent_gradient_partition_epilogue()

    return step


def bench_block(name, family, hidden, ffn, experts, k, tokens, device, args):
    results = {}
    for backend in ("deepspeed", "comet"):
        ms, mib, allocator = block_step(family, hidden, ffn, experts, k, tokens, backend, args)
        gc.collect()  # the engine of one backend is gone before the other's is built
        torch.cuda.empty_cache()
        label = "autoep" if backend == "deepspeed" else "comet"
        results[f"{label}_zero3_fwd_bwd"], results[f"{label}_zero3_peak_mib"] = ms, mib
        results.update({f"{label}_zero3_{key}": value for key, value in allocator.items()})
    results["speedup"] = results["autoep_zero3_fwd_bwd"] / results["comet_zero3_fwd_bwd"]
    results["memory_ratio"] = results["comet_zero3_peak_mib"] / results["autoep_zero3_peak_mib"]
    return results


def report(results, out_dir):
    if dist.get_rank() != 0:
        return
    for name, row in results.items():
        print(
            f"{name}: ZeRO-3 step AutoEP {row['autoep_zero3_fwd_bwd']:.2f} ms, comet {row['comet_zero3_fwd_bwd']:.2f} "
            f"ms ({row['speedup']:.2f}x); peak AutoEP {row['autoep_zero3_peak_mib']:.0f} MiB, comet "
            f"{row['comet_zero3_peak_mib']:.0f} MiB ({row['memory_ratio']:.2f}x)",
            flush=True,
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=[], help="names from ds_comet.bench.shapes.SWIGLU")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    run_blocks(args.shapes, lambda *shape: bench_block(*shape, args), report)


if __name__ == "__main__":
    main()
