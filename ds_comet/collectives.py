"""A training script's own collectives, bounded as the MoE layers' waits are, and the process groups' timeout.

The MoE layers bound each wait on their group by ``"moe": {"wait_timeout_s"}`` and name the ranks
that stalled (``pipelines/collective_waits.py``). Around them a training script runs collectives
of its own (a checkpoint's hashes and renames, a loss summed over the ranks) and DeepSpeed's
(gradients reduced inside ``engine.backward`` and ``engine.step``, the barriers of
``engine.save_checkpoint``). A rank that stops between two of them leaves its peers in the next
one for the process group's timeout (DeepSpeed's default: 30 minutes), with an error that names
neither the rank nor the step. Here:

- ``set_wait_timeout(seconds)`` (``ds_comet.launch.init_distributed`` calls it with the ds_config's
  ``wait_timeout_s``) sets the bound of the functions below, and the timeout of every process
  group, those made later included (DeepSpeed's expert groups): ``process_group_timeout``, twice
  the bound and 10 s more, so that a layer's wait and its roll call end before torch's NCCL
  watchdog would abort the process.
- ``all_reduce``, ``all_gather_object`` and ``barrier`` are collectives of the default group whose
  waits end after the bound, with the roll call's error naming the ranks that did not come
  (``CometWaitTimeout``) or whose process ended (``PeerLost``).
- ``peers_named(where)`` wraps code that runs DeepSpeed's collectives (a training step,
  ``engine.save_checkpoint``): a collective there that fails or times out at the process group's
  timeout is raised again after the same roll call, naming the ranks that stalled; an error of
  this rank's own is noted for its peers, as a layer notes one. On NCCL, torch's watchdog ends a
  rank stuck in DeepSpeed's collectives at the process group's timeout with NCCL's message, before
  any Python code could name the ranks: there the bound holds, the names do not.

Usage::

    ds_comet.launch.init_distributed(ds_config=ds_config)  # calls set_wait_timeout
    with collectives.peers_named(f"training step {step}"):
        engine.backward(loss)
        engine.step()
    collectives.all_reduce(losses, f"training step {step}", "the losses of the other ranks")
"""

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
from torch.distributed import distributed_c10d

from .config import DEFAULT_WAIT_TIMEOUT_S
from .kernels.ops import CometWaitTimeout
from .pipelines.collective_waits import CollectiveWaits, gather_objects, post_failure, process_group_timeout_s

# What the process groups raise when a collective cannot complete (besides torch's DistError): a
# peer's connection closed or reset (gloo's transport), or the process group's timeout passed.
COLLECTIVE_FAILURES = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "pair closure",
    "Timed out waiting",
    "NCCL error",
)

_wait_timeout_s = DEFAULT_WAIT_TIMEOUT_S


def process_group_timeout(wait_timeout_s: float) -> timedelta:
    """The process groups' timeout for a bound of ``wait_timeout_s``: a layer's wait and the roll
    call after it (as long again, and the store's slack) end first."""
    return timedelta(seconds=process_group_timeout_s(wait_timeout_s))


def set_wait_timeout(wait_timeout_s: float) -> timedelta:
    """Bounds this process's waits in the functions below by ``wait_timeout_s`` seconds, and sets
    the timeout of its process groups, those made from now on included, to
    ``process_group_timeout(wait_timeout_s)``.

    Returns:
        The process groups' timeout.
    """
    global _wait_timeout_s
    if not wait_timeout_s > 0:
        raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s}")
    _wait_timeout_s = float(wait_timeout_s)
    timeout = process_group_timeout(wait_timeout_s)
    # torch gives a group made without a timeout its backend's default, read when the group is
    # made: DeepSpeed makes its expert-parallel groups so.
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    if torch.distributed.is_initialized():
        for group in list(distributed_c10d._world.pg_map):
            if not distributed_c10d._rank_not_in_group(group):
                distributed_c10d._set_pg_timeout(timeout, group)
    return timeout


def wait_timeout_s() -> float:
    """The bound of this process's waits here (``set_wait_timeout``; 240 s until it is called)."""
    return _wait_timeout_s


def _waits(where: str) -> CollectiveWaits:
    return CollectiveWaits(None, _wait_timeout_s, where, members="the job", stopped="did not come to this collective")


def all_reduce(tensor: torch.Tensor, where: str, what: str) -> None:
    """Sums ``tensor`` over the ranks in place (collective, on the default group), waiting at most
    the bound; ``where`` (the step of the script) and ``what`` (the values) name the wait in the error.

    Raises:
        CometWaitTimeout: a rank did not come within the bound (``PeerLost``: a rank's process ended).
    """
    work = torch.distributed.all_reduce(tensor, async_op=True)
    _waits(where).wait(work, what, tensor.is_cuda, read_back=True)


def all_gather_object(obj, where: str, what: str) -> list:
    """Every rank's ``obj`` (picklable), by rank (collective, on the default group), waiting at most
    the bound; raises as ``all_reduce``."""
    return gather_objects(obj, _waits(where), what)


def barrier(where: str) -> None:
    """Waits for every rank (collective), at most the bound; raises as ``all_reduce``."""
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    all_reduce(torch.zeros(1, device=device), where, "the other ranks")


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a process group's report of a collective that could not complete."""
    if isinstance(error, torch.distributed.DistError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in COLLECTIVE_FAILURES)


@contextlib.contextmanager
def peers_named(where: str) -> Iterator[None]:
    """Runs the block, in which DeepSpeed's collectives (or any others) run (see the module's docstring).

    A collective of the block that fails, or times out at the process group's timeout, raises
    ``CometWaitTimeout`` (``PeerLost`` for a failure) naming ``where`` and, after the roll call, the
    ranks that do not wait with this one. Any other exception is noted for the peers (as a layer
    notes one) and raised unchanged.
    """
    start = time.monotonic()
    try:
        yield
    except CometWaitTimeout:
        raise
    except Exception as error:
        if not is_collective_failure(error):
            post_failure(where, error, torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
            raise
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        bound_s = process_group_timeout(_wait_timeout_s).total_seconds()
        waited = min(time.monotonic() - start, bound_s)
        what = (
            f"a collective of DeepSpeed's or torch's inside it (bounded by the process groups' timeout, {bound_s:g} s)"
        )
        _waits(where).give_up(waited, what, error, failed=not timed_out)
