"""The fused COMET pipeline: layer0 = dispatch + GEMM1, layer1 = GEMM2 + combine, both ways.

Forward: the dispatch sends token rows (packed in FP8 under the recipe's ``"dispatch": "fp8"``,
``kernels/fp8_rows.py``; a token's row crosses to a rank once, staged there with the
list of its routes and their gates, and that rank's dispatch copies it to each route's row), GEMM1
runs per row tile as rows arrive (the activation in its epilogue for gated experts, in an
elementwise kernel after it for the others), GEMM2 stores its output rows locally chunk
by chunk and counts them, and the combine, as chunks finish, first sums on each expert rank the
gate-weighted rows of each staged token's routes there into one row, then has each source read,
over NVLink, one such row per (token, rank) besides its own routes' rows, and sum them. A token
crosses each link at most once each way, however many of its k routes share a rank.

Backward, through the same two primitives: the gradient of the combine is a dispatch (each token's
output gradient travels once to each rank holding one of its routes and becomes each route's
gate-scaled row there, where its dot product with the route's saved output, the gate's gradient,
is taken too; packed in FP8 under ``"gradient_dispatch": "fp8"``, each route's gate then in its
row's tile scales), overlapped with the GEMM for the gradient of the activation (dY @ W2, which an
elementwise kernel multiplies by act'); the gradient of the dispatch is a combine (the rows' input
gradients dA @ W1, stored chunk by chunk on the expert ranks, are summed there per staged token and
read by the source ranks, which collect the gate gradients as they go). The weight gradients are
grouped GEMMs that run while the combine moves data, one projection at a time, each in an autograd
node of its own, so that its gradient reaches its parameter (and ZeRO's hook, which frees it) before
the next is computed (``fused_call_under_autograd``). Each GEMM phase runs on the implementation
the GEMM table (``kernels/gemm_table.py``) gives the call: alone in the group, where no row waits
for a link, stacked bf16 experts on sm_90 take the library's grouped GEMM for GEMM1, both ways; under
an ``"fp8"`` recipe that the pipeline runs (``fp8``), the phases it puts in FP8 take the FP8 GEMMs,
which read the weights the pipeline keeps quantised (``fp8_weights``).

Reuse across calls: a rank's next call writes ``recv``, ``reduced`` and ``row_dot`` (and peers stage
into its ``stage``) only after its next exchange, which waits until every rank has published that
call's counts, which each rank does only after its previous call joined its combine; so no rank
overwrites what a peer still reads. A backward joins in the last of its call's autograd nodes, which
autograd runs back to back, before any other call's exchange (``PendingBackward`` refuses otherwise).

Streams: the exchange and the GEMMs run on the caller's stream; the dispatch and then the combine
run on the buffer's communication stream, the dispatch on ``comm_blocks`` thread blocks beside GEMM1
and the combine on ``combine_blocks`` beside GEMM2, and the GEMMs take every other multiprocessor.
In the forward the combine is launched a second time on the caller's stream, after GEMM2, with
GEMM2's grid; both launches claim the same work units, so every SM reduces what is left once GEMM2
is done. No step reads anything back to the host, unless the layer sizes its activations by the
rows each call receives (``size_by_received``): then the exchange's count, once a call.

Progress: the dispatch waits only for the rows peers' dispatches stage here, and a block of it waits
only once it has sent all it sends; GEMM1 tiles wait only for dispatches, GEMM2 waits for nothing;
the combine's sums on an expert rank wait only for its own GEMM2, and a source's reads only for
those sums, which each rank claims before its own reads of the same chunk. Every rank launches in
the order exchange, dispatch, GEMM1, GEMM2, combine, so each spinning kernel's producers are
launched on every rank before anything that could block a host behind it. GEMM1's grid leaves
``comm_blocks`` multiprocessors free, so a spinning GEMM1 tile can never keep a dispatch from being
scheduled. The communication stream's combine starts only after the dispatch and holds at most
``combine_blocks`` <= ``comm_blocks`` SMs (parameters.py), so it and GEMM1 fit on the GPU together.
The forward's second combine starts only after this rank's GEMM2, when the only work peers may still
need from this GPU is its dispatch and its combine's reduce units (which it claims, chunk by chunk,
before the units that wait for peers); it takes ``num_sms - combine_blocks`` SMs, and the SMs of the
other combine, which cannot start before the dispatch ends, stay for the dispatch. A unit is claimed
only by a running block, so no unit waits on a block that is not scheduled.
"""

