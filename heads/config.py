"""Typed configs for draft heads and the fingerprint of the target model they were fitted on.

Everything here is saved into a checkpoint's `config.json`; loading refuses unknown keys so that a typo
or a checkpoint from another tool fails loudly instead of being half-read.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch


class HeadConfigError(ValueError):
    """A head config or checkpoint that cannot be used as it is."""


def dataclass_from_dict(cls, data: dict[str, Any], where: str):
    """Build dataclass `cls` from `data`, naming unknown or missing keys in the error."""
    if not isinstance(data, dict):
        raise HeadConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise HeadConfigError(f"{where}: unknown key(s) {unknown}; allowed keys are {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as error:  # a required field is missing
        raise HeadConfigError(f"{where}: {error}") from None


@dataclass
class MedusaConfig:
    """K residual blocks on the target's last hidden state; head i predicts the token i+1 steps past the next."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int | None = None  # draft from the N most frequent tokens only (heads.vocab); None = all
    # accuracy[head][rank] measured on held-out data after training: a static tree can be fitted to it
    # (inference.best_static_paths(15, rank_accuracy), Medusa's sparse tree)
    rank_accuracy: list[list[float]] | None = None
    kind: str = "medusa"

    def __post_init__(self):
        if self.kind != "medusa":
            raise HeadConfigError(f"MedusaConfig.kind must be 'medusa', got {self.kind!r}")
        _check_draft_vocab(self)
        if self.num_heads < 1 or self.num_layers < 1:
            raise HeadConfigError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {self.num_heads}, {self.num_layers}")
        if self.rank_accuracy is not None and (
            len(self.rank_accuracy) != self.num_heads
            or not all(row and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in row) for row in self.rank_accuracy)
        ):
            raise HeadConfigError(f"rank_accuracy must hold one row of accuracies in [0, 1] per head ({self.num_heads}), got {self.rank_accuracy!r}")

    @classmethod
    def for_target(cls, target_config, **overrides) -> "MedusaConfig":
        return cls(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size, **overrides)


@dataclass
class EagleConfig:
    """`num_layers` decoder layers (EAGLE's choice: one) over fc(cat(embedding of the next token, target feature)).

    `feature_layers` are indices into the target's `hidden_states` tuple (0 = embeddings, -1 = the final,
    normalised hidden state). One index is EAGLE-1; several (low, mid, high) are fused EAGLE-3 style.
    `copy_input` adds a third input: the embedding of the token that followed the latest earlier occurrence of
    the current bigram (what prompt lookup would copy; heads.eagle.copy_tokens), so the head only has to learn
    when the target copies, not how to find what it copies (one attention layer cannot match a token against
    earlier positions and then read the one after).
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: list[int] = field(default_factory=lambda: [-1])
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    draft_vocab_size: int | None = None  # draft from the N most frequent tokens only (heads.vocab); None = all
    copy_input: bool = False
    kind: str = "eagle"

    def __post_init__(self):
        if not isinstance(self.copy_input, bool):
            raise HeadConfigError(f"EagleConfig.copy_input must be true or false, got {self.copy_input!r}")
        if self.kind != "eagle":
            raise HeadConfigError(f"EagleConfig.kind must be 'eagle', got {self.kind!r}")
        _check_draft_vocab(self)
        self.feature_layers = list(self.feature_layers)
        if not self.feature_layers:
            raise HeadConfigError("EagleConfig.feature_layers must name at least one target layer")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise HeadConfigError(f"EagleConfig.num_layers must be a whole number >= 1, got {self.num_layers!r}")

    @classmethod
    def for_target(cls, target_config, **overrides) -> "EagleConfig":
        """A head shaped like one layer of the target (EAGLE's choice)."""
        heads = target_config.num_attention_heads
        values = dict(
            hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=getattr(target_config, "intermediate_size", None) or 4 * target_config.hidden_size,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(target_config),
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
        )
        values.update(overrides)
        return cls(**values)


def _check_draft_vocab(config) -> None:
    n = config.draft_vocab_size
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= config.vocab_size):
        raise HeadConfigError(f"draft_vocab_size must be a whole number from 1 to the vocabulary size {config.vocab_size}, or null; got {n!r}")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


HEAD_CONFIGS = {"medusa": MedusaConfig, "eagle": EagleConfig}


def head_config_from_dict(data: dict[str, Any]):
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in HEAD_CONFIGS:
        raise HeadConfigError(f"head config: 'kind' must be one of {sorted(HEAD_CONFIGS)}, got {kind!r}")
    return dataclass_from_dict(HEAD_CONFIGS[kind], data, f"head config ({kind})")


@dataclass
class TargetFingerprint:
    """What a head checkpoint remembers of the model it was fitted on.

    The hash covers a strided sample of the input embedding and output projection rows, rounded to
    bfloat16 so that the same weights loaded in float32 or bfloat16 give the same fingerprint.
    """

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    weights_sha256: str

    @classmethod
    def of(cls, model) -> "TargetFingerprint":
        config = model.config
        return cls(
            name=str(getattr(config, "_name_or_path", "") or config.model_type),
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_hidden_layers=config.num_hidden_layers,
            weights_sha256=_weights_hash(model),
        )

    def mismatch(self, other: "TargetFingerprint") -> str | None:
        """Why `other` is not the model these heads were fitted on, or None when it is."""
        for key in ("hidden_size", "vocab_size", "weights_sha256"):
            if getattr(self, key) != getattr(other, key):
                return f"{key} differs ({getattr(self, key)} vs {getattr(other, key)})"
        return None


@torch.no_grad()
def _weights_hash(model, rows: int = 64) -> str:
    digest = hashlib.sha256()
    for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        stride = max(1, matrix.shape[0] // rows)
        sample = matrix[::stride][:rows].detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
