"""EAGLE head: decoder layers (EAGLE's choice: one) over fc(cat(embedding of the next token, target feature)).

The decoder is a Hugging Face `LlamaModel` of `config.num_layers` layers (EAGLE's choice of layer, whatever the target's
family), driven with `inputs_embeds`, explicit positions, a 4D tree mask and its own `DynamicCache`: the same
machinery the target is driven with, and no copied modeling code.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from .config import EagleConfig

NO_COPY = -1  # no earlier occurrence of the bigram: the copy input is a zero vector


def copy_tokens(ids: Sequence[int], start: int = 0, end: int | None = None, successors: MutableMapping | None = None) -> list[int]:
    """For each pair position t in [start, end) (the head reads token t's feature and token t + 1 there): the
    token that followed the latest earlier occurrence of the bigram (ids[t], ids[t + 1]), or NO_COPY.

    `successors` maps each bigram seen at positions before `start` to the token after it; it is updated, so
    a caller that reads a sequence piece by piece (the drafter) passes the same mapping every time.
    """
    successors = {} if successors is None else successors
    end = len(ids) - 1 if end is None else end
    copies = []
    for t in range(start, end):
        if t >= 1:  # the bigram one position back has a known successor now: ids[t + 1]
            successors[(ids[t - 1], ids[t])] = ids[t + 1]
        copies.append(successors.get((ids[t], ids[t + 1]), NO_COPY))
    return copies


def copy_embedding(embed: nn.Module, copies: torch.Tensor) -> torch.Tensor:
    """The target's embeddings of the copy tokens, zero where there is none."""
    found = copies != NO_COPY
    return embed(copies.clamp(min=0)) * found[..., None].to(embed.weight.dtype)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        n_features = len(config.feature_layers)
        # EAGLE-3 fuses low/mid/high target layers into one feature; EAGLE-1 uses the last layer as it is.
        self.fuse, self.feature_norms = None, None
        if n_features > 1:
            self.fuse = nn.Linear(n_features * hidden, hidden, bias=False)
            # -1, the final hidden state, comes out of the target's final norm; the others are the raw residual
            # stream, whose scale grows with depth (SmolLM2-135M: rms 10 at layer 3, 250 at layer 15, one dimension
            # above 20,000), so they are RMS-normalised before fusing or they swamp the fuse layer and its updates.
            self.feature_norms = nn.ModuleList(nn.Identity() if layer == -1 else nn.RMSNorm(hidden, eps=config.rms_norm_eps) for layer in config.feature_layers)
        self.fc = nn.Linear((3 if config.copy_input else 2) * hidden, hidden)
        self.decoder = LlamaModel(
            LlamaConfig(
                vocab_size=1,  # inputs come as embeddings; the token table stays the target's
                hidden_size=hidden,
                intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                rms_norm_eps=config.rms_norm_eps,
                max_position_embeddings=config.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                bos_token_id=None,
                eos_token_id=None,
                attn_implementation="sdpa",
            )
        )
        self.decoder.embed_tokens.requires_grad_(False)  # unused (inputs come as embeddings); DDP wants no idle trainables
        # the target's token ids the head drafts from (set by training), saved with the weights
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)

    def fuse_features(self, feature: torch.Tensor) -> torch.Tensor:
        """The target's hidden states at `config.feature_layers`, concatenated [..., n * H] -> one feature [..., H]."""
        if self.fuse is None:
            return feature
        layers = feature.split(self.config.hidden_size, dim=-1)
        return self.fuse(torch.cat([norm(layer) for norm, layer in zip(self.feature_norms, layers)], dim=-1))

    def forward(
        self,
        feature: torch.Tensor,
        token_embedding: torch.Tensor,
        copy_embedding: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """(feature of token t, embedding of token t+1) -> predicted feature of token t+1, [B, T, H].

        `feature` is the head's own output fed back [B, T, H], or the target's hidden states at
        `config.feature_layers` concatenated [B, T, n * H], which are fused first (EAGLE-3). With
        `config.copy_input`, `copy_embedding` [B, T, H] is `copy_embedding(embed, copy_tokens(...))`.
        """
        if feature.shape[-1] != self.config.hidden_size:
            feature = self.fuse_features(feature)
        if self.config.copy_input != (copy_embedding is not None):
            needs = "needs" if self.config.copy_input else "takes no"
            raise ValueError(f"this EAGLE head {needs} copy_embedding (config.copy_input is {self.config.copy_input})")
        inputs = [token_embedding, feature] + ([copy_embedding] if self.config.copy_input else [])
        x = self.fc(torch.cat(inputs, dim=-1))
        out = self.decoder(
            inputs_embeds=x,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state
