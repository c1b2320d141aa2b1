"""The roll call that names the stalled ranks (pipelines/collective_waits.py), against stand-in stores."""

import threading
import time

import pytest
import torch

import ds_comet.pipelines.collective_waits as collective_waits
from ds_comet.kernels.ops import CometWaitTimeout
from ds_comet.pipelines.collective_waits import FAILURE_KEY, REPORT_KEY, CollectiveWaits, PeerLost, post_failure


class Store:
    """A store that holds what is set, the ranks in ``present`` reporting a wait now; ``check`` can
    be made to hang."""

    def __init__(self, present=(), hang=False):
        self.values = {f"{REPORT_KEY}{rank}": f"{time.time():.3f} blocks.0.moe: the rows".encode() for rank in present}
        self.hang = hang

    @property
    def keys(self):
        return set(self.values)

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        if self.hang:
            threading.Event().wait()
        return all(key in self.values for key in keys)


@pytest.fixture
def group_of_four(monkeypatch):
    """Global ranks 0-3 in the group, this one rank 0."""
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: [0, 1, 2, 3])
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(collective_waits.dist, "get_rank", lambda group=None: 0)

    def use(store):
        monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
        return store

    return use


def timed_out(waits):
    start = time.monotonic()
    with pytest.raises(CometWaitTimeout) as raised:
        waits.give_up(waits.timeout_s, "the rows the other ranks send it", None)
    return str(raised.value), time.monotonic() - start


def test_the_ranks_that_report_no_wait_are_named(group_of_four):
    store = group_of_four(Store(present=[2]))
    message, took = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "global rank(s) 1, 3 of the group did not report" in message and "blocks.0.moe" in message, message
    assert f"{REPORT_KEY}0" in store.keys  # this rank's own report, for its peers
    assert 0.3 <= took < 3.0, took


def test_every_peer_waiting_says_the_ranks_disagree(group_of_four):
    group_of_four(Store(present=[1, 2, 3]))
    message, took = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "every other rank of the group is waiting too" in message, message
    assert took < 0.3, took  # nobody to wait for


def test_a_peer_that_gave_up_before_this_wait_began_says_this_rank_came_late(group_of_four):
    """Rank 1 gave up its own wait 40 s before this rank's wait began and left: it is not waiting
    with this rank, and the error says this rank is the one that fell behind."""
    store = group_of_four(Store(present=[2, 3]))
    store.set(f"{REPORT_KEY}1", f"{time.time() - 0.3 - 40:.3f} blocks.0.moe: the expert counts")
    message, took = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "global rank(s) 1 of the group did not report a wait of their own" in message, message
    assert (
        "global rank(s) 1 (blocks.0.moe: the expert counts, 40.0 s before) gave up their own waits before this "
        'rank\'s wait began: this rank came to the call more than "wait_timeout_s" after its peers'
    ) in message, message
    assert "every other rank of the group is waiting too" not in message, message
    assert took < 0.3, took  # a rank that gave up reports no more: nobody to wait for


def test_a_report_without_a_readable_time_counts_as_waiting(group_of_four):
    store = group_of_four(Store(present=[2, 3]))
    store.set(f"{REPORT_KEY}1", "waiting")
    message, _ = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "every other rank of the group is waiting too" in message, message


def test_a_group_of_one_blames_the_device_not_the_peers(group_of_four, monkeypatch):
    group_of_four(Store())
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: [0])
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    message, _ = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "the group has no other rank: the device did not finish" in message, message


def test_a_store_that_hangs_does_not_hold_the_error_back(group_of_four, monkeypatch):
    monkeypatch.setattr(collective_waits, "STORE_SLACK_S", 0.2)
    group_of_four(Store(hang=True))
    message, took = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "a rank of the group stopped calling the layer or fell behind" in message, message
    assert took < 3.0, took


def test_no_store_gives_the_error_without_names(group_of_four, monkeypatch):
    def no_store():
        raise RuntimeError("no default store: the group was made without one")

    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", no_store)
    message, _ = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "a rank of the group stopped calling the layer or fell behind" in message, message


