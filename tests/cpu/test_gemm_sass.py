"""The fused GEMMs' machine code for sm_90, compiled offline: no warp-wide collective under a
predicate, and no more than a little spilling.

ptxas 12.8 (Triton 3.6's) once if-converted GEMM1's own/remote tile lookup and guarded its two
warp reductions with the per-thread predicate that stages the TMA descriptor, so warps used the
wrong expert's weights (docs/decisions.md). The kernels now keep such code branch-free; this
test compiles them for H100/H200 with Triton's own ptxas, disassembles them with its nvdisasm, and
fails if any REDUX, SHFL, VOTE or MATCH runs under a predicate again. GEMM1's epilogue once held
a whole tile's accumulator with its pre-activations and activations, spilled up to 2.4 KB a thread
and made a layer's training step 20-45 % slower on the device (docs/decisions.md); the test also
fails if a compiled kernel's stack frame grows past STACK_LIMIT bytes again. The FP8 GEMMs are held to
the same rules, and to computing their products on Hopper's FP8 tensor cores (``wgmma`` with e4m3 or
e5m2 operands in their PTX). Skipped without triton.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PRELUDE = r"""
import os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import MockTensor

class Driver:  # just enough of Triton's driver to compile for sm_90 without a GPU
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

triton.runtime.driver.set_active(Driver())
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
nvdisasm, cuobjdump = os.path.join(tools, "nvdisasm"), os.path.join(tools, "cuobjdump")
if not os.path.exists(nvdisasm) or not os.path.exists(cuobjdump):
    print("SKIP no nvdisasm or cuobjdump in", tools); sys.exit(0)
bf, fp, i64, i32 = (MockTensor(t) for t in (torch.bfloat16, torch.float16, torch.int64, torch.int32))
COLLECTIVE = re.compile(r"@!?U?P\d+ (REDUX|SHFL|VOTE|MATCH)")

STACK_LIMIT = 256  # bytes a thread; these builds need at most 32 (a 2.4 KB spill slowed steps 20-45 %)

def predicated(kernel, path):
    with open(path, "wb") as handle:
        handle.write(kernel.asm["cubin"])
    text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    code = [line.split("*/")[-1].split(";")[0].strip() for line in text.splitlines() if "*/" in line]
    usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    stack = max(int(v) for v in re.findall(r"STACK:(\d+)", usage))
    return [ins for ins in code if COLLECTIVE.match(ins)] + ([f"STACK:{stack}"] if stack > STACK_LIMIT else [])

"""

SCRIPT = (
    PRELUDE
    + r"""
from ds_comet.kernels.triton_gemm import (count_received_rows_kernel, expert_column_sums_kernel, gemm1_kernel,
                                         gemm2_kernel, wgrad_kernel)
path = sys.argv[1]
found = {}
# The fp16 cases compile the same source with the other element type (the fused path takes both).
for num_local, backward, gated, t in ((16, False, False, bf), (16, True, False, bf), (16, False, True, bf),
                                      (4, False, False, bf), (32, True, True, bf), (16, False, False, fp),
                                      (32, True, True, fp)):
    l_pow2 = 1 << num_local.bit_length()
    # Ungated forwards store the products alone (what the pipeline runs); one also compiles with the
    # activations in the epilogue (what the interpreter test checks the products against).
    for activate in ((False, True) if not (backward or gated) and num_local == 16 and t is bf else
                     (gated and not backward, )):
        k = gemm1_kernel.warmup(t, t, t, i64, i64, i64, i64, i32, i32, 2**40, 2**40, 0, 7168, 2048, num_local, 0, 8,
                                16, 24, 32, L_POW2=l_pow2, BM=128, BN=128 if gated and not backward else 256, BK=64,
                                GROUP_M=8, NUM_PROGS=116, HAS_BIAS=not gated, GATED=gated, ACTIVATION=0,
                                BACKWARD=backward, ACTIVATE=activate, STORE_PRE=gated and not backward, WAIT=True,
                                INTERPRET=False, grid=(1, ), num_warps=8, num_stages=3)
        found[("gemm1", num_local, backward, gated, activate, str(t.dtype))] = predicated(k, path)
    k = gemm2_kernel.warmup(t, 2048, i64, i64, i64, i64, t, i64, i32, 2048, 7168, num_local, 0, 8, 16, EP_SIZE=2,
                            L_POW2=l_pow2, BM=128, BN=256, BK=64, GROUP_M=8, CHUNK_TILES=4, NUM_PROGS=116,
                            HAS_BIAS=not backward, SECOND=backward and gated, W_NK=not backward, grid=(1, ),
                            num_warps=8, num_stages=3)
    found[("gemm2", num_local, backward, gated, str(t.dtype))] = predicated(k, path)
k = wgrad_kernel.warmup(bf, 4096, bf, 14336, bf, i32, 0, 4096, 14336, 4, BM=128, BN=256, BK=64, GROUP_M=8,
                        NUM_PROGS=132, grid=(1, ), num_warps=8, num_stages=3)
