"""A JIT build killed mid-way must not hang the next one (ds_comet/kernels/jit_build.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ds_comet.kernels.jit_build import FAILURE_NAME, GUARD_NAME, build_state, guarded_build

# A builder that takes the guard, leaves torch's lock file as a build in progress does, says so and
# then builds "forever": the test kills it there, as a Ctrl-C or a job's time limit would.
KILLED_BUILDER = """
import os, sys, time
from ds_comet.kernels.jit_build import guarded_build
directory = sys.argv[1]
def build():
    open(os.path.join(directory, "lock"), "w").close()
    print("building", flush=True)
    time.sleep(600)
guarded_build(directory, build)
"""


def start_builder(directory):
    builder = subprocess.Popen([sys.executable, "-c", KILLED_BUILDER, str(directory)], stdout=subprocess.PIPE,
                               text=True)
    for line in builder.stdout:  # DeepSpeed's import may log first
        if line.strip() == "building":
            return builder
    raise AssertionError(f"the builder ended before it built (exit code {builder.wait()})")


def test_build_runs_and_returns_its_result(tmp_path):
    calls = []
    assert guarded_build(str(tmp_path), lambda: calls.append(1) or "op") == "op"
    assert calls == [1]
    assert os.path.exists(tmp_path / GUARD_NAME)


def test_a_killed_builders_lock_is_removed_before_the_next_build(tmp_path):
    builder = start_builder(tmp_path)
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=30)
    assert os.path.exists(tmp_path / "lock"), "the killed builder left torch's lock"
    seen = []
    guarded_build(str(tmp_path), lambda: seen.append(os.path.exists(tmp_path / "lock")), wait_s=30)
    assert seen == [False], "torch's stale lock was still there when the build began"


def test_a_live_builder_is_waited_for_boundedly_and_named(tmp_path):
    builder = start_builder(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"process {builder.pid} on .*TORCH_EXTENSIONS_DIR"):
            guarded_build(str(tmp_path), lambda: pytest.fail("built while another process held the build"),
                          wait_s=1.0)
        assert time.monotonic() - started < 20
        assert os.path.exists(tmp_path / "lock"), "a live builder's lock must stay"
    finally:
        builder.kill()
        builder.wait(timeout=30)


def test_a_waiting_build_proceeds_once_the_builder_dies(tmp_path):
    builder = start_builder(tmp_path)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1.5); os.kill({builder.pid}, 9)"])
    try:
        assert guarded_build(str(tmp_path), lambda: not os.path.exists(tmp_path / "lock"), wait_s=60) is True
    finally:
        builder.kill()
        builder.wait(timeout=30)
        killer.wait(timeout=30)


# A builder that takes the guard, says so, and fails after a moment, as a build with a compiler error does.
FAILING_BUILDER = """
import sys, time
from ds_comet.kernels.jit_build import guarded_build
def build():
    print("building", flush=True)
    time.sleep(1.5)
    raise RuntimeError("nvcc: error in comet_kernels.cu")
try:
    guarded_build(sys.argv[1], build)
except RuntimeError:
    pass
"""


def test_processes_that_waited_for_a_failed_build_raise_its_error_and_later_ones_build_again(tmp_path):
    builder = subprocess.Popen([sys.executable, "-c", FAILING_BUILDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert any(line.strip() == "building" for line in builder.stdout)
        with pytest.raises(RuntimeError, match=f"waited for failed.*process {builder.pid}: RuntimeError: nvcc: error"):
            guarded_build(str(tmp_path), lambda: pytest.fail("repeated the build that had just failed"), wait_s=60)
    finally:
        builder.wait(timeout=60)
    assert guarded_build(str(tmp_path), lambda: "rebuilt") == "rebuilt"  # a later process tries again
    assert not os.path.exists(tmp_path / FAILURE_NAME), "a build that succeeds clears the failure"


def test_the_report_says_what_a_killed_or_failed_build_left(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_state("an_op") == f"not built yet in {tmp_path / 'an_op'}"
    (tmp_path / "an_op" / "lock").touch()
    (tmp_path / "an_op" / FAILURE_NAME).write_text("1.0 process 7: RuntimeError: nvcc: error")
    (tmp_path / "an_op" / "an_op.so").touch()
    state = build_state("an_op")
    assert state.startswith("built in") and "torch's build lock is there" in state, state
    assert state.endswith("the last build failed: process 7: RuntimeError: nvcc: error"), state
