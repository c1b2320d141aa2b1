"""The fused pipeline's Triton GEMMs under Triton's CPU interpreter, against plain torch.

One rank (P=1): the test lays out the receive buffer as the exchange and dispatch kernels would
(tests/layout_reference.py), marks every row tile as arrived, runs GEMM1 then GEMM2, and checks
every kept route's returned row and every chunk counter. This covers the tile schedule (own-row
tiles first, then the rest), the expert search, the swizzle, the column chunks and the origin
decoding without a GPU. Skipped where triton is not installed (it is an extra).
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
from layout_reference import reference_layout, layout_array
from ds_comet import layout as L
from ds_comet.experts import FeedForward, GatedFeedForward, fused_expert
from ds_comet.fused import ExpertTables, next_power_of_2
from ds_comet.routing import plan_routes
from ds_comet.triton_gemm import ACTIVATION_CODES, gemm1_kernel, gemm2_kernel

def check(num_tokens, hidden, ffn, num_experts, top_k, tile_m, tile_n, chunk_tiles, gated, activation, seed):
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
    layout = layout_array(lay, {**offsets.__dict__, "layout_total": offsets.total, "total_tiles": L.TOTAL_TILES,
                                "total_kept": L.TOTAL_KEPT, "total_recv_rows": L.TOTAL_RECV_ROWS,
                                "total_pieces": L.TOTAL_PIECES})
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
    experts = [(GatedFeedForward(hidden, ffn, activation, bias=True) if gated else FeedForward(hidden, ffn, activation))
               for _ in range(num_experts)]
    specs = [fused_expert(e) for e in experts]
    tables = ExpertTables().get(specs, torch.device("cpu"))
    h = torch.full((rows + tile_m, ffn), float("nan"))
    ret = torch.full((max(kept, 1), hidden), float("nan"))
    chunk_counters = torch.zeros(64, dtype=torch.int32)
    ret_table = torch.tensor([ret.data_ptr()], dtype=torch.int64)
    chunk_table = torch.tensor([chunk_counters.data_ptr()], dtype=torch.int64)
    error = torch.zeros(8, dtype=torch.int64)
    l_pow2 = next_power_of_2(num_experts + 1)
    gemm1_kernel[(3, )](recv, h, tables["w1"], tables["b1"], tables["w3"], tables["b3"], layout, counters,
                        error.data_ptr(), 10**9, 0, hidden, ffn, num_experts, offsets.expert_start, offsets.tile_start,
                        offsets.local_tiles, offsets.remote_tiles, offsets.totals + L.TOTAL_TILES, L_POW2=l_pow2,
                        BM=tile_m, BN=tile_n, BK=16, GROUP_M=2, NUM_PROGS=3, HAS_BIAS=True, GATED=gated,
                        ACTIVATION=ACTIVATION_CODES[activation], WAIT=True, INTERPRET=True)
    gemm2_kernel[(3, )](h, tables["w2"], tables["b2"], origin, ret_table, chunk_table, layout, hidden, ffn,
                        num_experts, offsets.expert_start, offsets.tile_start, offsets.totals + L.TOTAL_TILES,
                        EP_SIZE=1, L_POW2=l_pow2, BM=tile_m, BN=tile_n, BK=16, GROUP_M=2, CHUNK_TILES=chunk_tiles,
                        NUM_PROGS=3, HAS_BIAS=True)
    with torch.no_grad():
        for e in range(num_experts):
            for i in range(counts[0][e]):
                pos = lay["send_offset"][e] + i
                expected = experts[e](tokens[plan.route_order[pos] % num_tokens].double().float())
                torch.testing.assert_close(ret[pos], expected, rtol=2e-4, atol=2e-4)
    n_tiles = -(-hidden // tile_n)
    for c in range(-(-n_tiles // chunk_tiles)):
        tiles = min(chunk_tiles, n_tiles - c * chunk_tiles)
        assert chunk_counters[c].item() == kept * tiles, (c, chunk_counters[c].item(), kept * tiles)
    assert error[0].item() == 0
    print("ok", num_tokens, hidden, ffn, num_experts, top_k, gated, activation, "rows", rows, "kept", kept)

check(37, 48, 40, 4, 2, 16, 16, 2, False, "gelu", 1)
check(50, 40, 24, 3, 1, 16, 16, 1, True, "silu", 2)
check(29, 32, 32, 5, 3, 32, 16, 3, False, "gelu_tanh", 3)
check(64, 24, 48, 2, 2, 16, 32, 1, True, "relu", 4)
"""


def test_triton_gemms_in_interpreter():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT, tests_dir], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert result.stdout.count("ok ") == 4
