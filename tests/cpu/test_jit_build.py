"""A JIT build killed mid-way must not hang the next one (ds_comet/kernels/jit_build.py)."""

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from ds_comet.kernels import jit_build
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


def start_builder(directory, script=KILLED_BUILDER):
    builder = subprocess.Popen(
        [sys.executable, "-c", script, str(directory)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    said = []
    reader = threading.Thread(target=lambda: said.extend(line.strip() for line in builder.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120  # imports torch and DeepSpeed first: seconds on two cores
    while "building" not in said and builder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if "building" not in said:
        builder.kill()
        raise AssertionError(f"the builder did not start building (exit code {builder.wait()}): {said}")
    return builder


def tell(builder):
    """Sends the builder the line it waits for."""
    builder.stdin.write("go\n")
    builder.stdin.flush()


def on_wait(monkeypatch, action):
    """Runs ``action()`` when guarded_build starts to wait for the flock; returns the list of its
    waits (True: it had to wait)."""
    waits, lock = [], jit_build._lock

    def spy(*args):
        threading.Timer(0.2, action).start()
        waits.append(lock(*args))
        return waits[-1]

    monkeypatch.setattr(jit_build, "_lock", spy)
    return waits


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
            guarded_build(str(tmp_path), lambda: pytest.fail("built while another process held the build"), wait_s=1.0)
        assert time.monotonic() - started < 20
        assert os.path.exists(tmp_path / "lock"), "a live builder's lock must stay"
    finally:
        builder.kill()
        builder.wait(timeout=30)


def test_a_waiting_build_proceeds_once_the_builder_dies(tmp_path, monkeypatch):
    builder = start_builder(tmp_path)
    waits = on_wait(monkeypatch, builder.kill)
    try:
        assert guarded_build(str(tmp_path), lambda: not os.path.exists(tmp_path / "lock"), wait_s=60) is True
        assert waits == [True]
    finally:
        builder.kill()
        builder.wait(timeout=30)


# A builder that takes the guard, says so, and fails when told to, as a build with a compiler error does.
FAILING_BUILDER = """
import sys
from ds_comet.kernels.jit_build import guarded_build
def build():
    print("building", flush=True)
    sys.stdin.readline()
    raise RuntimeError("nvcc: error in dispatch_kernels.cu")
try:
    guarded_build(sys.argv[1], build)
except RuntimeError:
    pass
"""


def test_processes_that_waited_for_a_failed_build_raise_its_error_and_later_ones_build_again(tmp_path, monkeypatch):
    builder = start_builder(tmp_path, FAILING_BUILDER)
    waits = on_wait(monkeypatch, lambda: tell(builder))
    try:
        with pytest.raises(RuntimeError, match=f"waited for failed.*process {builder.pid}: RuntimeError: nvcc: error"):
            guarded_build(str(tmp_path), lambda: pytest.fail("repeated the build that had just failed"), wait_s=60)
        assert waits == [True]
    finally:
        builder.kill()
        builder.wait(timeout=60)
    monkeypatch.undo()
    assert guarded_build(str(tmp_path), lambda: "rebuilt") == "rebuilt"  # a later process tries again
    assert not os.path.exists(tmp_path / FAILURE_NAME), "a build that succeeds clears the failure"


def hold_guard(directory):
    """The guard held through a second open file (as another process would hold it)."""
    guard = open(directory / GUARD_NAME, "a+")
    fcntl.flock(guard, fcntl.LOCK_EX)
    return guard


@pytest.mark.parametrize("note", ["", "garbage", "12.5 process 3: RuntimeError: an older failure"])
def test_a_note_that_was_there_before_the_wait_or_is_no_note_does_not_stop_the_build(tmp_path, monkeypatch, note):
    # Unchanged while this process waited (an older failure, whatever the clocks say), or written by
    # the builder it waited for but unreadable: either way it builds.
    guard = hold_guard(tmp_path)
    if note.startswith("12.5"):
        (tmp_path / FAILURE_NAME).write_text(note)
        release = guard.close
    else:

        def release():
            (tmp_path / FAILURE_NAME).write_text(note)
            guard.close()

    waits = on_wait(monkeypatch, release)
    assert guarded_build(str(tmp_path), lambda: "built", wait_s=30) == "built"
    assert waits == [True] and not os.path.exists(tmp_path / FAILURE_NAME)


# Holds torch's build lock as torch's FileBaton does (created exclusively, kept open), without the
# guard, as DeepSpeed's own init_distributed builds its shm op; removes it when told to.
TORCH_BUILDER = """
import os, sys
lock = os.path.join(sys.argv[1], "lock")
fd = os.open(lock, os.O_CREAT | os.O_EXCL)
print("building", flush=True)
sys.stdin.readline()
os.close(fd)
os.remove(lock)
"""


def test_a_torch_build_that_holds_its_lock_is_waited_for_not_broken(tmp_path):
    builder = start_builder(tmp_path, TORCH_BUILDER)
    try:
        with pytest.raises(TimeoutError, match=f"processes \\[{builder.pid}\\] on .* still build in"):
            guarded_build(str(tmp_path), lambda: pytest.fail("built beside a live torch build"), wait_s=1.0)
        assert os.path.exists(tmp_path / "lock"), "a live build's lock must stay"
        threading.Timer(0.5, tell, args=(builder,)).start()
        assert guarded_build(str(tmp_path), lambda: "built", wait_s=60) == "built"
        assert builder.wait(timeout=30) == 0, "the torch build could not release its own lock"
    finally:
        builder.kill()
        builder.wait(timeout=30)


def test_without_flock_the_build_runs_unguarded_with_a_warning(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(38, "Function not implemented")

    warnings = []
    monkeypatch.setattr(jit_build.fcntl, "flock", no_flock)
    monkeypatch.setattr(jit_build.logger, "warning", warnings.append)
    assert guarded_build(str(tmp_path), lambda: "built") == "built"
    assert len(warnings) == 1 and "has no flock" in warnings[0] and "TORCH_EXTENSIONS_DIR" in warnings[0], warnings


def test_the_report_says_what_a_killed_or_failed_build_left(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_state("an_op") == f"not built yet in {tmp_path / 'an_op'}"
    (tmp_path / "an_op" / "lock").touch()
    (tmp_path / "an_op" / FAILURE_NAME).write_text("1.0 process 7: RuntimeError: nvcc: error")
    (tmp_path / "an_op" / "an_op.so").touch()
    state = build_state("an_op")
    assert state.startswith("built in") and "torch's build lock is there" in state, state
    assert state.endswith("the last build failed: process 7: RuntimeError: nvcc: error"), state


def test_compilers_a_killed_build_left_running_are_waited_for(tmp_path):
    # A killed build's ninja (here: sleep under that name) still compiles in the directory, beside the
    # lock it left: building there now would race it.
    ninja = tmp_path / "tools" / "ninja"
    ninja.parent.mkdir()
    shutil.copy(shutil.which("sleep"), ninja)
    (tmp_path / "lock").touch()
    compiler = subprocess.Popen([str(ninja), "600"], cwd=tmp_path)
    try:
        time.sleep(0.2)  # until it runs under its name
        with pytest.raises(TimeoutError, match=f"processes \\[{compiler.pid}\\] on .* still build in"):
            guarded_build(str(tmp_path), lambda: pytest.fail("built beside a running compiler"), wait_s=1.0)
        threading.Timer(0.5, compiler.kill).start()
        assert guarded_build(str(tmp_path), lambda: not os.path.exists(tmp_path / "lock"), wait_s=60) is True
    finally:
        compiler.kill()
        compiler.wait(timeout=30)


BUILD_CPU_COMM_OP = """
from ds_comet.kernels.jit_build import build_cpu_comm_op
print("loaded", build_cpu_comm_op(wait_s=60) is not None, flush=True)
"""


def test_deepspeeds_cpu_comm_op_loads_past_a_lock_an_interrupted_launch_left(tmp_path):
    """What the example runs before init_distributed on CPU: torch would wait on this lock forever."""
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
    from torch.utils.cpp_extension import _get_build_directory

    jit_build.build_cpu_comm_op()  # built in this run's extensions (a load where it is already)
    built = _get_build_directory(ShareMemCommBuilder.NAME, verbose=False)
    extensions = tmp_path / "extensions"
    target = extensions / ShareMemCommBuilder.NAME  # where torch builds it under TORCH_EXTENSIONS_DIR
    shutil.copytree(built, target, ignore=shutil.ignore_patterns("lock", GUARD_NAME, FAILURE_NAME))
    open(target / "lock", "w").close()  # torch's lock, left by a launch interrupted during the build
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions))
    result = subprocess.run(
        [sys.executable, "-c", BUILD_CPU_COMM_OP], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "loaded True" in result.stdout, result.stdout[-2000:]
    assert not os.path.exists(target / "lock")
