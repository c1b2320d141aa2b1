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
is the one that fell behind. A report also says where its rank waits: when every rank reports, the
ranks either wait in this same collective (the bound is shorter than the collective takes) or
elsewhere (they disagree on the collectives), and the error says which.

A collective that fails before the bound (gloo's "Connection closed by peer", an NCCL error: a
peer's process ended) is reported the same way (``PeerLost``), after a roll call of a few seconds:
the group's live ranks meet the failure at once, and the rank that does not report is the one
whose process ended.

The same waits, on the default group, bound a training script's own collectives (``ds_comet.collectives``).

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
# After a collective failed (a peer's connection closed), how long the roll call waits for the group's
# other ranks to report: the live ones meet the same failure at once.
LOST_PEER_ROLL_CALL_S = 5.0
NOTED = "_ds_comet_noted"  # set on an exception once post_failure has noted it
Report = tuple[float, str]  # a rank's report of the wait it gave up: when (time.time()) and where


class PeerLost(CometWaitTimeout):
    """A collective of a layer's group, or of the job, failed before its bound: a peer's process
    ended or its connection closed (gloo's "Connection closed by peer", an NCCL error)."""


class CollectiveWaits:
    """Bounded waits on ``group`` (None: the default group), reported as ``layer_name``'s.

    Args:
        group: the process group the collectives run on.
        timeout_s: bounds each wait.
        layer_name: what the waits belong to, first in the error (a layer's name, or a step of a
            training script such as ``"saving checkpoint step10"``).
        members: what this rank is a member of, in the error ("its expert-parallel group", or
            "the job" for the default group).
        stopped: what a rank that does not come to the collective has done, in the error.
    """

    def __init__(
        self,
        group,
        timeout_s: float,
        layer_name: str,
        members: str = "its expert-parallel group",
        stopped: str = "stopped calling the layer",
    ):
        self.group = group
        self.timeout_s = timeout_s
        self.layer_name = layer_name
        self.members = members
        self.stopped = stopped

    def wait(self, work, what: str, on_device: bool, read_back: bool = False) -> None:
        """Waits for ``work`` (an ``async_op`` collective of the group on tensors of the GPU when
        ``on_device``), at most ``timeout_s``.

        ``what`` says what the wait is for, in the error. On the GPU, unless the group is gloo's,
        the stream waits and the host does not, so a stalled peer is noticed at the next wait with
        ``read_back``: the host then also waits for the device to finish the collective and the
        work queued before it, as the read-back of its result would. A collective that fails
        before the bound (a peer's process ended) is reported as a wait that timed out is, naming
        the ranks that did not report (``PeerLost``).
        """
        start = time.monotonic()
        try:
            if on_device and torch.distributed.get_backend(self.group) != "gloo":
                work.wait()
                if read_back:
                    self._poll_device(start, what)
                return
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except CometWaitTimeout:
            raise
        except RuntimeError as error:
            waited = time.monotonic() - start
            self.give_up(waited, what, error, failed=waited < self.timeout_s)

    def _poll_device(self, start: float, what: str) -> None:
        # The host polls an event: NCCL's own wait with a timeout polls in sleeps of
        # milliseconds, on every call of every layer.
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            if time.monotonic() - start > self.timeout_s:
                self.give_up(time.monotonic() - start, what, None)
            time.sleep(20e-6)

    def give_up(self, waited: float, what: str, error: BaseException | None, failed: bool = False):
        """Raises ``CometWaitTimeout`` (``PeerLost`` when ``failed``) for a wait of ``waited`` s for
        ``what`` that timed out, or whose collective failed with ``error``, once the roll call has
        named the ranks that do not wait with this one (a roll call of ``timeout_s``; of at most
        ``LOST_PEER_ROLL_CALL_S`` after a failure, which the group's live ranks meet at once)."""
        rank = dist.get_rank(group=self.group)
        began = time.time() - waited
        look_s = min(self.timeout_s, LOST_PEER_ROLL_CALL_S) if failed else self.timeout_s
        place = f"{self.layer_name}: {what}"  # this rank's report: where it waits
        # A peer that met the same failure a moment before this rank's wait began is no late-comer.
        answer = self._roll_call(place, began - self.timeout_s if failed else began, look_s)
        silent, reports = answer if answer is not None else (None, {})
        who = self._who(silent, reports, place, began, look_s, failed)
        if silent:
            who += describe_failures(failure_notes(silent, began - self.timeout_s))
        if failed:
            lines = str(error).strip().splitlines()  # gloo's first line says what broke
            cause = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
            head = f"lost {what}: the collective failed after {waited:.1f} s ({cause})"
            tail = "The job cannot go on: restart it"
        else:
            head = f"waited {waited:.1f} s for {what}"
            tail = 'Raise "moe": {"wait_timeout_s"} if they are only slow. The exchange stays posted: restart the job'
        exception = PeerLost if failed else CometWaitTimeout
        members = f"{self.members} (global ranks {describe_ranks(group_ranks(self.group))})"
        raise exception(f"ds_comet: {self.layer_name}: rank {rank} of {members} {head}; {who}. {tail}") from error

    def _who(
        self,
        silent: list[int] | None,
        reports: dict[int, Report],
        place: str,
        began: float,
        look_s: float,
        failed: bool,
    ) -> str:
        """The part of the error that says which ranks are where (``give_up``)."""
        if torch.distributed.get_world_size(self.group) == 1:
            return "the group has no other rank: the device did not finish the work queued before this wait"
        if silent is None:
            return f"a rank of the group {self.stopped} or fell behind" + (", or its process ended" if failed else "")
        if silent:
            ranks = ", ".join(map(str, silent))
            if failed:
                who = (
                    f"global rank(s) {ranks} of the group did not report a wait of their own within {look_s:g} s: "
                    f"their process ended (the connection to them closed), or they {self.stopped}"
                )
            else:
                who = (
                    f"global rank(s) {ranks} of the group did not report a wait of their own within {look_s:g} s "
                    f"more: they {self.stopped}, raised, or are stuck"
                )
        else:
            who = self._all_waiting(reports, place, failed)
        gave_up = {} if failed else {peer: report for peer, report in reports.items() if peer in silent}
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
        return who

    def _all_waiting(self, reports: dict[int, Report], place: str, failed: bool) -> str:
        """Every other rank of the group reports a wait (``reports``, by rank): where they wait tells
        a bound too short for the collective itself (all in this one, ``place``) from ranks that
        disagree on the collectives; after a failed collective, that no peer's process ended."""
        elsewhere = {peer: where for peer, (_, where) in sorted(reports.items()) if where != place}
        if failed:
            places = "; ".join(f"global rank {peer}: {where}" for peer, (_, where) in sorted(reports.items()))
            return f"every other rank of the group reports a wait of its own ({places}): no peer's process ended"
        if not elsewhere:
            return (
                "every other rank of the group waits in this same collective: it took longer than "
                f'"wait_timeout_s" ({self.timeout_s:g} s) with every rank in it, a bound below what the '
                "exchange needs (raise it) or a stalled transport"
            )
        places = "; ".join(f"global rank {peer}: {where}" for peer, where in elsewhere.items())
        return (
            f"every other rank of the group is waiting too, elsewhere ({places}): they disagree on the "
            "collectives of this call (a rank called another layer, or another number of times, or changed "
            "a setting of the layer)"
        )

    def _roll_call(self, place: str, began: float, look_s: float) -> tuple[list[int], dict[int, Report]] | None:
        """Reports this rank's wait at ``place`` in the store, then returns (the group's other ranks
        (global) that report no wait of their own within ``look_s`` more, or whose last report came
        before ``began`` (``time.time()``: when this rank's wait began, or earlier after a failure);
        every report seen, by rank); None where that cannot be found out (no store, or a store that
        does not answer).

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
            store.set(f"{REPORT_KEY}{me}", f"{time.time():.3f} {place}")
            silent = [rank for rank in group_ranks(self.group) if rank != me]
            reports: dict[int, Report | None] = {}
            seen: dict[int, Report] = {}
            deadline = time.monotonic() + look_s
            while silent:
                reports = {rank: report(store, rank) for rank in silent}
                seen.update((rank, found) for rank, found in reports.items() if found is not None)
                silent = [rank for rank, found in reports.items() if found is None or found[0] < began]
                # Ranks that gave up before this wait began will not report again.
                if all(reports[rank] is not None for rank in silent) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            return silent, seen

        return ask_store(roll_call, look_s + STORE_SLACK_S)


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


def process_group_timeout_s(wait_timeout_s: float) -> float:
    """The process groups' timeout that goes with a bound of ``wait_timeout_s`` (the one
    ``ds_comet.collectives.set_wait_timeout`` sets): a wait and the roll call after it (as long
    again, and the store's slack) end before it."""
    return 2 * wait_timeout_s + 2 * STORE_SLACK_S


def describe_ranks(ranks: list[int]) -> str:
    """``ranks`` as text, runs of consecutive ranks as ranges: [0, 1, 2, 3, 8] -> "0-3, 8"."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


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
    peers of its expert-parallel group (``ep_size`` ranks) it leaves waiting (``failure_notes``).

    An error is noted once, where it was first caught (a layer's name says more than the training
    step around it, which notes what leaves it too: ``ds_comet.collectives.peers_named``).
    """
    if ep_size == 1 or getattr(error, NOTED, False):  # no peer waits, or noted already
        return
    try:
        me = torch.distributed.get_rank()
    except (RuntimeError, ValueError):  # no process group: nobody waits
        return
    note = f"{time.time():.3f} in {layer_name}: {type(error).__name__}: {error}"[:2000]
    ask_store(lambda store: store.set(f"{FAILURE_KEY}{me}", note), STORE_SLACK_S)
    with contextlib.suppress(AttributeError):  # an exception class without a __dict__ is noted again
        setattr(error, NOTED, True)


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
