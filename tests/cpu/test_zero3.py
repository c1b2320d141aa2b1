"""AutoEP under ZeRO stage 3 on ds_comet, against AutoEP under ZeRO-3 itself (CPU, gloo ranks, fp32).

ZeRO-3 partitions every parameter and gathers a module's own parameters only inside its calls. The
comet layer calls AutoEP's ``GroupedExperts`` through those calls (the reference pipeline runs it;
the fused pipeline runs its kernels as the module's call, tests/gpu), so the same seed and batches
must give AutoEP's losses and weights; checkpoints must load both ways; and experts that get no
tokens (on some rank, or on every rank) must not stall ZeRO-3's gathers, which every rank of an
expert-data-parallel group joins.
"""

import pytest
import torch

from tests.support.autoep_models import ds_config, tiny_model
from tests.support.zero3_cases import block_steps_case, checkpoint_case, training_case

pytest.importorskip("transformers")


def _seed():
    return torch.randint(1, 10**6, ()).item()


@pytest.mark.parametrize("preset", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_zero3_training_matches_autoep(cpu_pool, preset):
    for losses, comet_losses, errors, ran_fused in cpu_pool.run(training_case, preset=preset, seed=_seed()):
        assert comet_losses == pytest.approx(losses, rel=1e-5), (losses, comet_losses)
        worst = max(errors.items(), key=lambda item: item[1]["comet_vs_autoep"])
        assert worst[1]["comet_vs_autoep"] < 1e-4, worst
        assert ran_fused == {False}


@pytest.mark.parametrize("autoep_size", [1, None], ids=["every_rank_every_expert", "experts_spread"])
def test_zero3_experts_without_tokens_match_autoep(cpu_pool, autoep_size):
    """Every route goes to the first two experts. At autoep_size 1 every rank holds every expert and
    ZeRO-3 gathers their weights across the ranks; spread over the ranks (autoep_size = the world
    size), the other ranks' experts get no rows."""
    for losses, comet_losses, errors, _ in cpu_pool.run(
        training_case, preset="deepseek_v3", seed=_seed(), autoep_size=autoep_size, starve=True
    ):
        assert comet_losses == pytest.approx(losses, rel=1e-5), (losses, comet_losses)
        assert max(e["comet_vs_autoep"] for e in errors.values()) < 1e-4


@pytest.mark.parametrize("first,second", [("deepspeed", "comet"), ("comet", "deepspeed")])
def test_zero3_checkpoints_resume_across_backends(cpu_pool, tmp_path, first, second):
    cpu_pool.run(checkpoint_case, seed=_seed(), save_dir=str(tmp_path / "ckpt"), first=first, second=second)


def test_the_zero3_benchs_block_step_repeats_on_both_backends(cpu_pool):
    """``python -m ds_comet.bench.zero3`` times the MoE block's step again and again outside
    ``engine.backward``: each step must leave ZeRO-3's reduction bucket empty, or the next one fails in
    DeepSpeed's hook. The same input gives the same input gradient each step, on both backends alike."""
    for norms in cpu_pool.run(block_steps_case, seed=_seed()):
        assert norms["comet"] == pytest.approx(norms["deepspeed"], rel=1e-5), norms
        assert norms["deepspeed"] == pytest.approx([norms["deepspeed"][0]] * 3, rel=1e-6), norms


def refused_case(zero: dict, message: str):
    """A ZeRO-3 option AutoEP refuses is refused with the comet backend too, in DeepSpeed's own words."""
    import ds_comet

    model = tiny_model("mixtral")
    config = ds_config("mixtral", "comet", 3, torch.float32, overlap="none")
    config["zero_optimization"].update(zero)
    with pytest.raises(AssertionError, match=message):
        ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)


@pytest.mark.parametrize(
    "zero,message",
    [
        ({"zero_quantized_gradients": True}, "does not support zero_quantized_gradients"),
        ({"zero_hpz_partition_size": 2}, "does not support hpZeRO"),
    ],
)
def test_zero3_options_autoep_refuses_stay_refused(cpu_pool, zero, message):
    cpu_pool.run(refused_case, zero=zero, message=message)
