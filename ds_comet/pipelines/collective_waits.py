"""Bounded waits on a layer's host-side collectives (the reference pipeline's, and the group's
agreement at a layer's first call), and an error that names the ranks that stalled.

A collective waits for every rank of its group. When one rank stops calling the layer (it raised,
returned early or is stuck in other work), its peers would wait out the process group's timeout,
30 minutes by default, and end with an error that names neither the layer nor the rank. Here each
wait the host makes is bounded by ``"moe": {"wait_timeout_s"}``. Past it, the rank reports where
it waits in the process group's store and looks, for as long again, for the reports of the
group's other ranks: a rank that reports is waiting too, and a rank that does not is the one that
stalled, which the error then names. A report carries the time it was written: one written before
this rank's wait began is a peer that gave up before this rank arrived, which says that this rank
is the one that fell behind.

A rank that raises inside a layer's call (a batch larger than the fused workspace, out of memory)
leaves its peers waiting in the same way. Before the exception leaves the layer, the rank notes its
message in the store (``post_failure``); a peer whose wait timed out, on either pipeline, adds the
notes of the group's other ranks to its error (``failure_notes``), so that the error says why, not
only who. The store is only used on these failure paths, never in a healthy call. A note carries
the time it was written, and a waiting rank reads only the notes written since one wait's length
before its own wait began: an error caught and survived long before is not blamed.
"""

import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch
from deepspeed import comm as dist

from ..kernels.ops import CometWaitTimeout

REPORT_KEY = "ds_comet/waiting/"  # + the global rank: when and where that rank gave up waiting
FAILURE_KEY = "ds_comet/raised/"  # + the global rank: the error that rank raised inside a layer's call
STORE_SLACK_S = 5.0  # beyond the bound, for the store's own answers, before the roll call is given up
Report = tuple[float, str]  # a rank's report of the wait it gave up: when (time.time()) and where


class CollectiveWaits:
    """The waits of one layer's reference pipeline on its expert-parallel ``group`` (None: the
    default group): ``timeout_s`` bounds each wait, and ``layer_name`` names the layer in the error.
    """

    def __init__(self, group, timeout_s: float, layer_name: str):
        self.group = group
        self.timeout_s = timeout_s
        self.layer_name = layer_name

    def wait(self, work, what: str, on_device: bool, read_back: bool = False) -> None:
        """Waits for ``work`` (an ``async_op`` collective of the group on tensors of the GPU when
        ``on_device``), at most ``timeout_s``.

        ``what`` says what the wait is for, in the error. On the GPU, unless the group is gloo's,
        the stream waits and the host does not, so a stalled peer is noticed at the next wait with
        ``read_back``: the host then also waits for the device to finish the collective and the
        work queued before it, as the read-back of its result would.
        """
        start = time.monotonic()
        if on_device and torch.distributed.get_backend(self.group) != "gloo":
            work.wait()
            if not read_back:
                return
            # The host polls an event: NCCL's own wait with a timeout polls in sleeps of
            # milliseconds, on every call of every layer.
            done = torch.cuda.Event()
            done.record()
            while not done.query():
                if time.monotonic() - start > self.timeout_s:
                    self._timed_out(time.monotonic() - start, what, None)
                time.sleep(20e-6)
            return
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            waited = time.monotonic() - start
            if waited < self.timeout_s:
                raise  # not the bound: the collective itself failed (a peer's process ended, say)
            self._timed_out(waited, what, error)

    def _timed_out(self, waited: float, what: str, error: BaseException | None):
        rank = dist.get_rank(group=self.group)
        began = time.time() - waited  # the roll call below takes as long again
        answer = self._ranks_not_waiting(what, began)
        silent, gave_up = answer if answer is not None else (None, {})
        if torch.distributed.get_world_size(self.group) == 1:
            who = "the group has no other rank: the device did not finish the work queued before this wait"
        elif silent is None:
            who = "a rank of the group stopped calling the layer or fell behind"
        elif silent:
            who = (
                f"global rank(s) {', '.join(map(str, silent))} of the group did not report a wait of their own "
                f"within {self.timeout_s:g} s more: they stopped calling the layer, raised, or are stuck"
            )
        else:
            who = (
                "every other rank of the group is waiting too: they disagree on the collectives of this "
                "call (a rank called another layer, or another number of times)"
            )
        if gave_up:
            who += (
                "; global rank(s) "
                + ", ".join(
                    f"{peer} ({where}, {began - written:.1f} s before)"
                    for peer, (written, where) in sorted(gave_up.items())
                )
                + " gave up their own waits before this rank's wait began: this rank came to the call more "
                'than "wait_timeout_s" after its peers (a slow batch, or work on this rank alone)'
            )
        if silent:
            who += describe_failures(failure_notes(silent, began - self.timeout_s))
        raise CometWaitTimeout(
            f"ds_comet: {self.layer_name}: rank {rank} of its expert-parallel group waited {waited:.1f} s for "
            f'{what}; {who}. Raise "moe": {{"wait_timeout_s"}} if they are only slow. The exchange stays '
            f"posted: restart the job"
        ) from error

    def _ranks_not_waiting(self, what: str, began: float) -> tuple[list[int], dict[int, Report]] | None:
        """The group's other ranks (global) that report no wait of their own within ``timeout_s``
        more, and of those, the ones whose last report (its time and place) came before this rank's
        wait began at ``began`` (``time.time()``); None where that cannot be found out (no store, or
        a store that does not answer).

        A peer that entered the same wait later than this rank reports when its own wait times
        out, less than ``timeout_s`` from now; one that has not entered it by now is a wait's
        length behind, or stuck; one whose report predates this wait gave up before this rank came,
        and is not waited for. A report without a readable time counts as a wait of now. The store
        is asked from a thread that is given up on after that time, so that a store that does not
        answer cannot hold the error back.
        """

        def report(store, rank: int) -> Report | None:
            key = f"{REPORT_KEY}{rank}"
            if not store.check([key]):
                return None
            text = store.get(key).decode(errors="replace")
            written, _, where = text.partition(" ")
            try:
                return float(written), where
            except ValueError:
                return float("inf"), text

        def roll_call(store):
            me = torch.distributed.get_rank()
            store.set(f"{REPORT_KEY}{me}", f"{time.time():.3f} {self.layer_name}: {what}")
            silent = [rank for rank in group_ranks(self.group) if rank != me]
            reports: dict[int, Report | None] = {}
            deadline = time.monotonic() + self.timeout_s
            while silent:
                reports = {rank: report(store, rank) for rank in silent}
                silent = [rank for rank, seen in reports.items() if seen is None or seen[0] < began]
                # Ranks that gave up before this wait began will not report again.
                if all(reports[rank] is not None for rank in silent) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            return silent, {rank: seen for rank, seen in reports.items() if rank in silent and seen is not None}

        return ask_store(roll_call, self.timeout_s + STORE_SLACK_S)


