"""The gate's routing replayed from CUDA graphs (``"moe": {"cuda_graph_gate": true}``).

Each of the gate's twenty-odd kernels finishes in microseconds, so from an idle device the
routing takes as long as the host needs to launch them. On the H200 host, ``gate_routes`` took
0.66-0.81 ms eager and 0.28-0.32 ms replayed as one graph. A training step's gate, forward and
backward, took 1.8-2.4 ms eager and 0.76-1.02 ms replayed (docs/decisions.md).

``GateGraphs`` captures ``gate_routes`` once per call signature, with its backward when gradients
flow, and replays it. The results are bit for bit the eager call's, random draws included: a
replay advances torch's CUDA generator as the eager ops would, and the capture leaves the
generator as it found it.

A graph reads and writes fixed memory, which its next replay reuses:
- the tokens are copied in, and the outputs copied out;
- a forward runs eagerly while an earlier forward of the same signature still awaits its backward,
  because the replay would overwrite the activations that backward reads;
- a backward whose activations a later replay overwrote, or a second backward of one forward
  (``retain_graph``), raises an error rather than return wrong gradients.

It runs eagerly where a graph could not be the eager call: under autocast (which caches a cast of
the weight that the graph would keep reading), under saved-tensor hooks (non-reentrant activation
checkpointing compares the saved tensors of the recomputation with the first forward's; CPU
offloading of activations would be bypassed), while another capture is under way, while
``torch.compile`` traces (a trace must not capture), and for signatures past the first
``MAX_SIGNATURES`` of a layer.

Each captured signature holds its activations and the backward's temporaries permanently: at
the bench's three shapes 129-192 MiB allocated and 218-326 MiB reserved per layer, mostly the fp32
features and their gradient and the bf16 gradient of the tokens (about 6 bytes x tokens x hidden).
Signatures captured for the parameters' old storage are dropped at the next capture.
"""

import contextlib
import weakref

import torch
from deepspeed.moe import sharded_moe
from torch import Tensor
from torch.autograd.function import once_differentiable

from ...pipelines.policy import saved_tensor_hooks_active
from .gate import _reproducible, gate_routes

WARMUP_CALLS = 2  # eager calls on a side stream before a capture (lazy cuBLAS and allocator set-up)
MAX_SIGNATURES = 4  # captured signatures per layer; further ones (say, other token counts) run eagerly


def _fp32_matmul_precision():
    """The TF32 setting, which picks the cuBLAS kernel of the gate's fp32 linear. From torch 2.9 it
    is read through fp32_precision: the legacy allow_tf32 raises once a program used the new API."""
    try:
        return torch.backends.cuda.matmul.fp32_precision
    except AttributeError:
        return torch.backends.cuda.matmul.allow_tf32


def _parameter_storage(params) -> tuple:
    """Where and in which dtype the gate's parameters live: a graph captured for other storage can never
    replay again (after ``model.half()``, a move, a reload into new tensors)."""
    return tuple(p.data_ptr() for p in params), tuple(p.dtype for p in params)


def _signature(gate, tokens: Tensor, op, params, needs_grad: bool) -> tuple:
    """What a captured graph is only valid for; its first entry is ``_parameter_storage``."""
    return (
        _parameter_storage(params),
        gate.training,
        needs_grad,
        torch.is_inference_mode_enabled(),
        tokens.requires_grad,
        tuple(p.requires_grad for p in params),
        tuple(tokens.shape),
        tokens.dtype,
        tokens.device,
        op is None,
        torch.are_deterministic_algorithms_enabled(),
        _fp32_matmul_precision(),
        id(sharded_moe.gumbel_rsample),
        gate.k,
        gate.capacity_factor,
        gate.eval_capacity_factor,
        gate.min_capacity,
        gate.noisy_gate_policy,
        gate.drop_tokens,
        gate.use_rts,
        getattr(gate, "top2_2nd_expert_sampling", None),
    )


