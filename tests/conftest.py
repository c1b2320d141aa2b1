import os

import pytest
import torch

from tests.support.dist_pool import WORLD_SIZE_VAR, DistPool, cpu_world_size, gpu_world_size, ranks_per_gpu

SHARD_VAR = "DS_COMET_TEST_SHARD"  # "i/n": run the i-th of n interleaved parts of the selected tests


def pytest_collection_modifyitems(config, items):
    """With DS_COMET_TEST_SHARD=i/n, keep every n-th test from the i-th (0-based): a suite too long
    for one run (the fused tests with four or eight ranks sharing a GPU) runs as n parts."""
    shard = os.environ.get(SHARD_VAR)
    if not shard:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
        if not 0 <= index < count:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"{SHARD_VAR} must be i/n with 0 <= i < n, got {shard!r}") from None
    config.hook.pytest_deselected(items=[item for number, item in enumerate(items) if number % count != index])
    items[:] = [item for number, item in enumerate(items) if number % count == index]


def pytest_report_header(config):
    try:
        ranks = f"{cpu_world_size()} gloo ranks in the CPU pool"
    except ValueError as error:
        ranks = str(error)
    return f"ds_comet: {ranks} ({WORLD_SIZE_VAR}: {os.environ.get(WORLD_SIZE_VAR) or 'unset'})"


@pytest.fixture(scope="session")
def cpu_pool():
    """Gloo ranks shared by every test of the session: DS_COMET_TEST_WORLD_SIZE of them, 2 by default."""
    pool = DistPool(cpu_world_size())
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def gpu_pool():
    """One NCCL rank per visible GPU, at most DS_COMET_TEST_WORLD_SIZE, for the fused kernels; skips without CUDA.

    With DS_COMET_TEST_RANKS_PER_GPU > 1, that many gloo ranks per GPU instead (dist_pool.py).
    """
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the fused kernels run on GPUs")
    gpu_ranks = ranks_per_gpu()
    pool = DistPool(
        gpu_world_size(torch.cuda.device_count()), backend="nccl" if gpu_ranks == 1 else "gloo", gpu_ranks=gpu_ranks
    )
    yield pool
    pool.stop()
