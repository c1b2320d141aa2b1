"""Starting torch.distributed for a DeepSpeed training script, under any launcher, on GPUs or on CPU.

``init_distributed`` is ``deepspeed.init_distributed`` with what a script otherwise adds around it:

- under a bare single-node ``mpirun`` the ranks come from the MPI launcher's environment
  (``adopt_mpi_launcher_env``) rather than from DeepSpeed's mpi4py discovery;
- each rank takes its GPU (``LOCAL_RANK``) before NCCL comes up;
- gloo on GPUs (ranks that share a GPU: NCCL refuses them) gets a default group that can be split
  into the expert-parallel groups;
- on CPU, DeepSpeed's shm comm op is built under a lock of ds_comet's own, and each rank takes its
  share of the CPU cores as torch threads;
- the process groups' timeout, and the bound of ``ds_comet.collectives``' waits, come from the
  ds_config's ``"moe": {"wait_timeout_s"}`` (``collectives.set_wait_timeout``);
- each rank exits when the launcher that started it is gone (``watch_launcher``).

A rank started by a launcher (torchrun, the ``deepspeed`` command, mpirun) would otherwise outlive it
in two ways. Killed with SIGKILL, no launcher can stop its ranks. And the ``deepspeed`` command on one
node starts ``deepspeed.launcher.launch``, which starts the ranks, and forwards it no signal: SIGTERM
or SIGINT (Ctrl-C aside, which reaches the whole terminal's process group) ends the command alone, and
``launch.py`` and its ranks train on. ``watch_launcher`` watches, from a thread, the rank's parent
and, when that parent is DeepSpeed's ``launch.py``, the command above it: once either is gone, the
rank says so on stderr and exits (then ``launch.py``, seeing a rank fail, ends the others). A
rank's parent dying would also be caught by ``prctl(PR_SET_PDEATHSIG)``, but not the command above
``launch.py``, and not off Linux: the watch reads ``os.getppid()`` and ``/proc``.
"""

import os
import sys
import threading
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from . import collectives
from .config import moe_config_from
from .kernels.jit_build import build_cpu_comm_op

# DeepSpeed's per-node launcher, which the `deepspeed` command runs and forwards no signal to.
DEEPSPEED_NODE_LAUNCHER = "deepspeed.launcher.launch"
LAUNCHER_POLL_S = 1.0  # how often a rank looks for its launcher
LAUNCHER_GONE_EXIT_CODE = 1
# Set in a rank's environment by the launchers that start ranks: torchrun and the deepspeed command
# (LOCAL_RANK), Open MPI and MPICH's Hydra.
LAUNCHED_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

