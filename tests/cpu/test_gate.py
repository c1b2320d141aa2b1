"""ds_comet.integrations.legacy.gate.gate_routes against DeepSpeed's TopKGate itself, on CPU (and on
CUDA where present).

Every returned tensor, the gradients of a random mix of l_aux and the gates (w.r.t. the gate weight
and the input) and the RNG state after the call must equal stock's bit for bit, for fresh inputs
drawn under the same seed. A dispatch-level log of the ops also checks what the fast path is for:
no scan over the token dimension, no capacity max where nothing is dropped, no host read of device
data, and fewer ops than stock.
"""

import pytest
import torch
from deepspeed.moe import sharded_moe
from deepspeed.moe.sharded_moe import TopKGate
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ds_comet.integrations.legacy.gate as gate_module
from ds_comet.integrations.legacy.gate import gate_routes

aten = torch.ops.aten
MODEL_DIM = 12


def make_gate(
    k,
    num_experts=8,
    capacity_factor=1.0,
    eval_capacity_factor=1.0,
    min_capacity=4,
    noisy_gate_policy=None,
    drop_tokens=True,
    use_rts=True,
    top2_2nd_expert_sampling=True,
    seed=0,
):
    torch.manual_seed(seed)
    return TopKGate(
        MODEL_DIM,
        num_experts,
        k,
        capacity_factor,
        eval_capacity_factor,
        min_capacity,
        noisy_gate_policy,
        drop_tokens,
        use_rts,
        None,
        top2_2nd_expert_sampling,
    )


def make_tokens(gate, num_tokens, seed, skew=0.0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, MODEL_DIM, generator=generator)
    if skew:
        # Lean every token towards expert 0 (overflow, dropped routes) and push the last expert so
        # far away that not even top-2's Gumbel sampling reaches it (an expert with no tokens).
        with torch.no_grad():
            lean = gate.wg.weight[0] / gate.wg.weight[0].square().sum()
            tokens += (skew - tokens @ gate.wg.weight[0]).clamp(min=0).unsqueeze(1) * lean
            gate.wg.weight[-1] = -20 * gate.wg.weight[0]
    return tokens.to(dtype)


def stock_routes(gate, tokens, used_token=None):
    l_aux, _, num_experts, indices, _, gates, exp_counts = gate(tokens, used_token, True)
    return l_aux, num_experts, indices, gates, exp_counts


def run_gate(routes_fn, gate, tokens, used_token, seed, mix_seed):
    """One call under `seed`, then the gradients of a random mix of its differentiable outputs."""
    inputs = tokens.clone().requires_grad_()
    torch.manual_seed(seed)
    l_aux, num_experts, indices, gates, exp_counts = routes_fn(gate, inputs, used_token)
    rng_state = torch.get_rng_state() if tokens.device.type == "cpu" else torch.cuda.get_rng_state(tokens.device)
    generator = torch.Generator().manual_seed(mix_seed)
    l_aux_weight = torch.randn((), generator=generator).to(tokens.device)
    gate_weights = torch.randn(gates.shape, generator=generator).to(tokens.device)
    loss = l_aux_weight * l_aux + (gates * gate_weights).sum()
    weight_grad, input_grad = torch.autograd.grad(loss, [gate.wg.weight, inputs])
    return dict(
        l_aux=l_aux.detach(),
        num_experts=num_experts,
        indices=indices,
        gates=gates.detach(),
        exp_counts=exp_counts,
        rng_state=rng_state,
        weight_grad=weight_grad,
        input_grad=input_grad,
    )


def assert_bitwise_equal(actual, expected):
    assert type(actual["num_experts"]) is int and actual["num_experts"] == expected["num_experts"]
    for name in ("l_aux", "indices", "gates", "exp_counts", "rng_state", "weight_grad", "input_grad"):
        a, e = actual[name], expected[name]
        assert (a.dtype, a.shape) == (e.dtype, e.shape), (
            f"{name}: {a.dtype} {tuple(a.shape)} vs {e.dtype} {tuple(e.shape)}"
        )
        # NaN only where stock has NaN (the aux loss of an empty batch is a mean over nothing).
        same = torch.equal(a, e) or (
            a.is_floating_point() and torch.equal(a.isnan(), e.isnan()) and torch.equal(a[~a.isnan()], e[~e.isnan()])
        )
        assert same, f"{name} differs from stock"


@pytest.fixture
def forward_calls(monkeypatch):
    """How often TopKGate.forward ran: stock calls count, the fast path must not."""
    calls = []
    stock_forward = TopKGate.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return stock_forward(self, *args, **kwargs)

    monkeypatch.setattr(TopKGate, "forward", counted)
    return calls