def gather_objects(obj, waits: CollectiveWaits, what: str) -> list:
    """``torch.distributed.all_gather_object`` over ``waits.group`` with each wait bounded as
    ``waits`` bounds it (``what`` names the objects in the error): every rank's ``obj``, by rank."""
    group = waits.group
    on_gpu = torch.distributed.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = torch.distributed.get_world_size(group)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    waits.wait(
        torch.distributed.all_gather(sizes, size, group=group, async_op=True),
        f"the sizes of {what}",
        on_gpu,
        read_back=True,
    )
    lengths = torch.cat(sizes).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world)]
    waits.wait(torch.distributed.all_gather(gathered, padded, group=group, async_op=True), what, on_gpu, read_back=True)
    return [pickle.loads(part[:length].cpu().numpy().tobytes()) for part, length in zip(gathered, lengths)]


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the default group)."""
    return torch.distributed.get_process_group_ranks(group or torch.distributed.group.WORLD)


def ask_store(call: Callable, timeout_s: float):
    """``call(store)`` on the default process group's store, in a thread given up on after
    ``timeout_s``: its result, or None where there is no store (MPI), it failed, or it did not answer
    in time, so that a broken store cannot hold an error back."""
    result = [None]

    def run():
        try:
            result[0] = call(torch.distributed.distributed_c10d._get_default_store())
        except Exception:  # the caller's error goes out without what the store would have added
            pass

    asking = threading.Thread(target=run, name="ds_comet store", daemon=True)
    asking.start()
    asking.join(timeout_s)
    return result[0]


def post_failure(layer_name: str, error: BaseException, ep_size: int) -> None:
    """Notes in the store that this rank raised ``error`` inside ``layer_name``'s call, for the
    peers of its expert-parallel group (``ep_size`` ranks) it leaves waiting (``failure_notes``)."""
    if ep_size == 1:  # no peer waits
        return
    try:
        me = torch.distributed.get_rank()
    except (RuntimeError, ValueError):  # no process group: nobody waits
        return
    note = f"{time.time():.3f} in {layer_name}: {type(error).__name__}: {error}"[:2000]
    ask_store(lambda store: store.set(f"{FAILURE_KEY}{me}", note), STORE_SLACK_S)


@contextlib.contextmanager
def failures_noted(layer_name: str, ep_size: int) -> Iterator[None]:
    """Runs the block, noting any exception it raises (``post_failure``) before it leaves: the
    block's steps come before collectives that the group's other ranks will wait in. A wait that
    timed out is not noted: this rank is the one left waiting."""
    try:
        yield
    except CometWaitTimeout:
        raise
    except Exception as error:
        post_failure(layer_name, error, ep_size)
        raise


def failure_notes(ranks: Iterable[int], since: float) -> dict[int, str]:
    """The notes ``post_failure`` left for any of the global ``ranks`` at ``since`` (``time.time()``)
    or later, by rank, without their time."""

    def read(store) -> dict[int, str]:
        found = {}
        for rank in ranks:
            key = f"{FAILURE_KEY}{rank}"
            if store.check([key]):
                written, _, note = store.get(key).decode(errors="replace").partition(" ")
                if float(written) >= since:
                    found[rank] = note
        return found

    return ask_store(read, STORE_SLACK_S) or {}


def describe_failures(notes: dict[int, str]) -> str:
    """``failure_notes`` as the end of an error message ("" when there are none)."""
    return "".join(f"; global rank {rank} raised {note}" for rank, note in sorted(notes.items()))
