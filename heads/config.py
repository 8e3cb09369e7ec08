"""Typed configs for draft heads and the fingerprint of the target model they were fitted on.

Everything here is saved into a checkpoint's `config.json`; loading refuses unknown keys so that a typo
or a checkpoint from another tool fails loudly instead of being half-read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
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


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


FIELD_TYPES = {  # annotation -> (check, what the error says it must be)
    "int": (_is_whole, "a whole number"),
    "float": (_is_number, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[int]": (lambda v: isinstance(v, (list, tuple)) and all(map(_is_whole, v)), "a list of whole numbers"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "list[float]": (lambda v: isinstance(v, list) and all(map(_is_number, v)), "a list of finite numbers"),
    "LayerShape": (lambda v: isinstance(v, LayerShape), "a decoder layer's shape (a mapping)"),
    "list[list[float]]": (
        lambda v: isinstance(v, list) and all(isinstance(r, list) and all(map(_is_number, r)) for r in v),
        "a list of lists of numbers",
    ),
}


def check_field_types(config, minimum_one: tuple[str, ...] = ()) -> None:
    """Every field holds what its annotation says (a config.json may say "64" or 0); `minimum_one` fields are >= 1."""
    for f in dataclasses.fields(config):
        value, annotation = getattr(config, f.name), str(f.type)
        if annotation.endswith(" | None"):
            if value is None:
                continue
            annotation = annotation.removesuffix(" | None")
        check, what = FIELD_TYPES[annotation]
        if not check(value):
            raise HeadConfigError(f"{type(config).__name__}.{f.name} must be {what}, got {value!r}")
        if annotation == "float":
            setattr(config, f.name, float(value))
    for name in minimum_one:
        if getattr(config, name) < 1:
            raise HeadConfigError(f"{type(config).__name__}.{name} must be >= 1, got {getattr(config, name)!r}")


@dataclass
class LayerShape:
    """One Llama-style decoder layer's shape, the target's by default: a Medusa prefix layer's."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        check_field_types(self, ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"))

    @classmethod
    def for_target(cls, target_config) -> LayerShape:
        heads = target_config.num_attention_heads
        return cls(
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=getattr(target_config, "intermediate_size", None) or 4 * target_config.hidden_size,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(target_config),
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
        )


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
    # each head projects with an lm_head of its own (FasterDecoding's Medusa trains one per head) instead of the
    # target's; for heads read from Medusa's files (heads.formats); training here shares the target's
    own_lm_heads: bool = False
    # Hydra's sequentially dependent heads: head d also reads head d-1's feature (head 0: the target's) and the
    # embedding of the token drafted before its own, so a candidate depends on the path above it; trees are
    # grown a level (one head) at a time. False: Medusa-1, every head from the target's feature alone.
    sequential: bool = False
    # [w0, w1, w2] of the map from the head's probability of a draft to the target's acceptance of it, fitted on
    # held-out prompts after training (scripts/fit_acceptance_map.py, inference.acceptance_map); None: as it is
    acceptance_map: list[float] | None = None
    # Hydra++'s prefix attention: one decoder layer of this shape (a training recipe says `true`: the target's)
    # reads the target's last hidden states of the whole committed text, and the heads start from its output
    # instead of the last state alone. Sequential heads only; it keeps a cache of its own (heads.medusa).
    prefix_layer: LayerShape | None = None
    kind: str = "medusa"

    def __post_init__(self):
        if self.kind != "medusa":
            raise HeadConfigError(f"MedusaConfig.kind must be 'medusa', got {self.kind!r}")
        if self.prefix_layer is True:
            raise HeadConfigError(
                "MedusaConfig.prefix_layer: true is a training recipe's word for the target's layer shape; a saved "
                "config holds the shape itself (num_attention_heads, ...)"
            )
        if isinstance(self.prefix_layer, dict):  # as config.json holds it
            self.prefix_layer = dataclass_from_dict(LayerShape, self.prefix_layer, "MedusaConfig.prefix_layer")
        check_field_types(self, ("hidden_size", "vocab_size", "num_heads", "num_layers"))
        _check_draft_vocab(self)
        _check_acceptance_map(self)
        if self.own_lm_heads and self.draft_vocab_size is not None:
            raise HeadConfigError(
                "MedusaConfig: heads with lm_heads of their own draft from the whole vocabulary: draft_vocab_size must "
                "be null"
            )
        if self.acceptance_map is not None and not self.sequential:
            raise HeadConfigError(
                "MedusaConfig.acceptance_map ranks the drafts of trees grown level by level, which only sequential "
                "heads grow: set sequential: true, or acceptance_map: null"
            )
        if self.prefix_layer is not None and not self.sequential:
            raise HeadConfigError(
                "MedusaConfig.prefix_layer feeds heads that grow trees level by level: set sequential: true, or "
                "prefix_layer: null"
            )
        if self.sequential and self.own_lm_heads:
            raise HeadConfigError(
                "MedusaConfig: own_lm_heads is for heads read from Medusa's files, which have no sequential heads: set "
                "one of them false"
            )
        if self.rank_accuracy is not None and (
            len(self.rank_accuracy) != self.num_heads
            or not all(
                row and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in row) for row in self.rank_accuracy
            )
        ):
            raise HeadConfigError(
                f"rank_accuracy must hold one row of accuracies in [0, 1] per head ({self.num_heads}), got "
                f"{self.rank_accuracy!r}"
            )

    @classmethod
    def for_target(cls, target_config, **overrides) -> MedusaConfig:
        return cls(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size, **overrides)