import weakref
from types import ModuleType

import torch
import torch.distributed as torch_dist
from torch import Tensor

from ..fp8 import E4M3, FORMATS
from ..kernels.fp8_rows import dequantise_rows, packed_rows_in, quantise_rows
from ..kernels.fp8_weights import Fp8WeightCache
from ..kernels.fused_experts import PROJECTIONS, FusedExperts
from ..kernels.gemm_phases import Fp8Facts, Phase
from ..kernels.launch import FusedKernels, FusedParameters, PointerTables
from ..kernels.ops import CometWaitTimeout
from ..kernels.routing_plan import RoutingPlan, plan_routes_cuda
from ..kernels.workspace import CometBuffer
from .collective_waits import describe_failures, failure_notes, group_ranks, post_failure
from .exchange_header import NO_HEADER, ExchangeHeader, LayerHeaders
from .interface import Pipeline


class FusedPipeline(Pipeline):
    """The fused COMET pipeline of one MoE layer on one rank, in the spirit of DeepEP's ``Buffer``.

    It owns what a call needs beyond its tokens: the expert-parallel group's workspace
    (``CometBuffer``: symmetric receive, staging and partial-sum buffers, flags and counters;
    shared by the group's layers of one shape), the kernel parameters (``FusedParameters``), the
    local experts' weights as the kernels read them (``FusedExperts``) and their device pointer
    tables. Build it on every rank of the group at once (``pipelines.selection`` does); call
    ``forward`` (``Pipeline.forward``) on every rank for every call, in the same order, as with any
    collective. The gate before it may do its integer bookkeeping in the workspace's op
    (``gate_op``) and be replayed from CUDA graphs (``replays_gate``).

    Args:
        workspace: the group's workspace for this layer's shape (``workspace.get_buffer``).
        experts: the local experts' weights as the kernels read them.
        params: the kernel parameters (``parameters.choose_parameters``).
        num_experts: the layer's experts over the group.
        row_bounds: the most rows this rank can receive in one call, by capacity mode (True: the
            gate's training capacity, False: its eval capacity): the exchange kernel stops with an
            error rather than let a call exceed it, and activations are sized by it.
        size_by_received: size activations by the rows each call receives instead (read back to
            the host after the exchange: ``"activation_rows": "received"``).
        fp8: what the layer's FP8 recipe asks of the GEMMs, where they run it (the GEMM table then
            gives those phases its FP8 implementation); the pipeline keeps the weights those GEMMs
            read quantised (``fp8_weights``). None: every GEMM in the tokens' dtype.
    """

    name = "fused"
    replays_gate = True

    def __init__(
        self,
        workspace: CometBuffer,
        experts: FusedExperts,
        params: FusedParameters,
        num_experts: int,
        row_bounds: dict[bool, int],
        size_by_received: bool = False,
        fp8: Fp8Facts | None = None,
    ):
        self.workspace = workspace
        self.experts = experts
        self.params = params
        self.num_experts = num_experts
        self.row_bounds = row_bounds
        self.size_by_received = size_by_received
        self.tables = PointerTables()
        self.fp8 = fp8
        self.fp8_weights = None if fp8 is None else Fp8WeightCache(fp8.phases, fp8.scaling)
        self.rows_in_fp8 = fp8 is not None and fp8.rows_in_fp8
        # Under "gradient_dispatch": "fp8" the output gradients cross packed in this format (else None).
        self.gradient_format = FORMATS[fp8.gradient_format] if fp8 is not None and fp8.gradients_in_fp8 else None
        self.layer_name = "MoE layer"  # in the note its peers read if this rank raises (the selection names it)
        # The layer's exchange headers (exchange_header.py), which the selection keeps; None: every call's
        # header is NO_HEADER.
        self.headers: LayerHeaders | None = None

    @property
    def gate_op(self) -> ModuleType:
        """The workspace's loaded op, whose gate kernels do the gate's integer bookkeeping."""
        return self.workspace.op

    # Under torch.compile the fused call runs as written, behind one graph break. Dynamo would otherwise
    # trace into the fused autograd function around the op's calls and could put its Triton launches
    # in graphs; a functionalized launch (aot_autograd, inductor) runs on copies of the tensors it
    # writes, while the kernels hand data to peers through raw pointers into the symmetric workspace,
    # which no graph sees. torch._disable_dynamo, not torch.compiler.disable: it imports torch._dynamo
    # at the first call, not at `import ds_comet` (seconds; DeepSpeed's lazy_disable does the same).
    @torch._disable_dynamo
    def forward(
        self,
        tokens: Tensor,
        indices: Tensor,
        weights: Tensor,
        *,
        train: bool = True,
        scale_before: bool = False,
        out: Tensor | None = None,
    ) -> Tensor:
        """The experts' combined output for ``tokens``: ``Pipeline.forward``'s arguments and result.

        ``tokens`` are bf16 or fp16 on this rank's GPU; ``train`` picks the capacity bound
        (``row_bounds``). ``scale_before`` must be False: the kernels weight the routes' outputs,
        never their rows. Under autograd, with gradients wanted for the tokens, the weights or the
        experts' parameters, the fused backward runs when they flow. ``out`` ([S, H], the tokens'
        dtype), if given, receives the output, with no autograd (beyond ``Pipeline``: the GPU
        tests pass a poisoned tensor to see every row written). No host sync, unless
        ``size_by_received``.
        """
        if scale_before:
            raise ValueError(
                f"ds_comet: {self.layer_name}: the fused pipeline weights the routes' outputs, not their rows "
                "(scale_before); such a layer runs the reference pipeline"
            )
        # The kernels weight routes in fp32; autocast makes the top-2 gate's weights bf16 (exact in fp32).
        weights = weights.float()
        try:
            plan = plan_routes_cuda(self.workspace.op, indices, self.num_experts, self.workspace.shape.ep_size)
            if plan.top_k != self.workspace.shape.top_k:
                raise ValueError(
                    f"the gate gave {plan.top_k} routes a token, but this layer's fused workspace was "
                    f"built for k={self.workspace.shape.top_k}"
                )
            max_rows = self.row_bounds[train]
            header = None if self.headers is None else self.headers.current

            def call(tokens: Tensor, weights: Tensor) -> Tensor:
                if out is None and torch.is_grad_enabled():
                    params = self.experts.projection_parameters()
                    needs = {projection: any(p.requires_grad for p in group) for projection, group in params.items()}
                    if tokens.requires_grad or weights.requires_grad or any(needs.values()):
                        return fused_call_under_autograd(self, plan, max_rows, header, tokens, weights, params, needs)
                return self.run_forward(tokens, plan, weights, max_rows, header_words(header), out=out)

            return self.experts.with_whole_weights(call, tokens, weights)
        except Exception as error:
            self.note_error(error)
            self.raise_with_sizing_hint(error, self.row_bounds[train])
            raise

    def raise_with_sizing_hint(self, error: Exception, rows: int) -> None:
        """Raises ``error`` again, naming ``"activation_rows"``, if it is running out of memory where
        this layer sized its activations by its row bound (``rows``); else returns."""
        if isinstance(error, torch.OutOfMemoryError) and not self.size_by_received:
            raise torch.OutOfMemoryError(
                f"{error}\nds_comet: {self.layer_name} sizes its activations by the most rows "
                f'a rank can receive ({rows} a call); "moe": {{"activation_rows": '
                '"received"} sizes them by the rows each call receives'
            ) from error

    def note_error(self, error: Exception) -> None:
        """What a call that raised ``error`` tells: if one of its kernels gave up on a wait (which
        stops the device), the wait's own error, with what peers noted; else ``error`` is this rank's
        own, and it notes it for the peers its kernels will leave waiting (``post_failure``)."""
        if isinstance(error, CometWaitTimeout):
            return  # the wait's own error, already told
        self.raise_if_failed()
        post_failure(self.layer_name, error, self.workspace.shape.ep_size)

    def raise_if_failed(self):
        """Raises ``CometWaitTimeout`` if a kernel of this rank gave up on a wait, with the notes of
        any peer that raised inside a call (``collective_waits.post_failure``)."""
        failure = self.workspace.failed_wait()
        if failure is None:
            return
        message, began = failure
        if self.headers is not None and self.headers.current is not None:
            message += f"; this rank's last call: {self.headers.current.describe()}"
        if self.workspace.shape.ep_size > 1:
            me = torch_dist.get_rank()
            peers = [rank for rank in group_ranks(self.workspace.group) if rank != me]
            since = began - self.workspace.kernel_shape.timeout_ns / 1e9
            message += describe_failures(failure_notes(peers, since))
        raise CometWaitTimeout(message)

    def kernels(self, tokens: Tensor) -> FusedKernels:
        """The kernel launches of one call on ``tokens`` ([S, H]), with the experts' current weights
        (quantised first for the FP8 GEMMs where they may have changed)."""
        tables = self.tables.get(self.experts, tokens)
        fp8_tables = {} if self.fp8_weights is None else self.fp8_weights.tables(self.experts, tokens.device)
        return FusedKernels(
            self.workspace,
            self.experts,
            self.params,
            tables,
            tokens.shape[1],
            fp8=self.fp8,
            fp8_tables=fp8_tables,
            fp8_weights=self.fp8_weights,
        )

    def run_forward(
        self,
        tokens: Tensor,
        plan: RoutingPlan,
        weights: Tensor,
        max_rows: int,
        header: list[int],
        out: Tensor | None = None,
        saved: dict | None = None,
    ) -> Tensor:
        """The forward's kernels: exchange, dispatch, GEMM1, GEMM2, combine (see the module's docstring).
        ``header``: the call's exchange header words (``header_words``), which every rank's must match.

        ``saved``, if given, receives what ``run_backward`` needs: the received rows in a tensor of this
        call's (the workspace is reused by the next call), their expert outputs (GEMM2 writes them into a tensor
        of this call's) and the products before the activation. Not the activations: the backward's
        elementwise step after its GEMM1 recomputes them from those products: a layer holds half the
        FFN-wide memory it would (a third less for gated experts, whose products are twice as wide).
        """
        buffer = self.workspace
        num_tokens, hidden = tokens.shape
        buffer.check_tokens(num_tokens)
        self.raise_if_failed()
        kernels = self.kernels(tokens)
        tokens, weights = rows_for_kernels(tokens), weights.contiguous()
        rows = min(max_rows, buffer.shape.max_recv_rows)
        kernels.exchange(plan, rows, header)
        if self.size_by_received and not torch.cuda.is_current_stream_capturing():
            rows = max(kernels.received_rows(), 1)  # one row at least: the kernels take no null pointers
        # Each GEMM phase's outputs in the dtype its implementation stores them in.
        h = torch.empty((rows, kernels.ffn), dtype=kernels.stored_dtype(Phase.FIRST_LAYER), device=tokens.device)
        expert_out = torch.empty((rows, hidden), dtype=kernels.stored_dtype(Phase.GEMM2), device=tokens.device)
        # Under "dispatch": "fp8" the rows cross packed in FP8 (fp8_rows), quantised once a token here.
        sent = quantise_rows(tokens) if self.rows_in_fp8 else tokens
        # The backward needs the received rows after the next call has reused the workspace. Alone in
        # the group only this rank's dispatch writes them, so they go straight into a tensor of this
        # call's; with peers, who write into the workspace's buffer, they are copied out of it.
        own_rows = saved is not None and kernels.alone
        if own_rows:
            recv = torch.empty((rows, sent.shape[1]), dtype=sent.dtype, device=tokens.device)
        else:
            recv = packed_rows_in(buffer.recv, rows, hidden) if self.rows_in_fp8 else buffer.recv
        if out is None:
            # Allocated before the dispatch orders the communication stream after the main one, as
            # everything the combine writes there must be: memory freed on the main stream before that
            # point may still be read by kernels queued before it.
            out = torch.empty((num_tokens, hidden), dtype=tokens.dtype, device=tokens.device)

        packed_format = E4M3 if self.rows_in_fp8 else None
        kernels.dispatch(
            sent, plan, weights, scale_rows=False, recv=recv if own_rows else None, packed_format=packed_format
        )
        pre = kernels.first_layer(recv, h, keep_pre=saved is not None)
        kernels.gemm2(h, expert_out, backward=False)
        if saved is not None:
            # GEMM1 waited for every received row, so a copy out of the workspace reads them all (packed
            # rows stay packed until the backward needs them). The backward takes the gate gradient
            # where the outputs are, on the expert's rank.
            saved.update(rows=recv if own_rows else recv[:rows].clone(), outputs=expert_out, pre=pre)
        # The combine spins until this rank's GEMM2 and peers' combines deliver, so it is launched last:
        # a launch that blocks the host (a lazily loaded module waits for the device) must never wait
        # behind a spinning kernel whose producers this rank has not launched yet.
        kernels.combine(plan, expert_out, weights, out, None, finish_on_main=True)
        kernels.join(tokens.device, sent, plan.route_order, plan.route_position, weights, expert_out, out)
        return out

    def run_backward(
        self,
        grad_out: Tensor,
        plan: RoutingPlan,
        weights: Tensor,
        saved: dict,
        header: list[int],
        need_second: bool,
        need_weights: bool,
    ) -> tuple[list[Tensor], "PendingBackward"]:
        """The backward's collective part and the second layer's weight gradients, from the output gradient
        ``grad_out`` ([S, H]) of ``run_forward``'s call that filled ``saved``; ``header``: the exchange
        header words of the call's backward. Returns the gradients of the experts'
        ``projection_parameters("w2")`` (empty unless ``need_second``) and the rest of the backward,
        queued later (``PendingBackward``: the first layer's weight gradients, then the tokens' and,
        if ``need_weights``, the route weights' ([k, S], fp32) gradients)."""
        buffer = self.workspace
        self.raise_if_failed()
        grad_out = rows_for_kernels(grad_out)
        kernels = self.kernels(grad_out)
        device = grad_out.device
        dtype = kernels.stored_dtype(Phase.FIRST_LAYER_BACKWARD)  # of the first layer's gradients and activations

        # The collective part runs whatever this rank needs, so that every rank of the group launches the
        # same kernels (a rank whose tokens need no gradient must still return its peers' rows).
        weights = weights.detach().contiguous()
        width = kernels.ffn * (2 if kernels.gated else 1)
        rows = saved["rows"].shape[0]
        grad_pre = torch.empty((rows, width), dtype=dtype, device=device)
        # Allocated before the dispatch, which orders the communication stream after everything queued
        # so far: the combine writes them there, and a block freed later (``pre``) may still be read by
        # GEMM1 when the combine runs.
        grad_tokens = torch.empty_like(grad_out)
        route_grad = torch.empty(weights.shape, dtype=torch.float32, device=device) if need_weights else None
        kernels.exchange(plan, rows, header)
        # The combine weighted each route by its gate, so each route's output gradient is the gate
        # times the token's gradient (rounded like stock's fp32 combine rounds it). Each route's
        # gate gradient, the dot product of the token's gradient with the route's output, is taken
        # where that output is, on every rank (a peer may need it even where this rank does not).
        # Under "gradient_dispatch": "fp8" the gradients cross packed (fp8_rows), quantised once a
        # token here, and the gate goes into each route's tile scales instead.
        fmt = self.gradient_format
        sent = grad_out if fmt is None else quantise_rows(grad_out, fmt)
        recv = buffer.recv if fmt is None else packed_rows_in(buffer.recv, rows, grad_out.shape[1])
        outputs = saved.pop("outputs")
        kernels.dispatch(sent, plan, weights, scale_rows=True, outputs=outputs, packed_format=fmt)
        # Each saved tensor is dropped as soon as its last kernel is queued: the caching allocator
        # reuses its memory only for work queued after it on this stream, so the peak stays low.
        h = kernels.first_layer_backward(recv, grad_pre, saved.pop("pre"), want_act=need_second)
        # GEMM2's rows go over the forward's outputs, saving an [R, H] tensor: the dispatch reads each
        # output row before it counts the row on its GEMM1 tile, and GEMM1 waits for every count (alone
        # in the group the dispatch runs before it on this stream), so no read is left once GEMM1 ends.
        grad_rows = outputs
        kernels.gemm2(grad_pre, grad_rows, backward=True)
        # Not joined here: the weight gradients queued on the main stream next hide the combine's tail.
        kernels.combine(plan, grad_rows, None, grad_tokens, route_grad, finish_on_main=False)
        used_on_comm = [sent, weights, plan.route_order, plan.route_position, grad_rows, grad_tokens]
        kernels.record_comm_use(*used_on_comm, *([] if route_grad is None else [route_grad]))
        second = []
        if need_second:
            # While the combine brings the input gradients home: dW2 = dY_l^T h_l.
            # Packed gradients as the emulation holds them: the values times their gate-scaled scales, in bf16.
            dy = recv if fmt is None else dequantise_rows(recv, grad_out.shape[1], fmt)
            second = self.experts.projection_gradients("w2", *kernels.wgrad(dy, h))
        pending = PendingBackward(kernels, grad_pre, saved.pop("rows"), self.rows_in_fp8, grad_tokens, route_grad)
        saved.clear()
        return second, pending


