"""Medusa-1 heads: K residual blocks on the target's last hidden state, one shared lm_head projection."""

from __future__ import annotations

import torch
from torch import nn

from .config import MedusaConfig


class ResidualBlock(nn.Module):
    """x + SiLU(W x). W starts at zero, so an untrained head predicts what the target's lm_head does."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """[..., H] -> logits [..., K, V], all heads through the target's lm_head in ONE projection;
        without lm_head, the heads' features [..., K, H] (training projects only where labels are)."""
        features = torch.stack([head(hidden) for head in self.heads], dim=-2)
        return features if lm_head is None else lm_head(features)
