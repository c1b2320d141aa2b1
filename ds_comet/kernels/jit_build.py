"""JIT builds that a killed build cannot hang.

torch's JIT build (``torch.utils.cpp_extension.load``, which DeepSpeed's op builders call) guards a
build directory with a plain ``lock`` file and waits, without a limit and without a word, while
that file exists. A process killed while it builds (Ctrl-C during a job's first launch, a job's
time limit, a test run cut short) leaves the file behind, and every later process that loads the
op on that machine then waits forever.

``guarded_build`` runs the build under an ``flock`` of its own on a file beside torch's lock. The
kernel drops an flock when its holder dies, so whoever holds it is the only process of ours building
that op there. A torch ``lock`` found then is removed unless a process that does not take the guard
(DeepSpeed's own ``init_distributed`` builds its shm op without it) holds it open, or compilers run
in the directory; those are waited for. Every wait is bounded and its error names the process waited
for. A build that fails leaves its error beside the guard: the processes that waited for that build
(the other ranks of the node) raise it rather than each repeat the failing build in turn; a process
that starts later builds again. Where the file system has no flock, the build runs unguarded, as
torch runs it, with a warning.
"""

import errno
import fcntl
import os
import time
from collections.abc import Callable
from typing import TypeVar

from deepspeed.utils import logger

GUARD_NAME = "ds_comet_build.flock"
FAILURE_NAME = "ds_comet_build.failed"  # the last failed build's time and error
# Processes whose working directory is a build directory and whose name starts with one of these
# (after a target prefix) are still compiling there (torch runs ninja there, and ninja the
# compilers): a killed build's leftovers.
BUILD_TOOLS = (
    "ninja",
    "nvcc",
    "cicc",
    "ptxas",
    "cudafe",
    "fatbinary",
    "nvlink",
    "cc1",
    "c++",
    "g++",
    "gcc",
    "clang",
    "collect2",
    "ld",
)
NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
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
    try:
        directory = torch_build_directory(name)
    except OSError as error:
        return f"no build directory: {error}"
    parts = [f"{'built' if os.path.exists(os.path.join(directory, f'{name}.so')) else 'not built yet'} in {directory}"]
    if os.path.exists(os.path.join(directory, "lock")):
        parts.append(
            "torch's build lock is there: a build is running, or one was killed (the next load removes "
            "a killed build's lock)"
        )
    note = _failure_note(os.path.join(directory, FAILURE_NAME))
    if note is not None:
        parts.append(f"the last build failed: {note}")
    return "; ".join(parts)


def guarded_build(directory: str, build: Callable[[], T], wait_s: float = BUILD_WAIT_S) -> T:
    """``build()`` (a JIT build or load into ``directory``) under this module's flock there.

    Waits at most ``wait_s`` in all, for another process that holds the flock or a build of torch's
    still running there, then raises ``TimeoutError`` naming that process; a torch ``lock`` file left
    in ``directory`` by a killed build is removed first. A process that waited for a build that
    failed raises that build's error without building.
    """
    os.makedirs(directory, exist_ok=True)
    guard_path, failure_path = os.path.join(directory, GUARD_NAME), os.path.join(directory, FAILURE_NAME)
    deadline = time.monotonic() + wait_s
    with open(guard_path, "a+") as guard:
        failure_before = _identity(failure_path)
        try:
            waited = _lock(guard, guard_path, directory, deadline, wait_s)
        except OSError as error:
            if error.errno not in NO_FLOCK:
                raise
            logger.warning(
                f"ds_comet: the file system of {directory} has no flock ({error}): building without "
                "ds_comet's guard, so a killed build's lock there would make later builds wait forever; "
                "set TORCH_EXTENSIONS_DIR to a local disk"
            )
            return build()
        guard.seek(0)
        guard.truncate()
        guard.write(f"process {os.getpid()} on {os.uname().nodename}")  # named in a waiter's timeout
        guard.flush()
        _clear_torch_lock(directory, deadline, wait_s)
        if waited and _identity(failure_path) != failure_before:
            # Written while this process waited: the build it waited for failed.
            note = _failure_note(failure_path)
            if note is not None:
                raise RuntimeError(
                    f"ds_comet: the build this process waited for failed, so it was not repeated: {note}"
                )
        try:
            built = build()
        except Exception as error:
            _write_failure(failure_path, f"process {os.getpid()}: {type(error).__name__}: {error}")
            raise
        if os.path.exists(failure_path):
            os.unlink(failure_path)
        return built