class PendingBackward:
    """What is left of one fused call's backward once ``FusedPipeline.run_backward`` has queued its
    collective part and the second layer's weight gradients, while the combine brings the input
    gradients home: the first layer's weight gradients, a projection at a time (``projection_gradients``),
    then the join with the communication stream (``finish``), which gives the tokens' and the route
    weights' gradients.

    Args:
        kernels: the call's kernel launches.
        grad_pre: the gradients before the activation, [R, F] (gated: [R, 2F], the up projection's
            half last), in the first layer's stored dtype.
        rows: the received rows ([R, H], or packed FP8 rows under ``"dispatch": "fp8"``).
        rows_in_fp8: whether ``rows`` are packed.
        grad_tokens: the tokens' gradients the combine writes, [S, H].
        route_grad: the route weights' gradients it writes, [k, S] fp32 (None: not wanted).
    """

    def __init__(
        self,
        kernels: FusedKernels,
        grad_pre: Tensor,
        rows: Tensor,
        rows_in_fp8: bool,
        grad_tokens: Tensor,
        route_grad: Tensor | None,
    ):
        self.kernels, self.grad_pre, self.rows, self.rows_in_fp8 = kernels, grad_pre, rows, rows_in_fp8
        self.grad_tokens, self.route_grad = grad_tokens, route_grad
        self.exchange = kernels.buffer.exchanges  # this call's: the layout the weight gradients read is its

    def projection_gradients(self, projection: str) -> list[Tensor]:
        """The gradients of the experts' ``projection_parameters(projection)`` for ``"w1"`` or ``"w3"``:
        dW = dA_l^T x_l over each local expert's received rows, from the projection's half of
        ``grad_pre``."""
        kernels = self.kernels
        if kernels.buffer.exchanges != self.exchange:
            # Autograd runs one call's nodes back to back (later-made nodes first), so only an unusual
            # graph gets here; the layout is now another call's, and the gradients would be wrong.
            raise RuntimeError(
                "ds_comet: another MoE call on this layer's workspace exchanged between the nodes of one "
                "call's fused backward, so its weight gradients cannot be computed; run the layers whose "
                'backwards interleave with "moe": {"overlap": "none"}'
            )
        if self.rows_in_fp8:  # the emulation's rows: the received values times their scales, in bf16
            self.rows, self.rows_in_fp8 = dequantise_rows(self.rows, kernels.hidden), False
        # Each projection's gradient is computed apart, so that each is one contiguous tensor: a slice
        # of a joint [L, 2F, H] result is copied by autograd when it accumulates into a stacked
        # [L, F, H] parameter.
        columns = slice(kernels.ffn, None) if projection == "w3" else slice(None, kernels.ffn)
        return kernels.experts.projection_gradients(projection, *kernels.wgrad(self.grad_pre[:, columns], self.rows))

    def finish(self) -> tuple[Tensor, Tensor | None]:
        """The tokens' gradients ([S, H]) and the route weights' ([k, S], fp32, or None), the caller's stream
        ordered after the combine that writes them; drops everything else."""
        self.kernels.join(self.grad_tokens.device)
        grads = self.grad_tokens, self.route_grad
        self.grad_pre = self.rows = self.grad_tokens = self.route_grad = None
        return grads


