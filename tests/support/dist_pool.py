"""A pool of ranks that lives for the whole test session.

Starting ranks costs seconds (importing torch and DeepSpeed, joining the process group), so the
pool starts them once and each test sends it a case: a module-level function that every rank
runs. A failure on any rank comes back as that rank's traceback; a rank that does not answer in
time, or whose process ended, fails the test instead of hanging it, and the pool is started afresh
for the next test. A rank that does not answer in time is asked for its Python stacks first (each
rank's ``faulthandler`` answers SIGUSR1), and the test's error shows where it waits; a rank that
writes none is shown by its threads' states as the kernel reports them.

How many ranks: DS_COMET_TEST_WORLD_SIZE, so that the suite runs unchanged at 2, 4 or 8 ranks.
The gloo (CPU) pool has that many ranks (at least 2; 2 when it is unset); the NCCL pool has one
rank per visible GPU, at most that many. The tests take the expert-parallel size from the pool.

DS_COMET_TEST_RANKS_PER_GPU=N puts N ranks on each visible GPU instead, over gloo (NCCL refuses
two ranks on one GPU). The GPU time-slices between the ranks' processes, so a kernel that waits
for a peer makes progress only when the peer's slice comes: slow, but the two-rank paths (remote
rows, peer counters, the exchange) run on a one-GPU machine. Correctness only; time nothing there.
"""

import faulthandler
import glob
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

# The repository root: the ranks import each case as tests.<group>.<module>, as pytest names it.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD_SIZE_VAR = "DS_COMET_TEST_WORLD_SIZE"
RANKS_PER_GPU_VAR = "DS_COMET_TEST_RANKS_PER_GPU"
CPU_DEFAULT_WORLD_SIZE = 2
# How long a rank that was asked for its stacks (SIGUSR1) is given to write them.
STACKS_WAIT_S = 5.0


def requested_world_size():
    """The rank count DS_COMET_TEST_WORLD_SIZE asks for, or None when it is unset."""
    value = os.environ.get(WORLD_SIZE_VAR, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WORLD_SIZE_VAR} must be a positive integer, got {value!r}")
    return int(value)


def cpu_world_size() -> int:
    """Ranks of the gloo pool: DS_COMET_TEST_WORLD_SIZE, else 2."""
    requested = requested_world_size()
    if requested is None:
        return CPU_DEFAULT_WORLD_SIZE
    if requested < 2:
        raise ValueError(
            f"{WORLD_SIZE_VAR}={requested}: the CPU tests exchange tokens between ranks and need at least 2"
        )
    return requested


def ranks_per_gpu() -> int:
    """DS_COMET_TEST_RANKS_PER_GPU, 1 when it is unset."""
    value = os.environ.get(RANKS_PER_GPU_VAR, "").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RANKS_PER_GPU_VAR} must be a positive integer, got {value!r}")
    return int(value)


def gpu_world_size(device_count: int) -> int:
    """Ranks of the GPU pool: ranks_per_gpu() on every visible GPU, capped by DS_COMET_TEST_WORLD_SIZE."""
    requested = requested_world_size()
    ranks = device_count * ranks_per_gpu()
    return ranks if requested is None else min(ranks, requested)


def _unlink_matching(pattern: str):
    for path in glob.glob(pattern):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_shm_buffers(port: int):
    """Unlink the /dev/shm all-reduce buffers DeepSpeed's CPU comm op made for a job on this port.

    The op never unlinks them, and killed ranks cannot: every pool start would otherwise leave
    2 x 66 MiB behind in memory-backed /dev/shm (21 GB after about 160 pool starts).
    """
    _unlink_matching(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*")


def remove_ipc_counters(pids):
    """Unlink the /dev/shm reference counters of CUDA tensors these killed ranks shared (CUDA IPC).

    torch names them after the sharing process, which unlinks them on a clean exit only.
    """
    for pid in pids:
        _unlink_matching(f"/dev/shm/torch_{pid}_*")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stacks_path(port: int, rank: int) -> str:
    """Where rank ``rank`` of the pool on ``port`` writes its Python stacks when asked (SIGUSR1)."""
    return os.path.join(tempfile.gettempdir(), f"ds_comet_pool_{os.getuid()}_{port}_rank{rank}.stacks")


def thread_name_and_state(stat: str) -> tuple[str, str]:
    """A thread's name and state letter from its /proc ``stat`` line, ``"<tid> (<name>) <state> ..."``,
    whose name may hold spaces and parentheses: it ends at the line's last ")"."""
    end = stat.rindex(")")
    return stat[stat.index("(") + 1 : end], stat[end + 2]


def thread_states(pid: int) -> str:
    """What the kernel says each thread of process ``pid`` is doing (Linux's /proc): its state and the
    kernel function it sleeps in. For a rank that cannot run its SIGUSR1 handler, e.g. one blocked in
    a driver call in uninterruptible sleep ("D")."""
    lines = []
    for task in sorted(glob.glob(f"/proc/{pid}/task/*"), key=lambda path: int(os.path.basename(path))):
        try:
            with open(os.path.join(task, "stat")) as file:
                stat = file.read()
            with open(os.path.join(task, "wchan")) as file:
                wchan = file.read().strip()
            wchan = "-" if wchan in ("", "0") else wchan  # "0": running, in no kernel function
        except OSError:  # the thread ended while being read
            continue
        name, state = thread_name_and_state(stat)
        lines.append(f"  thread {os.path.basename(task)} ({name}): state {state}, in {wchan}")
    if not lines:
        return "its threads could not be read from /proc"
    return "its threads (state R running, S sleeping, D uninterruptible):\n" + "\n".join(lines)


def _rank_main(rank, world_size, port, backend, gpu_ranks, tasks, results):
    # Kept open for the process's life: faulthandler writes to its descriptor from the signal handler,
    # which works while the main thread is blocked in C (a collective, a CUDA call).
    stacks = open(stacks_path(port, rank), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # LOCAL_RANK is the device: DeepSpeed's engine places its model on cuda:LOCAL_RANK.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank // gpu_ranks),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    sys.path.insert(0, REPO_ROOT)
    import torch

    torch.set_num_threads(1)
    if backend == "nccl" or gpu_ranks > 1:
        torch.cuda.set_device(rank // gpu_ranks)
    import deepspeed

    if backend == "gloo":
        # DeepSpeed binds the rank's CUDA device whenever one is visible, whatever the backend, and
        # torch (2.11) then builds every new group by splitting the default one, which gloo cannot.
        # Initialised here, DeepSpeed keeps the group as it is.
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=120))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=120))
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            return
        module_name, func_name, kwargs = task
        try:
            func = getattr(importlib.import_module(module_name), func_name)
            results.put((rank, True, func(**kwargs)))
        except BaseException:  # noqa: B902 - every failure must reach the test
            results.put((rank, False, traceback.format_exc()))


