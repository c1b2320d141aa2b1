"""Benchmark one MoE layer, forward and forward+backward: stock DeepSpeed, the reference and the fused pipeline.

    torchrun --nproc_per_node 2 -m ds_comet.bench [--shape NAME ...] [--custom H,F,E,K,T ...] [--out DIR]
                                                  [--no-backward] [--cuda-graph-gate]
                                                  [--fp8 [rowwise] [--fp8-requantise]]

Every number comes from one run on the same GPUs and inputs: the three layers (same weights), the
gate alone (stock's call and the comet layer's ``gate_routes``), the routing plan, the fused
pipeline's GEMM1, GEMM2, combine and dispatch relaunched alone (the last two on every SM, and
"_comm" on the communication blocks only), the expert GEMMs alone on the rows each rank actually
receives (cuBLAS: the compute bound) and the two all-to-alls alone with the same splits (NCCL: the
communication bound). Each time is the median of CUDA-event timings of many calls, the ranks lined
up before each call.

On the SwiGLU shapes (and every shape with --gated) it also times DeepSpeed AutoEP's layer on a
Hugging Face block of the same sizes (``torch._grouped_mm`` experts, its NCCL ``comm`` exchange)
beside that same block on ds_comet ("autoep_comet"), with the same weights; --no-autoep skips them.

With --fp8 the comet layer also runs the blockwise ``"fp8"`` recipe on the fused pipeline, its four
GEMM phases in FP8 and the same weights, twice: as a user gets it by default, the forward's rows
crossing the exchange as packed FP8 rows ("fused_fp8"), and with ``"dispatch": "bf16"``
("fused_fp8_bf16_dispatch"); on the SwiGLU shapes AutoEP's block on ds_comet runs the default
recipe ("autoep_comet_fp8") and, alone in the group, the rowwise recipe whose GEMMs run on
``torch._scaled_grouped_mm`` ("autoep_comet_fp8_rowwise": rows crossing in bf16), also with its
weight gradients in FP8 ("autoep_comet_fp8_rowwise_wgrad": ``"weight_gradients": true``).
Each is timed against the bf16 comet layer and against AutoEP (bf16).
A shape a recipe cannot scale (blockwise: gpt-oss's H2880 is no multiple of 128) gets none of its rows; rank 0
prints the recipe's refusal instead. The FP8 layers' weights are quantised once and cached, as
between two optimizer steps; with --fp8-requantise each of their training steps quantises them
again first, as a step of one micro-batch after an optimizer step does.

Unless --no-backward, each pipeline also runs training steps (forward, then backward of the output
against a fixed random gradient plus the aux loss; grads set to None at the start of each step),
timed the same way, with the peak memory one step allocates above what was allocated before it.
The fused layer runs them on the fused backward. Their bounds: the expert FFNs
alone, forward and backward (cuBLAS, autograd), and four all-to-alls (two forward, two backward).
Rank 0 prints the tables of times and ratios and writes bench.json and bench.png under --out.
"""

import argparse
import functools
import json
import os

import deepspeed
import torch
from deepspeed import comm as dist

from ds_comet.bench import autoep
from ds_comet.bench.common import (
    autoep_step,
    build,
    comet_layer,
    expert_ffn,
    expert_template,
    grouped_ffn,
    moe_kwargs,
    peak_mib,
    run_shapes,
    timed,
    train_step,
)
from ds_comet.bench.sent_bytes import exchange_mb
from ds_comet.bench.shapes import SHAPES, SWIGLU, selected_shapes
from ds_comet.integrations.legacy.gate import gate_routes
from ds_comet.kernels.fp8_weights import weights_changed
from ds_comet.kernels.gemm_phases import Phase
from ds_comet.kernels.routing_plan import RoutingPlan, plan_routes_cuda
from ds_comet.pipelines.exchange_header import NO_HEADER
from ds_comet.pipelines.fused import FusedPipeline

