"""Time each GEMM phase of the fused pipeline alone against ``torch._grouped_mm`` on the same problem.

    torchrun --nproc_per_node 1 -m ds_comet.bench.gemm [--shape NAME ...] [--custom H,F,E,K,T ...] [--gated]
                                                       [--skew 0.7] [--warm-ms 200] [--time-ms MS] [--power]
                                                       [--fp8] [--out DIR]

One rank (EP=1), so that every route's row lands on this GPU: R = k x T rows over E experts. Each
shape runs twice, with routes drawn uniformly over the experts ("balanced") and from expert
probabilities drawn from a Dirichlet(--skew) ("skewed": some experts get several times the mean,
some none). The fused pipeline runs one forward on those routes, so that its layout and arrival
counters hold; then each GEMM phase is relaunched alone:

    gemm1_fwd  rows [R, H] x W1^T (and W3^T) -> the products before the activation, and h  (2 R H F')
    gemm2_fwd  h [R, F] x W2^T -> expert outputs [R, H]                                     (2 R F H)
    gemm1_bwd  dY [R, H] x W2 -> dh, times the activation's gradient -> dA [R, F']          (2 R H F)
    gemm2_bwd  dA [R, F'] x W1 (and W3) -> dX [R, H]                                        (2 R F' H)
    wgrad_w2   per expert dY_e^T h_e -> [E, H, F]                                           (2 R H F)
    wgrad_w1   per expert dA_e^T x_e -> [E, F', H]                                          (2 R F' H)

(F' = 2F for gated experts.) "ours" is what the fused pipeline launches for the phase: the
implementation the GEMM table (``ds_comet/kernels/gemm_table.py``) gives it, which each line names.
That is the Triton GEMMs (a GELU expert's forward GEMM1 and every backward GEMM1 store plain
products and an elementwise kernel computes the rest from them, both timed), and the weight
gradients as ``torch._grouped_mm`` for bf16 on sm_90 (a gated dW1 as two calls; biases' column
sums by ``expert_column_sums_kernel``, timed with them). The experts are one module each, so
GEMM1 stays on Triton even here alone in the group, where stacked experts would take the library's.
``torch._grouped_mm`` computes the same product on the same rows, grouped by the same offsets,
without the epilogue's bias, activation or stored products, or a bias gradient: its rate is the
library's rate for the GEMM alone. For the two GEMM1 phases a third implementation, "composed",
is that library product followed by the pipeline's own elementwise kernel for the phase (the
forward's activations, the backward's activation gradients): ours against it separates what our
GEMM loses to the library's from what the phase's extra memory traffic costs. Each phase is timed
on a warm device (the chip is power bound and its clock settles within about 200 ms): back-to-back
calls for ``--time-ms``, the implementations of one phase in turn. With ``--power``, ``nvidia-smi``
samples the GPU's SM clock and power through each timed window (``ds_comet.bench.power``), and the
energy of a call is its time by the mean power: at the power cap, time follows energy. Rank 0
prints TFLOP/s and the ratios and writes gemm.json.

With ``--fp8`` a second fused layer, with the same weights, runs the blockwise ``"fp8"`` recipe
(rows crossing in bf16, so that its four FP8 phases run on the GEMM table's "triton_fp8"), and
its phases are timed on the same routes as ``gemm1_fwd_fp8`` ... ``gemm2_bwd_fp8`` (the weight
gradients stay bf16): "ours" is the FP8 phase, rows quantised inside the GEMM as the pipeline runs
it; "scaled_grouped_mm" is ``torch._scaled_grouped_mm`` on the same rows and groups with rowwise
e4m3 scales (fp8.py's rowwise quantisation: one scale per row and per output channel, the
library's scaling, not the recipe's blocks; its operands quantised beforehand, outside the timing;
``use_fast_accum``); "bf16" is the bf16 layer's phase, the same product in bf16. The FLOPs of a
phase are the same in every implementation. A shape the recipe cannot scale (hidden and FFN sizes
must be multiples of 128) gets no FP8 phases: the recipe's refusal is printed in their place.
"""

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import deepspeed
import torch

