"""A comet run's AutoEP checkpoint resumed at other EP sizes through DeepSpeed's universal checkpoint.

Saved at EP 2 on the comet backend, converted with DeepSpeed's ``ds_to_universal``, resumed with
``"checkpoint": {"load_universal": true}`` at EP 1 (the pool's ranks, each with every expert) and at
EP 4 (four ranks): every weight, each expert tensor gathered whole by global expert index, is the
one saved, and the run goes on as AutoEP itself resumed from the same universal checkpoint does
(and at EP 1, on the same ranks and batches, as the run that saved goes on).
"""

import pytest
import torch

from tests.support.autoep_universal import convert, resume_case, save_case
from tests.support.dist_pool import DistPool

pytest.importorskip("transformers")
FP32_REL = 1e-5


@pytest.fixture(scope="module")
def universal_checkpoint(cpu_pool, tmp_path_factory):
    """``universal_checkpoint(zero_stage)``: (the folder to resume from, the seed, the saving run's
    weights and how it went on, per rank), saved at EP 2 and converted once per stage."""
    if cpu_pool.world_size % 2:
        pytest.skip(f"the checkpoint is saved at EP 2, which {cpu_pool.world_size} ranks cannot hold")
    made = {}

    def make(zero_stage: int):
        if zero_stage not in made:
            root = tmp_path_factory.mktemp(f"autoep_zero{zero_stage}")
            seed = torch.randint(1, 10**6, ()).item()
            saved = cpu_pool.run(save_case, seed=seed, save_dir=str(root / "saved"), zero_stage=zero_stage)
            convert(str(root / "saved" / "two"), str(root / "universal" / "two"))
            made[zero_stage] = (str(root / "universal"), seed, saved)
        return made[zero_stage]

    return make


def _assert_weights_equal(got: dict, want: dict):
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _resume_both(pool, folder: str, seed: int, zero_stage: int, autoep_size: int):
    """The comet backend and AutoEP itself resumed at ``autoep_size``: the comet run's answers, per
    rank, after checking that its losses are AutoEP's."""
    kwargs = dict(seed=seed, universal_dir=folder, zero_stage=zero_stage, autoep_size=autoep_size)
    comet = pool.run(resume_case, backend="comet", **kwargs)
    autoep = pool.run(resume_case, backend="deepspeed", **kwargs)
    for (_, comet_losses), (_, autoep_losses) in zip(comet, autoep):
        assert comet_losses == pytest.approx(autoep_losses, rel=FP32_REL), (comet_losses, autoep_losses)
    return comet


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_resumes_at_ep1_where_the_saving_run_goes_on(cpu_pool, universal_checkpoint, zero_stage):
    folder, seed, saved = universal_checkpoint(zero_stage)
    resumed = _resume_both(cpu_pool, folder, seed, zero_stage, autoep_size=1)
    for (weights, losses), (saved_weights, saved_losses) in zip(resumed, saved):
        _assert_weights_equal(weights, saved_weights)
        # The same ranks and batches: the optimizer's state came through too.
        assert losses == pytest.approx(saved_losses, rel=FP32_REL), (losses, saved_losses)


def test_resumes_at_ep4(cpu_pool, universal_checkpoint):
    folder, seed, saved = universal_checkpoint(2)
    pool = cpu_pool if cpu_pool.world_size == 4 else DistPool(4)
    try:
        resumed = _resume_both(pool, folder, seed, 2, autoep_size=4)
    finally:
        if pool is not cpu_pool:
            pool.stop()
    for weights, _ in resumed:
        _assert_weights_equal(weights, saved[0][0])
