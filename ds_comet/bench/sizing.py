"""What sizing activations by the received rows costs: one AutoEP block on ds_comet, both ways.

    torchrun --nproc_per_node N -m ds_comet.bench.sizing [--shape NAME ...] [--steps 5] [--rounds 4]
                                                         [--iters 5] [--warmup 2]

With ``"activation_rows": "bound"`` (the default) a call sizes its activations, without a host
sync, by the most rows a rank can receive; with ``"received"`` by the rows it receives, read back
to the host once a call after the exchange. For each shape this builds DeepSpeed AutoEP's block of
the shape's family twice on ds_comet, the same weights, one block per sizing, and times each in
rounds, the order of the two sizings alternating from round to round (so that neither always runs
on a device the other has just warmed): ``--steps`` forwards, then as many training steps, back
to back in one timed call (a host sync costs most where the host would otherwise run ahead of the
device), and one training step's peak memory. Rank 0 prints the medians over rounds and the
received/bound ratios.
"""

import argparse
import statistics

import torch
from deepspeed import comm as dist

from ds_comet.bench import autoep
from ds_comet.bench.common import autoep_step, peak_mib, timed
from ds_comet.bench.shapes import SWIGLU

SIZINGS = ("bound", "received")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SWIGLU), help="an AutoEP shape (repeatable)")
    parser.add_argument("--steps", type=int, default=5, help="calls back to back in one timed call")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the two sizings, in alternating order")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


def bench_block(family, hidden, ffn, experts, k, tokens, device, args):
    ep_size = dist.get_world_size()
    layers = {
        sizing: autoep.autoep_layer(
            family,
            hidden,
            ffn,
            experts,
            k,
            ep_size,
            device,
            torch.bfloat16,
            0,
            {"backend": "comet", "overlap": "fused", "activation_rows": sizing},
        )
        for sizing in SIZINGS
    }
    x = torch.randn(1, tokens, hidden, device=device).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)

    def forwards(layer):
        with torch.no_grad():
            for _ in range(args.steps):
                layer(x)

    def steps(layer):
        for _ in range(args.steps):
            autoep_step(layer, x, dy)

    times = {f"{sizing}_{kind}": [] for sizing in SIZINGS for kind in ("fwd", "fwd_bwd")}
    for round_index in range(args.rounds):
        order = SIZINGS if round_index % 2 == 0 else SIZINGS[::-1]
        for sizing in order:
            layer = layers[sizing]
            layer.train()
            times[f"{sizing}_fwd"].append(timed(lambda: forwards(layer), args.iters, args.warmup) / args.steps)
            times[f"{sizing}_fwd_bwd"].append(timed(lambda: steps(layer), args.iters, args.warmup) / args.steps)
    results = {key: statistics.median(values) for key, values in times.items()}
    for sizing, layer in layers.items():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        results[f"{sizing}_peak_mib"] = peak_mib(lambda: autoep_step(layer, x, dy))
    values = torch.tensor([results[key] for key in sorted(results)], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # the slowest rank sets every step
    results = dict(zip(sorted(results), values.tolist()))
    for kind in ("fwd", "fwd_bwd"):
        results[f"received_over_bound_{kind}"] = results[f"received_{kind}"] / results[f"bound_{kind}"]
    return results


COLUMNS = (
    ("bound fwd", "bound_fwd"),
    ("received fwd", "received_fwd"),
    ("recv/bound", "received_over_bound_fwd"),
    ("bound fb", "bound_fwd_bwd"),
    ("received fb", "received_fwd_bwd"),
    ("recv/bound fb", "received_over_bound_fwd_bwd"),
    ("bound MiB", "bound_peak_mib"),
    ("received MiB", "received_peak_mib"),
)


def report(all_results, _out_dir):
    lines = ["shape".ljust(40) + "".join(h.rjust(15) for h, _ in COLUMNS)]
    for name, results in all_results.items():
        lines.append(name.ljust(40) + "".join(f"{results[key]:15.3f}" for _, key in COLUMNS))
    print(
        f"AutoEP blocks on ds_comet, EP={dist.get_world_size()}: ms a call (fb: a training step), peak MiB of a "
        "training step (max over ranks)\n" + "\n".join(lines),
        flush=True,
    )


def main():
    args = parse_args()
    autoep.run_blocks(args.shape, lambda name, *block: bench_block(*block, args), report)


if __name__ == "__main__":
    main()