def header_words(header: ExchangeHeader | None) -> list[int]:
    """The words the exchange kernel publishes and compares for ``header``; NO_HEADER for None (a
    pipeline used without a selection: every rank's alike)."""
    return NO_HEADER if header is None else header.words()


def rows_for_kernels(rows: Tensor) -> Tensor:
    """``rows`` contiguous and 16-byte aligned (the kernels move rows as 16-byte vectors): as it is
    when it already is, else a copy (a view starting mid-vector would fault on the device)."""
    rows = rows.contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


class StagedBackward:
    """One fused call's backward as autograd runs it: several nodes, one after the other
    (``fused_call_under_autograd``), which share this.

    Args:
        pipeline: the pipeline of the call.
        rows: the most rows the call could receive (for ``raise_with_sizing_hint``).
        needs: by each of ``PROJECTIONS``, whether its parameters need gradients.
        need_tokens, need_weights: whether the tokens and the route weights need them.
    """

    def __init__(
        self, pipeline: FusedPipeline, rows: int, needs: dict[str, bool], need_tokens: bool, need_weights: bool
    ):
        self.pipeline, self.rows = pipeline, rows
        self.needs, self.need_tokens, self.need_weights = needs, need_tokens, need_weights
        self.pending: PendingBackward | None = None  # between the first node's backward and the last's
        # The projections' nodes that autograd recorded, weakly (they hold this).
        self.nodes: dict[str, weakref.ref] = {}

    def record(self, projection: str, anchor: Tensor) -> Tensor:
        """Notes the node behind ``anchor`` (``projection``'s, if autograd recorded it); returns ``anchor``."""
        if anchor.grad_fn is not None:
            self.nodes[projection] = weakref.ref(anchor.grad_fn)
        return anchor

    def runs_after(self, projection: str) -> bool:
        """Whether this backward runs a projection's node after ``projection``'s (``"w2"``: the fused
        node's); a backward restricted to some inputs (``torch.autograd.grad``) may run none."""
        later = PROJECTIONS[: PROJECTIONS.index(projection)]  # the nodes run in the reverse of PROJECTIONS
        nodes = [self.nodes[name]() for name in later if name in self.nodes]
        return any(node is not None and torch._C._will_engine_execute_node(node) for node in nodes)

    def finish_unless_later(self, projection: str) -> tuple[Tensor, Tensor | None] | None:
        """The call's ``PendingBackward.finish()`` if no node runs after ``projection``'s (which then runs
        last), else None."""
        if self.runs_after(projection):
            return None
        grads, self.pending = self.pending.finish(), None
        return grads

    def note_error(self, error: Exception) -> None:
        """Tells what a backward node's ``error`` means, as the forward's call does, then returns."""
        self.pipeline.note_error(error)
        self.pipeline.raise_with_sizing_hint(error, self.rows)


