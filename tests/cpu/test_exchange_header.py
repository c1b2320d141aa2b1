"""Ranks that are not in the same exchange of an MoE layer (another layer, another call, a backward
or an evaluation forward of their own, a setting changed alone) get the same named error on every
rank, before any row moves: not rows of another layer in their sums, nor gloo's SIGABRT."""

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.experts import FeedForward
from ds_comet.pipelines.exchange_header import (
    BACKWARD,
    FORWARD_TRAINING,
    WORD_RANGE,
    ExchangeMismatch,
    LayerHeaders,
    setting_differences,
    stable_hash,
)
from tests.support.dist_pool import cpu_world_size

HIDDEN = 16


def group_layers(*names, **moe_kwargs):
    """Layers named ``names``, alike, built by every rank on one expert-parallel group of their own (all
    ranks), their waits bounded at 5 s."""
    world = dist.get_world_size()
    group = torch.distributed.new_group(list(range(world)))
    config = {"moe": {"backend": "comet", "overlap": "none", "wait_timeout_s": 5.0}}
    layers = []
    for name in names:
        layer = ds_comet.MoE(HIDDEN, FeedForward(HIDDEN, 24), num_experts=2 * world, ep_size=world, config=config)
        layer.deepspeed_moe._set_ep_group(group)
        layer.deepspeed_moe.pipelines.name = name
        layers.append(layer)
    return layers


def step(*layers):
    """A training step through ``layers`` in order: forward, then backward."""
    x = torch.randn(1, 8, HIDDEN, requires_grad=True)
    for layer in layers:
        x = layer(x)[0]
    x.sum().backward()


def mismatch(call) -> str:
    with pytest.raises(ExchangeMismatch) as raised:
        call()
    return str(raised.value)


def layer_order_case():
    """After a step through A then B, rank 1 calls B first: every rank raises, naming both layers."""
    first, second = group_layers("blocks.0.moe", "blocks.1.moe")
    step(first, second)
    layer = second if dist.get_rank() == 1 else first
    return mismatch(lambda: layer(torch.randn(1, 8, HIDDEN)))


def test_layers_called_in_another_order_are_named(cpu_pool):
    messages = cpu_pool.run(layer_order_case)
    for message in messages:
        assert "not in the same exchange" in message, message
        assert "rank 1: blocks.1.moe, forward (training) of call 2" in message, message
        assert "blocks.0.moe, forward (training) of call 2" in message, message


def backward_alone_case():
    """Rank 0 runs the backward of a call; the others go on to the next forward."""
    (layer,) = group_layers("blocks.2.moe")
    output = layer(torch.randn(1, 8, HIDDEN, requires_grad=True))[0]
    if dist.get_rank() == 0:
        return mismatch(lambda: output.sum().backward())
    return mismatch(lambda: layer(torch.randn(1, 8, HIDDEN)))


def test_a_backward_on_one_rank_alone_is_named(cpu_pool):
    messages = cpu_pool.run(backward_alone_case)
    assert len(set(messages)) == 1, messages
    assert "rank 0: blocks.2.moe, backward of call 1" in messages[0], messages[0]
    assert "blocks.2.moe, forward (training) of call 2" in messages[0], messages[0]


def evaluation_alone_case():
    """After a training step, rank 0 alone runs an evaluation forward; the others their next step."""
    (layer,) = group_layers("blocks.3.moe")
    step(layer)
    if dist.get_rank() == 0:
        layer.eval()
        with torch.no_grad():
            return mismatch(lambda: layer(torch.randn(1, 8, HIDDEN)))
    return mismatch(lambda: step(layer))


def test_an_evaluation_forward_on_one_rank_alone_is_named(cpu_pool):
    messages = cpu_pool.run(evaluation_alone_case)
    assert len(set(messages)) == 1, messages
    assert "rank 0: blocks.3.moe, forward (evaluation) of call 2" in messages[0], messages[0]
    assert "blocks.3.moe, forward (training) of call 2" in messages[0], messages[0]


def changed_setting_case():
    """After a step, rank 1 alone changes its gate's capacity factor."""
    (layer,) = group_layers("blocks.7.moe")
    step(layer)
    if dist.get_rank() == 1:
        layer.deepspeed_moe.gate.capacity_factor = 2.0
    return mismatch(lambda: step(layer))


def test_a_setting_changed_on_one_rank_after_the_first_call_is_named(cpu_pool):
    messages = cpu_pool.run(changed_setting_case)
    assert len(set(messages)) == 1, messages
    others = list(range(cpu_world_size()))
    others.remove(1)
    assert f"they disagree on capacity_factor (ranks {others}: 1.0; ranks [1]: 2.0)" in messages[0], messages[0]
    assert "blocks.7.moe, forward (training) of call 2" in messages[0], messages[0]


def healthy_steps_case():
    """Steps, an evaluation forward and gradient accumulation on every rank alike raise nothing."""
    first, second = group_layers("blocks.8.moe", "blocks.9.moe")
    for _ in range(2):
        step(first, second)
    for layer in (first, second):
        layer.eval()
        with torch.no_grad():
            layer(torch.randn(1, 8, HIDDEN))
        layer.train()
    outputs = [first(torch.randn(1, 8, HIDDEN, requires_grad=True))[0] for _ in range(2)]
    for output in reversed(outputs):
        output.sum().backward()
    return first.deepspeed_moe.pipelines.headers.calls


def test_ranks_in_the_same_exchanges_raise_nothing(cpu_pool):
    assert cpu_pool.run(healthy_steps_case) == [5] * cpu_world_size()


def test_the_header_words_fit_int32_and_do_not_depend_on_the_process():
    assert stable_hash("blocks.0.moe") == 504639575  # blake2b, not Python's salted hash()
    headers = LayerHeaders()
    header = headers.begin_call("blocks.0.moe", True, "key", lambda: (("k", 1),))
    assert header.words() == [stable_hash("blocks.0.moe"), 1, FORWARD_TRAINING, stable_hash("(('k', 1),)")]
    assert header.backward().words()[2] == BACKWARD
    assert all(0 <= word < WORD_RANGE for word in header.words())
    read = []
    headers.begin_call("blocks.0.moe", True, "key", lambda: read.append(1) or ())
    assert not read and headers.calls == 2  # the same key: the digest is not made again


def test_setting_differences_name_every_field_that_differs():
    settings = [(("k", 1), ("capacity_factor", 1.0)), (("k", 1), ("capacity_factor", 2.0))]
    assert setting_differences(settings) == ["capacity_factor (ranks [0]: 1.0; ranks [1]: 2.0)"]
