"""The fused pipeline on GPUs (one NCCL rank per visible GPU, at most DS_COMET_TEST_WORLD_SIZE): skipped without CUDA.

Every case builds stock DeepSpeed MoE, the comet layer on the reference pipeline and the comet
layer on the fused pipeline with the same weights, feeds fresh random bf16 (or fp16) tokens and checks the
fused output against a float64 evaluation of the gate's routes and against both other layers.
The workspace is poisoned with NaN before each fused call and the output buffer too, so a row
nobody wrote cannot pass; GEMM2's rows are a fresh tensor each call, whose memory holds nothing
of the call's tokens (each call's tokens are fresh), so a row read before GEMM2 wrote it is off.
"""

import os
import re

import deepspeed
import pytest
import torch
import torch.utils.checkpoint
from deepspeed import comm as dist

import ds_comet
from ds_comet.experts import reset_expert_
from ds_comet.kernels.constants import TOTAL_OWN_ROUTES, TOTAL_RECV_ROWS, TOTAL_STAGED_SENT
from ds_comet.kernels.ops import CometWaitTimeout
from ds_comet.pipelines.routing import plan_routes
from ds_comet.pipelines.selection import NO_TOKENS_YET
from tests.support.dist_pool import RANKS_PER_GPU_VAR, ranks_per_gpu
from tests.support.layout_reference import STAGE_KEYS, reference_layout
from tests.support.moe_helpers import make_expert, rel, reset_experts_

BF16_REL = 1e-2  # bf16 operands and outputs against float64 (fp16 cases are held to the same bound)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _layers(seed, hidden, ffn, expert_kind, timeout_s=20.0, moe=None, dtype=torch.bfloat16, **moe_kwargs):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(seed)
    template = make_expert(expert_kind, hidden, ffn)
    stock = deepspeed.moe.layer.MoE(hidden, template, **moe_kwargs)
    stock.set_deepspeed_parallelism()
    reset_experts_(stock, seed)
    layers = {"stock": stock}
    for name, overlap in (("reference", "none"), ("fused", "fused")):
        config = {"moe": {"backend": "comet", "overlap": overlap, "wait_timeout_s": timeout_s, **(moe or {})}}
        layer = ds_comet.MoE(hidden, template, config=config, **moe_kwargs)
        layer.set_deepspeed_parallelism()
        layer.load_state_dict(stock.state_dict())
        layers[name] = layer
    for layer in layers.values():
        layer.to(device=device, dtype=dtype).eval()
    return layers


def _float64_output(layer, tokens, seed, expert_kind, hidden, ffn):
    """Every expert on this rank in float64, applied to the gate's routes."""
    gate = layer.deepspeed_moe.gate
    num_experts = gate.wg.weight.shape[0]
    _, _, _, indices, _, gates, _ = gate(tokens, None, True)
    expected = torch.zeros(tokens.shape, dtype=torch.float64, device=tokens.device)
    for global_id in range(num_experts):
        expert = make_expert(expert_kind, hidden, ffn)
        reset_expert_(expert, seed * 1000 + global_id)
        expert = expert.to(tokens.device).to(tokens.dtype).double()  # the layer's weights, evaluated exactly
        for j in range(indices.shape[0]):
            rows = (indices[j] == global_id).nonzero().flatten()
            if rows.numel():
                expected.index_add_(0, rows, gates[j, rows].double().unsqueeze(1) * expert(tokens[rows].double()))
    return expected, indices


def _fused_pipeline(layer):
    """The layer's fused pipeline, asserting that its last call ran it."""
    pipelines = layer.deepspeed_moe.pipelines
    assert pipelines.fused is not None and pipelines.reason is None, (
        f"the fused pipeline did not run: {pipelines.reason}"
    )
    return pipelines.fused


def _nobody_has_tokens(tokens_per_rank, ep_size):
    """Whether no rank of the case has tokens (rank-without-tokens at one rank): the layer then has
    nothing to size the fused workspace by and runs the reference pipeline."""
    return not any(tokens_per_rank[r % len(tokens_per_rank)] for r in range(ep_size))


def _poison(layer):
    fused = layer.deepspeed_moe.pipelines.fused
    if fused is None:  # no call has had tokens on any rank: no workspace yet
        return
    workspace = fused.workspace
    workspace.recv.fill_(float("nan"))
    workspace.stage.fill_(float("nan"))
    workspace.reduced.fill_(float("nan"))
    workspace.row_dot.fill_(float("nan"))


