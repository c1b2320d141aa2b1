"""The comet layer under torch.compile (fullgraph=False), against the same layer run eagerly.

CPU (the gloo pool's ranks, the reference pipeline): the layer compiled with the "aot_eager" and
"eager" backends (inductor's C++ build is too slow for CI) must give the eager call's output, aux
loss, expert counts, input gradient and every parameter gradient, call after call with fresh
tokens (so fresh all-to-all splits), and so must stock DeepSpeed MoE compiled the same way. The
gate's and DeepSpeed's module-level caches are emptied first, so the first call traces their
filling. The graph breaks are the host read of the splits (``.tolist()``), the row exchanges (run
eagerly: see ``ds_comet.pipelines.reference.exchange``) and the data-dependent ``repeat_interleave`` that
orders the received rows by expert, plus, on a first call, the "runs the reference pipeline" log
line and the capacity's ``int()``. Stock breaks at its capacity's ``int()``; its all-to-alls are
traced, and on torch 2.11 their compiled backward gives wrong gradients (the input gradient off
by as much as itself; 2.12 is not checked), so stock's compiled step is held to its eager one only
from 2.13, where it is right.

GPU (skipped without CUDA): the fused pipeline compiled with "aot_eager", with and without the
CUDA-graphed gate, and with inductor (its random numbers from torch's generator, as
``fallback_random`` asks: otherwise the gate's noise differs from the eager call's, stock's too),
against its eager calls within bf16 tolerance. The gate is traced (the graphed
gate runs it eagerly while Dynamo traces); the fused call runs eagerly behind a graph break
(``FusedPipeline.forward`` is excluded from tracing).
"""

import pytest
import torch
from deepspeed import comm as dist
from deepspeed.moe import sharded_moe

import ds_comet
import ds_comet.integrations.legacy.gate
from tests.support.dist_pool import cpu_world_size
from tests.support.moe_helpers import assert_same_step, build_pair, make_expert, rel, reset_experts_, run_step

HIDDEN, FFN = 24, 40
P = cpu_world_size()
STOCK_COMPILES_RIGHT = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)
GELU = {torch._C._nn.gelu, torch.nn.functional.gelu}  # the experts' activation ("gelu" experts)


def _recording(backend: str, graphs: list):
    """``backend`` that also keeps every graph Dynamo hands it."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return compile_fn


def _compiled(layer, backend: str, graphs: list):
    return torch.compile(layer, backend=_recording(backend, graphs), fullgraph=False)


def _unwrapped(step: dict) -> dict:
    """run_step's result for a compiled module, its parameter names as the module's own."""
    step["grads"] = {name.removeprefix("_orig_mod."): grad for name, grad in step["grads"].items()}
    return step


def _forget_caches():
    """Empty the gate's caches and DeepSpeed's sampler maps: the next (compiled) call fills them."""
    ds_comet.integrations.legacy.gate._capacities.clear()
    ds_comet.integrations.legacy.gate._expert_ids.clear()
    sharded_moe.exp_selection_uniform_map.clear()
    sharded_moe.gumbel_map.clear()
    sharded_moe.uniform_map.clear()


def _ran_experts(graphs) -> bool:
    """Whether some compiled graph holds the experts' activation (the layer was not skipped whole)."""
    return any(node.op == "call_function" and node.target in GELU for gm in graphs for node in gm.graph.nodes)


def compile_case(seed, k, backend, calls=2, tokens_per_rank=48):
    rank = dist.get_rank()
    stock, comet = build_pair(seed, HIDDEN, FFN, "gelu", num_experts=2 * P, ep_size=P, k=k)
    # A fresh start for every case: cache entries of earlier cases would count towards Dynamo's
    # recompile limit of these functions, past which it runs them eagerly without a word.
    torch._dynamo.reset()
    _forget_caches()
    graphs = {"comet": [], "stock": []}
    compiled = {name: _compiled(layer, backend, graphs[name]) for name, layer in (("comet", comet), ("stock", stock))}
    for call in range(calls):
        generator = torch.Generator().manual_seed(seed * 17 + call * 5 + rank)
        tokens = torch.randn(1, tokens_per_rank, HIDDEN, generator=generator)
        loss_weight = torch.randn(tokens.shape, generator=generator)
        noise_seed = seed * 31 + call * 7 + rank
        # Compiled first: the first call traces the filling of the caches emptied above.
        comet_compiled = _unwrapped(run_step(compiled["comet"], tokens, loss_weight, noise_seed))
        stock_compiled = _unwrapped(run_step(compiled["stock"], tokens, loss_weight, noise_seed))
        eager = run_step(comet, tokens, loss_weight, noise_seed)
        assert_same_step(eager, comet_compiled)
        # The parity tests hold the eager comet layer to stock's eager numbers at these tolerances.
        if STOCK_COMPILES_RIGHT:
            assert_same_step(eager, stock_compiled)
    for name, recorded in graphs.items():
        assert _ran_experts(recorded), f"{name}: no compiled graph ran the experts"
    return {name: len(recorded) for name, recorded in graphs.items()}


