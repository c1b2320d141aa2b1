"""Time the FP8 recipes' library products alone, with and without fast accumulation, against bf16.

    python -m ds_comet.bench.library_fp8 [--shape NAME ...] [--custom H,F,E,K,T ...] [--warm-ms 200]
                                         [--time-ms 400] [--accumulation] [--deepgemm]

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

With ``--deepgemm`` (DeepGEMM importable as ``deep_gemm``: scripts/build_deepgemm.sh), the products
that group their rows (all but the weight gradients) are timed on DeepGEMM's m-grouped contiguous
GEMMs as well: ``deepgemm_fp8`` with the blockwise recipe's scaling (1x128 row tiles, 128x128 weight
blocks, its partial sums promoted into fp32 every 128 of K), its row scales given in the layout it
reads (as a quantiser would write them), and ``deepgemm_bf16``. Each group's rows start on a multiple
of ``get_mk_alignment_for_contiguous_layout()``, the padding rows (an index of -1) counted in its
time but not in its TFLOP/s. Its weights are ``[E, N, K]`` K-major, as Hopper's FP8 kernels take
them: the input gradients' products would read a transposed copy of each weight.

Prints ms and TFLOP/s for each and the ratios, and writes library_fp8.json under --out.

With ``--accumulation`` it measures the two settings' error instead: one ``[M, K] x [K, N]`` product
by K (``ACCUMULATION_K``), its operands quantised rowwise as the recipe's are, against float64 of the
same dequantised operands; once on signed normal values and once on their magnitudes (same-signed:
nothing cancels, the case an accumulator that drops low bits does worst on). Prints the largest
elementwise error relative to ``sum_k |a_k b_k|`` and the normwise error, beside bf16's own rounding
of the exact product, and writes accumulation.json under --out. With ``--deepgemm`` as well, the same
product on DeepGEMM's FP8 GEMM, its operands quantised blockwise (``fp8.quantise_tiles`` and
``fp8.quantise_blocks``), against float64 of those dequantised operands.
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


def calls(product: Product, experts: int, device: torch.device, deepgemm=None) -> dict[str, Callable[[], object]]:
    """``product``'s implementations on random operands of the right layouts (``bf16``, ``fp8``,
    ``fp8_fast``; with the ``deepgemm`` module, ``deepgemm_fp8`` and ``deepgemm_bf16`` too where the
    product groups its rows), each a call with no arguments."""
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

    found = {
        "bf16": lambda: torch._grouped_mm(a_bf16, b_bf16, offs=offsets),
        "fp8": scaled_call(USE_FAST_ACCUM),
        "fp8_fast": scaled_call(True),
    }
    if deepgemm is not None and not product.two_d:
        found.update(deepgemm_calls(deepgemm, a, b, group_ends(product.rows, experts, pad=False)))
    return found


def deepgemm_layout(ends: list[int], alignment: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous layout DeepGEMM's m-grouped GEMMs read for groups of rows ending at ``ends``,
    each group starting on a multiple of ``alignment``: ``(rows, groups)``, where ``rows`` ([R] int64)
    is the padded row each row moves to, and ``groups`` ([P] int32, P the padded rows) each padded
    row's group, -1 on padding."""
    counts = torch.diff(torch.tensor([0, *ends]))
    padded_counts = (counts + alignment - 1) // alignment * alignment
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    group = torch.repeat_interleave(torch.arange(len(ends)), counts)
    starts = torch.cumsum(counts, 0) - counts
    rows = padded_starts[group] + torch.arange(int(counts.sum())) - starts[group]
    groups = torch.full((int(padded_counts.sum()),), -1, dtype=torch.int32)
    groups[rows] = group.int()
    return rows.to(device), groups.to(device)


def deepgemm_calls(deepgemm, a: torch.Tensor, b: torch.Tensor, ends: list[int]) -> dict[str, Callable[[], object]]:
    """DeepGEMM's m-grouped products of rows ``a`` ([R, K] float, grouped by ``ends``) by each group's
    ``b`` ([E, N, K] float): ``deepgemm_fp8`` (blockwise e4m3, its row scales transformed beforehand
    into the layout the kernel reads) and ``deepgemm_bf16``, each writing a [P, N] bf16 output."""
    rows, groups = deepgemm_layout(ends, deepgemm.get_mk_alignment_for_contiguous_layout(), a.device)
    padded = a.new_zeros(groups.numel(), a.shape[1])
    padded[rows] = a
    tiles, blocks = fp8.quantise_tiles(padded), [fp8.quantise_blocks(weight) for weight in b]
    tile_scales = deepgemm.get_mn_major_tma_aligned_tensor(tiles.scales)
    block_values, block_scales = torch.stack([q.values for q in blocks]), torch.stack([q.scales for q in blocks])
    out = torch.empty(groups.numel(), b.shape[1], dtype=torch.bfloat16, device=a.device)
    padded_bf16, b_bf16 = padded.bfloat16(), b.bfloat16()

    def fp8_call():
        deepgemm.m_grouped_fp8_gemm_nt_contiguous(
            (tiles.values, tile_scales), (block_values, block_scales), out, groups, disable_ue8m0_cast=True
        )
        return out

    def bf16_call():
        deepgemm.m_grouped_bf16_gemm_nt_contiguous(padded_bf16, b_bf16, out, groups)
        return out

    return {"deepgemm_fp8": fp8_call, "deepgemm_bf16": bf16_call}


