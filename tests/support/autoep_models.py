"""Tiny Hugging Face MoE models for the AutoEP tests (random weights from a config, no download),
and the cases the CPU and GPU tests share: AutoEP against AutoEP on ds_comet, same seed and data."""

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from tests.support.moe_helpers import rel

# Every AutoEP preset of DeepSpeed 0.19.8 whose model transformers 5.16.1 has: all of them.
PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")
# The presets whose experts the fused kernels do not compute, with what the reason names: on a GPU
# their layers run the reference pipeline, and "overlap": "fused" refuses them.
REFERENCE_PIPELINE_PRESETS = {"minimax_m3": "'swiglu_oai'"}
FUSED_PRESETS = tuple(preset for preset in PRESETS if preset not in REFERENCE_PIPELINE_PRESETS)
VOCAB = 64


def _mixtral(transformers, experts: int, ffn: int, common: dict):
    config = transformers.MixtralConfig(
        intermediate_size=ffn, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2, **common
    )
    return transformers.MixtralForCausalLM(config)


def _qwen3_moe(transformers, experts: int, ffn: int, common: dict):
    config = transformers.Qwen3MoeConfig(
        intermediate_size=2 * ffn,
        moe_intermediate_size=ffn,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        head_dim=16,
        **common,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def _qwen3_5_moe(transformers, experts: int, ffn: int, common: dict):
    # The text backbone (model type qwen3_5_moe_text), a shared expert behind a sigmoid gate. Its one
    # layer is a full-attention one: Qwen3.5's linear-attention (Gated DeltaNet) layers cost more on
    # CPU and hold the same MoE block.
    config = transformers.Qwen3_5MoeTextConfig(
        moe_intermediate_size=ffn,
        shared_expert_intermediate_size=2 * ffn,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=3,
        head_dim=16,
        layer_types=["full_attention"],
        **common,
    )
    return transformers.Qwen3_5MoeForCausalLM(config)


def _deepseek_v2(transformers, experts: int, ffn: int, common: dict):
    # Softmax scores without top-k normalisation, group-limited top-k (groups scored by their best
    # expert), a routed scaling factor, a shared expert.
    config = transformers.DeepseekV2Config(
        intermediate_size=2 * ffn,
        moe_intermediate_size=ffn,
        num_key_value_heads=4,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=8,
        **common,
    )
    return transformers.DeepseekV2ForCausalLM(config)


def _deepseek_v3(transformers, experts: int, ffn: int, common: dict):
    # Sigmoid scores, group-limited top-k, score correction bias, a shared expert; the first layer
    # dense, as in the model.
    config = transformers.DeepseekV3Config(
        intermediate_size=2 * ffn,
        moe_intermediate_size=ffn,
        num_key_value_heads=4,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=8,
        **{**common, "num_hidden_layers": 2},
    )
    return transformers.DeepseekV3ForCausalLM(config)


def _minimax_m3(transformers, experts: int, ffn: int, common: dict):
    # The text backbone (model type minimax_m3_vl_text): the clamped GPT-OSS expert activation
    # ("swiglu_oai"), sigmoid scores with a correction-bias buffer, the routed output scaled by 2, a
    # shared expert. One full-attention layer (no sparse-attention indexer).
    config = transformers.MiniMaxM3VLTextConfig(
        intermediate_size=ffn,
        shared_intermediate_size=ffn,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        head_dim=16,
        rotary_dim=8,
        layer_types=["full_attention"],
        mlp_layer_types=["sparse"],
        bos_token_id=None,
        eos_token_id=None,
        **common,
    )
    return transformers.MiniMaxM3VLForCausalLM(config)


_BUILDERS = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5_moe": _qwen3_5_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "minimax_m3": _minimax_m3,
}


def tiny_model(preset: str, hidden: int = 64, ffn: int = 96, experts_per_rank: int = 4, experts: int | None = None):
    """A model of ``preset``'s family with one MoE block, which AutoEP converts: ``experts`` routed
    experts (by default ``experts_per_rank`` for each rank of the world).

    One: the input of a second MoE block would carry the first one's bf16 rounding, which differs
    between backends (other GEMM kernels), and a top-k choice near a tie that flips on it moves a
    token's whole gradient to another expert: a tiny model's expert gradients then differ by ~10 %
    for a reason that is not the backend's.
    """
    transformers = pytest.importorskip("transformers")
    if experts is None:
        experts = experts_per_rank * dist.get_world_size()
    common = dict(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64
    )
    return _BUILDERS[preset](transformers, experts, ffn, common)


