"""AutoEP under ZeRO stage 3, on AutoEP alone and on ds_comet, for the CPU and GPU tests (they run
inside the test pools' ranks)."""

import pytest
import torch

from tests.support.autoep_models import batch, comet_layers, ds_config, tiny_model
from tests.support.moe_helpers import rel

STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def zero3_engine(
    preset: str,
    backend: str,
    seed: int,
    autoep_size: int | None = None,
    starve: bool = False,
    dtype: torch.dtype = torch.float32,
    overlap: str = "none",
):
    """A ZeRO-3 engine of a tiny ``preset`` model under AutoEP (``backend`` "comet": on ds_comet with
    ``overlap``); ``starve`` biases DeepSeek-V3's router so that no route picks an expert past the
    first two."""
    import ds_comet

    torch.manual_seed(seed)
    model = tiny_model(preset)
    if starve:
        gate = model.model.layers[1].mlp.gate
        gate.e_score_correction_bias[2:] = -1e4
    config = ds_config(preset, backend, 3, dtype, overlap=overlap)
    if autoep_size is not None:
        config["expert_parallel"]["autoep_size"] = autoep_size
    engine, *_ = ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def full_state(engine) -> dict:
    """Every parameter and buffer whole, by name (ZeRO-3 keeps only partitions between calls)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        state = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    state.update({name: b.detach().clone() for name, b in engine.module.named_buffers()})
    return state


def train(engine, seed: int, steps: int = STEPS, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        ids = batch(seed, step, engine.device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


def training_case(
    preset: str,
    seed: int,
    autoep_size: int | None = None,
    starve: bool = False,
    dtype_name: str = "fp32",
    overlap: str = "none",
):
    """ZeRO-3 AdamW steps of AutoEP and of AutoEP on ds_comet (with ``overlap``) from the same weights
    and batches: both runs' losses, each weight's relative distance between them and, in bf16, both
    runs' distances from AutoEP trained in fp32 (as autoep_models.training_case gives them), and
    whether the comet layers ran the fused pipeline."""
    dtype = DTYPES[dtype_name]
    stock = zero3_engine(preset, "deepspeed", seed, autoep_size, starve, dtype)
    losses, state = train(stock, seed), full_state(stock)
    comet = zero3_engine(preset, "comet", seed, autoep_size, starve, dtype, overlap)
    layers = comet_layers(comet)
    assert layers, "ds_comet converted no AutoEP layer under ZeRO-3"
    comet_losses, comet_state = train(comet, seed), full_state(comet)
    if starve:
        counts = layers[0].tokens_per_expert
        assert counts[:2].sum() > 0 and counts[2:].sum() == 0, counts
    assert state.keys() == comet_state.keys()
    errors = {
        name: {"comet_vs_autoep": rel(comet_state[name], value)} for name, value in state.items() if value.numel()
    }
    if dtype != torch.float32:
        exact = full_state_after(zero3_engine(preset, "deepspeed", seed, autoep_size, starve), seed)
        for name, error in errors.items():
            error.update(
                comet_vs_exact=rel(comet_state[name], exact[name]), autoep_vs_exact=rel(state[name], exact[name])
            )
    ran_fused = {layer.pipelines.reason is None for layer in layers}
    return losses, comet_losses, errors, ran_fused


def full_state_after(engine, seed: int) -> dict:
    """``engine``'s whole state after the training steps ``train`` takes."""
    train(engine, seed)
    return full_state(engine)


def checkpoint_case(seed: int, save_dir: str, first: str, second: str):
    """Two ZeRO-3 steps under ``first`` and a checkpoint; the checkpoint loaded under ``second`` (from
    other initial weights) must give ``first``'s weights and its next loss."""
    engine = zero3_engine("mixtral", first, seed)
    train(engine, seed, steps=2)
    engine.save_checkpoint(save_dir, tag="two")
    want_state = full_state(engine)
    want = train(engine, seed, steps=1, first=2)[0]
    other = zero3_engine("mixtral", second, seed + 1)
    path, _ = other.load_checkpoint(save_dir, tag="two")
    assert path is not None, f"{second} found no checkpoint in {save_dir}"
    got_state = full_state(other)
    assert got_state.keys() == want_state.keys()
    for name, value in want_state.items():
        # AutoEP's running token counts are a statistic that DeepSpeed's ZeRO-3 checkpoints do not
        # restore, for AutoEP alone as well.
        if not name.endswith("tokens_per_expert"):
            assert torch.equal(got_state[name], value), name
    got = train(other, seed, steps=1, first=2)[0]
    assert got == pytest.approx(want, rel=1e-6), (got, want)


def block_steps_case(seed: int, steps: int = 3) -> dict[str, list[float]]:
    """``bench.zero3``'s timed step, ``block_training_step``, run ``steps`` times on each backend's ZeRO-3
    engine (the tiny Mixtral, fp32): each step's input gradient norm, by backend."""
    from ds_comet.bench.zero3 import block_training_step

    norms = {}
    for backend in ("deepspeed", "comet"):
        engine = zero3_engine("mixtral", backend, seed)
        block = engine.module.model.layers[0].mlp
        x = torch.randn(2, 8, engine.module.config.hidden_size, requires_grad=True)
        step = block_training_step(engine, block, x, torch.randn_like(x))
        norms[backend] = []
        for _ in range(steps):
            step()
            norms[backend].append(float(x.grad.norm()))
    return norms
