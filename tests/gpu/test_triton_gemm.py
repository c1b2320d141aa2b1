"""The fused pipeline's Triton GEMMs under Triton's CPU interpreter, against plain torch.

One rank (P=1): the test lays out the receive buffer as the exchange and dispatch kernels would
(tests/support/layout_reference.py), marks every row tile as arrived, runs GEMM1 then GEMM2, and checks
every kept route's output row (GEMM2 stores it by receive row) and every chunk counter. This covers
the tile schedule (own-row tiles first, then the rest), the expert search, the swizzle and the
column chunks without a GPU; with one rank every row's source is 0, so the per-source counting and
the combine's reads (route_row) are left to the GPU tests.
Then the backward kernels run on random output gradients laid out the same way (GEMM1 backward,
dY W2 alone, and the elementwise kernel after it; GEMM2 backward
with the gated second operand; the grouped weight and bias gradients) and are checked against
float64 autograd of each expert. The elementwise steps as the pipeline calls them
(``FusedKernels.activations`` and ``activations_backward``) are checked the same way on every
form of the products they take. Skipped where triton is not installed (it is an extra).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import sys
import torch
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter turns a loaded scalar into a Python int with int(array), which NumPy 2
# refuses for 1-element arrays; give it the element instead.
_patch_tensor = interpreter._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patch_lang_tensor
sys.path.insert(0, sys.argv[1])
from tests.support.layout_reference import reference_layout, layout_array
from ds_comet.kernels import constants as C, layout as L
from ds_comet.experts import FeedForward, GatedFeedForward, fused_expert
from ds_comet.pipelines.expert_weights import ModuleFusedExperts
from ds_comet.kernels.launch import PointerTables
from ds_comet.kernels.triton_phases import next_power_of_2
from ds_comet.pipelines.routing import plan_routes
from ds_comet.kernels.triton_gemm import (ACTIVATION_CODES, expert_column_sums_kernel, gemm1_kernel, gemm2_kernel,
                                          wgrad_kernel)
from ds_comet.kernels.triton_activation import activation_backward_kernel, activation_kernel

def check(num_tokens, hidden, ffn, num_experts, top_k, tile_m, tile_n, chunk_tiles, gated, activation, seed,
          with_bias=True):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, hidden, generator=g)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    scores[:, 0] += 0.5  # skew: expert 0 gets many rows, others few or none
    indices = scores.topk(top_k, dim=1).indices.t().contiguous().int()
    indices[torch.rand(indices.shape, generator=g) < 0.2] = -1
    plan = plan_routes(indices, num_experts)
    counts = [plan.expert_counts.tolist()]
    lay = reference_layout(counts, 0, tile_m)
    offsets = L.layout_offsets(num_experts, num_experts)
    layout = layout_array(lay, {**offsets.__dict__, "layout_total": offsets.total, "total_tiles": C.TOTAL_TILES,
                                "total_kept": C.TOTAL_KEPT, "total_recv_rows": C.TOTAL_RECV_ROWS,
                                "total_pieces": C.TOTAL_PIECES})
    rows, kept = lay["totals"]["recv_rows"], lay["totals"]["kept"]
    recv = torch.full((rows + tile_m, hidden), float("nan"))
    origin = torch.zeros(rows + tile_m, dtype=torch.int64)
    for e in range(num_experts):
        for i in range(counts[0][e]):
            pos = lay["send_offset"][e] + i
            recv[lay["dest_row"][e] + i] = tokens[plan.route_order[pos] % num_tokens]
            origin[lay["dest_row"][e] + i] = pos
    counters = torch.zeros(lay["totals"]["tiles"] + 1, dtype=torch.int32)
    for l in range(num_experts):
        region = lay["expert_start"][l + 1] - lay["expert_start"][l]
        for t in range(lay["tile_start"][l + 1] - lay["tile_start"][l]):
            counters[lay["tile_start"][l] + t] = min(tile_m, region - t * tile_m)

    torch.manual_seed(seed)
    experts = [(GatedFeedForward(hidden, ffn, activation, bias=with_bias) if gated
                else FeedForward(hidden, ffn, activation, bias=with_bias)) for _ in range(num_experts)]
    specs = [fused_expert(e) for e in experts]
    tables = PointerTables().get(ModuleFusedExperts(specs), torch.empty(0, hidden))
    h = torch.full((rows + tile_m, ffn), float("nan"))
    expert_out = torch.full((rows + tile_m, hidden), float("nan"))  # GEMM2's rows, by recv row
    chunk_counters = torch.zeros(64, dtype=torch.int32)
    chunk_table = torch.tensor([chunk_counters.data_ptr()], dtype=torch.int64)
    error = torch.zeros(8, dtype=torch.int64)
    l_pow2 = next_power_of_2(num_experts + 1)
    width = ffn * (2 if gated else 1)
    pre = torch.full((rows + tile_m, width), float("nan"))
    common = dict(L_POW2=l_pow2, BM=tile_m, BN=tile_n, BK=16, GROUP_M=2, NUM_PROGS=3)
    lo = (offsets.expert_start, offsets.tile_start)
    first_args = (layout, counters, error.data_ptr(), 10**9, 0, hidden, ffn)
    first_offsets = (num_experts, *lo, offsets.local_tiles, offsets.remote_tiles, offsets.totals + C.TOTAL_TILES)
    gemm1_kernel[(3, )](recv, h, pre, tables["w1"], tables["w3"], tables["b1"], tables["b3"], *first_args,
                        *first_offsets, **common, HAS_BIAS=with_bias, GATED=gated,
                        ACTIVATION=ACTIVATION_CODES[activation], BACKWARD=False, ACTIVATE=True, STORE_PRE=True,
                        WAIT=True, INTERPRET=True)
    received = torch.tensor([rows], dtype=torch.int32)
    if not gated:
        # The products alone (what a GELU expert's forward stores, training or eval), then the activation:
        # the same products and activations as the epilogue's, rows past the received ones untouched.
        products, h_split = torch.full_like(pre, float("nan")), torch.full_like(h, float("nan"))
        gemm1_kernel[(3, )](recv, products, products, tables["w1"], tables["w3"], tables["b1"], tables["b3"],
                            *first_args, *first_offsets, **common, HAS_BIAS=with_bias, GATED=False,
                            ACTIVATION=ACTIVATION_CODES[activation], BACKWARD=False, ACTIVATE=False,
                            STORE_PRE=False, WAIT=True, INTERPRET=True)
        activation_kernel[(-(-rows // 16), -(-ffn // 16))](products, products, ffn, h_split, received, ffn,
                                                           ACTIVATION=ACTIVATION_CODES[activation], GATED=False,
                                                           BM=16, BN=16)
        torch.testing.assert_close(products[:rows], pre[:rows], rtol=0, atol=0)
        torch.testing.assert_close(h_split[:rows], h[:rows], rtol=1e-6, atol=1e-6)
        assert h_split[rows:].isnan().all()
    gemm2_kernel[(3, )](h, ffn, tables["w2"], tables["w2"], tables["b2"], origin, expert_out, chunk_table, layout, ffn,
                        hidden, num_experts, *lo, offsets.totals + C.TOTAL_TILES, EP_SIZE=1, **common,
                        CHUNK_TILES=chunk_tiles, HAS_BIAS=with_bias, SECOND=False, W_NK=True)
    with torch.no_grad():
        for e in range(num_experts):
            for i in range(counts[0][e]):
                pos = lay["send_offset"][e] + i
                expected = experts[e](tokens[plan.route_order[pos] % num_tokens].double().float())
                torch.testing.assert_close(expert_out[lay["dest_row"][e] + i], expected, rtol=2e-4, atol=2e-4)
    n_tiles = -(-hidden // tile_n)
    for c in range(-(-n_tiles // chunk_tiles)):
        tiles = min(chunk_tiles, n_tiles - c * chunk_tiles)
        assert chunk_counters[c].item() == kept * tiles, (c, chunk_counters[c].item(), kept * tiles)
    assert error[0].item() == 0

    # Backward: a random gradient per kept route, laid out like the forward's rows.
    grad_routes = torch.randn(kept, hidden, generator=g)
    grad_recv = torch.full_like(recv, float("nan"))
    for e in range(num_experts):
        for i in range(counts[0][e]):
            grad_recv[lay["dest_row"][e] + i] = grad_routes[lay["send_offset"][e] + i]
    grad_pre = torch.full((rows + tile_m, width), float("nan"))
    h_again = torch.full_like(h, float("nan"))  # the activations, recomputed from pre for W2's gradient
    # g = dY W2 alone, then the elementwise kernel: the products' gradients and the activations.
    grad_h = torch.full_like(h, float("nan"))
    gemm1_kernel[(3, )](grad_recv, grad_h, grad_h, tables["w2"], tables["w3"], tables["b1"], tables["b3"], *first_args,
                        *first_offsets, **common, HAS_BIAS=with_bias, GATED=gated,
                        ACTIVATION=ACTIVATION_CODES[activation], BACKWARD=True, ACTIVATE=False, STORE_PRE=False,
                        WAIT=True, INTERPRET=True)
    activation_backward_kernel[(-(-rows // 16), -(-ffn // 16))](
        grad_h, pre, pre[:, ffn:] if gated else pre, width, grad_pre, h_again, received, ffn,
        ACTIVATION=ACTIVATION_CODES[activation], GATED=gated, STORE_ACT=True, BM=16, BN=16)
    # fp32 here, so pre holds GEMM1's products exactly and the recomputed rows are the forward's.
    torch.testing.assert_close(h_again[:rows], h[:rows], rtol=1e-6, atol=1e-6)
    grad_rows = torch.full_like(expert_out, float("nan"))
    chunk_counters.zero_()
    gemm2_kernel[(3, )](grad_pre, width, tables["w1"], tables["w3"], tables["b2"], origin, grad_rows, chunk_table,
                        layout, ffn, hidden, num_experts, *lo, offsets.totals + C.TOTAL_TILES, EP_SIZE=1, **common,
                        CHUNK_TILES=chunk_tiles, HAS_BIAS=False, SECOND=gated, W_NK=False)
    grads = {}
    for name, a, b, m, n in (("w2", grad_recv, h_again, hidden, ffn), ("w1", grad_pre, recv, width, hidden)):
        out = torch.full((num_experts, m, n), float("nan"))
        wgrad_kernel[(3, )](a, a.shape[1], b, b.shape[1], out, layout, offsets.expert_start, m, n, num_experts,
                            BM=16, BN=16, BK=16, GROUP_M=2, NUM_PROGS=3)
        # The column sums (the bias gradients): over the whole width, and over each column half
        # read with the whole row's stride, as a gated dW1 passes its two projections.
        for first_col, cols in ((0, m), (0, m // 2), (m // 2, m - m // 2)):
            last_col = first_col + cols
            sums = torch.full((num_experts, cols), float("nan"))
            expert_column_sums_kernel[(-(-cols // 8), num_experts)](a[:, first_col:], a.shape[1], sums, layout,
                                                                    offsets.expert_start, cols, BR=16, BM=8)
            expect = torch.stack([a[lay["expert_start"][e]:lay["expert_start"][e + 1], first_col:last_col].sum(0)
                                  for e in range(num_experts)])
            torch.testing.assert_close(sums, expect, rtol=1e-5, atol=1e-5)
            if cols == m:
                grads[name] = (out, sums)

    for e in range(num_experts):
        expert = experts[e].double()
        positions = list(range(lay["send_offset"][e], lay["send_offset"][e] + counts[0][e]))
        inputs = tokens[plan.route_order[positions] % num_tokens].double().requires_grad_()
        expert.zero_grad(set_to_none=False)
        expert(inputs).backward(grad_routes[positions].double())
        recv_rows = [lay["dest_row"][e] + i for i in range(counts[0][e])]
        torch.testing.assert_close(grad_rows[recv_rows].double(), inputs.grad, rtol=2e-4, atol=2e-4)
        spec = fused_expert(expert)
        first_rows = slice(0, ffn)
        checks = [(grads["w1"][0][e][first_rows], spec.first.weight), (grads["w2"][0][e], spec.second.weight)]
        if with_bias:
            checks += [(grads["w1"][1][e][first_rows], spec.first.bias), (grads["w2"][1][e], spec.second.bias)]
        if gated:
            checks += [(grads["w1"][0][e][ffn:], spec.gate.weight)]
            if with_bias:
                checks += [(grads["w1"][1][e][ffn:], spec.gate.bias)]
        for got, param in checks:
            torch.testing.assert_close(got.double(), param.grad, rtol=2e-4, atol=2e-4)
        assert len(ModuleFusedExperts([spec]).parameters()) == (3 if gated else 2) * (2 if with_bias else 1)
    print("ok", num_tokens, hidden, ffn, num_experts, top_k, gated, activation, with_bias, "rows", rows, "kept", kept)

check(37, 48, 40, 4, 2, 16, 16, 2, False, "gelu", 1)
check(50, 40, 24, 3, 1, 16, 16, 1, True, "silu", 2)
check(29, 32, 32, 5, 3, 32, 16, 3, False, "gelu_tanh", 3)
check(64, 24, 48, 2, 2, 16, 32, 1, True, "relu", 4)
# GEMM1's epilogue runs on column halves: FFN 40 at 32-column tiles leaves its last tile's left half
# partly valid and its right half empty, FFN 56 the right half partly valid; and experts without biases.
check(37, 48, 40, 4, 2, 16, 32, 2, False, "gelu", 5)
check(45, 40, 56, 3, 2, 16, 32, 1, True, "silu", 6, with_bias=False)
check(30, 32, 24, 2, 1, 16, 16, 1, False, "relu", 7, with_bias=False)
"""


