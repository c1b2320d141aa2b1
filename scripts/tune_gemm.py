#!/usr/bin/env python3
"""Tune the fused pipeline's two Triton grouped GEMMs on one GPU, against cuBLAS, without communication.

    python3 scripts/tune_gemm.py --out DIR [--shape NAME ...] [--tma | --tma-only] [--gated] [--budget S]
        [--no-sweep] [--ctas-per-sm 1,2] [--gemm2-chunks 1,2,4,8 [--gemm2-stages 3,4]]
    TRITON_INTERPRET=1 python3 scripts/tune_gemm.py --smoke --out DIR    (CPU interpreter, a tiny shape)
    python3 scripts/tune_gemm.py --offline --out DIR [--ptxas-info]       (no GPU: compile the sweep for sm_90)

For each shape (H, F, E, k, T) with EP=2 the script builds what one rank's GEMMs see after the
exchange and the dispatch: the receive buffer (each local expert's rows, own rows first, then the
peer's), the per-expert weights in nn.Linear layout and their pointer tables, the layout array of
tests/layout_reference.py, the rows' origins ((source << 32) | position), GEMM2's local output
buffer and the sources' chunk counters, all local. It checks GEMM1 (WAIT=False) and GEMM2 against per-expert
F.linear in fp32, times cuBLAS (an F.linear loop and torch._grouped_mm) on the same GEMMs, and
sweeps tile configurations:

  A  every tile (BM, BN, BK, stages, warps) whose stages fit shared memory (227 KB) and whose fp32
     accumulator fits 128 registers a thread, GROUP_M 8, GEMM2 with the pipeline's default chunks;
  B  GROUP_M 4 and 16 on the three best tiles of each GEMM, and GEMM2's n_chunks 1, 2, 4, 8 on its best tiles;
  C  the other --comm-blocks values (a persistent grid of every SM) on the two best of each;
  N  (--gemm2-chunks) GEMM2's default tile at each chunk count (and --gemm2-stages);
  P  (--ctas-per-sm) small tiles with two or three programs a multiprocessor, the grid grown to match;
  T  (--tma) a stand-alone GEMM1 with weight tiles (and optionally row tiles) loaded through
     device-side TMA descriptors, and warp-specialised variants of it; the pipeline's own GEMMs load
     their weight tiles that way too (--tma-only: the defaults, then only these);
  then the defaults and the winners again on the exactly balanced split. --no-sweep skips A, B and C.

Compilation dominates, so worker processes compile every configuration into Triton's cache ahead
of the main process (highest priority first), and each shape stops sweeping when its share of
--budget is spent. Every configuration's output is checked before it is timed (rel. err < 1e-2).
stdout gets one summary per shape (--verbose: a line per configuration); DIR gets tune_gemm.json
(everything) and tune_gemm.log (every line).
"""

import argparse
import heapq
import importlib
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from layout_reference import layout_array, reference_layout  # noqa: E402  (tests/, put on the path above)


def _load(name):
    """ds_comet.<name> straight from its file: the package's __init__ imports DeepSpeed, which costs
    every compile worker seconds; the modules used here import nothing of the package."""
    path = os.path.join(ROOT, "ds_comet", name + ".py")
    spec = importlib.util.spec_from_file_location("_tune_ds_comet_" + name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # it grew a relative import: take the package after all
        module = importlib.import_module("ds_comet." + name)
    return module


TG = _load("triton_gemm")
LAYOUT = _load("layout")

SHAPES = _load("shapes").SHAPES
SMOKE_SHAPE = ("smoke-H64-F96-E4-k2-T40", (64, 96, 4, 2, 40))
EP = 2
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on H100/H200 (227 KB)
SMEM_PER_SM, SMEM_RESERVED = 233472, 1024  # a multiprocessor's shared memory; what each block costs besides
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread past which a tile spills
MAX_CHUNKS = 64  # chunk counters per source (the workspace's max_chunks)
REL_TOL = 1e-2
ROW_PAD = 128  # receive-buffer rows past the last received one (NaN: masked reads must not see them)

# The pipeline's configuration today (fused.py / selection.py): one for every shape.
DEFAULT_TILE = dict(bm=128, bn=256, bk=64, stages=3, warps=8, group_m=8)
SWEEP_BM, SWEEP_BN, SWEEP_BK = (64, 128), (128, 256), (64, 128)
SWEEP_STAGES, SWEEP_WARPS, SWEEP_GROUP_M = (3, 4, 5), (4, 8), (4, 8, 16)
SWEEP_N_CHUNKS = (1, 2, 4, 8)
# Tile families (BM, BN, BK, warps), most promising first on Hopper (bf16 wgmma, cp.async
# pipelines): the time box cuts from the end. Families not listed come last; stages 3, 4, 5 within
# a family. GEMM2's epilogue holds a 64-bit destination pointer per element: ptxas (sm_90) gives it
# 255 registers and spills at 128 rows or 4 warps, so its 8-warp 64-row tiles come early.
FAMILY_ORDER = {
    "gemm1": [(128, 256, 64, 8), (128, 128, 64, 8), (128, 128, 128, 8), (64, 256, 64, 4), (128, 128, 64, 4),
              (64, 256, 64, 8), (64, 128, 64, 4), (128, 128, 128, 4), (64, 128, 128, 4), (64, 128, 64, 8),
              (64, 128, 128, 8)],
    "gemm2": [(128, 256, 64, 8), (128, 128, 64, 8), (64, 256, 64, 8), (64, 128, 64, 8), (64, 128, 128, 8),
              (128, 128, 128, 8), (64, 256, 64, 4), (128, 128, 64, 4), (64, 128, 64, 4), (128, 128, 128, 4),
              (64, 128, 128, 4)],
}
TMA_TILES = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 8),
             (128, 128, 128, 3, 8), (64, 256, 64, 4, 4)]
# Warp-specialised TMA GEMM1 (num_warps per consumer group): all gave wrong results on H200 with
# Triton 3.6 (docs/performance.md), kept to retest on the next Triton.
WS_TILES = [(128, 256, 64, 3, 4), (128, 256, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 5, 4)]
# --ctas-per-sm: tiles whose pipelines fit two (some three) programs a multiprocessor.
CTAS_TILES = [(128, 128, 64, 3, 4), (128, 128, 64, 3, 8), (64, 128, 64, 3, 4), (64, 128, 64, 4, 4),
              (64, 256, 64, 2, 4), (128, 256, 64, 3, 8)]
# --smoke: interpreter-sized tiles (stages and warps mean nothing there).
SMOKE_DEFAULT = dict(bm=16, bn=32, bk=16, stages=3, warps=4, group_m=2)
SMOKE_TILES = [(16, 32, 16, 3, 4), (32, 16, 32, 3, 4), (16, 16, 32, 3, 4), (32, 32, 16, 3, 4)]
SMOKE_GROUP_M, SMOKE_N_CHUNKS = (1, 2, 4), (1, 2, 4)

# The kernels' argument names change as the kernels do: arguments are passed by name, from the
# dictionaries in kernel_values, which know every name any version used. Pipeline-only arguments
# (pre, BACKWARD, STORE_PRE, ...) are set to their forward, no-wait values.
PRE_ARG, STORE_PRE_ARG = "pre", "STORE_PRE"


# ----------------------------------------------------------------------------------------------
# GEMM1 with the weight tile (and optionally the row tile) loaded through device-side TMA
# descriptors (--tma). Same schedule as gemm1_kernel: own-row tiles of every expert, then the rest.


