"""Sequences of different lengths in one pass, right-padded: which rows share a pass, and the mask that keeps
each row to its own tokens. The target's prefill and a drafter's first read of a prompt both use them."""

from __future__ import annotations

import torch

from .tree import additive_mask


def prefill_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Rows prefilled in one pass together: longest first, a group grows while its padding stays within `waste`
    of its real tokens (one long prompt would otherwise make every row of the batch compute its length)."""
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= (1 + waste) * (
            sum(lengths[r] for r in groups[-1]) + lengths[row]
        ):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def right_padded_mask(lengths: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, width, width] additive mask for rows of lengths[b] tokens padded on the right to `width`, nothing
    cached before them: causal within each row; a padding position sees only itself (never a row of nothing)."""
    index = torch.arange(width, device=lengths.device)
    real = index[None, :] < lengths[:, None]  # [B, width]
    allowed = (index[None, :, None] >= index[None, None, :]) & real[:, None, :] & real[:, :, None]
    allowed |= torch.eye(width, dtype=torch.bool, device=lengths.device)[None]
    return additive_mask(allowed, dtype)[:, None]
