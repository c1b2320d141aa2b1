"""Ranks of an expert-parallel group that build or call a layer differently get a named error on
every rank before any rows are exchanged, not a crash or wrong numbers."""

import re

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.experts import FeedForward
from ds_comet.pipelines.selection import GroupDisagreement
from tests.support.dist_pool import cpu_world_size

COMET = {"moe": {"backend": "comet", "overlap": "none"}}


def disagreement_case(field):
    """Every rank builds the layer, rank 1 with ``field`` different; returns each rank's error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden = 32 if field == "hidden size" and rank == 1 else 16
    k = 2 if field == "k" and rank == 1 else 1
    capacity = 2.0 if field == "capacity_factor" and rank == 1 else 1.0
    layer = ds_comet.MoE(
        hidden,
        FeedForward(hidden, 24),
        num_experts=2 * world,
        ep_size=world,
        k=k,
        capacity_factor=capacity,
        config=COMET,
    )
    layer.set_deepspeed_parallelism()
    dtype = torch.float64 if field == "dtype" and rank == 1 else torch.float32
    layer.to(dtype)
    with pytest.raises(GroupDisagreement) as raised:
        layer(torch.randn(1, 8, hidden, dtype=dtype))
    return str(raised.value)


@pytest.mark.parametrize("field", ["k", "capacity_factor", "hidden size", "dtype"])
def test_ranks_that_disagree_get_the_field_values_and_ranks(cpu_pool, field):
    messages = cpu_pool.run(disagreement_case, field=field)
    assert len(set(messages)) == 1, messages  # every rank raises the same error
    assert f"disagree on {field} (" in messages[0] and "ranks [1]" in messages[0], messages[0]


def oversized_ep_case():
    world = dist.get_world_size()
    layer = ds_comet.MoE(16, FeedForward(16, 24), num_experts=4 * world, ep_size=2 * world, k=1, config=COMET)
    with pytest.raises(ValueError, match=f"ep_size={2 * world} does not divide the {world} ranks"):
        layer.set_deepspeed_parallelism()


def test_ep_size_larger_than_the_world_is_named(cpu_pool):
    cpu_pool.run(oversized_ep_case)


def named_layer(name, overlap="none"):
    """A layer named ``name``, whose waits end after 2 s, built by every rank."""
    world = dist.get_world_size()
    config = {"moe": {"backend": "comet", "overlap": overlap, "wait_timeout_s": 2.0}}
    layer = ds_comet.MoE(16, FeedForward(16, 24), num_experts=2 * world, ep_size=world, k=1, config=config)
    layer.set_deepspeed_parallelism()
    layer.deepspeed_moe.pipelines.name = name
    return layer


def called_layer(name):
    """``named_layer``, called once by every rank."""
    layer = named_layer(name)
    layer(torch.randn(1, 8, 16))
    return layer


def call_alone_on_rank_0(layer):
    """Rank 0 calls ``layer`` while its peers return: (rank 0's error, how long it waited); None elsewhere."""
    import time

    from ds_comet.kernels.ops import CometWaitTimeout

    if dist.get_rank() != 0:
        return None
    start = time.monotonic()
    with pytest.raises(CometWaitTimeout) as raised:
        layer(torch.randn(1, 8, 16))
    return str(raised.value), time.monotonic() - start


def stopped_peer_case():
    """Both ranks call the layer, then rank 0 calls it once more alone: its wait must end with an
    error naming the layer within the section's wait_timeout_s, not the process group's timeout."""
    return call_alone_on_rank_0(called_layer("blocks.3.moe"))


def first_call_alone_case():
    """Rank 0 makes the layer's first call alone (its peers stall before theirs): the group's
    agreement must end within wait_timeout_s with an error naming the layer."""
    return call_alone_on_rank_0(named_layer("blocks.4.moe", overlap="auto"))


def rank_0_alone(cpu_pool, case):
    """``case``'s answer on rank 0, checked to name the other ranks and to come after the bound."""
    try:
        message, waited = cpu_pool.run(case)[0]
    finally:
        cpu_pool.stop()  # rank 0's collective is still posted: the next test starts afresh
    # The other ranks returned from the test function and report no wait of their own: they are named.
    others = ", ".join(str(rank) for rank in range(1, cpu_world_size()))
    assert f"global rank(s) {others} of the group did not report" in message, message
    # The behaviour under test is the bound itself: 2 s asked for, the pool's group timeout is 120 s.
    assert 2.0 <= waited < 60.0, waited
    return message


def test_a_peer_that_stops_calling_ends_the_wait_with_a_named_error(cpu_pool):
    message = rank_0_alone(cpu_pool, stopped_peer_case)
    assert "blocks.3.moe" in message and "exchange headers" in message and "wait_timeout_s" in message, message


def test_a_first_call_whose_peers_stall_ends_with_a_named_error(cpu_pool):
    message = rank_0_alone(cpu_pool, first_call_alone_case)
    assert "blocks.4.moe" in message and "the group's agreement at its first call" in message, message


def raising_peer_case():
    """Both ranks call the layer; in the next call every rank but 0 raises before its first
    exchange (as a rank out of memory would): rank 0's error must say why, not only who."""
    import ds_comet.pipelines.reference as reference
    from ds_comet.kernels.ops import CometWaitTimeout

    rank = dist.get_rank()
    layer = called_layer("blocks.5.moe")
    if rank != 0:
        planned = reference.plan_rank_rows

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError(f"stand-in: rank {rank} ran out of memory")

        reference.plan_rank_rows = out_of_memory
        try:
            with pytest.raises(torch.OutOfMemoryError):
                layer(torch.randn(1, 8, 16))
        finally:
            reference.plan_rank_rows = planned
        return None
    with pytest.raises(CometWaitTimeout) as raised:
        layer(torch.randn(1, 8, 16))
    return str(raised.value)


def gate_raising_peer_case():
    """Both ranks call the layer; in the next call every rank but 0 feeds fewer tokens than the
    gate's min_capacity, which stock's gate refuses before any exchange: rank 0's error must quote it."""
    from ds_comet.kernels.ops import CometWaitTimeout

    layer = called_layer("blocks.6.moe")  # min_capacity 4, k 1
    if dist.get_rank() != 0:
        with pytest.raises(AssertionError, match="min_capacity"):
            layer(torch.randn(1, 2, 16))
        return None
    with pytest.raises(CometWaitTimeout) as raised:
        layer(torch.randn(1, 8, 16))
    return str(raised.value)


def test_a_peer_whose_gate_raises_is_named_with_its_error(cpu_pool):
    try:
        message = cpu_pool.run(gate_raising_peer_case)[0]
    finally:
        cpu_pool.stop()
    for rank in range(1, cpu_world_size()):
        assert f"global rank {rank} raised in blocks.6.moe: AssertionError: No. of tokens" in message, message


def test_a_peer_that_raises_is_named_with_its_error(cpu_pool):
    try:
        message = cpu_pool.run(raising_peer_case)[0]
    finally:
        cpu_pool.stop()  # rank 0's exchange is still posted, and the notes stay in the group's store
    for rank in range(1, cpu_world_size()):
        assert (
            f"global rank {rank} raised in blocks.5.moe: OutOfMemoryError: stand-in: rank {rank} ran out of memory"
        ) in message, message


def gate_hooked_on_one_rank_case():
    """Rank 0's gate (top-2 without dropping, whose stock forward all-reduces a capacity over the
    group) has a hook from before the first call, its peers' none: every rank must take stock's
    forward, or the ranks' collectives would pair wrongly. Returns how often each rank ran it."""
    from deepspeed.moe.sharded_moe import TopKGate

    world = dist.get_world_size()
    config = {"moe": {"backend": "comet", "overlap": "none", "wait_timeout_s": 5.0}}
    layer = ds_comet.MoE(
        16, FeedForward(16, 24), num_experts=2 * world, ep_size=world, k=2, drop_tokens=False, config=config
    )
    layer.set_deepspeed_parallelism()
    gate = layer.deepspeed_moe.gate
    seen = []
    if dist.get_rank() == 0:
        gate.register_forward_hook(lambda module, args, output: seen.append(1))
    calls = []
    stock_forward = TopKGate.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return stock_forward(self, *args, **kwargs)

    TopKGate.forward = counted
    try:
        for _ in range(2):
            layer(torch.randn(1, 8, 16))
    finally:
        TopKGate.forward = stock_forward
    return len(calls), len(seen)


def test_a_gate_hooked_on_one_rank_sends_every_rank_through_stocks_forward(cpu_pool):
    counts = cpu_pool.run(gate_hooked_on_one_rank_case)
    assert counts[0] == (2, 2), counts  # rank 0's hooks ran at every call
    assert all(calls == 2 for calls, _ in counts), counts


def ep_sizes_case(through_initialize):
    """Rank 1 builds its MoE layer with ep_size 1, the others with the world size: DeepSpeed would
    make different groups on each and wait in new_group forever. Returns each rank's error."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_size = 1 if rank == 1 else world
    config = {"moe": {"backend": "deepspeed" if through_initialize else "comet", "wait_timeout_s": 5.0}}
    layer = ds_comet.build_moe(
        config, hidden_size=16, expert=FeedForward(16, 24), num_experts=2 * world, ep_size=ep_size
    )
    if not through_initialize:
        with pytest.raises(ValueError) as raised:
            layer.set_deepspeed_parallelism()
        return str(raised.value)
    model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([layer])})
    config.update(train_micro_batch_size_per_gpu=1, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(ValueError) as raised:
        ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)
    return str(raised.value)


@pytest.mark.parametrize("through_initialize", [False, True], ids=["set_deepspeed_parallelism", "initialize"])
def test_ranks_whose_layers_differ_in_ep_size_are_named_before_deepspeed_makes_groups(cpu_pool, through_initialize):
    world = cpu_world_size()
    messages = cpu_pool.run(ep_sizes_case, through_initialize=through_initialize, timeout=60)
    assert len(set(messages)) == 1, messages  # every rank raises the same error
    name = "blocks.0" if through_initialize else "MoE layer"
    assert re.search(
        rf"the ranks build MoE layer 1 of 1 with different ep_size \(rank 0: {name}[ \d]* has ep_size={world}, "
        rf"rank 1: {name}[ \d]* has ep_size=1",
        messages[0],
    ), messages[0]


def raised_then_exited_case(answer_file):
    """Both ranks call the layer; then every rank but 0 raises inside the next call (noted for its
    peers, as an out-of-memory error is) and its process ends, as a script's does when nothing
    catches the error. Rank 0, in the call's exchange, writes its error to ``answer_file``."""
    import os

    import ds_comet.pipelines.reference as reference

    rank = dist.get_rank()
    layer = called_layer("blocks.8.moe")
    if rank != 0:

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError(f"stand-in: rank {rank} ran out of memory")

        reference.plan_rank_rows = out_of_memory
        try:
            layer(torch.randn(1, 8, 16))
        finally:
            os._exit(1)
    try:
        layer(torch.randn(1, 8, 16))
    except Exception as error:
        with open(answer_file, "w") as handle:
            handle.write(f"{type(error).__name__}: {error}")


def test_a_peer_whose_process_ended_is_named_with_its_note(cpu_pool, tmp_path):
    answer = tmp_path / "rank0.txt"
    try:
        with pytest.raises(AssertionError, match=r"process ended \(exit code 1\)"):
            cpu_pool.run(raised_then_exited_case, answer_file=str(answer), timeout=60)
    finally:
        cpu_pool.stop()
    message = answer.read_text()
    others = ", ".join(str(rank) for rank in range(1, cpu_world_size()))
    assert message.startswith("PeerLost: ds_comet: blocks.8.moe: rank 0 of its expert-parallel group (global ranks "), (
        message
    )
    assert "the collective failed after" in message and "Connection" in message, message
    assert f"global rank(s) {others} of the group did not report a wait of their own" in message, message
    assert "their process ended" in message, message
    for rank in range(1, cpu_world_size()):
        assert (
            f"global rank {rank} raised in blocks.8.moe: OutOfMemoryError: stand-in: rank {rank} ran out of memory"
            in message
        ), message