def ds_config(
    preset: str,
    backend: str,
    zero_stage: int,
    dtype: torch.dtype,
    overlap: str = "auto",
    activation_rows: str = "bound",
    fp8: dict | None = None,
) -> dict:
    """A ds_config for ``preset``'s model under ``backend``; ``fp8``: the comet backend's "fp8" recipe."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": zero_stage},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": dist.get_world_size(),
            "preset_model": preset,
            "use_grouped_mm": torch.cuda.is_available(),
        },
        "moe": (
            {"backend": backend, "overlap": overlap, "activation_rows": activation_rows}
            if backend == "comet"
            else {"backend": backend}
        ),
    }
    if fp8 is not None:
        config["moe"]["fp8"] = fp8
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    return config


def engine_for(
    preset: str,
    backend: str,
    seed: int,
    zero_stage: int,
    dtype: torch.dtype,
    overlap: str = "auto",
    activation_rows: str = "bound",
    fp8: dict | None = None,
    sizes: tuple[int, int] = (64, 96),
):
    """``preset``'s tiny model (hidden and FFN ``sizes``) in an engine of ``backend``, ``ds_config``'s."""
    torch.manual_seed(seed)
    model = tiny_model(preset, *sizes)
    config = ds_config(preset, backend, zero_stage, dtype, overlap, activation_rows, fp8)
    engine, *_ = ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(seed: int, step: int, device):
    generator = torch.Generator().manual_seed(seed * 1000 + step * 10 + dist.get_rank())
    ids = torch.randint(0, VOCAB, (2, 24), generator=generator)
    return ids.to(device)


def comet_layers(engine):
    return [m for m in engine.module.modules() if type(m).__name__ == "CometAutoEPMoELayer"]


def _forward_backward(
    preset: str,
    backend: str,
    seed: int,
    dtype: torch.dtype,
    overlap: str,
    activation_rows: str = "bound",
    fp8: dict | None = None,
    sizes: tuple[int, int] = (64, 96),
):
    engine = engine_for(preset, backend, seed, 0, dtype, overlap, activation_rows, fp8, sizes)
    ids = batch(seed, 0, engine.device)
    # The converted model called directly and torch.autograd.grad, not the engine's forward and
    # backward: the gradients as autograd computes them, before any optimizer hook (DeepSpeed's bf16
    # optimizer moves them into its own buffers as they arrive).
    out = engine.module(input_ids=ids, labels=ids)
    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, [p for _, p in named], allow_unused=True)
    grads = {name: grad.detach().float() for (name, _), grad in zip(named, grads) if grad is not None}
    return engine, {"logits": out.logits.detach().float(), **grads}, out.loss.item()


def gradients_case(
    preset: str, seed: int, dtype_name: str = "fp32", overlap: str = "auto", activation_rows: str = "bound"
):
    """One forward and backward of AutoEP and of AutoEP on ds_comet (its activations sized as
    ``activation_rows`` says): the logits and every parameter's gradient, by name.

    Returns, per tensor, comet's relative difference from AutoEP and, in bf16, both backends'
    differences from AutoEP in fp32 (the same weights: the ground truth both round away from);
    the loss difference; and the set of the comet layers' reasons for not running the fused
    pipeline (``{None}`` where they all ran it).
    """
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    _, stock, loss = _forward_backward(preset, "deepspeed", seed, dtype, overlap)
    engine, comet, comet_loss = _forward_backward(preset, "comet", seed, dtype, overlap, activation_rows)
    layers = comet_layers(engine)
    assert layers, "ds_comet.initialize converted no AutoEP layer"
    reasons = {layer.pipelines.reason for layer in layers}
    assert stock.keys() == comet.keys() and len(stock) > 10, sorted(set(stock) ^ set(comet))
    errors = {name: {"comet_vs_autoep": rel(comet[name], value)} for name, value in stock.items()}
    if dtype != torch.float32:
        _, exact, _ = _forward_backward(preset, "deepspeed", seed, torch.float32, overlap)
        for name, value in exact.items():
            errors[name].update(comet_vs_exact=rel(comet[name], value), autoep_vs_exact=rel(stock[name], value))
    return errors, abs(comet_loss - loss), reasons


def fp8_case(preset: str, seed: int, recipe: dict):
    """One forward and backward of AutoEP on ds_comet without and with the "fp8" ``recipe`` (the
    reference pipeline), same weights and data: per tensor (the logits and every parameter's
    gradient, by name) the recipe's relative difference from the run without it; and, per comet
    layer, the type of the experts its reference pipeline runs."""
    _, plain, _ = _forward_backward(preset, "comet", seed, torch.float32, "none")
    engine, emulated, _ = _forward_backward(preset, "comet", seed, torch.float32, "none", fp8=recipe)
    layers = comet_layers(engine)
    assert layers and plain.keys() == emulated.keys()
    kinds = [type(layer.pipelines.reference.experts).__name__ for layer in layers]
    return {name: rel(emulated[name], value) for name, value in plain.items()}, kinds


# The blockwise recipe on the fused pipeline: rows cross in bf16; hidden and FFN sizes of 128.
FUSED_FP8_RECIPE = {"enabled": True, "dispatch": "bf16"}
FP8_SIZES = (128, 128)


def fp8_fused_case(preset: str, seed: int, recipe: dict | None = None):
    """One forward and backward of AutoEP on ds_comet under ``recipe`` (``FUSED_FP8_RECIPE`` by
    default), in bf16, on the fused pipeline and on the reference pipeline's emulation; and without the
    recipe, fused, and AutoEP in fp32 (the same weights). Returns, per tensor (the logits and every
    parameter's gradient), the fused FP8 run's relative difference from each of those, and the plain
    run's from AutoEP in fp32; and per comet layer, (its reason for not running the fused pipeline,
    whether its fused pipeline runs FP8 GEMMs)."""
    bf16, recipe = torch.bfloat16, recipe or FUSED_FP8_RECIPE
    engine, fused, _ = _forward_backward(preset, "comet", seed, bf16, "fused", fp8=recipe, sizes=FP8_SIZES)
    ran = [
        (layer.pipelines.reason, layer.pipelines.fused is not None and layer.pipelines.fused.fp8 is not None)
        for layer in comet_layers(engine)
    ]
    _, emulated, _ = _forward_backward(preset, "comet", seed, bf16, "none", fp8=recipe, sizes=FP8_SIZES)
    _, plain, _ = _forward_backward(preset, "comet", seed, bf16, "fused", sizes=FP8_SIZES)
    _, exact, _ = _forward_backward(preset, "deepspeed", seed, torch.float32, "none", sizes=FP8_SIZES)
    differences = {
        name: dict(
            emulated=rel(value, emulated[name]),
            plain=rel(value, plain[name]),
            exact=rel(value, exact[name]),
            plain_exact=rel(plain[name], exact[name]),
        )
        for name, value in fused.items()
    }
    return differences, ran


def fp8_training_case(preset: str, seed: int, steps: int = 3):
    """ZeRO-2 AdamW steps in bf16 of AutoEP on ds_comet under ``FUSED_FP8_RECIPE``, fused and emulated,
    from the same weights and batches. DeepSpeed's optimizer writes the weights through ``.data``: the
    fused layers must quantise them anew after every step. Returns both runs' losses and the fused
    layers' quantisation counts."""

    def train(overlap: str):
        engine = engine_for(preset, "comet", seed, 2, torch.bfloat16, overlap, fp8=FUSED_FP8_RECIPE, sizes=FP8_SIZES)
        losses = []
        for step in range(steps):
            ids = batch(seed, step, engine.device)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        return losses, engine

    losses, engine = train("fused")
    counts = [layer.pipelines.fused.fp8_weights.quantisations for layer in comet_layers(engine)]
    emulated, _ = train("none")
    return losses, emulated, counts


