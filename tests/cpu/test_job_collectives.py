"""ds_comet.collectives: a training script's own collectives, bounded as the MoE layers' waits are,
and the process groups' timeout taken from the same "wait_timeout_s".

(The example's runs in tests/cpu/test_example.py show the whole: a rank that stops inside a training
step ends its peers' waits in DeepSpeed's collectives by name.)
"""

from datetime import timedelta

import pytest
import torch
from deepspeed import comm as dist

from ds_comet import collectives
from ds_comet.training_metrics import sum_over_ranks


def process_group_timeouts_case():
    """The timeouts of the default group and of a group made afterwards, once set_wait_timeout(3)
    ran; the pool's own timeouts are put back after."""
    from torch.distributed import distributed_c10d

    def timeout_of(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    world = torch.distributed.group.WORLD
    before = (timeout_of(world), distributed_c10d.default_pg_timeout, collectives.wait_timeout_s())
    try:
        returned = collectives.set_wait_timeout(3.0)
        made_after = torch.distributed.new_group(list(range(dist.get_world_size())))
        return returned, timeout_of(world), timeout_of(made_after), collectives.wait_timeout_s()
    finally:
        distributed_c10d._set_pg_timeout(before[0], world)
        distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = before[1]
        collectives.set_wait_timeout(before[2])
        distributed_c10d._set_pg_timeout(before[0], world)


def test_the_process_groups_take_their_timeout_from_the_bound(cpu_pool):
    # Twice the bound and 10 s: a layer's wait and its roll call end before the process group gives up.
    expected = timedelta(seconds=16)
    for answer in cpu_pool.run(process_group_timeouts_case):
        assert answer == (expected, expected, expected, 3.0), answer


def stopped_before_the_metrics_case():
    """Every rank but 0 stops before the step's metrics are summed over the ranks: rank 0's wait
    ends after the bound (1 s) with an error naming them."""
    from ds_comet.kernels.ops import CometWaitTimeout

    collectives.set_wait_timeout(1.0)
    if dist.get_rank() != 0:
        return None
    with pytest.raises(CometWaitTimeout) as raised:
        sum_over_ranks([2.5, 0.1], torch.device("cpu"), "the metrics of step 5")
    return str(raised.value)


def test_a_rank_that_stops_before_the_metrics_is_named(cpu_pool):
    try:
        message = cpu_pool.run(stopped_before_the_metrics_case, timeout=60)[0]
    finally:
        cpu_pool.stop()  # rank 0's all-reduce is still posted on the default group
    others = ", ".join(str(rank) for rank in range(1, cpu_pool.world_size))
    assert (
        message.startswith("ds_comet: the metrics of step 5: rank 0 of the job (global ranks ")
        and "waited 1.0 s for the values of the other ranks" in message
    ), message
    assert (
        f"global rank(s) {others} of the group did not report a wait of their own within 1 s more: they did not "
        "come to this collective, raised, or are stuck"
    ) in message, message


def test_only_the_process_groups_reports_of_failed_collectives_are_taken_for_them():
    gloo_closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30353")
    gloo_timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    assert collectives.is_collective_failure(gloo_closed) and collectives.is_collective_failure(gloo_timeout)
    assert collectives.is_collective_failure(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    assert not collectives.is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not collectives.is_collective_failure(ValueError("Timed out waiting"))
