"""What the benchmarks share: timing, peak memory, the layers they compare and one training step."""

import json
import statistics
import time

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

import ds_comet
from ds_comet.experts import ACTIVATIONS, FeedForward, GatedFeedForward, reset_expert_


def timed(fn, iters, warmup):
    """Median milliseconds of fn() over iters calls from an idle device, every rank (if distributed)
    starting each call together: the device's events, or on CPU (whose accelerator has none) the
    host's clock."""
    accelerator = get_accelerator()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        accelerator.synchronize()
        if dist.is_initialized():
            dist.barrier()
        if accelerator.device_name() == "cpu":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, stop = accelerator.Event(enable_timing=True), accelerator.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        accelerator.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def peak_mib(fn):
    """MiB that one call of fn() allocates at its peak above what was allocated before it."""
    accelerator = get_accelerator()
    accelerator.synchronize()
    before = accelerator.memory_allocated()
    accelerator.reset_peak_memory_stats()
    fn()
    accelerator.synchronize()
    return (accelerator.max_memory_allocated() - before) / 2**20


def moe_kwargs(experts, ep_size, k, capacity_factor) -> dict:
    """The MoE layers' arguments besides the hidden size and the expert: every layer a benchmark
    compares takes the same."""
    return dict(
        num_experts=experts,
        ep_size=ep_size,
        k=k,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=4,
    )


def expert_template(hidden, ffn, gated):
    return GatedFeedForward(hidden, ffn) if gated else FeedForward(hidden, ffn)


def comet_layer(hidden, template, kwargs, section, stock):
    """A comet layer of the ``"moe"`` ``section`` with ``stock``'s weights, in bf16 on the accelerator,
    in eval mode. Raises ValueError where the section refuses the layer (an ``"fp8"`` recipe that
    cannot scale its sizes, under ``"fallback": "error"``)."""
    layer = ds_comet.MoE(hidden, template, config={"moe": section}, **kwargs)
    layer.set_deepspeed_parallelism()
    layer.load_state_dict(stock.state_dict())
    device = torch.device(get_accelerator().device_name(), get_accelerator().current_device())
    return layer.to(device=device, dtype=torch.bfloat16).eval()


def build(hidden, ffn, experts, k, ep_size, gated, capacity_factor, overrides):
    """{"stock", "reference", "fused"}: stock DeepSpeed's layer and the comet layers on each pipeline
    (``overrides``: their further "moe" keys), the same weights, in bf16 on the accelerator."""
    torch.manual_seed(0)
    template = expert_template(hidden, ffn, gated)
    kwargs = moe_kwargs(experts, ep_size, k, capacity_factor)
    stock = deepspeed.moe.layer.MoE(hidden, template, **kwargs)
    stock.set_deepspeed_parallelism()
    rank = dist.get_rank(group=stock.deepspeed_moe.ep_group)
    for i, expert in enumerate(stock.deepspeed_moe.experts.deepspeed_experts):
        reset_expert_(expert, 1000 + rank * len(stock.deepspeed_moe.experts.deepspeed_experts) + i)
    layers = {"stock": stock}
    for name, overlap in (("reference", "none"), ("fused", "fused")):
        section = {"backend": "comet", "overlap": overlap, **overrides}
        layers[name] = comet_layer(hidden, template, kwargs, section, stock)
    device = torch.device(get_accelerator().device_name(), get_accelerator().current_device())
    stock.to(device=device, dtype=torch.bfloat16).eval()
    return layers


def expert_ffn(expert, rows):
    """The expert's FFN in plain torch ops (its module's arithmetic, without nn.Module's call)."""
    act = ACTIVATIONS[expert.activation]
    if isinstance(expert, GatedFeedForward):
        return F.linear(
            act(F.linear(rows, expert.gate_proj.weight)) * F.linear(rows, expert.up_proj.weight),
            expert.down_proj.weight,
        )
    return F.linear(act(F.linear(rows, expert.fc1.weight, expert.fc1.bias)), expert.fc2.weight, expert.fc2.bias)


def grouped_ffn(modules, inputs, train=False):
    """The experts as grouped GEMMs (``torch._grouped_mm``, AutoEP's own expert computation) on stacked
    weights, without biases, or None where torch has no grouped GEMM for them.

    With train the callable runs forward and backward (rows and weights are leaves that need grads).
    """
    if not hasattr(torch, "_grouped_mm"):
        return None
    gated = isinstance(modules[0], GatedFeedForward)
    rows = torch.cat(inputs).detach().requires_grad_(train)
    offsets = torch.cumsum(torch.tensor([len(r) for r in inputs], device=rows.device), 0).to(torch.int32)

    def stacked(name):
        return torch.stack([getattr(m, name).weight.t() for m in modules]).detach().contiguous().requires_grad_(train)

    weights = [stacked(n) for n in (("gate_proj", "up_proj", "down_proj") if gated else ("fc1", "fc2"))]
    act = ACTIVATIONS[modules[0].activation]
    dy = torch.randn(rows.shape[0], weights[-1].shape[-1], device=rows.device).to(rows.dtype)

    def forward():
        h = act(torch._grouped_mm(rows, weights[0], offs=offsets))
        if gated:
            h = h * torch._grouped_mm(rows, weights[1], offs=offsets)
        return torch._grouped_mm(h, weights[-1], offs=offsets)

    def step():
        rows.grad = None
        for weight in weights:
            weight.grad = None
        torch.autograd.backward([forward()], [dy])

    call = step if train else forward
    try:
        call()
    except RuntimeError:
        return None
    return call


def train_step(layer, x, dy):
    """One training step of an MoE layer: grads set to None, forward, backward of out and the aux loss."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out, l_aux, _ = layer(x)
    torch.autograd.backward([out, l_aux], [dy, torch.ones_like(l_aux)])


def autoep_step(layer, x, dy):
    """One training step of an AutoEP block: grads set to None, forward, backward of its output."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x)
    torch.autograd.backward([out[0] if isinstance(out, tuple) else out], [dy])


def run_shapes(shapes, bench_shape, report, out_dir):
    """Every rank benchmarks each of ``shapes`` ({name: shape}) with ``bench_shape(name, shape)``;
    rank 0 prints each shape's results as they come (floats to 4 places) and ``report(results,
    out_dir)`` at the end; then the process group ends."""
    all_results = {}
    for name, shape in shapes.items():
        all_results[name] = bench_shape(name, shape)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the shape's layers are gone; give the next shape room
        if dist.get_rank() == 0:
            rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in all_results[name].items()}
            print(name, json.dumps(rounded), flush=True)
    if dist.get_rank() == 0:
        report(all_results, out_dir)
    dist.barrier()
    dist.destroy_process_group()