def test_triton_gemms_in_interpreter():
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, repo_root], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert result.stdout.count("ok ") == 7


GIVE_UP_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.support.layout_reference import reference_layout, layout_array
from ds_comet.kernels import constants as C, layout as L
from ds_comet.experts import FeedForward, fused_expert
from ds_comet.pipelines.expert_weights import ModuleFusedExperts
from ds_comet.kernels.launch import PointerTables
from ds_comet.kernels.triton_phases import next_power_of_2, with_descriptor_scratch
from ds_comet.kernels.ops import describe_error_record
from ds_comet.kernels.triton_gemm import ACTIVATION_CODES, gemm1_kernel

hidden, ffn, tile_m, tile_n, num_experts, timeout_ns = 64, 512, 64, 64, 8, 200_000_000
rows_of = [5 + 7 * e for e in range(num_experts)]  # one tile per expert, each waiting for a different count
lay = reference_layout([rows_of], 0, tile_m)
offsets = L.layout_offsets(num_experts, num_experts)
layout = layout_array(lay, {**offsets.__dict__, "layout_total": offsets.total, "total_tiles": C.TOTAL_TILES,
                            "total_kept": C.TOTAL_KEPT, "total_recv_rows": C.TOTAL_RECV_ROWS,
                            "total_pieces": C.TOTAL_PIECES}).cuda()