PIPELINES = ("stock", "reference", "fused")
AUTOEP_PIPELINES = (
    "autoep",
    "autoep_comet",
    "autoep_comet_fp8",
    "autoep_comet_fp8_rowwise",
    "autoep_comet_fp8_rowwise_wgrad",
)
# The blockwise recipes the fused FP8 layers are timed under: the default (the forward's rows cross the
# exchange as packed FP8 rows), and the same GEMMs with the rows crossing in bf16.
FP8_RECIPES = {"fused_fp8": {"enabled": True}, "fused_fp8_bf16_dispatch": {"enabled": True, "dispatch": "bf16"}}
# Every FP8 layer the bench builds (fp8_layers).
FP8_PIPELINES = {*FP8_RECIPES, "autoep_comet_fp8", "autoep_comet_fp8_rowwise", "autoep_comet_fp8_rowwise_wgrad"}
# The rowwise recipes that the "library_fp8" GEMMs run (all four FP8 phases, alone in the group), with the
# weight gradients in high precision and in FP8.
ROWWISE_LIBRARY_RECIPE = {"enabled": True, "scaling": "rowwise", "dispatch": "bf16"}
ROWWISE_WGRAD_RECIPE = {**ROWWISE_LIBRARY_RECIPE, "weight_gradients": True}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="a default shape (repeatable)")
    parser.add_argument("--custom", action="append", default=[], help="H,F,E,K,T (T = tokens per rank)")
    parser.add_argument("--gated", action="store_true", help="SwiGLU experts instead of GELU FFNs")
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--comm-blocks", type=int, default=None)
    parser.add_argument("--combine-blocks", type=int, default=None)
    parser.add_argument("--n-chunks", type=int, default=None)
    parser.add_argument(
        "--activation-rows",
        choices=("bound", "received"),
        default=None,
        help='how the comet layers size their activations ("moe": {"activation_rows"})',
    )
    parser.add_argument(
        "--cuda-graph-gate", action="store_true", help="the comet layers replay the gate from CUDA graphs"
    )
    parser.add_argument(
        "--no-autoep", dest="autoep", action="store_false", help="skip DeepSpeed AutoEP's layer and ds_comet on it"
    )
    parser.add_argument(
        "--no-backward",
        dest="backward",
        action="store_false",
        help="time the forward only (skip the training steps and their bounds)",
    )
    parser.add_argument(
        "--fp8",
        nargs="?",
        const="all",
        choices=("all", "rowwise"),
        help='also the comet layers under the "fp8" recipes, against the bf16 comet layer and AutoEP; '
        '"rowwise": only AutoEP\'s block under the rowwise recipes',
    )
    parser.add_argument(
        "--fp8-requantise",
        action="store_true",
        help="with --fp8, each FP8 layer's training step quantises its weights again first, as after an "
        "optimizer step (one micro-batch a step); without it the weights' FP8 copies stay cached",
    )
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser.parse_args()


def fused_phases(pipeline: FusedPipeline, tokens, plan: RoutingPlan, gates):
    """Callables that relaunch the fused forward's GEMM1, GEMM2, combine and dispatch alone (the last
    two on every SM, and "_comm" on the communication blocks only), after one whole forward.

    Tiles and chunks stay counted from that forward, so each part relaunched alone measures its
    own rate. Every rank's relaunches must be done before any rank's next exchange zeroes its
    counters (a late dispatch would count rows of the old call): ``timed`` lines the ranks up.
    """
    rows = pipeline.row_bounds[False]
    out = pipeline.run_forward(tokens, plan, gates, rows, NO_HEADER)
    kernels = pipeline.kernels(tokens)
    workspace, params = pipeline.workspace, pipeline.params
    rows = min(rows, workspace.shape.max_recv_rows)
    h = torch.empty((rows, kernels.ffn), dtype=kernels.stored_dtype(Phase.FIRST_LAYER), device=tokens.device)
    expert_out = torch.empty((rows, tokens.shape[1]), dtype=kernels.stored_dtype(Phase.GEMM2), device=tokens.device)
    kernels.first_layer(workspace.recv, h, keep_pre=False)
    kernels.gemm2(h, expert_out, backward=False)

    def combine(blocks):
        kernels.reset_combine_claims()
        kernels.reduce(plan, expert_out, gates, out, None, blocks)

    def dispatch(blocks):  # the same rows to the same places; the tile counts only grow
        kernels.send(tokens, plan, gates, False, None, blocks)

    return dict(
        gemm1=lambda: kernels.first_layer(workspace.recv, h, keep_pre=False),
        gemm2=lambda: kernels.gemm2(h, expert_out, backward=False),
        combine=lambda: combine(workspace.num_sms),
        combine_comm=lambda: combine(params.combine_blocks),
        dispatch=lambda: dispatch(workspace.num_sms),
        dispatch_comm=lambda: dispatch(params.comm_blocks),
    )