# (gate arguments, token count, extra): token counts are multiples of nothing in particular.
CASES = [
    # top-1, drop_tokens=True
    (dict(k=1), 101, {}),
    (dict(k=1, use_rts=False), 101, {}),
    (dict(k=1, use_rts=False), 333, dict(skew=3.0)),
    (dict(k=1, noisy_gate_policy="Jitter"), 77, {}),
    (dict(k=1, noisy_gate_policy="RSample"), 77, {}),
    (dict(k=1, noisy_gate_policy="RSample"), 77, dict(train=False)),
    (dict(k=1, noisy_gate_policy="Jitter", use_rts=False), 53, dict(train=False)),
    (dict(k=1, capacity_factor=0.5, min_capacity=0), 250, dict(skew=3.0)),
    (dict(k=1, min_capacity=20), 61, {}),
    (dict(k=1, eval_capacity_factor=1.7), 250, dict(train=False, dtype=torch.bfloat16)),
    (dict(k=1), 90, dict(used_token="binary")),
    (dict(k=1, use_rts=False), 90, dict(used_token="weighted")),
    # top-2
    (dict(k=2), 101, {}),
    (dict(k=2, top2_2nd_expert_sampling=False), 101, {}),
    (dict(k=2, drop_tokens=False), 101, {}),
    (dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False), 37, {}),
    (dict(k=2, capacity_factor=0.5, min_capacity=0), 333, dict(skew=3.0)),
    (dict(k=2, top2_2nd_expert_sampling=False, min_capacity=0), 250, dict(skew=3.0)),
    (dict(k=2, drop_tokens=False), 250, dict(skew=3.0)),
    (dict(k=2, min_capacity=40), 61, {}),
    (dict(k=2, noisy_gate_policy="Jitter", eval_capacity_factor=0.6), 199, dict(train=False)),
    (dict(k=2, noisy_gate_policy="Jitter"), 199, dict(dtype=torch.bfloat16)),
    (dict(k=2, num_experts=3), 29, {}),
    (dict(k=2, capacity_factor=0.5, min_capacity=0), 150, dict(ties=True)),
    (dict(k=2, top2_2nd_expert_sampling=False, capacity_factor=0.5, min_capacity=0), 150, dict(ties=True)),
    # top-k, k > 2
    (dict(k=3), 101, {}),
    (dict(k=3, drop_tokens=False), 101, {}),
    (dict(k=3, capacity_factor=0.4, min_capacity=0), 250, dict(skew=3.0)),
    (dict(k=4), 131, dict(train=False)),
    (dict(k=4, drop_tokens=False), 131, dict(skew=3.0)),
    (dict(k=4, eval_capacity_factor=0.5, min_capacity=0), 333, dict(skew=2.0, train=False)),
    (dict(k=4, min_capacity=90), 47, {}),
    (dict(k=4, capacity_factor=0.5, min_capacity=0), 150, dict(ties=True)),
    (dict(k=8), 67, {}),
    (dict(k=8, drop_tokens=False), 67, {}),
    (dict(k=8, num_experts=12, capacity_factor=0.3, min_capacity=0, noisy_gate_policy="Jitter"), 199, dict(skew=2.0)),
]


def case_id(case):
    gate_args, num_tokens, extra = case
    words = [f"{key}={value}" for key, value in {**gate_args, **extra}.items()]
    return "-".join(words + [f"S={num_tokens}"])


def prepare(case, seed, device="cpu"):
    gate_args, num_tokens, extra = case
    gate = make_gate(seed=seed, **gate_args)
    gate.train(extra.get("train", True))
    tokens = make_tokens(gate, num_tokens, seed, extra.get("skew", 0.0), extra.get("dtype", torch.float32))
    if extra.get("ties"):
        # Two experts with equal logits for every token (ties inside a row: argmax and topk pick the
        # lower index) and every third token a copy of another (ties across tokens for the capacity).
        with torch.no_grad():
            gate.wg.weight[-2] = gate.wg.weight[1]
        tokens[1::3] = tokens[0::3][: len(tokens[1::3])]
    used_token = None
    if extra.get("used_token"):
        generator = torch.Generator().manual_seed(seed + 1)
        used_token = (torch.rand(num_tokens, generator=generator) < 0.7).float()
        if extra["used_token"] == "weighted":
            used_token *= torch.rand(num_tokens, generator=generator)
        used_token = used_token.to(device)
    return gate.to(device), tokens.to(device), used_token


# CUDA runs other kernels (softmax, topk, einsum through cuBLAS): equality there is checked too, with
# torch ops and with the op's gate kernels (the fused layer's path).
# "cuda:1-kernels": the gate kernels on a GPU other than the current one (the bindings must launch
# on the tensors' device and its current stream, not on the current device).
DEVICES = (
    ["cpu"]
    + (["cuda", "cuda-kernels"] if torch.cuda.is_available() else [])
    + (["cuda:1-kernels"] if torch.cuda.device_count() > 1 else [])
)
# Sizes the kernels split over many threads and blocks (CUDA only: stock's CPU gate is slow there).
LARGE_CASES = [
    (dict(k=2, num_experts=64, capacity_factor=0.5, min_capacity=0), 4099, dict(skew=3.0)),
    (dict(k=2, num_experts=8), 8192, {}),
    (dict(k=4, num_experts=64, capacity_factor=0.7, min_capacity=0), 3001, dict(skew=2.0)),
    (dict(k=8, num_experts=32), 4096, {}),
    (dict(k=8, num_experts=32, drop_tokens=False), 1029, {}),
]


