"""A head checkpoint folder on disk (`config.json` + `model.safetensors`): written atomically, refused when writing it
would destroy what this project did not write, its config read and checked. No model code: heads.io and
heads.formats both build on it."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import HeadConfigError
from .early_exit import ADAPTER_CONFIG, ADAPTER_WEIGHTS

FORMAT_VERSION = 1
CHECKPOINT_KEYS = {"format_version", "head", "target", "training"}
CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
}  # the adapter: early-exit heads


@contextmanager
def written_atomically(path: str | os.PathLike):
    """Yield a staging path beside `path` (a file or a folder to write); when the block succeeds it becomes
    `path` in one rename, when it fails it is removed: a reader finds the old content or the new, never half."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield staging
        os.replace(staging, path)
    finally:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        else:
            staging.unlink(missing_ok=True)


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The nearest existing path among `path` and its parents when it is not a folder (so no folder can be made
    at `path`), else None."""
    path = Path(path)
    existing = next((p for p in [path, *path.parents] if p.exists() or p.is_symlink()), None)
    return existing if existing is not None and not existing.is_dir() else None


def check_output_dir(path: str | os.PathLike) -> Path:
    """Refuse to write heads where that would delete or overwrite what this project did not write.

    `path` may be new, an empty folder, or a head checkpoint of ours (config.json + model.safetensors and
    nothing else), which is replaced atomically. Whatever is in the way of creating it is named.
    """
    path = Path(path)
    blocking = file_in_the_way(path)
    if blocking == path:
        raise HeadConfigError(
            f"cannot write heads to {path}: a file of that name exists; choose another output_dir or move the file away"
        )
    if blocking is not None:
        raise HeadConfigError(
            f"cannot write heads to {path}: {blocking} is a file, not a folder; choose another output_dir"
        )
    if path.is_dir():
        entries = {entry.name for entry in path.iterdir()}
        foreign = sorted(entries - CHECKPOINT_FILES)
        if foreign or (entries and "config.json" not in entries):
            shown = ", ".join(foreign[:5] or sorted(entries)) + (", ..." if len(foreign) > 5 else "")
            raise HeadConfigError(
                f"cannot write heads to {path}: it holds files that are not a head checkpoint ({shown}), which "
                "writing would delete; choose a new or empty output_dir"
            )
        if entries:
            try:
                read_checkpoint_config(path)
            except HeadConfigError as error:
                raise HeadConfigError(
                    f"cannot write heads to {path}: it is not a head checkpoint of this project ({error}); choose a "
                    "new or empty output_dir"
                ) from None
    return path


def read_checkpoint_config(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HeadConfigError(f"{path} is not a head checkpoint: {config_file} is missing")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise HeadConfigError(
            f"{config_file} is not valid JSON ({error}); the checkpoint is corrupted or half-written"
        ) from None
    if not isinstance(config, dict) or "head" not in config or "target" not in config:
        raise HeadConfigError(
            f"{config_file} lacks 'head' and 'target' sections: not a head checkpoint of this project"
        )
    unknown = sorted(set(config) - CHECKPOINT_KEYS)
    if unknown:
        raise HeadConfigError(f"{config_file}: unknown key(s) {unknown}; allowed keys are {sorted(CHECKPOINT_KEYS)}")
    if config.get("format_version") != FORMAT_VERSION:
        raise HeadConfigError(f"{config_file}: format_version {config.get('format_version')!r} is not {FORMAT_VERSION}")
    return config