def fused_call_under_autograd(
    pipeline: FusedPipeline,
    plan: RoutingPlan,
    max_rows: int,
    header: ExchangeHeader | None,
    tokens: Tensor,
    weights: Tensor,
    params: dict[str, list[Tensor]],
    needs: dict[str, bool],
) -> Tensor:
    """The fused call ([S, H] tokens, [k, S] route weights -> [S, H] output) with its backward as a
    chain of autograd nodes: the fused one (``FusedMoEFunction``: the collective backward and the
    second layer's weight gradients), then the up projection's weight gradients (gated experts), then
    the first projection's, with the tokens' and the route weights' gradients (``ProjectionGradients``).

    Why a chain: autograd hands a node's gradients to their parameters' accumulators before it runs the
    next node (an accumulator outranks every other node in autograd's ready queue), and ZeRO-3's hook
    there copies each gradient into its reduction bucket and frees it; so under ZeRO-3 a layer's three
    weight gradients are not all allocated at once, as with AutoEP's own chain of grouped GEMMs.
    ``params``: the experts' ``projection_parameters()``; ``needs``: whether each projection's need
    gradients.
    """
    experts = pipeline.experts
    staged = StagedBackward(pipeline, max_rows, needs, tokens.requires_grad, weights.requires_grad)
    anchor = staged.record("w1", ProjectionGradients.apply(staged, "w1", tokens, weights, *params["w1"]))
    if experts.gated:
        anchor = staged.record("w3", ProjectionGradients.apply(staged, "w3", anchor, *params["w3"]))
    return FusedMoEFunction.apply(pipeline, plan, max_rows, header, staged, anchor, tokens, weights, *params["w2"])


