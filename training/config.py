"""The training recipe: typed dataclasses read from YAML, overridden from the command line.

Unknown keys are errors everywhere (a typo must not silently train with a default), and the whole resolved
recipe is saved into the head checkpoint's config.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import inference.target
from heads.config import HeadConfigError, dataclass_from_dict

DEFAULT_PROMPTS = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "prompts.jsonl")


class ConfigError(HeadConfigError):
    """A training recipe that cannot be used as written."""


def check_numbers(config) -> None:
    """Numbers must be numbers; YAML reads '3e-4' (no dot) as a string, so such strings are converted."""
    for f in dataclasses.fields(config):
        kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type))
        value = getattr(config, f.name)
        if kind is None or value is None:
            continue
        if isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
            raise ConfigError(f"{f.name} must be a number ({kind.__name__}), got {getattr(config, f.name)!r}")
        setattr(config, f.name, kind(value))


@dataclass
class DataConfig:
    path: str = DEFAULT_PROMPTS  # a local .jsonl / .json / .parquet file, or a hub dataset name
    split: str = "train"
    corpus: str | None = None  # a self-distilled corpus folder (python -m training.distill); all of it is used
    corpus_answers: int | None = None  # use only the corpus's first N answers (a balanced prefix); None = all
    corpus_per_source: int | None = None  # then at most N answers of each prompt source (in corpus order); None = all
    id_field: str = "id"  # the prompts' id: prompts the corpus answered are not used again with the dataset's answer
    prompt_field: str = "prompt"  # a user message ...
    messages_field: str | None = None  # ... or a whole conversation [{"role", "content"}, ...]
    response_field: str | None = "response"  # the dataset's own answer, used as fixed text when present
    dataset_responses: int | None = (
        None  # use at most N of those answers (seeded order, balanced with balance_field); None = all
    )
    max_prompts: int | None = None  # use the first N prompts (after the held-out ones)
    balance_field: str | None = None  # e.g. "source": take prompts round-robin across its values, not in proportion
    eval_prompts: int = 64  # held out: the corpus's first N first turns (balanced), or the file's first N prompts
    max_length: int = 512  # tokens per training sequence, prompt included
    # whole conversations placed one after another into training sequences of up to this many tokens (null: one
    # conversation a sequence): long inputs teach the head positions and feature histories of that length
    pack_length: int | None = None
    exclude_sources: list[str] = field(default_factory=list)  # prompt sources left out of training (a held-out check)
    cache_dir: str = "outputs/cache"  # tokenized data and cached features, reused by reruns

    def __post_init__(self):
        check_numbers(self)
        for name in ("corpus_answers", "corpus_per_source"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be >= 1 (or null for all), got {getattr(self, name)}")
        if self.pack_length is not None and self.pack_length < self.max_length:
            raise ConfigError(
                f"data.pack_length ({self.pack_length}) must be at least data.max_length ({self.max_length}), the "
                "length of one conversation; raise it, or set it to null to train on one conversation a sequence"
            )
        if not isinstance(self.exclude_sources, list) or not all(isinstance(s, str) for s in self.exclude_sources):
            raise ConfigError(f"data.exclude_sources must be a list of source names, got {self.exclude_sources!r}")


@dataclass
class TrainConfig:
    head: dict[str, Any] = field(
        default_factory=lambda: {"kind": "eagle"}
    )  # kind (medusa | eagle | early_exit) + options of heads.*Config
    model: str | None = None  # hub id or directory; None = the embedded SmolLM2-135M-Instruct
    target_dtype: str = (
        "float32"  # the frozen target's dtype (features, self-distillation); auto: bfloat16 where faster
    )
    data: DataConfig = field(default_factory=DataConfig)
    output_dir: str = "outputs/heads"  # the trained heads (config.json + model.safetensors)
    init_from: str | None = None  # a head checkpoint to start from (its weights and draft vocabulary); see warm_start
    state_dir: str | None = None  # resumable training checkpoints; default <output_dir>.train-state
    seed: int = 0
    max_steps: int = 1000  # optimizer steps
    max_minutes: float | None = None  # stop (and save) after this much training time
    batch_size: int = 8  # sequences per device per micro-step
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    lr_schedule: str = "cosine"  # cosine | linear | constant
    max_grad_norm: float = 1.0
    group_by_length: bool = True  # batches of similar length (transformers' LengthGroupedSampler): less padding
    cache_features: bool = (
        False  # compute the target's hidden states once, on disk (training/features.py), not every step
    )
    mixed_precision: str = "no"  # no | bf16 | fp16 (as accelerate takes it) | auto: bf16 where faster
    eval_every: int = 200
    save_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10
    report_to: str = "none"  # none | wandb | tensorboard | all
    # objectives
    medusa_decay: float = 0.8  # weight of head k is decay ** k
    medusa_soft_labels: bool = False  # cross-entropy against the target's distribution for each label, not its token
    eagle_regression_weight: float = 1.0  # SmoothL1 of the predicted feature against the target's last hidden state
    eagle_ce_weight: float = 0.1  # soft cross-entropy against the target's own distribution
    eagle_noise: float = 0.2  # uniform feature noise, +-noise/2 (EAGLE's augmentation)
    eagle_unroll: int = 1  # EAGLE-3 training-time test: also train on the head's own fed-back features
    early_exit_soft_labels: bool = (
        True  # against the target's distribution (a pass of the whole target a step), not the text's next token
    )
    loss_tokens: int = 1024  # positions per micro-batch that go through the vocabulary projection

    def __post_init__(self):
        check_numbers(self)
        if isinstance(self.data, dict):
            self.data = dataclass_from_dict(DataConfig, self.data, "data")
        if isinstance(self.head, dict):
            self.head = {"kind": "eagle", **self.head}  # the default kind, as the field's default says
        if not isinstance(self.head, dict) or self.head.get("kind") not in ("medusa", "eagle", "early_exit"):
            raise ConfigError(f"head must be a mapping with kind 'medusa', 'eagle' or 'early_exit', got {self.head!r}")
        if self.head.get("architecture") == "eagle3" and self.eagle_regression_weight:
            raise ConfigError(
                "head.architecture eagle3 predicts no target feature to regress on (its output feeds its own norm and "
                "lm_head, as EAGLE-3's does): set eagle_regression_weight: 0"
            )
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(f"lr_schedule must be cosine, linear or constant, got {self.lr_schedule!r}")
        if self.mixed_precision is False:  # YAML 1.1 reads the bare word `no` (this field's default) as false
            self.mixed_precision = "no"
        if self.mixed_precision not in ("no", "bf16", "fp16", "auto"):
            raise ConfigError(f"mixed_precision must be no, bf16, fp16 or auto, got {self.mixed_precision!r}")
        if self.target_dtype not in inference.target.DTYPES and self.target_dtype != "auto":
            raise ConfigError(
                f"target_dtype must be one of {sorted(inference.target.DTYPES)} or auto, got {self.target_dtype!r}"
            )
        if self.report_to not in ("none", "wandb", "tensorboard", "all"):
            raise ConfigError(f"report_to must be none, wandb, tensorboard or all, got {self.report_to!r}")
        for name in ("cache_features", "group_by_length", "medusa_soft_labels", "early_exit_soft_labels"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        # keep_checkpoints too: the pruning keeps the newest N, and N < 1 would delete each checkpoint as it is written
        for name in (
            "max_steps",
            "batch_size",
            "gradient_accumulation_steps",
            "eval_every",
            "save_every",
            "keep_checkpoints",
            "eagle_unroll",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    def resolve_auto_precision(self, device_type: str) -> None:
        """`auto` becomes bfloat16 where this device computes it clearly faster than float32 (a CPU with AVX512-BF16 or
        AMX, most GPUs), float32 elsewhere: emulated on a CPU with AVX2 alone, bfloat16 costs 1.7-5x. Resolved
        once, so the checkpoint's config.json records what was used."""
        fast = inference.target.bfloat16_is_faster(device_type)
        if self.target_dtype == "auto":
            self.target_dtype = "bfloat16" if fast else "float32"
        if self.mixed_precision == "auto":
            self.mixed_precision = "bf16" if fast else "no"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """A recipe from YAML (or the defaults), with `--key value` / `--data.key value` overrides applied."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of settings at the top level")
    for key, value in parse_overrides(overrides):
        target = values
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--{key}: {parent} is not a section")
        target[leaf] = value
    return dataclass_from_dict(TrainConfig, values, str(path or "config"))


def parse_overrides(arguments: list[str]) -> list[tuple[str, Any]]:
    """['--lr', '1e-3', '--data.path', 'x.jsonl'] -> [('lr', 0.001), ('data.path', 'x.jsonl')]."""
    pairs, items = [], list(arguments)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--") or not items or items[0].startswith("--"):
            raise ConfigError(f"overrides take the form --key value; could not read {flag!r}")
        pairs.append((flag[2:].replace("-", "_"), yaml.safe_load(items.pop(0))))
    return pairs
