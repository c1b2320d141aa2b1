"""Time the rowwise FP8 recipe's library products alone, with and without fast accumulation, against bf16.

    python -m ds_comet.bench.library_fp8 [--shape NAME ...] [--custom H,F,E,K,T ...] [--warm-ms 200]
                                         [--time-ms 400] [--accumulation]

One GPU (sm_90), EP=1, gated experts, balanced routing: R = k x T rows in E equal groups (each
padded to a whole 16 for the weight gradients, as ``library_fp8_phases.padded_expert_ends`` pads
them). Each product the "library_fp8" implementation runs is timed three ways on the same groups:
``torch._grouped_mm`` in bf16; ``torch._scaled_grouped_mm`` with rowwise e4m3 scales and
``use_fast_accum=False``, as the implementation runs it (``library_fp8_phases.USE_FAST_ACCUM``: the
tensor cores' partial sums promoted into fp32 along K); and the same with ``use_fast_accum=True``
(the tensor cores accumulate all of K in their own precision, which the recipe does not offer:
docs/decisions.md, "Fast accumulation"). The operands are random and quantised beforehand, outside
the timing, so these are the GEMMs' own times:

    gemm1_fwd   rows [R, H] x W1^T -> [R, F]  (one projection; a gated layer runs two)
    gemm2_fwd   h [R, F] x W2^T -> [R, H]
    gemm1_bwd   dY [R, H] x W2 -> [R, F]
    gemm2_bwd   [dA, dA_up] [R, 2F] x [W1; W3] -> [R, H]
    wgrad_w1    per expert dA_e^T x_e -> [E, F, H]  (2-D by 2-D, K = each expert's rows; W3's alike)
    wgrad_w2    per expert dY_e^T h_e -> [E, H, F]

Prints ms and TFLOP/s for each and the ratios, and writes library_fp8.json under --out.

With ``--accumulation`` it measures the two settings' error instead: one ``[M, K] x [K, N]`` product
by K (``ACCUMULATION_K``), its operands quantised rowwise as the recipe's are, against float64 of the
same dequantised operands; once on signed normal values and once on their magnitudes (same-signed:
nothing cancels, the case an accumulator that drops low bits does worst on). Prints the largest
elementwise error relative to ``sum_k |a_k b_k|`` and the normwise error, beside bf16's own rounding
of the exact product, and writes accumulation.json under --out.
"""

import argparse
import itertools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import fp8
from ..kernels.library_fp8_phases import ALIGNMENT, USE_FAST_ACCUM, padded_expert_ends, rowwise_grouped_mm
from .gemm import per_call_ms
from .shapes import SHAPES, selected_shapes

# The Mixtral-like shape: the one the FP8 targets are stated on.
DEFAULT_SHAPE = "mixtral-H4096-F14336-E8-k2-T8192"
# The reductions --accumulation measures: the Mixtral-like step's (H, F, 2F, an expert's 2,048 rows;
# a hot expert's more) and beyond.
ACCUMULATION_K = (1024, 2048, 4096, 8192, 14336, 28672, 65536)
ACCUMULATION_OPERANDS = ("signed", "same-signed")
# M and N of the measured product: some two million elementwise errors a case.
ACCUMULATION_MN = (1024, 2048)


@dataclass(frozen=True)
class Product:
    """One product of the rowwise recipe on ``rows`` routed rows: ``[M, K] x [K, N]`` per group (M the
    rows), or with ``two_d`` the weight gradient's ``[M, P] x [P, N]`` reduced over each group's rows
    (``M`` and ``N`` then the output's, ``K`` = P the rows padded as ``group_ends`` pads them)."""

    name: str
    rows: int
    m: int
    k: int
    n: int
    two_d: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def products(hidden: int, ffn: int, experts: int, k: int, tokens: int) -> list[Product]:
    """The library's products of a gated layer's training step on ``k x tokens`` rows (one of each; the
    forward's GEMM1 and the first layer's weight gradient run once a projection)."""
    rows = k * tokens
    padded = group_ends(rows, experts, pad=True)[-1]
    return [
        Product("gemm1_fwd", rows, rows, hidden, ffn),
        Product("gemm2_fwd", rows, rows, ffn, hidden),
        Product("gemm1_bwd", rows, rows, hidden, ffn),
        Product("gemm2_bwd", rows, rows, 2 * ffn, hidden),
        Product("wgrad_w1", rows, ffn, padded, hidden, two_d=True),
        Product("wgrad_w2", rows, hidden, padded, ffn, two_d=True),
    ]


