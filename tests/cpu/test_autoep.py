"""DeepSpeed AutoEP on ds_comet against AutoEP itself, on CPU (gloo ranks, the reference pipeline).

A tiny model from its config for each AutoEP preset (Mixtral, Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V2,
DeepSeek-V3, MiniMax-M3): the same seed and data give both backends the same weights, routes and
tokens, so outputs, every gradient, ZeRO-2 training steps and checkpoints must agree (fp32: to
rounding). Which presets the fused kernels compute is decided without a GPU and checked here too.
"""

import pytest

import ds_comet
from ds_comet.config import autoep_section_keys
from tests.support.autoep_models import (
    PRESETS,
    REFERENCE_PIPELINE_PRESETS,
    checkpoint_case,
    gradients_case,
    training_case,
)

pytest.importorskip("transformers")
FP32_REL = 1e-5


def _seed():
    import torch

    return torch.randint(1, 10**6, ()).item()


@pytest.mark.parametrize("preset", PRESETS)
def test_outputs_and_every_gradient_match_autoep(cpu_pool, preset):
    for errors, loss_diff, reasons in cpu_pool.run(gradients_case, preset=preset, seed=_seed()):
        worst = max(errors.items(), key=lambda item: item[1]["comet_vs_autoep"])
        assert worst[1]["comet_vs_autoep"] < FP32_REL, worst
        assert loss_diff < 1e-5, loss_diff
        assert None not in reasons, "on CPU the comet layers run the reference pipeline"


@pytest.mark.parametrize("preset", PRESETS)
def test_zero2_training_steps_match_autoep(cpu_pool, preset):
    for losses, comet_losses, errors in cpu_pool.run(training_case, preset=preset, seed=_seed()):
        assert comet_losses == pytest.approx(losses, rel=FP32_REL), (losses, comet_losses)
        worst = max(e["comet_vs_autoep"] for e in errors.values())
        assert worst < 1e-4, worst


@pytest.mark.parametrize("first,second", [("deepspeed", "comet"), ("comet", "deepspeed")])
@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoints_resume_across_backends(cpu_pool, tmp_path, preset, first, second):
    cpu_pool.run(
        checkpoint_case, preset=preset, seed=_seed(), save_dir=str(tmp_path / "ckpt"), first=first, second=second
    )


def fused_structure_case(preset):
    """The comet conversion under "overlap": "fused", which checks the experts' structure (no device
    needed): None where it converts, else the error's message."""
    import torch

    from tests.support.autoep_models import engine_for

    try:
        engine_for(preset, "comet", 0, 0, torch.float32, overlap="fused")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_overlap_refuses_only_experts_the_kernels_do_not_compute_and_says_why(cpu_pool, preset):
    for message in cpu_pool.run(fused_structure_case, preset=preset):
        if preset not in REFERENCE_PIPELINE_PRESETS:
            assert message is None, message
            continue
        assert message is not None, f"{preset}'s experts passed the fused pipeline's structure check"
        assert '"overlap": "fused" was asked for' in message and REFERENCE_PIPELINE_PRESETS[preset] in message
        assert "not one the fused kernels compute" in message, message


def test_autoep_keys_the_comet_backend_replaces_are_named():
    from ds_comet.integrations.autoep.layer import REPLACED_KEYS, replaced_keys_message

    assert replaced_keys_message({"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}) is None
    message = replaced_keys_message({"enabled": True, "combine_impl": "weighted_sum", "comm_max_tokens_per_rank": 8192})
    assert "combine_impl (the combine)" in message and "max_tokens_per_rank" in message, message
    # GroupedExperts follows these where the reference pipeline runs: no warning may call them moot.
    assert (
        replaced_keys_message(
            {"enabled": True, "use_grouped_mm": True, "gate_up_impl": "fused", "disable_triton_grouped_mm": True}
        )
        is None
    )
    assert set(REPLACED_KEYS) <= autoep_section_keys()  # read from DeepSpeed's parser, so a renamed key fails here
    # A key set to AutoEP's own default changes nothing that the comet backend replaces.
    assert (
        replaced_keys_message({"enabled": True, "combine_impl": "auto", "comm_num_sm": 12, "async_split_plan": False})
        is None
    )


def test_a_graphed_gate_asked_for_autoep_layers_is_named():
    from ds_comet.config import CometMoEConfig
    from ds_comet.integrations.autoep.layer import moe_keys_message

    assert moe_keys_message(CometMoEConfig(backend="comet")) is None
    assert "AutoEP's layers route with their own router" in moe_keys_message(
        CometMoEConfig(backend="comet", cuda_graph_gate=True)
    )


def deepep_case(autoep_size):
    """AutoEP with "comm_backend": "deepep" on the comet backend: AutoEP uses DeepEP only across
    ranks, so at autoep_size 1 nothing of it is replaced; above, the two exchanges conflict."""
    import torch

    from tests.support.autoep_models import ds_config, tiny_model

    config = ds_config("mixtral", "comet", 0, torch.float32, overlap="none")
    config["expert_parallel"].update(autoep_size=autoep_size, comm_backend="deepep", comm_max_tokens_per_rank=64)
    model = tiny_model("mixtral")
    try:
        ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return None


def test_deepep_conflicts_only_where_autoep_would_use_it(cpu_pool):
    from tests.support.dist_pool import cpu_world_size

    assert all(message is None for message in cpu_pool.run(deepep_case, autoep_size=1))
    if cpu_world_size() > 1:
        for message in cpu_pool.run(deepep_case, autoep_size=cpu_world_size()):
            assert "both replace AutoEP's exchange" in message, message