found[("wgrad", )] = predicated(k, path)
k = expert_column_sums_kernel.warmup(bf, 28672, bf, i32, 0, 14336, BR=128, BM=64, grid=(1, ), num_warps=4)
found[("column_sums", )] = predicated(k, path)
# After library_fp8's GEMM2, as count_received_rows launches it (tile_n 256, 4 tiles a chunk).
k = count_received_rows_kernel.warmup(i64, i32, 0, 7168, CHUNK_COLS=1024, BN=256, grid=(1, ))
found[("count_received_rows", )] = predicated(k, path)
bad = {key: ins for key, ins in found.items() if ins}
print("checked", len(found), "kernels; predicated collectives or large stacks:", bad)
sys.exit(1 if bad else 0)
"""
)


FP8_SCRIPT = (
    PRELUDE
    + r"""
from ds_comet.kernels.triton_fp8_gemm import gemm1_fp8_kernel, gemm2_fp8_kernel
from ds_comet.kernels.fp8_rows import packed_row_bytes
from ds_comet.kernels.fp8_weights import WEIGHT_TILE
from ds_comet.kernels.library_fp8_phases import EXPERT_COLUMNS_TILE, QUANTISE_COLUMNS
from ds_comet.kernels.triton_fp8_quantise import (dequantise_rows_kernel, quantise_blocks_kernel, quantise_rows_kernel,
                                                  expert_column_maxima_kernel, quantise_expert_columns_kernel,
                                                  quantise_rowwise_kernel,
                                                  quantise_weight_columns_kernel, quantise_weight_rows_kernel)
from ds_comet.kernels.triton_fp8_phases import ACCUMULATOR_ELEMENTS, GATED_GEMM1_TILE_N, GEMM1_TILE_N
MMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.(e4m3|e5m2)\.(e4m3|e5m2)")
path = sys.argv[1]
found = {}

def check(name, kernel, rows_format):
    # Each FP8 product on Hopper's FP8 tensor cores: rows in their format, weights e4m3 (none: no products).
    found[name] = predicated(kernel, path)
    mma = set(MMA.findall(kernel.asm["ptx"]))
    if mma != ({(rows_format, "e4m3")} if rows_format else set()):
        found[name].append(f"wgmma {sorted(mma)}")
    usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    spills = len(re.findall(r"\b(STL|LDL)\b", text))
    print(name, "registers", max(int(v) for v in re.findall(r"REG:(\d+)", usage)), "stack",
          max(int(v) for v in re.findall(r"STACK:(\d+)", usage)), "local loads/stores", spills,
          "shared", kernel.metadata.shared, "wgmma", sorted(mma))

