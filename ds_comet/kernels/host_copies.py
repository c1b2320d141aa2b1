"""Host tensors to the device without a host sync, for the launches and the pipelines alike.

A copy from pageable host memory waits for the work queued on the stream before it (torch copies
it synchronously); one from pinned memory is queued like a kernel. The fused path reads nothing
back and waits for nothing, so the small tables it builds on the host go through pinned memory.
"""

import torch
from torch import Tensor


def host_to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (on the host) on ``device``, queued on the current stream without waiting for it:
    through pinned memory on CUDA (torch's pinned-memory allocator keeps the host copy alive until
    the transfer is done)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
