"""JIT builds that a killed build cannot hang.

torch's JIT build (``torch.utils.cpp_extension.load``, which DeepSpeed's op builders call) guards a
build directory with a plain ``lock`` file and waits, without a limit and without a word, while
that file exists. A process killed while it builds (Ctrl-C during a job's first launch, a job's
time limit, a test run cut short) leaves the file behind, and every later process that loads the
op on that machine then waits forever.

``guarded_build`` runs the build under an ``flock`` of its own on a file beside torch's lock. The
kernel drops an flock when its holder dies, so whoever holds it is the only process of ours building
that op there, and a torch ``lock`` found then was left by a build that died: it is removed. The
wait for a live builder is bounded and its error names the process that holds the build. A build
that fails leaves its error beside the guard: the processes that waited for that build (the other
ranks of the node) raise it rather than each repeat the failing build in turn; a process that starts
later builds again.
"""

import fcntl
import os
import time
from typing import Callable, TypeVar

from deepspeed.utils import logger

GUARD_NAME = "ds_comet_build.flock"
FAILURE_NAME = "ds_comet_build.failed"  # the last failed build's time and error
BUILD_WAIT_S = 1800.0  # a build takes one to a few minutes; past half an hour its holder is stuck
POLL_S = 0.5

T = TypeVar("T")


def torch_build_directory(name: str) -> str:
    """Where torch JIT-builds the extension ``name`` ($TORCH_EXTENSIONS_DIR or its default); made if missing."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, verbose=False)


def build_state(name: str) -> str:
    """What the JIT build directory of extension ``name`` holds, in words, for reports: where it is,
    whether the op is built there, and what a killed or failed build left behind."""
    directory = torch_build_directory(name)
    parts = [f"{'built' if os.path.exists(os.path.join(directory, f'{name}.so')) else 'not built yet'} in {directory}"]
    if os.path.exists(os.path.join(directory, "lock")):
        parts.append("torch's build lock is there: a build is running, or one was killed (the next load removes "
                     "a killed build's lock)")
    try:
        with open(os.path.join(directory, FAILURE_NAME)) as failure:
            parts.append(f"the last build failed: {failure.read().partition(' ')[2]}")
    except FileNotFoundError:
        pass
    return "; ".join(parts)


def guarded_build(directory: str, build: Callable[[], T], wait_s: float = BUILD_WAIT_S) -> T:
    """``build()`` (a JIT build or load into ``directory``) under this module's flock there.

    Waits at most ``wait_s`` for another process that holds it, then raises ``TimeoutError`` naming
    that process; a torch ``lock`` file left in ``directory`` by a killed build is removed first. A
    process that waited for a build that failed raises that build's error without building.
    """
    os.makedirs(directory, exist_ok=True)
    guard_path, failure_path = os.path.join(directory, GUARD_NAME), os.path.join(directory, FAILURE_NAME)
    with open(guard_path, "a+") as guard:
        began = time.time()
        waited = _lock(guard, guard_path, directory, wait_s)
        guard.seek(0)
        guard.truncate()
        guard.write(f"process {os.getpid()} on {os.uname().nodename}")  # named in a waiter's timeout
        guard.flush()
        _remove_stale_lock(directory)
        if waited:
            _raise_failure_since(failure_path, began)
        try:
            built = build()
        except Exception as error:
            try:
                with open(failure_path, "w") as failure:
                    failure.write(f"{time.time():.3f} process {os.getpid()}: {type(error).__name__}: {error}"[:4000])
            except OSError:  # the build's own error matters more than this note for the waiters
                pass
            raise
        if os.path.exists(failure_path):
            os.unlink(failure_path)
        return built


def _lock(guard, guard_path: str, directory: str, wait_s: float) -> bool:
    """Takes the flock on ``guard``, waiting at most ``wait_s``; whether it had to wait."""
    deadline, waited = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return waited
        except BlockingIOError:
            waited = True
            if time.monotonic() > deadline:
                guard.seek(0)
                holder = guard.read().strip() or "another process"
                raise TimeoutError(f"ds_comet: waited {wait_s:.0f} s for {holder} to finish building in {directory} "
                                   f"(it holds {guard_path}); end that process, or set TORCH_EXTENSIONS_DIR to "
                                   "another directory") from None
            time.sleep(POLL_S)


def _remove_stale_lock(directory: str) -> None:
    """Removes torch's build lock, which only a killed build can have left while the guard is held."""
    stale_lock = os.path.join(directory, "lock")
    if os.path.exists(stale_lock):
        logger.warning(f"ds_comet: removing {stale_lock}, left by a build that was killed: torch would wait on it "
                       "forever")
        try:
            os.unlink(stale_lock)
        except FileNotFoundError:
            pass


def _raise_failure_since(failure_path: str, since: float) -> None:
    """Raises the error of a build that failed at ``since`` (``time.time()``) or later, if one did."""
    try:
        with open(failure_path) as failure:
            written, _, what = failure.read().partition(" ")
    except FileNotFoundError:
        return
    if float(written) >= since:
        raise RuntimeError(f"ds_comet: the build this process waited for failed, so it was not repeated: {what}")
