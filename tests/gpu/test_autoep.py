"""DeepSpeed AutoEP on ds_comet's fused pipeline against AutoEP itself, and users' own expert classes
on the fused pipeline, on GPUs (skipped without CUDA or without transformers for the AutoEP cases)."""

import pytest
import torch
from deepspeed import comm as dist

import ds_comet
from tests.support.autoep_models import FUSED_PRESETS, REFERENCE_PIPELINE_PRESETS, gradients_case, training_case
from tests.support.moe_helpers import MixtralStyleMLP, rel

BF16_REL = 2e-2


def _seed():
    return torch.randint(1, 10**6, ()).item()


def _assert_bf16_as_close_as_autoep(errors: dict, loss_diff: float):
    # Both round the same fp32 computation to bf16: comet may not stray further from it than
    # AutoEP does (twice, or a bf16 rounding's worth, whichever is larger).
    worse = {name: e for name, e in errors.items() if e["comet_vs_exact"] > max(2 * e["autoep_vs_exact"], BF16_REL)}
    assert not worse, sorted(worse.items(), key=lambda item: -item[1]["comet_vs_exact"])[:6]
    assert loss_diff < 2e-2, loss_diff


@pytest.mark.parametrize("activation_rows", ["bound", "received"])
@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_fused_outputs_and_gradients_match_autoep(gpu_pool, preset, activation_rows):
    pytest.importorskip("transformers")
    for errors, loss_diff, reasons in gpu_pool.run(
        gradients_case, preset=preset, seed=_seed(), dtype_name="bf16", overlap="fused", activation_rows=activation_rows
    ):
        assert reasons == {None}, f"the comet layers did not run the fused pipeline: {reasons}"
        _assert_bf16_as_close_as_autoep(errors, loss_diff)


@pytest.mark.parametrize("preset", sorted(REFERENCE_PIPELINE_PRESETS))
def test_presets_the_kernels_do_not_compute_run_the_reference_pipeline_and_say_why(gpu_pool, preset):
    pytest.importorskip("transformers")
    for errors, loss_diff, reasons in gpu_pool.run(
        gradients_case, preset=preset, seed=_seed(), dtype_name="bf16", overlap="auto"
    ):
        named = REFERENCE_PIPELINE_PRESETS[preset]
        assert reasons and all(reason is not None and named in reason for reason in reasons), reasons
        _assert_bf16_as_close_as_autoep(errors, loss_diff)


def test_fused_zero2_training_matches_autoep(gpu_pool):
    pytest.importorskip("transformers")
    for losses, comet_losses, errors in gpu_pool.run(
        training_case, preset="mixtral", seed=_seed(), steps=4, dtype_name="bf16", overlap="fused"
    ):
        assert comet_losses == pytest.approx(losses, rel=2e-2), (losses, comet_losses)
        # Judged as the gradients are: no further from AutoEP trained in fp32 than AutoEP in bf16 is
        # (twice, or a bf16 rounding's worth), weight by weight.
        worse = {name: e for name, e in errors.items() if e["comet_vs_exact"] > max(2 * e["autoep_vs_exact"], BF16_REL)}
        assert not worse, sorted(worse.items(), key=lambda item: -item[1]["comet_vs_exact"])[:6]


def user_expert_case(seed):
    """The registered class on the fused pipeline: output and every gradient as its own forward gives
    them on the reference pipeline (same weights, routes and tokens)."""
    ds_comet.register_expert(MixtralStyleMLP, first="w1", up="w3", second="w2", activation="silu")
    ep_size, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    layers = {}
    for overlap in ("none", "fused"):
        torch.manual_seed(seed)
        layer = ds_comet.MoE(
            512,
            MixtralStyleMLP(512, 768),
            num_experts=4 * ep_size,
            ep_size=ep_size,
            k=2,
            config={"moe": {"backend": "comet", "overlap": overlap}},
        )
        layer.set_deepspeed_parallelism()
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            ds_comet.experts.reset_expert_(expert, seed * 100 + rank * 4 + i)
        layers[overlap] = layer.to(device=device, dtype=torch.bfloat16).train()
    generator = torch.Generator(device=device).manual_seed(seed + rank)
    tokens = torch.randn(1, 300, 512, generator=generator, device=device).to(torch.bfloat16)
    grad_out = torch.randn(1, 300, 512, generator=generator, device=device).to(torch.bfloat16)
    results = {}
    for overlap, layer in layers.items():
        x = tokens.clone().requires_grad_()
        torch.manual_seed(seed)
        out, l_aux, _ = layer(x)
        torch.autograd.backward([out, l_aux], [grad_out, torch.ones_like(l_aux)])
        results[overlap] = (out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()})
    assert layers["fused"].deepspeed_moe.pipelines.reason is None, layers["fused"].deepspeed_moe.pipelines.reason
    (out, grad, grads), (want, want_grad, want_grads) = results["fused"], results["none"]

    worst = max([rel(out, want), rel(grad, want_grad)] + [rel(grads[n], g) for n, g in want_grads.items()])
    assert worst < 2 * BF16_REL, worst
    return worst


def test_user_expert_class_runs_fused_with_its_own_numbers(gpu_pool):
    gpu_pool.run(user_expert_case, seed=_seed())


@pytest.mark.parametrize("preset", ["mixtral", "qwen3_moe"])
def test_fused_zero3_training_matches_autoep(gpu_pool, preset):
    """Under ZeRO-3 the fused call runs as GroupedExperts' own call, whose hooks gather the weights for
    the forward and again for the backward: AutoEP's ZeRO-3 steps, in bf16, judged as ZeRO-2's are."""
    pytest.importorskip("transformers")
    from tests.support.zero3_cases import training_case as zero3_training_case

    for losses, comet_losses, errors, ran_fused in gpu_pool.run(
        zero3_training_case, preset=preset, seed=_seed(), dtype_name="bf16", overlap="fused"
    ):
        assert ran_fused == {True}, "the comet layers did not run the fused pipeline under ZeRO-3"
        assert comet_losses == pytest.approx(losses, rel=2e-2), (losses, comet_losses)
        worse = {name: e for name, e in errors.items() if e["comet_vs_exact"] > max(2 * e["autoep_vs_exact"], BF16_REL)}
        assert not worse, sorted(worse.items(), key=lambda item: -item[1]["comet_vs_exact"])[:6]