class _Captured:
    """One signature's forward graph (and backward graph) with the fixed tensors they use."""

    def __init__(self, gate, tokens: Tensor, op, params, needs_grad: bool):
        device = tokens.device
        self.pool = torch.cuda.graph_pool_handle()
        self.tokens = tokens.detach().clone().requires_grad_(tokens.requires_grad and needs_grad)
        self.pending: weakref.ref | None = None  # the context of the forward whose backward is due
        self.generation = 0
        self.grad_tokens_index = 0 if self.tokens.requires_grad else None
        self.param_grad_index = {}
        for i, p in enumerate(params):
            if needs_grad and p.requires_grad:
                self.param_grad_index[i] = len(self.param_grad_index) + (1 if self.tokens.requires_grad else 0)

        def differentiate(inputs, l_aux, gates, grad_l_aux, grad_gates):
            outputs = [(o, g) for o, g in ((l_aux, grad_l_aux), (gates, grad_gates)) if o.requires_grad]
            return torch.autograd.grad([o for o, _ in outputs], inputs, [g for _, g in outputs], allow_unused=True)

        rng = torch.cuda.get_rng_state(device)
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(main)
        try:
            with _own_leaves(gate, params) as aliases, torch.cuda.stream(side), torch.set_grad_enabled(needs_grad):
                inputs = ([self.tokens] if self.tokens.requires_grad else []) + [a for a in aliases if a.requires_grad]
                for _ in range(WARMUP_CALLS):
                    l_aux, _, _, gates, _ = gate_routes(gate, self.tokens, None, op)
                    if needs_grad:
                        differentiate(inputs, l_aux, gates, torch.ones_like(l_aux), torch.ones_like(gates))
                self.forward = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.forward, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                    l_aux, self.num_experts, indices, gates, counts = gate_routes(gate, self.tokens, None, op)
                self.backward = None
                if needs_grad:
                    self.grad_l_aux, self.grad_gates = torch.zeros_like(l_aux), torch.zeros_like(gates)
                    self.backward = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(
                        self.backward, pool=self.pool, stream=side, capture_error_mode="thread_local"
                    ):
                        self.grads = differentiate(inputs, l_aux, gates, self.grad_l_aux, self.grad_gates)
                # The graphs keep their memory; the eager autograd graph of the capture is not needed.
                self.l_aux, self.indices, self.gates, self.counts = (
                    t.detach() for t in (l_aux, indices, gates, counts)
                )
        finally:
            main.wait_stream(side)
            # The warm-up calls drew from the generator and the capture advanced it; from the state
            # restored here, a replay draws what the eager call would have drawn.
            torch.cuda.set_rng_state(rng, device)

    def awaiting_backward(self) -> bool:
        return self.pending is not None and self.pending() is not None


