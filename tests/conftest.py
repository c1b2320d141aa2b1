import pytest
import torch

from dist_pool import DistPool


@pytest.fixture(scope="session")
def dist2():
    """Two gloo ranks shared by every test of the session."""
    pool = DistPool(2)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def gpu_pool():
    """One NCCL rank per GPU (at most two), for the fused kernels; skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the fused kernels run on GPUs")
    pool = DistPool(min(torch.cuda.device_count(), 2), backend="nccl")
    yield pool
    pool.stop()
