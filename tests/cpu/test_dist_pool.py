"""How many ranks the test pools start, from DS_COMET_TEST_WORLD_SIZE and DS_COMET_TEST_RANKS_PER_GPU."""

import pytest

from tests.support.dist_pool import RANKS_PER_GPU_VAR, WORLD_SIZE_VAR, DistPool, gpu_world_size, ranks_per_gpu


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(WORLD_SIZE_VAR, raising=False)
    monkeypatch.delenv(RANKS_PER_GPU_VAR, raising=False)
    return monkeypatch


def test_one_rank_per_gpu_by_default(clean_env):
    assert ranks_per_gpu() == 1
    assert gpu_world_size(1) == 1 and gpu_world_size(8) == 8


def test_ranks_per_gpu_multiply_and_world_size_caps(clean_env):
    clean_env.setenv(RANKS_PER_GPU_VAR, "2")
    assert gpu_world_size(1) == 2 and gpu_world_size(2) == 4
    clean_env.setenv(WORLD_SIZE_VAR, "3")
    assert gpu_world_size(2) == 3


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_ranks_per_gpu_is_refused(clean_env, value):
    clean_env.setenv(RANKS_PER_GPU_VAR, value)
    with pytest.raises(ValueError, match=RANKS_PER_GPU_VAR):
        ranks_per_gpu()


def test_shared_gpus_need_gloo():
    with pytest.raises(ValueError, match="gloo"):
        DistPool(2, backend="nccl", gpu_ranks=2)
