"""Host -> device copies that never make the host wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA device makes the calling thread wait
until the target stream has finished its earlier work; the scheduler issues token2wav work on
a side stream while the LM decodes, so such a wait would stall LM decoding for a whole flow
solve. :func:`to_device` stages through page-locked memory and copies asynchronously instead.
"""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` on ``device`` (same dtype); CPU -> CUDA through pinned memory, asynchronously on the
    current stream (the pinned staging buffer is kept alive by the caching host allocator until the
    copy is done). Other moves are plain ``x.to(device)``; ``x`` itself if already there."""
    device = torch.device(device)
    if x.device == device:
        return x
    if x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
