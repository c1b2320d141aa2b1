"""AutoEP checkpoints taken to another expert-parallel size through DeepSpeed's universal checkpoint.

A comet run saves at one EP size; DeepSpeed's ``ds_to_universal`` converts the checkpoint; a run at
another EP size, on the comet backend or on AutoEP itself, resumes from it with
``"checkpoint": {"load_universal": true}``. The cases run inside the gloo ranks; ``convert`` runs
where the test runs, as a user runs the tool.
"""

import sys

import torch
from deepspeed import comm as dist

import ds_comet
from tests.support.autoep_models import batch, ds_config, tiny_model

# Routed experts of the model at every EP size (a multiple of each size the tests take: 1, 2, 4).
EXPERTS = 8
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def convert(input_folder: str, output_folder: str) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...``,
    through the module's own argument parser, in this process (one worker: no process pool)."""
    from deepspeed.checkpoint import ds_to_universal

    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", input_folder, "--output_folder", output_folder]
    sys.argv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv


def _fresh_expert_groups() -> None:
    """Forget the expert-parallel groups that earlier cases made in this rank's process.

    DeepSpeed's universal loader slices the experts by the rank's place in the largest EP group the
    process knows (``groups._get_max_expert_size_name``); a job that resumes at EP 1 holds only its
    own group, but a pooled rank would still hold the EP 2 group of the run that saved.
    """
    from deepspeed.utils import groups

    for registry in (
        groups._EXPERT_PARALLEL_GROUP,
        groups._EXPERT_PARALLEL_GROUP_RANKS,
        groups._EXPERT_DATA_PARALLEL_GROUP,
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
    ):
        registry.clear()


def _engine(backend: str, seed: int, zero_stage: int, autoep_size: int, load_universal: bool = False):
    torch.manual_seed(seed)
    model = tiny_model("mixtral", experts=EXPERTS)
    config = ds_config("mixtral", backend, zero_stage, torch.float32)
    config["expert_parallel"]["autoep_size"] = autoep_size
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, seed: int, step: int) -> None:
    ids = batch(seed, step, engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _loss(engine, seed: int, step: int) -> float:
    ids = batch(seed, step, engine.device)
    with torch.no_grad():
        return engine(input_ids=ids, labels=ids).loss.item()


def _autoep_layers(engine) -> list:
    """The model's AutoEP layers (``CometAutoEPMoELayer`` derives from ``AutoEPMoELayer``)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [module for module in engine.module.modules() if isinstance(module, AutoEPMoELayer)]


def _full_weights(engine) -> dict[str, torch.Tensor]:
    """The model's weights with each expert tensor whole: ``[EXPERTS, ...]`` by global expert index.

    Rank r of an EP group of size N holds experts r * L .. r * L + L - 1 (L = EXPERTS / N), where
    both backends' exchanges send their rows; every rank of the world gives its rows and replicas
    (ranks of one expert-data-parallel group) must agree.
    """
    (layer,) = _autoep_layers(engine)
    first = dist.get_rank(group=layer.ep_group) * layer.num_local_experts
    local = {
        name: {first + i: row.detach().clone() for i, row in enumerate(getattr(layer.experts, name))}
        for name in EXPERT_WEIGHTS
    }
    everyone = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(everyone, local)
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if ".experts.w" not in k}
    for name in EXPERT_WEIGHTS:
        rows = {}
        for rank_rows in everyone:
            for index, row in rank_rows[name].items():
                assert index not in rows or torch.equal(rows[index], row), f"replicas of expert {index} differ"
                rows[index] = row
        assert sorted(rows) == list(range(EXPERTS)), sorted(rows)
        weights[f"experts.{name}"] = torch.stack([rows[i] for i in range(EXPERTS)])
    return weights


def _go_on(engine, seed: int) -> tuple[float, float]:
    """What a run does after step 2: step 3's loss, then (after step 3) step 4's."""
    before = _loss(engine, seed, 2)
    _step(engine, seed, 2)
    return before, _loss(engine, seed, 3)


def save_case(seed: int, save_dir: str, zero_stage: int, autoep_size: int = 2):
    """A comet run at ``autoep_size``: two steps, a checkpoint (tag ``two``) in ``save_dir``.

    Returns its weights as saved (``_full_weights``) and how the run goes on (``_go_on``).
    """
    _fresh_expert_groups()
    engine = _engine("comet", seed, zero_stage, autoep_size)
    for step in range(2):
        _step(engine, seed, step)
    engine.save_checkpoint(save_dir, tag="two")
    return _full_weights(engine), _go_on(engine, seed)


def resume_case(seed: int, universal_dir: str, zero_stage: int, autoep_size: int, backend: str):
    """A run at ``autoep_size`` on ``backend`` that resumes from the universal checkpoint in
    ``universal_dir`` (the one ``latest_universal`` names), built from other initial weights.

    Returns its weights as loaded (``_full_weights``) and how it goes on (``_go_on``).
    """
    _fresh_expert_groups()
    engine = _engine(backend, seed + 1, zero_stage, autoep_size, load_universal=True)
    layers = _autoep_layers(engine)
    expected = "CometAutoEPMoELayer" if backend == "comet" else "AutoEPMoELayer"
    assert [type(m).__name__ for m in layers] == [expected], layers
    assert layers[0].ep_size == autoep_size and layers[0].num_local_experts == EXPERTS // autoep_size
    path, _ = engine.load_checkpoint(universal_dir)
    assert path is not None, f"no universal checkpoint loaded from {universal_dir}"
    return _full_weights(engine), _go_on(engine, seed)
