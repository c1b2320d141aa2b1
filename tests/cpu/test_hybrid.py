"""The hybrid pipeline of a group that spans nodes (pipelines/hybrid.py), on CPU.

The fused pipeline needs GPUs, so the reference pipeline on the node's group stands in for the
node's part: what is checked here is the split of the routes between the two parts and their
sum, forward and backward, and the selection that builds the hybrid. Four gloo ranks, two a
declared node (DS_COMET_RANKS_PER_NODE=2): outputs and every gradient (tokens, gates, experts)
against the reference pipeline on the whole group (fp32's rounding) and against float64, with
skewed routing, experts that get no route, dropped routes, k = 1 to 3, chunked and forwarded
exchanges between nodes; no row of the exchange between nodes goes to a rank of the sender's node.
"""

import os

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.pipelines import hybrid
from ds_comet.pipelines.hybrid import HybridPipeline, NodeSplit, node_group
from ds_comet.pipelines.policy import RANKS_PER_NODE_VAR, hybrid_layout, node_blocks
from ds_comet.pipelines.reference import ReferencePipeline
from tests.support.dist_pool import DistPool, cpu_world_size
from tests.support.moe_helpers import make_expert, rel, reset_experts_

HIDDEN, FFN, PER_NODE = 24, 40, 2


def test_split_gives_each_kept_route_to_one_part():
    split = NodeSplit(num_experts=8, nodes=2, node=1)  # node 1 holds experts 4..7
    indices = torch.tensor([[0, 4, 7, -1, 8], [5, 3, -1, 6, 2]])
    here, elsewhere = split.split(indices)
    assert here.tolist() == [[-1, 0, 3, -1, -1], [1, -1, -1, 2, -1]]
    assert elsewhere.tolist() == [[0, -1, -1, -1, -1], [-1, 3, -1, -1, 2]]
    assert here.dtype == indices.dtype and split.node_experts == 4


def test_hybrid_layout_needs_nodes_filled_in_order_two_ranks_or_more():
    assert node_blocks(["a", "a", "b", "b"]) == 2 and node_blocks(["a", "b", "a", "b"]) is None
    assert node_blocks(["a", "a", "a", "b"]) is None
    assert hybrid_layout(["a", "a", "b", "b"], True) == 2
    assert '"internode_hybrid" is false' in hybrid_layout(["a", "a", "b", "b"], False)
    assert "one rank a node" in hybrid_layout(["a", "b", "c", "d"], True)
    assert "do not fill them in order" in hybrid_layout(["a", "b", "a", "b"], True)


@pytest.fixture(scope="module")
def pool_of_four(cpu_pool):
    """Four gloo ranks, two nodes of two: the session's pool if it has four, else one of this module."""
    if cpu_world_size() == 4:
        yield cpu_pool
        return
    pool = DistPool(4)
    yield pool
    pool.stop()


def _routes(seed, rank, num_tokens, k, num_experts):
    """Skewed routes (half of them to experts 0 and 1, experts 5 and 6 never), some dropped, and
    gates; k distinct experts a token."""
    generator = torch.Generator().manual_seed(seed * 31 + rank)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    scores[:, :2] += 0.6
    scores[:, 5:7] = -1.0
    indices = scores.topk(k, dim=1).indices.t().contiguous()
    dropped = torch.rand(indices.shape, generator=generator) < 0.15
    indices = torch.where(dropped, torch.full_like(indices, -1), indices)
    return indices, torch.rand(indices.shape, generator=generator)


def _run(pipeline, experts, tokens, indices, gates, grad_out):
    """The pipeline's output and the gradients of tokens, gates and the experts' parameters."""
    tokens = tokens.detach().requires_grad_(True)
    gates = gates.detach().requires_grad_(True)
    for p in experts.parameters():
        p.grad = None
    out = pipeline.forward(tokens, indices, gates)
    out.backward(grad_out)
    return [out.detach(), tokens.grad, gates.grad] + [p.grad.clone() for p in experts.parameters()]


