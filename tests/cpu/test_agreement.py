"""Ranks of an expert-parallel group that build or call a layer differently get a named error on
every rank before any rows are exchanged, not a crash or wrong numbers."""

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from ds_comet.experts import FeedForward
from ds_comet.pipelines.selection import GroupDisagreement

COMET = {"moe": {"backend": "comet", "overlap": "none"}}


def disagreement_case(field):
    """Every rank builds the layer, rank 1 with ``field`` different; returns each rank's error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden = 32 if field == "hidden size" and rank == 1 else 16
    k = 2 if field == "k" and rank == 1 else 1
    capacity = 2.0 if field == "capacity_factor" and rank == 1 else 1.0
    layer = ds_comet.MoE(hidden, FeedForward(hidden, 24), num_experts=2 * world, ep_size=world, k=k,
                         capacity_factor=capacity, config=COMET)
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