def bench_fwd_bwd(layers, x, modules, inputs, args):
    """Training-step times and peak MiB of every pipeline, and the expert FFNs alone, fwd+bwd."""
    results = {}
    x = x.detach().clone().requires_grad_()
    dy = torch.randn_like(x)
    for pipeline in layers:
        layer = layers[pipeline].train()
        step_of = autoep_step if pipeline in AUTOEP_PIPELINES else train_step
        requantise = args.fp8_requantise and pipeline in FP8_PIPELINES

        def step():
            if requantise:
                weights_changed()  # as an optimizer step would: the next call quantises the weights again
            return step_of(layer, x, dy)

        results[f"{pipeline}_fwd_bwd"] = timed(step, args.iters, args.warmup)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        results[f"{pipeline}_peak_mib"] = peak_mib(step)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer.eval()

    rows = [r.detach().clone().requires_grad_() for r in inputs]
    dys = [torch.randn_like(r) for r in rows]

    def experts_step():
        for module, r in zip(modules, rows):
            module.zero_grad(set_to_none=True)
            r.grad = None
        torch.autograd.backward([expert_ffn(m, r) for m, r in zip(modules, rows)], dys)

    results["experts_loop_fwd_bwd"] = timed(experts_step, args.iters, args.warmup)
    results["experts_fwd_bwd"] = results["experts_loop_fwd_bwd"]
    for module in modules:
        module.zero_grad(set_to_none=True)
    grouped = grouped_ffn(modules, inputs, train=True)
    if grouped is not None:
        results["experts_grouped_fwd_bwd"] = timed(grouped, args.iters, args.warmup)
        results["experts_fwd_bwd"] = min(results["experts_fwd_bwd"], results["experts_grouped_fwd_bwd"])
    return results


def layer_overrides(args):
    """The ``"moe"`` keys the command line sets for the comet layers."""
    return {
        key: value
        for key, value in (
            ("comm_blocks", args.comm_blocks),
            ("combine_blocks", args.combine_blocks),
            ("n_chunks", args.n_chunks),
            ("cuda_graph_gate", args.cuda_graph_gate or None),
            ("activation_rows", args.activation_rows),
        )
        if value is not None
    }


def build_layers(name, hidden, ffn, experts, k, ep_size, device, args):
    """{pipeline: layer} of one shape: stock's, the reference and the fused layer (same weights), and
    on gated shapes AutoEP's block and that block on ds_comet, where AutoEP runs here."""
    overrides = layer_overrides(args)
    gated = args.gated or name in SWIGLU
    layers = build(hidden, ffn, experts, k, ep_size, gated, args.capacity_factor, overrides)
    if args.autoep and gated:
        reason = autoep.unavailable_reason()
        if reason is None:
            family = SWIGLU.get(name, "mixtral")
            section = {"backend": "comet", "overlap": "fused", **overrides}
            layers["autoep"] = autoep.autoep_layer(family, hidden, ffn, experts, k, ep_size, device, torch.bfloat16, 0)
            layers["autoep_comet"] = autoep.autoep_layer(
                family, hidden, ffn, experts, k, ep_size, device, torch.bfloat16, 0, section
            )
        elif dist.get_rank() == 0:
            print(f"{name}: no AutoEP rows: {reason}", flush=True)
    if args.fp8:
        layers.update(fp8_layers(name, hidden, ffn, experts, k, ep_size, gated, layers, device, args))
    return layers