def group_ends(rows: int, experts: int, pad: bool) -> list[int]:
    """Where each of ``experts`` balanced groups of ``rows`` ends; with ``pad``, each group padded as the
    weight gradients' operands are (``library_fp8_phases.padded_expert_ends``)."""
    counts = [rows // experts + (1 if e < rows % experts else 0) for e in range(experts)]
    ends = list(itertools.accumulate(counts))
    if not pad:
        return ends
    return padded_expert_ends(torch.tensor([0, *ends], dtype=torch.int32), 0, experts).tolist()


def calls(product: Product, experts: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """``product``'s three implementations on random operands of the right layouts (``bf16``, ``fp8``,
    ``fp8_fast``), each a call with no arguments."""
    e4m3 = torch.float8_e4m3fn

    def scales(count: int) -> torch.Tensor:  # power-of-two scales, as the recipe's are
        return torch.exp2(torch.randint(-4, 4, (count,), device=device).float())

    offsets = torch.tensor(group_ends(product.rows, experts, pad=product.two_d), dtype=torch.int32, device=device)
    if product.two_d:  # [M, P] row-major by [P, N] column-major, grouped along P
        m, p, n = product.m, product.k, product.n
        a, b = torch.randn(m, p, device=device), torch.randn(n, p, device=device)
        a_bf16, b_bf16 = a.bfloat16(), b.bfloat16().t()
        a_fp8, b_fp8 = a.to(e4m3), b.to(e4m3).t()
        a_scales, b_scales = scales(experts * m), scales(experts * n)
    else:  # [R, K] row-major by each group's [N, K] weight as stored, grouped along R
        rows, width, n = product.m, product.k, product.n
        a, b = torch.randn(rows, width, device=device), torch.randn(experts, n, width, device=device)
        a_bf16, b_bf16 = a.bfloat16(), b.bfloat16().transpose(-2, -1)
        a_fp8, b_fp8 = a.to(e4m3), b.to(e4m3).transpose(-2, -1)
        a_scales, b_scales = scales(rows), scales(experts * n).view(experts, n)

    def scaled_call(fast: bool) -> Callable[[], object]:
        return lambda: torch._scaled_grouped_mm(
            a_fp8, b_fp8, a_scales, b_scales, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return {
        "bf16": lambda: torch._grouped_mm(a_bf16, b_bf16, offs=offsets),
        "fp8": scaled_call(USE_FAST_ACCUM),
        "fp8_fast": scaled_call(True),
    }


def accumulation_errors(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """How far ``out`` ([M, N], any float dtype) is from ``a @ b^T`` (``a`` [M, K], ``b`` [N, K], float64):
    the largest elementwise error relative to ``sum_k |a_mk b_nk|`` (what an accumulation bound scales
    with; an element whose sum is 0 counts as infinite if it has any error) and the normwise error
    ``||out - a b^T|| / ||a b^T||``."""
    exact, magnitude = a @ b.t(), a.abs() @ b.abs().t()
    error = (out.double() - exact).abs()
    relative = torch.where(magnitude > 0, error / magnitude, error * math.inf)
    return relative.nan_to_num(nan=0.0, posinf=math.inf).max().item(), (error.norm() / exact.norm()).item()


def accumulation_case(k: int, operands: str, device: torch.device) -> dict[str, tuple[float, float]]:
    """``accumulation_errors`` of one rowwise FP8 product of reduction length ``k`` on ``operands``
    ("signed" normal values or their magnitudes, "same-signed"): {"bf16 rounding": the exact product
    rounded to bf16, "fp8": as the recipe runs it, "fp8_fast": with ``use_fast_accum=True``}."""
    rows, columns = ACCUMULATION_MN
    a, b = torch.randn(rows, k, device=device), torch.randn(columns, k, device=device)
    if operands == "same-signed":
        a, b = a.abs(), b.abs()
    qa, qb = fp8.quantise_rows(a), fp8.quantise_rows(b)  # b's rows: the output channels
    a64, b64 = qa.values.double() * qa.scales.double(), qb.values.double() * qb.scales.double()
    offsets = torch.tensor([rows], dtype=torch.int32, device=device)
    errors = {"bf16 rounding": accumulation_errors((a64 @ b64.t()).bfloat16(), a64, b64)}
    weights = fp8.Quantised(qb.values[None], qb.scales[None], qb.block)  # one group
    for name, fast in (("fp8", USE_FAST_ACCUM), ("fp8_fast", True)):
        out = rowwise_grouped_mm(qa, weights, offsets, use_fast_accum=fast)
        errors[name] = accumulation_errors(out, a64, b64)
    return errors


def report_accumulation(device: torch.device, out_dir: str):
    """Every ``accumulation_case``, printed by operands and K and written to accumulation.json."""
    report = {}
    for operands in ACCUMULATION_OPERANDS:
        for k in ACCUMULATION_K:
            errors = report.setdefault(operands, {})[k] = accumulation_case(k, operands, device)
            print(
                f"  {operands:11s} K {k:6d}  "
                + "  ".join(f"{name}: max {e[0]:.1e} norm {e[1]:.1e}" for name, e in errors.items()),
                flush=True,
            )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "accumulation.json"), "w") as f:
        json.dump(report, f, indent=1)


def bench_shape(shape: tuple, args, device: torch.device) -> dict:
    """Every product of ``shape`` (H, F, E, k, T) timed three ways: {product: {implementation: ms}}."""
    hidden, ffn, experts, k, tokens = shape
    results = {}
    for product in products(hidden, ffn, experts, k, tokens):
        timings = {
            name: per_call_ms(call, args.warm_ms, args.time_ms)
            for name, call in calls(product, experts, device).items()
        }
        timings["tflops"] = {name: product.flops / ms / 1e9 for name, ms in timings.items()}
        results[product.name] = timings
        torch.cuda.empty_cache()
    return results


def product_line(name: str, r: dict) -> str:
    rate = r["tflops"]
    return (
        f"  {name:10s} bf16 {r['bf16']:7.3f} ms ({rate['bf16']:5.0f} TFLOP/s)  FP8 {r['fp8']:7.3f} ms "
        f"({rate['fp8']:5.0f})  FP8 fast {r['fp8_fast']:7.3f} ms ({rate['fp8_fast']:5.0f})  "
        f"bf16/FP8 {r['bf16'] / r['fp8']:.2f}x  FP8/FP8 fast {r['fp8'] / r['fp8_fast']:.2f}x"
    )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens)")
    parser.add_argument("--warm-ms", type=float, default=200.0)
    parser.add_argument("--time-ms", type=float, default=400.0, help="timed window of each implementation")
    parser.add_argument("--accumulation", action="store_true", help="measure the error by K instead of timing")
    parser.add_argument("--out", default="library_fp8_out")
    return parser.parse_args()


def main():
    args = parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(
            "ds_comet.bench.library_fp8 needs an sm_90 GPU: torch._scaled_grouped_mm's rowwise FP8 runs on Hopper"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    if args.accumulation:
        rows, columns = ACCUMULATION_MN
        print(f"error against float64, M {rows}, N {columns} ({torch.cuda.get_device_name(device)})")
        report_accumulation(device, args.out)
        return
    shapes = selected_shapes(args.shape or ([] if args.custom else [DEFAULT_SHAPE]), args.custom)
    report = {}
    for name, shape in shapes.items():
        hidden, ffn = shape[:2]
        if hidden % ALIGNMENT or ffn % ALIGNMENT:
            print(f"{name}: skipped, hidden and FFN sizes must be multiples of {ALIGNMENT} (torch._scaled_grouped_mm)")
            continue
        report[name] = bench_shape(shape, args, device)
        print(f"{name} ({torch.cuda.get_device_name(device)})")
        for product, r in report[name].items():
            print(product_line(product, r))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "library_fp8.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
