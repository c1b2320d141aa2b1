"""The reference pipeline's exchange in chunks, for groups that span nodes (pipelines/chunked.py).

One host stands for several nodes with DS_COMET_RANKS_PER_NODE: the chunked layer must give what
the whole exchange gives (outputs and every gradient, the gate's included; fp32: to 1e-5, the
GEMMs' rounding for other row counts; bf16: to its rounding), AutoEP's layer included, and its
chunk bookkeeping must cover every row once. A rank that stalls inside a call, whole or in chunks,
ends its peers' waits within the layer's bound, with an error naming it.
"""

import os
import random

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.pipelines.chunked import ChunkPlan, rule_chunks
from ds_comet.pipelines.policy import RANKS_PER_NODE_VAR, node_name
from tests.support.dist_pool import DistPool, cpu_world_size
from tests.support.moe_helpers import assert_parameter_grad_close, make_expert, per_rank, rel, reset_experts_


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
def test_chunk_plan_covers_every_row_once(chunks):
    rng = random.Random(chunks)
    ep_size = 4
    send = [rng.choice([0, rng.randint(1, 9)]) for _ in range(ep_size)]
    recv = [rng.choice([0, rng.randint(1, 9)]) for _ in range(ep_size)]
    plan = ChunkPlan(send, recv, chunks, torch.device("cpu"))
    assert sorted(torch.cat(plan.send_index).tolist()) == list(range(sum(send)))
    starts = [sum(send[:dest]) for dest in range(ep_size)]
    for c in range(chunks):
        # Chunk c of each destination's block, destination by destination, as the receiver cuts it.
        expected = [
            starts[dest] + row
            for dest in range(ep_size)
            for row in range(send[dest] * c // chunks, send[dest] * (c + 1) // chunks)
        ]
        assert plan.send_index[c].tolist() == expected
        assert plan.send_splits[c] == [send[d] * (c + 1) // chunks - send[d] * c // chunks for d in range(ep_size)]
        assert plan.recv_splits[c] == [recv[d] * (c + 1) // chunks - recv[d] * c // chunks for d in range(ep_size)]


def test_rule_and_node_names(monkeypatch):
    assert rule_chunks(2, 512) == 2 and rule_chunks(8, 4096) == 8 and rule_chunks(2, 8192) == 4
    monkeypatch.setenv(RANKS_PER_NODE_VAR, "2")
    assert node_name(0) == node_name(1) != node_name(2)
    monkeypatch.setenv(RANKS_PER_NODE_VAR, "two")
    with pytest.raises(ValueError, match=RANKS_PER_NODE_VAR):
        node_name(0)


def chunked_case(seed, expert_kind, k, chunks, input_grad, tokens_per_rank, autocast=False):
    """The same layer and tokens with and without declared node boundaries: equal results."""
    import ds_comet.pipelines.reference as reference

    chunked_calls = []
    chunked_exchange = reference.chunked_exchange
    reference.chunked_exchange = lambda *args: chunked_calls.append(args[4]) or chunked_exchange(*args)
    try:
        results = _with_and_without_nodes(seed, expert_kind, k, chunks, input_grad, tokens_per_rank, autocast)
    finally:
        reference.chunked_exchange = chunked_exchange
    whole, chunked = results[None], results["1"]
    assert len(chunked_calls) == 1, chunked_calls  # the declared nodes' call, not the whole one
    assert whole.pop("ranks_per_node") is None and chunked.pop("ranks_per_node") is None
    assert whole.pop("chunks") == 1
    assert chunked.pop("chunks") == (chunks or rule_chunks(k, max(tokens_per_rank))), "declared nodes, chunks"
    assert_same_results(chunked, whole, autocast, seed)


def assert_same_results(got, want, autocast, seed):
    """``_layer_results`` of two ways to run one layer, equal: to fp32's rounding for other row counts
    (1e-5), or to bf16's under autocast."""
    for name, value in want.items():
        if value is None:
            assert got[name] is None, name
        elif autocast:
            # The experts' bf16 GEMMs round once per call, and the chunks call them on fewer rows: a
            # weight gradient is then a sum of rounded parts. Held to bf16's bound, as a whole.
            distance = rel(got[name], value)
            assert distance < 2e-2, (name, seed, distance)
        elif name in ("out", "input"):
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} (seed {seed})")
        else:  # a parameter's gradient, summed over the chunks in another order
            assert_parameter_grad_close(got[name], value, f"{name} (seed {seed})")


def _with_and_without_nodes(seed, expert_kind, k, chunks, input_grad, tokens_per_rank, autocast=False):
    results = {}
    for per_node in (None, "1"):
        moe = {"backend": "comet", "overlap": "none", "internode_chunks": chunks}
        results[per_node] = _layer_results(per_node, moe, seed, expert_kind, k, input_grad, tokens_per_rank, autocast)
    return results


def _layer_results(per_node, moe, seed, expert_kind, k, input_grad, tokens_per_rank, autocast=False):
    """One layer's output, input gradient and parameter gradients on this rank, with ``per_node``
    ranks a declared node (None: one host, one node), the "moe" section ``moe``, and the seed's
    weights and tokens; with the reference pipeline's chunks and ranks a node it forwards within."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if per_node is None:
        os.environ.pop(RANKS_PER_NODE_VAR, None)
    else:
        os.environ[RANKS_PER_NODE_VAR] = per_node
    try:
        torch.manual_seed(seed)
        layer = ds_comet.MoE(
            24,
            make_expert(expert_kind, 24, 40),
            num_experts=3 * world,
            ep_size=world,
            k=k,
            drop_tokens=False,
            config={"moe": moe},
        )
        layer.set_deepspeed_parallelism()
        reset_experts_(layer, seed)
        generator = torch.Generator().manual_seed(seed * 7 + rank)
        tokens = torch.randn(1, per_rank(tokens_per_rank, rank), 24, generator=generator)
        tokens.requires_grad_(input_grad)
        grad_out = torch.randn(tokens.shape, generator=generator)
        torch.manual_seed(seed + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, l_aux, _ = layer(tokens)
        torch.autograd.backward([out, l_aux], [grad_out, torch.tensor(0.01)])
        reference = layer.deepspeed_moe.pipelines.reference
        return dict(
            out=out.detach(),
            input=tokens.grad,
            **{name: p.grad for name, p in layer.named_parameters()},
            chunks=reference.chunks,
            ranks_per_node=reference.ranks_per_node,
        )
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)


@pytest.mark.parametrize(
    "expert_kind,k,chunks,input_grad,tokens_per_rank,autocast",
    [
        ("gelu", 2, 3, True, (40, 17), False),
        ("swiglu", 3, None, True, (33, 0), False),
        ("gelu", 1, 5, False, (9, 30), False),
        ("swiglu", 2, 3, True, (40, 25), True),
    ],
    ids=["gelu-k2-3chunks", "swiglu-k3-rule-empty-rank", "k1-5chunks-no-input-grad", "bf16-autocast"],
)
def test_chunked_exchange_equals_the_whole_one(cpu_pool, expert_kind, k, chunks, input_grad, tokens_per_rank, autocast):
    cpu_pool.run(
        chunked_case,
        seed=torch.randint(1, 10**6, ()).item(),
        expert_kind=expert_kind,
        k=k,
        chunks=chunks,
        input_grad=input_grad,
        tokens_per_rank=tokens_per_rank,
        autocast=autocast,
    )


def forwarding_case(seed, expert_kind, k, chunks, tokens_per_rank, autocast):
    """Two ranks a declared node: each token forwarded inside its destination nodes gives what sending
    it to each rank gives, outputs and every gradient; the rows a rank sends go to its own lane only."""
    import ds_comet.pipelines.reference as reference

    rank, world = dist.get_rank(), dist.get_world_size()
    results, splits = {}, []
    exchange = reference.exchange
    reference.exchange = lambda rows, send, recv, *rest: splits.append(list(send)) or exchange(rows, send, recv, *rest)
    try:
        for forwarding in (False, True):
            moe = {
                "backend": "comet",
                "overlap": "none",
                "internode_chunks": chunks,
                "internode_forwarding": forwarding,
            }
            splits.clear()
            results[forwarding] = _layer_results("2", moe, seed, expert_kind, k, True, tokens_per_rank, autocast)
    finally:
        reference.exchange = exchange
    assert results[False].pop("ranks_per_node") is None and results[True].pop("ranks_per_node") == 2
    assert results[False].pop("chunks") == results[True].pop("chunks") == chunks
    assert_same_results(results[True], results[False], autocast, seed)
    if chunks == 1:  # the exchanges between nodes reach this rank's lane only (rank % 2)
        between_nodes = splits[0]
        assert all(rows == 0 for peer, rows in enumerate(between_nodes) if peer % 2 != rank % 2), between_nodes
        assert len(splits) == 6, len(splits)  # rows, routes and return: between nodes, then inside one
    return world


@pytest.fixture(scope="module")
def pool_of_four():
    """Four gloo ranks, two a declared node: forwarding inside a node needs two nodes of two."""
    pool = DistPool(4)
    yield pool
    pool.stop()


@pytest.mark.parametrize(
    "expert_kind,k,chunks,tokens_per_rank,autocast",
    [
        ("gelu", 3, 1, (40, 17, 0, 25), False),
        ("swiglu", 2, 3, (33, 8, 21, 40), False),
        ("swiglu", 4, 2, (24, 30, 9, 16), True),
    ],
    ids=["gelu-k3-whole-empty-rank", "swiglu-k2-3chunks", "bf16-autocast-k4-2chunks"],
)
def test_forwarding_inside_nodes_equals_sending_to_each_rank(
    pool_of_four, expert_kind, k, chunks, tokens_per_rank, autocast
):
    assert (
        pool_of_four.run(
            forwarding_case,
            seed=torch.randint(1, 10**6, ()).item(),
            expert_kind=expert_kind,
            k=k,
            chunks=chunks,
            tokens_per_rank=tokens_per_rank,
            autocast=autocast,
        )
        == [4] * 4
    )


def test_a_stalled_rank_ends_forwarding_waits_with_an_error_naming_it(pool_of_four):
    try:
        answers = pool_of_four.run(stalled_rank_case, per_node="2", forwarding=True)
    finally:
        pool_of_four.stop()  # exchanges are still posted: the next test starts afresh
    assert answers[1] is None
    for message, waited in answers[:1] + answers[2:]:
        assert "blocks.1.moe" in message and "global rank(s) 1 of the group did not report" in message, message
        assert 2.0 <= waited < 7.0, waited  # the bound and the search for the stalled rank, not its 8 s


def autoep_chunked_case(seed):
    """AutoEP on ds_comet across declared nodes (one rank a node) against AutoEP itself."""
    import ds_comet.pipelines.reference as reference
    from tests.support.autoep_models import gradients_case

    chunked_exchange, calls = reference.chunked_exchange, []
    reference.chunked_exchange = lambda *args: calls.append(args[4]) or chunked_exchange(*args)
    os.environ[RANKS_PER_NODE_VAR] = "1"
    try:
        result = gradients_case("mixtral", seed)
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)
        reference.chunked_exchange = chunked_exchange
    assert calls and all(chunks > 1 for chunks in calls), calls
    return result


def test_autoep_layers_across_declared_nodes_match_autoep(cpu_pool):
    pytest.importorskip("transformers")
    for errors, loss_diff, _ in cpu_pool.run(autoep_chunked_case, seed=torch.randint(1, 10**6, ()).item()):
        worst = max(errors.items(), key=lambda item: item[1]["comet_vs_autoep"])
        assert worst[1]["comet_vs_autoep"] < 1e-5 and loss_diff < 1e-5, (worst, loss_diff)


def stalled_rank_case(per_node, forwarding=False):
    """Rank 1 stalls inside its experts (chunk 2 of 3 across declared nodes, else the whole call):
    every other rank's wait for the rows coming back must end within wait_timeout_s, naming rank 1."""
    import time

    from ds_comet.kernels.ops import CometWaitTimeout

    rank, world = dist.get_rank(), dist.get_world_size()
    if per_node:
        os.environ[RANKS_PER_NODE_VAR] = per_node
    try:
        moe = {
            "backend": "comet",
            "overlap": "none",
            "internode_chunks": 3,
            "wait_timeout_s": 2.0,
            "internode_forwarding": forwarding,
        }
        layer = ds_comet.MoE(
            24,
            make_expert("gelu", 24, 40),
            num_experts=2 * world,
            ep_size=world,
            k=2,
            drop_tokens=False,
            config={"moe": moe},
        )
        layer.set_deepspeed_parallelism()
        layer.deepspeed_moe.pipelines.name = "blocks.1.moe"
        calls = []
        if rank == 1:
            # Each chunk calls the rank's two experts in turn: the third call is chunk 2's first.
            stall_at = 3 if per_node else 1

            def stall(module, args):
                calls.append(module)
                if len(calls) == stall_at:
                    time.sleep(8.0)

            for expert in layer.deepspeed_moe.experts.deepspeed_experts:
                expert.register_forward_pre_hook(stall)
        tokens = torch.randn(1, 30, 24)
        if rank == 1:
            try:
                layer(tokens)
            except CometWaitTimeout:
                # Forwarding: rank 1 meets its peers' next exchange only after they gave up and left.
                if not forwarding:
                    raise
            return None
        start = time.monotonic()
        with pytest.raises(CometWaitTimeout) as raised:
            layer(tokens)
        return str(raised.value), time.monotonic() - start
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)


@pytest.mark.parametrize("per_node", [None, "1"], ids=["whole", "chunks"])
def test_a_stalled_rank_ends_its_peers_waits_with_an_error_naming_it(cpu_pool, per_node):
    try:
        answers = cpu_pool.run(stalled_rank_case, per_node=per_node)
    finally:
        cpu_pool.stop()  # exchanges are still posted: the next test starts afresh
    assert answers[1] is None
    for message, waited in answers[:1] + answers[2:]:
        assert "blocks.1.moe" in message and "global rank(s) 1 of the group did not report" in message, message
        assert "back from their experts' ranks" in message and ("chunk 2 of 3" in message) == bool(per_node), message
        # The bound (2 s) and the search for the stalled rank (at most as long again), not rank 1's 8 s.
        assert 2.0 <= waited < 7.0, waited


def checkpointed_case(seed, hooks_on):
    """Across declared nodes, under saved-tensor hooks on the ranks in ``hooks_on``: on every rank,
    the rows go whole and the results are those of the run without nodes; on some ranks only, every
    rank raises the same clear error before any row moves."""
    import ds_comet.pipelines.reference as reference

    rank, world = dist.get_rank(), dist.get_world_size()
    moe = {"backend": "comet", "overlap": "none", "internode_chunks": 3}
    chunked_exchange, calls = reference.chunked_exchange, []
    reference.chunked_exchange = lambda *args: calls.append(args[4]) or chunked_exchange(*args)
    results = {}
    try:
        for per_node in (None, "1"):
            if per_node:
                os.environ[RANKS_PER_NODE_VAR] = per_node
            torch.manual_seed(seed)
            layer = ds_comet.MoE(
                24,
                make_expert("gelu", 24, 40),
                num_experts=2 * world,
                ep_size=world,
                k=2,
                drop_tokens=False,
                config={"moe": moe},
            )
            layer.set_deepspeed_parallelism()
            layer.deepspeed_moe.pipelines.name = "blocks.2.moe"
            reset_experts_(layer, seed)
            tokens = torch.randn(1, 20 + 7 * rank, 24, generator=torch.Generator().manual_seed(seed + rank))
            tokens.requires_grad_(True)
            try:
                if per_node and rank in hooks_on:
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                        out, _, _ = layer(tokens)
                else:
                    out, _, _ = layer(tokens)
            except RuntimeError as error:
                return str(error)
            out.pow(2).sum().backward()
            results[per_node] = [out.detach(), tokens.grad] + [p.grad for p in layer.parameters()]
    finally:
        os.environ.pop(RANKS_PER_NODE_VAR, None)
        reference.chunked_exchange = chunked_exchange
    assert calls == [], calls  # under the hooks the rows went whole
    for whole, nodes in zip(results[None], results["1"]):
        torch.testing.assert_close(nodes, whole, rtol=1e-5, atol=1e-6)
    return None


def test_saved_tensor_hooks_on_every_rank_send_the_rows_whole(cpu_pool):
    world = cpu_world_size()
    assert (
        cpu_pool.run(checkpointed_case, seed=torch.randint(1, 10**6, ()).item(), hooks_on=list(range(world)))
        == [None] * world
    )


def test_saved_tensor_hooks_on_some_ranks_only_are_an_error_on_every_rank(cpu_pool):
    messages = cpu_pool.run(checkpointed_case, seed=torch.randint(1, 10**6, ()).item(), hooks_on=[0])
    for message in messages:
        assert message and "blocks.2.moe" in message and "different numbers of chunks" in message, messages
        assert "ranks [0] run it under saved-tensor hooks" in message, message