def fused_case(
    seed,
    hidden,
    ffn,
    experts_per_rank,
    k,
    tokens_per_rank,
    expert_kind="gelu",
    drop_tokens=True,
    capacity_factor=1.0,
    min_capacity=4,
    skew=0.0,
    calls=2,
    moe=None,
    dtype="bf16",
):
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    num_experts = experts_per_rank * ep_size
    dtype = DTYPES[dtype]
    layers = _layers(
        seed,
        hidden,
        ffn,
        expert_kind,
        moe=moe,
        dtype=dtype,
        num_experts=num_experts,
        ep_size=ep_size,
        k=k,
        drop_tokens=drop_tokens,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=min_capacity,
    )
    device = torch.device("cuda", torch.cuda.current_device())
    stats = []
    for call in range(calls):
        generator = torch.Generator(device=device).manual_seed(seed * 100 + call * 10 + rank)
        tokens = torch.randn(tokens_per_rank[rank % len(tokens_per_rank)], hidden, generator=generator, device=device)
        if skew:
            tokens += skew * layers["stock"].deepspeed_moe.gate.wg.weight[0].float()
        tokens = tokens.to(dtype)
        with torch.no_grad():
            if call > 0:
                _poison(layers["fused"])
            noise = seed * 7 + call * 3 + rank  # top-2 gating samples its second expert even in eval mode
            # Stock DeepSpeed cannot run uneven token counts with drops (its capacity follows the
            # local count, so its equal all-to-all splits would not line up): leave it out there.
            stock_runs = not drop_tokens or len(set(tokens_per_rank)) == 1
            outputs = {}
            for name, layer in layers.items():
                if name == "stock" and not stock_runs:
                    continue
                torch.manual_seed(noise)
                outputs[name] = layer(tokens.unsqueeze(0))
            fused_layer = layers["fused"].deepspeed_moe
            if _nobody_has_tokens(tokens_per_rank, ep_size):
                assert fused_layer.pipelines.reason == NO_TOKENS_YET and fused_layer.pipelines.fused is None
                assert outputs["fused"][0].shape == (1, 0, hidden)
                stats.append(dict(dropped=0, empty_experts=num_experts))
                continue
            pipeline = _fused_pipeline(layers["fused"])
            num_sms = pipeline.workspace.num_sms
            for key, value in (moe or {}).items():  # pinned block counts, as capped by the selection
                if key in ("comm_blocks", "combine_blocks"):
                    assert getattr(pipeline.params, key) == min(value, num_sms - 1), key
                if key == "n_chunks":  # a pinned count holds at every EP (the cases keep a tile a chunk)
                    assert pipeline.params.n_chunks == value, pipeline.params
            if (moe or {}).get("cuda_graph_gate") and call > 0:
                assert fused_layer.gate_graphs._captured, "the gate was not captured"

            torch.manual_seed(noise)
            expected, indices = _float64_output(layers["fused"], tokens, seed, expert_kind, hidden, ffn)

            fused_out = outputs["fused"][0][0]
            assert torch.isfinite(fused_out).all(), "the fused output has NaN/inf: a row was read before written"
            err = {name: rel(out[0][0], expected) for name, out in outputs.items()}
            assert err["fused"] < BF16_REL, err
            assert rel(fused_out, outputs["reference"][0][0]) < 2 * BF16_REL, err
            if stock_runs:
                assert rel(fused_out, outputs["stock"][0][0]) < 2 * BF16_REL, err
                assert torch.equal(outputs["fused"][1], outputs["stock"][1]), "l_aux"
                assert torch.equal(outputs["fused"][2], outputs["stock"][2]), "exp_counts"
            no_route = (indices < 0).all(dim=0)
            assert (fused_out[no_route] == 0).all(), "a token with no kept route must come out zero"

            # The same call through the pipeline into a poisoned output: every row must be written.
            _poison(layers["fused"])
            torch.manual_seed(noise)
            _, _, num, idx, _, gates, _ = fused_layer.gate(tokens, None, True)
            poisoned = torch.full_like(tokens, float("nan"))
            again = pipeline.forward(tokens, idx, gates, train=False, out=poisoned)
            assert torch.equal(again, fused_out), "the fused forward is not deterministic or left rows unwritten"

            plan = plan_routes(idx, num)
            counts = plan.expert_counts
            everyone = [torch.empty_like(counts) for _ in range(ep_size)]
            dist.all_gather(everyone, counts)
            # Tokens with a kept route to each rank: what this rank stages there, once a token.
            kept = (idx >= 0) & (idx < num)
            staged = torch.stack(
                [(kept & (idx.long() // (num // ep_size) == d)).any(dim=0).sum() for d in range(ep_size)]
            )
            staged_by_all = [torch.empty_like(staged) for _ in range(ep_size)]
            dist.all_gather(staged_by_all, staged)
            expected_layout = reference_layout(
                [c.tolist() for c in everyone], rank, pipeline.params.tile_m, [s.tolist() for s in staged_by_all]
            )
            lo, layout = pipeline.workspace.layout_offsets, pipeline.workspace.layout.tolist()
            for key in (
                "expert_start",
                "tile_start",
                "local_tiles",
                "remote_tiles",
                "send_offset",
                "dest_row",
                "dest_rel",
                "dest_tile",
                "send_order",
                "piece_start",
            ) + STAGE_KEYS:
                start = getattr(lo, key)
                assert layout[start : start + len(expected_layout[key])] == expected_layout[key], key
            # What the combine's waits count to: the own routes' rows and the rows staged on other ranks.
            totals = expected_layout["totals"]
            assert (layout[lo.totals + TOTAL_OWN_ROUTES], layout[lo.totals + TOTAL_STAGED_SENT]) == (
                totals["own_routes"],
                totals["staged_sent"],
            )
            _check_one_row_a_rank(
                idx,
                num,
                plan,
                rank,
                ep_size,
                pipeline.workspace.route_stage.tolist(),
                expected_layout["stage_dest_row"],
            )
        stats.append(
            dict(
                err=err,
                dropped=int((indices < 0).sum()),
                no_route=int(no_route.sum()),
                empty_experts=int((counts == 0).sum()),
            )
        )
    return stats


def _check_one_row_a_rank(idx, num_experts, plan, rank, ep_size, route_stage, stage_dest_row):
    """Each token's routes to another rank come back as one row: the token's first route there names
    its staged (and so its reduced) row there, in token order from this rank's first staging row;
    its other routes there name none (-1)."""
    local, (top_k, num_tokens) = num_experts // ep_size, idx.shape
    idx, position = idx.tolist(), plan.route_position.tolist()
    named = {d: [] for d in range(ep_size) if d != rank}
    for t in range(num_tokens):
        seen = set()
        for j in range(top_k):
            e = idx[j][t]
            if e < 0 or e >= num_experts or e // local == rank:
                continue
            stage_row = route_stage[position[j * num_tokens + t]]
            if e // local in seen:
                assert stage_row == -1, (t, j, stage_row)
            else:
                seen.add(e // local)
                named[e // local].append(stage_row)
    for d, rows in named.items():
        assert rows == list(range(stage_dest_row[d], stage_dest_row[d] + len(rows))), d


def _seed():
    return torch.randint(1, 10**6, ()).item()


# Experts per rank (the layer has experts_per_rank x world size) and per-rank token counts that repeat over the ranks.
FORWARD_CASES = [
    dict(hidden=512, ffn=1024, experts_per_rank=4, k=2, tokens_per_rank=(512, 512)),
    dict(hidden=512, ffn=1024, experts_per_rank=4, k=2, tokens_per_rank=(640, 384), skew=4.0, min_capacity=0),
    dict(hidden=1408, ffn=704, experts_per_rank=4, k=4, tokens_per_rank=(333, 1000), expert_kind="swiglu"),
    dict(hidden=384, ffn=768, experts_per_rank=8, k=8, tokens_per_rank=(300, 257), drop_tokens=False),
    dict(
        hidden=256,
        ffn=512,
        experts_per_rank=1,
        k=1,
        tokens_per_rank=(200, 77),
        expert_kind="sequential",
        capacity_factor=0.5,
        min_capacity=0,
    ),
    dict(hidden=320, ffn=640, experts_per_rank=2, k=1, tokens_per_rank=(256, 256), drop_tokens=False, skew=50.0),
    # The combine reads k routes in passes of 1, 2, 4 or 8: k = 3 fills a pass partly, k = 12 takes two.
    dict(hidden=448, ffn=512, experts_per_rank=3, k=3, tokens_per_rank=(211, 300), skew=4.0),
    dict(hidden=264, ffn=384, experts_per_rank=8, k=12, tokens_per_rank=(150, 97)),
    # k = 5 leaves three of a pass of 8 empty; a rank with no tokens still serves its experts.
    dict(hidden=640, ffn=768, experts_per_rank=4, k=5, tokens_per_rank=(257, 190)),
    dict(hidden=512, ffn=1024, experts_per_rank=4, k=2, tokens_per_rank=(0, 300), capacity_factor=0.5, min_capacity=0),
    # The combine stages a unit's routes in shared memory, at most 3,000 of them: with k = 24 a unit
    # holds 125 tokens instead of 128 (three passes of 8 routes each).
    dict(hidden=256, ffn=256, experts_per_rank=16, k=24, tokens_per_rank=(300, 129)),
    # The extreme splits: GEMM1 on one program beside a dispatch on every other SM (comm_blocks is
    # capped there), and a combine on one block beside GEMM2, which every SM finishes after GEMM2.
    dict(
        hidden=512,
        ffn=1024,
        experts_per_rank=4,
        k=2,
        tokens_per_rank=(700, 500),
        skew=4.0,
        moe=dict(comm_blocks=100000, combine_blocks=1),
    ),
    # The gate replayed from CUDA graphs: the first call captures, the later ones replay.
    dict(hidden=512, ffn=1024, experts_per_rank=4, k=2, tokens_per_rank=(512, 512), moe=dict(cuda_graph_gate=True)),
    dict(
        hidden=448,
        ffn=512,
        experts_per_rank=3,
        k=3,
        tokens_per_rank=(211, 300),
        skew=4.0,
        moe=dict(cuda_graph_gate=True),
    ),
    # fp16 takes the same kernels with the other element type: a kernel reading fp16 as bf16 is far off.
    dict(
        hidden=512,
        ffn=1024,
        experts_per_rank=4,
        k=2,
        tokens_per_rank=(640, 384),
        skew=4.0,
        min_capacity=0,
        dtype="fp16",
    ),
    dict(
        hidden=1408, ffn=704, experts_per_rank=4, k=4, tokens_per_rank=(333, 1000), expert_kind="swiglu", dtype="fp16"
    ),
    # A small gated layer, an FFN narrower than one column tile, three of four experts a token.
    dict(hidden=64, ffn=96, experts_per_rank=4, k=3, tokens_per_rank=(48, 60), expert_kind="swiglu", drop_tokens=False),
    # bf16 experts take the library's grouped GEMM for their weight gradients: every token
    # on one expert leaves the others' groups empty, which must give zero gradients. Equal token
    # counts: without drops stock caps its capacity at the rank's own token count, so ranks with
    # fewer tokens than the busiest expert's routes would post all-to-alls of different sizes.
    dict(
        hidden=512,
        ffn=768,
        experts_per_rank=4,
        k=1,
        tokens_per_rank=(300, 300),
        expert_kind="swiglu",
        drop_tokens=False,
        skew=50.0,
    ),
    # Activations sized by the rows each call receives: without dropping, and with every row on one
    # rank's expert (the other rank receives none and keeps one row).
    dict(
        hidden=384,
        ffn=768,
        experts_per_rank=8,
        k=8,
        tokens_per_rank=(300, 257),
        drop_tokens=False,
        moe=dict(activation_rows="received"),
    ),
    dict(
        hidden=512,
        ffn=768,
        experts_per_rank=4,
        k=1,
        tokens_per_rank=(300, 300),
        expert_kind="swiglu",
        drop_tokens=False,
        skew=50.0,
        moe=dict(activation_rows="received"),
    ),
    # GEMM2 and the combine in four column chunks however many ranks run the suite: the rule takes
    # one chunk at EP=1, where nothing overlaps GEMM2.
    dict(
        hidden=1024,
        ffn=512,
        experts_per_rank=4,
        k=2,
        tokens_per_rank=(300, 211),
        expert_kind="swiglu",
        skew=4.0,
        min_capacity=0,
        moe=dict(n_chunks=4),
    ),
]
FORWARD_IDS = [
    "uniform",
    "skewed-drops",
    "swiglu-odd-sizes",
    "k8-no-drop",
    "one-local-expert",
    "all-to-one-expert",
    "k3-skewed",
    "k12-two-passes",
    "k5",
    "rank-without-tokens",
    "k24-capped-units",
    "extreme-sm-splits",
    "graphed-gate",
    "graphed-gate-k3-skewed",
    "fp16-skewed-drops",
    "fp16-swiglu-odd-sizes",
    "swiglu-narrow-k3",
    "swiglu-empty-experts",
    "k8-received-rows",
    "swiglu-empty-experts-received-rows",
    "swiglu-four-chunks",
]


def _experts_or_skip(gpu_pool, case) -> int:
    """The case's experts in all; a case whose k needs more of them than this many GPUs give skips."""
    num_experts = case["experts_per_rank"] * gpu_pool.world_size
    if case["k"] > num_experts:
        pytest.skip(f"k = {case['k']} needs more experts than {gpu_pool.world_size} GPU(s) give this case")
    return num_experts


@pytest.mark.parametrize("case", FORWARD_CASES, ids=FORWARD_IDS)
def test_fused_forward(gpu_pool, case):
    num_experts = _experts_or_skip(gpu_pool, case)
    stats = gpu_pool.run(fused_case, seed=_seed(), **case)
    # With one GPU, k3-skewed routes every token to each of its 3 experts: nothing to drop.
    if case.get("skew") and case.get("drop_tokens", True) and case["k"] < num_experts:
        assert sum(s[-1]["dropped"] for s in stats) > 0, stats
    if case.get("skew") and case["k"] == 1:  # top-2 samples its second expert, so only top-1 starves experts
        assert sum(s[-1]["empty_experts"] for s in stats) > 0, stats


def first_calls_without_tokens_case(seed):
    """Two calls on which no rank has tokens, then one on which every rank has some: the workspace
    is built at the third, for its tokens."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    hidden, ffn = 256, 512
    layers = _layers(seed, hidden, ffn, "swiglu", num_experts=2 * ep_size, ep_size=ep_size, k=2)
    del layers["stock"]  # stock cannot run uneven token counts with drops
    device = torch.device("cuda", torch.cuda.current_device())
    for call, count in enumerate((0, 0, 200 + 37 * rank)):
        generator = torch.Generator(device=device).manual_seed(seed * 100 + call * 10 + rank)
        tokens = torch.randn(count, hidden, generator=generator, device=device).to(torch.bfloat16)
        with torch.no_grad():
            outputs = {}
            for name, layer in layers.items():
                torch.manual_seed(seed * 7 + call)
                outputs[name] = layer(tokens.unsqueeze(0))[0]
        pipelines = layers["fused"].deepspeed_moe.pipelines
        if count == 0:
            assert pipelines.reason == NO_TOKENS_YET and pipelines.fused is None, pipelines.reason
            assert outputs["fused"].shape == (1, 0, hidden)
            continue
        pipeline = _fused_pipeline(layers["fused"])
        assert pipeline.workspace.shape.max_tokens == 200 + 37 * (ep_size - 1)
        assert torch.isfinite(outputs["fused"]).all()
        assert rel(outputs["fused"][0], outputs["reference"][0]) < 2 * BF16_REL


def test_calls_without_tokens_before_the_first_with_tokens(gpu_pool):
    gpu_pool.run(first_calls_without_tokens_case, seed=_seed())


BF16_GRAD_REL = 2e-2  # gradients sum many bf16 products: a little looser than outputs


def _exact_copy(stock, hidden, template, device, dtype, **moe_kwargs):
    """The comet reference pipeline in float64 with the bf16 (or fp16) model's weights: the ground truth."""
    layer = ds_comet.MoE(hidden, template, config={"moe": {"backend": "comet", "overlap": "none"}}, **moe_kwargs)
    layer.set_deepspeed_parallelism()
    layer.load_state_dict(stock.state_dict())
    return layer.to(device=device, dtype=dtype).to(torch.float64)


def backward_case(
    seed,
    hidden,
    ffn,
    experts_per_rank,
    k,
    tokens_per_rank,
    expert_kind="gelu",
    drop_tokens=True,
    capacity_factor=1.0,
    min_capacity=4,
    skew=0.0,
    micro_batches=2,
    frozen_experts=False,
    input_grad=True,
    moe=None,
    dtype="bf16",
):
    """Training steps (train-mode gate, gradients accumulated over micro-batches) on every pipeline.

    Every gradient (input, gate weight, each expert weight and bias) of the fused pipeline is
    compared with the float64 ground truth, with the reference pipeline and, where it can run,
    with stock DeepSpeed. ``frozen_experts`` and ``input_grad=False`` leave those gradients out,
    as a job that freezes the experts or feeds the layer a constant would.
    """
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    moe_kwargs = dict(
        num_experts=experts_per_rank * ep_size,
        ep_size=ep_size,
        k=k,
        drop_tokens=drop_tokens,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=min_capacity,
    )
    dtype = DTYPES[dtype]
    layers = _layers(seed, hidden, ffn, expert_kind, moe=moe, dtype=dtype, **moe_kwargs)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(seed)
    layers["exact"] = _exact_copy(
        layers["stock"], hidden, make_expert(expert_kind, hidden, ffn), device, dtype, **moe_kwargs
    )
    stock_runs = not drop_tokens or len(set(tokens_per_rank)) == 1
    if not stock_runs:
        del layers["stock"]
    input_grads = {name: [] for name in layers}
    for layer in layers.values():
        layer.train()
        layer.zero_grad(set_to_none=True)
        if frozen_experts:
            layer.deepspeed_moe.experts.requires_grad_(False)
    for step in range(micro_batches):
        generator = torch.Generator(device=device).manual_seed(seed * 100 + step * 10 + rank)
        tokens = torch.randn(tokens_per_rank[rank % len(tokens_per_rank)], hidden, generator=generator, device=device)
        if skew:
            tokens += skew * layers["reference"].deepspeed_moe.gate.wg.weight[0].detach().float()
        tokens = tokens.to(dtype)
        grad_out = torch.randn(1, *tokens.shape, generator=generator, device=device).to(dtype)
        for name, layer in layers.items():
            layer_dtype = torch.float64 if name == "exact" else dtype
            inputs = tokens.to(layer_dtype).unsqueeze(0).requires_grad_(input_grad)
            torch.manual_seed(seed * 7 + step)  # the gate's top-2 sampling
            out, l_aux, _ = layer(inputs)
            if name == "fused":
                # Other layers' calls reuse the workspace between a forward and its backward: the
                # backward must read only what it saved or writes itself.
                _poison(layer)
            torch.autograd.backward([out, l_aux], [grad_out.to(layer_dtype), torch.tensor(0.01, device=device)])
            if input_grad:
                assert torch.isfinite(inputs.grad).all(), f"{name}: input gradient is not finite"
                input_grads[name].append(inputs.grad[0])
    if _nobody_has_tokens(tokens_per_rank, ep_size):
        assert layers["fused"].deepspeed_moe.pipelines.reason == NO_TOKENS_YET
    else:
        _fused_pipeline(layers["fused"])

    errors = {}
    params = {name: dict(layer.named_parameters()) for name, layer in layers.items()}
    compared = [
        (f"input grad {i}", {name: grads[i] for name, grads in input_grads.items()})
        for i in range(micro_batches if input_grad else 0)
    ]
    compared += [
        (pname, {name: params[name][pname].grad for name in layers})
        for pname, param in params["exact"].items()
        if param.requires_grad
    ]
    frozen = [pname for pname, param in params["fused"].items() if not param.requires_grad]
    assert all(params["fused"][pname].grad is None for pname in frozen), "a frozen parameter got a gradient"
    assert len(frozen) == (len(list(layers["fused"].deepspeed_moe.experts.parameters())) if frozen_experts else 0)
    for what, grads in compared:
        assert all(g is not None for g in grads.values()), f"{what}: a pipeline left no gradient"
        exact = grads["exact"]
        err = {name: rel(g, exact) for name, g in grads.items() if name != "exact"}
        errors[what] = err
        assert torch.isfinite(grads["fused"]).all(), f"{what}: the fused gradient is not finite"
        assert err["fused"] < BF16_GRAD_REL, (what, err)
        assert rel(grads["fused"], grads["reference"]) < 2 * BF16_GRAD_REL, (what, err)
        if "stock" in grads:
            assert rel(grads["fused"], grads["stock"]) < 2 * BF16_GRAD_REL, (what, err)
    return max(e["fused"] for e in errors.values())


@pytest.mark.parametrize("case", FORWARD_CASES, ids=FORWARD_IDS)
def test_fused_backward(gpu_pool, case):
    _experts_or_skip(gpu_pool, case)
    worst = gpu_pool.run(backward_case, seed=_seed(), **case)
    assert max(worst) < BF16_GRAD_REL


@pytest.mark.parametrize(
    "frozen_experts,input_grad",
    [(True, True), (False, False), (True, False)],
    ids=["frozen-experts", "no-input-grad", "gate-only"],
)
def test_fused_backward_partial_gradients(gpu_pool, frozen_experts, input_grad):
    # Skewed and uneven: rank 1 routes almost nothing to its own experts, and the gradients that are
    # not needed are not asked for, while every rank still returns its peers' rows.
    case = dict(FORWARD_CASES[1], frozen_experts=frozen_experts, input_grad=input_grad)
    worst = gpu_pool.run(backward_case, seed=_seed(), **case)
    assert max(worst) < BF16_GRAD_REL


def autocast_case(seed, k, moe=None, dtype="bf16"):
    """Training forward and backward under bf16 (or fp16) autocast, which makes the gate's logits and
    the top-2 gate's weights half precision: the fused layer against stock's, both under autocast."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[dtype]
    layers = _layers(seed, 512, 1024, "gelu", moe=moe, dtype=dtype, num_experts=4 * ep_size, ep_size=ep_size, k=k)
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(seed * 10 + rank)
    tokens = torch.randn(384, 512, generator=generator, device=device).to(dtype)
    grad_out = torch.randn(384, 512, generator=generator, device=device).to(dtype)
    results = {}
    for name in ("stock", "fused"):
        layer = layers[name].train()
        for call in range(2):  # with the graphed gate, the second call replays (or runs eagerly under autocast)
            x = tokens.clone().requires_grad_()
            torch.manual_seed(seed + call)
            with torch.autocast("cuda", dtype=dtype):
                out, l_aux, counts = layer(x.unsqueeze(0))
            torch.autograd.backward([out[0], l_aux], [grad_out, torch.ones_like(l_aux)])
        results[name] = (out[0].detach(), l_aux.detach(), counts, x.grad)
    _fused_pipeline(layers["fused"])
    (out, l_aux, counts, grad), (want, want_l_aux, want_counts, want_grad) = results["fused"], results["stock"]
    assert torch.equal(l_aux, want_l_aux) and torch.equal(counts, want_counts)
    assert rel(out, want) < 2 * BF16_REL and rel(grad, want_grad) < 2 * BF16_GRAD_REL, (
        rel(out, want),
        rel(grad, want_grad),
    )


@pytest.mark.parametrize(
    "k,moe,dtype",
    [
        (1, None, "bf16"),
        (2, None, "bf16"),
        (4, None, "bf16"),
        (2, dict(cuda_graph_gate=True), "bf16"),
        (2, None, "fp16"),
        (4, None, "fp16"),
    ],
    ids=["k1", "k2", "k4", "k2-graphed-gate", "k2-fp16", "k4-fp16"],
)
def test_fused_under_autocast_matches_stock(gpu_pool, k, moe, dtype):
    gpu_pool.run(autocast_case, seed=_seed(), k=k, moe=moe, dtype=dtype)


def checkpoint_case(seed, use_reentrant, moe=None):
    """The fused layer under activation checkpointing, as a training script wraps its blocks: the
    forward under checkpoint, the backward recomputing it (gate noise included, from the restored
    RNG). Non-reentrant checkpointing packs saved tensors through hooks, and recomputes the block
    when the fused function's saved gates are unpacked. Outputs and every gradient must equal those
    of the same layer run without checkpointing."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    layers = _layers(seed, 512, 1024, "gelu", moe=moe, num_experts=4 * ep_size, ep_size=ep_size, k=2)
    layer = layers["fused"].train()
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(seed * 10 + rank)
    tokens = torch.randn(384, 512, generator=generator, device=device).to(torch.bfloat16)
    grad_out = torch.randn(1, 384, 512, generator=generator, device=device).to(torch.bfloat16)

    def block(x):
        out, l_aux, _ = layer(x)
        return out, l_aux

    results = {}
    for mode in ("plain", "checkpointed", "plain-again"):
        layer.zero_grad(set_to_none=True)
        x = tokens.unsqueeze(0).clone().requires_grad_()
        torch.manual_seed(seed)  # the gate's top-2 sampling
        if mode == "checkpointed":
            out, l_aux = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)
        else:
            out, l_aux = block(x)
        torch.autograd.backward([out, l_aux], [grad_out, torch.tensor(0.01, device=device)])
        grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
        results[mode] = (out.detach(), l_aux.detach(), x.grad, grads)
    _fused_pipeline(layer)
    want_out, want_l_aux, want_grad, want_grads = results["plain"]
    for mode in ("checkpointed", "plain-again"):
        out, l_aux, grad, grads = results[mode]
        assert torch.equal(l_aux, want_l_aux), mode
        assert rel(out, want_out) < 1e-6 and rel(grad, want_grad) < 1e-6, (
            mode,
            rel(out, want_out),
            rel(grad, want_grad),
        )
        assert grads.keys() == want_grads.keys() and len(grads) > 2, (mode, sorted(grads))
        worst = max(rel(grads[name], want) for name, want in want_grads.items())
        assert worst < 1e-6, (mode, worst)


@pytest.mark.parametrize(
    "use_reentrant,moe",
    [(True, None), (False, None), (False, dict(cuda_graph_gate=True))],
    ids=["reentrant", "non-reentrant", "non-reentrant-graphed-gate"],
)
def test_fused_under_activation_checkpointing(gpu_pool, use_reentrant, moe):
    gpu_pool.run(checkpoint_case, seed=_seed(), use_reentrant=use_reentrant, moe=moe)


class _ZeroNet(torch.nn.Module):
    """inp -> MoE -> out, the MoE's experts distinct per global expert id."""

    def __init__(self, ds_config, hidden, ffn, seed):
        super().__init__()
        ep_size = dist.get_world_size()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(hidden, hidden)
        self.moe = ds_comet.build_moe(
            ds_config,
            hidden_size=hidden,
            expert=make_expert("gelu", hidden, ffn),
            num_experts=4 * ep_size,
            ep_size=ep_size,
            k=2,
        )
        self.out = torch.nn.Linear(hidden, hidden)
        # deepspeed.initialize sets the expert-parallel groups (a second set_deepspeed_parallelism asserts);
        # with ep_size equal to the world size the expert-parallel rank is the global rank.
        reset_experts_(self.moe, seed, ep_rank=dist.get_rank())

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(hidden), l_aux


def zero2_case(seed, hidden=256, ffn=512, steps=2, precision="bf16", scale_power=8):
    """One ZeRO-2 job per backend (SGD, two micro-batches per step) from the same weights and data.

    fp16 runs DeepSpeed's loss scaler: both backends' gradients pass its overflow check and unscaling.
    With a loss scale of 2**32 the output gradients overflow fp16: the fused backward must take
    the infinities without failing or hanging, and both backends skip every step. The scale halves
    after each overflow (hysteresis 1), so this holds for a few steps only.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for backend in ("deepspeed", "comet"):
        mixed = (
            {"bf16": {"enabled": True}}
            if precision == "bf16"
            else {"fp16": {"enabled": True, "initial_scale_power": scale_power, "hysteresis": 1}}
        )
        ds_config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            **mixed,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**6,
            "moe": {"backend": backend, "overlap": "fused"} if backend == "comet" else {"backend": backend},
        }
        model = _ZeroNet(ds_config, hidden, ffn, seed)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"}
        )
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.5), config=ds_config)
        losses = []
        for step in range(steps * 2):
            generator = torch.Generator(device=device).manual_seed(seed + 1000 * step + dist.get_rank())
            x = torch.randn(4, 64, hidden, generator=generator, device=device).to(DTYPES[precision])
            target = torch.randn(4, 64, hidden, generator=generator, device=device).to(DTYPES[precision])
            torch.manual_seed(step)  # the gate's top-2 sampling
            output, l_aux = engine(x)
            loss = ((output.float() - target.float()) ** 2).mean() + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if backend == "comet":
            _fused_pipeline(engine.module.moe)
            if scale_power < 32:
                assert engine.skipped_steps < steps, "the loss scaler skipped every step: nothing was compared"
        results[backend] = (
            losses,
            {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()},
            engine.skipped_steps,
        )
    (stock_losses, stock_state, stock_skipped), (comet_losses, comet_state, comet_skipped) = (
        results["deepspeed"],
        results["comet"],
    )
    assert stock_skipped == comet_skipped, (stock_skipped, comet_skipped)
    if scale_power >= 32:
        assert comet_skipped == steps, f"only {comet_skipped} of {steps} overflowing steps were skipped"
    assert stock_state.keys() == comet_state.keys()
    for a, b in zip(stock_losses, comet_losses):
        assert abs(a - b) <= 2e-2 * abs(a), (stock_losses, comet_losses)
    worst = max(rel(comet_state[name], value) for name, value in stock_state.items())
    assert worst < BF16_GRAD_REL, worst
    return worst


def plan_case(seed):
    """The plan kernel against plan_routes on the same gate indices: equal, entry for entry; and the
    tokens each rank gets once, against a list made here."""
    from ds_comet.kernels.ops import load_op
    from ds_comet.kernels.routing_plan import plan_routes_cuda

    op = load_op()
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(seed + dist.get_rank())
    # The kernel gives each block 1, 2 or 4 experts, the fewest with which one wave of blocks covers
    # every expert (4 past that): on 132 SMs (H100, H200) the expert counts below take each of
    # those paths, and 1201 experts take several waves.
    cases = [
        (2, 8192, 8, 0.1, 0.0),
        (4, 333, 64, 0.5, 3.0),
        (8, 1000, 32, 0.0, 0.0),
        (1, 5, 3, 1.0, 0.0),
        (2, 0, 4, 0.0, 0.0),
        (3, 2047, 300, 0.2, 8.0),
        (1, 70000, 2, 0.3, 0.0),
        (2, 999, 200, 0.1, 0.0),
        (8, 3001, 256, 0.05, 2.0),
        (1, 4000, 1201, 0.1, 4.0),
    ]
    for k, tokens, experts, drop, skew in cases:
        scores = torch.rand(tokens, experts, generator=generator, device=device)
        scores[:, 0] += skew  # skewed: most routes go to expert 0, some experts get none
        indices = scores.topk(min(k, experts), dim=1).indices.t().contiguous().int()
        indices[torch.rand(indices.shape, generator=generator, device=device) < drop] = -1
        if skew == 8.0:  # ids past the last expert, or far below -1, count as dropped in both
            indices[0, :5] = experts
            indices[-1, 5:8] = experts + 7
            indices[-1, 8] = -(2**31)
        ranks = max(p for p in (1, 2, 3, 4, 8) if experts % p == 0)
        want, got = plan_routes(indices, experts), plan_routes_cuda(op, indices, experts, ranks)
        for field in ("route_order", "route_position", "expert_counts"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (k, tokens, experts, field)
        assert (got.num_tokens, got.top_k) == (want.num_tokens, want.top_k)
        kept = (indices >= 0) & (indices < experts)
        for d in range(ranks):
            here = (kept & (indices.long() // (experts // ranks) == d)).any(dim=0)
            listed = here.nonzero().flatten()
            assert got.rank_token_counts[d].item() == listed.numel(), (k, tokens, experts, d)
            assert torch.equal(got.rank_tokens[d, : listed.numel()].long(), listed), (k, tokens, experts, d)


def test_plan_kernel_matches_plan_routes(gpu_pool):
    gpu_pool.run(plan_case, seed=_seed())


@pytest.mark.parametrize(
    "precision,scale_power", [("bf16", 8), ("fp16", 8), ("fp16", 32)], ids=["bf16", "fp16", "fp16-overflow"]
)
def test_zero2_training_step_matches_stock(gpu_pool, precision, scale_power):
    gpu_pool.run(zero2_case, seed=_seed(), precision=precision, scale_power=scale_power)


def graph_case(seed):
    """The fused forward captured in a CUDA graph: it must need no host sync, and replay right."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    hidden, ffn = 512, 1024
    layers = _layers(seed, hidden, ffn, "gelu", num_experts=4 * ep_size, ep_size=ep_size, k=2)
    fused_layer = layers["fused"].deepspeed_moe
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = torch.randn(256, hidden, device=device).to(torch.bfloat16)
    with torch.no_grad():
        layers["fused"](tokens.unsqueeze(0))  # selection, workspace, Triton compilation
        pipeline = _fused_pipeline(layers["fused"])
        _, _, num, indices, _, gates, _ = fused_layer.gate(tokens, None, True)
        static = dict(tokens=tokens.clone(), indices=indices.clone(), gates=gates.clone())

        def step():
            return pipeline.forward(static["tokens"], static["indices"], static["gates"], train=False)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = step()
        for trial in range(2):
            fresh = torch.randn(256, hidden, device=device).to(torch.bfloat16)
            torch.manual_seed(seed + trial)
            _, _, _, indices, _, gates, _ = fused_layer.gate(fresh, None, True)
            static["tokens"].copy_(fresh)
            static["indices"].copy_(indices)
            static["gates"].copy_(gates)
            graph.replay()
            torch.manual_seed(seed + trial)
            eager = layers["fused"](fresh.unsqueeze(0))[0][0]
            torch.cuda.synchronize()
            assert torch.equal(graph_out, eager), f"graph replay {trial} differs from eager"
    return rank


def test_fused_forward_in_cuda_graph(gpu_pool):
    gpu_pool.run(graph_case, seed=_seed())


def _saved_activations(out):
    """The fused autograd node's saved tensors behind ``out`` (the layer's output)."""
    pending, seen = [out.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "FusedMoEFunctionBackward":
            return node.saved
        pending.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError("no fused autograd node behind the layer's output")


def activation_rows_case(seed):
    """Without dropping, activations sized by the received rows against the bound: kept at the rows
    each call receives (one at least), the bound's otherwise, with the same output and gradients."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for mode in ("bound", "received"):
        layers = _layers(
            seed,
            256,
            384,
            "swiglu",
            moe={"activation_rows": mode},
            num_experts=4 * ep_size,
            ep_size=ep_size,
            k=4,
            drop_tokens=False,
        )
        layer = layers["fused"].train()
        generator = torch.Generator(device=device).manual_seed(seed + rank)
        # Skewed toward one expert, and a different token count on each rank.
        tokens = torch.randn(1, 200 + 37 * rank, 256, generator=generator, device=device)
        tokens += 3.0 * layer.deepspeed_moe.gate.wg.weight[0].detach().float()
        tokens = tokens.to(torch.bfloat16).requires_grad_()
        torch.manual_seed(seed)
        out, l_aux, _ = layer(tokens)
        saved = _saved_activations(out)
        pipeline = _fused_pipeline(layers["fused"])
        workspace = pipeline.workspace
        received = int(workspace.layout[workspace.layout_offsets.totals + TOTAL_RECV_ROWS])
        kept = {name: saved[name].shape[0] for name in ("rows", "outputs")}
        kept["pre"] = (saved["pre"][0] if isinstance(saved["pre"], tuple) else saved["pre"]).shape[0]
        want = max(received, 1) if mode == "received" else min(pipeline.row_bounds[True], workspace.shape.max_recv_rows)
        assert set(kept.values()) == {want}, (mode, kept, received)
        grad_out = torch.randn(out.shape, generator=generator, device=device).to(out.dtype)
        torch.autograd.backward([out, l_aux], [grad_out, torch.ones_like(l_aux)])
        results[mode] = [out.detach(), tokens.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
    # The same kernels over the same rows: only the tensors' unused tails differ.
    assert len(results["bound"]) == len(results["received"]) > 3
    for bound, received in zip(results["bound"], results["received"]):
        assert torch.isfinite(received).all() and rel(received, bound) < 1e-3, rel(received, bound)
    return rank


def test_activations_sized_by_received_rows(gpu_pool):
    gpu_pool.run(activation_rows_case, seed=_seed())


def shared_expandable_case(seed):
    """Ranks on one GPU with expandable segments asked for: "fused" must fail naming the setting."""
    ep_size = dist.get_world_size()
    previous = {name: os.environ.pop(name, None) for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    # Read by the layer's choice only: the allocator took its settings when CUDA started.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        layers = _layers(
            seed, 128, 256, "gelu", moe={"overlap": "fused"}, num_experts=2 * ep_size, ep_size=ep_size, k=1
        )
        tokens = torch.randn(1, 32, 128, device=torch.device("cuda", torch.cuda.current_device())).to(torch.bfloat16)
        with torch.no_grad(), pytest.raises(RuntimeError, match="expandable segments"):
            layers["fused"](tokens)
    finally:
        for name, value in previous.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def test_shared_gpu_refuses_expandable_segments(gpu_pool):
    if ranks_per_gpu() < 2:
        pytest.skip(f"needs ranks that share a GPU ({RANKS_PER_GPU_VAR}=2)")
    gpu_pool.run(shared_expandable_case, seed=_seed())


def step_shares_case(seed):
    """StepShares on the device's clock (CUDA events) around fused calls: it finds the comet layer
    and charges each measured step's forward, backward and optimizer step."""
    from ds_comet.step_shares import StepShares, moe_layers

    ep_size = dist.get_world_size()
    layers = _layers(seed, 128, 256, "gelu", num_experts=2 * ep_size, ep_size=ep_size, k=2)
    layer = layers["fused"]
    device = torch.device("cuda", torch.cuda.current_device())
    assert moe_layers(layer) == [layer.deepspeed_moe]
    shares = StepShares(layer, device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    for step in range(3):
        tokens = torch.randn(1, 64, 128, device=device).to(torch.bfloat16).requires_grad_()
        with shares.step(measure=step > 0):
            out = layer(tokens)[0] + tokens
            out.float().square().sum().backward()
            with shares.optimizer():
                optimizer.step()
                optimizer.zero_grad()
    totals = shares.read()
    assert layer.deepspeed_moe.pipelines.reason is None, layer.deepspeed_moe.pipelines.reason  # the fused path ran
    assert totals.steps == 2 and min(totals.moe_forward_ms, totals.moe_backward_ms, totals.optimizer_ms) > 0, totals
    assert totals.step_ms > totals.moe_forward_ms + totals.moe_backward_ms + totals.optimizer_ms, totals
    shares.remove()
    return dist.get_rank()


def test_step_shares_time_the_fused_layer_on_the_device(gpu_pool):
    gpu_pool.run(step_shares_case, seed=_seed())


def timeout_case(seed):
    """Rank 0 calls the layer alone: its wait for its peers' counts must end in a named error."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    layers = _layers(seed, 256, 512, "gelu", timeout_s=2.0, num_experts=2 * ep_size, ep_size=ep_size, k=1)
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = torch.randn(1, 64, 256, device=device).to(torch.bfloat16)
    with torch.no_grad():
        layers["fused"](tokens)  # every rank: selection and workspace
        torch.cuda.synchronize()
        dist.barrier()
        if rank != 0:
            return None
        return _wait_timeout_message(layers["fused"], tokens)


def _wait_timeout_message(layer, tokens):
    """The CometWaitTimeout message of a call of ``layer`` on ``tokens`` that its peers do not join."""
    try:
        layer(tokens)
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    with pytest.raises(CometWaitTimeout) as raised:
        layer.deepspeed_moe.pipelines.fused.raise_if_failed()
    return str(raised.value)


def test_wait_timeout_names_rank_and_flag(gpu_pool):
    if gpu_pool.world_size < 2:
        pytest.skip("needs two GPUs")
    # Runs last in this file: it leaves rank 0's CUDA context dead, and the pool restarts after it.
    message = gpu_pool.run(timeout_case, seed=_seed(), timeout=120)[0]
    # Every peer is silent; which peer's wait gives up first is a race from 3 ranks on.
    peer = re.search(r"the expert counts of peer rank (\d+) to reach", message)
    assert "rank 0" in message and peer and 1 <= int(peer.group(1)) < gpu_pool.world_size, message
    gpu_pool.stop()


def raising_peer_case(seed):
    """The ranks but 0 call the layer with more tokens than its workspace holds and raise; rank 0's
    kernel gives up on them, and its error carries their reason."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    layers = _layers(
        seed,
        256,
        512,
        "gelu",
        timeout_s=2.0,
        moe={"max_tokens_per_rank": 64},
        num_experts=2 * ep_size,
        ep_size=ep_size,
        k=1,
    )
    layers["fused"].deepspeed_moe.pipelines.name = "blocks.2.moe"
    device = torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():
        layers["fused"](torch.randn(1, 64, 256, device=device).to(torch.bfloat16))
        torch.cuda.synchronize()
        dist.barrier()
        if rank != 0:
            with pytest.raises(ValueError, match="sized for 64"):
                layers["fused"](torch.randn(1, 96, 256, device=device).to(torch.bfloat16))
            return None
        return _wait_timeout_message(layers["fused"], torch.randn(1, 64, 256, device=device).to(torch.bfloat16))


def test_wait_timeout_carries_the_reason_a_peer_raised(gpu_pool):
    if gpu_pool.world_size < 2:
        pytest.skip("needs two GPUs")
    # Like the test above, it leaves rank 0's CUDA context dead, and the pool restarts after it.
    message = gpu_pool.run(raising_peer_case, seed=_seed(), timeout=120)[0]
    assert "the expert counts of peer rank" in message, message
    for rank in range(1, gpu_pool.world_size):
        assert (
            f"global rank {rank} raised in blocks.2.moe: ValueError: this MoE layer got 96 tokens on one rank but "
            "the fused workspace was sized for 64"
        ) in message, message
    gpu_pool.stop()
