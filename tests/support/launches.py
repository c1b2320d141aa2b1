"""Launching a training script under a real launcher (torchrun, deepspeed, mpirun, accelerate) on CPU.

Each launch gets the rank environment from the launcher under test, not from the test process, runs
its ranks over gloo in fp32 (also on a machine with GPUs, so that runs agree bit for bit), and is
killed with every rank it started if it outlives its time.
"""

import os
import signal
import subprocess
import time

import pytest

from tests.support.dist_pool import remove_shm_buffers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The launchers' rank environment must come from the launcher under test, not from this process.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


def cpu_environment(extra: dict | None = None) -> dict:
    """This process's environment less the launchers' variables, set up for gloo ranks on CPU."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    env.update(extra or {})
    return env


def run_launch(cmd: list[str], port: int, timeout_s: float, env_extra: dict | None = None):
    """Runs ``cmd`` from the repository's root; returns (exit status, combined output, seconds).

    ``port`` is the launch's MASTER_PORT: DeepSpeed's /dev/shm buffers for it are removed after. A
    launch past ``timeout_s`` is killed with all the ranks it started and fails the test.
    """
    start = time.perf_counter()
    try:
        # A session of its own, so that a run past its time is killed with all the ranks it started.
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=cpu_environment(env_extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"timed out after {timeout_s} s\n$ {' '.join(cmd)}\n--- output tail ---\n{output[-5000:]}")
        return proc.returncode, output, time.perf_counter() - start
    finally:
        remove_shm_buffers(port)
