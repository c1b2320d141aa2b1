"""JIT builds that a killed build cannot hang.

torch's JIT build (``torch.utils.cpp_extension.load``, which DeepSpeed's op builders call) guards a
build directory with a plain ``lock`` file and waits, without a limit and without a word, while
that file exists. A process killed while it builds (Ctrl-C during a job's first launch, a job's
time limit, a test run cut short) leaves the file behind, and every later process that loads the
op on that machine then waits forever.

``guarded_build`` runs the build under an ``flock`` of its own on a file beside torch's lock. The
kernel drops an flock when its holder dies, so whoever holds it is the only process of ours building
that op there, and a torch ``lock`` found then was left by a build that died: it is removed. The
wait for a live builder is bounded and its error names the process that holds the build.
"""

import fcntl
import os
import time
from typing import Callable, TypeVar

from deepspeed.utils import logger

GUARD_NAME = "ds_comet_build.flock"
BUILD_WAIT_S = 1800.0  # a build takes one to a few minutes; past half an hour its holder is stuck
POLL_S = 0.5

T = TypeVar("T")


def torch_build_directory(name: str) -> str:
    """Where torch JIT-builds the extension ``name`` ($TORCH_EXTENSIONS_DIR or its default); made if missing."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, verbose=False)


def guarded_build(directory: str, build: Callable[[], T], wait_s: float = BUILD_WAIT_S) -> T:
    """``build()`` (a JIT build or load into ``directory``) under this module's flock there.

    Waits at most ``wait_s`` for another process that holds it, then raises ``TimeoutError`` naming
    that process; a torch ``lock`` file left in ``directory`` by a killed build is removed first.
    """
    os.makedirs(directory, exist_ok=True)
    guard_path = os.path.join(directory, GUARD_NAME)
    with open(guard_path, "a+") as guard:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    guard.seek(0)
                    holder = guard.read().strip() or "another process"
                    raise TimeoutError(f"ds_comet: waited {wait_s:.0f} s for {holder} to finish building in "
                                       f"{directory} (it holds {guard_path}); end that process, or set "
                                       f"TORCH_EXTENSIONS_DIR to another directory") from None
                time.sleep(POLL_S)
        guard.seek(0)
        guard.truncate()
        guard.write(f"process {os.getpid()} on {os.uname().nodename}")
        guard.flush()
        stale_lock = os.path.join(directory, "lock")
        if os.path.exists(stale_lock):
            logger.warning(f"ds_comet: removing {stale_lock}, left by a build that was killed: torch would wait "
                           "on it forever")
            try:
                os.unlink(stale_lock)
            except FileNotFoundError:
                pass
        return build()
