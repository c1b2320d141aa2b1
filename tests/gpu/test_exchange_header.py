"""The fused pipeline's exchange headers on GPUs (one NCCL rank per visible GPU): ranks that are not in
the same exchange stop in the exchange kernel, before any row moves, with an error naming the field
that differs, on every rank. Skipped without CUDA or with one GPU.

Each case ends with every rank's CUDA context stopped (the kernel traps, as a wait that gives up does;
docs/troubleshooting.md, "Ranks sharing a GPU", on a synchronize after it), so the pool restarts
after each.
"""

import time

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.experts import FeedForward
from ds_comet.kernels.ops import CometWaitTimeout

HIDDEN, FFN = 256, 512
# How long a rank waits for its kernel's error record (the kernel stops within wait_timeout_s, 5 s).
RECORD_WAIT_S = 30.0


def fused_layers(*names):
    """Layers named ``names``, alike (so one workspace serves them all), on the fused pipeline, bf16."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    config = {"moe": {"backend": "comet", "overlap": "fused", "wait_timeout_s": 5.0}}
    layers = []
    for name in names:
        layer = ds_comet.MoE(HIDDEN, FeedForward(HIDDEN, FFN), num_experts=2 * world, ep_size=world, k=1, config=config)
        layer.set_deepspeed_parallelism()
        layer.deepspeed_moe.pipelines.name = name
        layers.append(layer.to(device=device, dtype=torch.bfloat16))
    return layers


def tokens() -> torch.Tensor:
    device = torch.device("cuda", torch.cuda.current_device())
    return torch.randn(1, 64, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)


def step(*layers, synchronize=True):
    x = tokens()
    for layer in layers:
        x = layer(x)[0]
    x.float().sum().backward()
    if synchronize:
        torch.cuda.synchronize()


def stopped(layer, call) -> str:
    """The error of ``call`` once the exchange kernel stopped: the fused pipeline's ``CometWaitTimeout``.

    It waits for the kernel's error record (pinned host memory, filled before the kernel traps), not
    for the device: with two ranks time-sliced on one GPU (DS_COMET_TEST_RANKS_PER_GPU=2), once both
    ranks' kernels stopped on the header, one rank's synchronize was seen never to return
    (docs/troubleshooting.md, "Ranks sharing a GPU").
    """
    fused = layer.deepspeed_moe.pipelines.fused
    try:
        call()
    except RuntimeError:
        pass
    deadline = time.monotonic() + RECORD_WAIT_S
    while fused.workspace.failed_wait() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if fused.workspace.failed_wait() is None:
        pytest.fail(f"rank {dist.get_rank()}: no kernel filled its error record within {RECORD_WAIT_S:.0f} s")
    with pytest.raises(CometWaitTimeout) as raised:
        fused.raise_if_failed()
    return str(raised.value)


def layer_order_case():
    """After a step through A then B, rank 1 calls B first, the others A."""
    first, second = fused_layers("blocks.0.moe", "blocks.1.moe")
    step(first, second)
    assert first.deepspeed_moe.pipelines.reason is None  # the fused pipeline
    layer = second if dist.get_rank() == 1 else first
    return stopped(layer, lambda: layer(tokens()))


def backward_alone_case():
    """Rank 0 runs the backward of a call; the others go on to the next forward."""
    (layer,) = fused_layers("blocks.2.moe")
    step(layer)
    output = layer(tokens())[0]
    if dist.get_rank() == 0:
        return stopped(layer, lambda: output.float().sum().backward())
    return stopped(layer, lambda: layer(tokens()))


def evaluation_alone_case():
    """After a step, rank 0 alone runs an evaluation forward; the others their next training step."""
    (layer,) = fused_layers("blocks.3.moe")
    step(layer)
    if dist.get_rank() == 0:
        layer.eval()
        with torch.no_grad():
            return stopped(layer, lambda: layer(tokens()))
    return stopped(layer, lambda: step(layer, synchronize=False))


@pytest.mark.parametrize(
    "case, field",
    [(layer_order_case, "layer"), (backward_alone_case, "call"), (evaluation_alone_case, "direction")],
)
def test_ranks_in_different_exchanges_stop_with_the_field_named(gpu_pool, case, field):
    if gpu_pool.world_size < 2:
        pytest.skip("needs two GPUs")
    try:
        messages = gpu_pool.run(case, timeout=60)
    finally:
        gpu_pool.stop()  # every rank's CUDA context is stopped
    for message in messages:
        assert "exchange header differs from group rank" in message, message
        assert "not in the same exchange" in message and "this rank's last call" in message, message
    # The field that differs first in the header's order: the layer, then the call, then the direction.
    assert any(f"in its {field}:" in message for message in messages), messages
