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


def read_together(*tensors: torch.Tensor) -> list:
    """The tensors' values in ONE host read, each as nested lists of floats shaped as it is (a number for a 0-dim
    tensor). float64 holds every integer below 2**53, so token ids and indices come back exact."""
    values = torch.cat([tensor.reshape(-1).double() for tensor in tensors]).tolist()
    out, start = [], 0
    for tensor in tensors:
        flat, start = values[start : start + tensor.numel()], start + tensor.numel()
        for size in reversed(tensor.shape[1:]):
            flat = [flat[i : i + size] for i in range(0, len(flat), size)]
        out.append(flat if tensor.dim() else flat[0])
    return out
