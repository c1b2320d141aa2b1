"""The fused dispatch's checks of a recv tensor of the caller's, made before anything is launched, and
what the launches pass the op (the launches themselves need a GPU: tests/gpu/test_fused.py)."""

from types import SimpleNamespace

import pytest
import torch

from ds_comet import fp8
from ds_comet.kernels.constants import HEADER_WORDS
from ds_comet.kernels.fp8_rows import PACKED_DTYPE, packed_row_bytes
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


@pytest.mark.parametrize(
    "rows, packed_format",
    [
        (torch.zeros(4, 144, dtype=torch.uint8), None),  # packed rows of 128 values, format unsaid
        (torch.randn(4, 16), fp8.E4M3),  # rows of the tokens' dtype, with a format
    ],
    ids=["packed-without-format", "format-without-packed"],
)
def test_the_dispatch_takes_a_format_for_packed_fp8_rows_and_for_them_only(rows, packed_format):
    with pytest.raises(ValueError, match="packed FP8 rows .* are dispatched with their values' format"):
        kernels_of_group(2).dispatch(rows, plan=None, gates=None, scale_rows=True, packed_format=packed_format)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda fmt: fmt.name)
def test_the_dispatch_names_the_format_of_packed_rows_to_the_op(fmt):
    """The backward's output gradients under "gradient_dispatch": "fp8" go scaled and dotted with the
    outputs, and the op is told their values' format (the forward's rows are e4m3); rows of the tokens'
    dtype go with none (alone in the group: the launch is on the caller's stream)."""
    kernels, op = recording_kernels(ep_size=1)
    plan = routing_plan()
    gates, outputs = torch.rand(SHAPE.top_k, plan.num_tokens), torch.empty(8, 128, dtype=torch.bfloat16)
    packed = torch.zeros(plan.num_tokens, packed_row_bytes(128), dtype=PACKED_DTYPE)
    kernels.dispatch(packed, plan, gates, scale_rows=True, outputs=outputs, packed_format=fmt)
    kernels.dispatch(torch.randn(plan.num_tokens, SHAPE.hidden), plan, gates, scale_rows=True)
    (_, packed_launch), (_, plain_launch) = [call for call in op.calls if call[0] == "dispatch"]
    assert packed_launch["tokens"] is packed and packed_launch["outputs"] is outputs
    assert (packed_launch["packed_format"], packed_launch["scaled"]) == (fmt.name, True)
    assert plain_launch["packed_format"] == ""
