"""Medusa-1 heads: K residual blocks on the target's last hidden state, projected by the target's lm_head
(restricted to a draft vocabulary when the config has one: heads.vocab), or by an lm_head per head
(`own_lm_heads`, as FasterDecoding's Medusa trains them)."""

from __future__ import annotations

import torch
from torch import nn

from .config import MedusaConfig
from .vocab import DraftVocabulary


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
        self.heads = nn.ModuleList(nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(config.num_layers))) for _ in range(config.num_heads))
        # the target's token ids the heads draft from (set by training), saved with the weights
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)
        self.lm_heads = None
        if config.own_lm_heads:
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> each head's feature [..., K, H]; callers project them, all heads in ONE call."""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def draft_logits(self, features: torch.Tensor, vocab: DraftVocabulary) -> torch.Tensor:
        """The first heads' features [..., d, H] -> their logits [..., d, N]: through `vocab` (the target's
        lm_head), or each through its own lm_head."""
        if self.lm_heads is None:
            return vocab.logits(features)
        return torch.stack([lm_head(features[..., i, :]) for i, lm_head in enumerate(self.lm_heads[: features.shape[-2]])], dim=-2)
