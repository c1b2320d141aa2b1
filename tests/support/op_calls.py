"""The fused pipeline's calls of the CUDA op, recorded without a GPU: what ``CometBuffer`` and
``FusedKernels`` pass to the op's ``Workspace``, exchange, dispatch and combine
(tests/cpu/test_op_builder.py checks the keywords against the compiled binding's,
tests/cpu/test_fused_dispatch_args.py some of the values)."""

import dataclasses
from types import SimpleNamespace

import torch

from ds_comet.kernels.constants import HEADER_WORDS
from ds_comet.kernels.launch import FusedKernels
from ds_comet.kernels.routing_plan import RoutingPlan
from ds_comet.kernels.workspace import BufferShape, CometBuffer, symmetric_parts
from ds_comet.pipelines.routing import plan_routes

SHAPE = BufferShape(
    ep_size=2, num_experts=4, hidden=16, dtype=torch.float32, max_tokens=4, max_recv_rows=16, top_k=2, tile_m=8
)


class RecordingOp:
    """Stands in for the op: records each call of one of its functions as (function, keywords) in
    ``calls`` and returns a ``RecordedWorkspace``; a positional argument fails the call."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def __getattr__(self, function: str):
        def record(*args, **keywords):
            assert not args, f"{function} got {len(args)} positional arguments"
            self.calls.append((function, keywords))
            return RecordedWorkspace(self)

        return record


class RecordedWorkspace:
    """Stands in for the op's ``Workspace``: its ``with_peer_recv`` is recorded on the op too."""

    def __init__(self, op: RecordingOp):
        self.op = op

    def with_peer_recv(self, *args, **keywords):
        assert not args, f"with_peer_recv got {len(args)} positional arguments"
        self.op.calls.append(("Workspace.with_peer_recv", keywords))
        return RecordedWorkspace(self.op)


def recording_kernels(ep_size: int = SHAPE.ep_size) -> tuple[FusedKernels, RecordingOp]:
    """FusedKernels for a group of ``ep_size`` ranks, and the recording op its launches call. Its
    workspace is built as ``CometBuffer`` builds it, from small CPU stand-ins: nothing is allocated."""
    op = RecordingOp()
    shape = dataclasses.replace(SHAPE, ep_size=ep_size)
    workspace = CometBuffer.__new__(CometBuffer)
    workspace.op = op
    for name in ("meta", "row_dot", "stage_routes", "stage_scale", "layout", "route_row", "route_stage"):
        setattr(workspace, name, torch.zeros(1))
    workspace.error_record = torch.zeros(8, dtype=torch.int64)
    peer_tables = {name: torch.zeros(ep_size, dtype=torch.int64) for name, _, _ in symmetric_parts(shape, 1)}
    buffer = SimpleNamespace(
        op=op,
        shape=shape,
        kernel_shape=SimpleNamespace(),
        kernel_workspace=workspace._kernel_workspace(peer_tables),
        none=torch.empty(0),
        num_sms=4,
        exchanges=0,
    )
    params = SimpleNamespace(tile_n=8, n_chunks=2)
    return FusedKernels(buffer=buffer, experts=None, params=params, tables={}, hidden=shape.hidden), op


def routing_plan() -> RoutingPlan:
    """A plan of 4 tokens, 2 routes each, over SHAPE's experts."""
    plan = plan_routes(torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]], dtype=torch.int32), SHAPE.num_experts)
    return dataclasses.replace(
        plan,
        rank_tokens=torch.zeros(SHAPE.ep_size, plan.num_tokens, dtype=torch.int32),
        rank_token_counts=torch.zeros(SHAPE.ep_size, dtype=torch.int64),
    )


def launch_keywords() -> dict[str, set[str]]:
    """The keywords each op function gets from the fused pipeline: the workspace's construction, an
    exchange, a dispatch launch into a recv table of the caller's, and a combine launch."""
    kernels, op = recording_kernels()
    plan = routing_plan()
    rows, gates = torch.randn(plan.num_tokens, SHAPE.hidden), torch.rand(SHAPE.top_k, plan.num_tokens)
    kernels.exchange(plan, SHAPE.max_recv_rows, [0] * HEADER_WORDS)
    kernels.send(rows, plan, gates, False, None, blocks=2, recv_table=torch.zeros(SHAPE.ep_size, dtype=torch.int64))
    kernels.reduce(plan, torch.empty(0, SHAPE.hidden), gates, torch.empty_like(rows), None, blocks=2)
    called = {function for function, _ in op.calls}
    assert called == {"Workspace", "exchange", "Workspace.with_peer_recv", "dispatch", "combine"}, called
    return {function: set(keywords) for function, keywords in op.calls}