def fp8_layers(name, hidden, ffn, experts, k, ep_size, gated, layers, device, args):
    """With --fp8: the fused comet layer under each of ``FP8_RECIPES`` with the stock layer's weights
    ("fused_fp8", "fused_fp8_bf16_dispatch") and, where ``layers`` has AutoEP's block, that block on
    ds_comet under the default recipe ("autoep_comet_fp8") and, alone in the group, under
    ``ROWWISE_LIBRARY_RECIPE`` ("autoep_comet_fp8_rowwise") and ``ROWWISE_WGRAD_RECIPE``
    ("autoep_comet_fp8_rowwise_wgrad"); with ``--fp8 rowwise`` only the last two. Each is left out where
    its recipe refuses the shape (rank 0 prints the reason)."""
    kwargs = moe_kwargs(experts, ep_size, k, args.capacity_factor)

    def section(recipe):
        return {"backend": "comet", "overlap": "fused", "fp8": recipe, **layer_overrides(args)}

    builders = {}
    if args.fp8 == "all":
        for pipeline, recipe in FP8_RECIPES.items():
            builders[pipeline] = functools.partial(
                comet_layer, hidden, expert_template(hidden, ffn, gated), kwargs, section(recipe), layers["stock"]
            )
    if "autoep" in layers:
        block = functools.partial(
            autoep.autoep_layer,
            SWIGLU.get(name, "mixtral"),
            hidden,
            ffn,
            experts,
            k,
            ep_size,
            device,
            torch.bfloat16,
            0,
        )
        if args.fp8 == "all":
            builders["autoep_comet_fp8"] = functools.partial(block, section(FP8_RECIPES["fused_fp8"]))
        if ep_size == 1:
            builders["autoep_comet_fp8_rowwise"] = functools.partial(block, section(ROWWISE_LIBRARY_RECIPE))
            builders["autoep_comet_fp8_rowwise_wgrad"] = functools.partial(block, section(ROWWISE_WGRAD_RECIPE))
    built = {}
    for pipeline, build_layer in builders.items():
        try:
            built[pipeline] = build_layer()
        except ValueError as refusal:  # "fallback": "error": the recipe names why it cannot run the shape
            if dist.get_rank() == 0:
                print(f"{name}: no {pipeline} row: {refusal}", flush=True)
    return built


def bench_routing(moe, x, experts, ep_size, args):
    """(results, plan): the fused layer ``moe``'s gate (stock's call, ``gate_routes``, replayed), its
    routing plan, the MB its exchanges send, its parameters and its phases relaunched alone."""
    results = {}
    gate = moe.gate
    results["stock_gate"] = timed(lambda: gate(x[0], None, True), args.iters, args.warmup)
    pipeline = moe.pipelines.fused
    op = pipeline.workspace.op
    results["gate_routes"] = timed(lambda: gate_routes(gate, x[0], op=op), args.iters, args.warmup)
    graphs = moe.gate_graphs
    if graphs is not None:
        results["gate_routes_graphed"] = timed(lambda: graphs.routes(gate, x[0], None, op), args.iters, args.warmup)
    _, _, indices, gates, _ = gate_routes(gate, x[0], op=op)
    results["plan"] = timed(lambda: plan_routes_cuda(op, indices, experts, ep_size), args.iters, args.warmup)
    plan = plan_routes_cuda(op, indices, experts, ep_size)
    # What crosses the links in each of the four exchanges of a training step, from this rank.
    sent = exchange_mb(indices, experts, ep_size, dist.get_rank(), x.shape[-1], x.element_size())
    results["sent_mb_per_route"], results["sent_mb_once_per_rank"] = sent["route"], sent["once"]
    # Where blockwise tiles fit: the forward's dispatch under "dispatch": "fp8" sends packed FP8 rows (values and
    # scales), and so does the backward's under "gradient_dispatch": "fp8" (the output gradients, as many rows and
    # bytes); a training step with both then sends two such dispatches and two combines in the tokens' dtype.
    if "fp8" in sent:
        results["sent_mb_fp8_rows"] = sent["fp8"]
        results["sent_mb_fp8_step"] = 2 * (results["sent_mb_fp8_rows"] + results["sent_mb_once_per_rank"])
    results["comm_blocks"] = pipeline.params.comm_blocks
    results["combine_blocks"] = pipeline.params.combine_blocks
    for part, launch in fused_phases(pipeline, x[0], plan, gates.float()).items():
        results[f"fused_{part}"] = timed(launch, args.iters, args.warmup)
    return results, plan