FUSED_BACKWARD_ONCE = (
    "the fused MoE backward runs once per forward: its saved activations are freed as it goes "
    '(retain_graph=True needs "moe": {"overlap": "none"})'
)


class FusedMoEFunction(torch.autograd.Function):
    """The fused forward with the first part of the fused backward:
    (pipeline, plan, max_rows, header, staged, anchor, tokens, weights, *second layer parameters) ->
    output, where ``header`` is the call's ``ExchangeHeader`` (or None), whose backward's words the
    backward exchange carries, and ``staged`` and ``anchor`` tie it to the call's other backward nodes
    (``fused_call_under_autograd``).

    Its backward runs ``FusedPipeline.run_backward`` and returns the second layer's weight gradients;
    the tokens' and route weights' come from the first projection's node. The parameters are inputs
    of the nodes that return their gradients, so that autograd accumulates them into the experts'
    own ``.grad`` and DeepSpeed's hooks see them as they would with stock.
    """

    @staticmethod
    def forward(
        ctx,
        pipeline: FusedPipeline,
        plan: RoutingPlan,
        max_rows: int,
        header: ExchangeHeader | None,
        staged: StagedBackward,
        anchor: Tensor,
        tokens: Tensor,
        weights: Tensor,
        *second_params: Tensor,
    ) -> Tensor:
        saved = {}
        out = pipeline.run_forward(tokens, plan, weights, max_rows, header_words(header), saved=saved)
        ctx.pipeline, ctx.plan, ctx.saved, ctx.staged = pipeline, plan, saved, staged
        ctx.header = header_words(None if header is None else header.backward())
        ctx.save_for_backward(weights)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if ctx.saved is None:
            raise RuntimeError(FUSED_BACKWARD_ONCE)
        (weights,) = ctx.saved_tensors
        staged = ctx.staged
        try:
            second, staged.pending = ctx.pipeline.run_backward(
                grad_out,
                ctx.plan,
                weights,
                ctx.saved,
                ctx.header,
                need_second=staged.needs["w2"],
                need_weights=staged.need_weights,
            )
        except Exception as error:
            staged.note_error(error)
            raise
        ctx.saved = None
        staged.finish_unless_later("w2")
        second = second or [None] * (len(ctx.needs_input_grad) - 8)
        # The anchor's gradient (empty) lets the projections' nodes run next.
        return (None, None, None, None, None, grad_out.new_empty(0), None, None, *second)


