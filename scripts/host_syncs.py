"""Host synchronisations by source line (gpu_check.py's section 6): on CUDA, set_sync_debug_mode("warn")'s warnings
(recording_syncs); on any device, the reads of tensor values back to Python, each a GPU sync (recording_host_reads)."""

from __future__ import annotations

import functools
import linecache
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import REPO, table

SCRIPTS = Path(__file__).resolve().parent
SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says at every sync
# the calls by which Python reads a tensor's values: on a GPU each waits for the device
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu", "nonzero", "unique"}
HOST_READS |= {"unique_consecutive", "masked_select"}
# the calls that make host values a device tensor: on a GPU, without non_blocking, the host first waits for the device
UPLOADS = {"tensor", "as_tensor", "asarray", "to"}
TORCH_DIR = Path(torch.__file__).resolve().parent


@dataclass
class SyncRecorder:
    """Counts synchronisations by where they come from: the Python line that made the synchronising call, and the
    innermost line of this repository on the way there (outside scripts/)."""

    sources: Counter = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.sources.values())

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING in str(message):  # other warnings are not what is counted
            self.add(filename, lineno, traceback.extract_stack())

    def add(self, filename: str, lineno: int, stack: traceback.StackSummary) -> None:
        """One synchronisation made at filename:lineno, `stack` the frames that led there."""
        ours = (f for f in reversed(stack) if is_ours(f.filename) and Path(f.filename).resolve().parent != SCRIPTS)
        origin = next((f for f in ours if (f.filename, f.lineno) != (filename, lineno)), None)
        via = f"{shown_path(origin.filename)}:{origin.lineno}" if origin is not None and not is_ours(filename) else ""
        self.sources[f"{shown_path(filename)}:{lineno}", via] += 1

    def rows(self, steps: int) -> str:
        """A table of where the synchronisations came from, most frequent first."""
        rows = [
            [count, f"{count / steps:.2f}", f"`{location}`", f"`{source_text(location)}`", via and f"`{via}`"]
            for (location, via), count in self.sources.most_common()
        ]
        return table(["synchronisations", "per decode step", "line", "code", "reached from"], rows)


def is_upload(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call copies host values to a device synchronously (inference.transfer.to_device does not): a tensor
    made from values with a device named, or `.to(device)` without non_blocking."""
    if name not in UPLOADS or kwargs.get("non_blocking"):
        return False
    positional = name == "to" and any(isinstance(arg, (torch.device, str)) for arg in args[1:])  # .to("cuda")
    return kwargs.get("device") is not None or positional


class HostReadRecorder(torch.overrides.TorchFunctionMode):
    """Counts, on any device, the calls that read a tensor's values back to Python (HOST_READS, a boolean mask as an
    index) and, from this repository's code, synchronous copies to a device (is_upload), into a SyncRecorder."""

    def __init__(self, recorder: SyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name == "__getitem__" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for index in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        upload = is_upload(name, args, kwargs or {})
        if name in HOST_READS or masked or upload:
            stack = traceback.extract_stack()[:-1]
            outside = (f for f in reversed(stack) if not Path(f.filename).resolve().is_relative_to(TORCH_DIR))
            caller = next(outside, stack[-1])  # the innermost frame outside torch
            # ours only: on the CPU a library's .to(device) of a device tensor looks like an upload (a GPU sees all)
            if not upload or is_ours(caller.filename):
                self.recorder.add(caller.filename, caller.lineno, stack)
        return func(*args, **(kwargs or {}))


@functools.cache
def is_ours(filename: str) -> bool:
    """A file of this repository (not "<frozen ...>" or "<string>", which would resolve into the working folder, nor
    a package installed in a virtual environment inside it)."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return path.is_relative_to(REPO) and "site-packages" not in path.parts


def shown_path(filename: str) -> str:
    """A path as the report shows it: relative to the repository, or from site-packages on."""
    if is_ours(filename):
        return str(Path(filename).resolve().relative_to(REPO))
    return filename.split("site-packages/", 1)[-1]


def source_text(location: str) -> str:
    """The code at `path:line`, as a table cell's code span quotes it."""
    path, _, line = location.rpartition(":")
    for candidate in [REPO / path, *(Path(p) / path for p in sys.path if p)]:
        text = linecache.getline(str(candidate), int(line)).strip()
        if text:
            return text.replace("|", "\\|").replace("`", "'")
    return ""


@contextmanager
def recorded_warnings(recorder: SyncRecorder) -> Iterator[SyncRecorder]:
    """Every warning raised inside goes to `recorder` (which keeps the sync warnings), each time it is raised."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")  # every sync, not only the first from each line
        # catch_warnings restores showwarning on the way out; a recorded WarningMessage would lack the stack
        warnings.showwarning = recorder.showwarning
        yield recorder


@contextmanager
def recording_syncs() -> Iterator[SyncRecorder]:
    """Every host synchronisation of the CUDA calls inside, recorded with its source line."""
    with recorded_warnings(SyncRecorder()) as recorder:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield recorder
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextmanager
def recording_host_reads() -> Iterator[SyncRecorder]:
    """Every read of a tensor's values back to Python inside (HostReadRecorder), recorded with its source line."""
    recorder = SyncRecorder()
    with HostReadRecorder(recorder):
        yield recorder