# (rank, world size, local rank, local size) as MPI launchers name them: Open MPI, then MPICH/Hydra.
MPI_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def adopt_mpi_launcher_env(environ=os.environ) -> dict[str, str]:
    """Under a bare single-node mpirun, sets the torch.distributed variables from the MPI launcher's own.

    DeepSpeed would otherwise discover the ranks through mpi4py and take the master address from the
    first word of ``hostname -I``, overriding a MASTER_ADDR passed with ``mpirun -x``; on a machine
    without a network interface that word does not exist. Here the ranks come from the launcher's
    environment, MASTER_ADDR stays what the caller set (127.0.0.1 if unset) and MASTER_PORT too
    (29500 if unset). A launcher that set RANK, WORLD_SIZE and LOCAL_RANK itself, and multi-node jobs
    (local size < world size, left to DeepSpeed's mpi4py discovery), are left alone.

    Args:
        environ: the environment to read and update.

    Returns:
        The variables it set ({} when it set none).
    """
    if all(environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return {}
    for rank_key, size_key, local_rank_key, local_size_key in MPI_LAUNCHER_VARS:
        values = [environ.get(key) for key in (rank_key, size_key, local_rank_key, local_size_key)]
        if not all(values):
            continue
        rank, size, local_rank, local_size = (int(value) for value in values)
        if local_size != size:
            return {}
        found = dict(
            RANK=str(rank),
            WORLD_SIZE=str(size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(size),
            MASTER_ADDR=environ.get("MASTER_ADDR") or "127.0.0.1",
            MASTER_PORT=environ.get("MASTER_PORT") or "29500",
        )
        environ.update(found)
        return found
    return {}


def _local_world_size(world_size: int) -> int:
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(key):
            return int(os.environ[key])
    return world_size


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def init_distributed(
    dist_backend: str | None = None, ds_config=None, exit_with_launcher: bool = True
) -> dict[str, str]:
    """Starts torch.distributed through ``deepspeed.init_distributed`` (see the module's docstring).

    The ranks come from the launcher's environment (deepspeed, torchrun), from an MPI launcher's
    under a bare single-node mpirun, else from DeepSpeed's mpi4py discovery; a MASTER_PORT in the
    environment is honoured (DeepSpeed would otherwise use 29500).

    Args:
        dist_backend: ``"nccl"``, ``"gloo"``, or None for DeepSpeed's choice for the accelerator.
            gloo with GPUs needs the ranks in the environment (a launcher, or a one-node mpirun).
        ds_config: the job's ds_config (a dict, a path, ...; ``ds_comet.moe_config_from``'s forms):
            its ``"moe": {"wait_timeout_s"}`` (240 s without one) bounds ``ds_comet.collectives``'
            waits and sets the process groups' timeout (``collectives.set_wait_timeout``).
        exit_with_launcher: under a launcher, end this rank when the launcher is gone (the module's
            docstring); False leaves the rank to the launcher alone.

    Returns:
        The variables taken from an MPI launcher's environment ({} under any other launcher).
    """
    if exit_with_launcher and any(os.environ.get(var) for var in LAUNCHED_VARS):
        watch_launcher()
    timeout = collectives.set_wait_timeout(moe_config_from(ds_config).wait_timeout_s)
    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    from_mpi = adopt_mpi_launcher_env()
    if not on_cpu and os.environ.get("LOCAL_RANK"):
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))  # one device per rank before NCCL comes up
    if dist_backend == "gloo" and not on_cpu and os.environ.get("WORLD_SIZE"):
        # DeepSpeed would bind the rank's device to the default group, and torch then makes every new
        # group (the expert groups) by splitting it, which gloo cannot do; a group made here is kept.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group("gloo", timeout=timeout)
    if on_cpu:
        # DeepSpeed's init_distributed would JIT-build its CPU comm op under torch's plain lock, which
        # an interrupted first launch leaves behind for every later run to wait on without a word.
        build_cpu_comm_op()
    deepspeed.init_distributed(
        dist_backend=dist_backend, distributed_port=int(os.environ.get("MASTER_PORT", 29500)), timeout=timeout
    )
    if on_cpu:
        world_size = torch.distributed.get_world_size()
        torch.set_num_threads(max(1, _usable_cpus() // _local_world_size(world_size)))
    else:
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return from_mpi


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (from ``/proc``), or None where it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # "pid (command) state ppid ...": the command may hold spaces and parentheses.
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def _command_line(pid: int) -> str:
    """The command line of process ``pid`` (from ``/proc``), "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launchers() -> list[tuple[int, int, str]]:
    """The processes this rank exits without, as ``(child, parent, what the parent is)``: this
    process and its parent, and, when that parent is DeepSpeed's ``launch.py``, ``launch.py`` and the
    ``deepspeed`` command above it. A parent is gone once its child has another."""
    parent = os.getppid()
    watched = [(os.getpid(), parent, f"its launcher (pid {parent})")]
    if DEEPSPEED_NODE_LAUNCHER in _command_line(parent):
        runner = _parent_of(parent)
        if runner is not None and runner > 1:
            watched.append((parent, runner, f"the deepspeed command above {DEEPSPEED_NODE_LAUNCHER} (pid {runner})"))
    return watched


def watch_launcher(poll_s: float = LAUNCHER_POLL_S) -> threading.Thread:
    """Starts a daemon thread that ends this process, with a line on stderr, once a process of
    ``launchers()`` is gone: its child in the chain then has another parent (see the module's docstring).

    Returns:
        The thread.
    """
    watched = launchers()

    def parent_now(pid: int) -> int | None:
        return os.getppid() if pid == os.getpid() else _parent_of(pid)

    def watch():
        while True:
            time.sleep(poll_s)
            for child, parent, what in watched:
                if parent_now(child) != parent:
                    rank = os.environ.get("RANK", "?")
                    sys.stdout.flush()
                    sys.stderr.write(
                        f"ds_comet: rank {rank}: {what} is gone; this rank exits rather than train on without it\n"
                    )
                    sys.stderr.flush()
                    os._exit(LAUNCHER_GONE_EXIT_CODE)

    thread = threading.Thread(target=watch, name="ds_comet launcher watch", daemon=True)
    thread.start()
    return thread
