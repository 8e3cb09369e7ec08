"""A compiled package's weights, and the KV caches' buffers, in 2 MiB pages (Linux's transparent huge pages).

A decoding pass reads every weight once: about 310 MB for SmolLM2-135M's bfloat16 package, some 76,000 pages of 4 KiB,
each a miss in the CPU's TLB. Where transparent huge pages are left to the process (`madvise`, the usual default), the
memory a package's loading maps is marked for them and, on a kernel of 6.1 or later, collapsed into them at once
(MADV_COLLAPSE, once a process, as the package loads); earlier kernels collapse it in the background (khugepaged). A KV
cache's buffers are asked for huge pages before they are written, so they fault in 2 MiB at a time: attention over a
long prompt reads every layer's entries each pass. Measured: docs/experiments.md, row X30.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from pathlib import Path

import torch

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE_PAGE = 1 << 21
MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Whether this process may ask for huge pages: Linux, with transparent huge pages not turned off."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return "[never]" not in MODE.read_text()
    except OSError:
        return False


def anonymous_mappings() -> dict[int, int]:
    """This process's private writable mappings that no file backs: start -> end."""
    mappings = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 5 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            mappings[start] = end
    return mappings


@functools.cache
def _libc_madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _madvise(start: int, end: int, advice: int) -> int:
    """madvise over the whole 2 MiB pages within [start, end): the bytes it applied to (0 where it failed)."""
    start, end = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return 0
    return end - start if _libc_madvise()(start, end - start, advice) == 0 else 0


def collapse(start: int, end: int) -> int:
    """Ask for huge pages over the whole 2 MiB pages within [start, end) and collapse them now; returns the bytes
    collapsed (0 where the kernel leaves them to khugepaged)."""
    return _madvise(start, end, MADV_COLLAPSE) if _madvise(start, end, MADV_HUGEPAGE) else 0


def for_tensor(tensor: torch.Tensor) -> None:
    """Ask for huge pages under a CPU tensor not written yet (new_empty: a KV cache's buffers), where available():
    its pages then fault in 2 MiB at a time, at no cost beyond the zeroing a page gets anyway."""
    if tensor.device.type == "cpu" and tensor.nbytes >= 2 * HUGE_PAGE and available():
        _madvise(tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, MADV_HUGEPAGE)


@contextlib.contextmanager
def for_new_mappings(minimum: int = 2 * HUGE_PAGE):
    """The anonymous mappings of at least `minimum` bytes that the block maps (a package's constants, as it loads) in
    huge pages where available(); elsewhere the block runs as it is."""
    if not available():
        yield
        return
    before = anonymous_mappings()
    yield
    for start, end in anonymous_mappings().items():
        if end - start >= minimum and before.get(start) != end:
            collapse(start, end)