import ds_comet
from ds_comet import fp8
from ds_comet.bench.power import Sampler
from ds_comet.bench.shapes import SHAPES, SWIGLU, selected_shapes
from ds_comet.experts import FeedForward, GatedFeedForward
from ds_comet.kernels.gemm_phases import Phase
from ds_comet.kernels.library_fp8_phases import rowwise_grouped_mm

PHASES = ("gemm1_fwd", "gemm2_fwd", "gemm1_bwd", "gemm2_bwd", "wgrad_w2", "wgrad_w1")
FP8_PHASES = ("gemm1_fwd", "gemm2_fwd", "gemm1_bwd", "gemm2_bwd")  # the blockwise recipe's (its weight gradients: bf16)
IMPLEMENTATIONS = ("ours", "grouped_mm", "composed", "scaled_grouped_mm", "bf16")
# The blockwise recipe as the fused pipeline runs it: rows cross the exchange in bf16.
FP8_RECIPE = {"enabled": True, "dispatch": "bf16"}
FP8_HEADER = (
    "  FP8, blockwise (1x128 row tiles, 128x128 weight blocks; rows quantised inside ours, timed); "
    "scaled_grouped_mm runs rowwise scaling (a scale per row and per output channel), its operands "
    "quantised beforehand, untimed:"
)


# The pipeline's GEMM phase that each benchmarked phase relaunches.
PIPELINE_PHASES = {
    "gemm1_fwd": Phase.FIRST_LAYER,
    "gemm2_fwd": Phase.GEMM2,
    "gemm1_bwd": Phase.FIRST_LAYER_BACKWARD,
    "gemm2_bwd": Phase.GEMM2_BACKWARD,
    "wgrad_w2": Phase.WEIGHT_GRADIENTS,
    "wgrad_w1": Phase.WEIGHT_GRADIENTS,
}


@dataclass
class TimedPhase:
    """One GEMM phase's implementations on the same rows, and the product's FLOPs."""

    ours: Callable[[], object]
    grouped_mm: Callable[[], object]
    flops: int
    composed: Callable[[], object] | None = None  # the library's product, then our elementwise kernel
    implementation: str = ""  # the name of the implementation "ours" runs (the GEMM table's)
    scaled_grouped_mm: Callable[[], object] | None = None  # FP8 phases: the library's rowwise FP8 product
    bf16: Callable[[], object] | None = None  # FP8 phases: the bf16 layer's phase
    bf16_implementation: str = ""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens)")
    parser.add_argument("--gated", action="store_true", help="SwiGLU experts on every shape (else only on SWIGLU's)")
    parser.add_argument("--skew", type=float, default=0.7, help="Dirichlet concentration of the skewed routing")
    parser.add_argument("--warm-ms", type=float, default=200.0)
    parser.add_argument(
        "--time-ms",
        type=float,
        default=None,
        help="timed window of each implementation (default 400 ms; 1500 with --power, so "
        "that nvidia-smi, which takes a moment to start, samples most of it)",
    )
    parser.add_argument(
        "--power",
        action="store_true",
        help="sample the SM clock and power through each timed window (needs nvidia-smi)",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="also the FP8 phases of the blockwise recipe, against torch._scaled_grouped_mm (rowwise) and bf16",
    )
    parser.add_argument("--out", default="gemm_out")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


def per_call_ms(fn, warm_ms: float, time_ms: float, sampler: Sampler | None = None) -> float:
    """Milliseconds per call of fn() queued back to back, after warm_ms of warm-up calls; with a
    ``sampler``, its samples cover the timed calls (its ``result`` holds them afterwards)."""
    torch.cuda.synchronize()
    calls, start = 0, time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warm_ms:
        fn()
        calls += 1
        torch.cuda.synchronize()
    one = (time.perf_counter() - start) * 1e3 / calls
    n = max(3, int(time_ms / max(one, 1e-3)))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with sampler if sampler is not None else contextlib.nullcontext():
        begin.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
    return begin.elapsed_time(end) / n


def routes(tokens: int, experts: int, k: int, skew: float, device) -> torch.Tensor:
    """[k, tokens] distinct experts per token: uniform, or from Dirichlet(skew) expert probabilities."""
    generator = torch.Generator().manual_seed(1)
    if skew > 0:
        probs = torch.distributions.Dirichlet(torch.full((experts,), skew)).sample()
    else:
        probs = torch.full((experts,), 1.0 / experts)
    probs = probs.clamp_min(1e-9).expand(tokens, experts).contiguous()
    return torch.multinomial(probs, k, replacement=False, generator=generator).t().contiguous().to(device)


