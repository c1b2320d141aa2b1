"""Count the torch ops one DeepSpeed optimizer step runs for the example model, on CPU.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 scripts/count_step_ops.py [--experts N] [--clip C]

Builds examples/train_moe.py's model (small sizes, 4 MoE blocks, top-4) with ZeRO-2 over gloo,
runs two training steps, then profiles the third ``engine.step()`` and prints, on rank 0, the
number of parameter tensors, the number of aten ops in the step and the most frequent ones. The
op count of ZeRO-2's step grows with the number of parameter tensors (a norm, copies and views
each), which on a GPU makes the step launch bound whatever the MoE backend.
"""

import argparse
import os
import sys

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
import train_moe  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--clip", type=float, default=1.0, help="the config's gradient_clipping")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    cli = parser.parse_args()
    args = train_moe.parse_args(["--deepspeed_config", os.path.join(REPO, "configs", "zero2_comet.json"), "--layers",
                                 "4", "--hidden", "64", "--ffn", "64", "--experts", str(cli.experts), "--k", "4",
                                 "--seq-len", "32"])
    ds_config = train_moe.load_ds_config(args.deepspeed_config)
    ds_config["gradient_clipping"] = cli.clip
    deepspeed.init_distributed()
    model = train_moe.ByteMoELM(args, ds_config, cli.experts, dist.get_world_size())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3), config=ds_config)
    batch = (engine.train_micro_batch_size_per_gpu(), args.seq_len)
    for step in range(3):
        ids = torch.randint(0, 256, batch)
        loss = engine(ids, ids)
        engine.backward(loss[0] if isinstance(loss, tuple) else loss)
        if step < 2:
            engine.step()
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step()
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    if dist.get_rank() == 0:
        tensors = sum(1 for _ in engine.module.parameters())
        print(f"{cli.experts} experts, gradient_clipping {cli.clip}: {tensors} parameter tensors per rank, "
              f"{sum(e.count for e in ops)} aten ops in one engine.step()")
        for event in sorted(ops, key=lambda e: -e.count)[:10]:
            print(f"  {event.count:6d} {event.key}")
    dist.barrier()


if __name__ == "__main__":
    main()