class ProjectionGradients(torch.autograd.Function):
    """A first-layer projection's weight gradients as an autograd node of their own, which runs after
    the call's nodes that follow it in the forward (``fused_call_under_autograd``):
    (staged, projection, *inputs, *the projection's parameters) -> anchor (empty), where ``inputs`` are
    the up projection's node's anchor (``"w3"``) or the tokens and route weights (``"w1"``, whose node
    returns their gradients too).
    """

    @staticmethod
    def forward(ctx, staged: StagedBackward, projection: str, *inputs: Tensor) -> Tensor:
        ctx.staged, ctx.projection = staged, projection
        ctx.leading = 1 if projection == "w3" else 2
        return inputs[0].new_empty(0)

    @staticmethod
    def backward(ctx, grad_anchor: Tensor):
        staged, projection = ctx.staged, ctx.projection
        pending = staged.pending
        if pending is None:
            raise RuntimeError(FUSED_BACKWARD_ONCE)
        count = len(ctx.needs_input_grad) - 2 - ctx.leading
        leading = (grad_anchor,) if projection == "w3" else (None, None)
        try:
            params = pending.projection_gradients(projection) if staged.needs[projection] else [None] * count
            finished = staged.finish_unless_later(projection)
            if finished is not None and projection == "w1":
                grad_tokens, grad_weights = finished
                leading = (grad_tokens if staged.need_tokens else None, grad_weights if staged.need_weights else None)
        except Exception as error:
            staged.note_error(error)
            raise
        return (None, None, *leading, *params)
