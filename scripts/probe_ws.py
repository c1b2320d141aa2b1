#!/usr/bin/env python3
"""Probe: the grouped GEMMs with weight tiles from one host-built descriptor, with and without
warp specialisation, against the pipeline's kernels and cuBLAS, on one GPU.

    python3 scripts/probe_ws.py [--shape NAME ...] [--out DIR] [--ws]
    python3 scripts/probe_ws.py --offline [--ws]     (no GPU: compile every variant for sm_90a)

The pipeline builds a TMA descriptor on the device for every tile (the experts' weights are
separate tensors). When the local experts' weights lie at one stride from each other (stacked, or
in ZeRO's flat buffer), one host-built descriptor over [experts, N, K] covers them all: no
per-tile descriptor, and nothing a producer warp running ahead of its consumers could overwrite
(the hypothesis for the wrong results of the warp-specialised variants, docs/performance.md).

Each variant's output is checked against fp32 references before it is timed. GEMM1 runs the
forward with the bias, GELU and the stored pre-activation (a training forward); GEMM2 stores its
rows and counts them per chunk and source as the pipeline's does.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tune_gemm", os.path.join(ROOT, "scripts", "tune_gemm.py"))
TUNE = importlib.util.module_from_spec(_spec)
sys.modules["tune_gemm"] = TUNE
_spec.loader.exec_module(TUNE)
TG = TUNE.TG


@triton.jit
def _tile_product(a_desc, rows, w_desc, expert, row0, col0, offs_m, m_mask, K, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, A_TMA: tl.constexpr, WS: tl.constexpr):
    """rows[row0:row0+BM] @ W_expert[col0:col0+BN]^T in fp32, W's tiles through the one 3-D descriptor."""
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        if A_TMA:
            a = a_desc.load([row0, k * BK])
        else:
            a = tl.load(rows + offs_m[:, None] * K + (k * BK + offs_k)[None, :],
                        mask=m_mask[:, None] & (offs_k < K - k * BK)[None, :], other=0.0)
        w = w_desc.load([expert, col0, k * BK]).reshape(BN, BK)
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _act(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        y = x / (1.0 + tl.exp(-x))
    return y


@triton.jit
def gemm1_desc_kernel(a_desc, rows, out, pre, w_desc, b1_table, layout, K, N, num_local, off_expert_start,
                      off_local_tiles, off_remote_tiles, off_total_tiles, L_POW2: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, A_TMA: tl.constexpr, WS: tl.constexpr,
                      STORE_PRE: tl.constexpr):
    dtype = rows.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    in_table = lanes <= num_local
    own_prefix = tl.load(layout + off_local_tiles + lanes, mask=in_table, other=1 << 30)
    rest_prefix = tl.load(layout + off_remote_tiles + lanes, mask=in_table, other=1 << 30)
    own_total = tl.load(layout + off_local_tiles + num_local)
    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        slot, pid_n = TG._swizzle(tile, total_m, n_tiles, GROUP_M)
        expert, _, row0, row_end = TG._own_rows_first(slot, own_prefix, rest_prefix, own_total, layout,
                                                      off_expert_start, off_local_tiles, off_remote_tiles, BM)
        col0 = pid_n * BN
        offs_m = row0 + tl.arange(0, BM)
        offs_n = col0 + tl.arange(0, BN)
        m_mask = offs_m < row_end
        n_mask = offs_n < N
        acc = _tile_product(a_desc, rows, w_desc, expert, row0, col0, offs_m, m_mask, K, BM, BN, BK, A_TMA, WS)
        if HAS_BIAS:
            b1 = tl.load(b1_table + expert).to(tl.pointer_type(dtype))
            acc += tl.load(b1 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        if STORE_PRE:
            tl.store(pre + offs_m[:, None] * N + offs_n[None, :], acc.to(dtype), mask=mn_mask)
        tl.store(out + offs_m[:, None] * N + offs_n[None, :], _act(acc, ACTIVATION).to(dtype), mask=mn_mask)


@triton.jit
def gemm2_desc_kernel(a_desc, rows, w_desc, b2_table, origin, out, chunk_counter_table, layout, K, N, num_local,
                      off_expert_start, off_tile_start, off_total_tiles, EP_SIZE: tl.constexpr, L_POW2: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      CHUNK_TILES: tl.constexpr, NUM_PROGS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      A_TMA: tl.constexpr, WS: tl.constexpr, BARRIER: tl.constexpr, SIGNAL: tl.constexpr):
    dtype = rows.dtype.element_ty
    total_m = tl.load(layout + off_total_tiles)
    n_tiles = tl.cdiv(N, BN)
    lanes = tl.arange(0, L_POW2)
    tile_prefix = tl.load(layout + off_tile_start + lanes, mask=lanes <= num_local, other=1 << 30)
    for tile in range(tl.program_id(0), total_m * n_tiles, NUM_PROGS):
        chunk, expert, row0, row_end, n0 = TG._chunk_major_tile(tile, total_m, n_tiles, tile_prefix, layout,
                                                                off_expert_start, off_tile_start, BM, BN, GROUP_M,
                                                                CHUNK_TILES)
        offs_m = row0 + tl.arange(0, BM)
        offs_n = n0 + tl.arange(0, BN)
        m_mask = offs_m < row_end
        n_mask = offs_n < N
        acc = _tile_product(a_desc, rows, w_desc, expert, row0, n0, offs_m, m_mask, K, BM, BN, BK, A_TMA, WS)
        if HAS_BIAS:
            b2 = tl.load(b2_table + expert).to(tl.pointer_type(dtype))
            acc += tl.load(b2 + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])
        if SIGNAL:
            source = (tl.load(origin + offs_m, mask=m_mask, other=0) >> 32).to(tl.int32)
            if BARRIER:
                tl.debug_barrier()
            for p in tl.static_range(EP_SIZE):
                delivered = tl.sum((m_mask & (source == p)).to(tl.int32))
                counter = tl.load(chunk_counter_table + p).to(tl.pointer_type(tl.int32))
                tl.atomic_add(counter + chunk, delivered, mask=delivered > 0, sem="release", scope="sys")


VARIANTS = {
    # name: (kind, A_TMA, WS, stages, warps)
    "g1 desc": ("gemm1", False, False, 3, 8),
    "g1 desc a-tma": ("gemm1", True, False, 3, 8),
    "g2 desc": ("gemm2", False, False, 3, 8),
    "g2 desc a-tma": ("gemm2", True, False, 3, 8),
    "g2 desc a-tma nosignal": ("gemm2", True, False, 3, 8),
}
# Warp-specialised (--ws). Triton 3.6 compiles these, but the first one run on an H200 never
# finished (docs/performance.md, seventh session); GEMM2 with its counting epilogue, or GEMM1 with
# rows loaded by plain masked loads, does not compile warp-specialised at all.
WS_VARIANTS = {
    "g1 desc a-tma ws": ("gemm1", True, True, 3, 4),
    "g1 desc a-tma ws s4": ("gemm1", True, True, 4, 4),
    "g2 desc a-tma ws nosignal": ("gemm2", True, True, 3, 4),
}
BM, BN, BK, GROUP_M = 128, 256, 64, 8


def descriptors(meta, weights, bufs, rows, kind):
    L, H, Fd = meta.num_local, meta.hidden, meta.ffn
    if kind == "gemm1":
        w, K, N = weights.w1, H, Fd
    else:
        w, K, N = weights.w2, Fd, H
    a = TensorDescriptor(rows, [rows.shape[0], K], [rows.stride(0), 1], [BM, BK])
    wd = TensorDescriptor(w, [L, N, K], [w.stride(0), K, 1], [1, BN, BK])
    return a, wd, K, N


def launch_args(name, meta, weights, bufs, num_progs, pre):
    kind, a_tma, ws, stages, warps = VARIANTS[name]
    o = meta.offsets
    common = dict(layout=bufs.layout(BM), num_local=meta.num_local, off_expert_start=o.expert_start,
                  off_total_tiles=o.totals + TUNE.LAYOUT.TOTAL_TILES, L_POW2=meta.l_pow2, BM=BM, BN=BN, BK=BK,
                  GROUP_M=GROUP_M, NUM_PROGS=num_progs, HAS_BIAS=meta.has_bias, A_TMA=a_tma, WS=ws,
                  num_warps=warps, num_stages=stages)
    if kind == "gemm1":
        a, wd, K, N = descriptors(meta, weights, bufs, bufs.recv, kind)
        return gemm1_desc_kernel, dict(common, a_desc=a, rows=bufs.recv, out=bufs.h_out, pre=pre, w_desc=wd,
                                       b1_table=bufs.tables["b1"], K=K, N=N, off_local_tiles=o.local_tiles,
                                       off_remote_tiles=o.remote_tiles, ACTIVATION=meta.activation, STORE_PRE=True)
    a, wd, K, N = descriptors(meta, weights, bufs, bufs.h_in, kind)
    cfg = TUNE.Config("gemm2", BM, BN, BK, stages, warps, GROUP_M)
    return gemm2_desc_kernel, dict(common, a_desc=a, rows=bufs.h_in, w_desc=wd, b2_table=bufs.tables["b2"],
                                   origin=bufs.origin, out=bufs.expert_out, chunk_counter_table=bufs.chunk_table, K=K,
                                   N=N, off_tile_start=o.tile_start, EP_SIZE=TUNE.EP,
                                   CHUNK_TILES=TUNE.chunk_tiles(meta, cfg), BARRIER="nobar" not in name,
                                   SIGNAL="nosignal" not in name)


def pipeline_args(kind, meta, weights, bufs, num_progs, pre):
    stages, warps = 3, 8
    cfg = TUNE.Config(kind, BM, BN, BK, stages, warps, GROUP_M)
    values = TUNE.kernel_values(cfg, meta, bufs, num_progs, False)
    kwargs = TUNE.bind(cfg, values)
    if kind == "gemm1":
        kwargs.update(pre=pre, STORE_PRE=True)
    return TUNE.kernels()[kind], kwargs


def run_shape(name, shape, comm_blocks, num_sms, timer):
    device = torch.device("cuda")
    meta = TUNE.make_meta(name, shape, False)
    weights = TUNE.Weights(meta, device, 1)
    counts = TUNE.route_counts(meta, "uneven", False, 2)
    bufs = TUNE.Buffers(meta, weights, counts, device, 3)
    refs = TUNE.references(meta, weights, bufs)
    pre = torch.empty_like(bufs.h_out)
    num_progs = num_sms - comm_blocks
    results = {}
    flops = {k: bufs.flops(k) for k in ("gemm1", "gemm2")}

    def check(kind):
        if kind == "gemm1":
            return TUNE.rel_err(bufs.h_out, refs[0]), None
        cfg = TUNE.Config("gemm2", BM, BN, BK, 3, 8, GROUP_M)
        return TUNE.check_output(cfg, meta, bufs, refs)

    entries = [("pipeline gemm1", "gemm1"), ("pipeline gemm2", "gemm2")] + [(n, v[0]) for n, v in VARIANTS.items()]
    for label, kind in entries:
        try:
            if label.startswith("pipeline"):
                kernel, kwargs = pipeline_args(kind, meta, weights, bufs, num_progs, pre)
                call = lambda: TG_launch(kernel, num_progs, kwargs)  # noqa: E731
            else:
                kernel, kwargs = launch_args(label, meta, weights, bufs, num_progs, pre)
                call = lambda: kernel[(num_progs, )](**kwargs)  # noqa: E731
            cfg = TUNE.Config(kind, BM, BN, BK, 3, 8, GROUP_M)
            TUNE.prepare_output(cfg, bufs)
            call()
            torch.cuda.synchronize()
            err, problem = check(kind)
            if "nosignal" in label:
                problem = None  # counts nothing, by design
            record = dict(rel_err=err, problem=problem)
            if err < TUNE.REL_TOL and problem is None:
                ms = timer.ms(call)
                record.update(ms=ms, tflops=flops[kind] / ms / 1e9)
        except Exception as error:  # a variant the compiler refuses: report it, go on
            record = dict(error=f"{type(error).__name__}: {str(error)[:300]}")
        results[label] = record
        print(f"{name} {label:24} {json.dumps(record)}", flush=True)
    s = bufs.expert_start
    for kind in ("gemm1", "gemm2"):
        if kind == "gemm1":
            fn = lambda: [F.linear(bufs.recv[s[l]:s[l + 1]], weights.w1[l], weights.b1[l]) for l in range(meta.num_local)]  # noqa
        else:
            fn = lambda: [F.linear(bufs.h_in[s[l]:s[l + 1]], weights.w2[l], weights.b2[l]) for l in range(meta.num_local)]  # noqa
        ms = timer.ms(fn)
        results[f"cublas {kind} (all SMs)"] = dict(ms=ms, tflops=flops[kind] / ms / 1e9)
        print(f"{name} cublas {kind:17} {ms:.3f} ms", flush=True)
    return results


def TG_launch(kernel, num_progs, kwargs):
    from ds_comet.fused import with_descriptor_scratch
    return with_descriptor_scratch(lambda: kernel[(num_progs, )](**kwargs))


def offline():
    from triton.backends.compiler import GPUTarget
    target = GPUTarget("cuda", 90, 32)
    triton.runtime.driver.set_active(TUNE.FakeDriver(target))
    from triton.runtime.jit import MockTensor
    failures = 0
    for name, shape in list(TUNE.SHAPES.items())[:1]:
        meta = TUNE.make_meta(name, shape, False)
        L, H, Fd = meta.num_local, meta.hidden, meta.ffn
        w1 = torch.empty(L, Fd, H, dtype=torch.bfloat16)
        w2 = torch.empty(L, H, Fd, dtype=torch.bfloat16)
        rows = torch.empty(64, max(H, Fd), dtype=torch.bfloat16)
        for label, (kind, a_tma, ws, stages, warps) in VARIANTS.items():
            w, K, N = (w1, H, Fd) if kind == "gemm1" else (w2, Fd, H)
            a = TensorDescriptor(rows, [64, K], [rows.stride(0), 1], [BM, BK])
            wd = TensorDescriptor(w, [L, N, K], [w.stride(0), K, 1], [1, BN, BK])
            bf, i64, i32 = MockTensor(torch.bfloat16), MockTensor(torch.int64), MockTensor(torch.int32)
            o = meta.offsets
            common = dict(layout=i32, num_local=L, off_expert_start=o.expert_start,
                          off_total_tiles=o.totals + TUNE.LAYOUT.TOTAL_TILES, L_POW2=meta.l_pow2, BM=BM, BN=BN, BK=BK,
                          GROUP_M=GROUP_M, NUM_PROGS=123, HAS_BIAS=True, A_TMA=a_tma, WS=ws, num_warps=warps,
                          num_stages=stages)
            start = time.perf_counter()
            try:
                if kind == "gemm1":
                    compiled = gemm1_desc_kernel.warmup(a, bf, bf, bf, wd, i64, K=K, N=N, off_local_tiles=o.local_tiles,
                                                        off_remote_tiles=o.remote_tiles, ACTIVATION=0, STORE_PRE=True,
                                                        grid=(1, ), **common)
                else:
                    compiled = gemm2_desc_kernel.warmup(a, bf, wd, i64, i64, bf, i64, K=K, N=N,
                                                        off_tile_start=o.tile_start, EP_SIZE=2, CHUNK_TILES=4,
                                                        BARRIER="nobar" not in label, SIGNAL="nosignal" not in label, grid=(1, ), **common)
                ttgir = compiled.asm.get("ttgir", "")
                print(f"ok   {label:24} {time.perf_counter() - start:5.1f} s  shared {compiled.metadata.shared} "
                      f"warp_specialize partitions: {ttgir.count('ttg.warp_specialize')} "
                      f"tensormap creations: {ttgir.count('tensormap_create')}", flush=True)
            except Exception as error:
                failures += 1
                print(f"FAIL {label:24} {type(error).__name__}: {str(error)[:2000]}", flush=True)
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append")
    parser.add_argument("--out", default="probe_out")
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--ws", action="store_true", help="also the warp-specialised variants (one hung on an H200)")
    args = parser.parse_args()
    if args.ws:
        VARIANTS.update(WS_VARIANTS)
    if args.offline:
        sys.exit(1 if offline() else 0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer = TUNE.Timer(False, 25, 100)
    comm_blocks = {"H4096-F14336-E8-k2-T8192": 9, "H2048-F1408-E64-k4-T8192": 22, "H7168-F2048-E32-k8-T4096": 22}
    out = {}
    for name in args.shape or list(TUNE.SHAPES):
        out[name] = run_shape(name, TUNE.SHAPES[name], comm_blocks.get(name, 16), num_sms, timer)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_ws.json"), "w") as handle:
        json.dump(out, handle, indent=1)


if __name__ == "__main__":
    main()