# A second call with other splits recompiles with symbolic sizes (Dynamo's automatic dynamic
# shapes), the state a training job runs in. Each case costs 7-20 s on two cores, so the "eager"
# backend (the same Dynamo trace as aot_eager's, without AOT autograd) runs one case, one call:
# where aot_eager fails and it passes, the AOT part is at fault.
@pytest.mark.parametrize(
    "backend,k,calls",
    [("aot_eager", 1, 2), ("aot_eager", 2, 2), ("eager", 2, 1)],
    ids=["aot_eager-k1", "aot_eager-k2", "eager-k2"],
)
def test_compiled_matches_eager(cpu_pool, backend, k, calls):
    seed = torch.randint(1, 10**6, ()).item()
    cpu_pool.run(compile_case, seed=seed, k=k, backend=backend, calls=calls)


BF16_REL = 1e-2  # as tests/gpu/test_fused.py: bf16 outputs
BF16_GRAD_REL = 2e-2  # gradients sum many bf16 products


def fused_compile_case(
    seed,
    cuda_graph_gate,
    backend="aot_eager",
    hidden=512,
    ffn=1024,
    experts_per_rank=4,
    k=2,
    tokens_per_rank=256,
    calls=3,
):
    """The fused layer compiled against its own eager calls, training steps (train-mode gate, fresh tokens)."""
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    config = {
        "moe": {"backend": "comet", "overlap": "fused", "wait_timeout_s": 20.0, "cuda_graph_gate": cuda_graph_gate}
    }
    torch.manual_seed(seed)
    layer = ds_comet.MoE(
        hidden,
        make_expert("gelu", hidden, ffn),
        num_experts=experts_per_rank * ep_size,
        ep_size=ep_size,
        k=k,
        config=config,
    )
    layer.set_deepspeed_parallelism()
    reset_experts_(layer, seed)
    layer.to(device=device, dtype=torch.bfloat16).train()
    torch._dynamo.reset()
    graphs = []
    compiled = _compiled(layer, backend, graphs)
    errors = []
    # Inductor draws random numbers with its own generator unless told to fall back to torch's, and
    # the gate's noise (top-2 sampling) then differs from the eager call's: stock's gate as well.
    with torch._inductor.config.patch(fallback_random=True):
        for call in range(calls):
            errors.append(
                _fused_compile_step(layer, compiled, seed, call, rank, cuda_graph_gate, device, hidden, tokens_per_rank)
            )
    assert graphs, "nothing was compiled"  # the gate; the experts run in the fused call, which is not traced
    return max(errors)


def _fused_compile_step(layer, compiled, seed, call, rank, cuda_graph_gate, device, hidden, tokens_per_rank):
    """One training step compiled and eagerly (fresh tokens); the largest relative error."""
    generator = torch.Generator(device=device).manual_seed(seed * 100 + call * 10 + rank)
    tokens = torch.randn(1, tokens_per_rank, hidden, generator=generator, device=device).to(torch.bfloat16)
    loss_weight = torch.randn(tokens.shape, generator=generator, device=device).to(torch.bfloat16)
    noise_seed = seed * 7 + call * 3 + rank  # the gate's top-2 sampling
    # The first call is compiled: the layer's one-time selection and workspace run under it.
    steps = {}
    for name in ("compiled", "eager") if call == 0 else ("eager", "compiled"):
        module = compiled if name == "compiled" else layer
        steps[name] = _unwrapped(run_step(module, tokens, loss_weight, noise_seed))
    moe = layer.deepspeed_moe
    assert moe.pipelines.fused is not None and moe.pipelines.reason is None, "the fused pipeline did not run"
    if cuda_graph_gate:
        assert moe.gate_graphs._captured, "the eager calls did not capture the gate"
    eager, actual = steps["eager"], steps["compiled"]
    assert torch.equal(actual["exp_counts"], eager["exp_counts"]), "exp_counts"
    torch.testing.assert_close(actual["l_aux"], eager["l_aux"], rtol=1e-5, atol=1e-6, msg="l_aux")
    assert torch.isfinite(actual["output"]).all(), "the compiled output is not finite"
    err = {"output": rel(actual["output"], eager["output"])}
    assert err["output"] < BF16_REL, err
    compared = [("input grad", actual["input_grad"], eager["input_grad"])]
    compared += [(name, actual["grads"][name], grad) for name, grad in eager["grads"].items()]
    assert actual["grads"].keys() == eager["grads"].keys()
    for what, got, want in compared:
        assert (got is None) == (want is None), f"{what}: {got is None=} {want is None=}"
        if want is not None:
            assert torch.isfinite(got).all(), f"{what}: the compiled gradient is not finite"
            err[what] = rel(got, want)
            assert err[what] < BF16_GRAD_REL, (what, err)
    return max(err.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused kernels run on GPUs")
@pytest.mark.parametrize(
    "backend,cuda_graph_gate",
    [("aot_eager", False), ("aot_eager", True), ("inductor", False)],
    ids=["eager-gate", "graphed-gate", "inductor"],
)
def test_fused_compiled_matches_eager(gpu_pool, backend, cuda_graph_gate):
    worst = gpu_pool.run(
        fused_compile_case, seed=torch.randint(1, 10**6, ()).item(), cuda_graph_gate=cuda_graph_gate, backend=backend
    )
    assert max(worst) < BF16_GRAD_REL