def routes_on(device):
    """(torch device, gate_routes as the layer calls it there)."""
    if not device.endswith("-kernels"):
        return device, gate_routes
    from ds_comet.kernels.ops import load_op, op_unavailable_reason

    reason = op_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    op = load_op()
    return device[: -len("-kernels")], lambda gate, tokens, used_token: gate_routes(gate, tokens, used_token, op=op)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    CASES
    + [
        pytest.param(case, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only"))
        for case in LARGE_CASES
    ],
    ids=case_id,
)
def test_matches_stock_bitwise(case, device, forward_calls):
    if case[1] > 1000 and device == "cpu":
        pytest.skip("a large case: CUDA only")
    device, routes_fn = routes_on(device)
    for seed in (11, 2024):
        gate, tokens, used_token = prepare(case, seed, device)
        forward_calls.clear()
        expected = run_gate(stock_routes, gate, tokens, used_token, seed, mix_seed=seed + 5)
        actual = run_gate(routes_fn, gate, tokens, used_token, seed, mix_seed=seed + 5)
        assert len(forward_calls) == 1, "took the stock path"
        assert_bitwise_equal(actual, expected)

        gate_args, num_tokens, extra = case
        dropped = int((expected["indices"] < 0).sum())
        if not gate.drop_tokens:
            assert dropped == 0
        if extra.get("skew"):
            # The skewed cases are there for overflow and for an idle expert: make sure they have them.
            assert int(expected["exp_counts"][-1]) == 0
            assert dropped > 0 or not gate.drop_tokens


AUTOCAST_CASES = [
    (dict(k=1, noisy_gate_policy="RSample"), 101, {}),
    (dict(k=2), 101, {}),
    (dict(k=2, top2_2nd_expert_sampling=False), 250, dict(skew=3.0)),
    (dict(k=2, drop_tokens=False), 101, {}),
    (dict(k=4, capacity_factor=0.5, min_capacity=0), 150, dict(ties=True)),
    (dict(k=2, noisy_gate_policy="Jitter"), 199, {}),
    (dict(k=2), 101, dict(train=False)),
    (dict(k=1, use_rts=False), 90, dict(used_token="weighted")),
]