def accumulation_errors(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """How far ``out`` ([M, N], any float dtype) is from ``a @ b^T`` (``a`` [M, K], ``b`` [N, K], float64):
    the largest elementwise error relative to ``sum_k |a_mk b_nk|`` (what an accumulation bound scales
    with; an element whose sum is 0 counts as infinite if it has any error) and the normwise error
    ``||out - a b^T|| / ||a b^T||``."""
    exact, magnitude = a @ b.t(), a.abs() @ b.abs().t()
    error = (out.double() - exact).abs()
    relative = torch.where(magnitude > 0, error / magnitude, error * math.inf)
    return relative.nan_to_num(nan=0.0, posinf=math.inf).max().item(), (error.norm() / exact.norm()).item()


def accumulation_case(k: int, operands: str, device: torch.device, deepgemm=None) -> dict[str, tuple[float, float]]:
    """``accumulation_errors`` of one rowwise FP8 product of reduction length ``k`` on ``operands``
    ("signed" normal values or their magnitudes, "same-signed"): {"bf16 rounding": the exact product
    rounded to bf16, "fp8": as the recipe runs it, "fp8_fast": with ``use_fast_accum=True``}; with the
    ``deepgemm`` module, "deepgemm_fp8": DeepGEMM's product of the blockwise quantised operands."""
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
    if deepgemm is not None:
        out = deepgemm_calls(deepgemm, a, b[None], [rows])["deepgemm_fp8"]()[:rows]  # one group: its padding last
        tiles, blocks = fp8.quantise_tiles(a).dequantise().double(), fp8.quantise_blocks(b).dequantise().double()
        errors["deepgemm_fp8"] = accumulation_errors(out, tiles, blocks)
    return errors


def report_accumulation(device: torch.device, out_dir: str, deepgemm=None):
    """Every ``accumulation_case``, printed by operands and K and written to accumulation.json."""
    report = {}
    for operands in ACCUMULATION_OPERANDS:
        for k in ACCUMULATION_K:
            errors = report.setdefault(operands, {})[k] = accumulation_case(k, operands, device, deepgemm)
            print(
                f"  {operands:11s} K {k:6d}  "
                + "  ".join(f"{name}: max {e[0]:.1e} norm {e[1]:.1e}" for name, e in errors.items()),
                flush=True,
            )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "accumulation.json"), "w") as f:
        json.dump(report, f, indent=1)


def bench_shape(shape: tuple, args, device: torch.device, deepgemm=None) -> dict:
    """Every product of ``shape`` (H, F, E, k, T) timed each way ``calls`` gives: {product:
    {implementation: ms}}."""
    hidden, ffn, experts, k, tokens = shape
    results = {}
    for product in products(hidden, ffn, experts, k, tokens):
        found = calls(product, experts, device, deepgemm)
        for call in found.values():  # DeepGEMM compiles a kernel at its first call: not a warm-up's to time
            call()
        timings = {name: per_call_ms(call, args.warm_ms, args.time_ms) for name, call in found.items()}
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
        + (
            f"  DeepGEMM FP8 {r['deepgemm_fp8']:7.3f} ms ({rate['deepgemm_fp8']:5.0f})  DeepGEMM bf16 "
            f"{r['deepgemm_bf16']:7.3f} ms ({rate['deepgemm_bf16']:5.0f})  FP8/DeepGEMM FP8 "
            f"{r['fp8'] / r['deepgemm_fp8']:.2f}x"
            if "deepgemm_fp8" in r
            else ""
        )
    )


def import_deepgemm():
    """The ``deep_gemm`` module, or SystemExit saying how to get it."""
    try:
        import deep_gemm
    except ImportError as error:
        raise SystemExit(
            f"--deepgemm needs DeepGEMM importable as deep_gemm ({error}): build it from its source with "
            "`bash scripts/build_deepgemm.sh SRC PREFIX` and put PREFIX on PYTHONPATH"
        ) from error
    return deep_gemm


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens)")
    parser.add_argument("--warm-ms", type=float, default=200.0)
    parser.add_argument("--time-ms", type=float, default=400.0, help="timed window of each implementation")
    parser.add_argument("--accumulation", action="store_true", help="measure the error by K instead of timing")
    parser.add_argument("--deepgemm", action="store_true", help="DeepGEMM's FP8 and bf16 grouped GEMMs as well")
    parser.add_argument("--out", default="library_fp8_out")
    return parser.parse_args()


def main():
    args = parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(
            "ds_comet.bench.library_fp8 needs an sm_90 GPU: torch._scaled_grouped_mm's rowwise FP8 runs on Hopper"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    deepgemm = import_deepgemm() if args.deepgemm else None
    if args.accumulation:
        rows, columns = ACCUMULATION_MN
        print(f"error against float64, M {rows}, N {columns} ({torch.cuda.get_device_name(device)})")
        report_accumulation(device, args.out, deepgemm)
        return
    shapes = selected_shapes(args.shape or ([] if args.custom else [DEFAULT_SHAPE]), args.custom)
    report = {}
    for name, shape in shapes.items():
        hidden, ffn = shape[:2]
        if hidden % ALIGNMENT or ffn % ALIGNMENT:
            print(f"{name}: skipped, hidden and FFN sizes must be multiples of {ALIGNMENT} (torch._scaled_grouped_mm)")
            continue
        blockwise = deepgemm is not None and not (hidden % fp8.BLOCK or ffn % fp8.BLOCK)
        if deepgemm is not None and not blockwise:
            print(f"{name}: DeepGEMM skipped, blockwise scaling needs hidden and FFN sizes in multiples of {fp8.BLOCK}")
        report[name] = bench_shape(shape, args, device, deepgemm if blockwise else None)
        print(f"{name} ({torch.cuda.get_device_name(device)})")
        for product, r in report[name].items():
            print(product_line(product, r))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "library_fp8.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