def training_case(preset: str, seed: int, steps: int = 3, dtype_name: str = "fp32", overlap: str = "auto"):
    """ZeRO-2 AdamW steps of AutoEP and of AutoEP on ds_comet from the same weights and batches.

    ``overlap`` is the comet run's (``"fused"`` makes a fallback to the reference pipeline an error).
    Returns both runs' losses and, per weight, comet's relative distance from AutoEP's final value
    and, in bf16, both backends' distances from AutoEP trained in fp32 (the value both round away
    from: Adam's normalised steps carry a weight's bf16 noise of one step into the next).
    """
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]

    def train(backend: str, dtype: torch.dtype):
        engine = engine_for(preset, backend, seed, 2, dtype, overlap)
        losses = []
        for step in range(steps):
            ids = batch(seed, step, engine.device)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        return losses, {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}

    losses, state = train("deepspeed", dtype)
    c_losses, c_state = train("comet", dtype)
    assert state.keys() == c_state.keys()
    errors = {k: {"comet_vs_autoep": rel(c_state[k], v)} for k, v in state.items() if v.numel()}
    if dtype != torch.float32:
        _, exact = train("deepspeed", torch.float32)
        for k, e in errors.items():
            e.update(comet_vs_exact=rel(c_state[k], exact[k]), autoep_vs_exact=rel(state[k], exact[k]))
    return losses, c_losses, errors


def checkpoint_case(preset: str, seed: int, save_dir: str, first: str, second: str):
    """Train under ``first`` and save; load the checkpoint under ``second``: the weights and the next
    step's loss must be what ``first`` gets when it goes on."""
    engine = engine_for(preset, first, seed, 2, torch.float32)
    for step in range(2):
        ids = batch(seed, step, engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag="two")
    ids = batch(seed, 2, engine.device)
    want = engine(input_ids=ids, labels=ids).loss.item()
    want_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    other = engine_for(preset, second, seed + 1, 2, torch.float32)  # other initial weights: the load must set them
    path, _ = other.load_checkpoint(save_dir, tag="two")
    assert path is not None, f"{second} found no checkpoint in {save_dir}"
    got_state = other.module.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key
    got = other(input_ids=ids, labels=ids).loss.item()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    return got