def bench_bounds(moe, plan, experts, ep_size, hidden, device, args):
    """(results, expert modules, their inputs): the expert FFNs alone on the rows each local expert
    of ``moe`` receives under ``plan``, and one all-to-all with the plan's splits."""
    results = {}
    # What this rank receives, per local expert, and what it sends to / receives from each rank.
    local = experts // ep_size
    received = torch.empty_like(plan.expert_counts)
    dist.all_to_all_single(received, plan.expert_counts)
    received = received.view(ep_size, local)
    per_expert = received.sum(0).tolist()
    send_splits = plan.rank_counts(ep_size).tolist()
    recv_splits = received.sum(1).tolist()
    modules = moe.experts.deepspeed_experts
    inputs = [torch.randn(rows, hidden, device=device).to(torch.bfloat16) for rows in per_expert]
    results["experts_loop"] = timed(
        lambda: [expert_ffn(m, r) for m, r in zip(modules, inputs)], args.iters, args.warmup
    )
    results["experts"] = results["experts_loop"]
    grouped = grouped_ffn(modules, inputs)
    if grouped is not None:
        results["experts_grouped"] = timed(grouped, args.iters, args.warmup)
        results["experts"] = min(results["experts"], results["experts_grouped"])
    send = torch.randn(sum(send_splits), hidden, device=device).to(torch.bfloat16)
    recv = torch.empty(sum(recv_splits), hidden, device=device, dtype=torch.bfloat16)

    def a2a():
        return dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits)

    results["all_to_all"] = timed(a2a, args.iters, args.warmup)
    return results, modules, inputs