u8 = MockTensor(torch.float8_e4m3fn)
f32 = MockTensor(torch.float32)
# As TritonFp8Gemm launches them (tile_m 128; GEMM2 at tile_n 256 and 128); GEMM1 also on packed FP8
# rows (fp32 scales, H + H / 32 bytes a row): forward e4m3 ("dispatch": "fp8"), backward e5m2 gradients
# ("gradient_dispatch": "fp8").
for num_local in (16, 4):
    l_pow2 = 1 << num_local.bit_length()
    for backward, gated, e5m2, rows_fp8 in ((False, False, False, False), (False, True, False, False),
                                            (True, False, False, False), (True, False, True, False),
                                            (False, False, False, True), (False, True, False, True),
                                            (True, False, True, True)):
        forward_gated = gated and not backward
        values = MockTensor(torch.float8_e5m2) if e5m2 else u8
        rows, row_scales, lda = (values, f32, packed_row_bytes(4096)) if rows_fp8 else (bf, bf, 4096)
        k = gemm1_fp8_kernel.warmup(rows, row_scales, lda, bf, bf, i64, i64, i64, i64, i64, i64, i32, i32, 2**40,
                                    2**40, 0, 4096, 14336, num_local, 0, 8, 16, 24, 32, L_POW2=l_pow2, BM=128,
                                    BN=GATED_GEMM1_TILE_N if forward_gated else GEMM1_TILE_N, GROUP_M=8,
                                    NUM_PROGS=116, HAS_BIAS=not gated, GATED=forward_gated,
                                    ACTIVATION=3 if gated else 0, BACKWARD=backward, ACTIVATE=forward_gated,
                                    STORE_PRE=forward_gated, WAIT=True,
                                    INTERPRET=False, E5M2=e5m2, ROWS_FP8=rows_fp8, grid=(1, ), num_warps=8,
                                    num_stages=3)
        check(f"gemm1_fp8 local={num_local} backward={backward} gated={gated} e5m2={e5m2} rows_fp8={rows_fp8}", k,
              "e5m2" if e5m2 else "e4m3")
    for backward, gated, e5m2, tile_n in ((False, False, False, 256), (True, True, False, 256),
                                          (True, False, True, 256), (False, True, False, 128)):
        k = gemm2_fp8_kernel.warmup(bf, 2048, i64, i64, i64, i64, i64, i64, bf, i64, i32, 2048, 7168, num_local, 0, 8,
                                    16, EP_SIZE=2, L_POW2=l_pow2, BM=128, BN=tile_n,
                                    SUB_M=min(128, ACCUMULATOR_ELEMENTS // tile_n), GROUP_M=8, CHUNK_TILES=4,
                                    NUM_PROGS=116, HAS_BIAS=not backward, SECOND=backward and gated, E5M2=e5m2,
                                    grid=(1, ), num_warps=8, num_stages=3)
        check(f"gemm2_fp8 local={num_local} backward={backward} gated={gated} e5m2={e5m2} tile_n={tile_n}", k,
              "e5m2" if e5m2 else "e4m3")
for store, store_t in ((True, True), (False, True), (True, False)):
    k = quantise_blocks_kernel.warmup(i64, u8, u8, f32, f32, 14336, 4096, STORE=store, STORE_T=store_t, grid=(1, ),
                                      num_warps=8)
    check(f"quantise_blocks store={store} store_t={store_t}", k, None)
# The exchanged packed FP8 rows, as fp8_rows launches their passes: e4m3 tokens, e4m3 or e5m2 gradients.
for values in (u8, MockTensor(torch.float8_e5m2)):
    e5m2 = values.dtype == torch.float8_e5m2
    k = quantise_rows_kernel.warmup(bf, values, f32, 4000, 7168, packed_row_bytes(7168), E5M2=e5m2, BM=32,
                                    grid=(1, ), num_warps=4)
    check(f"quantise_rows e5m2={e5m2}", k, None)
    k = dequantise_rows_kernel.warmup(values, f32, bf, 4000, 7168, packed_row_bytes(7168), BM=32, grid=(1, ),
                                      num_warps=4)
    check(f"dequantise_rows e5m2={e5m2}", k, None)
    # The rowwise recipe's rows for the library's FP8 GEMMs, as library_fp8_phases.quantised_rows launches it.
    k = quantise_rowwise_kernel.warmup(bf, 14336, values, f32, 14336, E5M2=e5m2, BK=QUANTISE_COLUMNS, grid=(1, ),
                                       num_warps=4)
    check(f"quantise_rowwise e5m2={e5m2}", k, None)
    # The FP8 weight gradients' operands, as library_fp8_phases.quantised_expert_columns_by_triton launches
    # them (a column slice of the first layer's [R, 2F] gradients).
    k = quantise_expert_columns_kernel.warmup(bf, 28672, values, 16512, f32, i32, i32, 5, i32, 14336, 8,
                                              E5M2=e5m2, BR=EXPERT_COLUMNS_TILE[0], BC=EXPERT_COLUMNS_TILE[1],
                                              grid=(1, ), num_warps=4)
    check(f"quantise_expert_columns e5m2={e5m2}", k, None)
k = expert_column_maxima_kernel.warmup(bf, 28672, i32, i32, 5, 14336, 8, BR=EXPERT_COLUMNS_TILE[0],
                                       BC=EXPERT_COLUMNS_TILE[1], grid=(1, ), num_warps=4)
check("expert_column_maxima", k, None)
# The rowwise weight copies, as Fp8WeightCache launches them: per row, and per column transposed (W2^T;
# W1 and W3 together).
k = quantise_weight_rows_kernel.warmup(i64, u8, f32, 14336, 4096, BK=QUANTISE_COLUMNS, grid=(1, ), num_warps=4)
check("quantise_weight_rows", k, None)
for two in (False, True):
    k = quantise_weight_columns_kernel.warmup(i64, i64, u8, f32, 14336, 4096, TWO=two, BN=WEIGHT_TILE[0],
                                              BC=WEIGHT_TILE[1], grid=(1, ), num_warps=4)
    check(f"quantise_weight_columns two={two}", k, None)
bad = {key: ins for key, ins in found.items() if ins}
print("checked", len(found), "kernels; predicated collectives, large stacks or other MMAs:", bad)
sys.exit(1 if bad else 0)
"""
)


def compile_for_sm90(tmp_path, script: str) -> str:
    """Runs ``script`` (a compile for sm_90 with Triton's own ptxas) in a child process; its stdout."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "kernel.cubin")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_no_predicated_collective_and_little_spilling(tmp_path):
    assert "checked 18 kernels" in compile_for_sm90(tmp_path, SCRIPT)


def test_the_fp8_gemms_run_on_the_fp8_tensor_cores_without_predicated_collectives_or_spilling(tmp_path):
    """The FP8 GEMMs as ``TritonFp8Gemm`` launches them: their products are Hopper's FP8 wgmma (e4m3 rows,
    or e5m2 gradients, by e4m3 weights), with the bf16 GEMMs' rules on collectives and stacks, GEMM1's
    forward and backward also on packed FP8 rows; the weights' quantisation kernel as ``Fp8WeightCache`` launches it,
    the dispatched rows' quantise and dequantise passes as ``fp8_rows`` launches them, and the rowwise
    recipe's row quantisation, weight copies and weight gradients' operands as ``library_fp8_phases`` and
    ``Fp8WeightCache`` launch them. Each kernel's registers, stack, local-memory accesses and shared memory are printed
    (pytest -s)."""
    out = compile_for_sm90(tmp_path, FP8_SCRIPT)
    print(out)
    assert "checked 37 kernels" in out
