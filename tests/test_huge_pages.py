"""inference.huge_pages: what a block maps goes into 2 MiB pages, what was mapped before it is left alone; a tensor
asked for before it is written faults in 2 MiB pages."""

import platform
from pathlib import Path

import pytest
import torch

from inference import huge_pages

KERNEL = tuple(int(part) for part in platform.release().split("-")[0].split(".")[:2] if part.isdigit())
pytestmark = pytest.mark.skipif(
    not huge_pages.available() or KERNEL < (6, 1),
    reason="needs Linux 6.1 or later (MADV_COLLAPSE) with transparent huge pages not turned off",
)
SIZE = 64 << 20  # above glibc's largest mmap threshold (32 MiB): a mapping of its own


def huge_bytes_under(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings of this process that hold `tensor`'s bytes (asking for huge pages over the
    whole 2 MiB pages of a mapping splits it in up to three)."""
    low, high = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start < high and low < end
        elif inside and fields[0] == "AnonHugePages:":
            total += int(fields[1]) << 10
    return total


def test_what_the_block_maps_goes_into_huge_pages():
    with huge_pages.for_new_mappings():
        weights = torch.ones(SIZE, dtype=torch.uint8)
    assert huge_bytes_under(weights) >= SIZE - 2 * huge_pages.HUGE_PAGE


def test_what_was_mapped_before_the_block_is_left_alone():
    weights = torch.ones(SIZE, dtype=torch.uint8)
    with huge_pages.for_new_mappings():
        pass
    assert huge_bytes_under(weights) == 0


def test_a_tensor_asked_for_before_it_is_written_faults_in_huge_pages():
    buffer = torch.empty(SIZE, dtype=torch.uint8)
    huge_pages.for_tensor(buffer)
    buffer.fill_(1)
    assert huge_bytes_under(buffer) >= SIZE - 2 * huge_pages.HUGE_PAGE
    untouched = torch.empty(SIZE, dtype=torch.uint8).fill_(1)  # not asked for: small pages
    assert huge_bytes_under(untouched) == 0
