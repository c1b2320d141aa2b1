"""Experiment: the batched CUTLASS backward GEMM1 with a TMA epilogue (equal expert groups) against
torch._grouped_mm on the same groups, and its distance from float64. One GPU:
    python run_batched.py libbatched.so"""
import ctypes
import json
import sys

import torch

from ds_comet.bench.gemm import per_call_ms

lib = ctypes.CDLL(sys.argv[1])
lib.batched_workspace_bytes.restype = ctypes.c_size_t
lib.batched_workspace_bytes.argtypes = [ctypes.c_int] * 5
lib.batched_bwd_gemm1_gated.restype = ctypes.c_int
lib.batched_bwd_gemm1_gated.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5 + [ctypes.c_void_p] * 2
SHAPES = {"mixtral": (4096, 14336, 8, 2048), "qwen3": (2048, 768, 128, 512), "gpt-oss": (2880, 2880, 32, 1024)}
device = torch.device("cuda", 0)
sms = torch.cuda.get_device_properties(device).multi_processor_count
for name, (hidden, ffn, experts, m) in SHAPES.items():
    torch.manual_seed(0)
    rows = experts * m
    dy = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, ffn, device=device) / ffn**0.5).to(torch.bfloat16)
    pre = torch.randn(rows, 2 * ffn, device=device).to(torch.bfloat16)
    out = torch.zeros(rows, 2 * ffn, device=device, dtype=torch.bfloat16)
    act = torch.zeros(rows, ffn, device=device, dtype=torch.bfloat16)
    workspace = torch.empty(max(1, lib.batched_workspace_bytes(m, ffn, hidden, experts, sms)), dtype=torch.uint8,
                            device=device)
    stream = torch.cuda.current_stream().cuda_stream

    def ours():
        rc = lib.batched_bwd_gemm1_gated(dy.data_ptr(), w2.data_ptr(), pre.data_ptr(), out.data_ptr(), act.data_ptr(),
                                         m, ffn, hidden, experts, sms, workspace.data_ptr(), stream)
        assert rc == 0, rc

    offs = (torch.arange(1, experts + 1, device=device) * m).to(torch.int32)

    def library():
        torch._grouped_mm(dy, w2, offs=offs)

    ours()
    torch.cuda.synchronize()
    worst = 0.0
    for e in (0, experts // 2, experts - 1):
        a, b = e * m, (e + 1) * m
        g = dy[a:b].double() @ w2[e].double()
        z, u = pre[a:b, :ffn].double(), pre[a:b, ffn:].double()
        s = torch.sigmoid(z)
        ref = torch.cat([g * u * s * (1 + z * (1 - s)), g * z * s], dim=1)
        worst = max(worst, ((out[a:b].double() - ref).abs().max() / ref.abs().max()).item(),
                    ((act[a:b].double() - z * s * u).abs().max() / (z * s * u).abs().max()).item())
    flops = 2 * rows * hidden * ffn
    library_ms, ours_ms = per_call_ms(library, 200, 400), per_call_ms(ours, 200, 400)
    print(name, json.dumps({"grouped_mm_tflops": round(flops / library_ms / 1e9, 1),
                            "ours_tflops": round(flops / ours_ms / 1e9, 1),
                            "ours_over_grouped_mm": round(library_ms / ours_ms, 3), "rel_err_vs_f64": worst}),
          flush=True)
