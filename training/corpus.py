"""A self-distilled corpus on disk: `corpus.json` (what shaped the answers) and `shard-NNNNN.jsonl.gz` records
{id, source, turn, follow_up, prompt_ids, answer_ids}. Written by training/distill.py, read by training/data.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from heads.config import TargetFingerprint
from heads.files import written_atomically

from .config import ConfigError

MANIFEST_KEYS = ("dtype", "max_new_tokens", "decoding", "chat_template_sha256", "prompts", "follow_ups")
LATER_KEYS = (
    "self_prompting",
)  # settings added after corpora were written: an older corpus.json records them on first use


def check_manifest(directory: Path, expected: dict) -> None:
    """Writes corpus.json into a new corpus; refuses to add answers made another way to an existing one."""
    path = directory / "corpus.json"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        with written_atomically(path) as staging:
            staging.write_text(json.dumps(expected, indent=1) + "\n")
        return
    found = json.loads(path.read_text())
    mismatch = TargetFingerprint(**found["target"]).mismatch(TargetFingerprint(**expected["target"]))
    if mismatch:
        raise ConfigError(f"{directory} holds answers of another model ({mismatch}); set corpus_root to another folder")
    for key in MANIFEST_KEYS + tuple(k for k in LATER_KEYS if k in found):
        if found.get(key) != expected[key]:
            raise ConfigError(
                f"{directory} was written with {key}={found.get(key)!r}, this run would use {expected[key]!r}; "
                "answers made differently do not mix: set corpus_root to another folder or the setting back"
            )
    if any(key not in found for key in LATER_KEYS):
        with written_atomically(path) as staging:
            staging.write_text(
                json.dumps({**found, **{k: expected[k] for k in LATER_KEYS if k not in found}}, indent=1) + "\n"
            )


def read_corpus(directory: str | Path) -> list[dict]:
    """Every record of a corpus folder, in shard order."""
    return [record for path in sorted(Path(directory).glob("shard-*.jsonl.gz")) for record in read_corpus_shard(path)]


def read_corpus_shard(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def write_shard(path: Path, records: list[dict]) -> None:
    with written_atomically(path) as staging:  # a shard is either complete or absent
        with (
            open(staging, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed,
        ):  # same answers, same bytes
            packed.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())


def corpus_records(directory: str | Path, target) -> list[dict]:
    """A corpus's records for training `target`'s heads; refused when they are another model's answers."""
    manifest = Path(directory) / "corpus.json"
    if not manifest.is_file():
        raise ConfigError(
            f"data.corpus {directory} is not a distilled corpus (no corpus.json); write one with `python -m "
            "training.distill`"
        )
    mismatch = TargetFingerprint(**json.loads(manifest.read_text())["target"]).mismatch(TargetFingerprint.of(target))
    if mismatch:
        raise ConfigError(
            f"data.corpus {directory} holds another model's answers ({mismatch}); distill a corpus for this target"
        )
    records = read_corpus(directory)
    if not records:
        raise ConfigError(
            f"data.corpus {directory} holds no answers yet; write some with `python -m training.distill --answers N`"
        )
    return records