@pytest.mark.parametrize("device", [d for d in DEVICES if not d.startswith("cuda:")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", AUTOCAST_CASES, ids=case_id)
def test_matches_stock_bitwise_under_autocast(case, dtype, device, forward_calls):
    # Autocast makes the gate's logits half precision (its softmax stays fp32): stock then adds
    # top-2's noise in place, rounded to that precision.
    device, routes_fn = routes_on(device)
    for seed in (3, 4):
        gate, tokens, used_token = prepare(case, seed, device)
        with torch.autocast(torch.device(device).type, dtype=dtype):
            forward_calls.clear()
            expected = run_gate(stock_routes, gate, tokens, used_token, seed, mix_seed=seed + 5)
            actual = run_gate(routes_fn, gate, tokens, used_token, seed, mix_seed=seed + 5)
        assert len(forward_calls) == 1, "took the stock path"
        assert_bitwise_equal(actual, expected)


class OpLog(TorchDispatchMode):
    """The aten ops a call runs, and the host reads it makes of device data.

    Tensors built from Python numbers (and everything computed only from them) are host values,
    like stock's capacity arithmetic; reading anything else would be a device-to-host sync on a GPU.
    """

    def __init__(self):
        super().__init__()
        self.ops = []
        self.device_reads = []
        self._host_values = {}  # id -> tensor; holding them keeps the ids from being reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is aten._local_scalar_dense.default and id(args[0]) not in self._host_values:
            self.device_reads.append(tuple(args[0].shape))
        if func is aten.lift_fresh.default or (inputs and all(id(t) in self._host_values for t in inputs)):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._host_values[id(t)] = t
        self.ops.append((func, args))
        return out

    def launches(self):
        """Ops that would be kernels: no views, no host-side scalar work."""
        return [
            func
            for func, args in self.ops
            if not func.is_view
            and func not in (aten.lift_fresh.default, aten._local_scalar_dense.default)
            and not self._on_host(args)
        ]

    def _on_host(self, args):
        inputs = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        return bool(inputs) and all(id(t) in self._host_values for t in inputs)


def logged(routes_fn, gate, tokens, used_token):
    log = OpLog()
    torch.manual_seed(0)
    with log:
        routes_fn(gate, tokens, used_token)
    return log


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fast_path_skips_scans_and_syncs(case):
    gate, tokens, used_token = prepare(case, seed=5)
    gate_module._capacities.clear()  # the first call computes the capacity: check it reads no device data
    stock = logged(stock_routes, gate, tokens, used_token)
    fast = logged(gate_routes, gate, tokens, used_token)
    assert fast.device_reads == []
    scans = [args for func, args in fast.ops if func is aten.cumsum.default]
    if gate.k == 2 and gate.drop_tokens:
        # One scan for both choices, along the contiguous innermost dimension of an [E, 2S] mask.
        assert len(scans) == 1
        scan = scans[0]
        assert scan[0].dim() == 2 and scan[0].shape[0] == gate.wg.weight.shape[0]
        assert scan[1] in (1, -1) and scan[0].is_contiguous()
    else:
        assert scans == []
    if not gate.drop_tokens:
        assert aten.max.default not in [func for func, _ in fast.ops], "capacity computed though not needed"
    assert len(fast.launches()) < len(stock.launches())


@pytest.mark.parametrize("k,drop_tokens", [(1, True), (2, True), (2, False), (4, True), (4, False)])
def test_fewer_ops_than_stock(k, drop_tokens):
    """Every path sheds at least five launches (S=256, E=8); top-1/top-k keep all of stock's float ops."""
    gate, tokens, _ = prepare((dict(k=k, drop_tokens=drop_tokens), 256, {}), seed=3)
    logged(gate_routes, gate, tokens, None)  # the first call makes the cached expert ids and capacity
    stock = len(logged(stock_routes, gate, tokens, None).launches())
    fast = len(logged(gate_routes, gate, tokens, None).launches())
    assert fast <= stock - 5, f"{fast} ops vs stock's {stock}"


class GateSubclass(TopKGate):
    pass


def fallback_gates():
    yield "top-1 without dropping", make_gate(k=1, drop_tokens=False)
    yield "top-1 without dropping, eval", make_gate(k=1, drop_tokens=False, use_rts=False)
    subclass = GateSubclass(MODEL_DIM, 8, 2)
    yield "a subclass", subclass
    timed = make_gate(k=2)
    timed.wall_clock_breakdown = True
    yield "wall_clock_breakdown", timed
    hooked = make_gate(k=4)
    hooked.register_forward_hook(lambda module, args, output: None)
    yield "a forward hook", hooked
    pre_hooked = make_gate(k=1)
    pre_hooked.register_forward_pre_hook(lambda module, args: None)
    yield "a forward pre-hook", pre_hooked
    patched = make_gate(k=2)
    # Looked up at call time, so the forward_calls fixture's counting class method is the one run.
    patched.forward = lambda *args, **kwargs: TopKGate.forward(patched, *args, **kwargs)
    yield "an instance forward", patched
    empty_top1 = make_gate(k=1, min_capacity=0)
    yield "top-1 with no tokens", empty_top1


@pytest.mark.parametrize("name,gate", list(fallback_gates()), ids=lambda value: value if isinstance(value, str) else "")
def test_fallbacks_call_the_stock_gate(name, gate, forward_calls):
    tokens = make_tokens(gate, 0 if "no tokens" in name else 57, seed=9)
    expected = run_gate(stock_routes, gate, tokens, None, seed=4, mix_seed=8)
    actual = run_gate(gate_routes, gate, tokens, None, seed=4, mix_seed=8)
    assert len(forward_calls) == 2
    assert_bitwise_equal(actual, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,drop_tokens", [(2, True), (2, False), (4, True), (4, False)])
def test_no_tokens_take_the_fast_path(k, drop_tokens, device, forward_calls):
    """A rank with an empty batch must not fall back: stock's no-drop path all-reduces the capacity
    over the expert group, which the fast path never does on the ranks that have tokens."""
    device, routes_fn = routes_on(device)
    gate = make_gate(k=k, drop_tokens=drop_tokens).to(device)
    tokens = make_tokens(gate, 0, seed=3).to(device)
    expected = run_gate(stock_routes, gate, tokens, None, seed=5, mix_seed=6)
    actual = run_gate(routes_fn, gate, tokens, None, seed=5, mix_seed=6)
    assert len(forward_calls) == 1  # stock's own call only
    assert_bitwise_equal(actual, expected)


@pytest.mark.parametrize("k", [2, 4])
def test_hooked_gate_without_dropping_keeps_the_fast_path(k, forward_calls, monkeypatch):
    # Stock's forward without dropping all-reduces a capacity the fast path skips. Hooks need not be
    # alike on every rank (DeepSpeed's flops profiler hooks rank 0 at one step), so a hooked gate
    # must not fall back there: its peers would not join that all-reduce. Its hooks are skipped.
    # Hooks the gate has from its first call (registered before training, alike on every rank)
    # still run, through stock's forward.
    warned = []
    monkeypatch.setattr(gate_module.logger, "warning", lambda message, *args: warned.append(message % args))
    gate = make_gate(k=k, drop_tokens=False)
    tokens = make_tokens(gate, 57, seed=2)
    expected = run_gate(stock_routes, gate, tokens, None, seed=4, mix_seed=8)
    assert_bitwise_equal(run_gate(gate_routes, gate, tokens, None, seed=4, mix_seed=8), expected)
    gate.register_forward_hook(lambda module, args, output: None)
    for _ in range(2):
        assert_bitwise_equal(run_gate(gate_routes, gate, tokens, None, seed=4, mix_seed=8), expected)
    assert len(forward_calls) == 1  # stock's own call only
    assert len(warned) == 1 and f"top-{k} gate without dropping" in warned[0] and "skipped" in warned[0], warned
    hooked_from_the_start = make_gate(k=k, drop_tokens=False)
    hooked_from_the_start.register_forward_hook(lambda module, args, output: None)
    run_gate(
        gate_routes, hooked_from_the_start, make_tokens(hooked_from_the_start, 40, seed=3), None, seed=4, mix_seed=8
    )
    assert len(forward_calls) == 2 and len(warned) == 1  # through stock's forward, which runs the hooks


def test_global_hook_falls_back(forward_calls):
    gate = make_gate(k=2)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        gate_routes(gate, make_tokens(gate, 40, seed=1))
    finally:
        handle.remove()
    assert len(forward_calls) == 1
    gate_routes(gate, make_tokens(gate, 40, seed=1))
    assert len(forward_calls) == 1


def test_top1_min_capacity_assert_like_stock():
    gate = make_gate(k=1, min_capacity=64)
    tokens = make_tokens(gate, 40, seed=2)
    with pytest.raises(AssertionError):
        gate(tokens, None, True)
    with pytest.raises(AssertionError):
        gate_routes(gate, tokens)


def test_gumbel_noise_is_the_chain_the_top2_kernel_repeats():
    """The top-2 gate kernel (csrc/gate_kernels.cu, gumbel_of) computes stock's Gumbel noise from
    torch.rand with exactly these ops; should torch's Gumbel ever compute it another way, this fails
    on any machine, before the GPU tests' bitwise comparisons would."""
    shape = (257, 9)
    torch.manual_seed(3)
    expected = sharded_moe.gumbel_rsample(shape, device=torch.device("cpu"))
    torch.manual_seed(3)
    uniform = torch.rand(shape, dtype=torch.float32)
    finfo = torch.finfo(torch.float32)
    low, high = torch.tensor(finfo.tiny), torch.tensor(1 - finfo.eps)
    inner = 0 + -1.0 * (low + uniform * (high - low)).log()
    noise = 0 + -1.0 * inner.log()
    assert torch.equal(noise, expected)


def test_top2_kernels_sample_only_like_stocks_fp32_gumbel(monkeypatch):
    """The top-2 kernel draws fp32 uniforms; stock's sampler takes the default dtype when first made."""
    device = torch.device("cpu")
    monkeypatch.setattr(sharded_moe, "gumbel_map", {})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert not gate_module._stock_gumbel_is_fp32(device)
    finally:
        torch.set_default_dtype(default)
    assert not gate_module._stock_gumbel_is_fp32(device), "the fp64 sampler stock would keep is kept"
    monkeypatch.setattr(sharded_moe, "gumbel_map", {})
    assert gate_module._stock_gumbel_is_fp32(device)
    assert sharded_moe.gumbel_map[device](torch.Size([3])).dtype == torch.float32
    monkeypatch.setattr(sharded_moe, "gumbel_rsample", lambda shape, device: torch.zeros(shape))
    assert not gate_module._stock_gumbel_is_fp32(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_top2_kernel_gumbel_noise_is_torchs_for_every_uniform_draw():
    """Every value CUDA's torch.rand can return (the multiples of 2^-24 in [0, 1)): the kernel's noise
    equals torch's own ops on the GPU (the chain test_gumbel_noise_is_the_chain_the_top2_kernel_repeats
    ties to stock's sampler), bit for bit."""
    routes_on("cuda-kernels")  # skips where the op cannot be built
    from ds_comet.kernels.ops import load_op

    uniform = torch.arange(2**24, device="cuda", dtype=torch.float64).mul_(2.0**-24).float()
    finfo = torch.finfo(torch.float32)
    low, high = torch.tensor(finfo.tiny, device="cuda"), torch.tensor(1 - finfo.eps, device="cuda")
    expected = 0 + -1.0 * (0 + -1.0 * (low + uniform * (high - low)).log()).log()
    noise = torch.empty_like(uniform)
    load_op().gumbel_noise(uniform, noise)
    mismatched = (noise != expected).nonzero()[:5].flatten().tolist()
    assert not mismatched, f"noise differs at uniform = {[uniform[i].item() for i in mismatched]}"


# The CUDA-graphed gate ("moe": {"cuda_graph_gate": true}): the first call captures, later calls
# replay; each call must still equal stock's bit for bit, RNG state and gradients included.
GRAPH_CASES = [
    (dict(k=1), 101, {}),
    (dict(k=1, noisy_gate_policy="RSample"), 77, {}),
    (dict(k=1, use_rts=False), 333, dict(skew=3.0)),
    (dict(k=2), 101, {}),
    (dict(k=2, drop_tokens=False), 250, dict(skew=3.0)),
    (dict(k=2, noisy_gate_policy="Jitter"), 199, dict(dtype=torch.bfloat16)),
    (dict(k=2, num_experts=8), 8192, {}),
    (dict(k=4, capacity_factor=0.5, min_capacity=0), 150, dict(ties=True)),
    (dict(k=4, num_experts=64, capacity_factor=0.7, min_capacity=0), 3001, dict(skew=2.0)),
    (dict(k=8, drop_tokens=False), 67, {}),
    (dict(k=2), 101, dict(train=False)),
    # bf16 tokens, as the layer's: the graph takes them as fp32 and casts their gradient back.
    (dict(k=1, noisy_gate_policy="RSample"), 77, dict(dtype=torch.bfloat16)),
    (dict(k=4, num_experts=64, capacity_factor=0.7, min_capacity=0), 3001, dict(skew=2.0, dtype=torch.bfloat16)),
]


def graphed_routes():
    from ds_comet.integrations.legacy.gate_graph import GateGraphs

    _, kernels = routes_on("cuda-kernels")  # skips where the op cannot be built
    from ds_comet.kernels.ops import load_op

    graphs, op = GateGraphs(), load_op()
    return graphs, lambda gate, tokens, used_token: graphs.routes(gate, tokens, used_token, op)


def fresh_tokens(like, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=generator).to(like.dtype).to(like.device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("case", GRAPH_CASES, ids=case_id)
def test_cuda_graph_gate_matches_stock_bitwise(case):
    graphs, graphed = graphed_routes()
    gate, tokens, _ = prepare(case, 11, "cuda")
    for call, seed in enumerate((11, 12, 13)):
        if call:
            tokens = fresh_tokens(tokens, seed)
        expected = run_gate(stock_routes, gate, tokens, None, seed, mix_seed=seed + 5)
        actual = run_gate(graphed, gate, tokens, None, seed, mix_seed=seed + 5)
        assert_bitwise_equal(actual, expected)
        with torch.no_grad():  # a second signature: no gradients, no backward graph
            torch.manual_seed(seed)
            want = stock_routes(gate, tokens) + (torch.cuda.get_rng_state(),)
            torch.manual_seed(seed)
            got = graphed(gate, tokens, None) + (torch.cuda.get_rng_state(),)
        for a, e in zip(got, want):
            assert a == e if isinstance(e, int) else torch.equal(a, e)
    assert len(graphs._captured) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cuda_graph_gate_runs_eagerly_while_a_backward_is_due_and_recaptures_moved_weights():
    graphs, graphed = graphed_routes()
    case = (dict(k=2), 257, {})
    gate, tokens, _ = prepare(case, 3, "cuda")

    def two_forwards_then_backwards(routes_fn):
        torch.manual_seed(5)
        inputs = [fresh_tokens(tokens, s).requires_grad_() for s in (1, 2)]
        outs = [routes_fn(gate, x, None) for x in inputs]  # the second forward's replay would clobber the first's
        weights = [torch.randn(o[3].shape, generator=torch.Generator().manual_seed(9)).cuda() for o in outs]
        grads = []
        for (l_aux, _, _, gates, _), w, x in zip(outs[::-1], weights[::-1], inputs[::-1]):
            grads += torch.autograd.grad(l_aux + (gates * w).sum(), [gate.wg.weight, x])
        return [t for o in outs for t in (o[0], o[2], o[3])] + grads

    # DeepSpeed's ZeRO keeps each parameter's accumulation node alive, made on the default stream:
    # the capture (on a side stream) must not differentiate through it.
    accumulator = gate.wg.weight.expand_as(gate.wg.weight).grad_fn.next_functions[0][0]
    graphed(gate, tokens.clone().requires_grad_(), None)  # capture
    storages = []
    for _ in range(2):
        storages.append(gate.wg.weight.data_ptr())
        expected = two_forwards_then_backwards(stock_routes)
        actual = two_forwards_then_backwards(graphed)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected))
        with torch.no_grad():  # ZeRO may move a parameter: the next call captures anew
            gate.wg.weight.data = gate.wg.weight.data.clone()
    # The second round recaptured for the moved weight and dropped the first round's graph.
    assert [key[0][0] for key in graphs._captured] == [(storages[1],)] and storages[0] != storages[1]
    assert accumulator is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cuda_graph_gate_refuses_a_backward_whose_activations_a_later_replay_reused():
    graphs, graphed = graphed_routes()
    gate, tokens, _ = prepare((dict(k=2), 101, {}), 4, "cuda")
    x = tokens.clone().requires_grad_()
    l_aux, _, _, gates, _ = graphed(gate, x, None)
    loss = l_aux + gates.sum()
    loss.backward(retain_graph=True)
    graphed(gate, x, None)  # replays: the first call's backward is done, so this may reuse its memory
    with pytest.raises(RuntimeError, match="cuda_graph_gate"):
        loss.backward()


@pytest.mark.parametrize("case", [(dict(k=2), 101, {}), (dict(k=1), 90, dict(used_token="binary"))], ids=case_id)
def test_graphed_gate_runs_eagerly_where_it_cannot_capture(case):
    # CPU tokens (and, on any device, a used_token mask) take the eager routing, untouched.
    from ds_comet.integrations.legacy.gate_graph import GateGraphs

    graphs = GateGraphs()
    for seed in (1, 2):
        gate, tokens, used_token = prepare(case, seed)
        expected = run_gate(stock_routes, gate, tokens, used_token, seed, mix_seed=seed + 5)
        actual = run_gate(
            lambda g, t, u: graphs.routes(g, t, u, None), gate, tokens, used_token, seed, mix_seed=seed + 5
        )
        assert_bitwise_equal(actual, expected)
    assert not graphs._captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cuda_graph_gate_refuses_a_second_backward_of_one_forward():
    graphs, graphed = graphed_routes()
    gate, tokens, _ = prepare((dict(k=2), 101, {}), 6, "cuda")
    l_aux, _, _, gates, _ = graphed(gate, tokens.clone().requires_grad_(), None)
    loss = l_aux + gates.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cuda_graph_gate"):
        loss.backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch >= 2.9's TF32 API")
def test_cuda_graph_gate_recaptures_when_tf32_is_switched():
    # The gate's fp32 linear is a cuBLAS kernel chosen by the TF32 setting at capture time.
    graphs, graphed = graphed_routes()
    gate, tokens, _ = prepare((dict(k=2), 101, {}), 12, "cuda")
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        for seed, precision in enumerate(["ieee", "tf32", "ieee"]):
            torch.backends.cuda.matmul.fp32_precision = precision
            x = fresh_tokens(tokens, seed)
            expected = run_gate(stock_routes, gate, x, None, seed, mix_seed=seed + 5)
            actual = run_gate(graphed, gate, x, None, seed, mix_seed=seed + 5)
            assert_bitwise_equal(actual, expected)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert len(graphs._captured) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("order", ["capture-order", "reversed", "eval-between"])
def test_cuda_graph_gate_of_several_layers_matches_stock_in_any_order(order):
    """Several layers' graphs, called in capture order, in another order, and with another layer's
    replay without gradients before a backward: no replay may overwrite another layer's activations
    or outputs."""
    from ds_comet.integrations.legacy.gate_graph import GateGraphs
    from ds_comet.kernels.ops import load_op

    graphed_routes()  # skips where the op cannot be built
    op = load_op()
    cases = [(dict(k=2), 301, {}), (dict(k=4, num_experts=16), 301, dict(skew=2.0)), (dict(k=1), 301, {})]
    layers = [prepare(case, 20 + i, "cuda")[:2] for i, case in enumerate(cases)]
    per_layer = [GateGraphs() for _ in layers]

    def graphed_of(i):
        return lambda gate, tokens, used_token: per_layer[i].routes(gate, tokens, used_token, op)

    def step(routes_of, seed):
        sequence = list(range(len(layers)))
        if order == "reversed" and seed % 2:
            sequence.reverse()
        torch.manual_seed(seed)
        loss, inputs, outputs = 0, [], []
        for i in sequence:
            gate, tokens = layers[i]
            x = fresh_tokens(tokens, seed * 10 + i).requires_grad_()
            l_aux, _, indices, gates, counts = routes_of(i)(gate, x, None)
            if order == "eval-between":  # another layer's replay without gradients before this backward
                other, other_tokens = layers[(i + 1) % len(layers)]
                other.eval()
                with torch.no_grad():
                    outputs += [
                        t
                        for t in routes_of((i + 1) % len(layers))(other, other_tokens, None)
                        if isinstance(t, torch.Tensor)
                    ]
                other.train()
            loss = loss + l_aux + (gates * fresh_tokens(gates, seed + i)).sum()
            inputs.append(x)
            outputs += [l_aux, indices, gates, counts]
        for gate, _ in layers:
            gate.wg.weight.grad = None
        loss.backward()
        return outputs + [x.grad for x in inputs] + [gate.wg.weight.grad for gate, _ in layers]

    for seed in range(1, 5):  # the first graphed step captures, the later ones replay
        expected = step(lambda i: stock_routes, seed)
        actual = step(graphed_of, seed)
        assert len(actual) == len(expected)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected)), f"step {seed}"
    assert all(graphs._captured for graphs in per_layer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("context", ["autocast", "checkpoint", "many-token-counts"])
def test_cuda_graph_gate_runs_eagerly_where_a_graph_could_differ(context):
    """Autocast caches a cast of the weight, non-reentrant checkpointing compares saved tensors, and
    a layer captures at most MAX_SIGNATURES signatures: there the gate runs eagerly, as stock's."""
    from ds_comet.integrations.legacy.gate_graph import MAX_SIGNATURES

    graphs, graphed = graphed_routes()
    gate, tokens, _ = prepare((dict(k=2), 101, {}), 8, "cuda")
    counts = range(90, 91 + MAX_SIGNATURES) if context == "many-token-counts" else [101, 101]
    for seed, num_tokens in enumerate(counts):
        x = fresh_tokens(torch.empty(num_tokens, MODEL_DIM, device="cuda"), seed)
        if context == "autocast":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                expected = run_gate(stock_routes, gate, x, None, seed, mix_seed=seed + 5)
                actual = run_gate(graphed, gate, x, None, seed, mix_seed=seed + 5)
        elif context == "checkpoint":

            def through_checkpoint(routes_fn):
                def wrapped(g, t, u):
                    def body(inputs):
                        l_aux, _, _, gates_, _ = routes_fn(g, inputs, u)
                        return l_aux, gates_

                    l_aux, gates_ = torch.utils.checkpoint.checkpoint(body, t, use_reentrant=False)
                    _, num, indices, _, counts_ = stock_routes(g, t.detach())  # the non-differentiable outputs
                    return l_aux, num, indices, gates_, counts_

                return wrapped

            expected = run_gate(through_checkpoint(stock_routes), gate, x, None, seed, mix_seed=seed + 5)
            actual = run_gate(through_checkpoint(graphed), gate, x, None, seed, mix_seed=seed + 5)
        else:
            expected = run_gate(stock_routes, gate, x, None, seed, mix_seed=seed + 5)
            actual = run_gate(graphed, gate, x, None, seed, mix_seed=seed + 5)
        if context == "checkpoint":
            for name in ("l_aux", "gates", "weight_grad", "input_grad"):
                assert torch.equal(actual[name], expected[name]), name
        else:
            assert_bitwise_equal(actual, expected)
    assert len(graphs._captured) == (MAX_SIGNATURES if context == "many-token-counts" else 0)


@pytest.mark.parametrize(
    "capacity_factor,min_capacity,dropped",
    [(1e9, 0, 0), (1.0, 2**31, 0), (1.0, 2**32 + 1, 0), (-1e10, -(2**32) + 5, 202)],
)
def test_top2_capacity_past_int32_like_stock(capacity_factor, min_capacity, dropped):
    # "Never drop" spelled as a huge capacity (or "drop all" as a hugely negative one): the queue
    # positions it is compared with are int32.
    gate = make_gate(
        2, capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor, min_capacity=min_capacity
    )
    tokens = make_tokens(gate, 101, seed=1, skew=3.0)
    expected = run_gate(stock_routes, gate, tokens, None, 5, 6)
    actual = run_gate(gate_routes, gate, tokens, None, 5, 6)
    assert (expected["indices"] < 0).sum().item() == dropped
    assert_bitwise_equal(actual, expected)


@pytest.mark.parametrize("name", ["top1gating", "top2gating", "topkgating"])
def test_a_replaced_stock_gating_function_falls_back(name, monkeypatch, forward_calls):
    # Stock's forward calls DeepSpeed's module-level gating functions: a replaced one is stock's answer.
    replaced = getattr(sharded_moe, name)
    monkeypatch.setattr(sharded_moe, name, lambda *args, **kwargs: replaced(*args, **kwargs))
    gate = make_gate({"top1gating": 1, "top2gating": 2, "topkgating": 4}[name])
    gate_routes(gate, make_tokens(gate, 33, seed=2))
    assert forward_calls == [gate]


def test_capacity_is_remembered_per_type_of_factor(monkeypatch):
    # Stock's capacity of ceil(S / E * factor) rounds in fp64 for a numpy float factor and in fp32
    # for a Python float: 25 * 1.2 gives 31 in fp32, 30 in fp64. Neither may be served the other's.
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(gate_module, "_capacities", {})
    tokens = torch.randn(50, MODEL_DIM)
    for factor in (1.2, np.float64(1.2), 1.2):
        gate = make_gate(
            1, num_experts=2, capacity_factor=factor, eval_capacity_factor=factor, min_capacity=0, use_rts=False
        )
        with torch.no_grad():
            gate.wg.weight.zero_()  # every token ties, so expert 0 gets all 50 and the capacity binds
        assert_bitwise_equal(
            run_gate(gate_routes, gate, tokens, None, 3, 4), run_gate(stock_routes, gate, tokens, None, 3, 4)
        )


def test_graphs_captured_for_moved_parameters_are_dropped():
    # After model.half() (or a move, or a reload into new tensors) a graph captured for the gate's
    # old parameter storage can never replay: it must not hold its memory pool and one of the
    # layer's MAX_SIGNATURES slots, which would send the current storage to the eager gate for good.
    from ds_comet.integrations.legacy.gate_graph import GateGraphs, _signature

    gate = TopKGate(16, 4, k=2)
    graphs, tokens = GateGraphs(), torch.randn(8, 16)
    old = _signature(gate, tokens, None, list(gate.parameters()), True)
    graphs._captured[old] = "captured for the fp32 weights"
    gate.half()
    current = _signature(gate, tokens.half(), None, list(gate.parameters()), True)
    graphs._captured[current] = "captured for the fp16 weights"
    graphs._forget_moved(list(gate.parameters()))
    assert list(graphs._captured) == [current]
