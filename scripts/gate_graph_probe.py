#!/usr/bin/env python3
"""How much of the gate's time is host launches: ``gate_routes`` eager against replayed as a CUDA graph.

    python3 scripts/gate_graph_probe.py [--iters N]

One GPU, no communication. For each default shape: DeepSpeed's TopKGate in bf16 (as the bench's
layers are), the fused path's gate kernels, T tokens.
- eval, no_grad (what the bench's forward runs): eager from an idle device, and one
  ``torch.cuda.CUDAGraph`` of the same call replayed; outputs compared bit for bit.
- training (noise as configured, gradients): eager forward and forward+backward, and
  ``torch.cuda.make_graphed_callables`` of the same routing replayed; outputs, the tokens' and the
  gate weight's gradients compared bit for bit after reseeding both.
- both again through ``ds_comet.gate_graph.GateGraphs`` (what ``"cuda_graph_gate"`` runs).
Times are medians of CUDA-event timings, the device synchronised before each call (as the bench).

    python3 scripts/gate_graph_probe.py --memory-layers N

instead measures memory: N layers' gates (bf16, training), each with its own ``GateGraphs``; a
training step through all N (forwards in order, one backward), eager and graphed. Prints what
the graphs keep allocated and reserved between steps, and each step's peak above the inputs.
"""

import argparse
import os
import sys

import torch
from deepspeed.moe.sharded_moe import TopKGate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds_comet.bench import timed  # noqa: E402
from ds_comet.gate import gate_routes  # noqa: E402
from ds_comet.gate_graph import GateGraphs  # noqa: E402
from ds_comet.ops import load_op  # noqa: E402
from ds_comet.shapes import SHAPES  # noqa: E402


class Routes(torch.nn.Module):
    """gate_routes as a module (make_graphed_callables collects the gate's parameters from it)."""

    def __init__(self, gate, op):
        super().__init__()
        self.gate, self.op = gate, op

    def forward(self, tokens):
        l_aux, _, indices, gates, counts = gate_routes(self.gate, tokens, None, self.op)
        return l_aux, indices, gates, counts


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


MIB = 2.0**20


def memory(name, shape, num_layers, op):
    """Eager and graphed training steps through num_layers gates: what the graphs keep, and peaks."""
    H, F, E, k, T = shape
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gates = [TopKGate(H, E, k, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
                      top2_2nd_expert_sampling=True).to(dev, torch.bfloat16) for _ in range(num_layers)]
    inputs = [torch.randn(T, H, device=dev).to(torch.bfloat16).requires_grad_() for _ in gates]
    weights = torch.randn(k, T, device=dev)
    graphs = [GateGraphs() for _ in gates]

    def step(routes_of):
        loss = 0
        for i, (gate, x) in enumerate(zip(gates, inputs)):
            l_aux, _, _, g, _ = routes_of(i)(gate, x)
            loss = loss + l_aux + (g * weights).sum()
        loss.backward()
        for gate, x in zip(gates, inputs):
            x.grad = gate.wg.weight.grad = None

    def peak(routes_of):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(routes_of)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MIB

    eager = lambda i: lambda gate, x: gate_routes(gate, x, None, op)
    graphed = lambda i: lambda gate, x: graphs[i].routes(gate, x, None, op)
    step(eager)
    eager_peak = peak(eager)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    step(graphed)  # captures
    torch.cuda.synchronize()
    kept = (torch.cuda.memory_allocated() - allocated) / MIB
    kept_reserved = (torch.cuda.memory_reserved() - reserved) / MIB
    graphed_peak = peak(graphed)
    print(f"{name} | {num_layers} layers, training step: eager peak {eager_peak:.0f} MiB above the inputs | "
          f"graphs keep {kept:.0f} MiB allocated, {kept_reserved:.0f} MiB reserved "
          f"({kept / num_layers:.0f} / {kept_reserved / num_layers:.0f} per layer) | graphed step peak "
          f"{graphed_peak:.0f} MiB above the inputs and the graphs (with them {kept + graphed_peak:.0f})", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--memory-layers", type=int, default=0)
    args = parser.parse_args()
    op = load_op()
    if args.memory_layers:
        for name, shape in SHAPES.items():
            memory(name, shape, args.memory_layers, op)
        return
    dev = torch.device("cuda")
    for name, (H, F, E, k, T) in SHAPES.items():
        torch.manual_seed(0)
        gate = TopKGate(H, E, k, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
                        top2_2nd_expert_sampling=True).to(dev, torch.bfloat16)
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        line = [name]

        gate.eval()
        with torch.no_grad():
            eager = timed(lambda: gate_routes(gate, x, None, op), args.iters, 3)
            static_x = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture, as torch's docs ask
                for _ in range(3):
                    gate_routes(gate, static_x, None, op)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = gate_routes(gate, static_x, None, op)
            replay = timed(graph.replay, args.iters, 3)
            want = gate_routes(gate, x, None, op)
            graph.replay()
            ok = same([want[0], want[2], want[3], want[4]], [static_out[0], static_out[2], static_out[3],
                                                             static_out[4]])
        graphs = GateGraphs()
        with torch.no_grad():
            ours = timed(lambda: graphs.routes(gate, x, None, op), args.iters, 3)
        line.append(f"eval: eager {eager:.3f} ms, graph {replay:.3f} ms, GateGraphs {ours:.3f} ms, equal {ok}")

        gate.train()
        xg = x.clone().requires_grad_(True)
        grad_gates = torch.randn(k, T, device=dev)

        def step(fn):
            l_aux, _, gates_, _ = fn(xg)
            (l_aux + (gates_ * grad_gates).sum()).backward()

        routes = Routes(gate, op)
        eager_fwd = timed(lambda: routes(xg), args.iters, 3)
        eager_step = timed(lambda: step(routes), args.iters, 3)
        graphed = torch.cuda.make_graphed_callables(Routes(gate, op), (xg.detach().clone().requires_grad_(True), ))
        graph_fwd = timed(lambda: graphed(xg), args.iters, 3)
        graph_step = timed(lambda: step(graphed), args.iters, 3)
        results = []
        for fn in (routes, graphed):
            xg.grad, gate.wg.weight.grad = None, None
            torch.manual_seed(7)
            out = fn(xg)
            (out[0] + (out[2] * grad_gates).sum()).backward()
            results.append([o.detach().clone() for o in out] + [xg.grad.clone(), gate.wg.weight.grad.clone()])
        ours = Routes(gate, op)
        ours.forward = lambda tokens: (lambda r: (r[0], r[2], r[3], r[4]))(graphs.routes(gate, tokens, None, op))
        ours_fwd = timed(lambda: ours(xg), args.iters, 3)
        ours_step = timed(lambda: step(ours), args.iters, 3)
        xg.grad, gate.wg.weight.grad = None, None
        torch.manual_seed(7)
        out = ours(xg)
        (out[0] + (out[2] * grad_gates).sum()).backward()
        results.append([o.detach().clone() for o in out] + [xg.grad.clone(), gate.wg.weight.grad.clone()])
        ok = same(results[0], results[1]) and same(results[0], results[2])
        line.append(f"train: eager fwd {eager_fwd:.3f} / step {eager_step:.3f} ms, graphed fwd {graph_fwd:.3f} / "
                    f"step {graph_step:.3f} ms, GateGraphs fwd {ours_fwd:.3f} / step {ours_step:.3f} ms, equal {ok}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
