"""The frozen target's hidden states for every training sequence, computed once and kept on disk.

Recomputing them every step costs about half of an EAGLE step on a small target (a target forward over the batch). A
recipe that trains for several epochs sets `cache_features: true` and pays for them once. Shards are written atomically,
each with its sha256 beside it, so an interrupted run resumes at the shard it stopped in, and a rerun with the same
target, data, layers and dtype reuses them after checking each against its digest (one that does not match, or has none,
is computed again). A shard checked once is not read again while its size and modification time stay those it had then
(`.checked` beside it; delete those files to check every shard again), so a restart does not hash a whole corpus's
features again (docs/training.md). They are stored in the target's dtype: a cached feature is exactly the one the loop
would have computed. Training reads them memory-mapped, so a corpus whose features exceed the machine's memory trains as
well as a small one. Features of the same target, rows and dtype at more layers serve a recipe that needs fewer
(`find_features`): an EAGLE recipe's extraction also trains Medusa heads on the same data.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from heads.files import written_atomically

from .data import collate
from .losses import target_features

SHARD_SEQUENCES = 256
ABOUT = "features.json"  # in each features directory: its layers and the digest of its target, rows and dtype


class FeatureStore:
    """Every sequence's hidden states, read from the memory-mapped shards on demand: a corpus whose features
    exceed the machine's memory trains as well as a small one (the page cache keeps what fits)."""

    def __init__(self, shards: list[Path], lengths: list[int], layers=None):
        self.files = [safe_open(str(path), framework="pt") for path in shards]
        self.where = []  # row -> (shard, first token, last token + 1) within that shard
        for number in range(len(shards)):
            offset = 0
            for n in lengths[number * SHARD_SEQUENCES : (number + 1) * SHARD_SEQUENCES]:
                self.where.append((number, offset, offset + n))
                offset += n
        held = [int(name.removeprefix("layer")) for name in self.files[0].keys()] if self.files else []
        self.layers = held if layers is None else [layer for layer in held if layer in set(layers) | {-1}]
        self.nbytes = sum(path.stat().st_size for path in shards)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> dict[int, torch.Tensor]:
        shard, start, end = self.where[i]
        return {layer: self.files[shard].get_slice(f"layer{layer}")[start:end] for layer in self.layers}


class WithFeatures(Dataset):
    """Training rows with their cached features under "features" (collate pads them with the rows)."""

    def __init__(self, rows, store: FeatureStore):
        if len(rows) != len(store):
            raise ValueError(f"{len(rows)} rows but features for {len(store)}")
        self.rows, self.store = rows, store

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {**self.rows[i], "features": self.store[i]}


def features_key(fingerprint: str, rows, layers, dtype) -> tuple[str, str]:
    """The name of the features of `rows` at `layers`, and the digest of their target, rows and dtype alone."""
    named = hashlib.sha256(repr((fingerprint, sorted(set(layers) | {-1}), str(dtype))).encode())
    content = hashlib.sha256(repr((fingerprint, str(dtype))).encode())
    for ids in rows["input_ids"]:
        text = repr(ids).encode()
        named.update(text)
        content.update(text)
    return named.hexdigest()[:16], content.hexdigest()


def find_features(cache_dir: Path, fingerprint: str, rows, layers, dtype) -> tuple[Path, list[int]]:
    """Where the features of `rows` at `layers` are kept, and the layers kept there: their own directory, unless
    it is absent and another holds the same target's features of the same rows in the same dtype at more layers."""
    name, content = features_key(fingerprint, rows, layers, dtype)
    wanted = sorted(set(layers) | {-1})
    own = cache_dir / f"features-{name}"
    if not own.exists():
        for about in sorted(cache_dir.glob(f"features-*/{ABOUT}")):
            try:
                held = json.loads(about.read_text())
                same, layers = held["content"] == content, [int(layer) for layer in held["layers"]]
            except (ValueError, KeyError, TypeError) as error:
                warnings.warn(f"{about} is unreadable ({error!r}): the features there are not reused", stacklevel=2)
                continue
            if same and set(wanted) <= set(layers):
                return about.parent, layers
    own.mkdir(parents=True, exist_ok=True)
    with written_atomically(own / ABOUT) as staging:  # several processes may write it: each writes it whole
        staging.write_text(json.dumps({"layers": wanted, "content": content}))
    return own, wanted


@torch.no_grad()
def cache_features(
    target, rows, layers, directory: Path, batch_size: int = 8, is_main: bool = True, serve=None
) -> FeatureStore:
    """Hidden states at `layers` (and -1) of every row of `rows`, computed in shards under `directory`; the store
    serves those at `serve` (and -1) alone where given."""
    directory.mkdir(parents=True, exist_ok=True)
    kept = sorted(set(layers) | {-1})
    lengths = [len(ids) for ids in rows["input_ids"]]
    starts = range(0, len(lengths), SHARD_SEQUENCES)
    device = next(target.parameters()).device
    pad = collate(pad_id=0)  # padded positions are masked out and never kept
    shards = []
    for number, start in enumerate(tqdm(starts, desc="caching features", disable=not is_main)):
        path = directory / f"shard-{number:05d}.safetensors"
        indices = list(range(start, min(start + SHARD_SEQUENCES, len(lengths))))
        if is_main and not intact(path):
            per_row: dict[int, list[torch.Tensor]] = {layer: [None] * len(indices) for layer in kept}
            by_length = sorted(range(len(indices)), key=lambda j: lengths[indices[j]])  # little padding per batch
            for b in range(0, len(by_length), batch_size):
                chosen = by_length[b : b + batch_size]
                batch = pad([rows[indices[j]] for j in chosen])
                hidden = target_features(
                    target, batch["input_ids"].to(device), batch["attention_mask"].to(device), tuple(kept), dtype=None
                )
                for r, j in enumerate(chosen):
                    for layer in kept:
                        per_row[layer][j] = hidden[layer][r, : lengths[indices[j]]].cpu()
            with written_atomically(path) as staging:  # a shard is either complete or absent
                save_file({f"layer{layer}": torch.cat(per_row[layer]).contiguous() for layer in kept}, str(staging))
            digest = file_digest(path)
            with written_atomically(digest_path(path)) as staging:  # after the shard: a digest names a whole one
                staging.write_text(digest)
            mark_checked(path, digest)
        shards.append(path)
    return FeatureStore(shards, lengths, serve)


def digest_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".sha256")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def checked_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".checked")


def checked_stamp(shard: Path, digest: str) -> str:
    """What `checked_path` holds once `shard` matched `digest`: the digest, the shard's size and modification time."""
    status = shard.stat()
    return f"{digest} {status.st_size} {status.st_mtime_ns}"


def mark_checked(shard: Path, digest: str) -> None:
    with written_atomically(checked_path(shard)) as staging:
        staging.write_text(checked_stamp(shard, digest))


def intact(shard: Path) -> bool:
    """Whether `shard` is there and matches the digest written beside it (else it is computed again): hashed once,
    then trusted while its size and modification time are those it had when it matched (`checked_path`)."""
    if not shard.is_file():
        return False
    try:
        expected = digest_path(shard).read_text().strip()
    except OSError:
        expected = None
    try:
        if expected is not None and checked_path(shard).read_text() == checked_stamp(shard, expected):
            return True
    except OSError:
        pass  # never checked: hash it
    if expected == file_digest(shard):
        mark_checked(shard, expected)
        return True
    warnings.warn(f"{shard} does not match its sha256 (or has none): computing it again", stacklevel=3)
    return False