EAGLE_ARCHITECTURES = ("specheads", "eagle1", "eagle3")


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
    # "specheads": this project's layout. "eagle1": SafeAILab's EAGLE-1/2 (no norm before the layer or after it).
    # "eagle3": EAGLE-3 as SafeAILab, SpecForge, speculators and vLLM run it (heads.eagle.Eagle3Layer): the
    # raw target states fused without norms, attention over [embedding; feature], its own norm and lm_head.
    architecture: str = "specheads"
    fc_bias: bool | None = None  # the input layer's bias; None: yes, except in "eagle3" (which has none)
    # [w0, w1, w2] of the map from the head's probability of a draft to the target's acceptance of it, fitted on
    # held-out prompts after training (scripts/fit_acceptance_map.py, inference.acceptance_map); None: as it is
    acceptance_map: list[float] | None = None
    kind: str = "eagle"

    def __post_init__(self):
        if self.kind != "eagle":
            raise HeadConfigError(f"EagleConfig.kind must be 'eagle', got {self.kind!r}")
        if self.architecture not in EAGLE_ARCHITECTURES:
            raise HeadConfigError(
                f"EagleConfig.architecture must be one of {list(EAGLE_ARCHITECTURES)}, got {self.architecture!r}"
            )
        sizes = (
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_layers",
            "max_position_embeddings",
        )
        check_field_types(self, sizes)
        _check_draft_vocab(self)
        _check_acceptance_map(self)
        self.feature_layers = list(self.feature_layers)
        if not self.feature_layers:
            raise HeadConfigError("EagleConfig.feature_layers must name at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise HeadConfigError(
                f"EagleConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise HeadConfigError(
                f"EagleConfig.rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps} and {self.rope_theta}"
            )
        if self.architecture != "specheads" and self.copy_input:
            raise HeadConfigError(
                f"EagleConfig.copy_input is this project's input; the {self.architecture} architecture has none: set "
                "copy_input: false"
            )
        if self.architecture == "eagle1" and self.feature_layers != [-1]:
            raise HeadConfigError(
                "an eagle1 head reads the target's final hidden state alone: feature_layers must be [-1], got "
                f"{self.feature_layers}"
            )
        if self.architecture == "eagle3" and (len(self.feature_layers) < 2 or self.fc_bias is True):
            raise HeadConfigError(
                "an eagle3 head fuses several target layers without a bias (EAGLE-3: [2, L//2, L-3]); got "
                f"feature_layers {self.feature_layers} and fc_bias {self.fc_bias}"
            )

    @property
    def has_fc_bias(self) -> bool:
        return self.architecture != "eagle3" if self.fc_bias is None else self.fc_bias

    @classmethod
    def for_target(cls, target_config, **overrides) -> EagleConfig:
        """A head shaped like one layer of the target (EAGLE's choice)."""
        values = dict(
            hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            **dataclasses.asdict(LayerShape.for_target(target_config)),
        )
        values.update(overrides)
        return cls(**values)


@dataclass
class EarlyExitConfig:
    """The target's first `exit_layer` layers draft (heads.early_exit); a LoRA adapter of rank `lora_rank` on
    them (None: none, the untrained exit) adapts their exit to the last layer's predictions."""

    hidden_size: int
    vocab_size: int
    exit_layer: int
    lora_rank: int | None = 16
    lora_alpha: float = 32.0
    lora_targets: list[str] | None = None  # module names in each layer, e.g. [q_proj, v_proj]; None = every linear map
    draft_vocab_size: int | None = None  # draft from the N most frequent tokens only (heads.vocab); None = all
    # [w0, w1, w2] of the map from the head's probability of a draft to the target's acceptance of it, fitted on
    # held-out prompts after training (scripts/fit_acceptance_map.py, inference.acceptance_map); None: as it is
    acceptance_map: list[float] | None = None
    kind: str = "early_exit"

    def __post_init__(self):
        if self.kind != "early_exit":
            raise HeadConfigError(f"EarlyExitConfig.kind must be 'early_exit', got {self.kind!r}")
        check_field_types(self, ("hidden_size", "vocab_size", "exit_layer"))
        _check_draft_vocab(self)
        _check_acceptance_map(self)
        if self.lora_rank is not None and self.lora_rank < 1:
            raise HeadConfigError(
                f"EarlyExitConfig.lora_rank must be >= 1, or null for no adapter; got {self.lora_rank}"
            )

    @classmethod
    def for_target(cls, target_config, **overrides) -> EarlyExitConfig:
        """Exit after a quarter of the layers unless told otherwise."""
        values = dict(
            hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            exit_layer=max(1, target_config.num_hidden_layers // 4),
        )
        values.update(overrides)
        return cls(**values)


def check_feature_layers(config, target_config, what: str = "the head") -> None:
    """An EAGLE head reads the target's hidden_states tuple: the embeddings and every layer's output."""
    states = target_config.num_hidden_layers + 1
    bad = [layer for layer in getattr(config, "feature_layers", []) if not -states <= layer < states]
    if bad:
        raise HeadConfigError(
            f"{what} reads target layers {bad}, but the target has {states} hidden states (indices "
            f"{-states}..{states - 1})"
        )


def _check_draft_vocab(config) -> None:
    n = config.draft_vocab_size
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= config.vocab_size):
        raise HeadConfigError(
            f"draft_vocab_size must be a whole number from 1 to the vocabulary size {config.vocab_size}, or null; got "
            f"{n!r}"
        )


