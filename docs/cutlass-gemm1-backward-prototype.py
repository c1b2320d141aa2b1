"""Prototype check: CUTLASS gated backward GEMM1 against the Triton one and torch._grouped_mm (EP=1)."""
import ctypes
import dataclasses
import json
import os
import sys

import deepspeed
import torch

from ds_comet.bench.gemm import fused_layer, per_call_ms, phase_calls, routes

LIBS = {}
for path in sys.argv[1:]:
    lib = ctypes.CDLL(path)
    lib.proto_scratch_bytes.restype = ctypes.c_size_t
    lib.proto_scratch_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.proto_bwd_gemm1_gated.restype = ctypes.c_int
    lib.proto_bwd_gemm1_gated.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_size_t,
                                                                                       ctypes.c_void_p]
    LIBS[os.path.basename(path)[3:-3]] = lib
SHAPES = {"mixtral": (4096, 14336, 8, 2, 8192), "qwen3": (2048, 768, 128, 8, 8192), "gpt-oss": (2880, 2880, 32, 4, 8192)}


def main():
    deepspeed.init_distributed()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    results = {}
    for name, (hidden, ffn, experts, k, tokens) in SHAPES.items():
        layer = fused_layer(hidden, ffn, experts, k, tokens, True, device)
        x0 = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
        with torch.no_grad():
            layer.eval()(x0[None])
        pipeline = layer.deepspeed_moe.pipelines.fused
        for routing, skew in (("balanced", 0.0), ("skewed", 0.7)):
            calls, counts = phase_calls(pipeline, x0, routes(tokens, experts, k, skew, device), experts)
            kernels = pipeline.kernels(x0)
            lo = pipeline.workspace.layout_offsets
            starts = pipeline.workspace.layout[lo.expert_start:lo.expert_start + experts + 1].clone()
            rows = int(starts[-1])
            torch.manual_seed(3)
            x = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
            pre = torch.randn(rows, 2 * ffn, device=device).to(torch.bfloat16)
            w2 = (torch.randn(experts, hidden, ffn, device=device) / ffn**0.5).to(torch.bfloat16)
            table = torch.tensor([w2[e].data_ptr() for e in range(experts)], dtype=torch.int64, device=device)
            ours = dataclasses.replace(kernels, tables={**kernels.tables, "w2": table})
            out_t = torch.zeros(rows, 2 * ffn, device=device, dtype=torch.bfloat16)
            act_t = torch.zeros(rows, ffn, device=device, dtype=torch.bfloat16)
            stream = torch.cuda.current_stream().cuda_stream

            def triton():
                ours.gemm1(x, out_t, pre, backward=True, store_pre=False, act=act_t)

            def cutlass_call(lib, out_c, act_c, scratch):
                def call():
                    rc = lib.proto_bwd_gemm1_gated(x.data_ptr(), table.data_ptr(), pre.data_ptr(), out_c.data_ptr(),
                                                   act_c.data_ptr(), starts.data_ptr(), experts, ffn, hidden, sms,
                                                   scratch.data_ptr(), scratch.numel(), stream)
                    assert rc == 0, rc
                return call
            variants = {}
            for label, lib in LIBS.items():
                out_c, act_c = torch.zeros_like(out_t), torch.zeros_like(act_t)
                scratch = torch.empty(lib.proto_scratch_bytes(experts, sms), dtype=torch.uint8, device=device)
                variants[label] = (cutlass_call(lib, out_c, act_c, scratch), out_c, act_c)

            offs = starts[1:].contiguous()

            def library():
                torch._grouped_mm(x, w2, offs=offs)

            triton()
            for call, _, _ in variants.values():
                call()
            torch.cuda.synchronize()
            # float64 reference on three experts (first non-empty, largest, last non-empty)
            errs = {}
            nonempty = [e for e in range(experts) if int(starts[e + 1]) > int(starts[e])]
            for e in sorted({nonempty[0], nonempty[-1], max(nonempty, key=lambda e: int(starts[e + 1] - starts[e]))}):
                a, b = int(starts[e]), int(starts[e + 1])
                g = x[a:b].double() @ w2[e].double()
                z, u = pre[a:b, :ffn].double(), pre[a:b, ffn:].double()
                s = torch.sigmoid(z)
                act = z * s
                ref = torch.cat([g * u * s * (1 + z * (1 - s)), g * act], dim=1)
                for label, (o, h) in [("triton", (out_t, act_t))] + [(k, (v[1], v[2])) for k, v in variants.items()]:
                    scale = ref.abs().max().item()
                    err = max((o[a:b].double() - ref).abs().max().item() / scale,
                              (h[a:b].double() - act * u).abs().max().item() / (act * u).abs().max().item())
                    errs[label] = max(errs.get(label, 0.0), err)
            flops = 2 * rows * hidden * ffn
            l_ms = per_call_ms(library, 200, 400)
            t_ms = per_call_ms(triton, 200, 400)
            r = {"rows": rows, "grouped_mm_tflops": round(flops / l_ms / 1e9, 1),
                 "triton_over_grouped_mm": round(l_ms / t_ms, 3), "rel_err_vs_f64": errs}
            for label, (call, out_c, _) in variants.items():
                r[label + "_over_grouped_mm"] = round(l_ms / per_call_ms(call, 200, 400), 3)
                r[label + "_vs_triton"] = (out_c.float() - out_t.float()).abs().max().item() / out_t.float().abs().max().item()
            results[f"{name}/{routing}"] = r
            print(name, routing, json.dumps(r), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "proto.json"), "w") as f:
        json.dump(results, f, indent=1)


main()
