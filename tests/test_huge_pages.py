"""inference.huge_pages: what a block maps goes into 2 MiB pages, what was mapped before it is left alone."""

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
SIZE = 64 << 20  # above any allocator's threshold: a mapping of its own


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
        small = torch.ones(2 << 20, dtype=torch.uint8)  # under the minimum (two huge pages): not collapsed either
    assert huge_bytes_under(weights) == 0
    assert huge_bytes_under(small) == 0