def _lock(guard, guard_path: str, directory: str, deadline: float, wait_s: float) -> bool:
    """Takes the flock on ``guard``, waiting until ``deadline`` (``time.monotonic()``); whether it had
    to wait."""
    waited = False
    while True:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return waited
        except BlockingIOError:
            waited = True
            if time.monotonic() > deadline:
                guard.seek(0)
                holder = guard.read().strip() or "another process"
                raise TimeoutError(
                    f"ds_comet: waited {wait_s:.0f} s for {holder} to finish building in {directory} "
                    f"(it holds {guard_path}); end that process, or set TORCH_EXTENSIONS_DIR to "
                    "another directory"
                ) from None
            time.sleep(POLL_S)


def _clear_torch_lock(directory: str, deadline: float, wait_s: float) -> None:
    """Removes torch's build lock in ``directory`` if a killed build left it; waits (until
    ``deadline``) while a live process still builds there without the guard."""
    lock = os.path.join(directory, "lock")
    while os.path.exists(lock):
        builders = _processes_building(directory)
        if not builders:
            logger.warning(
                f"ds_comet: removing {lock}, left by a build that was killed: torch would wait on it forever"
            )
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ds_comet: waited {wait_s:.0f} s for processes {builders} on {os.uname().nodename}, "
                f"which still build in {directory} (they hold torch's build lock there or compile "
                "in it); end them, or set TORCH_EXTENSIONS_DIR to another directory"
            )
        time.sleep(POLL_S)


def _processes_building(directory: str) -> list[int]:
    """This user's other processes on this machine that hold torch's lock in ``directory`` open (a
    torch build in progress keeps it open) or run a build tool in it. Empty where ``/proc`` cannot
    tell, as on other systems."""
    lock, real_directory = os.path.realpath(os.path.join(directory, "lock")), os.path.realpath(directory)
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    found = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{pid}/cwd") == real_directory:
                with open(f"/proc/{pid}/comm") as comm:
                    name = comm.read().strip()
                if name.rsplit("-", 1)[-1].startswith(BUILD_TOOLS):  # x86_64-linux-gnu-g++, cc1plus, ld.gold
                    found.append(pid)
                    continue
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == lock for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(pid)
        except OSError:  # another user's process, or one that just ended
            continue
    return found


def _identity(path: str) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now (inode, modification time, size), or None: a note written
    anew (``_write_failure`` replaces the file) has another identity, whatever the clocks say."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _write_failure(failure_path: str, what: str) -> None:
    """Leaves ``what`` as the failure note, whole or not at all (written aside, then moved in)."""
    partial = f"{failure_path}.{os.getpid()}"
    try:
        with open(partial, "w", encoding="utf-8", errors="replace") as note:
            note.write(f"{time.time():.3f} {what}"[:4000])
        os.replace(partial, failure_path)
    except Exception:  # the build's own error matters more than this note for the waiters
        try:
            os.unlink(partial)
        except OSError:
            pass


def _failure_note(failure_path: str) -> str | None:
    """The error of the failure note at ``failure_path``, or None where there is none or it is not one
    (empty, cut short, someone else's file): a process then builds again."""
    try:
        with open(failure_path, encoding="utf-8", errors="replace") as note:
            written, _, what = note.read().partition(" ")
        float(written)
    except (OSError, ValueError):
        return None
    return what or None


def build_cpu_comm_op(wait_s: float = BUILD_WAIT_S):
    """DeepSpeed's CPU shm comm op, JIT-built (or loaded) under ``guarded_build``; None where this
    DeepSpeed has none for the machine.

    ``deepspeed.init_distributed`` on a CPU machine builds it under torch's plain lock, which a
    launch interrupted during that first minute leaves behind for every later run to wait on,
    silently; called before ``init_distributed``, this builds it here (or removes such a lock and
    loads it), so that ``init_distributed`` finds it built.
    """
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    return guarded_build(torch_build_directory(ShareMemCommBuilder.NAME), build_shm_op, wait_s=wait_s)