tiles = lay["totals"]["tiles"]
wanted = {}
for e in range(num_experts):
    for t in range(lay["tile_start"][e + 1] - lay["tile_start"][e]):
        wanted[lay["tile_start"][e] + t] = min(tile_m, rows_of[e] - t * tile_m)
experts = [fused_expert(FeedForward(hidden, ffn).cuda().bfloat16()) for _ in range(num_experts)]
tables = PointerTables().get(ModuleFusedExperts(experts), torch.empty(0, hidden, dtype=torch.bfloat16, device="cuda"))
rows = lay["totals"]["recv_rows"]
recv = torch.zeros((rows + tile_m, hidden), dtype=torch.bfloat16, device="cuda")
h = torch.empty((rows + tile_m, ffn), dtype=torch.bfloat16, device="cuda")
counters = torch.zeros(tiles + 1, dtype=torch.int32, device="cuda")  # no row ever arrives
record = torch.zeros(C.ERROR_RECORD_WORDS, dtype=torch.int64, pin_memory=True)
programs = tiles * (ffn // tile_n)  # every program waits on its first tile, and all give up together
try:
    with_descriptor_scratch(lambda: gemm1_kernel[(programs, )](
        recv, h, h, tables["w1"], tables["w3"], tables["b1"], tables["b3"], layout, counters, record.data_ptr(),
        timeout_ns, 3, hidden, ffn, num_experts, offsets.expert_start, offsets.tile_start, offsets.local_tiles,
        offsets.remote_tiles, offsets.totals + C.TOTAL_TILES, L_POW2=next_power_of_2(num_experts + 1), BM=tile_m,
        BN=tile_n, BK=64, GROUP_M=8, NUM_PROGS=programs, HAS_BIAS=True, GATED=False,
        ACTIVATION=ACTIVATION_CODES["gelu"], BACKWARD=False, ACTIVATE=True, STORE_PRE=False, WAIT=True,
        INTERPRET=False,
        num_warps=4, num_stages=3))
    torch.cuda.synchronize()
    trapped = False
except RuntimeError:
    trapped = True
print(json.dumps(dict(trapped=trapped, record=record.tolist(), wanted=wanted, tiles=tiles, timeout_ns=timeout_ns,
                      message=describe_error_record(record))))
"""


def test_a_gemm1_wait_that_gives_up_fills_the_error_record_from_one_wait(tmp_path):
    """Every GEMM1 program waits for rows that never come and gives up at about the same time: the
    record must describe one of those waits (its tile and that tile's row count), not a mix."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import json

    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    env.pop("TRITON_INTERPRET", None)
    # The kernel traps, which ends the CUDA context: its own process.
    result = subprocess.run(
        [sys.executable, "-c", GIVE_UP_SCRIPT, repo_root], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    from ds_comet.kernels import constants as C

    record = out["record"]
    flag, rank, kind, index = (
        record[C.ERROR_FILLED],
        record[C.ERROR_RANK],
        record[C.ERROR_KIND],
        record[C.ERROR_INDEX],
    )
    target, seen, waited = record[C.ERROR_TARGET], record[C.ERROR_OBSERVED], record[C.ERROR_WAITED_NS]
    assert out["trapped"] and flag == 1, out
    assert (rank, kind, seen) == (3, 2, 0), out  # rank as launched, WAIT_DISPATCH_TILE, nothing arrived
    assert 0 <= index < out["tiles"] and target == out["wanted"][str(index)], out
    assert waited >= out["timeout_ns"], out
    assert f"GEMM1 row tile {index} to reach {target} but saw 0" in out["message"], out


def test_the_gemm_error_claim_is_the_layouts():
    from ds_comet.kernels import constants
    from ds_comet.kernels.triton_gemm import ERROR_CLAIM_AFTER_TILES, ERROR_RECORD_WAIT_NS, WAIT_DISPATCH_TILE

    assert ERROR_CLAIM_AFTER_TILES == constants.TOTAL_ERROR_CLAIM - constants.TOTAL_TILES
    assert constants.TOTAL_ERROR_CLAIM < constants.TOTALS_WORDS
    assert ERROR_RECORD_WAIT_NS.value == constants.ERROR_RECORD_WAIT_NS
    assert WAIT_DISPATCH_TILE.value == constants.WAIT_DISPATCH_TILE


ELEMENTWISE_SCRIPT = r"""
import sys
from types import SimpleNamespace
import torch
sys.path.insert(0, sys.argv[1])
from ds_comet.kernels import constants as C
from ds_comet.kernels.launch import FusedKernels

ACT = {"gelu": torch.nn.functional.gelu, "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
       "relu": torch.relu, "silu": torch.nn.functional.silu}

def kernels_for(ffn, gated, activation, received):
    layout = torch.zeros(C.TOTALS_WORDS, dtype=torch.int32)
    layout[C.TOTAL_RECV_ROWS] = received
    buffer = SimpleNamespace(layout=layout, layout_offsets=SimpleNamespace(totals=0))
    experts = SimpleNamespace(ffn=ffn, gated=gated, activation=activation)
    return FusedKernels(buffer=buffer, experts=experts, params=None, tables={}, hidden=8)

def check(rows, received, ffn, gated, activation, form, seed):
    g = torch.Generator().manual_seed(seed)
    kernels = kernels_for(ffn, gated, activation, received)
    z, u = torch.randn(rows, ffn, generator=g) * 2, torch.randn(rows, ffn, generator=g)
    # The products in each form the pipeline passes: a gated expert's [R, 2F] from GEMM1 or the
    # library's (z, u) pair; an ungated expert's [R, F].
    if not gated:
        pre = z.clone()
    elif form == "pair":
        pre = (z.clone(), u.clone())
    else:
        pre = torch.cat([z, u], dim=1)
    expect_h = ACT[activation](z.double()) * (u.double() if gated else 1)
    h = torch.full((rows, ffn), float("nan"))
    kernels.activations(pre, h)
    torch.testing.assert_close(h[:received].double(), expect_h[:received], rtol=1e-5, atol=1e-5)
    assert h[received:].isnan().all()  # rows past the call's are not touched

    grad_h = torch.randn(rows, ffn, generator=g)
    zd, ud = z.double().requires_grad_(), u.double().requires_grad_()
    (ACT[activation](zd) * (ud if gated else 1)).backward(grad_h.double())
    expect_pre = torch.cat([zd.grad, ud.grad], dim=1) if gated else zd.grad
    grad_pre = torch.full((rows, ffn * (2 if gated else 1)), float("nan"))
    g_then_act = grad_h.clone()
    act = kernels.activations_backward(g_then_act, pre, grad_pre, True)
    assert act.data_ptr() == g_then_act.data_ptr()  # the activations are stored over g
    torch.testing.assert_close(grad_pre[:received].double(), expect_pre[:received], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(act[:received].double(), expect_h[:received], rtol=1e-5, atol=1e-5)
    assert grad_pre[received:].isnan().all() and torch.equal(act[received:], grad_h[received:])
    # Without the activations, g is only read.
    again = torch.full_like(grad_pre, float("nan"))
    g = grad_h.clone()
    assert kernels.activations_backward(g, pre, again, False) is None
    torch.testing.assert_close(again[:received], grad_pre[:received], rtol=0, atol=0)
    assert torch.equal(g, grad_h)
    if not gated:  # eval's in-place step: the products become the activations
        kernels.activations(pre, pre)
        torch.testing.assert_close(pre[:received], h[:received], rtol=0, atol=0)
    print("ok", rows, received, ffn, gated, activation, form)

check(70, 61, 40, True, "silu", "side by side", 1)
check(45, 45, 136, True, "gelu", "pair", 2)
check(33, 20, 24, False, "gelu_tanh", "-", 3)
check(50, 37, 130, False, "relu", "-", 4)
"""


def test_the_first_layers_elementwise_steps_in_interpreter():
    """``FusedKernels.activations`` and ``activations_backward`` on every form of the products the
    pipeline passes (a gated expert's [R, 2F], the library's pair, an ungated expert's [R, F]),
    against float64 autograd, stopping at the call's received rows."""
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", ELEMENTWISE_SCRIPT, repo_root], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert result.stdout.count("ok ") == 4
