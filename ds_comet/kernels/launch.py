"""The fused pipeline's kernel launches for one call, the parameters they take, and the experts'
pointer tables.

``FusedKernels`` binds what every launch of one call shares (the workspace, the experts' pointer
tables, the kernel parameters, the sizes) and launches each kernel on the stream it belongs to.
``pipelines.fused`` strings them into the forward and the backward; benchmarks relaunch them
one at a time (``ds_comet.bench``). ``FusedParameters`` are the launches' parameters, which
``pipelines.parameters`` picks per shape.
"""

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..fp8 import Fp8Format
from .constants import TOTAL_COMBINE_CLAIM, TOTAL_RECV_ROWS
from .fp8_rows import PACKED_DTYPE
from .fp8_weights import Fp8WeightCache
from .fused_experts import POINTER_NAMES, FusedExperts
from .gemm_phases import Fp8Facts, GemmFacts, GemmImplementation, Phase, Products
from .gemm_table import choose
from .host_copies import host_to_device
from .routing_plan import RoutingPlan
from .workspace import CometBuffer

# The elementwise activation kernels' block (rows, columns) and warps: 64x128, 32x256 and 16x256
# blocks were no faster in the backward (docs/decisions.md).
ELEMENTWISE_BLOCK = (32, 128, 4)
# The bias gradients' column sums: rows a step, columns a program, warps. Against 64x128 and
# 32x256 blocks on shapes 1-3 it was fastest or within 3 % (docs/decisions.md).
COLUMN_SUMS_BLOCK = (128, 64, 4)


@dataclass(frozen=True)
class FusedParameters:
    """The launches' parameters for a layer's shape (``pipelines.parameters.choose_parameters``)."""

    comm_blocks: int  # thread blocks of the dispatch, beside GEMM1
    combine_blocks: int  # thread blocks of the combine, beside GEMM2
    tile_m: int
    tile_n: int  # GEMM2's column tile, and the granularity of the combine's chunk counters
    n_chunks: int
    gemm1_tile_n: int = 128


def gemm_facts(
    row_dtype: torch.dtype, experts: FusedExperts, capability: tuple[int, int], alone: bool, fp8: Fp8Facts | None
) -> GemmFacts:
    """The facts the GEMM table chooses a call's implementations by (``FusedKernels.facts``; the
    selection asks them before it builds the pipeline).

    Args:
        row_dtype: the rows' dtype (the tokens').
        experts: the local experts' weights as the kernels read them.
        capability: the GPU's compute capability.
        alone: one rank in the expert-parallel group.
        fp8: what the layer's FP8 recipe asks of the GEMMs, None without one.
    """
    return GemmFacts(
        row_dtype=row_dtype,
        weight_dtype=experts.weight_dtype(),
        capability=capability,
        alone=alone,
        gated=experts.gated,
        stacked=experts.stacked() is not None,
        fp8=fp8,
    )


class PointerTables:
    """Device tables of the local experts' weight pointers, rebuilt only when a pointer moves.

    ZeRO may move parameters into flat buffers (ZeRO-3 gathers them anew every call) and users may
    replace them, so the pointers are read on every call (cheaply) and the device tables rebuilt,
    with no host sync, when any changed.
    """

    def __init__(self):
        self._key: tuple[int, ...] | None = None
        self._tables = None

    def get(self, experts: FusedExperts, tokens: Tensor) -> dict[str, Tensor]:
        rows = experts.pointers()
        key = tuple(pointer for row in rows for pointer in row)
        if key != self._key:
            # New storage: a parameter was replaced or converted since the layer chose the fused path.
            reason = experts.tensors_reason(tokens.shape[-1], tokens.dtype, tokens.device)
            if reason is not None:
                raise ValueError(
                    f'the fused MoE kernels cannot read the experts\' weights: {reason} (use "overlap": "none")'
                )
            misaligned = sorted({POINTER_NAMES[i] for row in rows for i, p in enumerate(row) if p % 16})
            if misaligned:
                raise ValueError(
                    f"expert weights {misaligned} are not 16-byte aligned; the fused "
                    'kernels need aligned weights (use "overlap": "none")'
                )
            pointers = torch.tensor(key, dtype=torch.int64).view(len(rows), len(POINTER_NAMES)).t().contiguous()
            # Queued, not waited for: under ZeRO-3 the weights are gathered anew, at new addresses, every call.
            stacked = host_to_device(pointers, tokens.device)
            self._tables = {name: stacked[i] for i, name in enumerate(POINTER_NAMES)}
            self._key = key
        return self._tables


