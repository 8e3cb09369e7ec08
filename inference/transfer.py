"""Host values copied to the device without making the host wait for it.

`torch.tensor(values, device="cuda")` copies synchronously: the host first waits for every kernel queued before it,
a synchronisation as costly as reading a value back. A copy from pinned memory with `non_blocking=True` is queued
behind those kernels instead, and PyTorch's caching host allocator does not reuse the pinned block until the copy
is done, so the values cannot change under it.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list of numbers, or a CPU tensor) as a tensor on `device`, copied without a synchronisation."""
    tensor = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)  # another accelerator: a plain copy