@contextlib.contextmanager
def _own_leaves(gate, params):
    """The gate's parameters swapped for new leaves on the same memory while it is captured.

    Autograd keeps one accumulation node per parameter, made on the stream of its first backward;
    DeepSpeed's ZeRO keeps those nodes alive (it hooks them). A backward captured on the capture's
    side stream would make the engine sync with that other stream, which invalidates the capture
    (and leaves torch's CUDA generator in capture mode). Leaves of the capture's own have none of
    that history; they share the parameters' memory, so the graphs read the live weights.
    Yields the leaves in the order of ``params`` (``gate.parameters()``: a shared one once).
    """
    swapped, leaf_of = [], {}
    try:
        for module in gate.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    swapped.append((module, name, param))
                    if id(param) not in leaf_of:
                        leaf_of[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
                    module._parameters[name] = leaf_of[id(param)]
        yield [leaf_of[id(p)] for p in params]
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


class ReplayRoutes(torch.autograd.Function):
    """(captured, tokens, *gate parameters) -> (l_aux, indices, gates, counts), replayed."""

    @staticmethod
    def forward(ctx, captured: _Captured, tokens: Tensor, *params: Tensor):
        if captured.tokens.data_ptr() != tokens.data_ptr():
            captured.tokens.detach().copy_(tokens)
        captured.forward.replay()
        captured.generation += 1
        ctx.captured, ctx.generation = captured, captured.generation
        if captured.backward is not None:
            captured.pending = weakref.ref(ctx)
        outputs = (captured.l_aux.clone(), captured.indices.clone(), captured.gates.clone(), captured.counts.clone())
        ctx.mark_non_differentiable(outputs[1], outputs[3])
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_l_aux, _grad_indices, grad_gates, _grad_counts):
        captured = ctx.captured
        if captured.backward is None or ctx.generation != captured.generation:
            raise RuntimeError(
                "the CUDA-graphed gate's activations were reused before this backward (a second "
                "backward with retain_graph=True, or a backward after another forward); set "
                '"moe": {"cuda_graph_gate": false}'
            )
        for static, grad in ((captured.grad_l_aux, grad_l_aux), (captured.grad_gates, grad_gates)):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        captured.backward.replay()
        # The backward's temporaries reused the memory of the activations it read: no second one.
        captured.generation += 1
        captured.pending = None
        grads = captured.grads

        def grad_at(index):
            return None if index is None or grads[index] is None else grads[index].clone()

        param_grads = [grad_at(captured.param_grad_index.get(i)) for i in range(len(ctx.needs_input_grad) - 2)]
        return (None, grad_at(captured.grad_tokens_index), *param_grads)


class GateGraphs:
    """One MoE layer's captured routings, by call signature."""

    def __init__(self):
        self._captured: dict[tuple, _Captured] = {}

    def routes(self, gate, tokens: Tensor, used_token: Tensor | None, op) -> tuple[Tensor, int, Tensor, Tensor, Tensor]:
        """What ``gate_routes(gate, tokens, used_token, op)`` returns, replayed where it can be."""
        if (
            used_token is not None
            or not tokens.is_cuda
            or torch.cuda.is_current_stream_capturing()
            or torch.compiler.is_compiling()
            or torch.is_autocast_enabled(tokens.device.type)
            or saved_tensor_hooks_active()
            or not _reproducible(gate, tokens)
        ):
            return gate_routes(gate, tokens, used_token, op)
        params = list(gate.parameters())
        needs_grad = torch.is_grad_enabled() and (tokens.requires_grad or any(p.requires_grad for p in params))
        key = _signature(gate, tokens, op, params, needs_grad)
        captured = self._captured.get(key)
        if captured is None:
            self._forget_moved(params)
            if len(self._captured) >= MAX_SIGNATURES:
                return gate_routes(gate, tokens, used_token, op)
            captured = self._captured[key] = self._capture(gate, tokens, op, params, needs_grad)
        if needs_grad and captured.awaiting_backward():
            return gate_routes(gate, tokens, used_token, op)
        l_aux, indices, gates, counts = ReplayRoutes.apply(captured, tokens, *params)
        return l_aux, captured.num_experts, indices, gates, counts

    def _forget_moved(self, params) -> None:
        """Drops the graphs captured for the parameters' old storage, with their memory pools: they
        can never replay, and they would hold signature slots the current storage needs."""
        storage = _parameter_storage(params)
        for key in [key for key in self._captured if key[0] != storage]:
            del self._captured[key]

    @staticmethod
    def _capture(gate, tokens, op, params, needs_grad) -> _Captured:
        try:
            return _Captured(gate, tokens, op, params, needs_grad)
        except RuntimeError as error:
            # Not a silent fallback: a capture that fails part way can leave torch's CUDA generator
            # in capture mode, and every later random op of the process would fail obscurely.
            raise RuntimeError(
                f"ds_comet: capturing the gate's routing in a CUDA graph failed for tokens "
                f'{tuple(tokens.shape)} ({error}); set "moe": {{"cuda_graph_gate": false}}'
            ) from error
