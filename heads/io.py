"""Head checkpoints: `config.json` + `model.safetensors`, written atomically and validated on load."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import (
    EarlyExitConfig,
    HeadConfigError,
    MedusaConfig,
    TargetFingerprint,
    check_feature_layers,
    dataclass_from_dict,
    head_config_from_dict,
)
from .eagle import EagleHead
from .early_exit import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EarlyExitHead
from .files import FORMAT_VERSION, check_output_dir, read_checkpoint_config
from .formats import detect_format, load_foreign
from .medusa import MedusaHeads


def non_finite_parameters(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors in `state` holding NaN or infinity."""
    return [
        name for name, tensor in state.items() if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]


def build_heads(config, target=None) -> MedusaHeads | EagleHead | EarlyExitHead:
    """Fresh heads for `config`; an early-exit head drafts with `target`'s own layers, so it needs the target."""
    if isinstance(config, MedusaConfig):
        return MedusaHeads(config)
    if isinstance(config, EarlyExitConfig):
        if target is None:
            raise HeadConfigError("an early-exit head is built on its target's own layers: build_heads(config, target)")
        return EarlyExitHead(config, target)
    return EagleHead(config)


def save_heads(
    heads: MedusaHeads | EagleHead | EarlyExitHead,
    path: str | os.PathLike,
    target,
    *,
    training: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `heads` to directory `path`; a crash mid-write leaves any previous checkpoint there intact.

    `path` must be new, empty, or a head checkpoint (check_output_dir): nothing else is ever replaced. Heads
    with non-finite weights (a diverged training run) are refused: they would draft nothing useful.
    """
    path = check_output_dir(path)
    config = {
        "format_version": FORMAT_VERSION,
        "head": dataclasses.asdict(heads.config),
        "target": dataclasses.asdict(TargetFingerprint.of(target)),
        "training": training,
    }
    state = {  # weights in `dtype`; the draft vocabulary's token ids stay integers
        name: tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        for name, tensor in heads.state_dict().items()
        if not name.startswith("adapter.")  # an early-exit head's adapter goes to peft's own files
    }
    broken = non_finite_parameters(heads.state_dict())
    if broken:
        named = ", ".join(broken[:3]) + (", ..." if len(broken) > 3 else "")
        raise HeadConfigError(f"refusing to save heads with NaN or infinite weights ({named}): training diverged")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; a checkpoint is an ordinary directory
    try:
        save_file(state, staging / "model.safetensors")
        if isinstance(heads, EarlyExitHead):
            heads.save_adapter(staging, dtype)
            if (staging / ADAPTER_WEIGHTS).exists():
                os.chmod(staging / ADAPTER_WEIGHTS, 0o666 & ~_umask())
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(staging / "model.safetensors", 0o666 & ~_umask())  # safetensors writes it private
        if path.exists():  # swap: the old checkpoint is removed only once the new one is complete
            retired = path.with_name(f".{path.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(path, retired)
            os.replace(staging, path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def load_heads(path: str | os.PathLike, target) -> MedusaHeads | EagleHead | EarlyExitHead:
    """Load heads from `path` for `target`, refusing a checkpoint fitted on another model.

    `path` holds heads saved by this project, or a published head (EAGLE-1/2, EAGLE-3 from SafeAILab or
    SpecForge, speculators, Medusa: heads.formats), recognised from its files."""
    path = Path(path)
    if (path / "config.json").is_file():
        fmt = detect_format(path)
        if fmt != "ours":
            return load_foreign(path, target, fmt)
    config = read_checkpoint_config(path)
    head_config = head_config_from_dict(config["head"])
    trained_on = dataclass_from_dict(TargetFingerprint, config["target"], f"{path}/config.json 'target'")
    reason = trained_on.mismatch(TargetFingerprint.of(target))
    if reason:
        raise HeadConfigError(
            f"heads at {path} were trained for {trained_on.name!r} ({trained_on.model_type}, hidden "
            f"{trained_on.hidden_size}, vocab {trained_on.vocab_size}) but the target is "
            f"{getattr(target.config, '_name_or_path', '') or target.config.model_type!r}: {reason}. "
            "Load the base model these heads were trained on, or train heads for this one."
        )
    check_feature_layers(head_config, target.config, f"the head at {path}")
    try:
        state = load_file(path / "model.safetensors")
    except (SafetensorError, FileNotFoundError, OSError) as error:
        raise HeadConfigError(
            f"{path}/model.safetensors cannot be read ({error}): the checkpoint is missing, corrupted or half-written. "
            "Re-save or re-download it."
        ) from None
    broken = non_finite_parameters(state)
    if broken:
        raise HeadConfigError(
            f"{path}/model.safetensors holds NaN or infinite weights "
            f"({', '.join(broken[:3])}{', ...' if len(broken) > 3 else ''}): the training run that wrote it diverged. "
            "Train again (a lower learning_rate) or use another checkpoint."
        )
    heads = build_heads(head_config, target)
    try:
        if isinstance(heads, EarlyExitHead):
            heads.load_state_dict({**heads.state_dict(), **state})  # the adapter's entries are read just below
            if heads.lora is not None:
                heads.load_adapter(path, _read_adapter(path))
        else:
            heads.load_state_dict(state)
    except RuntimeError as error:
        raise HeadConfigError(f"{path}/model.safetensors does not match its config.json: {error}") from None
    parameter = next(target.parameters())
    return heads.to(device=parameter.device, dtype=parameter.dtype).eval()


def _read_adapter(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = load_file(path / ADAPTER_WEIGHTS)
    except (SafetensorError, FileNotFoundError, OSError) as error:
        raise HeadConfigError(
            f"{path}/{ADAPTER_WEIGHTS} cannot be read ({error}): the early-exit adapter is missing or corrupted"
        ) from None
    if not (path / ADAPTER_CONFIG).is_file():
        raise HeadConfigError(f"{path}/{ADAPTER_CONFIG} is missing: the early-exit adapter is incomplete")
    broken = non_finite_parameters(state)
    if broken:
        raise HeadConfigError(
            f"{path}/{ADAPTER_WEIGHTS} holds NaN or infinite weights ({', '.join(broken[:3])}): the training run that "
            "wrote it diverged"
        )
    return state
