"""The fused dispatch's checks of a recv tensor of the caller's, made before anything is launched, and
what the launches pass the op (the launches themselves need a GPU: tests/gpu/test_fused.py)."""

from types import SimpleNamespace

import pytest
import torch

from ds_comet.kernels.constants import HEADER_WORDS
from ds_comet.kernels.launch import FusedKernels
from tests.support.op_calls import SHAPE, recording_kernels, routing_plan


def kernels_of_group(ep_size: int) -> FusedKernels:
    """FusedKernels whose workspace only answers its group's size: any launch would fail."""
    buffer = SimpleNamespace(shape=SimpleNamespace(ep_size=ep_size))
    return FusedKernels(buffer=buffer, experts=None, params=None, tables={}, hidden=16)


def test_a_rank_with_peers_refuses_a_recv_tensor_of_its_own():
    tokens = torch.randn(4, 16)
    with pytest.raises(ValueError, match="peers' recv buffers"):
        kernels_of_group(2).dispatch(tokens, plan=None, gates=None, scale_rows=False, recv=torch.empty(8, 16))


@pytest.mark.parametrize(
    "recv, named",
    [
        (torch.empty(8, 24), r"\[8, 24\]"),
        (torch.empty(16, 8).t(), r"\[8, 16\]"),
        (torch.empty(8, 16, dtype=torch.float64), "torch.float64"),
        (torch.empty(8, 1, 16), r"\[8, 1, 16\]"),
    ],
)
def test_a_rank_alone_refuses_a_recv_tensor_the_kernel_cannot_write(recv, named):
    tokens = torch.randn(4, 16)
    with pytest.raises(ValueError, match=f"recv must be a contiguous \\[R, 16\\] torch.float32 tensor.*got.*{named}"):
        kernels_of_group(1).dispatch(tokens, plan=None, gates=None, scale_rows=False, recv=recv)


def test_a_rank_alone_dispatches_into_its_recv_tensor_through_a_workspace_that_names_it():
    kernels, op = recording_kernels(ep_size=1)
    plan = routing_plan()
    recv = torch.empty(8, SHAPE.hidden)
    kernels.dispatch(torch.randn(plan.num_tokens, SHAPE.hidden), plan, gates=None, scale_rows=False, recv=recv)
    (replace, replaced), (dispatch, launched) = op.calls[-2:]
    assert (replace, dispatch) == ("Workspace.with_peer_recv", "dispatch")
    assert replaced["peer_recv"].tolist() == [recv.data_ptr()]
    assert launched["workspace"] is not kernels.buffer.kernel_workspace
    assert launched["blocks"] == kernels.buffer.num_sms  # alone: on every SM


def test_launches_take_the_workspace_the_buffer_built():
    kernels, op = recording_kernels()
    plan = routing_plan()
    kernels.exchange(plan, row_limit=5, header=[0] * HEADER_WORDS)
    kernels.send(torch.randn(plan.num_tokens, SHAPE.hidden), plan, None, False, None, blocks=3)
    kernels.reduce(plan, torch.empty(0, SHAPE.hidden), None, torch.empty(plan.num_tokens, SHAPE.hidden), None, 3)
    workspace = kernels.buffer.kernel_workspace
    assert [(function, keywords["workspace"] is workspace) for function, keywords in op.calls[1:]] == [
        ("exchange", True),
        ("dispatch", True),
        ("combine", True),
    ]
    assert kernels.buffer.kernel_shape.max_recv_rows == 5  # the exchange's bound of received rows