def _check_acceptance_map(config) -> None:
    weights = config.acceptance_map
    if weights is not None and (len(weights) != 3 or not weights[1] > 0 >= weights[2]):
        raise HeadConfigError(
            f"{type(config).__name__}.acceptance_map must be null or [w0, w1, w2] with w1 > 0 >= w2 (a map "
            f"that grows with the head's probability; scripts/fit_acceptance_map.py fits it), got {weights!r}"
        )


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


HEAD_CONFIGS = {"medusa": MedusaConfig, "eagle": EagleConfig, "early_exit": EarlyExitConfig}


def head_config_from_dict(data: dict[str, Any]):
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in HEAD_CONFIGS:
        raise HeadConfigError(f"head config: 'kind' must be one of {sorted(HEAD_CONFIGS)}, got {kind!r}")
    return dataclass_from_dict(HEAD_CONFIGS[kind], data, f"head config ({kind})")


@dataclass
class TargetFingerprint:
    """What a head checkpoint remembers of the model it was fitted on.

    `weights_sample` holds a few dozen entries of the input embedding and output projection; two models
    match when every entry agrees within a rounding step of bfloat16, so the same weights loaded in float32,
    bfloat16 or float16 match and another model does not. `weights_sha256` hashes more of them, rounded to
    bfloat16: it keys caches (it is exact per dtype), and it is what checkpoints written before
    `weights_sample` existed are matched on.
    """

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    weights_sha256: str
    weights_sample: list[float] | None = None

    def __post_init__(self):
        check_field_types(self)  # a hand-edited config.json is named here, not in a tensor conversion

    @classmethod
    def of(cls, model) -> TargetFingerprint:
        config = model.config
        return cls(
            name=str(getattr(config, "_name_or_path", "") or config.model_type),
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_hidden_layers=config.num_hidden_layers,
            weights_sha256=_weights_hash(model),
            weights_sample=_weights_sample(model),
        )

    def mismatch(self, other: TargetFingerprint) -> str | None:
        """Why `other` is not the model these heads were fitted on, or None when it is."""
        for key in ("hidden_size", "vocab_size"):
            if getattr(self, key) != getattr(other, key):
                return f"{key} differs ({getattr(self, key)} vs {getattr(other, key)})"
        if self.weights_sample is not None and other.weights_sample is not None:
            a, b = (
                torch.tensor(self.weights_sample, dtype=torch.float64),
                torch.tensor(other.weights_sample, dtype=torch.float64),
            )
            if a.shape != b.shape or not bool(
                ((a - b).abs() <= SAMPLE_TOLERANCE * torch.maximum(a.abs(), b.abs()) + 1e-6).all()
            ):
                return "weights_sample differs (the embedding and output weights are another model's)"
            return None
        if self.weights_sha256 != other.weights_sha256:
            return f"weights_sha256 differs ({self.weights_sha256} vs {other.weights_sha256})"
        return None


SAMPLE_TOLERANCE = 2**-7  # bfloat16 rounds to within 2^-8 of a value, float16 to 2^-11; stored to 4 significant digits


@torch.no_grad()
def _weights_sample(model, rows: int = 32) -> list[float]:
    """`rows` entries of each of the input and output embedding matrices: strided rows, a column spread per row."""
    sample = []
    for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        picked = torch.arange(rows, device=matrix.device) * max(1, matrix.shape[0] // rows) % matrix.shape[0]
        columns = torch.arange(rows, device=matrix.device) * 7919 % matrix.shape[1]
        sample += [float(f"{v:.4g}") for v in matrix[picked, columns].float().cpu().tolist()]
    return sample


@torch.no_grad()
def _weights_hash(model, rows: int = 64) -> str:
    digest = hashlib.sha256()
    for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        stride = max(1, matrix.shape[0] // rows)
        sample = matrix[::stride][:rows].detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
