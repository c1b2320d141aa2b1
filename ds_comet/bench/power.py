"""SM clock and power through back-to-back training steps: DeepSpeed AutoEP's block on AutoEP and on
ds_comet.

    torchrun --nproc_per_node 1 -m ds_comet.bench.power [--shape NAME ...] [--seconds 4] [--rounds 2]

Grouped GEMMs back to back hold an H200 at its power cap, where a GEMM's speed follows the clock the
power limiter allows, and that follows what ran just before (docs/decisions.md). For each shape this
builds AutoEP's block of the shape's family on AutoEP and on ds_comet (the same weights) and runs
each backend's training steps back to back for about ``--seconds`` (the same number of steps on
every rank), while ``nvidia-smi`` samples this GPU's SM clock, power draw and software power cap
every 20 ms; the backends' order alternates from round to round. Rank 0 prints, per backend and
round, the ms a step, the median SM clock, the mean power and the share of samples under the
power cap. Needs ``nvidia-smi`` on PATH.
"""

import argparse
import shutil
import statistics
import subprocess
import time

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from ds_comet.bench import autoep
from ds_comet.bench.common import autoep_step
from ds_comet.bench.shapes import SWIGLU

BACKENDS = ("autoep", "comet")
# Newer drivers name the instantaneous draw and the clock-event reasons; older ones the averaged draw
# and the throttle reasons.
FIELDS = (
    "clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap",
    "clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap",
)
SAMPLE_MS = 20


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SWIGLU), help="an AutoEP shape (repeatable)")
    parser.add_argument("--seconds", type=float, default=4.0, help="back-to-back steps sampled per backend and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two backends, in alternating order")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


def summarize(lines: list[str]) -> dict[str, float]:
    """``nvidia-smi --format=csv,noheader,nounits`` rows of (SM MHz, W, cap state): the median SM
    clock, the mean power and the share of samples under the software power cap."""
    rows = [[field.strip() for field in line.split(",")] for line in lines if line.count(",") == 2]
    clocks = [float(r[0]) for r in rows if r[0].replace(".", "", 1).isdigit()]
    power = [float(r[1]) for r in rows if r[1].replace(".", "", 1).isdigit()]
    if not clocks or not power:
        raise RuntimeError(f"nvidia-smi gave no clock and power samples: {lines[:3]}")
    return {
        "sm_mhz": statistics.median(clocks),
        "watts": statistics.mean(power),
        "power_capped": sum(r[2] == "Active" for r in rows) / len(rows),
        "samples": float(len(rows)),
    }


class Sampler:
    """``nvidia-smi`` sampling one GPU (by UUID) every SAMPLE_MS while the ``with`` block runs."""

    def __init__(self, device: torch.device):
        if shutil.which("nvidia-smi") is None:
            raise SystemExit(
                "the power samples (ds_comet.bench.power, ds_comet.bench.gemm --power) need nvidia-smi on PATH"
            )
        self.gpu = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        for fields in FIELDS:
            query = ["nvidia-smi", f"--id={self.gpu}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
            if subprocess.run(query, capture_output=True).returncode == 0:
                self.query = query + ["-lms", str(SAMPLE_MS)]
                return
        raise SystemExit(f"nvidia-smi answers none of the queries {FIELDS} for {self.gpu}")

    def __enter__(self):
        self.process = subprocess.Popen(self.query, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        out, _ = self.process.communicate()
        self.result = summarize(out.splitlines())
        return False


def agreed_steps(step, seconds: float, device: torch.device) -> int:
    """How many calls of ``step`` (a training step, collective on the group) fill about ``seconds``,
    timed after three warm-up calls over two more: the largest count any rank's timing gives, the
    same on every rank, so that none waits in a collective for a step its peers never run."""
    accelerator = get_accelerator()
    for _ in range(3):
        step()
    accelerator.synchronize()
    began = time.perf_counter()
    for _ in range(2):
        step()
    accelerator.synchronize()
    per_step = (time.perf_counter() - began) / 2
    count = torch.tensor([max(4, round(seconds / per_step))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def bench_block(family, hidden, ffn, experts, k, tokens, device, args):
    ep_size = dist.get_world_size()
    sections = {"autoep": None, "comet": {"backend": "comet", "overlap": "fused"}}
    layers = {
        backend: autoep.autoep_layer(
            family, hidden, ffn, experts, k, ep_size, device, torch.bfloat16, 0, section
        ).train()
        for backend, section in sections.items()
    }
    x = torch.randn(1, tokens, hidden, device=device).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    sampler = Sampler(device)
    results = {}
    for round_index in range(args.rounds):
        for backend in BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]:
            layer = layers[backend]
            steps = agreed_steps(lambda: autoep_step(layer, x, dy), args.seconds, device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # nvidia-smi's first sample comes once it has started, while the steps run: no sample of
            # an idle lead-in dilutes the statistics.
            with sampler:
                start.record()
                for step in range(steps):
                    autoep_step(layer, x, dy)
                    if step % 4 == 3:  # keep the host within a few steps of the device
                        torch.cuda.synchronize()
                stop.record()
                torch.cuda.synchronize()
            results[f"{backend}_{round_index}_ms"] = start.elapsed_time(stop) / steps
            for key, value in sampler.result.items():
                results[f"{backend}_{round_index}_{key}"] = value
    return results


def report(all_results, _out_dir):
    lines = []
    for name, results in all_results.items():
        rounds = sorted({int(key.split("_")[1]) for key in results})
        for round_index in rounds:
            for backend in BACKENDS:
                prefix = f"{backend}_{round_index}_"
                lines.append(
                    f"{name:44s} round {round_index} {backend:6s} {results[prefix + 'ms']:8.2f} ms a step  "
                    f"{results[prefix + 'sm_mhz']:6.0f} MHz  {results[prefix + 'watts']:5.0f} W  "
                    f"power-capped {results[prefix + 'power_capped']:4.0%} of "
                    f"{results[prefix + 'samples']:.0f} samples"
                )
    print(f"Back-to-back training steps, EP={dist.get_world_size()}, rank 0's GPU:\n" + "\n".join(lines), flush=True)


def main():
    args = parse_args()
    autoep.run_blocks(args.shape, lambda name, *block: bench_block(*block, args), report)


if __name__ == "__main__":
    main()