def _wire(record):
    """``reference.exchange`` and ``reference.chunked_exchange`` wrapped to record, per call, the
    group and the rows sent to each rank; returns a function that restores them."""
    import ds_comet.pipelines.reference as reference

    exchange, chunked = reference.exchange, reference.chunked_exchange
    reference.exchange = lambda rows, send, recv, waits, what: (
        record.append((waits.group, list(send))) or exchange(rows, send, recv, waits, what)
    )
    reference.chunked_exchange = lambda rows, routes, send, recv, chunks, work, params, waits: (
        record.append((waits.group, list(send))) or chunked(rows, routes, send, recv, chunks, work, params, waits)
    )

    def restore():
        reference.exchange, reference.chunked_exchange = exchange, chunked

    return restore


def pipeline_case(seed, expert_kind, k, chunks, forwarding, tokens_per_rank):
    """The hybrid, the reference pipeline standing in for the node's part, against the whole group's
    reference pipeline (fp32) and against itself in float64."""
    rank = dist.get_rank()
    os.environ[RANKS_PER_NODE_VAR] = str(PER_NODE)
    try:
        torch.manual_seed(seed)
        num_experts = 2 * dist.get_world_size()
        moe = {"backend": "comet", "overlap": "none", "internode_chunks": chunks, "internode_forwarding": forwarding}
        layer = ds_comet.MoE(
            HIDDEN, make_expert(expert_kind, HIDDEN, FFN), num_experts=num_experts, ep_size=4, k=k, config={"moe": moe}
        )
        layer.set_deepspeed_parallelism()
        reset_experts_(layer, seed)
        pipelines = layer.deepspeed_moe.pipelines
        pipelines.pipeline_for(torch.randn(8, HIDDEN))  # the group's agreement: chunks, forwarding
        whole, experts = pipelines.reference, pipelines.experts
        assert whole.chunks == chunks and whole.ranks_per_node == (PER_NODE if forwarding else None)
        split = NodeSplit(num_experts, 2, rank // PER_NODE)
        ranks = tuple(range(split.node * PER_NODE, (split.node + 1) * PER_NODE))
        node_part = ReferencePipeline(experts, split.node_experts, PER_NODE, group=node_group(ranks))
        hybrid = HybridPipeline(node_part, whole, split)
        generator = torch.Generator().manual_seed(seed + rank)
        tokens = torch.randn(tokens_per_rank[rank], HIDDEN, generator=generator)
        grad_out = torch.randn(tokens.shape, generator=generator)
        indices, gates = _routes(seed, rank, tokens.shape[0], k, num_experts)
        sent = []
        restore = _wire(sent)
        try:
            got = _run(hybrid, experts, tokens, indices, gates, grad_out)
        finally:
            restore()
        want = _run(whole, experts, tokens, indices, gates, grad_out)
        names = ["out", "tokens", "gates"] + [f"parameter {i}" for i in range(len(got) - 3)]
        for name, g, w in zip(names, got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{name} (seed {seed})")
        layer.double()
        exact = _run(hybrid, experts, tokens.double(), indices, gates.double(), grad_out.double())
        for g, e in zip(got, exact):
            assert rel(g, e) < 1e-5, (seed, rel(g, e))
        # Between nodes, nothing goes to a rank of this node (this rank included).
        between = [splits for group, splits in sent if group is whole.group]
        between = between[:1] if forwarding else between  # forwarded: then the exchanges inside the node
        assert between and all(rows == 0 for splits in between for rows in splits[split.node * PER_NODE :][:PER_NODE])
        assert any(group is node_part.group for group, _ in sent), "the node's part exchanged nothing"
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)


@pytest.mark.parametrize(
    "expert_kind,k,chunks,forwarding,tokens_per_rank",
    [
        ("gelu", 2, 3, False, (30, 17, 0, 25)),
        ("swiglu", 1, 1, False, (20, 33, 12, 9)),
        ("gelu", 3, 2, True, (26, 8, 31, 14)),
    ],
    ids=["k2-3chunks-empty-rank", "k1-whole", "k3-forwarding-2chunks"],
)
def test_hybrid_equals_the_whole_groups_reference_pipeline(
    pool_of_four, expert_kind, k, chunks, forwarding, tokens_per_rank
):
    pool_of_four.run(
        pipeline_case,
        seed=torch.randint(1, 10**6, ()).item(),
        expert_kind=expert_kind,
        k=k,
        chunks=chunks,
        forwarding=forwarding,
        tokens_per_rank=tokens_per_rank,
    )


# Why the selection keeps the reference pipeline, by case: the hybrid turned off, an FP8 recipe (which
# the hybrid would run two ways), node groups that NCCL could not make for a node alone.
KEPT_REFERENCE = {
    "opted-out": '"internode_hybrid" is false',
    "fp8": 'the "fp8" recipe has no FP8 exchange between nodes',
    "bound": "NCCL cannot do for a node's ranks alone",
}


def selection_case(seed, mode):
    """The selection of a layer across two declared nodes of two ranks, where every rank could run the
    fused pipeline (the reference pipeline on the node's group stands in for it): it builds the
    hybrid, whose layer (gate included) gives what the layer on the reference pipeline gives; in the
    cases of ``KEPT_REFERENCE``, the reference pipeline and the reason."""
    from types import SimpleNamespace

    import ds_comet.pipelines.selection as selection

    rank = dist.get_rank()
    os.environ[RANKS_PER_NODE_VAR] = str(PER_NODE)
    saved = selection.local_reason, torch.cuda.get_device_properties
    selection.local_reason = lambda *args: SimpleNamespace(ffn=FFN)  # the kernels could run these experts
    torch.cuda.get_device_properties = lambda device: SimpleNamespace(uuid=f"GPU-{rank}")
    results = {}
    try:
        for overlap in ("auto", "none"):
            moe = {
                "backend": "comet",
                "overlap": overlap,
                "internode_chunks": 2,
                "internode_hybrid": mode != "opted-out",
            }
            if mode == "fp8":
                moe["fp8"] = {"enabled": True, "scaling": "rowwise"}
            torch.manual_seed(seed)
            layer = ds_comet.MoE(
                HIDDEN, make_expert("gelu", HIDDEN, FFN), num_experts=8, ep_size=4, k=2, config={"moe": moe}
            )
            layer.set_deepspeed_parallelism()
            reset_experts_(layer, seed)
            pipelines = layer.deepspeed_moe.pipelines

            def stand_in(tokens, experts, most_tokens, shared_device, on=None, pipelines=pipelines):
                assert on is not None and on.ep_size == PER_NODE and on.num_experts == 4 and not shared_device
                pipelines.fused = ReferencePipeline(pipelines.experts, on.num_experts, on.ep_size, group=on.group)

            pipelines._build_fused = stand_in
            pipelines._fp8_fused = lambda fused, tokens: fused  # a GPU whose FP8 GEMMs run the recipe
            if mode == "bound":
                selection.node_groups_reason = lambda: hybrid.node_groups_reason(bound=True)
            generator = torch.Generator().manual_seed(seed + rank)
            tokens = torch.randn(1, 20 + 5 * rank, HIDDEN, generator=generator, requires_grad=True)
            out, l_aux, _ = layer(tokens)
            torch.autograd.backward([out, l_aux], [torch.ones_like(out), torch.tensor(0.01)])
            chosen = pipelines.hybrid if overlap == "auto" else pipelines.reference
            results[overlap] = [out.detach(), tokens.grad] + [p.grad for p in layer.parameters()]
            if overlap == "auto" and mode in KEPT_REFERENCE:
                assert pipelines.hybrid is None and KEPT_REFERENCE[mode] in pipelines.reason, pipelines.reason
            elif overlap == "auto":
                assert chosen is not None and pipelines.reason is None and chosen.split.node == rank // PER_NODE
    finally:
        selection.local_reason, torch.cuda.get_device_properties = saved
        selection.node_groups_reason = hybrid.node_groups_reason
        os.environ.pop(RANKS_PER_NODE_VAR, None)
    for got, want in zip(results["auto"], results["none"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["hybrid", *KEPT_REFERENCE])
def test_selection_builds_the_hybrid_across_nodes_of_two_ranks(pool_of_four, mode):
    pool_of_four.run(selection_case, seed=torch.randint(1, 10**6, ()).item(), mode=mode)


def test_node_groups_are_made_by_a_nodes_ranks_alone_only_where_nccl_does_not_split_at_once():
    assert hybrid.node_groups_reason(bound=False) is None
    assert "bound to a device" in hybrid.node_groups_reason(bound=True)
    assert hybrid.node_groups_reason() is None  # no process group in this process