def max_over_ranks(results, device):
    """``results`` with each value the maximum over ranks (the slowest rank sets every step)."""
    values = torch.tensor([results[key] for key in sorted(results)], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    results = dict(zip(sorted(results), values.tolist()))
    results.update(comm_blocks=int(results["comm_blocks"]), combine_blocks=int(results["combine_blocks"]))
    return results


def add_ratios(results, backward):
    """Adds to ``results`` the ratios the tables print: stock, the reference and AutoEP against the
    fused layer, and the fused layers against their bounds."""
    results.update(
        stock_over_fused=results["stock"] / results["fused"],
        fused_over_bound=results["fused"] / results["bound"],
        reference_over_fused=results["reference"] / results["fused"],
    )
    if backward:
        results.update(
            stock_over_fused_fwd_bwd=results["stock_fwd_bwd"] / results["fused_fwd_bwd"],
            fused_over_bound_fwd_bwd=results["fused_fwd_bwd"] / results["bound_fwd_bwd"],
            reference_over_fused_fwd_bwd=results["reference_fwd_bwd"] / results["fused_fwd_bwd"],
        )
    if FP8_PIPELINES & results.keys():
        add_fp8_ratios(results, backward)
    if "autoep" in results:
        results.update(
            autoep_over_comet=results["autoep"] / results["autoep_comet"],
            autoep_comet_over_bound=results["autoep_comet"] / results["bound"],
        )
        if backward:
            results.update(
                autoep_over_comet_fwd_bwd=results["autoep_fwd_bwd"] / results["autoep_comet_fwd_bwd"],
                autoep_comet_over_bound_fwd_bwd=results["autoep_comet_fwd_bwd"] / results["bound_fwd_bwd"],
            )


def add_fp8_ratios(results, backward):
    """The FP8 layers' speedups: the bf16 comet layer's time and AutoEP's over each fused FP8 layer's, and
    AutoEP's and the AutoEP block's on ds_comet (bf16) over that block's under each FP8 recipe."""
    suffixes = ("", "_fwd_bwd") if backward else ("",)
    for suffix in suffixes:
        for pipeline in FP8_RECIPES:
            if pipeline not in results:
                continue
            results[f"fused_over_{pipeline}{suffix}"] = results[f"fused{suffix}"] / results[f"{pipeline}{suffix}"]
            if "autoep" in results:
                results[f"autoep_over_{pipeline}{suffix}"] = results[f"autoep{suffix}"] / results[f"{pipeline}{suffix}"]
        for variant in ("comet_fp8", "comet_fp8_rowwise", "comet_fp8_rowwise_wgrad"):
            if f"autoep_{variant}" in results:
                results[f"autoep_over_{variant}{suffix}"] = (
                    results[f"autoep{suffix}"] / results[f"autoep_{variant}{suffix}"]
                )
                results[f"autoep_comet_over_{variant}{suffix}"] = (
                    results[f"autoep_comet{suffix}"] / results[f"autoep_{variant}{suffix}"]
                )


def bench_shape(name, hidden, ffn, experts, k, tokens, args):
    """Every number of one shape (its entry in bench.json): the layers' times in ms, forward and
    (unless --no-backward) training step, their parts and bounds, the maximum over ranks, and
    their ratios."""
    ep_size = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    layers = build_layers(name, hidden, ffn, experts, k, ep_size, device, args)
    for layer in layers.values():
        layer.eval()
    x = torch.randn(1, tokens, hidden, device=device).to(torch.bfloat16)
    results = {}
    moe = layers["fused"].deepspeed_moe
    with torch.no_grad():
        for pipeline in layers:
            results[pipeline] = timed(lambda: layers[pipeline](x), args.iters, args.warmup)
        routing, plan = bench_routing(moe, x, experts, ep_size, args)
        results.update(routing)
        bounds, modules, inputs = bench_bounds(moe, plan, experts, ep_size, hidden, device, args)
        results.update(bounds)
    results["comm_bound"] = 2 * results["all_to_all"]
    results["bound"] = max(results["experts"], results["comm_bound"])
    if args.backward:
        results.update(bench_fwd_bwd(layers, x, modules, inputs, args))
        results["comm_bound_fwd_bwd"] = 4 * results["all_to_all"]
        results["bound_fwd_bwd"] = max(results["experts_fwd_bwd"], results["comm_bound_fwd_bwd"])
    results = max_over_ranks(results, device)
    add_ratios(results, args.backward)
    return results


TRAIN_COLUMNS = (
    ("stock", "stock_fwd_bwd"),
    ("reference", "reference_fwd_bwd"),
    ("fused", "fused_fwd_bwd"),
    ("experts", "experts_fwd_bwd"),
    ("a2a x4", "comm_bound_fwd_bwd"),
    ("bound", "bound_fwd_bwd"),
    ("stock/fused", "stock_over_fused_fwd_bwd"),
    ("fused/bound", "fused_over_bound_fwd_bwd"),
    ("stock MiB", "stock_peak_mib"),
    ("ref MiB", "reference_peak_mib"),
    ("fused MiB", "fused_peak_mib"),
)


def draw(ax, all_results, bars, ratios, ylabel):
    """Grouped bars per shape, with the two ratios written above each group."""
    names = list(all_results)
    width = 0.8 / len(bars)
    for i, bar in enumerate(bars):
        ax.bar([n + i * width for n in range(len(names))], [all_results[n][bar] for n in names], width, label=bar)
    for n, name in enumerate(names):
        top = max(all_results[name][bar] for bar in bars)
        text = "\n".join(f"{label} {all_results[name][key]:.2f}" for label, key in ratios)
        ax.text(n + 0.4 - width / 2, top, text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks([n + 0.4 - width / 2 for n in range(len(names))], names, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.25)
    ax.legend(fontsize=7)


FORWARD_COLUMNS = (
    "stock",
    "reference",
    "fused",
    "stock_gate",
    "gate_routes",
    "plan",
    "fused_gemm1",
    "fused_gemm2",
    "fused_combine",
    "experts",
    "all_to_all",
    "bound",
    "stock_over_fused",
    "fused_over_bound",
)


def print_forward_table(all_results):
    lines = ["shape".ljust(28) + "".join(c[:11].rjust(12) for c in FORWARD_COLUMNS)]
    for name, results in all_results.items():
        lines.append(name.ljust(28) + "".join(f"{results[c]:12.3f}" for c in FORWARD_COLUMNS))
    print("forward: times in ms (max over ranks); ratios are plain numbers\n" + "\n".join(lines), flush=True)


def print_sent_table(all_results):
    lines = []
    for name, r in all_results.items():
        once = max(r["sent_mb_once_per_rank"], 1e-9)
        fp8 = ""
        if "sent_mb_fp8_rows" in r:
            fp8 = f"{r['sent_mb_fp8_rows']:14.1f}{r['sent_mb_fp8_rows'] / once:10.3f}"
            fp8 += f"{r['sent_mb_fp8_step']:14.1f}{r['sent_mb_fp8_step'] / (4 * once):10.3f}"
        lines.append(
            f"{name.ljust(40)}{r['sent_mb_per_route']:12.1f}{r['sent_mb_once_per_rank']:16.1f}"
            f"{r['sent_mb_per_route'] / once:10.2f}{fp8}"
        )
    print(
        "MB one rank sends to the others per exchange (max over ranks): route by route, once per (token, rank) "
        "(every exchange of both ds_comet pipelines, dispatch and combine), their ratio; then the forward's "
        'dispatch once per (token, rank) under "dispatch": "fp8" (e4m3 rows with their 1x128 tiles\' fp32 '
        'scales; shapes with H a multiple of 128; the backward\'s dispatch under "gradient_dispatch": "fp8" sends '
        "as many bytes) and its ratio to bf16 rows; then a training step's four exchanges with both FP8 "
        "dispatches and its ratio to the step in bf16\n" + "\n".join(lines),
        flush=True,
    )


def print_autoep_table(all_results):
    """The AutoEP rows, where any shape has them."""
    autoep_rows = {name: results for name, results in all_results.items() if "autoep" in results}
    if not autoep_rows:
        return
    columns = (
        ("AutoEP", "autoep"),
        ("AutoEP+comet", "autoep_comet"),
        ("AutoEP/comet", "autoep_over_comet"),
        ("comet/bound", "autoep_comet_over_bound"),
    )
    if all("autoep_fwd_bwd" in results for results in autoep_rows.values()):
        columns += (
            ("AutoEP fb", "autoep_fwd_bwd"),
            ("comet fb", "autoep_comet_fwd_bwd"),
            ("AutoEP/comet fb", "autoep_over_comet_fwd_bwd"),
            ("comet/bound fb", "autoep_comet_over_bound_fwd_bwd"),
            ("AutoEP MiB", "autoep_peak_mib"),
            ("comet MiB", "autoep_comet_peak_mib"),
        )
    lines = ["shape".ljust(40) + "".join(h.rjust(16) for h, _ in columns)]
    for name, results in autoep_rows.items():
        lines.append(name.ljust(40) + "".join(f"{results[key]:16.3f}" for _, key in columns))
    print(
        "DeepSpeed AutoEP against the same block on ds_comet: ms (fb: forward+backward), ratios, peak MiB\n"
        + "\n".join(lines),
        flush=True,
    )


def print_fp8_table(all_results):
    """The FP8 rows, where any shape has them: each FP8 layer's ms and its speedups (ratios above 1:
    the FP8 layer is faster); "-" where a recipe refused the shape."""
    fp8_rows = {name: results for name, results in all_results.items() if FP8_PIPELINES & results.keys()}
    if not fp8_rows:
        return

    def cell(results, key, width):
        return f"{results[key]:{width}.3f}" if key in results else "-".rjust(width)

    columns = (
        ("comet", "fused"),
        ("comet FP8", "fused_fp8"),
        ("comet FP8 bd", "fused_fp8_bf16_dispatch"),
        ("comet/FP8", "fused_over_fused_fp8"),
        ("comet/FP8 bd", "fused_over_fused_fp8_bf16_dispatch"),
    )
    if any("fused_fwd_bwd" in results for results in fp8_rows.values()):
        columns += tuple((f"{h} fb", f"{key}_fwd_bwd") for h, key in columns)
    lines = ["shape".ljust(40) + "".join(h.rjust(16) for h, _ in columns)]
    for name, results in fp8_rows.items():
        lines.append(name.ljust(40) + "".join(cell(results, key, 16) for _, key in columns))
    autoep_columns = (
        ("AutoEP", "autoep"),
        ("AutoEP+comet FP8", "autoep_comet_fp8"),
        ("AutoEP/FP8", "autoep_over_comet_fp8"),
        ("AutoEP/comet FP8", "autoep_over_fused_fp8"),
        ("AutoEP/comet FP8 bd", "autoep_over_fused_fp8_bf16_dispatch"),
        ("AutoEP+comet/FP8", "autoep_comet_over_comet_fp8"),
        ("AutoEP+comet FP8 rw", "autoep_comet_fp8_rowwise"),
        ("AutoEP/FP8 rw", "autoep_over_comet_fp8_rowwise"),
        ("AutoEP+comet/FP8 rw", "autoep_comet_over_comet_fp8_rowwise"),
        ("AutoEP+comet FP8 rwg", "autoep_comet_fp8_rowwise_wgrad"),
        ("AutoEP/FP8 rwg", "autoep_over_comet_fp8_rowwise_wgrad"),
        ("AutoEP+comet/FP8 rwg", "autoep_comet_over_comet_fp8_rowwise_wgrad"),
    )
    autoep_columns += tuple((f"{h} fb", f"{key}_fwd_bwd") for h, key in autoep_columns)
    with_autoep = {name: results for name, results in fp8_rows.items() if "autoep" in results}
    if with_autoep:
        keys = [(h, key) for h, key in autoep_columns if any(key in r for r in with_autoep.values())]
        lines.append("shape".ljust(40) + "".join(h.rjust(24) for h, _ in keys))
        for name, results in with_autoep.items():
            lines.append(name.ljust(40) + "".join(cell(results, key, 24) for _, key in keys))
    print(
        'the blockwise "fp8" recipe on the fused pipeline against the bf16 comet layer and AutoEP (bf16): FP8, '
        'the default (the forward\'s rows cross as packed FP8 rows), and FP8 bd, "dispatch": "bf16" (rows cross '
        "in bf16); AutoEP's block on ds_comet runs the default, and FP8 rw the rowwise recipe on the library's "
        "GEMMs (rows crossing in bf16), FP8 rwg that recipe with its weight gradients in FP8. ms (fb: "
        "forward+backward), ratios of their times "
        "over the FP8 layer's\n" + "\n".join(lines),
        flush=True,
    )


def print_training_table(all_results):
    lines = ["shape".ljust(28) + "".join(h.rjust(12) for h, _ in TRAIN_COLUMNS)]
    for name, results in all_results.items():
        lines.append(name.ljust(28) + "".join(f"{results[key]:12.3f}" for _, key in TRAIN_COLUMNS))
    print(
        "forward+backward (one training step): times in ms, peak MiB above the step's start (max over ranks)\n"
        + "\n".join(lines),
        flush=True,
    )


def plot(all_results, out_dir, backward):
    """bench.png under ``out_dir``: the forward's bars, and the training step's with ``backward``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no bench.png", flush=True)
        return
    rows = 2 if backward else 1
    fig, axes = plt.subplots(rows, 1, figsize=(3 + 2.5 * len(all_results), 4.5 * rows), squeeze=False)
    draw(
        axes[0][0],
        all_results,
        ("stock", "reference", "fused", "experts", "comm_bound"),
        (("stock/fused", "stock_over_fused"), ("fused/bound", "fused_over_bound")),
        "forward time per layer (ms)",
    )
    axes[0][0].set_title(f"one MoE layer, EP={dist.get_world_size()}, bf16: forward")
    if backward:
        draw(
            axes[1][0],
            all_results,
            ("stock_fwd_bwd", "reference_fwd_bwd", "fused_fwd_bwd", "experts_fwd_bwd", "comm_bound_fwd_bwd"),
            (("stock/fused", "stock_over_fused_fwd_bwd"), ("fused/bound", "fused_over_bound_fwd_bwd")),
            "forward+backward time per layer (ms)",
        )
        axes[1][0].set_title("forward+backward (one training step)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bench.png"), dpi=120)


def report(all_results, out_dir):
    """Rank 0's report of every shape (``all_results``: {shape: bench_shape's results}): the tables
    on stdout, then bench.json and bench.png under ``out_dir``."""
    print_forward_table(all_results)
    print_sent_table(all_results)
    print_autoep_table(all_results)
    print_fp8_table(all_results)
    backward = all("fused_fwd_bwd" in results for results in all_results.values())
    if backward:
        print_training_table(all_results)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as handle:
        json.dump(all_results, handle, indent=2)
    plot(all_results, out_dir, backward)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    run_shapes(
        selected_shapes(args.shape, args.custom), lambda name, shape: bench_shape(name, *shape, args), report, args.out
    )


if __name__ == "__main__":
    main()
