"""The fused dispatch's checks of a recv tensor of the caller's, made before anything is launched
(the launches themselves need a GPU: tests/gpu/test_fused.py)."""

from types import SimpleNamespace

import pytest
import torch

from ds_comet.kernels.launch import FusedKernels


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