@triton.jit
def _tma_act(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 1:
        y = x * (1.0 - 1.0 / (1.0 + tl.exp(1.5957691216057308 * (x + 0.044715 * x * x * x))))
    elif ACTIVATION == 2:
        y = tl.maximum(x, 0.0)
    else:
        y = x / (1.0 + tl.exp(-x))
    return y


@triton.jit
def gemm1_tma_kernel(rows, out, w_table, w3_table, b1_table, b3_table, layout, num_rows, K, N, num_local,
                     off_expert_start, off_local_tiles, off_remote_tiles, off_total_tiles, L_POW2: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_PROGS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                     A_TMA: tl.constexpr, WS: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr):
    """out[rows of l] = act(rows @ W1_l^T + b1) [* (rows @ W3_l^T + b3)], W_l ([N, K]) read by TMA."""
    dtype = rows.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    in_table = lanes <= num_local
    own_prefix = tl.load(layout + off_local_tiles + lanes, mask=in_table, other=1 << 30)
    rest_prefix = tl.load(layout + off_remote_tiles + lanes, mask=in_table, other=1 << 30)
    own_total = tl.load(layout + off_local_tiles + num_local)
    offs_k = tl.arange(0, BK)
    if A_TMA:
        # Rows past an expert's end belong to the next one (or are zero-filled past num_rows):
        # their products land in rows the store masks off.
        a_desc = tl.make_tensor_descriptor(rows, shape=[num_rows, K], strides=[K, 1], block_shape=[BM, BK])

    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        slot, pid_n = TG._swizzle(tile, total_m, n_tiles, GROUP_M)
        # Branch-free (also what Triton's warp specialisation needs: it gives up on a loop body with an scf.if).
        expert, _, row0, row_end = TG._own_rows_first(slot, own_prefix, rest_prefix, own_total, layout,
                                                      off_expert_start, off_local_tiles, off_remote_tiles, BM)
        col0 = pid_n * BN
        offs_m = row0 + tl.arange(0, BM)
        offs_n = col0 + tl.arange(0, BN)
        m_mask = offs_m < row_end
        n_mask = offs_n < N

        w = tl.load(w_table + expert).to(tl.pointer_type(dtype))
        if SPLIT_EPILOGUE:  # two half-width accumulators
            w_desc = tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BN // 2, BK])
            acc = tl.zeros((BM, BN // 2), dtype=tl.float32)
            acc_right = tl.zeros((BM, BN // 2), dtype=tl.float32)
        else:
            w_desc = tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        if GATED:
            w3 = tl.load(w3_table + expert).to(tl.pointer_type(dtype))
            w3_desc = tl.make_tensor_descriptor(w3, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
            if A_TMA:
                a = a_desc.load([row0, k * BK])
            else:
                k_ok = offs_k < K - k * BK
                a = tl.load(rows + offs_m[:, None] * K + (k * BK + offs_k)[None, :],
                            mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            if SPLIT_EPILOGUE:
                acc = tl.dot(a, tl.trans(w_desc.load([col0, k * BK])), acc)
                acc_right = tl.dot(a, tl.trans(w_desc.load([col0 + BN // 2, k * BK])), acc_right)
            else:
                acc = tl.dot(a, tl.trans(w_desc.load([col0, k * BK])), acc)
            if GATED:
                acc3 = tl.dot(a, tl.trans(w3_desc.load([col0, k * BK])), acc3)

        if SPLIT_EPILOGUE:
            # The right half's activation and store after the left's: temporaries for half a tile.
            offs_h = col0 + tl.arange(0, BN // 2)
            for half in tl.static_range(2):
                part = acc if half == 0 else acc_right
                cols = offs_h + half * (BN // 2)
                if HAS_BIAS:
                    b1 = tl.load(b1_table + expert).to(tl.pointer_type(dtype))
                    part += tl.load(b1 + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
                tl.store(out + offs_m[:, None] * N + cols[None, :], _tma_act(part, ACTIVATION).to(dtype),
                         mask=m_mask[:, None] & (cols < N)[None, :])
        else:
            if HAS_BIAS:
                b1 = tl.load(b1_table + expert).to(tl.pointer_type(dtype))
                acc += tl.load(b1 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            result = _tma_act(acc, ACTIVATION)
            if GATED:
                if HAS_BIAS:
                    b3 = tl.load(b3_table + expert).to(tl.pointer_type(dtype))
                    acc3 += tl.load(b3 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                result = result * acc3
            tl.store(out + offs_m[:, None] * N + offs_n[None, :], result.to(dtype),
                     mask=m_mask[:, None] & n_mask[None, :])


def kernels():
    return {"gemm1": TG.gemm1_kernel, "gemm2": TG.gemm2_kernel, "gemm1_tma": gemm1_tma_kernel}


# ----------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class Config:
    kind: str  # gemm1, gemm2 or gemm1_tma
    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    group_m: int
    n_chunks: int = 0  # gemm2: column chunks asked for (the kernel gets CHUNK_TILES)
    comm_blocks: int = 16
    a_tma: bool = False  # gemm1_tma: the row tile through a descriptor too
    ws: bool = False  # gemm1_tma: Triton's warp specialisation of the K loop (loads and MMAs in separate warps)
    split_epilogue: bool = False  # gemm1_tma: the activation and store one column half at a time
    ctas: int = 1  # programs per multiprocessor: 2 lets one program's epilogue run beside another's K loop
    maxnreg: int = 0  # a register cap per thread (0: the compiler's choice), so that ctas programs fit

    def label(self, meta=None):
        text = f"{self.bm}x{self.bn}x{self.bk} s{self.stages} w{self.warps} g{self.group_m}"
        if self.kind == "gemm2":
            text += f" c{effective_chunks(meta, self) if meta else self.n_chunks}"
        if self.kind == "gemm1_tma":
            text += (" tmaA+W" if self.a_tma else " tmaW") + (" ws" if self.ws else "") + (
                " split" if self.split_epilogue else "")
        text += f" cb{self.comm_blocks}" + (f" x{self.ctas}" if self.ctas > 1 else "")
        return text + (f" r{self.maxnreg}" if self.maxnreg else "")

    def tile(self):
        return (self.bm, self.bn, self.bk, self.stages, self.warps)


def smem_bytes(cfg, gated):
    """Shared memory of the pipelined loop (Triton reuses it for the epilogue)."""
    b_tiles = 2 if gated and cfg.kind != "gemm2" else 1
    return cfg.stages * (cfg.bm + b_tiles * cfg.bn) * cfg.bk * 2


def acc_regs(cfg, gated):
    products = 2 if gated and cfg.kind != "gemm2" else 1
    # Warp specialised: two consumer warp groups of cfg.warps warps share the accumulator.
    consumers = 2 * cfg.warps if cfg.ws else cfg.warps
    return products * cfg.bm * cfg.bn // (32 * consumers)


def fits(cfg, gated):
    return smem_bytes(cfg, gated) <= SMEM_LIMIT and acc_regs(cfg, gated) <= MAX_ACC_REGS


def programs(cfg, num_sms):
    """The persistent grid: cfg.ctas programs on each multiprocessor left to the GEMM."""
    return cfg.ctas * max(1, num_sms - cfg.comm_blocks)


def column_tiles(meta, cfg):
    return -(-(meta.hidden if cfg.kind == "gemm2" else meta.ffn) // cfg.bn)


def chunk_tiles(meta, cfg):
    n_col = column_tiles(meta, cfg)
    return -(-n_col // max(1, min(cfg.n_chunks, n_col)))


def effective_chunks(meta, cfg):
    return -(-column_tiles(meta, cfg) // chunk_tiles(meta, cfg))


def default_n_chunks(meta, bn):
    """The library's own rule. Imported here, in the main process only: the package pulls in DeepSpeed."""
    from ds_comet.selection import rule_n_chunks
    return rule_n_chunks(meta.hidden, meta.ffn, bn)


def default_config(kind, meta, comm_blocks, smoke):
    base = SMOKE_DEFAULT if smoke else DEFAULT_TILE
    cfg = Config(kind, comm_blocks=comm_blocks, **base)
    if kind == "gemm2":
        cfg = canonical(meta, replace(cfg, n_chunks=default_n_chunks(meta, cfg.bn)))
    return cfg


def phase_a(kind, meta, comm_blocks, smoke):
    """Every sweep tile that fits, most promising first, GROUP_M 8 (GEMM2: default chunks)."""
    if smoke:
        tiles = SMOKE_TILES
        group_m = SMOKE_DEFAULT["group_m"]
    else:
        tiles = [t for t in itertools.product(SWEEP_BM, SWEEP_BN, SWEEP_BK, SWEEP_STAGES, SWEEP_WARPS)]
        family = {f: i for i, f in enumerate(FAMILY_ORDER[kind])}
        tiles.sort(key=lambda t: (family.get((t[0], t[1], t[2], t[4]), len(family)), t[3]))
        group_m = DEFAULT_TILE["group_m"]
    out = []
    for bm, bn, bk, stages, warps in tiles:
        cfg = Config(kind, bm, bn, bk, stages, warps, group_m, comm_blocks=comm_blocks)
        if kind == "gemm2":
            cfg = canonical(meta, replace(cfg, n_chunks=default_n_chunks(meta, bn)))
        if smoke or fits(cfg, meta.gated):
            out.append(cfg)
    return out


def canonical(meta, cfg):
    """GEMM2's n_chunks as the kernel sees it (requests that give the same CHUNK_TILES are one)."""
    return replace(cfg, n_chunks=effective_chunks(meta, cfg)) if cfg.kind == "gemm2" else cfg


def phase_b(kind, meta, ranked, smoke, done):
    """GROUP_M (and GEMM2's chunks) around the best tiles of phase A, leaving out what ran."""
    group_ms = SMOKE_GROUP_M if smoke else SWEEP_GROUP_M
    chunks = SMOKE_N_CHUNKS if smoke else SWEEP_N_CHUNKS
    out = []
    for cfg in ranked[:3]:
        variants = [replace(cfg, group_m=g) for g in group_ms]
        if kind == "gemm2":
            variants += [replace(cfg, n_chunks=c) for c in chunks]
        for v in map(lambda c: canonical(meta, c), variants):
            if v not in done and v not in out:
                out.append(v)
    return out


def ctas_configs(kind, meta, comm_blocks, values, smoke):
    """CTAS_TILES at each programs-per-multiprocessor value whose shared memory fits (8-warp tiles
    also with their registers capped, so that the programs fit the register file too)."""
    tiles = SMOKE_TILES[:2] if smoke else CTAS_TILES
    group_m = SMOKE_DEFAULT["group_m"] if smoke else DEFAULT_TILE["group_m"]
    out = []
    for bm, bn, bk, stages, warps in tiles:
        for ctas in values:
            cfg = Config(kind, bm, bn, bk, stages, warps, group_m, comm_blocks=comm_blocks, ctas=ctas)
            if kind == "gemm2":
                cfg = canonical(meta, replace(cfg, n_chunks=default_n_chunks(meta, bn)))
            shared = ctas * (smem_bytes(cfg, meta.gated) + SMEM_RESERVED)
            if smoke or (fits(cfg, meta.gated) and shared <= SMEM_PER_SM):
                out.append(cfg)
                cap = 65536 // (ctas * warps * 32) // 8 * 8
                if ctas > 1 and cap < 255 and not smoke:  # the compiler's choice may leave room for one program
                    out.append(replace(cfg, maxnreg=cap))
    return out


def chunk_configs(meta, base, chunks, stages):
    """GEMM2's base tile at each n_chunks (as the kernel sees it: equal CHUNK_TILES are one) and
    pipeline depth (none: the base's)."""
    return list(dict.fromkeys(canonical(meta, replace(base, n_chunks=c, stages=s))
                              for s in stages or [base.stages] for c in chunks))


def resident_programs(device, regs, warps, shared):
    """Programs of one kernel that a multiprocessor holds at once, by registers, shared memory and threads."""
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs_per_warp // warps
    by_smem = getattr(props, "shared_memory_per_multiprocessor", SMEM_PER_SM) // (shared + SMEM_RESERVED)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return min(by_regs, by_smem, by_threads)


def tma_configs(meta, comm_blocks, smoke):
    tiles = SMOKE_TILES[:2] if smoke else TMA_TILES
    group_m = SMOKE_DEFAULT["group_m"] if smoke else DEFAULT_TILE["group_m"]
    out = []
    for a_tma in (False, True):
        for bm, bn, bk, stages, warps in tiles:
            cfg = Config("gemm1_tma", bm, bn, bk, stages, warps, group_m, comm_blocks=comm_blocks, a_tma=a_tma)
            if smoke or fits(cfg, meta.gated):
                out.append(cfg)
    # Warp specialisation: num_warps is per consumer warp group; Triton adds the producer's warps.
    for bm, bn, bk, stages, warps in (SMOKE_TILES[:1] if smoke else WS_TILES):
        for split in ((False, ) if meta.gated else (False, True)):
            cfg = Config("gemm1_tma", bm, bn, bk, stages, warps, group_m, comm_blocks=comm_blocks, a_tma=True, ws=True,
                         split_epilogue=split)
            if smoke or fits(cfg, meta.gated):
                out.append(cfg)
    return out


# ----------------------------------------------------------------------------------------------
# The problem: shape, routes, buffers


@dataclass
class Meta:
    name: str
    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    tokens: int
    gated: bool
    num_local: int
    l_pow2: int
    has_bias: bool
    activation: int
    offsets: object  # ds_comet.layout.LayoutOffsets
    dtype: str  # torch dtype name of rows, weights and outputs

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


def make_meta(name, shape, gated, dtype="bfloat16"):
    hidden, ffn, num_experts, top_k, tokens = shape
    if num_experts % EP:
        raise SystemExit(f"{name}: {num_experts} experts do not split over EP={EP}")
    num_local = num_experts // EP
    # The pipeline's experts: GELU FFNs with biases (bench.py), or SwiGLU without (GatedFeedForward).
    activation = TG.ACTIVATION_CODES["silu" if gated else "gelu"]
    return Meta(name, hidden, ffn, num_experts, top_k, tokens, gated, num_local, 1 << num_local.bit_length(),
                not gated, activation, LAYOUT.layout_offsets(num_local, num_experts), dtype)


def route_counts(meta, split, all_own, seed):
    """counts[q][e]: routes source rank q sends to expert e (each source routes T*k rows).

    balanced: exactly T*k/E each. uneven: a top-k gate's mild imbalance; expert popularity is shared
    by the sources (log-normal, sigma 0.2), each source samples its T*k routes from it.
    all_own: the peer sends nothing and this rank routes all rows itself (every tile 'own').
    """
    E, total = meta.num_experts, meta.tokens * meta.top_k
    if split == "balanced":
        counts = [[total // E + (e < total % E) for e in range(E)] for _ in range(EP)]
    else:
        g = torch.Generator().manual_seed(seed)
        popularity = torch.exp(0.2 * torch.randn(E, generator=g, dtype=torch.float64))
        counts = []
        for _ in range(EP):
            p = popularity * torch.exp(0.05 * torch.randn(E, generator=g, dtype=torch.float64))
            picks = torch.multinomial((p / p.sum()).float(), total, replacement=True, generator=g)
            counts.append(torch.bincount(picks, minlength=E).tolist())
    if all_own:
        counts = [[sum(c[e] for c in counts) for e in range(E)]] + [[0] * E for _ in range(EP - 1)]
    return counts


class Weights:
    """The local experts' weights, nn.Linear layout, stacked per layer; tables of per-expert pointers."""

    def __init__(self, meta, device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        L, H, Fd = meta.num_local, meta.hidden, meta.ffn

        def normal(*size, scale):
            return (torch.randn(*size, generator=g, device=device) * scale).to(meta.torch_dtype)

        self.w1 = normal(L, Fd, H, scale=H**-0.5)
        self.b1 = normal(L, Fd, scale=0.1)
        self.w3 = normal(L, Fd, H, scale=H**-0.5) if meta.gated else self.w1
        self.b3 = normal(L, Fd, scale=0.1) if meta.gated else self.b1
        self.w2 = normal(L, H, Fd, scale=Fd**-0.5)
        self.b2 = normal(L, H, scale=0.1)
        self.tables = {name: torch.tensor([t[l].data_ptr() for l in range(L)], dtype=torch.int64, device=device)
                       for name, t in (("w1", self.w1), ("b1", self.b1), ("w3", self.w3), ("b3", self.b3),
                                       ("w2", self.w2), ("b2", self.b2))}


class Buffers:
    """One rank's inputs and outputs for one split of the routes (tensors on device)."""

    def __init__(self, meta, weights, counts, device, seed):
        L, H, Fd = meta.num_local, meta.hidden, meta.ffn
        self.meta, self.counts, self.device, self.tables = meta, counts, device, weights.tables
        self.rows_per_expert = [sum(counts[q][l] for q in range(EP)) for l in range(L)]
        self.rows_from = [sum(counts[q][:L]) for q in range(EP)]
        R = self.num_rows = sum(self.rows_per_expert)
        starts = [0]
        for n in self.rows_per_expert:
            starts.append(starts[-1] + n)
        self.expert_start = starts
        self.layout_offsets = {**meta.offsets.__dict__, "layout_total": meta.offsets.total,
                               "total_tiles": LAYOUT.TOTAL_TILES, "total_kept": LAYOUT.TOTAL_KEPT,
                               "total_recv_rows": LAYOUT.TOTAL_RECV_ROWS, "total_pieces": LAYOUT.TOTAL_PIECES}
        self._layouts = {}

        # Rows: expert l's region holds source 0's (own) rows, then source 1's; a row of source q
        # for expert l came from position send_offset_q[l] + i of q's send list.
        src, pos = torch.empty(R, dtype=torch.int64), torch.empty(R, dtype=torch.int64)
        for l in range(L):
            row = starts[l]
            for q in range(EP):
                n = counts[q][l]
                src[row:row + n] = q
                pos[row:row + n] = sum(counts[q][:l]) + torch.arange(n)
                row += n
        self.origin = ((src << 32) | pos).to(device)

        g = torch.Generator(device=device).manual_seed(seed)
        self.recv_rows = -(-(R + ROW_PAD) // 16) * 16  # a multiple of 16, as in every compile worker
        dtype = meta.torch_dtype
        self.recv = torch.randn(self.recv_rows, H, generator=g, device=device).to(dtype)
        self.recv[R:] = float("nan")
        self.h_out = torch.empty(R, Fd, dtype=dtype, device=device)
        self.h_in = None  # set by the references: the exact GEMM1 result, rounded to the dtype
        self.expert_out = torch.empty(self.recv_rows, H, dtype=dtype, device=device)  # GEMM2's rows, by recv row
        self.chunk_counters = torch.zeros(EP, MAX_CHUNKS, dtype=torch.int32, device=device)
        self.chunk_table = torch.tensor([self.chunk_counters[q].data_ptr() for q in range(EP)], dtype=torch.int64,
                                        device=device)
        self.tile_counters = torch.zeros(1, dtype=torch.int32, device=device)  # WAIT=False: never read
        self.error = torch.zeros(8, dtype=torch.int64, device=device)
        self.error_addr = self.error.data_ptr()

    def layout(self, bm):
        if bm not in self._layouts:
            lay = reference_layout(self.counts, 0, bm)
            assert lay["expert_start"] == self.expert_start, (lay["expert_start"], self.expert_start)
            self._layouts[bm] = layout_array(lay, self.layout_offsets).to(self.device)
        return self._layouts[bm]

    def flops(self, kind):
        products = 2 if self.meta.gated and kind != "gemm2" else 1
        return 2.0 * self.num_rows * self.meta.hidden * self.meta.ffn * products


class MockBuffers:
    """Buffers' shape for a compile worker: every tensor a dtype placeholder, every int alike."""

    def __init__(self, meta):
        rows, i64, i32 = ("tensor", meta.dtype), ("tensor", "int64"), ("tensor", "int32")
        self.meta = meta
        self.tables = {name: i64 for name in ("w1", "b1", "w3", "b3", "w2", "b2")}
        self.recv = self.h_out = self.h_in = self.expert_out = rows
        self.origin = self.chunk_table = i64
        self.tile_counters = i32
        self.error_addr = 1 << 40  # a device address: a 64-bit integer
        self.recv_rows = 16 * 1024

    def layout(self, bm):
        return ("tensor", "int32")


def kernel_values(cfg, meta, bufs, num_progs, interpret):
    """Every argument of cfg.kind's kernel under every name a version of it has used."""
    t, o, H, Fd = bufs.tables, meta.offsets, meta.hidden, meta.ffn
    v = dict(layout=bufs.layout(cfg.bm), num_local=meta.num_local, off_expert_start=o.expert_start,
             off_tile_start=o.tile_start, off_local_tiles=o.local_tiles, off_remote_tiles=o.remote_tiles,
             off_total_tiles=o.totals + LAYOUT.TOTAL_TILES, L_POW2=meta.l_pow2, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
             GROUP_M=cfg.group_m, NUM_PROGS=num_progs, HAS_BIAS=meta.has_bias)
    if cfg.kind == "gemm1":
        v.update(recv=bufs.recv, rows=bufs.recv, h=bufs.h_out, out=bufs.h_out, w1_table=t["w1"], w_table=t["w1"],
                 w3_table=t["w3"], b1_table=t["b1"], b3_table=t["b3"], tile_counters=bufs.tile_counters,
                 error_addr=bufs.error_addr, timeout_ns=10**9, rank=0, hidden=H, ffn=Fd, K=H, N=Fd, sbk=1, sbn=H,
                 GATED=meta.gated, ACTIVATION=meta.activation, BACKWARD=False, WAIT=False, INTERPRET=interpret)
        v[PRE_ARG] = bufs.h_out  # only written with STORE_PRE
        v[STORE_PRE_ARG] = False
        v.update(act=bufs.h_out, STORE_ACT=False)  # a backward-only output
    elif cfg.kind == "gemm2":
        v.update(h=bufs.h_in, rows=bufs.h_in, lda=Fd, w2_table=t["w2"], w_table=t["w2"], w3_table=t["w2"],
                 b2_table=t["b2"], origin=bufs.origin, out=bufs.expert_out, chunk_counter_table=bufs.chunk_table,
                 hidden=H, ffn=Fd, K=Fd, N=H, sbk=1, sbn=Fd, EP_SIZE=EP, CHUNK_TILES=chunk_tiles(meta, cfg),
                 SECOND=False, W_NK=True)
    else:
        v.update(rows=bufs.recv, out=bufs.h_out, w_table=t["w1"], w3_table=t["w3"], b1_table=t["b1"],
                 b3_table=t["b3"], num_rows=bufs.recv_rows, K=H, N=Fd, GATED=meta.gated, ACTIVATION=meta.activation,
                 A_TMA=cfg.a_tma, WS=cfg.ws, SPLIT_EPILOGUE=cfg.split_epilogue)
    return v


def bind(cfg, values):
    """The kernel's keyword arguments, in its own names."""
    kernel = kernels()[cfg.kind]
    missing = [name for name in kernel.arg_names if name not in values]
    if missing:
        raise SystemExit(f"{cfg.kind}'s kernel takes arguments this script does not know: {missing}; "
                         "add them to kernel_values in scripts/tune_gemm.py")
    kwargs = {name: values[name] for name in kernel.arg_names}
    kwargs.update(num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.maxnreg:
        kwargs["maxnreg"] = cfg.maxnreg
    return kwargs


def worker_spec(kwargs):
    """kwargs with tensors as dtype placeholders (what a compile worker binds)."""
    return {k: ("tensor", str(v.dtype).replace("torch.", "")) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()}


# ----------------------------------------------------------------------------------------------
# Compiling in worker processes (Triton's on-disk cache carries the result to the main process)


class FakeDriver:
    """Just enough of Triton's driver to compile for a target without a GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _init_worker(target):
    try:
        os.nice(5)  # the main process times kernels meanwhile
    except OSError:
        pass
    triton.runtime.driver.set_active(FakeDriver(target))


def _ptxas_info(ptx, arch):
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(ptx)
    try:
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", "-o", os.devnull, handle.name],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(handle.name)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return dict(n_regs=int(regs.group(1)) if regs else None, spill_bytes=int(spills.group(1)) if spills else None)


def compile_job(kind, spec, ptxas_arch=0):
    """Compile one configuration (worker side); returns what the compiler says about it."""
    from triton.runtime.jit import MockTensor
    kwargs = {k: MockTensor(getattr(torch, v[1])) if isinstance(v, tuple) and v[:1] == ("tensor", ) else v
              for k, v in spec.items()}
    start = time.perf_counter()
    try:
        compiled = kernels()[kind].warmup(grid=(1, ), **kwargs)
    except Exception as error:  # a configuration the compiler refuses: report it, keep sweeping
        return dict(error=f"{type(error).__name__}: {str(error)[:400]}", compile_s=time.perf_counter() - start)
    info = dict(compile_s=time.perf_counter() - start, shared=compiled.metadata.shared,
                global_scratch=getattr(compiled.metadata, "global_scratch_size", 0))
    if ptxas_arch:
        info.update(_ptxas_info(compiled.asm["ptx"], ptxas_arch))
    return info


class Compiler:
    """A pool of compile workers fed from a priority queue, so that the main process never waits
    behind work it needs later."""

    def __init__(self, jobs, target, ptxas_arch=0):
        self.jobs, self.ptxas_arch = jobs, ptxas_arch
        self.pool = None
        if jobs > 0:
            self.pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker, initargs=(target, ))
        self.queue, self.futures, self.results, self.seq = [], {}, {}, itertools.count()
        self.broken = None

    def request(self, key, kind, spec, priority):
        if self.pool is None or key in self.futures or key in self.results:
            return
        heapq.heappush(self.queue, (priority, next(self.seq), key, kind, spec))

    def pump(self):
        if self.pool is None:
            return
        for key, future in list(self.futures.items()):
            if future.done():
                try:
                    self.results[key] = future.result()
                except Exception as error:  # a worker died: fall back to compiling in the main process
                    self.broken = f"{type(error).__name__}: {error}"
                    self.results[key] = None
                del self.futures[key]
        while self.queue and len(self.futures) < self.jobs + 2 and not self.broken:
            _, _, key, kind, spec = heapq.heappop(self.queue)
            if key not in self.futures and key not in self.results:
                try:
                    self.futures[key] = self.pool.submit(compile_job, kind, spec, self.ptxas_arch)
                except Exception as error:
                    self.broken = f"{type(error).__name__}: {error}"

    def wait(self, key, deadline, priority=(-1, 0)):
        """The worker's report on key; None to compile in the main process; 'timeout' past deadline."""
        if self.pool is None or self.broken:
            return self.results.get(key)
        for i, entry in enumerate(self.queue):  # not started yet: needed now
            if entry[2] == key:
                self.queue[i] = (priority, ) + entry[1:]
                heapq.heapify(self.queue)
                break
        while True:
            self.pump()
            if key in self.results:
                return self.results[key]
            if key not in self.futures and not any(entry[2] == key for entry in self.queue):
                return None
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return "timeout"
            wait_futures(list(self.futures.values()), timeout=min(remaining, 0.5), return_when=FIRST_COMPLETED)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def compile_key(cfg, meta):
    return (meta.name, meta.gated, meta.dtype, cfg)


# ----------------------------------------------------------------------------------------------
# Checking and timing


def activation(x, code):
    return {0: F.gelu, 1: lambda y: F.gelu(y, approximate="tanh"), 2: F.relu, 3: F.silu}[code](x)


def references(meta, weights, bufs):
    """fp32 GEMM1 and GEMM2 results per expert; GEMM2's input is GEMM1's result in bf16."""
    R, s = bufs.num_rows, bufs.expert_start
    ref1 = torch.empty(R, meta.ffn, dtype=torch.float32, device=bufs.device)
    ref2 = torch.empty(R, meta.hidden, dtype=torch.float32, device=bufs.device)
    bias = meta.has_bias
    for l in range(meta.num_local):
        x = bufs.recv[s[l]:s[l + 1]].float()
        z = F.linear(x, weights.w1[l].float(), weights.b1[l].float() if bias else None)
        y = activation(z, meta.activation)
        if meta.gated:
            y = y * F.linear(x, weights.w3[l].float(), weights.b3[l].float() if bias else None)
        ref1[s[l]:s[l + 1]] = y
    bufs.h_in = ref1.to(meta.torch_dtype)
    for l in range(meta.num_local):
        ref2[s[l]:s[l + 1]] = F.linear(bufs.h_in[s[l]:s[l + 1]].float(), weights.w2[l].float(),
                                       weights.b2[l].float() if bias else None)
    return ref1, ref2


def rel_err(got, ref):
    got = got.float()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def prepare_output(cfg, bufs):
    if cfg.kind == "gemm2":
        bufs.expert_out.fill_(float("nan"))
        bufs.chunk_counters.zero_()
    else:
        bufs.h_out.fill_(float("nan"))


def check_output(cfg, meta, bufs, refs):
    """Relative error of the launched kernel's output (GEMM2: also its chunk counters)."""
    if cfg.kind != "gemm2":
        return rel_err(bufs.h_out, refs[0]), None
    err = rel_err(bufs.expert_out[:bufs.num_rows], refs[1])
    per_chunk, n_col = chunk_tiles(meta, cfg), column_tiles(meta, cfg)
    counters = bufs.chunk_counters.cpu().tolist()
    for q in range(EP):
        for c in range(MAX_CHUNKS):
            tiles = max(0, min(per_chunk, n_col - c * per_chunk))
            if counters[q][c] != bufs.rows_from[q] * tiles:
                return err, f"chunk counter {q}/{c} is {counters[q][c]}, expected {bufs.rows_from[q] * tiles}"
    return err, None


class Timer:

    def __init__(self, smoke, warmup_ms, rep_ms):
        self.smoke, self.warmup_ms, self.rep_ms = smoke, warmup_ms, rep_ms

    def ms(self, fn):
        if self.smoke:  # the interpreter: one call, wall clock (says nothing about a GPU)
            start = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - start)
        return triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """Launches, checks and times configurations of one shape and split."""

    def __init__(self, ctx, meta, weights, bufs, split):
        self.ctx, self.meta, self.weights, self.bufs, self.split = ctx, meta, weights, bufs, split
        self.refs = references(meta, weights, bufs)
        self.results = []

    def run(self, cfg, deadline, phase):
        ctx, meta, bufs = self.ctx, self.meta, self.bufs
        record = dict(kind=cfg.kind, config=asdict(cfg), label=cfg.label(meta), phase=phase, split=self.split)
        if cfg.kind == "gemm2":
            record["chunk_tiles"], record["n_chunks_effective"] = chunk_tiles(meta, cfg), effective_chunks(meta, cfg)
        num_progs = programs(cfg, ctx.num_sms)
        kwargs = bind(cfg, kernel_values(cfg, meta, bufs, num_progs, ctx.interpret))
        report = ctx.compiler.wait(compile_key(cfg, meta), deadline)
        if report == "timeout":
            record["status"] = "time box (not compiled in time)"
            return self._keep(record)
        if isinstance(report, dict):
            record.update(worker_compile_s=report.get("compile_s"), shared=report.get("shared"))
            if "error" in report:
                record.update(status="compile error", error=report["error"])
                return self._keep(record)
        kernel = kernels()[cfg.kind]
        launch = lambda: kernel[(num_progs, )](**kwargs)  # noqa: E731
        prepare_output(cfg, bufs)
        start = time.perf_counter()
        try:
            compiled = launch()
            sync(bufs.device)
        except Exception as error:
            record.update(status="launch error", error=f"{type(error).__name__}: {str(error)[:400]}")
            return self._keep(record)
        record["first_call_s"] = time.perf_counter() - start
        for attr in ("n_regs", "n_spills"):
            value = getattr(compiled, attr, None)
            if isinstance(value, int):
                record[attr] = value
        if ctx.device.type == "cuda" and "n_regs" in record:
            # Below cfg.ctas the extra programs run one after another, not beside each other.
            record["resident"] = resident_programs(ctx.device, record["n_regs"], cfg.warps, compiled.metadata.shared)
        err, problem = check_output(cfg, meta, bufs, self.refs)
        record["rel_err"] = err if math.isfinite(err) else None  # JSON has no inf
        if not err < REL_TOL or problem:
            record.update(status="wrong result", error=problem or f"rel. err {err:.3g}")
            return self._keep(record)
        ms = ctx.timer.ms(launch)
        record.update(status="ok", ms=ms, tflops=bufs.flops(cfg.kind) / (ms * 1e-3) / 1e12)
        return self._keep(record)

    def _keep(self, record):
        self.results.append(record)
        ctx = self.ctx
        if record["status"] == "ok":
            line = (f"  {record['split']:8} {record['kind']:9} {record['label']:34} {record['tflops']:8.1f} TFLOP/s "
                    f"{record['ms']:8.3f} ms  err {record['rel_err']:.1e}  first call {record['first_call_s']:.2f} s")
        else:
            line = f"  {record['split']:8} {record['kind']:9} {record['label']:34} {record['status']}: " \
                   f"{record.get('error', '')}"
        ctx.log(line, verbose=True)
        return record

    def cublas(self):
        """cuBLAS on the same GEMMs: per-expert F.linear (with bias) and torch._grouped_mm."""
        meta, w, bufs, ctx = self.meta, self.weights, self.bufs, self.ctx
        s, R, L = bufs.expert_start, bufs.num_rows, meta.num_local
        bias = meta.has_bias
        out = {}

        def loop1():
            for l in range(L):
                x = bufs.recv[s[l]:s[l + 1]]
                F.linear(x, w.w1[l], w.b1[l] if bias else None)
                if meta.gated:
                    F.linear(x, w.w3[l], w.b3[l] if bias else None)

        def loop2():
            for l in range(L):
                F.linear(bufs.h_in[s[l]:s[l + 1]], w.w2[l], w.b2[l] if bias else None)

        for kind, fn in (("gemm1", loop1), ("gemm2", loop2)):
            ms = ctx.timer.ms(fn)
            out[f"{kind}_loop"] = dict(ms=ms, tflops=bufs.flops(kind) / (ms * 1e-3) / 1e12)
        grouped = getattr(torch, "_grouped_mm", None)
        if grouped is None:
            out["grouped_error"] = "torch._grouped_mm does not exist in this torch"
            return out
        offs = torch.tensor(s[1:], dtype=torch.int32, device=bufs.device)
        x, h = bufs.recv[:R], bufs.h_in
        for kind, a, mats, width in (("gemm1", x, [w.w1] + ([w.w3] if meta.gated else []), meta.ffn),
                                     ("gemm2", h, [w.w2], meta.hidden)):
            # nn.Linear weights [L, out, in] seen as [L, in, out] (column-major per expert), as cuBLAS
            # takes them; a contiguous copy if that layout is refused.
            for layout in ("transposed view", "contiguous copy"):
                try:
                    bs = [m.transpose(1, 2) if layout == "transposed view" else m.transpose(1, 2).contiguous()
                          for m in mats]
                    got = grouped(a, bs[0], offs=offs)
                    want = torch.cat([F.linear(a[s[l]:s[l + 1]], mats[0][l]) for l in range(L)])
                    err = rel_err(got, want.float())
                    if not err < REL_TOL:
                        raise RuntimeError(f"rel. err {err:.3g} against F.linear")
                    ms = ctx.timer.ms(lambda: [grouped(a, b, offs=offs) for b in bs])
                    out[f"{kind}_grouped"] = dict(ms=ms, tflops=bufs.flops(kind) / (ms * 1e-3) / 1e12,
                                                  weights=layout, rel_err=err)
                    break
                except Exception as error:  # not there for this dtype/GPU/layout: say so, keep going
                    out[f"{kind}_grouped_error"] = f"{layout}: {type(error).__name__}: {str(error)[:300]}"
        return out


# ----------------------------------------------------------------------------------------------
# The sweep


class Context:

    def __init__(self, args, device, num_sms, compiler, timer, interpret, log_file):
        self.args, self.device, self.num_sms, self.compiler, self.timer = args, device, num_sms, compiler, timer
        self.interpret, self.log_file = interpret, log_file

    def log(self, line, verbose=False):
        if not verbose or self.args.verbose:
            print(line, flush=True)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()


def comm_blocks_list(args):
    return [int(v) for v in str(args.comm_blocks).split(",") if v != ""]


def all_phase_a(meta, args):
    cb = comm_blocks_list(args)[0]
    out = [default_config("gemm1", meta, cb, args.smoke), default_config("gemm2", meta, cb, args.smoke)]
    ones, twos = phase_a("gemm1", meta, cb, args.smoke), phase_a("gemm2", meta, cb, args.smoke)
    for a, b in itertools.zip_longest(ones, twos):  # interleaved: the time box cuts both alike
        out += [c for c in (a, b) if c is not None and c not in out]
    return out


def request(ctx, meta, cfgs, priority):
    bufs = MockBuffers(meta)
    for i, cfg in enumerate(cfgs):
        kwargs = bind(cfg, kernel_values(cfg, meta, bufs, programs(cfg, ctx.num_sms), ctx.interpret))
        ctx.compiler.request(compile_key(cfg, meta), cfg.kind, worker_spec(kwargs), (priority, i))


def best(results, kind, **match):
    """The kind's ok results, fastest first, whose configuration matches every key=value given."""
    ok = [r for r in results if r["kind"] == kind and r["status"] == "ok"
          and all(r["config"].get(k) == v for k, v in match.items())]
    return sorted(ok, key=lambda r: -r["tflops"])


def ranked_configs(results, kind, comm_blocks):
    seen, out = set(), []
    for r in best(results, kind, comm_blocks=comm_blocks):
        cfg = Config(**r["config"])
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def tune_shape(ctx, meta, index, deadline):
    args, device = ctx.args, ctx.device
    start = time.perf_counter()
    span = deadline - start
    cbs = comm_blocks_list(args)
    out = dict(shape=dict(hidden=meta.hidden, ffn=meta.ffn, experts=meta.num_experts, top_k=meta.top_k,
                          tokens=meta.tokens, ep=EP, local_experts=meta.num_local, gated=meta.gated),
               num_sms=ctx.num_sms, comm_blocks=cbs, skipped=[])
    weights = Weights(meta, device, args.seed + 1)
    counts = route_counts(meta, "uneven", args.all_own, args.seed + 2 + index)
    bufs = Buffers(meta, weights, counts, device, args.seed + 3)
    runner = Runner(ctx, meta, weights, bufs, "uneven")
    out["uneven"] = dict(counts=counts, rows_per_expert=bufs.rows_per_expert, rows=bufs.num_rows,
                         gemm_tflop=bufs.flops("gemm1") / 1e12)
    out["uneven"]["cublas"] = runner.cublas()

    def sweep(cfgs, until, phase):
        for cfg in cfgs:
            if time.perf_counter() >= until:
                out["skipped"].append(dict(phase=phase, label=cfg.label(meta), kind=cfg.kind))
                continue
            runner.run(cfg, until, phase)

    defaults = {kind: default_config(kind, meta, cbs[0], args.smoke) for kind in ("gemm1", "gemm2")}
    for cfg in defaults.values():  # the defaults run whatever the time box says
        runner.run(cfg, time.perf_counter() + 600, "default")
    if not (args.tma_only or args.no_sweep):  # straight from the defaults to the variants asked for
        sweep(all_phase_a(meta, args)[2:], start + 0.55 * span, "A")

        later, done = [], {Config(**r["config"]) for r in runner.results}
        for kind in ("gemm1", "gemm2"):
            later += phase_b(kind, meta, ranked_configs(runner.results, kind, cbs[0]), args.smoke, done)
        request(ctx, meta, later, 10 * index + 1)
        sweep(later, start + 0.8 * span, "B")

        extra, done = [], {Config(**r["config"]) for r in runner.results}
        for kind in ("gemm1", "gemm2"):
            top = ranked_configs(runner.results, kind, cbs[0])[:2] + [defaults[kind]]
            extra += [replace(c, comm_blocks=cb) for cb in cbs[1:] for c in top]
        extra = [c for c in dict.fromkeys(extra) if c not in done]
        request(ctx, meta, extra, 10 * index + 2)
        sweep(extra, start + 0.9 * span if args.tma else deadline, "C")
    if args.gemm2_chunks:
        cfgs = chunk_configs(meta, defaults["gemm2"], args.gemm2_chunks, args.gemm2_stages)
        request(ctx, meta, cfgs, 10 * index + 5)
        sweep([c for c in cfgs if c != defaults["gemm2"]], deadline, "N")
    if len(args.ctas) > 1:
        done = {Config(**r["config"]) for r in runner.results}
        cfgs = [c for kind in ("gemm1", "gemm2") for c in ctas_configs(kind, meta, cbs[0], args.ctas, args.smoke)]
        cfgs = [c for c in cfgs if c not in done]
        request(ctx, meta, cfgs, 10 * index + 4)
        sweep(cfgs, start + 0.9 * span if args.tma else deadline, "P")
    if args.tma:
        tma = tma_configs(meta, cbs[0], args.smoke)
        sweep(tma, deadline, "T")

    winners = {kind: ranked_configs(runner.results, kind, cbs[0])[:1] for kind in ("gemm1", "gemm2", "gemm1_tma")}
    out["uneven"]["results"] = runner.results
    runner = bufs = None  # free the split's buffers before the next one
    if device.type == "cuda":
        torch.cuda.empty_cache()

    counts = route_counts(meta, "balanced", args.all_own, 0)
    bufs = Buffers(meta, weights, counts, device, args.seed + 3)
    runner = Runner(ctx, meta, weights, bufs, "balanced")
    out["balanced"] = dict(counts=counts, rows_per_expert=bufs.rows_per_expert, rows=bufs.num_rows,
                           gemm_tflop=bufs.flops("gemm1") / 1e12)
    out["balanced"]["cublas"] = runner.cublas()
    again = [defaults["gemm1"], defaults["gemm2"]] + winners["gemm1"] + winners["gemm2"] + winners["gemm1_tma"]
    for cfg in dict.fromkeys(again):
        runner.run(cfg, time.perf_counter() + 120, "balanced")
    out["balanced"]["results"] = runner.results
    out["seconds"] = time.perf_counter() - start
    runner = bufs = weights = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# Reporting


def _tf(record):
    return f"{record['tflops']:6.1f} [{record['label']}]"


def summary(name, res):
    """The shape's result in a few lines (TFLOP/s)."""
    cb = res["comm_blocks"][0]
    lines = [f"== {name}: EP={EP}, {res['shape']['local_experts']} local experts, {res['num_sms']} SMs, "
             f"comm_blocks {cb} ({res['num_sms'] - cb} programs), {res['seconds']:.0f} s"]
    for split in ("uneven", "balanced"):
        part = res[split]
        results, cub, rows = part["results"], part["cublas"], part["rows_per_expert"]
        spread = f"{min(rows)}..{max(rows)}" if min(rows) != max(rows) else f"{rows[0]} each"
        lines.append(f" {split}: R={part['rows']} rows ({spread} per expert), {part['gemm_tflop']:.2f} TFLOP per GEMM")
        for kind in ("gemm1", "gemm2"):
            mine = [r for r in results if r["kind"] == kind]
            default = ([r for r in mine if r["phase"] == "default"] if split == "uneven" else mine)[:1]
            top = best(results, kind, comm_blocks=cb)
            text = f"  {kind}: default "
            text += _tf(default[0]) if default and default[0]["status"] == "ok" else \
                f"({default[0]['status'] if default else 'not run'})"
            text += f" | best {_tf(top[0])}" if top else " | best: none ok"
            loop, grouped = cub.get(f"{kind}_loop"), cub.get(f"{kind}_grouped")
            text += f" | cuBLAS loop {loop['tflops']:.1f}" if loop else ""
            text += f", grouped {grouped['tflops']:.1f}" if grouped else ", grouped n/a"
            bound = max([c["tflops"] for c in (loop, grouped) if c], default=0)
            if top and bound:
                text += f" | best/cuBLAS {top[0]['tflops'] / bound:.2f}"
            if top and default and default[0]["status"] == "ok":
                text += f" | best/default {top[0]['tflops'] / default[0]['tflops']:.2f}"
            lines.append(text)
        if split == "balanced":
            continue
        per_chunks = {}
        for r in best(results, "gemm2", comm_blocks=cb):
            per_chunks.setdefault(r["n_chunks_effective"], r)
        if per_chunks:
            lines.append("  gemm2 best per n_chunks: " +
                         "; ".join(f"{c}: {_tf(r)}" for c, r in sorted(per_chunks.items())))
        for kind in ("gemm1", "gemm2"):
            for other in res["comm_blocks"][1:]:
                got = best(results, kind, comm_blocks=other)
                if got:
                    lines.append(f"  {kind} comm_blocks={other}: best {_tf(got[0])}")
        for kind in ("gemm1", "gemm2"):
            for ctas in sorted({r["config"].get("ctas", 1) for r in results} - {1}):
                got = best(results, kind, comm_blocks=cb, ctas=ctas)
                if got:
                    lines.append(f"  {kind} {ctas} programs/SM: best {_tf(got[0])} (resident {got[0].get('resident')})")
        for a_tma in (False, True):
            got = best(results, "gemm1_tma", a_tma=a_tma)
            if got:
                lines.append(f"  gemm1 TMA {'rows+weights' if a_tma else 'weights'}: best {_tf(got[0])}")
        for kind in ("gemm1", "gemm2"):
            top = best(results, kind, comm_blocks=cb)[:5]
            lines.append(f"  {kind} top {len(top)}: " + "; ".join(f"{r['tflops']:.0f} {r['label']}" for r in top))
        bad = [r for r in results if r["status"] != "ok"]
        if bad:
            lines.append(f"  not ok ({len(bad)}): " + "; ".join(f"{r['kind']} {r['label']}: {r['status']}"
                                                              for r in bad[:6]))
        errors = [f"{k}: {v}" for k, v in cub.items() if k.endswith("error")]
        if errors:
            lines.append("  cuBLAS grouped: " + " | ".join(e[:160] for e in errors))
        ran = sum(1 for r in results if r["status"] == "ok")
        lines.append(f"  {ran} configurations ran ok" + (f", the time box skipped {len(res['skipped'])}"
                                                         if res["skipped"] else ""))
    return lines


# ----------------------------------------------------------------------------------------------
# Modes


def patch_interpreter():
    """Triton 3.6's interpreter turns a loaded scalar into an int with int(array), which NumPy 2
    refuses for a 1-element array; hand it the element."""
    import triton.runtime.interpreter as interpreter
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for tune_gemm.json and tune_gemm.log")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens per rank)")
    parser.add_argument("--gated", action="store_true", help="SwiGLU experts (GEMM1 computes two products)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                        help="rows and weights (default bfloat16; --smoke: float16, as the interpreter's "
                        "bfloat16 tl.dot is wrong)")
    parser.add_argument("--all-own", action="store_true", help="every row this rank's own (the peer sends none)")
    parser.add_argument("--comm-blocks", default="16,0", help="SMs left to communication: the first value sweeps, "
                        "the others are tried on the best configurations")
    parser.add_argument("--tma", action="store_true", help="also the stand-alone TMA GEMM1: rows by TMA too, warp-specialised")
    parser.add_argument("--tma-only", action="store_true", help="the defaults, then only the TMA GEMM1 variants")
    parser.add_argument("--ctas-per-sm", dest="ctas", default="1",
                        help="programs per multiprocessor to try on small tiles, e.g. 1,2 (epilogues beside K loops)")
    parser.add_argument("--gemm2-chunks", default="", help="GEMM2's default tile at each of these n_chunks, e.g. 1,2,4,8")
    parser.add_argument("--gemm2-stages", default="", help="with --gemm2-chunks: pipeline stages to try, e.g. 3,4")
    parser.add_argument("--no-sweep", action="store_true",
                        help="the defaults, then only the variants asked for (--ctas-per-sm, --gemm2-chunks, --tma)")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for the whole sweep (time box)")
    parser.add_argument("--shape-seconds", type=float, default=90.0, help="at most this many seconds per shape")
    parser.add_argument("--jobs", type=int, default=None, help="compile workers (default: CPUs - 2; 0: none)")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="a line per configuration on stdout")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (run with TRITON_INTERPRET=1)")
    parser.add_argument("--offline", action="store_true", help="no GPU: compile every sweep configuration")
    parser.add_argument("--arch", type=int, default=90, help="--offline: the target's compute capability")
    parser.add_argument("--ptxas-info", action="store_true", help="--offline: registers and spills from ptxas -v")
    args = parser.parse_args()
    args.tma = args.tma or args.tma_only
    args.ctas = [int(v) for v in args.ctas.split(",") if v] or [1]
    args.gemm2_chunks = [int(v) for v in args.gemm2_chunks.split(",") if v]
    args.gemm2_stages = [int(v) for v in args.gemm2_stages.split(",") if v]
    return args


def cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 2


def selected_shapes(args):
    if args.smoke:
        return dict([SMOKE_SHAPE])
    return _load("shapes").selected_shapes(args.shape, args.custom)


def offline(args, shapes, log):
    """Compile every configuration the sweep can reach for --arch, in worker processes."""
    from triton.backends.compiler import GPUTarget
    target = GPUTarget("cuda", args.arch, 32)
    triton.runtime.driver.set_active(FakeDriver(target))
    jobs = args.jobs if args.jobs is not None else max(1, cpus() - 1)
    compiler = Compiler(jobs, target, args.arch if args.ptxas_info else 0)
    ctx = Context(args, torch.device("cpu"), 132, compiler, None, False, None)
    report, start, keys = {}, time.perf_counter(), []
    for index, (name, shape) in enumerate(shapes.items()):
        meta = make_meta(name, shape, args.gated, args.dtype)
        cfgs = all_phase_a(meta, args)
        # Phase B/C change only GROUP_M, CHUNK_TILES and NUM_PROGS: one of each kind suffices.
        d2 = default_config("gemm2", meta, comm_blocks_list(args)[0], False)
        cfgs += [replace(cfgs[0], group_m=16), replace(d2, n_chunks=1), replace(cfgs[0], comm_blocks=0)]
        if args.tma:
            cfgs += tma_configs(meta, comm_blocks_list(args)[0], False)
        request(ctx, meta, cfgs, index)
        keys += [(meta, cfg) for cfg in cfgs]
    failures = 0
    for meta, cfg in keys:
        key = compile_key(cfg, meta)
        info = compiler.wait(key, time.perf_counter() + 3600)
        if info is None:  # no workers: compile here
            bufs = MockBuffers(meta)
            kwargs = bind(cfg, kernel_values(cfg, meta, bufs, programs(cfg, 132), False))
            info = compile_job(cfg.kind, worker_spec(kwargs), args.arch if args.ptxas_info else 0)
        ok = "error" not in info and info["shared"] <= SMEM_LIMIT
        failures += not ok
        regs = f" regs {info.get('n_regs')} spill {info.get('spill_bytes')} B" if "n_regs" in info else ""
        text = (f"{meta.name} {cfg.kind:9} {cfg.label(meta):34} " +
                (f"shared {info['shared']:6d} B (model {smem_bytes(cfg, meta.gated):6d}){regs} "
                 f"{info['compile_s']:.1f} s" if "error" not in info else info["error"]))
        log(("ok   " if ok else "FAIL ") + text)
        report.setdefault(meta.name, []).append(dict(kind=cfg.kind, label=cfg.label(meta), **info))
    # The main process finds what the workers compiled in Triton's cache: a warmup takes no time.
    hits = []
    for meta, cfg in keys[:3]:
        bufs = MockBuffers(meta)
        kwargs = bind(cfg, kernel_values(cfg, meta, bufs, programs(cfg, 132), False))
        real = {k: torch.empty(16, dtype=getattr(torch, v[1])) if isinstance(v, tuple) else v
                for k, v in worker_spec(kwargs).items()}
        if "error_addr" in real:
            real["error_addr"] = torch.empty(8, dtype=torch.int64).data_ptr()
        t0 = time.perf_counter()
        kernels()[cfg.kind].warmup(grid=(1, ), **real)
        hits.append(time.perf_counter() - t0)
    log(f"offline: {len(keys)} configurations for sm_{args.arch}, {failures} failed, "
        f"{time.perf_counter() - start:.0f} s with {jobs} workers; main-process warmups after the workers: "
        + ", ".join(f"{h:.3f} s" for h in hits))
    compiler.close()
    return dict(mode="offline", arch=args.arch, failures=failures, cache_hit_warmup_s=hits, shapes=report)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "tune_gemm.log"), "w")

    def log(line):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    shapes = selected_shapes(args)
    if args.dtype is None:
        args.dtype = "float16" if args.smoke else "bfloat16"
    result = dict(argv=sys.argv[1:], torch=torch.__version__, triton=triton.__version__, shapes={})
    path = os.path.join(args.out, "tune_gemm.json")

    if args.offline:
        result.update(offline(args, shapes, log))
        with open(path, "w") as handle:
            json.dump(result, handle, indent=1)
        return 1 if result["failures"] else 0

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if args.smoke and not interpret:
        raise SystemExit("--smoke runs under the interpreter: TRITON_INTERPRET=1 python3 scripts/tune_gemm.py --smoke")
    if interpret:
        patch_interpreter()
        device, num_sms, target, jobs = torch.device("cpu"), 4, None, 0
        if args.comm_blocks == "16,0":
            args.comm_blocks = "1,0"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: use --offline to compile, or --smoke under TRITON_INTERPRET=1")
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        num_sms = props.multi_processor_count
        target = triton.runtime.driver.active.get_current_target()
        jobs = args.jobs if args.jobs is not None else max(1, min(32, cpus() - 2))
        result.update(device=props.name, num_sms=num_sms, target=str(target))
    if device.type == "cuda":  # the GEMMs build TMA descriptors on the device
        def alloc(size, alignment, stream):
            return torch.empty(size, dtype=torch.int8, device=device)
        triton.set_allocator(alloc)

    begin = time.perf_counter()
    compiler = Compiler(jobs, target)
    timer = Timer(interpret, args.warmup_ms, args.rep_ms)
    ctx = Context(args, device, num_sms, compiler, timer, interpret, log_file)
    metas = [make_meta(name, shape, args.gated, args.dtype) for name, shape in shapes.items()]
    for index, meta in enumerate(metas):  # phase A of every shape (and TMA) to the workers at once
        if not (args.tma_only or args.no_sweep):
            request(ctx, meta, all_phase_a(meta, args), 10 * index)
        if len(args.ctas) > 1:
            request(ctx, meta, [c for kind in ("gemm1", "gemm2")
                                for c in ctas_configs(kind, meta, comm_blocks_list(args)[0], args.ctas, args.smoke)],
                    10 * index + 4)
        if args.tma:
            request(ctx, meta, tma_configs(meta, comm_blocks_list(args)[0], args.smoke), 10 * index + 3)
    log(f"tune_gemm: {len(metas)} shapes, {num_sms} SMs, {jobs} compile workers, budget {args.budget:.0f} s"
        + (f", device {result.get('device')}" if not interpret else ", interpreter"))
    all_lines = []
    try:
        for index, meta in enumerate(metas):
            now = time.perf_counter()
            left = args.budget - (now - begin)
            deadline = now + max(5.0, min(args.shape_seconds, left / (len(metas) - index)))
            res = tune_shape(ctx, meta, index, deadline)
            result["shapes"][meta.name] = res
            with open(path, "w") as handle:
                json.dump(result, handle, indent=1)
            lines = summary(meta.name, res)
            all_lines += lines
            for line in lines:
                log(line)
    finally:
        compiler.close()
    result["seconds"] = time.perf_counter() - begin
    if compiler.broken:
        result["compile_pool"] = f"broken, compiled in the main process: {compiler.broken}"
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    log(f"\n==== summary (TFLOP/s; {result['seconds']:.0f} s; all results in {path}) ====")
    for line in all_lines:
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