class DistPool:
    def __init__(self, world_size: int, backend: str = "gloo", start_timeout: float = 600.0, gpu_ranks: int = 1):
        """gpu_ranks > 1: that many gloo ranks share each GPU (see the module's docstring)."""
        if gpu_ranks > 1 and backend != "gloo":
            raise ValueError(f"{gpu_ranks} ranks a GPU need the gloo backend: NCCL refuses two ranks on one GPU")
        self.world_size = world_size
        self.backend = backend
        self.gpu_ranks = gpu_ranks
        self.start_timeout = start_timeout
        self.procs = []

    def _start(self):
        if self.backend == "gloo" and self.gpu_ranks == 1:
            # Here, once, before any rank starts (a minute on two cores): a rank that the start
            # timeout kills mid-build would otherwise leave torch's lock behind (jit_build.py).
            from ds_comet.kernels.jit_build import build_cpu_comm_op

            build_cpu_comm_op(self.start_timeout)
        ctx = mp.get_context("spawn")
        port = self.port = free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, self.world_size, port, self.backend, self.gpu_ranks, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self.procs:
            proc.start()
        self._collect(self.start_timeout, "start")

    def stop(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        if self.procs:
            remove_shm_buffers(self.port)
            remove_ipc_counters([proc.pid for proc in self.procs])
            _unlink_matching(stacks_path(self.port, "*"))
        self.procs = []

    def _collect(self, timeout: float, what: str):
        answers, failures = {}, []
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                # A rank whose process ended answers nothing: its failure, at once, not at the deadline.
                for rank, proc in enumerate(self.procs):
                    if rank not in answers and not proc.is_alive():
                        answers[rank] = None
                        failures.append((rank, f"its process ended (exit code {proc.exitcode}) without answering"))
                if time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(self.world_size)) - set(answers))
                try:
                    stacks = self._stacks(missing)
                    # Read before stop(): a killed process has no threads left to read.
                    silent = {
                        rank: thread_states(self.procs[rank].pid)
                        for rank in missing
                        if rank not in stacks and self.procs[rank].is_alive()
                    }
                finally:
                    self.stop()
                failures += [(rank, f"it waits here:\n{text}") for rank, text in stacks.items()]
                failures += [
                    (rank, f"it wrote no Python stacks within {STACKS_WAIT_S:.0f} s of SIGUSR1; {states}")
                    for rank, states in silent.items()
                ]
                details = "".join(f"\n--- rank {r} ---\n{v}" for r, v in failures)
                message = f"ranks {missing} gave no answer to {what} within {timeout:.0f} s{details}"
                raise TimeoutError(message) from None
            answers[rank] = value
            if not ok:
                failures.append((rank, value))
        if failures:
            # A rank that failed may have left the others mid-collective: start afresh next time.
            self.stop()
            raise AssertionError("".join(f"\n--- rank {r} ---\n{v}" for r, v in failures))
        return [answers[rank] for rank in range(self.world_size)]

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stacks of the live ``ranks``, by rank, as their faulthandler writes them on SIGUSR1
        (once a rank's writing stops; a rank that writes none within ``STACKS_WAIT_S`` is left out)."""
        asked = [rank for rank in ranks if self.procs[rank].is_alive()]
        for rank in asked:
            os.kill(self.procs[rank].pid, signal.SIGUSR1)
        written = {rank: "" for rank in asked}
        stacks, deadline = {}, time.monotonic() + STACKS_WAIT_S
        while len(stacks) < len(asked) and time.monotonic() < deadline:
            time.sleep(0.2)
            for rank in asked:
                try:
                    with open(stacks_path(self.port, rank)) as file:
                        text = file.read()
                except OSError:  # a rank still starting, before it opened its file
                    continue
                if text and text == written[rank]:
                    stacks[rank] = text
                written[rank] = text
        return stacks

    def run(self, func, timeout: float = 300.0, **kwargs):
        """Run ``func(**kwargs)`` on every rank; returns the per-rank results in rank order."""
        if not self.procs or not all(proc.is_alive() for proc in self.procs):
            self.stop()
            self._start()
        for task_queue in self.tasks:
            task_queue.put((func.__module__, func.__name__, kwargs))
        return self._collect(timeout, func.__name__)
