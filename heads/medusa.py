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

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K, H]: one feature per head."""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """[..., H] -> logits [..., K, V]; all heads go through the target's lm_head in ONE projection."""
        return lm_head(self.features(hidden))