def fused_layer(hidden, ffn, experts, k, tokens, gated, device, fp8_recipe: dict | None = None):
    """The bf16 comet layer of one shape on the fused pipeline, alone in its group; with ``fp8_recipe``
    under that recipe. The same weights every time (seeded)."""
    torch.manual_seed(0)
    template = GatedFeedForward(hidden, ffn) if gated else FeedForward(hidden, ffn)
    layer = ds_comet.MoE(
        hidden,
        template,
        num_experts=experts,
        ep_size=1,
        k=k,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        drop_tokens=False,
        config={"moe": {"backend": "comet", "overlap": "fused", **({"fp8": fp8_recipe} if fp8_recipe else {})}},
    )
    layer.set_deepspeed_parallelism()
    return layer.to(device=device, dtype=torch.bfloat16)


def phase_calls(pipeline, tokens, indices, experts):
    """A ``TimedPhase`` per phase name, on the rows one forward of ``indices`` lays out."""
    gates = torch.full(indices.shape, 1.0 / indices.shape[0], device=tokens.device)
    with torch.no_grad():
        pipeline.forward(tokens, indices, gates, train=False)
    kernels = pipeline.kernels(tokens)
    hidden, ffn, num_local = tokens.shape[1], kernels.ffn, kernels.num_local
    width = ffn * (2 if kernels.gated else 1)
    counts = torch.bincount(indices.reshape(-1).long(), minlength=experts)
    rows = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    dtype, device = tokens.dtype, tokens.device
    x = pipeline.workspace.recv[:rows]  # where that (eval) forward's dispatch put the rows
    h = torch.empty((rows, ffn), device=device, dtype=kernels.stored_dtype(Phase.FIRST_LAYER))
    pre = kernels.first_layer(x, h, keep_pre=True)  # fills h
    grad_pre = torch.empty((rows, width), device=device, dtype=kernels.stored_dtype(Phase.FIRST_LAYER_BACKWARD))
    out = torch.empty(rows, hidden, device=device, dtype=kernels.stored_dtype(Phase.GEMM2))  # both ways
    w1 = torch.randn(num_local, width, hidden, device=device).to(dtype) / hidden**0.5
    w2 = torch.randn(num_local, hidden, ffn, device=device).to(dtype) / ffn**0.5
    mm = torch._grouped_mm
    phases = {
        "gemm1_fwd": TimedPhase(
            lambda: kernels.first_layer(x, h, keep_pre=True),
            lambda: mm(x, w1.transpose(1, 2), offs=offsets),
            2 * rows * hidden * width,
            lambda: kernels.activations(mm(x, w1.transpose(1, 2), offs=offsets), h),
        ),
        "gemm2_fwd": TimedPhase(
            lambda: kernels.gemm2(h, out, backward=False),
            lambda: mm(h, w2.transpose(1, 2), offs=offsets),
            2 * rows * ffn * hidden,
        ),
        "gemm1_bwd": TimedPhase(
            lambda: kernels.first_layer_backward(x, grad_pre, pre, want_act=True),
            lambda: mm(x, w2, offs=offsets),
            2 * rows * hidden * ffn,
            lambda: kernels.activations_backward(mm(x, w2, offs=offsets), pre, grad_pre, want_act=True),
        ),
        "gemm2_bwd": TimedPhase(
            lambda: kernels.gemm2(grad_pre, out, backward=True),
            lambda: mm(grad_pre, w1, offs=offsets),
            2 * rows * width * hidden,
        ),
        "wgrad_w2": TimedPhase(
            lambda: kernels.wgrad(x, h), lambda: mm(x.t(), h, offs=offsets), 2 * rows * hidden * ffn
        ),
        "wgrad_w1": TimedPhase(
            lambda: [kernels.wgrad(grad_pre[:, part : part + ffn], x) for part in range(0, width, ffn)],
            lambda: mm(grad_pre.t(), x, offs=offsets),
            2 * rows * width * hidden,
        ),
    }
    for name, phase in phases.items():
        phase.implementation = kernels.implementation(PIPELINE_PHASES[name]).name
    if pipeline.fp8 is not None:
        w2_t, w1_t = w2.transpose(1, 2).contiguous(), w1.transpose(1, 2).contiguous()
        for name, a, weight in (
            ("gemm1_fwd", x, w1),
            ("gemm2_fwd", h, w2),
            ("gemm1_bwd", x, w2_t),
            ("gemm2_bwd", grad_pre, w1_t),
        ):
            phases[name].scaled_grouped_mm = rowwise_scaled_grouped_mm(a, weight, offsets)
    return phases, counts


