"""One place on disk for what the engine builds once a machine: compiled packages and pass-cost calibrations.

    path = artefact_path("compiled", f"{name}-{artefact_key(weights_digest(model), ...)}.pt2")
    build_once(path, lambda staging: compile_into(staging), what="the target's pass")

An artefact's name holds a key of everything it depends on (VERSION among them), so a changed model, library or
machine finds none and builds its own. `build_once` writes through a staging file renamed into place, under a lock
file that the kernel releases when its holder dies: two processes never build the same artefact at once, a reader
never sees half of one, and a build that was killed leaves nothing that a later one trusts. A build that fails with
a compile error may be recorded (`record_failure`) so that later processes do not spend minutes failing again; an
OSError (a full disk, say) is never recorded: the next process simply tries again.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import sys
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import heads

VERSION = 9  # bump when what an artefact holds changes (a pass's inputs and outputs, what a calibration measures)


def root() -> Path:
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def artefact_path(kind: str, name: str) -> Path:
    return root() / kind / name


def artefact_key(*parts) -> str:
    return hashlib.sha256(json.dumps([VERSION, *parts], default=str).encode()).hexdigest()[:24]


def build_once(path: Path, build: Callable[[Path], None], *, what: str, verbose: bool = False) -> Path:
    """`path`, built by `build(staging)` unless it is there; a process finding another building it waits for that
    build instead of building it too. Raises OSError where the store cannot be written."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if verbose:
                print(f"waiting for another process building {what}...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # built by the process that held the lock
            return path
        for stale in path.parent.glob(f".{path.stem}.*.tmp{path.suffix}"):  # left by a build that was killed
            stale.unlink(missing_ok=True)
        staging = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # AOTInductor wants the suffix
        try:
            build(staging)
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)
    return path


def failure_path(path: Path) -> Path:
    return path.with_name(path.name + ".failed")


def record_failure(path: Path, reason: str) -> None:
    """Remember that building `path` failed with a compile error (deleting the record tries again)."""
    try:
        failure_path(path).write_text(reason)
    except OSError:  # unrecorded, the next process tries again
        pass


def recorded_failure(path: Path) -> str | None:
    try:
        return failure_path(path).read_text().strip()
    except OSError:
        return None


@functools.cache
def code_digest() -> str:
    """A digest of the engine's own source (inference/ and heads/, kernels included): what a calibration's prices
    depend on besides the machine and the model. A step's drafting and bookkeeping cost what this code makes them
    cost, so an engine changed since a calibration measures again instead of pricing its trees by the old costs."""
    return source_digest([Path(__file__).parent, Path(heads.__file__).parent])


def source_digest(packages: list[Path]) -> str:
    """A digest of the Python and C++ sources under `packages`, with their paths."""
    digest = hashlib.sha256()
    for package in packages:
        for source in sorted([*package.rglob("*.py"), *package.rglob("*.cpp")]):
            digest.update(f"{package.name}/{source.relative_to(package)}".encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (its parameters' versions, digest)


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every byte of `module`'s weights and buffers (with their names, shapes and dtypes): what keys an
    artefact built from them. Worked out again only when a parameter changed since (its in-place version counter or
    storage: `.to()` swaps the storage), as every generate() call asks for it."""
    versions = tuple((id(p), p._version, p.data_ptr(), p.dtype) for p in module.parameters())
    known = _DIGESTS.get(module)
    if known is None or known[0] != versions:
        _DIGESTS[module] = known = (versions, _digest(module))
    return known[1]


def _digest(module: torch.nn.Module) -> str:
    tensors = list(module.state_dict().items())

    def one(item) -> bytes:
        name, tensor = item
        digest = hashlib.sha256(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        return digest.digest()

    # hashlib releases the GIL over large buffers: the tensors are hashed on every core
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        return hashlib.sha256(b"".join(pool.map(one, tensors))).hexdigest()