def noted(monkeypatch, rank, error, at=None):
    """Global rank ``rank`` notes ``error`` (at time ``at``, default now), as a rank that raises does."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    with monkeypatch.context() as clock:
        if at is not None:
            clock.setattr(collective_waits.time, "time", lambda: at)
        post_failure("blocks.0.moe", error, ep_size=4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)


def test_a_layer_without_peers_notes_nothing(group_of_four, monkeypatch):
    store = group_of_four(Store(present=[]))
    post_failure("blocks.0.moe", ValueError("alone"), ep_size=1)
    assert not store.check([f"{FAILURE_KEY}0"])


def test_a_silent_rank_that_noted_its_error_is_named_with_it(group_of_four, monkeypatch):
    store = group_of_four(Store(present=[2]))
    noted(monkeypatch, 3, ValueError("this MoE layer got 9000 tokens on one rank"))
    noted(monkeypatch, 2, RuntimeError("a rank that waits"))  # it reports waiting: not a cause
    noted(monkeypatch, 1, MemoryError("out of memory an hour ago"), at=time.time() - 3600)  # caught, survived
    assert (
        store.get(f"{FAILURE_KEY}3")
        .decode()
        .endswith(" in blocks.0.moe: ValueError: this MoE layer got 9000 tokens on one rank")
    )
    message, _ = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert (
        "global rank(s) 1, 3 of the group did not report a wait of their own" in message
        and "; global rank 3 raised in blocks.0.moe: ValueError: this MoE layer got 9000 tokens" in message
    ), message
    assert "rank 1 raised" not in message and "rank 2 raised" not in message, message


def test_every_peer_waiting_in_this_same_collective_says_the_bound_is_too_short(group_of_four):
    """With every rank in the same collective, none is missing and none disagrees: the collective
    itself took longer than the bound (a bound of milliseconds would say so of a healthy job)."""
    store = group_of_four(Store())
    for rank in (1, 2, 3):
        store.set(f"{REPORT_KEY}{rank}", f"{time.time():.3f} blocks.0.moe: the rows the other ranks send it")
    message, _ = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert "every other rank of the group waits in this same collective: it took longer than" in message, message
    assert "disagree" not in message, message


def test_peers_waiting_elsewhere_are_named_with_where_they_wait(group_of_four):
    store = group_of_four(Store(present=[2, 3]))
    store.set(f"{REPORT_KEY}1", f"{time.time():.3f} blocks.1.moe: the expert counts")
    message, _ = timed_out(CollectiveWaits(None, 0.3, "blocks.0.moe"))
    assert (
        "every other rank of the group is waiting too, elsewhere (global rank 1: blocks.1.moe: the expert counts; "
        "global rank 2: blocks.0.moe: the rows; global rank 3: blocks.0.moe: the rows): they disagree"
    ) in message, message
    assert "of its expert-parallel group (global ranks 0-3) waited" in message, message


class FailingWork:
    """A collective whose wait fails at once, as gloo's does when a peer's process ended."""

    def wait(self, timeout=None):
        raise RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:30353. This is typically caused by a remote worker crashing."
        )


def test_a_failed_collective_names_the_rank_whose_process_ended_with_its_note(group_of_four, monkeypatch):
    """A peer that raised inside the layer and then exited: the collective fails at once, and the
    error names the layer, the group's ranks, the rank that did not report, and its note, after a
    roll call of a few seconds rather than of the bound."""
    monkeypatch.setattr(collective_waits, "LOST_PEER_ROLL_CALL_S", 0.3)
    group_of_four(Store(present=[2, 3]))  # alive, and waiting in the same collective
    noted(monkeypatch, 1, MemoryError("stand-in: out of memory"))
    start = time.monotonic()
    with pytest.raises(PeerLost) as raised:
        CollectiveWaits(None, 60.0, "blocks.0.moe").wait(FailingWork(), "the rows the other ranks send it", False)
    message = str(raised.value)
    assert isinstance(raised.value, CometWaitTimeout), "a lost peer is caught as a timeout is"
    assert message.startswith(
        "ds_comet: blocks.0.moe: rank 0 of its expert-parallel group (global ranks 0-3) lost the rows the other "
        "ranks send it: the collective failed after 0.0 s (RuntimeError: [/pytorch/third_party/gloo/gloo/transport/"
        "tcp/pair.cc:553] Connection closed by peer"
    ), message
    assert (
        "global rank(s) 1 of the group did not report a wait of their own within 0.3 s: their process ended (the "
        "connection to them closed), or they stopped calling the layer; global rank 1 raised in blocks.0.moe: "
        "MemoryError: stand-in: out of memory"
    ) in message, message
    assert time.monotonic() - start < 10, "the roll call after a failure is not the bound's length"