def rowwise_scaled_grouped_mm(a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
    """A call of ``torch._scaled_grouped_mm`` for ``a @ weight[g]^T`` over groups of rows (``a`` [M, K],
    ``weight`` [G, N, K], ``offsets`` the groups' row ends, int32), bf16 out, with the "library_fp8"
    implementation's rowwise operands (``kernels.library_fp8_phases``), quantised once, here, and
    ``use_fast_accum`` (the library's fastest setting, not the implementation's)."""
    rows = fp8.quantise_rows(a)
    groups, n, k = weight.shape
    quantised = fp8.quantise_rows(weight.reshape(groups * n, k))
    weights = fp8.Quantised(quantised.values.view(groups, n, k), quantised.scales.view(groups, n, 1), (1, k))
    return lambda: rowwise_grouped_mm(rows, weights, offsets, use_fast_accum=True)


def fused_pipeline(hidden, ffn, experts, k, tokens, gated, x, fp8_recipe: dict | None = None):
    """The fused pipeline of ``fused_layer``'s layer, built by one eval call on ``x`` ([T, H]); with
    ``fp8_recipe``, one whose GEMMs run it (ValueError where the recipe cannot scale the shape,
    SystemExit where the fused pipeline does not run it, each with the layer's reason)."""
    layer = fused_layer(hidden, ffn, experts, k, tokens, gated, x.device, fp8_recipe)
    with torch.no_grad():
        layer.eval()(x[None])  # builds the pipeline and its workspace
    pipelines = layer.deepspeed_moe.pipelines
    if fp8_recipe is not None and (pipelines.fused is None or pipelines.fused.fp8 is None):
        raise SystemExit(f"the fused pipeline does not run the FP8 recipe on this shape: {pipelines.reason}")
    return pipelines.fused


def bench_shape(name, hidden, ffn, experts, k, tokens, args, sampler):
    device = torch.device("cuda", torch.cuda.current_device())
    gated = args.gated or name in SWIGLU
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    pipeline = fused_pipeline(hidden, ffn, experts, k, tokens, gated, x)
    fp8_pipeline = None
    if args.fp8:
        try:
            fp8_pipeline = fused_pipeline(hidden, ffn, experts, k, tokens, gated, x, FP8_RECIPE)
        except ValueError as refusal:  # "fallback": "error": the recipe names why it cannot scale the shape
            print(f"{name}: no FP8 phases: {refusal}", flush=True)
    results = {}
    for routing, skew in (("balanced", 0.0), ("skewed", args.skew)):
        indices = routes(tokens, experts, k, skew, device)
        calls, counts = phase_calls(pipeline, x, indices, experts)
        mean = counts.float().mean().item()
        results[routing] = {"largest_over_mean": counts.max().item() / mean, "empty_experts": int((counts == 0).sum())}
        for phase in PHASES:
            results[routing][phase] = time_phase(calls[phase], args, sampler)
        if fp8_pipeline is None:
            continue
        # The same routes, rows and weights (seeded): the bf16 phases' rows are the FP8 forward's too.
        fp8_calls, _ = phase_calls(fp8_pipeline, x, indices, experts)
        for phase in FP8_PHASES:
            fp8_calls[phase].bf16, fp8_calls[phase].bf16_implementation = calls[phase].ours, calls[phase].implementation
            results[routing][f"{phase}_fp8"] = time_phase(fp8_calls[phase], args, sampler)
    return results


def time_phase(phase: TimedPhase, args, sampler: Sampler | None) -> dict:
    """Each implementation's TFLOP/s (and, with a ``sampler``, SM clock, watts and mJ a call) and
    ours over the others' rates; ``ours_implementation`` names the GEMM table's implementation."""
    result, ms = {"ours_implementation": phase.implementation}, {}
    if phase.bf16 is not None:
        result["bf16_implementation"] = phase.bf16_implementation
    for name in IMPLEMENTATIONS:
        fn = getattr(phase, name)
        if fn is None:
            continue
        ms[name] = per_call_ms(fn, args.warm_ms, args.time_ms, sampler)
        result[f"{name}_tflops"] = phase.flops / ms[name] / 1e9
        if sampler is not None:
            result[f"{name}_sm_mhz"] = sampler.result["sm_mhz"]
            result[f"{name}_watts"] = sampler.result["watts"]
            result[f"{name}_power_capped"] = sampler.result["power_capped"]
            result[f"{name}_mj"] = sampler.result["watts"] * ms[name]
    for name in ms.keys() - {"ours"}:
        result[f"ours_over_{name}"] = ms[name] / ms["ours"]
    return result


def phase_line(phase: str, r: dict) -> str:
    line = (
        f"  {phase:10s} ours ({r['ours_implementation']}) {r['ours_tflops']:6.1f}  "
        f"grouped_mm {r['grouped_mm_tflops']:6.1f} TFLOP/s  ratio {r['ours_over_grouped_mm']:.3f}"
    )
    if "composed_tflops" in r:
        line += f"  composed {r['composed_tflops']:6.1f} TFLOP/s  ours/composed {r['ours_over_composed']:.3f}"
    if "scaled_grouped_mm_tflops" in r:
        line += (
            f"\n    {'':10s} scaled_grouped_mm (rowwise e4m3) {r['scaled_grouped_mm_tflops']:6.1f} TFLOP/s  "
            f"ours/scaled {r['ours_over_scaled_grouped_mm']:.3f}  bf16 ({r['bf16_implementation']}) "
            f"{r['bf16_tflops']:6.1f} TFLOP/s  ours/bf16 {r['ours_over_bf16']:.3f}"
        )
    for name in IMPLEMENTATIONS:
        if f"{name}_mj" in r:
            line += (
                f"\n    {name:10s} {r[f'{name}_sm_mhz']:5.0f} MHz {r[f'{name}_watts']:4.0f} W "
                f"(capped {r[f'{name}_power_capped']:4.0%}) {r[f'{name}_mj']:7.2f} mJ a call"
            )
    return line


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if deepspeed.comm.get_world_size() != 1:
        raise SystemExit("ds_comet.bench.gemm times one rank's GEMMs at EP=1: run it with --nproc_per_node 1")
    if not hasattr(torch, "_grouped_mm"):
        raise SystemExit("this torch has no torch._grouped_mm to compare with")
    if args.fp8 and not hasattr(torch, "_scaled_grouped_mm"):
        raise SystemExit("--fp8: this torch has no torch._scaled_grouped_mm to compare with")
    sampler = Sampler(torch.device("cuda", torch.cuda.current_device())) if args.power else None
    if args.time_ms is None:
        args.time_ms = 1500.0 if args.power else 400.0
    if args.power and args.time_ms < 1000:  # nvidia-smi may give no sample in a shorter window
        raise SystemExit(f"--power needs --time-ms of at least 1000, got {args.time_ms:g}")
    all_results = {}
    for name, shape in selected_shapes(args.shape, args.custom).items():
        all_results[name] = bench_shape(name, *shape, args, sampler)
        torch.cuda.empty_cache()
        for routing, phases in all_results[name].items():
            print(
                f"{name} {routing}: largest expert {phases['largest_over_mean']:.2f}x the mean, "
                f"{phases['empty_experts']} empty",
                flush=True,
            )
            for phase in PHASES:
                print(phase_line(phase, phases[phase]), flush=True)
            if f"{FP8_PHASES[0]}_fp8" in phases:
                print(FP8_HEADER, flush=True)
                for phase in FP8_PHASES:
                    print(phase_line(phase, phases[f"{phase}_fp8"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm.json"), "w") as f:
        json.dump(all_results, f, indent=1)


if __name__ == "__main__":
    main()
