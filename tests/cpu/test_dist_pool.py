"""How many ranks the test pools start, from DS_COMET_TEST_WORLD_SIZE and DS_COMET_TEST_RANKS_PER_GPU, and how
DS_COMET_TEST_SHARD splits a suite into parts (tests/conftest.py)."""

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests import conftest
from tests.conftest import SHARD_VAR
from tests.support.dist_pool import (
    RANKS_PER_GPU_VAR,
    WORLD_SIZE_VAR,
    DistPool,
    gpu_world_size,
    ranks_per_gpu,
    thread_name_and_state,
)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VAR, raising=False)
    monkeypatch.delenv(RANKS_PER_GPU_VAR, raising=False)
    return monkeypatch


def test_one_rank_per_gpu_by_default(clean_env):
    assert ranks_per_gpu() == 1
    assert gpu_world_size(1) == 1 and gpu_world_size(8) == 8


def test_ranks_per_gpu_multiply_and_world_size_caps(clean_env):
    clean_env.setenv(RANKS_PER_GPU_VAR, "2")
    assert gpu_world_size(1) == 2 and gpu_world_size(2) == 4
    clean_env.setenv(WORLD_SIZE_VAR, "3")
    assert gpu_world_size(2) == 3


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_ranks_per_gpu_is_refused(clean_env, value):
    clean_env.setenv(RANKS_PER_GPU_VAR, value)
    with pytest.raises(ValueError, match=RANKS_PER_GPU_VAR):
        ranks_per_gpu()


def test_shared_gpus_need_gloo():
    with pytest.raises(ValueError, match="gloo"):
        DistPool(2, backend="nccl", gpu_ranks=2)


def test_shards_split_the_selected_tests_into_disjoint_parts(monkeypatch):
    """The hook in-process on stand-in items: the parts are disjoint and cover the selection; a bad
    value is refused."""
    items = [f"test_{number}" for number in range(11)]
    deselected = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    parts = []
    for index in range(3):
        monkeypatch.setenv(SHARD_VAR, f"{index}/3")
        kept = list(items)
        deselected.clear()
        conftest.pytest_collection_modifyitems(config, kept)
        assert sorted(kept + deselected) == sorted(items)
        parts.append(kept)
    assert sorted(sum(parts, [])) == sorted(items) and all(parts), parts
    for bad in ("3/3", "1", "a/b", "-1/2"):
        monkeypatch.setenv(SHARD_VAR, bad)
        with pytest.raises(pytest.UsageError, match="DS_COMET_TEST_SHARD must be i/n"):
            conftest.pytest_collection_modifyitems(config, list(items))


def test_pytest_takes_a_shard_from_the_environment():
    """Through pytest itself: a shard's collection is every n-th test of the whole one, from the i-th."""

    def collected(shard):
        env = dict(os.environ)
        env.pop(SHARD_VAR, None)
        if shard:
            env[SHARD_VAR] = shard
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                os.path.join(os.path.dirname(__file__), "test_routing.py"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if "::" in line]

    everything = collected(None)
    assert len(everything) > 3 and collected("1/3") == everything[1::3]


def wait_on_rank_1(deaf: bool = False):
    """Rank 1 sleeps past the pool's timeout, with ``deaf`` ignoring SIGUSR1 as a rank stuck in a driver
    call cannot answer it (the pool kills it after); the others answer."""
    from deepspeed import comm as dist

    if dist.get_rank() == 1:
        if deaf:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        time.sleep(60)
    return dist.get_rank()


@pytest.mark.parametrize(
    "deaf, shown",
    [
        (False, r"--- rank 1 ---\nit waits here:\n(.|\n)*in wait_on_rank_1"),
        # Its main thread sleeps (S) in the kernel's timed sleep.
        (
            True,
            r"--- rank 1 ---\nit wrote no Python stacks within 5 s of SIGUSR1;"
            r"(.|\n)*thread \d+ \(.+\): state S, in \S+",
        ),
    ],
    ids=["its-stacks", "deaf-its-threads-states"],
)
def test_a_rank_that_does_not_answer_is_shown_where_it_waits(cpu_pool, deaf, shown):
    with pytest.raises(TimeoutError) as raised:
        cpu_pool.run(wait_on_rank_1, timeout=5, deaf=deaf)
    message = str(raised.value)
    assert "ranks [1] gave no answer to wait_on_rank_1 within 5 s" in message, message
    assert re.search(shown, message), message
    assert "--- rank 0 ---" not in message, message


def test_a_threads_name_may_hold_spaces_and_parentheses():
    assert thread_name_and_state("123 (a) S x (y) R 1 2 3") == ("a) S x (y", "R")
    assert thread_name_and_state("7 (python3) D 1 7 7") == ("python3", "D")