@dataclass
class FusedKernels:
    """What every kernel launch of one call shares, and the launches.

    Each method queues the launches of one step: one kernel; for ``dispatch`` and ``combine`` one on
    each stream the step runs on; for a GEMM phase (``first_layer``, ``gemm2``,
    ``first_layer_backward``, ``wgrad``) the launches of the implementation the GEMM table gives
    the phase for this call's facts (``implementation``), with ``wgrad``'s column sums after them
    where the experts have biases. None waits for the device.

    Args:
        buffer: the group's workspace.
        experts: the local experts' weights as the kernels read them.
        params: the launch parameters for the layer's shape.
        tables: the experts' device pointer tables (``PointerTables.get``), by ``POINTER_NAMES``.
        hidden: the tokens' width H.
        fp8: what the layer's FP8 recipe asks of the GEMMs, None without one.
        fp8_tables: with ``fp8``, the quantised weights' device pointer tables
            (``fp8_weights.Fp8WeightCache.tables``).
        fp8_weights: with ``fp8``, the cache those tables point into (its stacked copies,
            ``Fp8WeightCache.quantised``, are what a library FP8 GEMM reads).
    """

    buffer: CometBuffer
    experts: FusedExperts
    params: FusedParameters
    tables: dict[str, Tensor]
    hidden: int
    fp8: Fp8Facts | None = None
    fp8_tables: dict[str, Tensor] = field(default_factory=dict)
    fp8_weights: Fp8WeightCache | None = None
    _implementations: dict[Phase, GemmImplementation] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def ffn(self) -> int:
        return self.experts.ffn

    @property
    def gated(self) -> bool:
        return self.experts.gated

    @property
    def has_bias(self) -> bool:
        return self.experts.has_bias

    @property
    def activation(self) -> str:
        return self.experts.activation

    @property
    def num_local(self) -> int:
        return self.experts.num_local

    @property
    def alone(self) -> bool:
        """One rank in the group: nothing crosses a link, so the dispatch and the combine are local
        copies that run on every SM before and after the GEMMs, and the GEMMs take every SM."""
        return self.buffer.shape.ep_size == 1

    @property
    def grid(self) -> int:
        """Programs of GEMM1 (beside the dispatch) and of the weight gradients."""
        return self.buffer.num_sms if self.alone else max(1, self.buffer.num_sms - self.params.comm_blocks)

    @property
    def gemm2_grid(self) -> int:
        """Programs of GEMM2, beside the combine."""
        return self.buffer.num_sms if self.alone else max(1, self.buffer.num_sms - self.params.combine_blocks)

    @property
    def chunking(self) -> tuple[int, int]:
        """(column tiles per chunk, number of chunks) of the hidden dimension."""
        n_col_tiles = -(-self.hidden // self.params.tile_n)
        chunk_tiles = -(-n_col_tiles // self.params.n_chunks)
        return chunk_tiles, -(-n_col_tiles // chunk_tiles)

    def exchange(self, plan: RoutingPlan, row_limit: int, header: list[int]):
        """Shares the counts and lays out the call; more than row_limit received rows stops the kernel,
        and so does a peer whose ``header`` (``layout.HEADER_FIELDS``, host ints in [0, 2**31))
        differs from this rank's."""
        b = self.buffer
        b.exchanges += 1
        b.kernel_shape.max_recv_rows = row_limit  # what the exchange checks; the other kernels ignore it
        b.op.exchange(
            shape=b.kernel_shape,
            workspace=b.kernel_workspace,
            expert_counts=plan.expert_counts,
            rank_counts=plan.rank_token_counts,
            header=header,
        )

    def received_rows(self) -> int:
        """The rows this rank receives this call, read back to the host from the layout that
        ``exchange`` fills (a host sync: it waits for the group's exchange)."""
        word = self.buffer.layout_offsets.totals + TOTAL_RECV_ROWS
        return int(self.buffer.layout[word].item())

    def dispatch(
        self,
        rows: Tensor,
        plan: RoutingPlan,
        gates: Tensor,
        scale_rows: bool,
        outputs: Tensor | None = None,
        recv: Tensor | None = None,
        packed_format: Fp8Format | None = None,
    ):
        """Puts rows[route token] (times gates[route] with ``scale_rows``) in the recv row of every kept
        route; a token's row crosses to another rank once, however many of its routes go there, with
        its routes' gates ([k, S] fp32), for the combine's sums there. Every rank of the group passes
        the same ``scale_rows`` (the backward does, the forward does not).

        ``rows`` are [S, H] in the tokens' dtype, or packed FP8 rows ([S, ``fp8_rows.packed_row_bytes(H)``]
        uint8) whose values are in ``packed_format`` (given for them only): these cross as they are, and
        ``scale_rows`` multiplies each route's tile scales by its gate (exact: they are powers of two).

        ``outputs`` (the backward, on every rank of the group or on none): the forward's expert outputs
        by recv row ([R, H], bf16 for packed rows); each route's dot product of its token's row (packed:
        its values times their scales, rounded to bf16) with its output is kept for the combine's
        ``route_grad``.

        ``recv`` (alone in the group only): a contiguous [R, H] tensor that takes the recv rows in place
        of the workspace's buffer. With peers the buffer is where they write, so it must be the buffer.
        """
        if (rows.dtype == PACKED_DTYPE) != (packed_format is not None):
            raise ValueError(
                f"packed FP8 rows ({PACKED_DTYPE}) are dispatched with their values' format and other rows "
                f"without one: got {rows.dtype} rows and packed_format {packed_format}"
            )
        if self.alone:
            table = None
            if recv is not None:
                if (
                    not recv.is_contiguous()
                    or recv.dim() != 2
                    or recv.shape[1] != rows.shape[1]
                    or recv.dtype != rows.dtype
                    or recv.device != rows.device
                ):
                    raise ValueError(
                        f"recv must be a contiguous [R, {rows.shape[1]}] {rows.dtype} tensor on "
                        f"{rows.device}, got {list(recv.shape)} {recv.dtype} on {recv.device}"
                    )
                table = torch.full((1,), recv.data_ptr(), dtype=torch.int64, device=rows.device)
            self.send(rows, plan, gates, scale_rows, outputs, self.buffer.num_sms, table, packed_format)
            return
        if recv is not None:
            raise ValueError(
                "the dispatch writes into peers' recv buffers; only a rank alone in its group takes a "
                "recv tensor of its own"
            )
        main = torch.cuda.current_stream(rows.device)
        self.buffer.comm_stream.wait_stream(main)
        with torch.cuda.stream(self.buffer.comm_stream):
            self.send(rows, plan, gates, scale_rows, outputs, self.params.comm_blocks, packed_format=packed_format)

    def send(
        self,
        rows: Tensor,
        plan: RoutingPlan,
        gates: Tensor,
        scale_rows: bool,
        outputs: Tensor | None,
        blocks: int,
        recv_table: Tensor | None = None,
        packed_format: Fp8Format | None = None,
    ):
        """One launch of the dispatch kernel, on the current stream, over ``blocks`` thread blocks;
        ``recv_table`` ([P] int64 on the device) replaces the workspace's table of recv buffers;
        ``packed_format``: that of packed FP8 ``rows`` (``dispatch``)."""
        b = self.buffer
        workspace = (
            b.kernel_workspace if recv_table is None else b.kernel_workspace.with_peer_recv(peer_recv=recv_table)
        )
        b.op.dispatch(
            shape=b.kernel_shape,
            workspace=workspace,
            tokens=rows,
            route_order=plan.route_order,
            route_position=plan.route_position,
            rank_tokens=plan.rank_tokens,
            rank_counts=plan.rank_token_counts,
            route_scale=gates,
            scaled=scale_rows,
            outputs=b.none if outputs is None else outputs,
            packed_format="" if packed_format is None else packed_format.name,
            top_k=b.shape.top_k,
            blocks=blocks,
        )

    def combine(
        self,
        plan: RoutingPlan,
        expert_out: Tensor,
        gates: Tensor | None,
        out: Tensor,
        route_grad: Tensor | None,
        finish_on_main: bool,
    ):
        """out[token] = sum over its kept routes of gate (1 if gates is None) x the route's expert output,
        ``expert_out`` ([R, H]) holding GEMM2's rows here by recv row. A token's routes on another rank
        are summed there (with the gates the dispatch took along), and one row a token and rank crosses
        back. Every rank of the group passes gates ([k, S] fp32, empty on a rank without tokens) or
        none (the forward does, the backward does not). ``route_grad`` ([k, S] fp32), if given,
        receives each route's dot product that the backward's dispatch kept (0 for a dropped route).

        With ``finish_on_main`` a second launch on the current stream, queued after GEMM2, shares the
        work with the communication blocks: what they have not reduced when GEMM2 ends is reduced by
        every SM instead of by them alone. Alone in the group, it is one launch on every SM.
        """
        if self.alone:
            self.reduce(plan, expert_out, gates, out, route_grad, self.buffer.num_sms)
            return
        with torch.cuda.stream(self.buffer.comm_stream):
            self.reduce(plan, expert_out, gates, out, route_grad, self.params.combine_blocks)
        if finish_on_main:
            self.reduce(plan, expert_out, gates, out, route_grad, self.gemm2_grid)

    def reduce(
        self,
        plan: RoutingPlan,
        expert_out: Tensor,
        gates: Tensor | None,
        out: Tensor,
        route_grad: Tensor | None,
        blocks: int,
    ):
        """One launch of the combine kernel, on the current stream, over ``blocks`` thread blocks."""
        b = self.buffer
        weighted = gates is not None
        chunk_tiles, num_chunks = self.chunking
        b.op.combine(
            shape=b.kernel_shape,
            workspace=b.kernel_workspace,
            expert_out=expert_out,
            route_position=plan.route_position,
            weighted=weighted,
            gates=gates if weighted else b.none,
            out=out,
            route_grad=b.none if route_grad is None else route_grad,
            top_k=b.shape.top_k,
            chunk_cols=chunk_tiles * self.params.tile_n,
            tile_n=self.params.tile_n,
            num_chunks=num_chunks,
            blocks=blocks,
        )

    def reset_combine_claims(self):
        """Let the next ``reduce`` launches claim every work unit again (the exchange zeroes the claim
        counter once a call; benchmarks that relaunch the combine alone reset it themselves)."""
        claim = self.buffer.layout_offsets.totals + TOTAL_COMBINE_CLAIM
        self.buffer.layout[claim : claim + 1].zero_()

    def record_comm_use(self, *used_on_comm: Tensor):
        """Keeps the memory of ``used_on_comm`` (tensors the communication stream's work of this call
        reads or writes) from reuse until that work has ended, whenever they are freed."""
        if self.alone or torch.cuda.is_current_stream_capturing():  # a graph's private pool outlives its streams
            return
        for tensor in used_on_comm:
            tensor.record_stream(self.buffer.comm_stream)

    def join(self, device, *used_on_comm: Tensor):
        """Orders the caller's stream after the communication stream's work of this call (and
        ``record_comm_use(*used_on_comm)``)."""
        if self.alone:  # nothing ran there (and a captured graph may not wait on uncaptured work)
            return
        self.record_comm_use(*used_on_comm)
        torch.cuda.current_stream(device).wait_stream(self.buffer.comm_stream)

    @functools.cached_property
    def facts(self) -> GemmFacts:
        """What the GEMM table chooses this call's implementations by."""
        return gemm_facts(self.buffer.shape.dtype, self.experts, self.buffer.capability, self.alone, self.fp8)

    def implementation(self, phase: Phase) -> GemmImplementation:
        """The implementation that runs ``phase`` in this call: the GEMM table's first that admits the
        call's facts (``gemm_table.choose``, which raises where none does)."""
        chosen = self._implementations.get(phase)
        if chosen is None:
            chosen = self._implementations[phase] = choose(phase, self.facts)
        return chosen

    def stored_dtype(self, phase: Phase) -> torch.dtype:
        """The dtype ``phase`` stores its outputs in this call: what the caller allocates them as."""
        return self.implementation(phase).stored_dtype(phase, self.facts)

    def first_layer(self, rows: Tensor, h: Tensor, keep_pre: bool) -> Products | None:
        """The experts' first layer on the received ``rows``: their activations into ``h`` ([R, F], of
        ``stored_dtype(Phase.FIRST_LAYER)``), by the implementation the table gives the phase.

        Returns, with ``keep_pre``, the products before the activation that ``first_layer_backward``
        reads, in the form the implementation keeps them (``gemm_phases.Products``), else None.
        """
        return self.implementation(Phase.FIRST_LAYER).first_layer(self, rows, h, keep_pre)

    def first_layer_backward(self, rows: Tensor, grad_pre: Tensor, pre: Products, want_act: bool) -> Tensor | None:
        """From the received output gradients ``rows`` ([R, H]): the gradient of the first layer's
        products into ``grad_pre`` ([R, F], gated [R, 2F]); returns, with ``want_act``, the activations
        again ([R, F], ``grad_pre``'s dtype) for W2's gradient, else None. ``pre`` is what
        ``first_layer`` returned.

        A GEMM stores ``g = rows @ W2`` ([R, F]), then an elementwise kernel computes the outputs from
        g and the products. GEMM1 computing them in its epilogue held up its MMAs: the two launches
        were 1-8 % faster for gated experts and 0-18 % for GELU ones (docs/decisions.md).
        """
        return self.implementation(Phase.FIRST_LAYER_BACKWARD).first_layer_backward(self, rows, grad_pre, pre, want_act)

    def activations(self, pre: Products, h: Tensor):
        """The elementwise step after a first layer's products: the activations of ``pre`` (the
        products as ``first_layer`` returns them) into ``h`` ([R, F]; it may be ``pre`` itself for
        ungated experts)."""
        from .triton_activation import activation_kernel  # triton is an extra

        first, up = self._product_halves(pre)
        self._elementwise(activation_kernel, (), first, up, (h,), GATED=self.gated)

    def activations_backward(self, grad_h: Tensor, pre: Products, grad_pre: Tensor, want_act: bool) -> Tensor | None:
        """The elementwise step after the backward's ``g = dY @ W2`` (``grad_h``, [R, F], contiguous):
        the gradient of the products ``pre`` into ``grad_pre``; returns, with ``want_act``, the
        activations again (as ``first_layer_backward``), stored over ``grad_h`` where it has
        ``grad_pre``'s dtype, else None.

        Over ``grad_h``: the kernel reads each element of g before it stores that element's activation,
        in the same thread (as ``activations`` may store over the products), and g has no use after
        it; the backward then holds one [R, F] tensor less where its first layer sets its peak."""
        from .triton_activation import activation_backward_kernel  # triton is an extra

        act = None
        if want_act:
            act = grad_h if grad_h.dtype == grad_pre.dtype else torch.empty_like(grad_h, dtype=grad_pre.dtype)
        first, up = self._product_halves(pre)
        self._elementwise(
            activation_backward_kernel,
            (grad_h,),
            first,
            up,
            (grad_pre, grad_h if act is None else act),
            GATED=self.gated,
            STORE_ACT=act is not None,
        )
        return act

    def _product_halves(self, pre: Products) -> tuple[Tensor, Tensor]:
        """(z, u) of the first layer's products: the library's pair as it is; a gated expert's
        [R, 2F] side by side; an ungated expert's [R, F] twice (the kernels read no u then)."""
        if isinstance(pre, tuple):
            return pre
        return (pre[:, : self.ffn], pre[:, self.ffn :]) if self.gated else (pre, pre)

    @property
    def expert_ends(self) -> Tensor:
        """[L] int32 on the device: where each local expert's received rows end (the layout's words,
        the groups' offsets for ``torch._grouped_mm``)."""
        start = self.buffer.layout_offsets.expert_start
        return self.buffer.layout[start + 1 : start + 1 + self.num_local]

    def _elementwise(
        self, kernel, leading: tuple[Tensor, ...], z: Tensor, u: Tensor, trailing: tuple[Tensor, ...], **constants
    ):
        """One launch of ``kernel(*leading, z, u, z's row stride, *trailing, ...)``, an elementwise
        kernel of ``kernels.triton_activation``, over [R, F] blocks. ``z`` and ``u`` ([R, F]) are two
        tensors or the halves of one [R, 2F] (``u`` is ``z`` where the kernel reads no up products);
        the others are contiguous. The kernel stops at the rows received this call (a layout word)."""
        from .triton_gemm import ACTIVATION_CODES

        dense = leading + trailing
        rows = min(t.shape[0] for t in (z, u) + dense)
        block_m, block_n, warps = ELEMENTWISE_BLOCK
        if rows == 0:
            return
        # The kernels index rows by these strides: F or 2F for dense tensors, z's for z and u.
        if (
            z.shape[1] != self.ffn
            or u.shape[1] != self.ffn
            or z.stride() != u.stride()
            or z.stride(1) != 1
            or not all(t.is_contiguous() for t in dense)
        ):
            raise RuntimeError(
                f"ds_comet: the first layer's elementwise kernel needs [R, {self.ffn}] z and u of one "
                f"row stride and contiguous rows otherwise, got z {list(z.shape)} {z.stride()}, u "
                f"{list(u.shape)} {u.stride()}, others {[t.stride() for t in dense]}"
            )
        received = self.buffer.layout_offsets.totals + TOTAL_RECV_ROWS
        kernel[(-(-rows // block_m), -(-self.ffn // block_n))](
            *leading,
            z,
            u,
            z.stride(0),
            *trailing,
            self.buffer.layout[received : received + 1],
            self.ffn,
            ACTIVATION=ACTIVATION_CODES[self.activation],
            BM=block_m,
            BN=block_n,
            num_warps=warps,
            **constants,
        )

    def gemm2(self, rows: Tensor, out: Tensor, backward: bool):
        """GEMM2 on ``rows`` (the activations [R, F], or the backward's first-layer gradients [R, F] or
        [R, 2F]) into ``out`` ([R, H], by recv row), column chunk by column chunk, each finished row
        counted for the combine (here for this rank's routes, on a reduce counter for the others'),
        by the implementation the table gives ``Phase.GEMM2`` (``Phase.GEMM2_BACKWARD``)."""
        if out.shape != (rows.shape[0], self.hidden) or not out.is_contiguous():  # the combine reads [R, H] rows
            raise ValueError(
                f"GEMM2's output must be a contiguous [{rows.shape[0]}, {self.hidden}] tensor, got "
                f"{list(out.shape)} with strides {out.stride()}"
            )
        if backward:
            self.implementation(Phase.GEMM2_BACKWARD).gemm2_backward(self, rows, out)
        else:
            self.implementation(Phase.GEMM2).gemm2(self, rows, out)

    def wgrad(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor | None]:
        """Per local expert l: a[rows of l]^T @ b[rows of l] ([L, M, N], by the implementation the table
        gives ``Phase.WEIGHT_GRADIENTS``) and, when the experts have biases, a's column sums over those
        rows ([L, M] in a's dtype).

        ``a`` ([R, M]) and ``b`` ([R, N]) are row-major, their rows grouped by local expert as in
        the receive buffer (either may be a column slice of a wider tensor).
        """
        weight = self.implementation(Phase.WEIGHT_GRADIENTS).weight_gradients(self, a, b)
        if not self.has_bias:
            return weight, None
        from .triton_gemm import expert_column_sums_kernel  # triton is an extra

        # The bias gradients read a once more at memory speed: 1.0-1.75x faster than a library
        # product of a row of ones with a (docs/decisions.md).
        num_local, M = self.num_local, a.shape[1]
        sums = torch.empty((num_local, M), dtype=a.dtype, device=a.device)
        block_r, block_m, warps = COLUMN_SUMS_BLOCK
        expert_column_sums_kernel[(-(-M // block_m), num_local)](
            a,
            a.stride(0),
            sums,
            self.buffer.layout,
            self.buffer.layout_offsets.expert_start,
            M,
            BR=block_r,
            BM=block_m,
            num_warps=warps,
        )
        return weight, sums
