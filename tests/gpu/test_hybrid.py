"""The hybrid pipeline on GPUs (pipelines/hybrid.py): a group of four ranks or more, declared two a
node (DS_COMET_RANKS_PER_NODE=2), runs the fused kernels among each node's ranks and the reference
pipeline's chunked exchange between nodes. Outputs and every gradient against the reference
pipeline on the whole group (stock DeepSpeed MoE layers) and against AutoEP (AutoEP layers).
Skipped without CUDA or with fewer than four ranks; ranks may share a GPU
(DS_COMET_TEST_RANKS_PER_GPU, tests/support/dist_pool.py).
"""

import os

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.pipelines.policy import RANKS_PER_NODE_VAR
from tests.support.moe_helpers import make_expert, rel, reset_experts_

PER_NODE = 2
BF16_REL = 2e-2  # the hybrid rounds each part's sum to bf16 before adding them: one rounding more


def _seed():
    return torch.randint(1, 10**6, ()).item()


@pytest.fixture
def pool_of_nodes(gpu_pool):
    if gpu_pool.world_size < 2 * PER_NODE:
        pytest.skip(f"the hybrid needs two nodes of {PER_NODE} ranks: {2 * PER_NODE} ranks at least")
    return gpu_pool


def stock_case(seed, expert_kind, k, drop_tokens, chunks):
    """ds_comet.MoE across declared nodes: the hybrid (``"overlap": "auto"``) against the whole
    group's reference pipeline (``"none"``), same weights and tokens: output, input gradient and
    every parameter's gradient (the gate's included)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    os.environ[RANKS_PER_NODE_VAR] = str(PER_NODE)
    results = {}
    try:
        for overlap in ("auto", "none"):
            torch.manual_seed(seed)
            moe = {"backend": "comet", "overlap": overlap, "internode_chunks": chunks}
            layer = ds_comet.MoE(
                256,
                make_expert(expert_kind, 256, 512),
                num_experts=2 * world,
                ep_size=world,
                k=k,
                drop_tokens=drop_tokens,
                config={"moe": moe},
            )
            layer.set_deepspeed_parallelism()
            reset_experts_(layer, seed)
            layer = layer.to(device, torch.bfloat16)
            generator = torch.Generator(device=device).manual_seed(seed + rank)
            tokens = torch.randn(2, 48 + 16 * rank, 256, device=device, dtype=torch.bfloat16, generator=generator)
            tokens.requires_grad_(True)
            torch.manual_seed(seed + 1)
            out, l_aux, _ = layer(tokens)
            torch.autograd.backward([out, l_aux], [torch.ones_like(out), torch.tensor(0.01, device=device)])
            pipelines = layer.deepspeed_moe.pipelines
            if overlap == "auto":
                assert pipelines.reason is None and pipelines.hybrid is not None, pipelines.reason
                assert pipelines.fused.workspace.shape.ep_size == PER_NODE
            results[overlap] = [out.detach(), tokens.grad] + [p.grad for p in layer.parameters()]
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)
    worst = max(rel(got, want) for got, want in zip(results["auto"], results["none"]) if want is not None)
    assert worst < BF16_REL, (seed, worst)
    return worst


@pytest.mark.parametrize(
    "expert_kind,k,drop_tokens,chunks",
    [("gelu", 2, False, 2), ("swiglu", 1, True, 1), ("swiglu", 3, False, 3)],
    ids=["gelu-k2-2chunks", "swiglu-k1-dropping-whole", "swiglu-k3-3chunks"],
)
def test_hybrid_matches_the_reference_pipeline(pool_of_nodes, expert_kind, k, drop_tokens, chunks):
    pool_of_nodes.run(stock_case, seed=_seed(), expert_kind=expert_kind, k=k, drop_tokens=drop_tokens, chunks=chunks)


def autoep_case(preset, seed):
    """AutoEP's layers on ds_comet across declared nodes of two ranks, against AutoEP itself."""
    from tests.support.autoep_models import gradients_case

    os.environ[RANKS_PER_NODE_VAR] = str(PER_NODE)
    try:
        return gradients_case(preset, seed, dtype_name="bf16", overlap="auto")
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)


def test_autoep_layers_on_the_hybrid_match_autoep(pool_of_nodes):
    pytest.importorskip("transformers")
    for errors, loss_diff, reasons in pool_of_nodes.run(autoep_case, preset="mixtral", seed=_seed()):
        # Across nodes no reason means the hybrid: the fused kernels on the whole group need one node.
        assert reasons == {None}, f"the comet layers did not run the hybrid pipeline: {reasons}"
        worse = {name: e for name, e in errors.items() if e["comet_vs_exact"] > max(2 * e["autoep_vs_exact"], BF16_REL)}
        assert not worse, sorted(worse.items(), key=lambda item: -item[1]["comet_vs_exact"])[:6]
        assert loss_diff < 2e-2, loss_diff
