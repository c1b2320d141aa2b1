"""``import ds_comet`` makes the ds_config's ``"moe"`` section take effect wherever DeepSpeed builds an
engine: DeepSpeed's own ``deepspeed.initialize`` here (the Hugging Face Trainer and Accelerate are run
under launchers in test_hf_trainer.py). CPU, gloo ranks."""

import logging

import pytest
import torch

from tests.support.autoep_models import batch, ds_config, tiny_model
from tests.support.moe_helpers import make_expert

pytest.importorskip("transformers")


class Captured(logging.Handler):
    """The records DeepSpeed's logger passes on, at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def moe_classes(engine) -> list[str]:
    from ds_comet.integrations.layer_classes import moe_layers

    return [type(layer).__name__ for layer in moe_layers(engine.module)]


def autoep_case(section: dict | None):
    """DeepSpeed's deepspeed.initialize on a tiny Mixtral under AutoEP: the MoE layers' classes, one
    step's loss, and the WARNING lines of DeepSpeed's logger."""
    import deepspeed
    from deepspeed.utils import logger

    import ds_comet  # noqa: F401  (the one line a user adds)

    torch.manual_seed(7)
    model = tiny_model("mixtral")
    config = ds_config("mixtral", "deepspeed", 2, torch.float32)
    del config["moe"]
    if section is not None:
        config["moe"] = section
    captured = Captured()
    logger.addHandler(captured)
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        ids = batch(7, 0, engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    finally:
        logger.removeHandler(captured)
    return moe_classes(engine), loss.item(), captured.lines


def test_the_moe_section_takes_effect_in_deepspeeds_own_initialize(cpu_pool):
    stock = cpu_pool.run(autoep_case, section=None)
    comet = cpu_pool.run(autoep_case, section={"backend": "comet"})
    told = cpu_pool.run(autoep_case, section={"backend": "deepspeed"})
    for rank, ((classes, loss, _), (c_classes, c_loss, c_lines), (d_classes, d_loss, _)) in enumerate(
        zip(stock, comet, told)
    ):
        assert classes == d_classes == ["AutoEPMoELayer"], (classes, d_classes)
        assert c_classes == ["CometAutoEPMoELayer"], c_classes
        assert c_loss == pytest.approx(loss, rel=1e-6) and d_loss == loss
        summary = [line for line in c_lines if "run the comet backend" in line]
        # One line a job, on rank 0, at the WARNING level the Trainer leaves DeepSpeed's logger at.
        expected = 1 if rank == 0 else 0
        assert len(summary) == expected, c_lines
        if summary:
            assert "1 MoE layer(s) run the comet backend: 1 on the reference pipeline" in summary[0], summary


def stock_layer_case():
    """A model built with stock deepspeed.moe.layer.MoE: its inner layer becomes the comet one."""
    import deepspeed
    from deepspeed.moe.layer import MoE

    import ds_comet  # noqa: F401

    torch.manual_seed(3)
    model = torch.nn.Sequential(MoE(16, make_expert("gelu", 16, 32), num_experts=4, ep_size=2, k=2))
    config = {"train_micro_batch_size_per_gpu": 1, "moe": {"backend": "comet", "overlap": "none"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return moe_classes(engine)


def test_stock_moe_layers_are_converted_by_deepspeeds_initialize(cpu_pool):
    for classes in cpu_pool.run(stock_layer_case):
        assert classes == ["CometMOELayer"], classes


def rebound_case():
    """A script that rebinds deepspeed.initialize to ds_comet.initialize (the first thing users try)."""
    import deepspeed

    import ds_comet

    original = deepspeed.initialize
    deepspeed.initialize = ds_comet.initialize
    try:
        model = tiny_model("mixtral")
        config = ds_config("mixtral", "comet", 2, torch.float32, overlap="none")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        deepspeed.initialize = original
    return moe_classes(engine)


def test_rebinding_deepspeed_initialize_to_ds_comets_does_not_recurse(cpu_pool):
    for classes in cpu_pool.run(rebound_case):
        assert classes == ["CometAutoEPMoELayer"], classes


def bad_section_case():
    """A mistyped "moe" key fails before DeepSpeed builds the engine (no process group work, no
    conversion of the model)."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    import ds_comet  # noqa: F401

    model = tiny_model("mixtral")
    config = ds_config("mixtral", "comet", 2, torch.float32)
    config["moe"]["overlapp"] = "fused"
    built = []
    original = DeepSpeedEngine._configure_distributed_model
    DeepSpeedEngine._configure_distributed_model = lambda self, *a, **k: built.append(1) or original(self, *a, **k)
    try:
        with pytest.raises(ValueError, match=r"unknown key 'moe.overlapp'"):
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        DeepSpeedEngine._configure_distributed_model = original
    assert not built, "the engine was built before the section was checked"


def test_a_bad_moe_section_fails_before_the_engine_is_built(cpu_pool):
    cpu_pool.run(bad_section_case)


def test_the_hook_is_installed_once():
    import importlib

    from deepspeed.runtime.engine import DeepSpeedEngine

    import ds_comet
    from ds_comet import engine_hook

    hooked = DeepSpeedEngine.__init__
    assert getattr(hooked, engine_hook.HOOK_MARK, False)
    importlib.reload(engine_hook).install()
    engine_hook.install()
    assert DeepSpeedEngine.__init__ is hooked
    assert DeepSpeedEngine.__init__.__wrapped__.__qualname__ == "DeepSpeedEngine.__init__"
    assert ds_comet.initialize.__wrapped__.__module__ == "deepspeed"


def dense_case(overlap: str):
    """A "moe" section on a model without MoE layers: said by name (an error under "overlap": "fused")."""
    import deepspeed
    from deepspeed.utils import logger

    import ds_comet  # noqa: F401

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    config = {"train_micro_batch_size_per_gpu": 1, "moe": {"backend": "comet", "overlap": overlap}}
    captured = Captured()
    logger.addHandler(captured)
    try:
        if overlap == "fused":
            with pytest.raises(ValueError, match="the model has no MoE layer to run it"):
                deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            return
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        logger.removeHandler(captured)
    assert any("the model has no MoE layer to run it" in line for line in captured.lines), captured.lines


@pytest.mark.parametrize("overlap", ["auto", "fused"])
def test_a_moe_section_on_a_model_without_moe_layers_says_why(cpu_pool, overlap):
    cpu_pool.run(dense_case, overlap=overlap)
