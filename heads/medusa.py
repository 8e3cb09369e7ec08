"""Medusa-1 heads: K residual blocks on the target's last hidden state, projected by the target's lm_head
(restricted to a draft vocabulary when the config has one: heads.vocab), or by an lm_head per head
(`own_lm_heads`, as FasterDecoding's Medusa trains them).

With `sequential` (Hydra's sequentially dependent heads), head d first reads head d-1's feature (head 0: the
target's) together with the embedding of the token one place before its own (head 0: the root, the target's
next token), then its residual blocks: head d's guess depends on the path drafted above it."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaModel

from .config import LayerShape, MedusaConfig
from .eagle import decoder_config
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


class TokenReader(nn.Module):
    """x + SiLU(W [x; e]): a sequential head's first block, reading the embedding e of the token before its own.
    W starts at zero, as a residual block's does."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(2 * hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(torch.cat([x, token_embedding], dim=-1)))


class PrefixLayer(nn.Module):
    """One Hugging Face Llama decoder layer (no norm after it) over the target's last hidden states. Its output
    projections start at zero, so a new layer passes the states through as they are: heads it is added to compute
    what they did, and training only has to learn what the context adds."""

    def __init__(self, hidden_size: int, shape: LayerShape):
        super().__init__()
        self.decoder = LlamaModel(decoder_config(hidden_size, shape, 1))
        self.decoder.embed_tokens.requires_grad_(False)  # unused (inputs come as states); DDP wants no idle trainables
        self.decoder.norm = nn.Identity()
        nn.init.zeros_(self.decoder.layers[0].self_attn.o_proj.weight)
        nn.init.zeros_(self.decoder.layers[0].mlp.down_proj.weight)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, cache=None):
        """[B, T, H] states at `position_ids` [B, T] -> [B, T, H]; `attention_mask` additive [B, 1, T, cached + T] or
        None (causal); `cache` holds the states read before."""
        out = self.decoder(
            inputs_embeds=hidden,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        blocks = (
            config.num_layers - 1 if config.sequential else config.num_layers
        )  # a sequential head's reader is its first block
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(blocks))) for _ in range(config.num_heads)
        )
        self.readers = (
            nn.ModuleList(TokenReader(config.hidden_size) for _ in range(config.num_heads))
            if config.sequential
            else None
        )
        self.prefix = None if config.prefix_layer is None else PrefixLayer(config.hidden_size, config.prefix_layer)
        # the target's token ids the heads draft from (set by training), saved with the weights
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)
        self.lm_heads = None
        if config.own_lm_heads:
            self.lm_heads = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )

    def forward(
        self, hidden: torch.Tensor, token_embeddings: torch.Tensor | None = None, at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[..., H] -> each head's feature [..., K, H]; callers project them, all heads in ONE call.

        Sequential heads also take `token_embeddings` [..., D, H], the embeddings of the D <= K tokens after the
        one `hidden` produced (the root first), and return the first D heads' features [..., D, H].

        With `at` [N, 2] (row, position), `hidden` is whole right-padded texts [B, T, H], which a prefix layer
        reads first (causally), and the heads run at those N positions (training). Drafting reads the prefix
        layer through its cache instead (inference.drafters.medusa), then runs the heads a level at a time (`step`).
        """
        if at is not None:
            if self.prefix is not None:
                positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
                hidden = self.prefix(hidden, positions)
            hidden = hidden[at[:, 0], at[:, 1]]
        elif self.prefix is not None:
            raise ValueError("Medusa heads with a prefix layer read whole texts: pass at=[N, 2] positions")
        if self.readers is None:
            if token_embeddings is not None:
                raise ValueError("these Medusa heads are not sequential: they read no token embeddings")
            return torch.stack([head(hidden) for head in self.heads], dim=-2)
        if token_embeddings is None or not 1 <= token_embeddings.shape[-2] <= self.config.num_heads:
            raise ValueError(
                f"sequential Medusa heads need the embeddings of 1 to {self.config.num_heads} tokens, [..., D, H]"
            )
        features = []
        for depth in range(token_embeddings.shape[-2]):
            hidden = self.step(depth, hidden, token_embeddings[..., depth, :])
            features.append(hidden)
        return torch.stack(features, dim=-2)

    def step(self, depth: int, previous: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """Sequential head `depth` alone: the feature that drafts depth + 1 from head depth-1's feature (depth 0: the
        target's) and the embedding of the token its node drafts at `depth` (depth 0: the root)."""
        return self.heads[depth](self.readers[depth](previous, token_embedding))

    def draft_logits(self, features: torch.Tensor, vocab: DraftVocabulary) -> torch.Tensor:
        """The first heads' features [..., d, H] -> their logits [..., d, N]: through `vocab` (the target's
        lm_head), or each through its own lm_head."""
        if self.lm_heads is None:
            return vocab.logits(features)
        return torch.stack(
            [lm_head(features[..., i, :]) for i, lm_head in enumerate(self.lm_heads[: features.shape[-2]])], dim=-2
        )
