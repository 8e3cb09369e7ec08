"""EAGLE head: decoder layers (EAGLE's choice: one) over fc(cat(embedding of the next token, target feature)).

The decoder is a Hugging Face `LlamaModel` of `config.num_layers` layers (EAGLE's choice of layer, whatever the target's
family), driven with `inputs_embeds`, explicit positions, a 4D tree mask and its own `DynamicCache`: the same
machinery the target is driven with, and no copied modeling code. Two published layouts are built from the same
Hugging Face parts (`EagleConfig.architecture`), so heads trained elsewhere run here exactly as their authors'
code runs them (heads.formats reads and writes their files):
- "eagle1" (SafeAILab EAGLE-1/2): the decoder layer without its input norm and without a final norm;
- "eagle3" (SafeAILab EAGLE-3, SpecForge, speculators, vLLM): `Eagle3Layer`, then a norm and an lm_head of its own.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .attention import GROUPED_SDPA
from .config import EagleConfig
from .vocab import DraftVocabulary

NO_COPY = -1  # no earlier occurrence of the bigram: the copy input is a zero vector


def copy_tokens(
    ids: Sequence[int], start: int = 0, end: int | None = None, successors: MutableMapping | None = None
) -> list[int]:
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


def causal_mask(new: int, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, new, past + new]: each new entry sees the cached ones and the new ones up to itself."""
    # entry i sees columns up to past + i: the columns masked are those at or above diagonal past + 1
    return torch.full((new, past + new), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(past + 1)[None, None]


def decoder_config(hidden_size: int, shape, num_layers: int) -> LlamaConfig:
    """A Llama decoder of `num_layers` layers shaped as `shape` says (an EagleConfig or a LayerShape), read through
    inputs_embeds: the token table stays the target's."""
    return LlamaConfig(
        vocab_size=1,
        hidden_size=hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation=GROUPED_SDPA,  # a tree of queries without copying keys and values per head
    )


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads [input_layernorm(embedding); hidden_norm(feature)] (2H wide) and
    its residual is the feature. Built from Hugging Face's Llama attention and MLP; only q/k/v are made 2H wide."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden = config.hidden_size
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self.self_attn, name, nn.Linear(2 * hidden, getattr(self.self_attn, name).out_features, bias=False))
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embedding, feature, position_embeddings, attention_mask, cache) -> torch.Tensor:
        both = torch.cat([self.input_layernorm(embedding), self.hidden_norm(feature)], dim=-1)
        attended, _ = self.self_attn(
            both, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache
        )
        hidden = feature + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        n_features = len(config.feature_layers)
        layer_config = decoder_config(hidden, config, config.num_layers)
        # EAGLE-3 fuses low/mid/high target layers into one feature; EAGLE-1 uses the last layer as it is.
        self.fuse, self.feature_norms = None, None
        if n_features > 1:
            self.fuse = nn.Linear(n_features * hidden, hidden, bias=False)
        if n_features > 1 and config.architecture == "specheads":
            # -1, the final hidden state, comes out of the target's final norm; the others are the raw residual
            # stream, whose scale grows with depth (SmolLM2-135M: rms 10 at layer 3, 250 at layer 15, one dimension
            # above 20,000), so they are RMS-normalised before fusing or they swamp the fuse layer and its updates.
            self.feature_norms = nn.ModuleList(
                nn.Identity() if layer == -1 else nn.RMSNorm(hidden, eps=config.rms_norm_eps)
                for layer in config.feature_layers
            )
        if config.architecture == "eagle3":
            self.layer = Eagle3Layer(layer_config)
            self.rotary = LlamaRotaryEmbedding(layer_config)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size or config.vocab_size, bias=False)
        else:
            self.fc = nn.Linear((3 if config.copy_input else 2) * hidden, hidden, bias=config.has_fc_bias)
            self.decoder = LlamaModel(layer_config)
            self.decoder.embed_tokens.requires_grad_(
                False
            )  # unused (inputs come as embeddings); DDP wants no idle trainables
            if config.architecture == "eagle1":  # fc's output goes into attention as it is, and out as it is
                self.decoder.layers[0].input_layernorm = nn.Identity()
                self.decoder.norm = nn.Identity()
        # the target's token ids the head drafts from (set by training), saved with the weights
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)

    def draft_vocabulary(self, lm_head: nn.Module) -> DraftVocabulary:
        """How the head's outputs become draft logits: through the target's `lm_head` (restricted to the draft
        vocabulary), or through the head's own norm and lm_head (eagle3)."""
        if self.config.architecture == "eagle3":
            return DraftVocabulary(
                self.lm_head, self.draft_ids, own_rows=True, target_size=self.config.vocab_size, norm=self.norm
            )
        return DraftVocabulary(lm_head, self.draft_ids)

    def fuse_features(self, feature: torch.Tensor, fuse=None) -> torch.Tensor:
        """The target's hidden states at `config.feature_layers`, concatenated [..., n * H] -> one feature [..., H].
        `fuse`: what computes `self.fuse`'s product instead of it (a drafter's packed copy: inference.packed)."""
        if self.fuse is None:
            return feature
        fuse = self.fuse if fuse is None else fuse
        if self.feature_norms is None:
            return fuse(feature)
        layers = feature.split(self.config.hidden_size, dim=-1)
        return fuse(torch.cat([norm(layer) for norm, layer in zip(self.feature_norms, layers)], dim=-1))

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
        `attention_mask` is additive, [B, 1, T, cached + T]; None means causal.
        """
        if feature.shape[-1] != self.config.hidden_size:
            feature = self.fuse_features(feature)
        if self.config.copy_input != (copy_embedding is not None):
            needs = "needs" if self.config.copy_input else "takes no"
            raise ValueError(f"this EAGLE head {needs} copy_embedding (config.copy_input is {self.config.copy_input})")
        if self.config.architecture == "eagle3":
            past = cache.get_seq_length() if cache is not None else 0
            if attention_mask is None:
                attention_mask = causal_mask(feature.shape[1], past, feature.dtype, feature.device)
            return self.layer(token_embedding, feature, self.rotary(feature, position_ids), attention_mask, cache)
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
